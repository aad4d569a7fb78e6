"""grouped_mlp: a mixture-of-experts layer's whole expert MLP (gate-up, activation, down,
routing weights) over sorted rows."""

from pallasite.kernels.expert_mlp.api import grouped_mlp

__all__ = ["grouped_mlp"]
