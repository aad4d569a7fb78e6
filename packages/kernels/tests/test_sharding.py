"""pallasite.kernels.sharding on its own: one toy planner through the three ways in.

The toy op scales each row of x [m, n] by the row's sum: local in m, a reduction over n.
Its planner keeps whatever axes shard m and n and sums the row over n's axes, so every
mode must give the unsharded values with exactly one reduction of [m_local, 1].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding_testlib as st
from pallasite.kernels import sharding

M, N = 16, 32


def _planner(given, axis_sizes):
    ((m_axes, n_axes),) = given

    def local(x):
        rows = sharding.psum_f32(jnp.sum(x, axis=1, keepdims=True), n_axes, x.dtype)
        return (x * rows,)

    dims = ((m_axes, n_axes),)
    return sharding.Plan(in_dims=dims, out_dims=dims, local=local)


def _op(x):
    (out,) = sharding.run(_planner, (x,), rule="m n -> m n", reduction_factors=())
    return out


def _x():
    return jax.random.normal(jax.random.key(0), (M, N), jnp.float32)


def _want():
    x = np.asarray(_x())
    return x * x.sum(axis=1, keepdims=True)


def test_dims_and_specs_round_trip():
    assert sharding.dims_of(P("a", ("b", "c")), 3) == (("a",), ("b", "c"), ())
    assert sharding.dims_of(None, 2) == ((), ())
    assert sharding.spec_of((("a",), ("b", "c"), ())) == P("a", ("b", "c"), None)


@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO], ids=["explicit", "auto"])
@pytest.mark.parametrize("in_context", [True, False], ids=["set_mesh", "no_mesh"])
def test_run_reads_the_layout(axis_type, in_context):
    """Explicit arrays carry their mesh in their types, with or without set_mesh; Auto
    arrays only in their placement, which the compiler reads."""
    mesh = st.mesh((2, 4), ("r", "c"), axis_type)
    x = st.put(_x(), mesh, "r", "c")
    fn = jax.jit(_op)
    if in_context:
        with jax.set_mesh(mesh):
            out = fn(x)
            found = st.compiled_collectives(_op, x)
    else:
        out = fn(x)
        found = st.compiled_collectives(_op, x)
    np.testing.assert_allclose(out, _want(), rtol=1e-5)
    assert st.dims(out) == (("r",), ("c",))
    assert found == {"all-reduce": [(M // 2, 1)]}, found


def test_run_inside_a_shard_map_is_local():
    """All axes manual: the planner sees nothing sharded, no nested shard_map, no
    collective of its own (the row sum is then per shard, as the caller asked)."""
    mesh = st.mesh((2, 4), ("r", "c"), st.EXPLICIT)
    x = st.put(_x(), mesh, "r", "c")
    fn = jax.jit(jax.shard_map(_op, mesh=mesh, in_specs=P("r", "c"), out_specs=P("r", "c")))
    out = np.asarray(fn(x))
    local = np.asarray(_x())[:M // 2, :N // 4]
    np.testing.assert_allclose(out[:M // 2, :N // 4], local * local.sum(1, keepdims=True),
                               rtol=1e-5)
    assert "all-reduce" not in st.compiled_collectives(fn, x)


def test_vary_together_and_cotangent_like():
    """Under check_vma: operands cast to the union of varying axes; a cotangent that
    varies where its primal does not is summed there."""
    mesh = st.mesh((8,), ("d",), st.EXPLICIT)

    def body(x, w):
        xs, ws = sharding.vary_together((x, w))
        assert sharding.varying_axes(ws) == {"d"} and sharding.varying_axes(w) == set()
        ct = sharding.cotangent_like(ws * 0 + 1.0, w)
        assert sharding.varying_axes(ct) == set()
        return ct

    x = st.put(jnp.ones((8, 2)), mesh, "d")
    w = st.put(jnp.ones((2,)), mesh)
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P()))(x, w)
    np.testing.assert_array_equal(out, np.full((2,), 8.0))


def test_cotangent_like_reshards_to_the_primal_layout():
    mesh = st.mesh((8,), ("d",), st.EXPLICIT)
    with jax.set_mesh(mesh):
        primal = st.put(jnp.ones((8, 4)), mesh, "d")
        ct = jax.jit(lambda p, c: sharding.cotangent_like(c, p))(primal, jnp.ones((8, 4)))
    assert st.dims(ct) == (("d",), ())
