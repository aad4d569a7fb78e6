"""The decode step in plain JAX: the oracle's step (pallasite.reference.
ssd_decode.on_slots) on the gathered rows, scattered back into the cache. The
fallback wherever the Triton kernel does not run (CPU, TPU, GPUs before sm80). XLA updates
the cache in place when it is donated; otherwise it copies it once, as any functional
update does."""

from __future__ import annotations

from pallasite.reference.ssd_decode import on_slots as update

__all__ = ["update"]
