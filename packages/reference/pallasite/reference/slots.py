"""A decode step's state cache: slot indices per batch row, checked, and the rows'
states gathered and scattered back. Shared by the decode steps' oracles
(ssd_decode, gated_delta_rule).

Row i's slot is state_batch_indices[i] (i when None). An index outside [0, slots) marks
a padding row: it reads and writes no slot. Every slot no row names keeps its bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.reference.checks import need_shape


def check_slot_indices(state_batch_indices, slots: int, batch: int) -> None:
    """ValueError/TypeError naming state_batch_indices: [batch] integers, concrete ones
    naming no slot twice; without them the cache must hold one slot per row."""
    if state_batch_indices is None:
        if slots != batch:
            raise ValueError(f"state has {slots} slots for a batch of {batch}: pass "
                             f"state_batch_indices [batch] to name each row's slot")
        return
    idx = state_batch_indices
    if not hasattr(idx, "dtype") or not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"state_batch_indices must be an integer array; got "
                        f"{getattr(idx, 'dtype', type(idx).__name__)}")
    need_shape("state_batch_indices", idx, (batch,), "[batch]")
    if not isinstance(idx, jax.core.Tracer):
        values = np.asarray(idx)
        named = values[(values >= 0) & (values < slots)]
        if len(np.unique(named)) != len(named):
            raise ValueError(f"state_batch_indices names a slot twice: {values.tolist()}")


def slots_of_rows(state_batch_indices, batch: int):
    """[batch] int32: each row's slot."""
    if state_batch_indices is None:
        return jnp.arange(batch, dtype=jnp.int32)
    return state_batch_indices.astype(jnp.int32)


def gather(state, rows_slots):
    """(the rows' states in fp32 [batch, ...], live [batch]: the row names a slot)."""
    live = (rows_slots >= 0) & (rows_slots < state.shape[0])
    return state[jnp.where(live, rows_slots, 0)].astype(jnp.float32), live


def scatter(state, new, rows_slots, live):
    """The cache with each live row's new state in its slot, in the cache's dtype."""
    target = jnp.where(live, rows_slots, state.shape[0])  # out of range: dropped
    return state.at[target].set(new.astype(state.dtype), mode="drop")
