"""grouped_projection with the kernel's group axis sharded (expert parallelism).

Under jit over sharded arrays (Explicit axes, Auto axes with and without a mesh in
context) each device computes only the rows of its own experts: values and gradients
equal the unsharded call, and the compiled HLO moves no weights (no all-gather or
all-to-all of a kernel-shaped array) and holds exactly the reductions docs/sharding.md
names. Inside a caller's shard_map the caller passes the offset itself
(`axis_index * local_g`). 8 forced CPU devices: XLA and the Triton interpreter for values,
the Mosaic kernels compiled for their collectives; two GPUs in test_gpus.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding_testlib as st
from pallasite.kernels.grouped_matmul import grouped_projection
from pallasite.reference.grouped_projection import grouped_projection as reference

M, K, N, G = 64, 128, 256, 8
SIZES = np.array([9, 0, 11, 4, 0, 13, 7, 12], np.int32)  # total 56 < M, empty groups
BLOCKS = st.GROUPED_BLOCKS
RUNS_ON_CPU = st.GROUPED_ON_CPU
MOSAIC = st.GROUPED_MOSAIC


def _inputs(seed=0):
    x, w, weights = st.grouped_inputs(seed, M, K, N, G)
    return x, w, jnp.asarray(SIZES), weights


def _project(name):
    compute = jnp.bfloat16 if name == "pallas_mosaic_gpu" else jnp.float32
    return functools.partial(grouped_projection, compute=compute, interpret_on_cpu=True,
                             implementation=name, block_sizes=BLOCKS[name])


def _loss(project):
    def loss(x, w, sizes, weights):
        return jnp.sum(project(x, w, sizes).astype(jnp.float32) * weights)
    return jax.value_and_grad(loss, argnums=(0, 1))


def _want(x, w, sizes, weights):
    project = lambda x, w, s: reference(x, w, s, jnp.float32)  # noqa: E731
    return jax.jit(_loss(project))(*(np.asarray(t) for t in (x, w, sizes, weights)))


def _assert_close(got, want, rtol=2e-5, atol=2e-5):
    (value, (dx, dw)), (value_ref, (dx_ref, dw_ref)) = got, want
    np.testing.assert_allclose(value, value_ref, rtol=rtol, atol=atol * 100)
    np.testing.assert_allclose(np.asarray(dx), dx_ref, rtol=rtol, atol=atol, err_msg="dx")
    np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=rtol, atol=atol, err_msg="dkernel")


# (mesh shape, axis names, x spec, kernel spec, y spec, the reductions of the compiled
# fwd+bwd as {op: [result shapes]} (arrays of >= 2 elements), the tokens gathered).
LAYOUTS = {
    # experts over 4 devices, tokens replicated: y and dx summed once each over the
    # experts (every row has one non-zero term), dkernel stays local.
    "experts": ((4,), ("expert",), P(), P("expert"), P(),
                {"all-reduce": sorted([(M, N), (M, K)])}, []),
    # tokens and experts over the same 4 devices: the tokens (x, and dy for the
    # backward) are gathered, y and dx reduce-scattered back to the token layout.
    "tokens_experts": ((4,), ("expert",), P("expert"), P("expert"), P("expert"),
                       {"reduce-scatter": sorted([(M // 4, N), (M // 4, K)])},
                       sorted([(M, K), (M, N)])),
    # data x expert: tokens over data, experts over expert: y and dx summed over the
    # experts, dkernel over data.
    "data_experts": ((2, 4), ("data", "expert"), P("data"), P("expert"), P("data"),
                     {"all-reduce": sorted([(M // 2, N), (M // 2, K), (G // 4, K, N)])}, []),
    # experts and the kernel's columns (expert + tensor parallel): y local in columns,
    # dx summed over both axes at once.
    "experts_columns": ((4, 2), ("expert", "model"), P(), P("expert", None, "model"),
                        P(None, "model"), {"all-reduce": sorted([(M, N // 2), (M, K)])}, []),
}


def _placed(layout, axis_type, seed=0):
    shape, names, x_spec, w_spec, y_spec, _, _ = LAYOUTS[layout]
    mesh = st.mesh(shape, names, axis_type)
    x, w, sizes, weights = _inputs(seed)
    return (mesh, st.put(x, mesh, *x_spec), st.put(w, mesh, *w_spec), sizes,
            st.put(weights, mesh, *y_spec))


def _check_collectives(fn, args, layout):
    """No weight moves; the tokens move only where the layout says; exactly the named
    reductions."""
    found = st.compiled_collectives(fn, *args)
    for op in ("all-gather", "all-to-all", "collective-permute"):
        assert not [s for s in found.get(op, []) if len(s) == 3], f"weights moved: {found}"
    assert sorted(found.get("all-gather", [])) == LAYOUTS[layout][6], found
    assert "all-to-all" not in found, found
    got = {op: st.big(shapes) for op, shapes in found.items()
           if op != "all-gather" and st.big(shapes)}
    assert got == LAYOUTS[layout][5], f"collectives {got}, expected {LAYOUTS[layout][5]}"


@pytest.mark.parametrize("name", RUNS_ON_CPU)
@pytest.mark.parametrize("mode", ["explicit", "auto", "auto_no_mesh"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_jit_with_the_experts_sharded(layout, mode, name):
    mesh, *args = _placed(layout, st.EXPLICIT if mode == "explicit" else st.AUTO)
    fn = _loss(_project(name))
    with jax.set_mesh(mesh) if mode != "auto_no_mesh" else _nothing():
        _check_collectives(fn, args, layout)
        got = jax.jit(fn)(*args)
    _assert_close(got, _want(*args))
    if mode == "explicit":
        assert st.dims(got[1][1]) == st.dims(args[1]), "dkernel not laid out as the kernel"


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_outputs_keep_the_layout():
    """y is laid out as the tokens (rows) under Explicit axes, the kernel's cotangent as
    the kernel: no weight ends up gathered."""
    mesh, x, w, sizes, weights = _placed("tokens_experts", st.EXPLICIT)
    with jax.set_mesh(mesh):
        y = jax.jit(_project("xla"))(x, w, sizes)
    assert st.dims(y) == (("expert",), ())


def test_caller_offset_adds_to_the_shard_offset():
    """A kernel holding groups [2, 6) of 8, sharded over 2 expert devices: each device's
    first group is 2 + 2 * index."""
    mesh = st.mesh((2,), ("expert",))
    x, w, sizes, weights = _inputs(3)
    w4 = w[2:6]
    project = functools.partial(grouped_projection, compute=jnp.float32, group_offset=2)
    got = jax.jit(_loss(project))(x, st.put(w4, mesh, "expert"), sizes, weights)
    want = jax.jit(_loss(lambda x, w, s: reference(x, w, s, jnp.float32, group_offset=2)))(
        x, w4, sizes, weights)
    _assert_close(got, want)


@pytest.mark.parametrize("name", MOSAIC)
@pytest.mark.parametrize("layout", ["experts", "tokens_experts", "data_experts"])
def test_mosaic_kernels_compile_with_the_same_collectives(layout, name):
    mesh, *args = _placed(layout, st.EXPLICIT)
    with jax.set_mesh(mesh):
        _check_collectives(_loss(_project(name)), args, layout)


# --------------------------------------------------------- inside the caller's shard_map


def _manual(project, mesh, check_vma):
    """Tokens replicated, experts over `expert`, the offset from the caller's axis index;
    the expert axis sums what each device computed (y and dx by JAX's own rules)."""
    local_g = G // mesh.shape["expert"]

    def body(x, w, sizes, weights):
        offset = jax.lax.axis_index("expert") * local_g
        y = project(x, w, sizes, group_offset=offset).astype(jnp.float32)
        return jax.lax.psum(jnp.sum(y * weights), "expert")

    loss = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("expert"), P(), P()),
                         out_specs=P(), check_vma=check_vma)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _dense_local(x, w, sizes, group_offset):
    """Local experts as a masked einsum (plain jnp): JAX differentiates it itself."""
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(x.shape[0])[:, None]
    groups = group_offset + jnp.arange(w.shape[0])[None, :]
    mask = (rows >= starts[groups]) & (rows < ends[groups])
    return jnp.einsum("mk,gkn,mg->mn", x, w, mask.astype(x.dtype),
                      precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("name", RUNS_ON_CPU)
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_inside_shard_map_with_the_caller_offset(check_vma, name):
    mesh = st.mesh((4,), ("expert",))
    x, w, sizes, weights = _inputs(1)
    args = (x, st.put(w, mesh, "expert"), sizes, weights)
    project = functools.partial(_project(name))
    got = _manual(lambda x, w, s, group_offset: project(x, w, s, group_offset=group_offset),
                  mesh, check_vma)(*args)
    want = _manual(lambda x, w, s, group_offset: _dense_local(x, w, s, group_offset),
                   mesh, check_vma)(*args)
    _assert_close(got, want)
    _assert_close(got, _want(x, w, sizes, weights))


# ------------------------------------------------------------------------- GPUs


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["pallas_mosaic_gpu", "pallas_triton", "xla"])
@pytest.mark.parametrize("layout", ["experts", "tokens_experts"])
def test_gpus(layout, name):
    """Experts over two GPUs (Explicit axes), bf16 compute, against the unsharded call."""
    devices = st.gpus(two=True)
    m, k, n, g = 4096, 512, 1024, 8
    x, w, weights = st.grouped_inputs(5, m, k, n, g)
    sizes = jnp.asarray([700, 0, 900, 300, 512, 600, 400, 500], jnp.int32)  # 3912 < m
    mesh = st.mesh((2,), ("expert",), st.EXPLICIT, devices)
    tokens = "expert" if layout == "tokens_experts" else None
    args = (st.put(x, mesh, tokens), st.put(w, mesh, "expert"), sizes,
            st.put(weights, mesh, tokens))
    project = functools.partial(grouped_projection, compute=jnp.bfloat16, implementation=name)
    with jax.set_mesh(mesh):
        got = jax.jit(_loss(project))(*args)
    host = [np.asarray(a) for a in args]
    want = jax.jit(_loss(lambda x, w, s: reference(x, w, s, jnp.bfloat16)))(*host)
    (value, (dx, dw)), (value_ref, (dx_ref, dw_ref)) = got, want
    np.testing.assert_allclose(value, value_ref, rtol=1e-2)
    for a, b, what in ((dx, dx_ref, "dx"), (dw, dw_ref, "dkernel")):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < 1e-2, f"{what}: relative l2 error {rel}"


# ------------------------------------- the expert axes dropped, the kernel still sharded
# Where the planner cannot keep the kernel's group axis local (rows split over the expert
# axis in another order than minor-most; G that the expert axis does not divide), each
# device runs every group: the forward and the backward are still the unsharded call's,
# dkernel comes back laid out as the kernel. Never an error.


def _dropped_case(case, axis_type, offset):
    """(mesh, x, w, sizes, weights, constrain): x, w and weights placed as the case says;
    the kernel holds groups [offset, offset + g) of the sizes (offset None: all of them);
    `constrain` lays out the kernel inside the jitted function (G = 6 cannot be placed
    over 4 devices, but under Auto axes the compiler can shard it unevenly)."""
    x, w, sizes, weights = _inputs(4)
    if case == "indivisible":  # 6 groups over 4 expert devices, tokens replicated
        mesh = st.mesh((4,), ("expert",), axis_type)
        sizes = jnp.asarray(SIZES[:6] if offset is None else SIZES, jnp.int32)
        w = w[:6] if offset is None else w[offset:offset + 6]
        constrain = lambda w: jax.lax.with_sharding_constraint(  # noqa: E731
            w, jax.sharding.NamedSharding(mesh, P("expert")))
        return mesh, x, w, sizes, weights, constrain
    # rows over ("expert", "data"), the expert axis major: the kernel's groups over expert
    mesh = st.mesh((4, 2), ("expert", "data"), axis_type)
    w = w if offset is None else w[offset:offset + 4]
    return (mesh, st.put(x, mesh, ("expert", "data")), st.put(w, mesh, "expert"), sizes,
            st.put(weights, mesh, ("expert", "data")), lambda w: w)


DROPPED = [("rows_expert_major", st.EXPLICIT), ("rows_expert_major", st.AUTO),
           ("indivisible", st.AUTO)]


@pytest.mark.parametrize("name", RUNS_ON_CPU)
@pytest.mark.parametrize("offset", [None, 2], ids=["all_groups", "caller_offset"])
@pytest.mark.parametrize("case, axis_type", DROPPED, ids=str)
def test_backward_where_the_expert_axes_are_dropped(case, axis_type, offset, name):
    mesh, x, w, sizes, weights, constrain = _dropped_case(case, axis_type, offset)
    project = functools.partial(_project(name), group_offset=offset)
    with jax.set_mesh(mesh):
        got = jax.jit(_loss(lambda x, w, s: project(x, constrain(w), s)))(
            x, w, sizes, weights)
    ref = lambda x, w, s: reference(x, w, s, jnp.float32, group_offset=offset)  # noqa: E731
    want = jax.jit(_loss(ref))(*(np.asarray(t) for t in (x, w, sizes, weights)))
    _assert_close(got, want)
    if axis_type == st.EXPLICIT:
        assert st.dims(got[1][1]) == st.dims(w), "dkernel not laid out as the kernel"
