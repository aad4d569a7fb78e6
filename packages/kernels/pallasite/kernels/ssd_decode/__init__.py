"""The Mamba-2 decode step, `selective_state_update`: the Pallas Triton kernel and the XLA
fallback. See docs/ssd.md, "Decoding"."""

from pallasite.kernels.ssd_decode.api import selective_state_update

__all__ = ["selective_state_update"]
