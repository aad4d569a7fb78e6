"""The gated delta rule (Gated DeltaNet): chunked and step-by-step forms."""

from pallasite.kernels.gated_delta.api import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    gated_delta_rule_step,
)

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
           "gated_delta_rule_step"]
