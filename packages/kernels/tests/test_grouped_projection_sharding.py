"""grouped_projection on many devices (8 forced CPU devices; two GPUs where present).

Every way in, forward and backward, against the unsharded reference (jit over global
arrays) or, inside a caller's shard_map, against a dense masked einsum run by the same
caller code (plain jnp, so JAX's own autodiff sets the expected reductions):
  - jit over sharded arrays without a mesh in context (Auto axes);
  - under jax.set_mesh with Explicit and with Auto axes, and Explicit arrays without a
    mesh in context: tokens over one axis and the kernel's columns over another (data +
    tensor parallel), the contraction sharded (row parallel), axis names other than
    data/model;
  - inside the caller's shard_map, every axis manual or some, check_vma on and off, with
    per-shard group sizes (how MoE layers call a grouped matmul).
The compiled HLO (after partitioning) is read for the collectives: no all-gather, and
exactly the reductions docs/sharding.md names for each layout.

Backends: XLA and the Triton kernels (through its interpreter) for values; the Mosaic GPU
and Mosaic TPU kernels are compiled through their interpreters and their collectives read
(JAX 0.11.2's Mosaic interpreters share one host-memory barrier across devices, which
fails or deadlocks when 8 devices run at once, and their callbacks cannot lower inside a
custom_partitioning), and run for values on GPUs (test_gpus), where the compiled kernels
also run inside a caller's shard_map under check_vma.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding_testlib as st
from pallasite.kernels.grouped_matmul import grouped_projection
from pallasite.reference.grouped_projection import grouped_projection as reference

M, K, N, G = 64, 128, 256, 4
SIZES = np.array([20, 0, 27, 9], np.int32)  # total 56 < M: rows 56.. are zero
_HI = jax.lax.Precision.HIGHEST

BLOCKS = st.GROUPED_BLOCKS
RUNS_ON_CPU = st.GROUPED_ON_CPU
MOSAIC = st.GROUPED_MOSAIC
# Mosaic GPU takes 16-bit operands only; the others are checked in fp32.
COMPUTE = {"pallas_mosaic_gpu": jnp.bfloat16}


def _compute(name):
    return COMPUTE.get(name, jnp.float32)


def _project(name, compute=None):
    return functools.partial(grouped_projection, compute=compute or _compute(name),
                             interpret_on_cpu=True, implementation=name,
                             block_sizes=BLOCKS[name])


def _inputs(seed=0):
    x, w, weights = st.grouped_inputs(seed, M, K, N, G)
    return x, w, jnp.asarray(SIZES), weights


def _loss(project):
    """(loss, (dx, dkernel)) of a weighted sum of y; the weights are laid out like y, as
    the activations a real cotangent comes from are."""
    def loss(x, w, sizes, weights):
        return jnp.sum(project(x, w, sizes).astype(jnp.float32) * weights)
    return jax.value_and_grad(loss, argnums=(0, 1))


def _want(x, w, sizes, weights, compute=jnp.float32):
    """The unsharded call on one device (the inputs fetched to the host first)."""
    project = lambda x, w, s: reference(x, w, s, compute)  # noqa: E731
    return jax.jit(_loss(project))(*(np.asarray(t) for t in (x, w, sizes, weights)))


def _assert_close(got, want, rtol=2e-5, atol=2e-5, value_rtol=None):
    """Loss values, dx and dkernel. The loss of a bf16 y may differ by y's rounding
    (value_rtol); dx and dkernel come from the cotangent, not y."""
    (value, (dx, dw)), (value_ref, (dx_ref, dw_ref)) = got, want
    np.testing.assert_allclose(value, value_ref, rtol=value_rtol or rtol, atol=atol * 100)
    np.testing.assert_allclose(np.asarray(dx), dx_ref, rtol=rtol, atol=atol, err_msg="dx")
    np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=rtol, atol=atol, err_msg="dkernel")


# Layouts under jit: (mesh shape, axis names, x spec, kernel spec, the reductions the
# compiled fwd+bwd must hold as {op: [result shapes]}, arrays of >= 2 elements).
LAYOUTS = {
    # tokens over 8 devices: dkernel summed once over them.
    "tokens": ((8,), ("tokens",), P("tokens"), P(),
               {"all-reduce": [(G, K, N)]}),
    # tokens x columns (data + tensor parallel): dkernel over data, dx over model.
    "tokens_columns": ((2, 4), ("data", "model"), P("data"), P(None, None, "model"),
                       {"all-reduce": sorted([(G, K, N // 4), (M // 2, K)])}),
    # columns alone (tensor parallel): dx summed once, nothing else.
    "columns": ((8,), ("tp",), P(), P(None, None, "tp"), {"all-reduce": [(M, K)]}),
    # the contraction split (row parallel, a down projection): the forward summed once.
    "contraction": ((2, 4), ("dp", "mp"), P("dp", "mp"), P(None, "mp", None),
                    {"all-reduce": sorted([(M // 2, N), (G, K // 4, N)])}),
}


def _placed(layout, axis_type, seed=0):
    shape, names, x_spec, w_spec, _ = LAYOUTS[layout]
    mesh = st.mesh(shape, names, axis_type)
    x, w, sizes, weights = _inputs(seed)
    y_spec = (tuple(x_spec)[0] if len(x_spec) else None,
              tuple(w_spec)[2] if len(w_spec) > 2 else None)
    return (mesh, st.put(x, mesh, *x_spec), st.put(w, mesh, *w_spec), sizes,
            st.put(weights, mesh, *y_spec))


def _check_collectives(fn, args, layout):
    found = st.compiled_collectives(fn, *args)
    assert "all-gather" not in found, f"gathered: {found['all-gather']}"
    assert "all-to-all" not in found, f"all-to-all: {found['all-to-all']}"
    want = LAYOUTS[layout][4]
    got = {op: st.big(shapes) for op, shapes in found.items() if st.big(shapes)}
    assert got == want, f"collectives {got}, expected {want}"


@pytest.mark.parametrize("name", RUNS_ON_CPU)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_jit_no_mesh_in_context(layout, name):
    """Auto axes, no mesh in context: only the arrays say how they are laid out."""
    mesh, *args = _placed(layout, st.AUTO)
    fn = _loss(_project(name))
    _check_collectives(fn, args, layout)
    _assert_close(jax.jit(fn)(*args), _want(*args, _compute(name)), value_rtol=1e-2)


@pytest.mark.parametrize("name", RUNS_ON_CPU)
@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO], ids=["explicit", "auto"])
@pytest.mark.parametrize("layout", ["tokens_columns", "contraction"])
def test_jit_under_set_mesh(layout, axis_type, name):
    mesh, *args = _placed(layout, axis_type)
    fn = _loss(_project(name))
    with jax.set_mesh(mesh):
        _check_collectives(fn, args, layout)
        got = jax.jit(fn)(*args)
    _assert_close(got, _want(*args, _compute(name)), value_rtol=1e-2)


@pytest.mark.parametrize("name", RUNS_ON_CPU)
@pytest.mark.parametrize("layout", ["tokens_columns", "contraction"])
def test_jit_explicit_arrays_without_set_mesh(layout, name):
    """Explicit-axis arrays carry their mesh in their types: no mesh in context needed."""
    mesh, *args = _placed(layout, st.EXPLICIT)
    fn = _loss(_project(name))
    _check_collectives(fn, args, layout)
    _assert_close(jax.jit(fn)(*args), _want(*args, _compute(name)), value_rtol=1e-2)


@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO], ids=["explicit", "auto"])
def test_forward_keeps_the_layout(axis_type):
    """y comes out sharded as x's rows and the kernel's columns; under Explicit axes dx
    and dkernel as their primals (custom_vjp requires it; Auto lets the compiler pick)."""
    mesh, x, w, sizes, weights = _placed("tokens_columns", axis_type)
    with jax.set_mesh(mesh):
        y = jax.jit(_project("xla"))(x, w, sizes)
        _, (dx, dw) = jax.jit(_loss(_project("xla")))(x, w, sizes, weights)
    assert st.dims(y) == (("data",), ("model",))
    if axis_type == st.EXPLICIT:
        assert st.dims(dx) == st.dims(x) and st.dims(dw) == st.dims(w)


def test_bf16_compute_dtypes_and_rounding():
    """bf16 compute from fp32 operands, data + tensor parallel: y in bf16, dx and dkernel
    in fp32, within bf16 rounding of the unsharded call."""
    mesh, x, w, sizes, weights = _placed("tokens_columns", st.EXPLICIT)
    fn = _loss(_project("pallas_triton", jnp.bfloat16))
    with jax.set_mesh(mesh):
        y = jax.jit(_project("pallas_triton", jnp.bfloat16))(x, w, sizes)
        got = jax.jit(fn)(x, w, sizes, weights)
    assert y.dtype == jnp.bfloat16 and got[1][0].dtype == got[1][1].dtype == jnp.float32
    _assert_close(got, _want(x, w, sizes, weights, jnp.bfloat16), value_rtol=1e-2)


@pytest.mark.parametrize("name", MOSAIC)
@pytest.mark.parametrize("layout", ["tokens_columns", "contraction"])
def test_mosaic_kernels_compile_with_the_same_collectives(layout, name):
    mesh, *args = _placed(layout, st.EXPLICIT)
    with jax.set_mesh(mesh):
        _check_collectives(_loss(_project(name)), args, layout)


# --------------------------------------------------------- inside the caller's shard_map


def _dense(x, w, sizes):
    """The grouped product as one masked einsum (plain jnp: JAX differentiates it)."""
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(x.shape[0])[:, None]
    member = ((rows >= ends - sizes) & (rows < ends)).astype(jnp.float32)
    return jnp.einsum("mk,gkn,mg->mn", x, w, member, precision=_HI)


def _local_sizes(rng, shards):
    """Per-shard group sizes [shards, G] over M // shards local rows (some empty)."""
    rows = M // shards
    out = np.zeros((shards, G), np.int32)
    for s in range(shards):
        cuts = np.sort(rng.integers(0, rows - 2, G - 1))
        out[s] = np.diff(np.concatenate([[0], cuts, [rows - 2 * (s % 2)]]))
    return out


def _manual_loss(project, mesh, specs, weights_spec, check_vma, axis_names=None):
    x_spec, w_spec = specs
    axes = tuple(mesh.axis_names) if axis_names is None else tuple(axis_names)

    def body(x, w, sizes, weights):
        y = project(x, w, sizes.reshape(-1)).astype(jnp.float32)
        return jax.lax.psum(jnp.sum(y * weights), axes)

    def loss(x, w, sizes, weights):
        kwargs = {} if axis_names is None else {"axis_names": frozenset(axis_names)}
        return jax.shard_map(body, mesh=mesh, check_vma=check_vma,
                             in_specs=(x_spec, w_spec, P(axes[0]), weights_spec),
                             out_specs=P(), **kwargs)(x, w, sizes, weights)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("name", RUNS_ON_CPU)
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_inside_shard_map_tokens(check_vma, name):
    """Local tokens with local group sizes on 8 shards (an MoE layer after its local
    sort), weights replicated: dkernel is summed over the shards as JAX sums a dot's."""
    mesh = st.mesh((8,), ("experts_dp",), st.EXPLICIT)
    x, w, _, weights = _inputs(1)
    sizes = _local_sizes(np.random.default_rng(0), 8)
    args = (st.put(x, mesh, "experts_dp"), st.put(w, mesh),
            st.put(jnp.asarray(sizes), mesh, "experts_dp"),
            st.put(weights, mesh, "experts_dp"))
    specs, wspec = (P("experts_dp"), P()), P("experts_dp")
    got = _manual_loss(_project(name), mesh, specs, wspec, check_vma)(*args)
    want = _manual_loss(_dense, mesh, specs, wspec, check_vma)(*args)
    _assert_close(got, want, value_rtol=1e-2)


@pytest.mark.parametrize("name", RUNS_ON_CPU)
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_inside_shard_map_tokens_and_columns(check_vma, name):
    """Tokens over one manual axis, the kernel's columns over another: dx is summed over
    the column shards (x does not vary there), dkernel over the token shards."""
    mesh = st.mesh((2, 4), ("d", "m"), st.EXPLICIT)
    x, w, _, weights = _inputs(2)
    sizes = _local_sizes(np.random.default_rng(1), 2)
    args = (st.put(x, mesh, "d"), st.put(w, mesh, None, None, "m"),
            st.put(jnp.asarray(sizes), mesh, "d"), st.put(weights, mesh, "d", "m"))
    specs, wspec = (P("d"), P(None, None, "m")), P("d", "m")
    got = _manual_loss(_project(name), mesh, specs, wspec, check_vma)(*args)
    want = _manual_loss(_dense, mesh, specs, wspec, check_vma)(*args)
    _assert_close(got, want, value_rtol=1e-2)
    hlo = jax.jit(_manual_loss(_project(name), mesh, specs, wspec, check_vma)).lower(
        *args).compile().as_text()
    assert "all-gather" not in st.collectives(hlo)


@pytest.mark.parametrize("name", RUNS_ON_CPU)
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_inside_shard_map_some_axes_manual(check_vma, name):
    """The caller's shard_map over the token axis only; the kernel's columns stay on an
    Explicit axis outside it, which pallasite maps itself (a nested shard_map over the
    remaining axis, never over the caller's); results vary over the caller's axis."""
    mesh = st.mesh((2, 4), ("d", "m"), st.EXPLICIT)
    x, w, _, weights = _inputs(3)
    sizes = _local_sizes(np.random.default_rng(2), 2)
    args = (st.put(x, mesh, "d"), st.put(w, mesh, None, None, "m"),
            st.put(jnp.asarray(sizes), mesh, "d"), st.put(weights, mesh, "d", "m"))
    specs, wspec = (P("d"), P()), P("d")
    with jax.set_mesh(mesh):
        fn = _manual_loss(_project(name), mesh, specs, wspec, check_vma, axis_names=("d",))
        got = fn(*args)
        want = _manual_loss(_dense, mesh, specs, wspec, check_vma, axis_names=("d",))(*args)
        found = st.collectives(fn.lower(*args).compile().as_text())
    _assert_close(got, want)
    assert "all-gather" not in found, found


# ------------------------------------------------------------------------- GPUs


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["pallas_mosaic_gpu", "pallas_triton", "xla"])
@pytest.mark.parametrize("mode", ["tokens_explicit", "columns_auto", "shard_map_vma",
                                  "shard_map_no_vma"])
def test_gpus(mode, name):
    """Tokens over two GPUs (Explicit), columns over two (Auto, no mesh in context), and
    local tokens inside the caller's shard_map with and without check_vma; bf16 compute,
    values and gradients against the unsharded call."""
    devices = st.gpus(two=not mode.startswith("shard_map"))
    m, k, n, g = 4096, 512, 1024, 8
    x, w, weights = st.grouped_inputs(5, m, k, n, g)
    sizes = jnp.asarray([700, 0, 900, 300, 512, 600, 400, 500], jnp.int32)  # 3912 < m
    project = functools.partial(grouped_projection, compute=jnp.bfloat16, implementation=name)
    if mode.startswith("shard_map"):
        shards = len(devices)
        mesh = st.mesh((shards,), ("d",), st.EXPLICIT, devices)
        local = np.stack([np.asarray([400, 0, 500, 100, 300, 300, 200, 200], np.int32)
                          * 2 // shards] * shards)
        args = (st.put(x, mesh, "d"), st.put(w, mesh), st.put(jnp.asarray(local), mesh, "d"),
                st.put(weights, mesh, "d"))
        check = mode == "shard_map_vma"
        got = _manual_loss(project, mesh, (P("d"), P()), P("d"), check)(*args)
        # The loss sums 4M products of either sign, so y's rounding alone moves it by more
        # than 1% of its value: the Pallas kernels store y in bf16, while XLA may keep y's
        # fp32 value where the consumer upcasts it (xla_allow_excess_precision). The
        # value must match one of the two; the gradients do not depend on y's rounding.
        dense_bf16 = lambda x, w, s: _dense(x, w, s).astype(jnp.bfloat16)  # noqa: E731
        want = _manual_loss(dense_bf16, mesh, (P("d"), P()), P("d"), check)(*args)
        unrounded = _manual_loss(_dense, mesh, (P("d"), P()), P("d"), check)(*args)[0]
        if abs(float(got[0]) - float(unrounded)) <= 1e-3 * abs(float(unrounded)):
            want = (unrounded, want[1])
    else:
        explicit = mode == "tokens_explicit"
        mesh = st.mesh((2,), ("d",), st.EXPLICIT if explicit else st.AUTO, devices)
        xs = st.put(x, mesh, "d") if explicit else st.put(x, mesh)
        ws = st.put(w, mesh) if explicit else st.put(w, mesh, None, None, "d")
        wts = st.put(weights, mesh, "d") if explicit else st.put(weights, mesh, None, "d")
        args = (xs, ws, sizes, wts)
        with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
            got = jax.jit(_loss(project))(*args)
            found = st.compiled_collectives(_loss(project), *args)
        assert "all-gather" not in found, found
        want = _want(x, w, sizes, weights, jnp.bfloat16)
    _assert_close(got, want, rtol=1e-3, atol=1e-3, value_rtol=1e-2)


# ------------------------------------------------------------- the lowered program


@pytest.mark.parametrize("name", RUNS_ON_CPU)
@pytest.mark.parametrize("mode", ["explicit", "explicit_no_mesh", "auto", "auto_no_mesh",
                                  "shard_map_vma", "shard_map_no_vma"])
def test_lowered_program_holds_the_kernel_boundaries(mode, name):
    """The forward, dx and dkernel (three products) each run in pallasite's own
    shard_map over the data and model axes (Explicit), in a custom_partitioning (Auto),
    or directly in the caller's shard_map with nothing nested (docs/sharding.md, "Kernel
    boundaries"); read from the jaxpr and the StableHLO."""
    way = "caller" if mode.startswith("shard_map") else mode.removesuffix("_no_mesh")
    mesh, x, w, sizes, weights = _placed("tokens_columns",
                                         st.AUTO if way == "auto" else st.EXPLICIT)
    args = (x, w, sizes, weights)
    fn = _loss(_project(name))
    if way == "caller":
        local = jnp.asarray(_local_sizes(np.random.default_rng(0), 2))
        args = (x, w, st.put(local, mesh, "data"), weights)
        fn = _manual_loss(_project(name), mesh, (P("data"), P(None, None, "model")),
                          P("data", "model"), mode == "shard_map_vma")
    with jax.set_mesh(mesh) if not mode.endswith("no_mesh") else contextlib.nullcontext():
        found = st.assert_kernel_boundaries(fn, args, way=way, axes=("data", "model"),
                                            products=3)
    pallas = [f for f in found if f[0] == "pallas_call"]
    assert len(pallas) == (3 if name == "pallas_triton" else 0), pallas


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_lowered_program_inside_a_shard_map_over_some_axes(check_vma):
    """The caller's shard_map over the token axis only, the kernel's columns on an
    Explicit axis outside it: pallasite's own shard_maps sit inside the caller's and are
    over the remaining axis alone, never over the caller's."""
    mesh = st.mesh((2, 4), ("d", "m"), st.EXPLICIT)
    x, w, _, weights = _inputs(3)
    sizes = _local_sizes(np.random.default_rng(2), 2)
    args = (st.put(x, mesh, "d"), st.put(w, mesh, None, None, "m"),
            st.put(jnp.asarray(sizes), mesh, "d"), st.put(weights, mesh, "d", "m"))
    with jax.set_mesh(mesh):
        fn = _manual_loss(_project("pallas_triton"), mesh, (P("d"), P()), P("d"),
                          check_vma, axis_names=("d",))
        found = st.boundaries(fn, *args)
    caller, inner = ("shard_map", frozenset({"d"})), ("shard_map", frozenset({"m"}))
    assert {(n, a) for n, a, chain in found if n == "shard_map" and not chain} == {caller}
    assert {(n, a, chain) for n, a, chain in found if chain and n != "pallas_call"} == {
        ("shard_map", frozenset({"m"}), (caller,))}
    kernels = [chain for n, _, chain in found if n == "pallas_call"]
    assert len(kernels) == 3 and set(kernels) == {(caller, inner)}, kernels
    assert not any(n == "custom_partitioning" for n, _, _ in found)
