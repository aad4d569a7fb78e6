"""chunk_gated_delta_rule on 8 host devices: rows or value heads sharded under jit (Explicit
and Auto axes), packed sequences with the heads sharded, and inside a caller's
shard_map. Values and all six gradients equal the unsharded call's; with rows or heads
split, the compiled program moves no array of the inputs' size."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding_testlib as st
from pallasite.kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

B, T, HK, HV, K, V = 8, 100, 8, 16, 16, 16


def _inputs(seed=0, b=B, n=None):
    ks = jax.random.split(jax.random.key(seed), 6)
    return (jax.random.normal(ks[0], (b, T, HK, K)), jax.random.normal(ks[1], (b, T, HK, K)),
            jax.random.normal(ks[2], (b, T, HV, V)),
            -jax.nn.softplus(jax.random.normal(ks[3], (b, T, HV))),
            jax.nn.sigmoid(jax.random.normal(ks[4], (b, T, HV))),
            jax.random.normal(ks[5], (n or b, HV, K, V)))


def _loss(*args, cu_seqlens=None):
    o, final = chunk_gated_delta_rule(*args[:5], initial_state=args[5], output_final_state=True,
                                      cu_seqlens=cu_seqlens, chunk_size=32)
    weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
    return jnp.sum(o * weights) + jnp.sum(final ** 2)


def _grads(fn, args):
    return jax.jit(jax.value_and_grad(fn, argnums=tuple(range(6))))(*args)


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w), np.abs(g - w).max()


def _placed(args, mesh, split):
    q, k, v, g, beta, s0 = args
    if split == "rows":
        return tuple(st.put(t, mesh, "x") for t in args)
    return (st.put(q, mesh, None, None, "x"), st.put(k, mesh, None, None, "x"),
            st.put(v, mesh, None, None, "x"), st.put(g, mesh, None, None, "x"),
            st.put(beta, mesh, None, None, "x"), st.put(s0, mesh, None, "x"))


@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO], ids=["explicit", "auto"])
@pytest.mark.parametrize("split", ["rows", "heads"])
def test_rows_or_heads_split_under_jit(axis_type, split):
    """Rows over 8 devices, or the 16 value heads and 8 key heads over 8 devices (each
    device's two value heads read its own key head)."""
    args = _inputs()
    mesh = st.mesh((8,), ("x",), axis_type)
    placed = _placed(args, mesh, split)
    with jax.set_mesh(mesh):
        got = _grads(_loss, placed)
        found = st.compiled_collectives(jax.grad(_loss, argnums=tuple(range(6))), *placed)
    _assert_close(got, _grads(_loss, args))
    # No array with a time axis crosses devices: at most the states (XLA's partitioner,
    # under Auto axes, may gather the initial state's rows).
    moved = [s for shapes in found.values() for s in st.big(shapes)]
    assert all(int(np.prod(s)) <= B * HV * K * V for s in moved), found


def test_heads_split_with_packed_sequences():
    """cu_seqlens (one row, three sequences) with the heads over 2 devices: each device
    scans its heads' sequences."""
    args = _inputs(seed=1, b=1, n=3)
    cu = jnp.asarray([0, 30, 31, 100], jnp.int32)
    mesh = st.mesh((2,), ("x",), st.EXPLICIT, devices=jax.devices()[:2])
    placed = _placed(args, mesh, "heads")
    loss = functools.partial(_loss, cu_seqlens=cu)
    with jax.set_mesh(mesh):
        got = _grads(loss, placed)
    _assert_close(got, _grads(loss, args))


def test_inside_a_callers_shard_map():
    """The caller's shard_map splits the rows; each device runs the form on its own."""
    args = _inputs(seed=2)
    mesh = st.mesh((8,), ("x",), st.AUTO)

    def local(*a):
        o, final = chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True,
                                          chunk_size=32)
        return o, final

    spec = P("x")
    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6,
                                out_specs=(spec, spec)))(*args)
    want = local(*args)
    _assert_close(got, want)


@pytest.mark.parametrize("split", ["rows", "heads"])
def test_the_step_by_step_form_under_explicit_axes(split):
    """fused_recurrent_gated_delta_rule takes the same plan as the chunked form: under
    Explicit axes its scan over steps (whose carry would otherwise change layout) runs
    on the local rows or heads, values and gradients the unsharded call's."""
    args = _inputs(seed=3)
    mesh = st.mesh((8,), ("x",), st.EXPLICIT)

    def loss(*a):
        o, final = fused_recurrent_gated_delta_rule(*a[:5], initial_state=a[5],
                                                    output_final_state=True)
        return jnp.sum(o * jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)) \
            + jnp.sum(final ** 2)

    with jax.set_mesh(mesh):
        got = _grads(loss, _placed(args, mesh, split))
    _assert_close(got, _grads(loss, args))
