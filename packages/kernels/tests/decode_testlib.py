"""What the decode steps' tests share: a state cache with named slots, a padding row and
every other slot poisoned, and the checks of a step's result against its oracle's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def close(got, want, dtype):
    """fp32 to 1e-5; bf16 states or inputs to 2e-2."""
    tol = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)


def poisoned_cache(state, batch: int):
    """(the cache with every slot no row names set to NaN, the rows' slot indices): named
    slots from the end, the second row a padding row (-1)."""
    slots = state.shape[0]
    idx = np.array([slots - 1 - i for i in range(batch)], np.int32)
    idx[min(1, batch - 1)] = -1
    poison = np.ones(slots, bool)
    poison[idx[idx >= 0]] = False
    return state.at[jnp.asarray(np.nonzero(poison)[0])].set(jnp.nan), jnp.asarray(idx)


def check_step(got, want, idx, out_dtype, state_dtype):
    """The step's (output, cache) against the oracle's: named slots and outputs close,
    every other slot still NaN bit for bit, no NaN in an output, padding rows' outputs
    zero, and the dtypes kept."""
    idx = np.asarray(idx)
    named = sorted(set(int(i) for i in idx if i >= 0))
    poison = np.ones(got[1].shape[0], bool)
    poison[named] = False
    close(got[0], want[0], out_dtype)
    close(np.asarray(got[1], np.float32)[named], np.asarray(want[1], np.float32)[named],
          state_dtype)
    assert np.isnan(np.asarray(got[1], np.float32)[poison]).all()
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
    assert not np.asarray(got[0], np.float32)[idx < 0].any()  # padding rows: 0
    assert got[0].dtype == out_dtype and got[1].dtype == state_dtype
