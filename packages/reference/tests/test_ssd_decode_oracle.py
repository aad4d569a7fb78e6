"""The decode step's oracle against a float64 loop written from the definition, and
against the chunked scan's oracle: a prefill followed by steps is one scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.reference.ssd_decode import (
    selective_state_update_reference as step_ref,
)
from pallasite.reference.ssd import ssd_sequential


def _inputs(seed, slots=5, b=3, h=4, p=6, n=8, g=2):
    k = jax.random.split(jax.random.key(seed), 9)
    f = lambda i, shape: jax.random.normal(k[i], shape, jnp.float32)  # noqa: E731
    return dict(state=f(0, (slots, h, p, n)), x=f(1, (b, h, p)), dt=f(2, (b, h)),
                A=-jnp.exp(f(3, (h,))), B=f(4, (b, g, n)), C=f(5, (b, g, n)),
                D=f(6, (h, p)), z=f(7, (b, h, p)), dt_bias=f(8, (h,)))


def _loop(a, idx, softplus):
    """float64, one element at a time, from the definition."""
    a = {k: np.asarray(v, np.float64) for k, v in a.items()}
    state = a["state"].copy()
    slots, h, p, n = state.shape
    b, g = a["x"].shape[0], a["B"].shape[1]
    y = np.zeros((b, h, p))
    for i in range(b):
        s = idx[i]
        if not 0 <= s < slots:
            continue
        for hh in range(h):
            gg = hh // (h // g)
            dt = a["dt"][i, hh] + a["dt_bias"][hh]
            dt = np.log1p(np.exp(dt)) if softplus else dt
            for pp in range(p):
                acc = 0.0
                for nn in range(n):
                    v = (np.exp(a["A"][hh] * dt) * state[s, hh, pp, nn]
                         + dt * a["x"][i, hh, pp] * a["B"][i, gg, nn])
                    state[s, hh, pp, nn] = v
                    acc += v * a["C"][i, gg, nn]
                acc += a["D"][hh, pp] * a["x"][i, hh, pp]
                zz = a["z"][i, hh, pp]
                y[i, hh, pp] = acc * zz / (1 + np.exp(-zz))
    return y, state


@pytest.mark.parametrize("softplus", [False, True])
def test_the_step_is_the_definition(softplus):
    a = _inputs(0)
    idx = [3, -1, 0]  # a padding row; slots 1, 2 and 4 unnamed
    y, state = step_ref(**a, dt_softplus=softplus,
                        state_batch_indices=jnp.asarray(idx, jnp.int32))
    y_want, state_want = _loop(a, idx, softplus)
    np.testing.assert_allclose(y, y_want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, state_want, rtol=1e-5, atol=1e-5)
    untouched = np.asarray([1, 2, 4])
    np.testing.assert_array_equal(np.asarray(state)[untouched], np.asarray(a["state"])[untouched])
    assert not np.asarray(y)[1].any()


def test_a_prefill_then_steps_is_one_scan():
    """ssd_sequential over 12 steps from a zero state, against 8 steps of the scan and 4
    decode steps from its final state (x scaled by dt, a = A dt, as the scan takes them)."""
    bsz, length, h, p, n, g = 2, 12, 4, 6, 8, 2
    k = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(k[0], (bsz, length, h, p))
    dt = jax.nn.softplus(jax.random.normal(k[1], (bsz, length, h)))
    A = -jnp.exp(jax.random.normal(k[2], (h,)))
    B = jax.random.normal(k[3], (bsz, length, g, n))
    C = jax.random.normal(k[4], (bsz, length, g, n))
    scaled = x * dt[..., None]
    y_all, _ = ssd_sequential(scaled, A * dt, B, C)
    _, state = ssd_sequential(scaled[:, :8], (A * dt)[:, :8], B[:, :8], C[:, :8])
    for t in range(8, length):
        y, state = step_ref(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        np.testing.assert_allclose(y, y_all[:, t], rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_named():
    a = _inputs(1)
    with pytest.raises(ValueError, match="dt must be"):
        step_ref(**{**a, "dt": a["dt"][:, :2]})
    with pytest.raises(ValueError, match="multiple of B's groups"):
        step_ref(**{**a, "B": a["B"][:, :1].repeat(3, 1), "C": a["C"][:, :1].repeat(3, 1)})
    with pytest.raises(ValueError, match="state_batch_indices"):
        step_ref(**a)  # 5 slots, batch 3
    with pytest.raises(ValueError, match="names a slot twice"):
        step_ref(**a, state_batch_indices=jnp.asarray([1, 1, 2], jnp.int32))
    with pytest.raises(TypeError, match="state must be float32 or bfloat16"):
        step_ref(**{**a, "state": a["state"].astype(jnp.float16)},
                 state_batch_indices=jnp.asarray([0, 1, 2], jnp.int32))
    with pytest.raises(TypeError, match="state_batch_indices must be an integer"):
        step_ref(**a, state_batch_indices=jnp.asarray([0.0, 1.0, 2.0]))
