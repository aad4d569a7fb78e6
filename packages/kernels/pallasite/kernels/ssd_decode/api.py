"""`selective_state_update`: the Mamba-2 decode step, and which backend runs it.

Backends, in order: pallas_triton (a CUDA GPU from sm80: one pass over the named slots'
state, in place) then xla (the oracle's step, everywhere). `implementation=` takes a
name, a sequence tried in order, or None (that order). On a CPU host an explicit
"pallas_triton" runs through the Triton interpreter (for tests); a backend named alone
that cannot run here raises, saying why.

The step is inference: it has no gradient (the chunked scan, chunk_ssd, is the training
path) and says so when differentiated. The cache is updated functionally; donate it
(`jax.jit(..., donate_argnums=...)`) to update it in place.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax
from jaxtyping import Array, Float, Integer

from pallasite.kernels import decoding
from pallasite.reference import slots
from pallasite.reference import ssd_decode as ref

log = logging.getLogger(__name__)

IMPLEMENTATIONS = decoding.STEP_BACKENDS


def selective_state_update(
    state: Float[Array, "slots h p n"],
    x: Float[Array, "b h p"],
    dt: Float[Array, "b h"],
    A: Float[Array, " h"],
    B: Float[Array, "b g n"],
    C: Float[Array, "b g n"],
    *,
    D: Float[Array, "h ..."] | None = None,
    z: Float[Array, "b h p"] | None = None,
    dt_bias: Float[Array, " h"] | None = None,
    dt_softplus: bool = False,
    state_batch_indices: Integer[Array, " b"] | None = None,
    implementation: str | Sequence[str] | None = None,
) -> tuple[Float[Array, "b h p"], Float[Array, "slots h p n"]]:
    """One decode token per batch row: returns (y [b, h, p] in x's dtype, new_state).

    mamba_ssm's selective_state_update with its argument meanings (A, dt_bias and D per
    head): state [slots, h, p, n] in fp32 or bf16; x [b, h, p]; dt [b, h]; A [h]; B and C
    [b, g, n] with h a multiple of g; D [h] or [h, p]; z [b, h, p]; dt_bias [h].

    dt <- softplus(dt + dt_bias) (bias and softplus when given); S <- exp(A dt) S +
    dt x B^T; y = S C + D x; y <- y silu(z). Computed in fp32; the new state is stored
    in the state's dtype.

    state_batch_indices [b]: the slot of each batch row (continuous batching); without
    it, row i uses slot i and slots must equal b. A row whose index is outside
    [0, slots) is a padding row: it reads and writes no slot and gets y = 0. Slots no
    row names keep their bits. A slot named twice is refused when the indices are
    concrete; traced, which write lands is unspecified.
    """
    ref.validate_selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                        state_batch_indices=state_batch_indices)
    if not isinstance(dt_softplus, bool):
        raise TypeError(f"dt_softplus must be a bool; got {type(dt_softplus).__name__}")
    name = decoding.step_backend("selective_state_update", implementation)
    slots_of_rows = slots.slots_of_rows(state_batch_indices, x.shape[0])
    no_gradient = decoding.no_gradient("selective_state_update", "chunk_ssd (the chunked scan)")
    stop = lambda t: None if t is None else no_gradient(t)  # noqa: E731
    state, x, A, B, C, D, z = map(stop, (state, x, A, B, C, D, z))
    dt = stop(ref.process_dt(dt, dt_bias, dt_softplus))
    if name == "xla":
        from pallasite.kernels.ssd_decode import xla

        return xla.update(state, x, dt, A, B, C, D, z, slots_of_rows)
    from pallasite.kernels.ssd_decode import pallas_triton

    log.debug("selective_state_update on pallas_triton")
    return pallas_triton.update(state, x, dt, A, B, C, D, z, slots_of_rows,
                                interpret=jax.default_backend() == "cpu")
