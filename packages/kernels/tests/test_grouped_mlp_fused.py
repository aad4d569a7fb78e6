"""grouped_mlp's fused gate-up (h = act(x W_gate) * (x W_up) in the kernel's epilogue) on
Mosaic GPU and Pallas Triton, and its differentiable form (expert_mlp.ops): against the
definition's first half in the interpreters on the CPU (both activations, empty groups,
rows past the total, m off the 8-row grid, f padded to the tile, local experts, bf16
rounded once, both gradients), lowered for an H200 from the CPU, and on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export_testlib import cuda_module
from pallasite.kernels import platform
from pallasite.kernels.expert_mlp import ops
from pallasite.kernels.expert_mlp import pallas_mosaic_gpu as fused_mgpu
from pallasite.kernels.expert_mlp import pallas_triton as fused_triton
from pallasite.kernels.grouped_matmul import config
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as mgpu
from pallasite.reference.grouped_mlp import activate
from pallasite.reference.grouped_projection import gmm_reference
from pallasite.reference.inputs import random_group_sizes
from pallasite.reference.parity import EXACT_FP32, assert_close

BF16 = jnp.bfloat16
BACKENDS = {"pallas_mosaic_gpu": fused_mgpu, "pallas_triton": fused_triton}
# Interpreter-sized tiles: Mosaic GPU 64 rows x (2 x 64) columns of h, 2 stages; Triton
# 32 x 32 with 32-deep steps (blocks that do not divide m, k or f: masked edges).
SMALL = {"pallas_mosaic_gpu": mgpu.MosaicGpuBlockSizes(block_m=64, block_n=64, block_k=64,
                                                       stages=2, grid_block_n=2,
                                                       warp_specialized=True),
         "pallas_triton": config.TritonBlockSizes(32, 32, 32, group_m=2, num_warps=4,
                                                  num_stages=2)}


def _operands(seed, m, k, f, g, dtype=BF16):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (g, k, 2 * f), jnp.float32) / np.sqrt(k)).astype(dtype)
    return x, w


def _h_reference(x, w, sizes, activation):
    """act(gate) * up in fp32 from fp32 products of the same (rounded) operands."""
    pre = gmm_reference(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    return activate(pre, activation)


def _around(w):
    """w [2, k, 2f] as experts [1, 3) of 4: the others' weights zero (act(0) * 0 = 0)."""
    other = jnp.zeros_like(w[:1])
    return jnp.concatenate([other, w, other])


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_written_out_activations_match_the_reference(activation):
    """The kernels' activation and its derivative (exp, tanh and arithmetic only) against
    the reference's jax.nn form and its jax.grad, over [-30, 30] in fp32."""
    from pallasite.kernels.expert_mlp import epilogue
    from pallasite.reference.grouped_mlp import ACTIVATIONS

    t = jnp.linspace(-30.0, 30.0, 4001, dtype=jnp.float32)
    act, d_act = epilogue.activation_and_derivative(t, activation)
    np.testing.assert_allclose(act, ACTIVATIONS[activation](t), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(d_act, jax.vmap(jax.grad(ACTIVATIONS[activation]))(t),
                               rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(epilogue.activation_fp32(t, activation), act, rtol=2e-6,
                               atol=2e-6)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("m,k,f,sizes", [
    (200, 128, 128, [70, 0, 100]),   # an empty group, 30 rows past the total
    (131, 64, 64, [3, 60, 1, 0, 57]),  # m off the 8-row grid; one tile half past f
    (96, 64, 192, [0, 0, 0]),        # every group empty: zeros
    (160, 192, 96, [50, 110]),       # f = 96: padded (Mosaic GPU) or masked (Triton)
])
def test_interpret_gate_up_matches_the_definition(m, k, f, sizes, activation, backend):
    gs = jnp.array(sizes, jnp.int32)
    x, w = _operands(m + f, m, k, f, len(sizes))
    h = BACKENDS[backend].gate_up(x, w, gs, activation=activation, out_dtype=jnp.float32,
                                  block_sizes=SMALL[backend], interpret=True)
    assert h.shape == (m, f) and h.dtype == jnp.float32
    assert_close(h, _h_reference(x, w, gs, activation), dtype=jnp.float32, tol=EXACT_FP32,
                 what=f"gate_up {activation}")
    assert (np.asarray(h)[sum(sizes):] == 0).all()


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("m,k,f,sizes", [
    (200, 128, 128, [70, 0, 100]), (131, 64, 80, [3, 60, 1, 0, 57]), (96, 64, 64, [0, 0, 0]),
])
def test_interpret_gate_up_grad_matches_the_definition(m, k, f, sizes, activation, backend):
    """The backward's fused kernel: d(pre) = [act'(gate) up dh, act(gate) dh] from the
    sums recomputed in-kernel, fp32 output against the definition's vjp (dh in the
    operand dtype, as the kernels read it); f = 80 leaves the last tile part empty
    (Triton masks it, Mosaic GPU pads f); rows past the total are zero."""
    gs = jnp.array(sizes, jnp.int32)
    x, w = _operands(m + k, m, k, f, len(sizes))
    dh = jax.random.normal(jax.random.key(m), (m, f), jnp.float32).astype(BF16)
    got = BACKENDS[backend].gate_up_grad(x, w, gs, dh, activation=activation,
                                         out_dtype=jnp.float32, block_sizes=SMALL[backend],
                                         interpret=True)
    pre = gmm_reference(x.astype(jnp.float32), w.astype(jnp.float32), gs)
    _, vjp = jax.vjp(lambda p: activate(p, activation), pre)
    (want,) = vjp(dh.astype(jnp.float32))
    assert got.shape == (m, 2 * f)
    assert_close(got, want, dtype=jnp.float32, tol=EXACT_FP32, what="d(pre)")
    assert (np.asarray(got)[sum(sizes):] == 0).all()


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_interpret_gate_up_local_experts_and_bf16_output(backend):
    """rhs holds groups [1, 3) of four: the other experts' rows are zero; h in bf16 is
    the fp32 result rounded once."""
    sizes = jnp.array([20, 30, 25, 15], jnp.int32)
    x, w = _operands(3, 96, 64, 64, 2)
    h = BACKENDS[backend].gate_up(x, w, sizes, group_offset=jnp.int32(1),
                                  block_sizes=SMALL[backend], interpret=True)
    assert h.dtype == BF16
    ref = _h_reference(x, _around(w), sizes, "swiglu")
    assert_close(h, ref, dtype=BF16, what="gate_up, local experts")
    h = np.asarray(h, np.float32)
    assert (h[:20] == 0).all() and (h[75:] == 0).all()
    same = np.mean(h[20:75] == np.asarray(ref.astype(BF16), np.float32)[20:75])
    assert same > 0.95, same


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("local", [False, True])
def test_interpret_gate_up_activation_gradients(activation, local, backend):
    """The differentiable form's forward and backward (the pre-activation recomputed from
    x, the grouped dx and dkernel) against the definition's first half under jax.vjp,
    bf16 operands; with local experts (groups [1, 3) of 4) too."""
    sizes = jnp.array([40, 0, 50, 30] if local else [40, 0, 50], jnp.int32)
    x, w = _operands(5, 136, 64, 64, 2 if local else 3)
    dh = jax.random.normal(jax.random.key(6), (136, 64), jnp.float32)
    widen = _around if local else (lambda t: t)

    def ours(a, b):
        return ops.gate_up_activation(a, b, sizes, BF16, backend=backend,
                                      activation=activation,
                                      group_offset=1 if local else None, interpret=True)

    def definition(a, b):
        return _h_reference(a, widen(b), sizes, activation)

    h, vjp = jax.vjp(ours, x, w)
    h_ref, vjp_ref = jax.vjp(definition, x, w)
    assert h.dtype == BF16
    assert_close(h, h_ref, dtype=BF16, what="h")
    (dx, dw), (dx_ref, dw_ref) = vjp(dh.astype(BF16)), vjp_ref(dh)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert_close(dx, dx_ref, dtype=BF16, what="dx")
    assert_close(dw, dw_ref, dtype=BF16, what="dkernel")
    if local:  # rows of the other experts: no gradient
        assert not np.asarray(dx[:40], np.float32).any()
        assert not np.asarray(dx[90:], np.float32).any()


@pytest.mark.parametrize("sizes", [[3, 60, 1, 0, 57], [0, 0, 0, 0, 0]])
def test_interpret_triton_down_weighted_and_its_gradient(sizes):
    """The down product with the row weights in its epilogue: y exact in fp32 against
    (h W) * weights, zero past the total; its backward's dh (bf16) and d row_weights
    (from the same tiles) against autodiff of the definition; f = 80 and n = 96 leave
    edge tiles part empty."""
    m, f, n = 131, 80, 96
    gs = jnp.array(sizes, jnp.int32)
    k = jax.random.split(jax.random.key(sum(sizes)), 4)
    h = jax.random.normal(k[0], (m, f)).astype(BF16)
    w = (jax.random.normal(k[1], (5, f, n)) / 8).astype(BF16)
    rw = jax.random.uniform(k[2], (m,), minval=0.1, maxval=1.0)
    dy = jax.random.normal(k[3], (m, n)).astype(BF16)
    bs = SMALL["pallas_triton"]
    y = fused_triton.down_weighted(h, w, gs, rw, out_dtype=jnp.float32, block_sizes=bs,
                                   interpret=True)

    def definition(h32, weights):
        return gmm_reference(h32, w.astype(jnp.float32), gs) * weights[:, None]

    assert_close(y, definition(h.astype(jnp.float32), rw), dtype=jnp.float32,
                 tol=EXACT_FP32, what="y")
    assert (np.asarray(y)[sum(sizes):] == 0).all()
    dh, d_rw = fused_triton.down_weighted_grad(dy, w, gs, rw, h, block_sizes=bs,
                                               interpret=True)
    _, vjp = jax.vjp(definition, h.astype(jnp.float32), rw)
    dh_ref, d_rw_ref = vjp(dy.astype(jnp.float32))
    assert dh.dtype == BF16 and d_rw.dtype == jnp.float32
    assert_close(dh, dh_ref, dtype=BF16, what="dh")
    assert_close(d_rw, d_rw_ref, dtype=jnp.float32, tol=EXACT_FP32, what="d row_weights")
    # fp32 dh (partial sums over a split n are summed before the one rounding)
    dh32, _ = fused_triton.down_weighted_grad(dy, w, gs, rw, h, block_sizes=bs,
                                              interpret=True, dh_dtype=jnp.float32)
    assert dh32.dtype == jnp.float32
    assert_close(dh32, dh_ref, dtype=jnp.float32, tol=EXACT_FP32, what="dh in fp32")


def _down_operands(seed, m, f, n, g):
    """h [m, f] and w [g, f, n] in bf16, row weights in [0.1, 1), dy [m, n] fp32."""
    k = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(k[0], (m, f)).astype(BF16),
            (jax.random.normal(k[1], (g, f, n)) / 8).astype(BF16),
            jax.random.uniform(k[2], (m,), minval=0.1, maxval=1.0),
            jax.random.normal(k[3], (m, n), jnp.float32))


@pytest.mark.parametrize("blocks", ["tuned", "pingpong"])
def test_mosaic_gpu_down_weighted_scales_the_sums_in_its_epilogue(blocks):
    """The Mosaic GPU down kernel (the cooperative gmm, each consumer's row weights in by
    TMA): y exact in fp32 against (h W) * weights and zero past the total, n = 192 a
    3-half tile width (the last tile's second half idle), rows not a tile multiple; a
    ping-pong block choice runs as the cooperative kernel with its tiles."""
    m, n = 200, 192
    gs = jnp.array([70, 0, 59, 31], jnp.int32)  # 40 rows past the total
    h, w, rw, _ = _down_operands(22, m, 64, n, 4)
    bs = None if blocks == "tuned" else mgpu.GMM_PINGPONG
    y = fused_mgpu.down_weighted(h, w, gs, rw, out_dtype=jnp.float32, block_sizes=bs,
                                 interpret=True)
    want = gmm_reference(h.astype(jnp.float32), w.astype(jnp.float32), gs) * rw[:, None]
    assert y.dtype == jnp.float32 and y.shape == (m, n)
    assert_close(y, want, dtype=jnp.float32, tol=EXACT_FP32, what="y")
    assert not np.asarray(y[160:]).any()


@pytest.mark.parametrize("sizes", [[3, 60, 1, 0, 57], [0, 0, 0, 0, 0]])
@pytest.mark.parametrize("dh_dtype", [BF16, jnp.float32])
def test_mosaic_gpu_down_weighted_grad_forms_dh_and_the_weights_share(sizes, dh_dtype):
    """The Mosaic GPU down backward for h: t = dy W^T (the gmm's dx, cooperative kernel)
    with dh = weights * t and each row's sum of h * t formed in its epilogue (h's tile in
    by TMA), the shares summed over the tiles' valid rows; against autodiff of the
    definition. m = 131 and f = 192 leave part-empty tiles (f padded to whole 256-wide
    tiles), rows past the total get zeros, and fp32 dh is exact."""
    m, f, n = 131, 192, 96
    gs = jnp.array(sizes, jnp.int32)
    h, w, rw, dy = _down_operands(sum(sizes) + 3, m, f, n, 5)
    dy = dy.astype(BF16)
    dh, d_rw = fused_mgpu.down_weighted_grad(dy, w, gs, rw, h, interpret=True,
                                             dh_dtype=dh_dtype)

    def definition(h32, weights):
        return gmm_reference(h32, w.astype(jnp.float32), gs) * weights[:, None]

    _, vjp = jax.vjp(definition, h.astype(jnp.float32), rw)
    dh_ref, d_rw_ref = vjp(dy.astype(jnp.float32))
    assert dh.dtype == dh_dtype and dh.shape == (m, f) and d_rw.dtype == jnp.float32
    tol = EXACT_FP32 if dh_dtype == jnp.float32 else None
    assert_close(dh, dh_ref, dtype=dh_dtype, tol=tol, what="dh")
    assert_close(d_rw, d_rw_ref, dtype=jnp.float32, tol=EXACT_FP32, what="d row_weights")
    assert not np.asarray(dh[sum(sizes):], np.float32).any()
    assert not np.asarray(d_rw[sum(sizes):]).any()


def test_mosaic_gpu_down_weighted_and_its_backward():
    """ops.down_weighted on Mosaic GPU: y rounded once from the scaled sums, and the
    backward's dh and d row_weights from one kernel (keeping h, not y); values and the
    three gradients against the definition."""
    gs = jnp.array([100, 0, 90, 30], jnp.int32)  # 36 rows past the total
    h, w, rw, dy = _down_operands(21, 256, 64, 128, 4)

    def ours(a, b, r):
        return ops.down_weighted(a, b, gs, r, BF16, backend="pallas_mosaic_gpu",
                                 interpret=True)

    def definition(a, b, r):
        return gmm_reference(a.astype(jnp.float32), b.astype(jnp.float32), gs) * r[:, None]

    y, vjp = jax.vjp(ours, h, w, rw)
    y_ref, vjp_ref = jax.vjp(definition, h, w, rw)
    assert y.dtype == BF16 and not np.asarray(y[220:], np.float32).any()
    assert_close(y, y_ref, dtype=BF16, what="y")
    for got, want, name in zip(vjp(dy.astype(BF16)), vjp_ref(dy), ("dh", "dW", "d_rw")):
        assert_close(got, want, dtype=BF16, what=name)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gate_up_refuses_bad_arguments(backend):
    x, w = _operands(0, 64, 64, 64, 2)
    gs = jnp.array([30, 34], jnp.int32)
    gate_up = BACKENDS[backend].gate_up
    with pytest.raises(ValueError, match="activation='relu'"):
        gate_up(x, w, gs, activation="relu", interpret=True)
    with pytest.raises(ValueError, match="even last dim"):
        gate_up(x, w[..., :-1], gs, interpret=True)
    with pytest.raises(ValueError, match=r"dh must be \[m, f\]"):
        BACKENDS[backend].gate_up_grad(x, w, gs, x[:, :32], interpret=True)
    with pytest.raises(ValueError, match="backend='xla'"):
        ops.gate_up_activation(x, w, gs, BF16, backend="xla")


def test_mosaic_gpu_gate_up_tiles():
    """Only the cooperative warp-specialised kernel; its default fits 4 stages: 128 x 64
    lhs and two 64 x 128 rhs blocks (48 KiB a stage) beside two 128 x 64 bf16 slots."""
    x, w = _operands(0, 64, 64, 64, 2)
    with pytest.raises(ValueError, match="cooperative warp-specialised"):
        fused_mgpu.gate_up(x, w, jnp.array([30, 34], jnp.int32),
                           block_sizes=mgpu.GMM_LARGE_GROUPS, interpret=True)
    assert fused_mgpu._stages_that_fit(fused_mgpu.GATE_UP_DEFAULT, 2, 2) == 4


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gate_up_lowers_for_cuda_from_cpu(backend, activation, monkeypatch):
    """The default tiles lower for an H200: Mosaic GPU through layout inference, wgmma
    and TMA; Triton to its custom call. The differentiated op too (gate-up forward,
    gmm, dx and tgmm backward)."""
    monkeypatch.setattr(mgpu, "_num_programs", lambda interpret: 132)
    m, k, f, g = 4096, 512, 1024, 8
    s = jax.ShapeDtypeStruct
    args = (s((m, k), BF16), s((g, k, 2 * f), BF16), s((g,), jnp.int32))

    def loss(a, b, c):
        h = ops.gate_up_activation(a, b, c, BF16, backend=backend, activation=activation)
        return jnp.sum(h.astype(jnp.float32))

    fns = [lambda a, b, c: BACKENDS[backend].gate_up(a, b, c, activation=activation),
           jax.grad(loss, argnums=(0, 1))]
    def down_loss(a, b, c):  # the down product with the row weights, and its gradient:
        # x as h [m, k], the [g, k, 2f] kernel as a down kernel
        y = ops.down_weighted(a, b, c, jnp.ones((m,), jnp.float32), BF16, backend=backend)
        return jnp.sum(y.astype(jnp.float32))
    fns.append(jax.grad(down_loss, argnums=(0, 1)))
    for fn in fns:
        text = cuda_module(fn, *args)
        assert ("mosaic_gpu" if backend == "pallas_mosaic_gpu" else "triton") in text


@pytest.mark.parametrize("shape", [(65536, 14336, 4096, 8), (8192, 1408, 2880, 16)],
                         ids=["mixtral", "w2880"])
def test_mosaic_gpu_down_kernels_lower_at_model_shapes(shape, monkeypatch):
    """The down kernels with the row weights in their epilogues lower for an H200 at a
    model's widths, through Mosaic GPU's shared-memory check: the tuned 192-row tiles
    (mixtral) and a ping-pong choice (width 2880) run as the cooperative kernel, the
    backward on 128 x (2 x 128) tiles in two stages beside the h tiles."""
    monkeypatch.setattr(mgpu, "_num_programs", lambda interpret: 132)
    m, f, n, g = shape
    s = jax.ShapeDtypeStruct
    args = (s((m, f), BF16), s((g, f, n), BF16), s((g,), jnp.int32), s((m,), jnp.float32))

    def forward(h, w, sizes, rw):
        return ops.down_weighted(h, w, sizes, rw, BF16, backend="pallas_mosaic_gpu")

    def loss(h, w, sizes, rw):
        return jnp.sum(forward(h, w, sizes, rw).astype(jnp.float32))

    for fn in (forward, jax.grad(loss, argnums=(0, 1, 3))):
        text = cuda_module(fn, *args, allow_triton=False)
        assert "mosaic_gpu" in text
    dx = mgpu.resolve_block_sizes(None, product="dx", m=m, k=f, n=n, g=g, dtype=BF16,
                                  interpret=False)
    blocks, _ = fused_mgpu._cooperative(dx, f, BF16, BF16, "scaled_grad")
    assert (blocks.block_m, blocks.block_n, blocks.epilogue_block_n) == (128, 128, 64)
    assert blocks.stages >= 2 and not blocks.pingpong


def _gpu_runs(backend):
    return platform.mosaic_gpu_runs() if backend == "pallas_mosaic_gpu" else platform.triton_runs()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gpu_gate_up_and_gradients(backend, activation):
    if not _gpu_runs(backend):
        pytest.skip(f"{backend} does not run on this GPU")
    m, k, f, g = 4096, 512, 768, 8
    gs = random_group_sizes(jax.random.key(1), m, g, total=3900)
    x, w = _operands(2, m, k, f, g)
    dh = jax.random.normal(jax.random.key(5), (m, f), jnp.float32)
    h = jax.jit(lambda a, b, c: BACKENDS[backend].gate_up(
        a, b, c, activation=activation, out_dtype=jnp.float32))(x, w, gs)
    assert_close(h, _h_reference(x, w, gs, activation), dtype=BF16, what="gate_up")
    assert (np.asarray(h)[3900:] == 0).all()
    ours = jax.jit(lambda a, b: ops.gate_up_activation(a, b, gs, BF16, backend=backend,
                                                       activation=activation))
    h, vjp = jax.vjp(ours, x, w)
    h_ref, vjp_ref = jax.vjp(lambda a, b: _h_reference(a, b, gs, activation), x, w)
    assert_close(h, h_ref, dtype=BF16, what="h")
    for got, want, name in zip(vjp(dh.astype(BF16)), vjp_ref(dh), ("dx", "dkernel")):
        assert_close(got, want, dtype=BF16, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gpu_down_weighted_and_gradients(backend):
    """Triton's fused down product, and Mosaic GPU's composed one (its grouped gmm, then
    the weights on the fp32 sums), against the definition."""
    if not _gpu_runs(backend):
        pytest.skip(f"{backend} does not run on this GPU")
    m, f, n, g = 4096, 768, 512, 8
    gs = random_group_sizes(jax.random.key(7), m, g, total=3900)
    k = jax.random.split(jax.random.key(8), 4)
    h = jax.random.normal(k[0], (m, f)).astype(BF16)
    w = (jax.random.normal(k[1], (g, f, n)) / np.sqrt(f)).astype(BF16)
    rw = jax.random.uniform(k[2], (m,), minval=0.1, maxval=1.0)
    dy = jax.random.normal(k[3], (m, n), jnp.float32)

    def ours(a, b, r):
        return ops.down_weighted(a, b, gs, r, BF16, backend=backend)

    def definition(a, b, r):
        return gmm_reference(a.astype(jnp.float32), b.astype(jnp.float32), gs) * r[:, None]

    y, vjp = jax.vjp(jax.jit(ours), h, w, rw)
    y_ref, vjp_ref = jax.vjp(definition, h, w, rw)
    assert_close(y, y_ref, dtype=BF16, what="y")
    for got, want, name in zip(vjp(dy.astype(BF16)), vjp_ref(dy), ("dh", "dW", "d_rw")):
        assert_close(got, want, dtype=BF16, what=name)
