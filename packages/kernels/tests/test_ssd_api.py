"""chunk_ssd and ssd_chunk_scan's public behaviour: padding, implementation choice,
bad input, positive a and the geometry predicates (sharding: test_ssd_sharding)."""

from __future__ import annotations

import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.kernels import chunk_ssd, ssd_chunk_scan, ssd_kernel_platform, ssd_kernel_runs
from pallasite.kernels.ssd import predicates
from pallasite.reference import parity
from pallasite.reference.inputs import ssd_initial_state, ssd_inputs
from pallasite.reference.ssd import ssd_sequential


def _inputs(key=0, b=1, length=40, h=2, p=8, n=8, g=1, dtype=jnp.float32):
    x, a, bm, c = ssd_inputs(jax.random.key(key), b, length, h, p, n, g, dtype)
    s0 = ssd_initial_state(jax.random.key(key + 1), b, h, p, n)
    return x, a, bm, c, s0


# ---------------------------------------------------------------------------- padding


def test_padding_changes_neither_y_nor_final_state():
    """length 40, chunk 16: 8 padded steps (a = 0, x = B = C = 0) leave the state as it
    was and their outputs are cut; values and gradients equal the unpadded definition."""
    x, a, b, c, s0 = _inputs(length=40)

    def loss(fn):
        def f(x, a, b, c, s0):
            y, final = fn(x, a, b, c, s0)
            return jnp.sum(y * jnp.cos(y)) + jnp.sum(final * jnp.sin(final)), (y, final)
        return f

    run = lambda *t: chunk_ssd(*t[:4], chunk_size=16, initial_state=t[4], implementation="xla")
    (_, (y, final)), grads = jax.value_and_grad(loss(run), (0, 1, 2, 3, 4), has_aux=True)(
        x, a, b, c, s0)
    (_, (y_ref, final_ref)), grads_ref = jax.value_and_grad(
        loss(ssd_sequential), (0, 1, 2, 3, 4), has_aux=True)(x, a, b, c, s0)
    assert y.shape == x.shape
    parity.assert_close(y, y_ref, dtype=jnp.float32, tol=parity.EXACT_FP32, what="y")
    parity.assert_close(final, final_ref, dtype=jnp.float32, tol=parity.EXACT_FP32,
                        what="final")
    for what, got, want in zip(("dx", "da", "db", "dc", "ds0"), grads, grads_ref):
        parity.assert_close(got, want, dtype=jnp.float32, tol=parity.EXACT_FP32, what=what)


def test_padding_through_the_tpu_kernel():
    x, a, b, c, s0 = _inputs(length=72, p=8, n=8)
    y, final = chunk_ssd(x, a, b, c, chunk_size=64, initial_state=s0,
                         implementation="pallas_mosaic_tpu")
    y_ref, final_ref = ssd_sequential(x, a, b, c, s0)
    parity.assert_close(y, y_ref, dtype=jnp.float32, tol=parity.EXACT_FP32, what="y")
    parity.assert_close(final, final_ref, dtype=jnp.float32, tol=parity.EXACT_FP32,
                        what="final")


def test_default_initial_state_is_zero():
    x, a, b, c, s0 = _inputs(length=32)
    y, final = chunk_ssd(x, a, b, c, chunk_size=16)
    y_ref, final_ref = ssd_sequential(x, a, b, c)
    parity.assert_close(y, y_ref, dtype=jnp.float32, tol=parity.EXACT_FP32)
    parity.assert_close(final, final_ref, dtype=jnp.float32, tol=parity.EXACT_FP32)


# ------------------------------------------------------------------- implementation=


def test_default_on_cpu_is_xla(caplog):
    predicates._log_once.cache_clear()
    x, a, b, c, _ = _inputs(length=16)
    with caplog.at_level(logging.INFO, logger="pallasite.ssd"):
        chunk_ssd(x, a, b, c, chunk_size=16)
    assert "chunk=16 head_dim=8 state=8 -> xla" in caplog.text
    assert ssd_kernel_platform(16, 8, 8) is None


def test_unknown_implementation():
    x, a, b, c, _ = _inputs(length=16)
    with pytest.raises(ValueError, match="unknown SSD implementation 'cuda_magic'"):
        chunk_ssd(x, a, b, c, chunk_size=16, implementation="cuda_magic")
    with pytest.raises(ValueError, match="empty"):
        chunk_ssd(x, a, b, c, chunk_size=16, implementation=())


def test_named_kernel_fails_fast_on_refused_geometry():
    x, a, b, c, _ = _inputs(length=32)
    with pytest.raises(ValueError, match="chunk_size=16 < 64"):
        chunk_ssd(x, a, b, c, chunk_size=16, implementation="pallas_mosaic_tpu")


def test_sequence_falls_back_and_logs(caplog):
    x, a, b, c, s0 = _inputs(length=32)
    with caplog.at_level(logging.WARNING, logger="pallasite.ssd"):
        y, final = chunk_ssd(x, a, b, c, chunk_size=16, initial_state=s0,
                             implementation=("pallas_mosaic_tpu", "xla"))
    assert "pallas_mosaic_tpu failed" in caplog.text and "chunk_size=16 < 64" in caplog.text
    y_ref, _ = ssd_sequential(x, a, b, c, s0)
    parity.assert_close(y, y_ref, dtype=jnp.float32, tol=parity.EXACT_FP32)


def test_sequence_raises_all_failures_together():
    x, a, b, c, _ = _inputs(length=32, p=12)
    with pytest.raises(ValueError) as info:
        chunk_ssd(x, a, b, c, chunk_size=16,
                  implementation=("pallas_mosaic_tpu", "pallas_triton"))
    text = str(info.value)
    assert "pallas_mosaic_tpu: head_dim=12 is not a power of two" in text
    assert "pallas_triton: head_dim=12" in text


def test_kernel_not_for_this_device():
    x, a, b, c, _ = _inputs(length=64)
    fake = types.SimpleNamespace(default_backend=lambda: "gpu")
    from pallasite.kernels.ssd import api

    real = api.jax
    api.jax = types.SimpleNamespace(**{k: getattr(real, k) for k in ("numpy",)},
                                    default_backend=fake.default_backend)
    try:
        reason = api._refusal("pallas_mosaic_tpu", 64, 8, 8)
    finally:
        api.jax = real
    assert reason and "does not run on gpu" in reason


def test_fp16_refused_on_a_tpu_only():
    """A TPU's compiler does not load fp16 blocks (platform.MOSAIC_TPU_REFUSED_DTYPES); the
    interpreter on a CPU takes them."""
    from pallasite.kernels.ssd import pallas_mosaic_tpu

    fp16 = {"x": jnp.float16, "b": jnp.bfloat16, "c": jnp.bfloat16}
    why = pallas_mosaic_tpu.refusal("tpu", fp16)
    assert why is not None and "x float16" in why and "b " not in why
    assert pallas_mosaic_tpu.refusal("tpu", {"x": jnp.bfloat16}) is None
    assert pallas_mosaic_tpu.refusal("cpu", fp16) is None


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda t: {**t, "x": t["x"][0]}, ValueError, r"x must be rank 4 .*got shape \(40, 2, 8\)"),
        (lambda t: {**t, "a": t["a"][:, :-1]}, ValueError, r"a must match x's batch, steps and heads: a shape \(1, 39, 2\)"),
        (lambda t: {**t, "b": t["b"][:1, :20]}, ValueError, r"b must match x's batch and steps: b shape \(1, 20, 1, 8\)"),
        (lambda t: {**t, "c": t["c"][..., :4]}, ValueError, r"c must have b's shape: c shape \(1, 40, 1, 4\)"),
        (lambda t: {**t, "x": jnp.concatenate([t["x"]] * 2, 0)}, ValueError,
         r"a must match x's batch, steps and heads: a shape \(1, 40, 2\), x shape \(2, 40, 2, 8\)"),
        (lambda t: {**t, "a": t["a"][..., :1]}, ValueError, r"a must match x's batch, steps and heads: a shape \(1, 40, 1\)"),
        (lambda t: {**t, "x": t["x"].astype(jnp.int32)}, TypeError, "x must be floating; got int32"),
        (lambda t: {**t, "initial_state": t["initial_state"][:, :1]}, ValueError,
         r"initial_state must be \[batch, heads, head_dim, state\] = \(1, 2, 8, 8\); got shape \(1, 1, 8, 8\)"),
    ],
)
def test_bad_input(change, error, message):
    x, a, b, c, s0 = _inputs(length=40)
    args = change(dict(x=x, a=a, b=b, c=c, initial_state=s0))
    with pytest.raises(error, match=message):
        chunk_ssd(args["x"], args["a"], args["b"], args["c"], chunk_size=16,
                  initial_state=args["initial_state"])


def test_heads_not_divisible_by_groups():
    x, a, b, c, _ = _inputs(length=16, h=3, g=1)
    b2 = jnp.concatenate([b, b], axis=2)
    with pytest.raises(ValueError, match=r"heads \(3, x shape .*\) must be a multiple of groups \(2, b shape"):
        chunk_ssd(x, a, b2, b2, chunk_size=16)


@pytest.mark.parametrize("chunk_size, error", [(0, ValueError), (-4, ValueError),
                                               (16.0, TypeError), (True, TypeError)])
def test_bad_chunk_size(chunk_size, error):
    x, a, b, c, _ = _inputs(length=16)
    with pytest.raises(error, match="chunk_size"):
        chunk_ssd(x, a, b, c, chunk_size=chunk_size)


def test_chunked_layout_checked_by_ssd_chunk_scan():
    x, a, b, c, s0 = _inputs(length=32)
    chunked = [t.reshape(1, 2, 16, *t.shape[2:]) for t in (x, a, b, c)]
    with pytest.raises(ValueError, match=r"a must match x's batch, steps and heads: a shape \(1, 2, 16, 1\)"):
        ssd_chunk_scan(chunked[0], chunked[1][..., :1], chunked[2], chunked[3], s0, "xla")
    with pytest.raises(ValueError, match=r"initial_state must be \[batch, heads, head_dim, state\] .*got shape"):
        ssd_chunk_scan(*chunked, s0[..., :4], "xla")


# ---------------------------------------------------------------------------- positive a


@pytest.mark.parametrize("implementation", ["xla", "pallas_mosaic_tpu"])
def test_positive_a_is_growth_and_accepted(implementation):
    """a > 0 (growth) is accepted, not checked (a is traced): it matches the definition."""
    x, a, b, c, s0 = _inputs(length=64)
    grow = jnp.abs(a)  # the same magnitudes, growing: exp(sum a) ~ e^2 over 64 steps
    y, final = chunk_ssd(x, grow, b, c, chunk_size=64, initial_state=s0,
                         implementation=implementation)
    y_ref, final_ref = ssd_sequential(x, grow, b, c, s0)
    assert np.isfinite(np.asarray(y)).all()
    parity.assert_close(y, y_ref, dtype=jnp.float32, tol=parity.EXACT_FP32, what="y")
    parity.assert_close(final, final_ref, dtype=jnp.float32, tol=parity.EXACT_FP32,
                        what="final")


# ---------------------------------------------------------------------------- predicates


@pytest.mark.parametrize(
    "geometry, backend, message",
    [
        ((64, 48, 64), "pallas_mosaic_tpu", "head_dim=48 is not a power of two"),
        ((64, 64, 4), "pallas_mosaic_tpu", "state_size=4 is not a power of two >= 8"),
        ((96, 64, 64), "pallas_mosaic_tpu", "chunk_size=96 is not a power of two"),
        ((32, 64, 64), "pallas_mosaic_tpu", "chunk_size=32 < 64: too short"),
        ((1024, 64, 64), "pallas_mosaic_tpu", "chunk_size=1024 > 512"),
        ((512, 512, 512), "pallas_mosaic_tpu", "bytes > pallas_mosaic_tpu budget"),
        ((256, 256, 256), "pallas_triton", "bytes > pallas_triton budget"),
        ((64, 8, 64), "pallas_triton", "head_dim=8 < 16"),
        ((64, 64, 64), "cuda_magic", "unknown SSD backend"),
    ],
)
def test_each_refusal(geometry, backend, message):
    assert not ssd_kernel_runs(*geometry, backend)
    assert message in predicates.ssd_kernel_reason(*geometry, backend)


@pytest.mark.parametrize("geometry", [(64, 64, 64), (128, 128, 64), (256, 64, 128),
                                      (256, 128, 128)])
def test_issue_geometries_run_on_tpu(geometry):
    assert ssd_kernel_runs(*geometry, "pallas_mosaic_tpu")


def _device(platform, kind="", cc=None):
    return types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability=cc)


def test_platform_choice_and_logging_once(caplog, monkeypatch):
    tpu = _device("tpu", "TPU v5 lite")
    predicates._log_once.cache_clear()
    assert predicates.ADMITTED["pallas_mosaic_tpu"][0]  # measured ahead on a TPU v5e
    with caplog.at_level(logging.INFO, logger="pallasite.ssd"):
        assert ssd_kernel_platform(256, 64, 128, tpu) == "pallas_mosaic_tpu"
        assert ssd_kernel_platform(256, 64, 128, tpu) == "pallas_mosaic_tpu"
        assert ssd_kernel_platform(32, 64, 128, tpu) is None  # refused
        assert ssd_kernel_platform(256, 64, 128, _device("cpu")) is None
    lines = [r.getMessage() for r in caplog.records]
    assert sum("chunk=256 head_dim=64 state=128 -> pallas_mosaic_tpu (pallas_mosaic_tpu: "
               in line for line in lines) == 1
    assert any("pallas_mosaic_tpu refused: chunk_size=32 < 64" in line for line in lines)
    assert any("no SSD kernel for cpu" in line for line in lines)
    monkeypatch.setitem(predicates.ADMITTED, "pallas_mosaic_tpu", (False, "not measured"))
    predicates._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="pallasite.ssd"):
        assert ssd_kernel_platform(256, 64, 128, tpu) is None
    assert "-> xla (pallas_mosaic_tpu not admitted: not measured)" in caplog.text
    monkeypatch.setitem(predicates.ADMITTED, "pallas_triton", (True, "measured"))
    assert ssd_kernel_platform(128, 64, 64, _device("gpu", "H200", "9.0")) == "pallas_triton"
    assert ssd_kernel_platform(128, 64, 64, _device("gpu", "T4", "7.5")) is None


# ---------------------------------------------------------------------------- shard_map


def test_dispatch_to_pallas_triton_by_name():
    """ssd_chunk_scan imports the GPU backend lazily by name; the Triton interpreter runs
    it on CPU."""
    x, a, b, c, s0 = _inputs(b=2, length=64, h=2, p=16, n=16)
    chunked = [t.reshape(2, 2, 32, *t.shape[2:]) for t in (x, a, b, c)]
    y, final = ssd_chunk_scan(*chunked, s0, ("pallas_triton", True))
    y_ref, final_ref = ssd_sequential(x, a, b, c, s0)
    parity.assert_close(y.reshape(x.shape), y_ref, dtype=jnp.float32, tol=parity.EXACT_FP32)
    parity.assert_close(final, final_ref, dtype=jnp.float32, tol=parity.EXACT_FP32)


# ---------------------------------------------------------------------------- the GPU path


@pytest.mark.gpu
@pytest.mark.parametrize("length, groups", [(1000, 1), (1024, 4)])
def test_gpu_default_path_matches_sequential(length, groups):
    """chunk_ssd with no implementation on a GPU: the predicates pick pallas_triton for
    (chunk 256, head_dim 64, state 128), the length is padded where it must be, and values
    and all five gradients (through the custom_vjp's hand-written backward) match the
    sequential definition to bf16 rounding."""
    assert ssd_kernel_platform(256, 64, 128) == "pallas_triton"
    x, a, b, c, s0 = _inputs(b=2, length=length, h=8, p=64, n=128, g=groups,
                             dtype=jnp.bfloat16)
    dy_key, df_key = jax.random.split(jax.random.key(7))
    dy = jax.random.normal(dy_key, x.shape, jnp.float32).astype(x.dtype)
    dfinal = jax.random.normal(df_key, s0.shape, jnp.float32)

    def run(fn):
        (y, final), vjp = jax.vjp(fn, x, a, b, c, s0)
        return (y, final) + vjp((dy.astype(y.dtype), dfinal))

    got = run(jax.jit(lambda *t: chunk_ssd(*t[:4], chunk_size=256, initial_state=t[4])))
    want = run(lambda *t: ssd_sequential(*(u.astype(jnp.float32) for u in t)))
    for what, g_, w_ in zip(("y", "final", "dx", "da", "db", "dc", "ds0"), got, want):
        parity.assert_close(g_, w_, dtype=jnp.bfloat16, what=what)


def test_block_sizes_reach_their_backend(monkeypatch):
    """chunk_ssd(block_sizes=) runs the named backend with them; others keep their own."""
    from pallasite.kernels.ssd import pallas_mosaic_tpu, pallas_triton

    seen = []
    real = pallas_triton.forward

    def spy(*args, block_sizes=None, **kw):
        seen.append(block_sizes)
        return real(*args, block_sizes=block_sizes, **kw)

    monkeypatch.setattr(pallas_triton, "forward", spy)
    x, a, b, c, _ = _inputs(length=128, p=16, n=16)
    blocks = pallas_triton.BlockSizes(block_m=32, block_t=32)
    y, final = chunk_ssd(x, a, b, c, chunk_size=64, implementation="pallas_triton",
                         block_sizes=blocks)
    y_ref, final_ref = chunk_ssd(x, a, b, c, chunk_size=64, implementation="xla",
                                 block_sizes=blocks)
    assert seen == [blocks]
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final, final_ref, rtol=1e-4, atol=1e-4)
    seen.clear()
    chunk_ssd(x, a, b, c, chunk_size=64, implementation="pallas_triton",
              block_sizes=pallas_mosaic_tpu.BlockSizes())
    assert seen == [None]
    with pytest.raises(TypeError, match="block_sizes"):
        chunk_ssd(x, a, b, c, chunk_size=64, block_sizes={"block_m": 16})
