"""grouped_projection in fp8: recipe="fp8" and pre-quantized (BlockScaled) operands.

Values and gradients against the oracle (pallasite.reference.quantization: the exact
fp32 products of the dequantized operands) for the XLA path and the Mosaic GPU kernels
(through their interpreter on CPU, compiled on an H200); the Triton kernels have their
own file (test_grouped_projection_fp8_triton.py). Edge cases of the bf16 contract (rows
past the total, empty groups, local experts, non-finite values, vmap, zero sizes), the
errors, the sharding routes on 8 CPU devices, and lowering for CUDA from the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding_testlib as st
from cuda_export_testlib import cuda_module
from pallasite.kernels import grouped_projection, quantize
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as mgpu
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu_fp8 as mgpu_fp8
from pallasite.kernels.grouped_matmul import pallas_triton_fp8 as triton_fp8
from pallasite.reference import quantization as q

F8 = jnp.float8_e4m3fn
SIZES = (100, 0, 250, 130)  # 480 of 600 rows: an empty group and rows past the total


def _inputs(seed=0, m=600, k=256, n=384, sizes=SIZES, dtype=jnp.bfloat16):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (len(sizes), k, n), jnp.float32) / 16).astype(dtype)
    dy = jax.random.normal(kd, (m, n), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), dy


def _rel(a, b):
    """Relative L2 error; the absolute one where the expected array is all zeros."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30 if b.any() else 1.0))


def _value_and_grads(project, x, w, sizes, dy):
    """y and (dx, dkernel), the group sizes and dy jit arguments: traced, as in training
    (constants would let XLA fold the group tables that the kernels read)."""
    def loss(x, w, sizes, dy):
        return jnp.sum(project(x, w, sizes).astype(jnp.float32) * dy)
    y = jax.jit(project)(x, w, sizes)
    return y, jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, sizes, dy)


def _oracle(x, w, sizes, dy, compute=jnp.float32, group_offset=None):
    if group_offset is None:
        project = lambda x, w, s: q.grouped_projection_fp8(x, w, s, compute)  # noqa: E731
    else:  # local experts: the kernel's groups padded with zero weights around it
        full = jnp.zeros((sizes.shape[0],) + w.shape[1:], w.dtype)

        def project(x, w, s):
            whole = jax.lax.dynamic_update_slice(full, w, (group_offset, 0, 0))
            return q.grouped_projection_fp8(x, whole, s, compute)
    return _value_and_grads(project, x, w, sizes, dy)


def _check(got, want, rel=2e-3):
    """The fp8 contract: relative L2 <= 2e-3 against the fp32 products of the dequantized
    operands (the outputs here are fp32, so the sums' order is all that differs)."""
    (y, (dx, dw)), (y_ref, (dx_ref, dw_ref)) = got, want
    for name, a, b in (("y", y, y_ref), ("dx", dx, dx_ref), ("dkernel", dw, dw_ref)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) <= rel, f"{name}: rel {_rel(a, b):.3g}"


def _fp8(name, compute=jnp.float32, **kw):
    return functools.partial(grouped_projection, compute=compute, interpret_on_cpu=True,
                             implementation=name, recipe="fp8", **kw)


# ------------------------------------------------------------------------- the recipe


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_recipe_on_xla_matches_the_oracle(dtype):
    x, w, sizes, dy = _inputs(dtype=dtype)
    got = _value_and_grads(_fp8("xla"), x, w, sizes, dy)
    _check(got, _oracle(x, w, sizes, dy), rel=1e-6)
    assert got[1][0].dtype == dtype and got[1][1].dtype == dtype  # straight-through dtypes
    assert float(jnp.max(jnp.abs(got[0][480:]))) == 0  # rows past the total
    assert float(jnp.max(jnp.abs(got[1][0][480:]))) == 0
    assert float(jnp.max(jnp.abs(got[1][1][1]))) == 0  # the empty group


def test_recipe_default_order_on_cpu_is_xla():
    x, w, sizes, dy = _inputs(seed=1)
    project = functools.partial(grouped_projection, compute=jnp.float32, recipe="fp8")
    _check(_value_and_grads(project, x, w, sizes, dy), _oracle(x, w, sizes, dy), rel=1e-6)


def test_recipe_on_mosaic_gpu_interpreter_matches_the_oracle():
    x, w, sizes, dy = _inputs(seed=2, m=520, sizes=(100, 0, 250, 130))
    _check(_value_and_grads(_fp8("pallas_mosaic_gpu"), x, w, sizes, dy),
           _oracle(x, w, sizes, dy))


def test_recipe_with_local_experts_matches_the_oracle():
    x, w, sizes, dy = _inputs(seed=3, sizes=(60, 140, 0, 200, 90))
    local = w[1:4]
    project = _fp8("xla", group_offset=1)
    # bf16 gradients: a sum in another order rounds a few elements the other way.
    _check(_value_and_grads(project, x, local, sizes, dy),
           _oracle(x, local, sizes, dy, group_offset=1), rel=1e-4)


def test_recipe_output_in_bf16_rounds_once():
    x, w, sizes, dy = _inputs(seed=4)
    y = _fp8("xla", compute=jnp.bfloat16)(x, w, sizes)
    want = q.grouped_projection_fp8(x, w, sizes, jnp.float32)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.bfloat16).astype(jnp.float32)))


def test_a_nan_stays_in_its_row_and_its_group():
    x, w, sizes, dy = _inputs(seed=5)
    x = x.at[120, 7].set(jnp.nan)  # group 2 (rows 100-349)
    y, (dx, dw) = _value_and_grads(_fp8("xla"), x, w, sizes, dy)
    bad = np.isnan(np.asarray(y)).any(axis=1)
    assert bad[120] and bad.sum() == 1
    dw_bad = np.isnan(np.asarray(dw)).any(axis=(1, 2))
    np.testing.assert_array_equal(dw_bad, [False, False, True, False])
    # Its token block's column 7 is NaN (the block's scale), no other column of dkernel.
    assert np.isnan(np.asarray(dw[2, 7])).all() and not np.isnan(np.asarray(dw[2, 8])).any()
    assert not np.isnan(np.asarray(dx)).any()


def test_recipe_under_vmap_matches_each_call():
    x, w, sizes, _ = _inputs(seed=6, m=256, sizes=(100, 0, 100, 56))
    xs = jnp.stack([x, x[::-1]])
    got = jax.vmap(lambda a: _fp8("xla")(a, w, sizes))(xs)
    for i in range(2):
        np.testing.assert_array_equal(got[i], _fp8("xla")(xs[i], w, sizes))


def test_recipe_zero_sizes_give_zeros():
    x, w, sizes, _ = _inputs()
    assert _fp8("xla")(x[:0], w, sizes * 0).shape == (0, w.shape[2])
    out = _fp8("xla")(x[:, :0], w[:, :0], sizes)
    assert out.shape == (x.shape[0], w.shape[2]) and float(jnp.max(jnp.abs(out))) == 0


def test_recipe_errors_name_the_argument():
    x, w, sizes, _ = _inputs()
    with pytest.raises(ValueError, match="recipe"):
        grouped_projection(x, w, sizes, jnp.float32, recipe="int8")
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match="compute"):
            grouped_projection(x, w, sizes, jnp.float64, recipe="fp8")
    with pytest.raises(RuntimeError, match="no fp8 products"):
        grouped_projection(x, w, sizes, jnp.float32, recipe="fp8",
                           implementation="pallas_mosaic_tpu")
    with pytest.raises(NotImplementedError, match="first-order"):
        jax.jvp(lambda a: grouped_projection(a, w, sizes, jnp.float32, recipe="fp8"),
                (x,), (x,))


# --------------------------------------------------------------- pre-quantized operands


def test_pre_quantized_operands_match_the_oracle():
    x, w, sizes, _ = _inputs(seed=7)
    xq, wq = quantize(x, (1, 128)), quantize(w, (1, 128, 128))
    want = q.grouped_projection_quantized(xq.values, xq.scales, wq.values, wq.scales, sizes,
                                          jnp.float32)
    for name in ("xla", "pallas_mosaic_gpu"):
        got = grouped_projection(xq, wq, sizes, jnp.float32, interpret_on_cpu=True,
                                 implementation=name)
        assert _rel(got, want) <= 1e-6, name
    # One operand quantized, the other quantized inside: the same product.
    np.testing.assert_array_equal(grouped_projection(xq, w, sizes, jnp.float32),
                                  grouped_projection(xq, wq, sizes, jnp.float32))


def test_pre_quantized_operands_are_not_differentiable():
    x, w, sizes, _ = _inputs()
    xq = quantize(x, (1, 128))
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda w: grouped_projection(xq, w, sizes, jnp.float32).sum())(w)


def test_pre_quantized_operands_need_the_recipe_blocks():
    x, w, sizes, _ = _inputs()
    with pytest.raises(ValueError, match=r"\(1, 128\)"):
        grouped_projection(quantize(x, (1, 64)), w, sizes, jnp.float32)
    with pytest.raises(ValueError, match=r"\(1, 128, 128\)"):
        grouped_projection(x, quantize(w, (1, 128, 64)), sizes, jnp.float32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        grouped_projection(quantize(x, (1, 128), jnp.float8_e5m2), w, sizes, jnp.float32)


# ------------------------------------------------------------------------- sharding


# Groups of whole 128-row blocks and 128-row shards: every token block is the same on one
# device and on eight, so the sharded call must equal the unsharded one.
ALIGNED = (256, 0, 384, 128, 256)
M8 = 1024


def _aligned(seed=8):
    x, w, sizes, dy = _inputs(seed=seed, m=M8, sizes=ALIGNED, dtype=jnp.float32)
    return x, w, sizes, dy


def _loss_grads(project):
    def loss(x, w, sizes, dy):
        return jnp.sum(project(x, w, sizes).astype(jnp.float32) * dy)
    return jax.value_and_grad(loss, argnums=(0, 1))


def _close(got, want):
    (v, (dx, dw)), (v_ref, (dx_ref, dw_ref)) = got, want
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["xla", "pallas_triton"])
@pytest.mark.parametrize("layout", ["tokens", "columns", "experts"])
@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO])
def test_recipe_under_jit_over_sharded_arrays_equals_one_device(name, layout, axis_type):
    x, w, sizes, dy = _aligned()
    project = _fp8(name)
    want = jax.jit(_loss_grads(project))(*(np.asarray(t) for t in (x, w, sizes, dy)))
    if layout == "tokens":
        mesh = st.mesh((8,), ("data",), axis_type)
        args = (st.put(x, mesh, "data"), st.put(w, mesh), sizes, st.put(dy, mesh, "data"))
    elif layout == "columns":  # 128 columns per shard: the same weight and dy blocks
        x, w, sizes, dy = _inputs(seed=8, m=M8, n=512, sizes=ALIGNED, dtype=jnp.float32)
        want = jax.jit(_loss_grads(project))(*(np.asarray(t) for t in (x, w, sizes, dy)))
        mesh = st.mesh((2, 4), ("data", "model"), axis_type)
        args = (st.put(x, mesh, "data"), st.put(w, mesh, None, None, "model"), sizes,
                st.put(dy, mesh, "data", "model"))
    else:  # experts: the kernel's groups over "expert", the tokens over "data"
        x, w, sizes, dy = _inputs(seed=9, m=M8, sizes=(256, 0, 384, 128, 128, 0, 128, 0),
                                  dtype=jnp.float32)
        want = jax.jit(_loss_grads(project))(*(np.asarray(t) for t in (x, w, sizes, dy)))
        mesh = st.mesh((2, 4), ("data", "expert"), axis_type)
        args = (st.put(x, mesh, "data"), st.put(w, mesh, "expert"), sizes,
                st.put(dy, mesh, "data"))
    with jax.set_mesh(mesh):
        got = jax.jit(_loss_grads(project))(*args)
    _close(got, want)


def test_recipe_inside_a_callers_shard_map_uses_the_local_arrays():
    x, w, sizes, dy = _aligned()
    mesh = st.mesh((8,), ("data",), st.EXPLICIT)
    rows = M8 // 8

    def local(x, w, sizes, dy):  # each shard's own group sizes, as MoE layers pass them
        me = jax.lax.axis_index("data")
        ends = jnp.clip(jnp.cumsum(sizes) - me * rows, 0, rows)
        mine = jnp.diff(jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]))
        value, (dx, dw) = _loss_grads(_fp8("xla"))(x, w, mine, dy)
        # dkernel of the replicated kernel comes back summed over the token shards.
        return jax.lax.psum(value, "data"), dx, dw

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P(), P("data")),
                                out_specs=(P(), P("data"), P())))
    value, dx, dw = run(st.put(x, mesh, "data"), st.put(w, mesh), sizes, st.put(dy, mesh, "data"))
    _close((value, (dx, dw)), jax.jit(_loss_grads(_fp8("xla")))(x, w, sizes, dy))


def test_pre_quantized_operands_inside_a_callers_shard_map():
    x, w, sizes, _ = _aligned()
    xq, wq = quantize(x, (1, 128)), quantize(w, (1, 128, 128))
    mesh = st.mesh((8,), ("data",), st.EXPLICIT)
    rows = M8 // 8

    def local(xq, wq, sizes):
        me = jax.lax.axis_index("data")
        ends = jnp.clip(jnp.cumsum(sizes) - me * rows, 0, rows)
        mine = jnp.diff(jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]))
        return grouped_projection(xq, wq, mine, jnp.float32)

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P()),
                                out_specs=P("data")))
    placed = jax.tree.map(lambda a: st.put(a, mesh, "data"), xq)
    np.testing.assert_allclose(run(placed, jax.tree.map(lambda a: st.put(a, mesh), wq), sizes),
                               grouped_projection(xq, wq, sizes, jnp.float32), rtol=1e-6,
                               atol=1e-6)


def test_recipe_under_jit_gathers_nothing():
    x, w, sizes, dy = _aligned()
    mesh = st.mesh((8,), ("data",), st.EXPLICIT)
    args = (st.put(x, mesh, "data"), st.put(w, mesh), sizes, st.put(dy, mesh, "data"))
    with jax.set_mesh(mesh):
        found = st.compiled_collectives(_loss_grads(_fp8("xla")), *args)
    assert "all-gather" not in found and "all-to-all" not in found, found


# ------------------------------------------------------------ lowering for an H200


@pytest.mark.parametrize("product,steps_per_stage,cluster",
                         [("forward", 1, 1), ("forward", 2, 1), ("forward", 1, 2),
                          ("dx", 1, 1), ("dx", 2, 1), ("dx", 1, 2), ("dkernel", 1, 1)])
def test_mosaic_gpu_fp8_kernels_lower_for_cuda_from_cpu(product, steps_per_stage, cluster,
                                                        monkeypatch):
    """Layout inference, the fp8 wgmma (both operands K-major) and the TMA loads of the
    scales lower for every product, gmm's with one and two steps per stage and with
    A multicast to clusters of two (the interpreter runs no clusters: their values are
    checked on the GPU)."""
    monkeypatch.setattr(mgpu, "_num_programs", lambda interpret: 132)
    s = jax.ShapeDtypeStruct
    m, k, n, g = 4096, 512, 1024, 8
    f32 = jnp.float32
    if product == "dkernel":
        f = lambda *a: mgpu_fp8.tgmm_quantized(*a)  # noqa: E731
        args = (s((k, 128 * 44), F8), s((44, k), f32), s((n, 128 * 44), F8), s((44, n), f32),
                s((g,), jnp.int32), s((g,), jnp.int32))
    else:
        out, contraction = (n, k) if product == "forward" else (k, n)
        bs = mgpu_fp8.MosaicGpuFp8BlockSizes(steps_per_stage=steps_per_stage, cluster=cluster)
        f = lambda *a: mgpu_fp8.gmm_quantized(*a, product=product, block_sizes=bs)  # noqa: E731
        args = (s((m, contraction), F8), s((contraction // 128, m), f32),
                s((g, out, contraction), F8), s((g, out // 128, contraction // 128), f32),
                s((g,), jnp.int32))
    assert "mosaic_gpu" in cuda_module(f, *args, allow_triton=False)


@pytest.mark.parametrize("module", [mgpu_fp8, triton_fp8], ids=["mosaic_gpu", "triton"])
def test_dkernel_kernels_read_their_group_table_from_a_buffer_of_its_own(module, monkeypatch):
    """Each local group's first token block and block count are slices of the token-block
    table. Handed to a kernel as they are, XLA on a GPU may pass a slice as an offset
    into the sliced buffer, which Mosaic GPU refuses ("Input buffer 0 is not 256-byte
    aligned", seen on an H200 with traced group sizes): the kernels take them stacked."""
    monkeypatch.setattr(mgpu, "_num_programs", lambda interpret: 132)
    x, w, sizes, dy = _inputs(m=600, k=256, n=384)
    jaxpr = jax.make_jaxpr(lambda a, b, s: module.tgmm(a, b, s))(x, dy, sizes).jaxpr
    producers, table = {}, []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pallas_call", "mpmd_map") and "tgmm" in str(
                eqn.params["name"]):
            table.append(producers.get(eqn.invars[0]))
        producers.update((v, eqn.primitive.name) for v in eqn.outvars)
    assert len(table) == 1 and table[0] in ("stack", "concatenate"), table  # not a slice


def test_mosaic_gpu_fp8_block_sizes_are_checked():
    with pytest.raises(ValueError, match="stages"):
        mgpu_fp8.MosaicGpuFp8BlockSizes(stages=1)
    with pytest.raises(ValueError, match="grid_block_n"):
        mgpu_fp8.MosaicGpuFp8BlockSizes(grid_block_n=0)
    with pytest.raises(ValueError, match="steps_per_stage"):
        mgpu_fp8.MosaicGpuFp8BlockSizes(steps_per_stage=3)
    with pytest.raises(ValueError, match="cluster"):
        mgpu_fp8.MosaicGpuFp8BlockSizes(cluster=4)


def _quantized_forward_operands(k, seed=0, n=384):
    x, w, sizes, _ = _inputs(seed=seed, m=600, k=k, n=n)
    xq, wq = quantize(x, (1, 128)), quantize(w, (1, 128, 128))
    want = q.grouped_projection_quantized(xq.values, xq.scales, wq.values, wq.scales, sizes,
                                          jnp.float32)
    # The kernel layouts: x's scales transposed, the weights K-major (module docstring).
    args = (xq.values, xq.scales.T, jnp.swapaxes(wq.values, 1, 2), jnp.swapaxes(wq.scales, 1, 2),
            sizes)
    return args, want


@pytest.mark.parametrize("k", [512, 384], ids=["even_steps", "odd_steps"])
def test_mosaic_gpu_fp8_two_steps_per_stage_match_the_oracle(k):
    """steps_per_stage=2 (the second step's wgmmas in flight while the first is promoted)
    against the exact products, on the interpreter; an odd number of 128-deep steps
    runs one per stage. Rows past the group total must come back zero (the output is
    poisoned nowhere else: the kernel writes every row of its padded output)."""
    args, want = _quantized_forward_operands(k)
    for depth in (1, 2):
        bs = mgpu_fp8.MosaicGpuFp8BlockSizes(stages=2, grid_block_n=2, steps_per_stage=depth)
        got = mgpu_fp8.gmm_quantized(*args, out_dtype=jnp.float32, block_sizes=bs,
                                     interpret=True)
        assert _rel(got, want) <= 2e-3, depth
        assert float(jnp.max(jnp.abs(got[480:]))) == 0, depth


# ----------------------------------------------------------------------------- GPU


def _gpu_cases():
    return [
        ("dirichlet", 8192, 512, 768, (2000, 1500, 0, 3000, 1692)),
        ("total_lt_m", 4096, 256, 384, (1000, 0, 2001, 0)),
        ("odd_dims", 1000, 200, 300, (1, 300, 0, 7, 600)),
        ("many_small", 8192, 256, 512, tuple([128] * 32 + [100] * 20)),
        ("all_empty", 1024, 128, 256, (0, 0, 0, 0)),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: c[0])
def test_recipe_on_the_gpu_matches_the_oracle(case):
    _, m, k, n, sizes = case
    x, w, sizes, dy = _inputs(seed=11, m=m, k=k, n=n, sizes=sizes)
    want = _oracle(x, w, sizes, dy)
    for name in ("pallas_mosaic_gpu", "pallas_triton"):
        _check(_value_and_grads(_fp8(name), x, w, sizes, dy), want)
    # bf16 output: within bf16's rounding of the fp32 result.
    y = _fp8("pallas_mosaic_gpu", compute=jnp.bfloat16)(x, w, sizes)
    assert _rel(y, want[0]) <= 4e-3


@pytest.mark.gpu
def test_recipe_default_order_on_hopper_takes_mosaic_gpu_and_keeps_nans_local():
    x, w, sizes, dy = _inputs(seed=12, m=4096, k=512, n=768, sizes=(1000, 0, 2500, 500))
    x = x.at[1500, 3].set(jnp.nan).at[4050, 5].set(jnp.nan)  # group 2; past the total (4000)
    project = functools.partial(grouped_projection, compute=jnp.float32, recipe="fp8")
    y, (dx, dw) = _value_and_grads(project, x, w, sizes, dy)
    bad = np.isnan(np.asarray(y)).any(axis=1)
    assert bad[1500] and bad.sum() == 1  # the row past the total stays zero
    assert float(jnp.max(jnp.abs(jnp.nan_to_num(y[4000:])))) == 0
    np.testing.assert_array_equal(np.isnan(np.asarray(dw)).any(axis=(1, 2)),
                                  [False, False, True, False])
    assert not np.isnan(np.asarray(dx)).any()


@pytest.mark.gpu
def test_pre_quantized_operands_on_the_gpu():
    x, w, sizes, _ = _inputs(seed=13, m=4096, k=512, n=768, sizes=(1000, 0, 2500, 500))
    xq, wq = quantize(x, (1, 128)), quantize(w, (1, 128, 128))
    want = q.grouped_projection_quantized(xq.values, xq.scales, wq.values, wq.scales, sizes,
                                          jnp.float32)
    for name in ("pallas_mosaic_gpu", "pallas_triton", None):
        got = grouped_projection(xq, wq, sizes, jnp.float32, implementation=name)
        assert _rel(got, want) <= 2e-3, name


@pytest.mark.gpu
@pytest.mark.parametrize("steps_per_stage,cluster", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_mosaic_gpu_fp8_block_variants_on_the_gpu(steps_per_stage, cluster):
    """The forward from pre-quantized operands with each steps_per_stage and cluster,
    compiled: the two-step promotion's wait (one wgmma group left in flight) must not
    read a product before it is done, the 64-column epilogue strips must cover the tile,
    and a cluster's multicast A must reach both programs (384 columns: three tiles, an
    odd count that runs unclustered, beside 512)."""
    args, want = _quantized_forward_operands(k=1024, seed=14)
    bs = mgpu_fp8.MosaicGpuFp8BlockSizes(steps_per_stage=steps_per_stage, cluster=cluster)
    wide_args, wide_want = _quantized_forward_operands(k=1024, seed=15, n=512)
    got = mgpu_fp8.gmm_quantized(*wide_args, out_dtype=jnp.float32, block_sizes=bs)
    assert _rel(got, wide_want) <= 2e-3
    assert float(jnp.max(jnp.abs(got[480:]))) == 0
    for out_dtype in (jnp.float32, jnp.bfloat16):
        got = mgpu_fp8.gmm_quantized(*args, out_dtype=out_dtype, block_sizes=bs)
        assert got.dtype == out_dtype
        assert _rel(got, want) <= (2e-3 if out_dtype == jnp.float32 else 4e-3), out_dtype
        assert float(jnp.max(jnp.abs(got[480:].astype(jnp.float32)))) == 0


@pytest.mark.gpu
@pytest.mark.gpu_memory_hog
def test_recipe_with_weights_past_2_31_fp8_values():
    """DeepSeek-V3's 256 experts of 7168 x 2048 on one device: 3.76e9 fp8 weight values,
    past the 32-bit offsets of Pallas Triton's stores (the quantizer takes its XLA form
    there). The forward and dx of the default recipe against the oracle, on rows of the
    first group, a group past the wrap (147) and the last. Its 7.5 GB bf16 weights, their
    fp32 forms in the XLA quantizer and the oracle's copies need more than an 80 GB card
    holds (out of memory on an H100 80GB on 2026-12-05; it passes on an H200): it runs
    where the device holds at least 100 GiB."""
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
    if limit < 100 * 2**30:
        pytest.skip(f"needs a device of at least 100 GiB (an H200); this one holds "
                    f"{limit / 2**30:.0f} GiB")
    g, k, n, per = 256, 7168, 2048, 16
    kx, kw, kd = jax.random.split(jax.random.key(21), 3)
    w = jax.random.normal(kw, (g, k, n), jnp.bfloat16) / 16
    x = jax.random.normal(kx, (g * per, k), jnp.float32)  # dx in fp32: no rounding
    dy = jax.random.normal(kd, (g * per, n), jnp.bfloat16)
    sizes = jnp.full((g,), per, jnp.int32)
    project = functools.partial(grouped_projection, compute=jnp.float32, recipe="fp8")
    y, vjp = jax.vjp(lambda x: project(x, w, sizes), x)
    (dx,) = vjp(dy.astype(jnp.float32))
    for gi in (0, 147, 255):
        rows = slice(gi * per, (gi + 1) * per)
        wq = q.quantized_kernel(w[gi][None])[0]
        assert _rel(y[rows], q.quantized_rows(x[rows]) @ wq) <= 2e-3, gi
        assert _rel(dx[rows], q.quantized_rows(dy[rows]) @ wq.T) <= 2e-3, gi
