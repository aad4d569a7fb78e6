"""The gated delta rule's definition (pallasite.reference.gated_delta_rule) against a
float64 NumPy loop written from the update rule, with grouped value heads, the L2 norm,
a scale, and packed sequences from their own initial states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.reference.gated_delta_rule import gated_delta_rule_sequential


def _numpy_loop(q, k, v, g, beta, scale, init, starts, l2):
    """o [T, Hv, V] and the state after every step, for one row; `starts[t]` is the
    sequence whose initial state step t resets to (-1: none)."""
    t_len, hk, dk = q.shape
    hv, dv = v.shape[1:]
    rep = hv // hk
    if l2:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    s = init[0].copy()
    o = np.zeros((t_len, hv, dv))
    states = np.zeros((t_len, hv, dk, dv))
    for t in range(t_len):
        if starts[t] >= 0:
            s = init[starts[t]].copy()
        for h in range(hv):
            kk, qq = k[t, h // rep], q[t, h // rep]
            s[h] = np.exp(g[t, h]) * s[h]
            s[h] = s[h] + beta[t, h] * np.outer(kk, v[t, h] - s[h].T @ kk)
            o[t, h] = s[h].T @ (scale * qq)
        states[t] = s
    return o, states


@pytest.mark.parametrize("l2", [False, True])
def test_against_a_numpy_loop(l2):
    rng = np.random.default_rng(0)
    t, hk, hv, dk, dv = 40, 2, 4, 5, 3
    q, k = rng.standard_normal((2, 1, t, hk, dk))
    v = rng.standard_normal((1, t, hv, dv))
    g = -rng.random((1, t, hv)) * 3
    beta = rng.random((1, t, hv))
    init = rng.standard_normal((4, hv, dk, dv))
    cu = np.array([0, 9, 9, 31, 40])
    starts = np.full(t, -1)
    for s in range(4):
        if cu[s + 1] > cu[s]:
            starts[cu[s]] = s
    o_want, states = _numpy_loop(q[0], k[0], v[0], g[0], beta[0], 0.7, init, starts, l2)
    finals = np.stack([states[cu[s + 1] - 1] if cu[s + 1] > cu[s] else init[s]
                       for s in range(4)])
    with jax.enable_x64(True):
        j = lambda x: jnp.asarray(x, jnp.float64)  # noqa: E731
        o, final = gated_delta_rule_sequential(
            j(q), j(k), j(v), j(g), j(beta), scale=0.7, initial_state=j(init),
            output_final_state=True, cu_seqlens=jnp.asarray(cu),
            use_qk_l2norm_in_kernel=l2)
    np.testing.assert_allclose(np.asarray(o[0]), o_want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(final), finals, rtol=1e-12, atol=1e-12)


def test_default_scale_batch_rows_and_no_final_state():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 3, 12, 1, 4))
    v = rng.standard_normal((3, 12, 1, 2))
    g, beta = -rng.random((3, 12, 1)), rng.random((3, 12, 1))
    with jax.enable_x64(True):
        j = lambda x: jnp.asarray(x, jnp.float64)  # noqa: E731
        o, none = gated_delta_rule_sequential(j(q), j(k), j(v), j(g), j(beta))
    assert none is None
    for row in range(3):
        want, _ = _numpy_loop(q[row], k[row], v[row], g[row], beta[row], 0.5,
                              np.zeros((1, 1, 4, 2)), np.full(12, -1), False)
        np.testing.assert_allclose(np.asarray(o[row]), want, rtol=1e-12, atol=1e-12)
