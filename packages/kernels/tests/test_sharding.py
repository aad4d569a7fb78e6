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


# --------------------------------------------------- the backends' kernel wrappers

_GM, _GK, _GN, _GG = 64, 32, 32, 2
_SSD = dict(x=(8, 2, 16, 2, 16), a=(8, 2, 16, 2), b=(8, 2, 16, 1, 16),
            state=(8, 2, 16, 16), states=(8, 2, 2, 16, 16))


def _wrapper_calls():
    """(name, function of one [8 or 64, ...] first operand that calls the wrapper)."""
    from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu, pallas_mosaic_tpu
    from pallasite.kernels.grouped_matmul import pallas_triton as gp_triton
    from pallasite.kernels.ssd import pallas_mosaic_tpu as ssd_tpu
    from pallasite.kernels.ssd import pallas_triton as ssd_triton

    w = jnp.ones((_GG, _GK, _GN), jnp.float32)
    dy = jnp.ones((_GM, _GN), jnp.float32)
    sizes = jnp.array([_GM // 2, _GM // 2], jnp.int32)
    z = {k: jnp.zeros(v, jnp.float32) for k, v in _SSD.items()}
    calls = {}
    for mod in (gp_triton, pallas_mosaic_gpu, pallas_mosaic_tpu):
        short = mod.__name__.rpartition(".")[2]
        calls[f"grouped.{short}.gmm"] = (
            "gm", lambda x, mod=mod: mod.gmm(x, w, sizes, interpret=True))
        calls[f"grouped.{short}.tgmm"] = (
            "gm", lambda x, mod=mod: mod.tgmm(x, dy, sizes, interpret=True))
    from pallasite.kernels.expert_mlp import pallas_mosaic_gpu as mlp_mosaic_gpu
    from pallasite.kernels.expert_mlp import pallas_triton as mlp_triton

    gate_up = jnp.ones((_GG, _GK, 2 * _GN), jnp.float32)
    for mod in (mlp_triton, mlp_mosaic_gpu):
        short = mod.__name__.rpartition(".")[2]
        calls[f"mlp.{short}.gate_up"] = (
            "gm", lambda x, mod=mod: mod.gate_up(x, gate_up, sizes, interpret=True))
    for mod in (ssd_triton, ssd_tpu):
        short = mod.__name__.rpartition(".")[2]
        calls[f"ssd.{short}.forward"] = ("x", lambda x, mod=mod: mod.forward(
            x, z["a"], z["b"], z["b"], z["state"], interpret=True))
        calls[f"ssd.{short}.backward"] = ("x", lambda x, mod=mod: mod.backward(
            x, z["a"], z["b"], z["b"], z["states"], x, z["state"], interpret=True))
    return calls


_WRAPPERS = sorted(_wrapper_calls())


def _first_operand(kind):
    shape = (_GM, _GK) if kind == "gm" else _SSD["x"]
    return jax.random.normal(jax.random.key(1), shape, jnp.float32)


@pytest.mark.parametrize("wrapper", _WRAPPERS)
def test_kernel_wrappers_refuse_operands_sharded_over_explicit_axes(wrapper):
    """A backend's gmm, tgmm, gate_up, forward or backward called on an array laid out over an
    explicit mesh axis: a ValueError that names the argument, its layout, and the op to
    call instead, before any kernel is built."""
    kind, call = _wrapper_calls()[wrapper]
    mesh = st.mesh((8,), ("d",), st.EXPLICIT)
    x = st.put(_first_operand(kind), mesh, "d")
    public = {"grouped": "grouped_projection", "mlp": "grouped_mlp", "ssd": "chunk_ssd"}[
        wrapper.partition(".")[0]]
    with pytest.raises(ValueError, match=rf"(lhs|x) .* laid out over mesh axes P\('d'.*"
                                         rf"runs on local arrays.*{public}"):
        jax.jit(call)(x)


@pytest.mark.parametrize("wrapper", ["grouped.pallas_triton.gmm", "ssd.pallas_triton.forward"])
def test_kernel_wrappers_compute_auto_sharded_operands_whole(wrapper):
    """Under Auto axes the layout is unknown while tracing: an operand sharded there is
    gathered and the whole product computed on every device (docs/sharding.md), with the
    one-device values."""
    kind, call = _wrapper_calls()[wrapper]
    x = _first_operand(kind)
    want = jax.tree.leaves(jax.jit(call)(x))
    auto = st.put(x, st.mesh((8,), ("d",), st.AUTO), "d")
    assert "all-gather" in st.compiled_collectives(call, auto)
    for g, w in zip(jax.tree.leaves(jax.jit(call)(auto)), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
