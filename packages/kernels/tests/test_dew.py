"""pallasite.kernels.dew: dew's `dew.nn.kernels` names and behaviour, on pallasite's kernels.

Each expectation comes from dew's documented behaviour (its docstrings and signatures):
generations from a device's compute capability or TPU kind, unknown kinds unchanged;
bf16 dots from sm80; Triton on a process whose GPUs are all sm80+; the SSD scan in the
chunk-major layout with fp32 results and `platform` a JAX platform name, interpreted
where the process has no such device; integer group sizes of any width; the gated delta
rule's pieces (delta_prep, delta_chunks, delta_output) in dew's chunk layout, which
composed as dew composes them give the step-by-step rule (float64) and its gradients, and
its decode step with a decay per key dimension, idle rows and a stochastically rounded
bf16 state.
"""

from __future__ import annotations

import collections.abc
import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export_testlib import TRITON_CALL, cuda_module
from pallasite import kernels
from pallasite.kernels import dew, platform
from pallasite.reference.inputs import grouped_projection_inputs


def _gpu(cc):
    return types.SimpleNamespace(platform="gpu", device_kind="NVIDIA GPU", compute_capability=cc)


def _tpu(kind):
    return types.SimpleNamespace(platform="tpu", device_kind=kind)


@pytest.fixture
def devices(monkeypatch):
    """Pretend the process holds the given devices (dew asks jax.devices())."""
    def use(*fake):
        monkeypatch.setattr(dew, "_devices", lambda: list(fake))
        monkeypatch.setattr(platform, "_default_device", lambda: fake[0])
    return use


def test_every_dew_name_with_its_signature():
    expected = {
        "bf16_dot_runs": ["generation"],
        "device_generation": [],
        "grouped_projection": ["x", "kernel", "group_sizes", "compute", "interpret_on_cpu"],
        "ragged_dot_runs": ["compute", "operands", "precision"],
        "sm_version": ["generation"],
        "ssd_chunk_scan": ["x_c", "b_c", "c_c", "a_c", "state", "platform"],
        "ssd_kernel_platform": ["chunk_size", "head_dim", "state_size"],
        "ssd_kernel_runs": ["chunk_size", "head_dim", "state_size", "backend"],
        "triton_runs": [],
        # dew's delta-rule modules, each with its functions' parameters
        "delta_prep.chunk_prep": ["k", "v", "beta", "hi", "lo", "interpret"],
        "delta_prep.refusal": ["key", "value"],
        "delta_chunks.chunk_states": ["key", "w", "u", "gc", "state", "interpret"],
        "delta_chunks.refusal": ["key", "out_vals"],
        "delta_output.chunk_output": ["q", "k", "hi", "lo", "h", "v", "interpret"],
        "delta_output.refusal": ["key", "value"],
        "delta_rule.step": ["state", "query", "key", "value", "decay", "beta", "active"],
        "delta_rule.fits": ["state"],
        "delta_rule.round_to_bf16": ["state", "key", "value"],
    }
    assert sorted(dew.__all__) == sorted({name.split(".")[0] for name in expected})
    for name, params in expected.items():
        owner, _, attr = name.rpartition(".")
        fn = getattr(getattr(dew, owner) if owner else dew, attr)
        assert list(inspect.signature(fn).parameters) == params, name
    assert dew.ssd_chunk_scan.nondiff_argnums == (5,)


@pytest.mark.parametrize("fn", ["dew.ragged_dot_runs", "dew.grouped_projection",
                                "kernels.grouped_projection", "kernels.ragged_dot_runs",
                                "reference.grouped_projection"])
def test_compute_operands_and_precision_are_annotated(fn):
    """compute: a dtype-like; operands: a sequence of dtypes (or arrays); precision: a
    precision in JAX's spellings."""
    import typing

    import pallasite.reference.grouped_projection as reference

    owner, name = fn.split(".")
    hints = typing.get_type_hints(getattr({"dew": dew, "kernels": kernels,
                                           "reference": reference}[owner], name))
    assert hints["compute"] == jax.typing.DTypeLike
    if "operands" in hints or name == "ragged_dot_runs":
        assert typing.get_origin(hints["operands"]) is collections.abc.Sequence
    if "precision" in hints or name == "ragged_dot_runs":
        assert hints["precision"] == jax.lax.PrecisionLike


@pytest.mark.parametrize("device,generation", [
    (_gpu("8.9"), "sm89"), (_gpu("9.0"), "sm90"), (_tpu("TPU v5 lite"), "v5e"),
    (_tpu("TPU v6 lite"), "v6e"), (_tpu("TPU v5p"), "v5p"), (_tpu("TPU7x"), "TPU7x"),
    (_tpu(""), "tpu"), (types.SimpleNamespace(platform="cpu", device_kind="cpu"), "cpu")])
def test_device_generation_keeps_unknown_tpu_kinds(devices, device, generation):
    devices(device)
    assert dew.device_generation() == generation


def test_sm_version_and_bf16_dot_runs(devices):
    assert dew.sm_version("sm89") == 89 and dew.sm_version("v5e") is None
    assert dew.sm_version("cpu") is None
    assert not dew.bf16_dot_runs("sm75")
    assert all(dew.bf16_dot_runs(g) for g in ("sm80", "sm89", "sm90", "v5e", "cpu"))
    devices(_gpu("7.5"))
    assert not dew.bf16_dot_runs()


def test_triton_runs_needs_every_gpu_from_sm80(devices):
    assert not dew.triton_runs()  # this CPU
    devices(_gpu("8.0"), _gpu("8.9"))
    assert dew.triton_runs()
    devices(_gpu("9.0"), _gpu("7.5"))
    assert not dew.triton_runs()


def test_ragged_dot_runs():
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert dew.ragged_dot_runs(bf16, (bf16, bf16), None)
    assert dew.ragged_dot_runs(bf16, (f32, f32), jax.lax.Precision.HIGHEST)
    assert dew.ragged_dot_runs(f32, (f32,), None)
    assert not dew.ragged_dot_runs(f32, (f32,), jax.lax.Precision.HIGHEST)
    assert not dew.ragged_dot_runs(jnp.float64, (), None)
    with jax.enable_x64(True):
        assert not dew.ragged_dot_runs(bf16, (bf16,), None)


def test_ssd_kernel_runs_speaks_platforms(devices):
    assert dew.ssd_kernel_runs(128, 64, 128, "tpu")
    assert dew.ssd_kernel_runs(128, 64, 128, "gpu")  # no GPU here: the interpreter
    assert not dew.ssd_kernel_runs(128, 64, 128, "cpu")
    assert not dew.ssd_kernel_runs(128, 64, 128, "pallas_triton")
    assert not dew.ssd_kernel_runs(32, 64, 128, "tpu")  # too short to pay for a program
    assert not dew.ssd_kernel_runs(128, 48, 128, "tpu")  # not a power of two
    devices(_gpu("7.5"))
    assert not dew.ssd_kernel_runs(128, 64, 128, "gpu")


def test_ssd_kernel_platform(devices, monkeypatch):
    assert dew.ssd_kernel_platform(128, 64, 128) is None  # CPU: the XLA path
    devices(_gpu("9.0"))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dew.ssd_kernel_platform(128, 64, 128) == "gpu"
    assert dew.ssd_kernel_platform(32, 64, 128) is None
    devices(_tpu("TPU v6 lite"))
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    # The Mosaic TPU kernel is admitted (measured ahead of XLA on a TPU v5e); a geometry
    # it refuses takes the XLA path.
    assert dew.ssd_kernel_runs(128, 64, 128, "tpu")
    assert dew.ssd_kernel_platform(128, 64, 128) == "tpu"
    assert dew.ssd_kernel_platform(32, 64, 128) is None


def _ssd_operands(dtype=jnp.float32, nc=2, bsz=1, chunk=16, h=2, p=16, n=16):
    keys = jax.random.split(jax.random.key(0), 5)
    x_c = jax.random.normal(keys[0], (nc, bsz, chunk, h, p), dtype)
    b_c = jax.random.normal(keys[1], (nc, bsz, chunk, h, n), dtype)
    c_c = jax.random.normal(keys[2], (nc, bsz, chunk, h, n), dtype)
    a_c = -jax.random.uniform(keys[3], (nc, bsz, h, chunk), jnp.float32, 0.01, 0.3)
    state = jax.random.normal(keys[4], (bsz, h, p, n), jnp.float32)
    return x_c, b_c, c_c, a_c.astype(dtype), state


def _oracle(x_c, b_c, c_c, a_c, state):
    """pallasite's XLA scan in its own (batch-major, Mamba order) layout."""
    major = lambda t: jnp.swapaxes(t, 0, 1).astype(jnp.float32)  # noqa: E731
    y, final = kernels.ssd_chunk_scan(major(x_c), jnp.transpose(a_c, (1, 0, 3, 2)).astype(
        jnp.float32), major(b_c), major(c_c), state, "xla")
    return jnp.swapaxes(y, 0, 1), final


# ids other than "gpu"/"tpu": those are the accelerator marks' names (conftest skips them).
@pytest.mark.parametrize("platform_name", ["gpu", "tpu"], ids=["triton", "mosaic_tpu"])
def test_ssd_chunk_scan_values_and_gradients(platform_name):
    args = _ssd_operands()
    y, final = jax.jit(dew.ssd_chunk_scan, static_argnums=5)(*args, platform_name)
    y_ref, final_ref = _oracle(*args)
    assert y.shape == args[0].shape and y.dtype == jnp.float32 and final.dtype == jnp.float32
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final, final_ref, rtol=1e-4, atol=1e-4)

    def loss(fn):
        return lambda *t: sum(jnp.sum(o * o) for o in fn(*t))

    grads = jax.jit(jax.grad(loss(lambda *t: dew.ssd_chunk_scan(*t, platform_name)),
                             argnums=(0, 1, 2, 3, 4)))(*args)
    grads_ref = jax.grad(loss(_oracle), argnums=(0, 1, 2, 3, 4))(*args)
    for got, want in zip(grads, grads_ref):
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


def test_ssd_chunk_scan_returns_fp32_for_bf16_operands():
    y, final = dew.ssd_chunk_scan(*_ssd_operands(jnp.bfloat16), "gpu")
    assert y.dtype == jnp.float32 and final.dtype == jnp.float32


def test_ssd_chunk_scan_names_a_bad_platform():
    with pytest.raises(ValueError, match="platform"):
        dew.ssd_chunk_scan(*_ssd_operands(), "pallas_triton")


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.int32])
def test_grouped_projection_casts_integer_group_sizes(dtype):
    x, kernel, sizes = grouped_projection_inputs(jax.random.key(1), 40, 32, 16, 3, jnp.float32)
    want = kernels.grouped_projection(x, kernel, sizes, jnp.bfloat16)
    got = dew.grouped_projection(x, kernel, sizes.astype(dtype), jnp.bfloat16, False)
    np.testing.assert_array_equal(got, want)
    dx, dk = jax.grad(lambda x, k: jnp.sum(dew.grouped_projection(
        x, k, sizes.astype(dtype), jnp.bfloat16, True).astype(jnp.float32)), argnums=(0, 1))(
        x, kernel)
    assert dx.shape == x.shape and dk.shape == kernel.shape


def test_grouped_projection_under_jit_takes_traced_group_sizes():
    """Traced int16 sizes: their dtype is read, never converted to numpy (a tracer would
    raise)."""
    x, kernel, sizes = grouped_projection_inputs(jax.random.key(1), 40, 32, 16, 3, jnp.float32)
    want = kernels.grouped_projection(x, kernel, sizes, jnp.bfloat16)
    got = jax.jit(lambda x, k, s: dew.grouped_projection(x, k, s, jnp.bfloat16, False))(
        x, kernel, sizes.astype(jnp.int16))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sizes, shown", [
    (np.array([2**32 + 16, 0, 0], np.int64), "4294967312"),
    (np.array([4_000_000_000, 0, 0], np.uint32), "4000000000"),
    (np.array([-2**40, 0, 0], np.int64), "-1099511627776"),
], ids=["int64_past_int32", "uint32_past_int32", "int64_below_int32"])
def test_grouped_projection_refuses_concrete_sizes_int32_cannot_hold(sizes, shown):
    """Checked before the cast to int32, which would wrap them (2**32 + 16 became 16);
    the message shows the value given."""
    x, kernel, _ = grouped_projection_inputs(jax.random.key(1), 40, 32, 16, 3, jnp.float32)
    with pytest.raises(ValueError, match=f"group_sizes.*{shown}"):
        dew.grouped_projection(x, kernel, sizes, jnp.bfloat16, False)


def test_grouped_projection_takes_int64_sizes_that_fit():
    x, kernel, sizes = grouped_projection_inputs(jax.random.key(1), 40, 32, 16, 3, jnp.float32)
    want = kernels.grouped_projection(x, kernel, sizes, jnp.bfloat16)
    got = dew.grouped_projection(x, kernel, np.asarray(sizes, np.int64), jnp.bfloat16, False)
    np.testing.assert_array_equal(got, want)


def test_grouped_projection_refuses_float_group_sizes():
    x, kernel, sizes = grouped_projection_inputs(jax.random.key(1), 40, 32, 16, 3, jnp.float32)
    with pytest.raises(TypeError, match="group_sizes"):
        dew.grouped_projection(x, kernel, sizes.astype(jnp.float32), jnp.bfloat16, False)


def test_ssd_chunk_scan_gpu_path_lowers_for_cuda(devices, monkeypatch):
    """The path the GPU test takes (compiled Triton kernels, no interpreter) traced under
    jit and lowered for an abstract H200 from this host, forward and gradient: nothing
    in it needs a concrete value."""
    devices(types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200",
                                  compute_capability="9.0"))
    monkeypatch.setattr(dew, "_interpreting", lambda name: False)
    args = _ssd_operands(nc=4, bsz=2, chunk=64, h=4, p=64, n=128)
    specs = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in args]
    loss = lambda *t: sum(jnp.sum(o * o) for o in dew.ssd_chunk_scan(*t, "gpu"))  # noqa: E731
    for fn in (lambda *t: dew.ssd_chunk_scan(*t, "gpu"),
               jax.grad(loss, argnums=(0, 1, 2, 3, 4))):
        assert TRITON_CALL in cuda_module(fn, *specs)


# ----------------------------------------------------------------------------- the GPU


@pytest.mark.gpu
def test_gpu_ssd_chunk_scan_runs_the_compiled_kernel():
    """On a GPU, platform "gpu" runs the compiled Triton kernels (not the interpreter)."""
    assert not dew._interpreting("gpu")
    args = _ssd_operands(nc=4, bsz=2, chunk=64, h=4, p=64, n=128)
    y, final = jax.jit(dew.ssd_chunk_scan, static_argnums=5)(*args, "gpu")
    y_ref, final_ref = _oracle(*args)
    np.testing.assert_allclose(y, y_ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(final, final_ref, rtol=2e-2, atol=2e-2)
    text = jax.jit(dew.ssd_chunk_scan, static_argnums=5).lower(*args, "gpu").as_text()
    assert "triton" in text


@pytest.mark.gpu
def test_gpu_grouped_projection_int16_sizes():
    x, kernel, sizes = grouped_projection_inputs(jax.random.key(1), 512, 256, 128, 4,
                                                 jnp.bfloat16)
    want = kernels.grouped_projection(x, kernel, sizes, jnp.bfloat16)
    got = jax.jit(lambda x, k, s: dew.grouped_projection(x, k, s, jnp.bfloat16, False))(
        x, kernel, sizes.astype(jnp.int16))
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------- dew's gated delta-rule pieces

B_, H_, NC_, C_, DK_, DV_ = 2, 3, 3, 16, 16, 32


def _chunked_rule_inputs(seed=0):
    """Inputs in dew's chunk layout: q (already scaled) and k [B, H, NC, C, Dk], v
    [B, H, NC, C, Dv], g (log decay, <= 0) and beta [B, H, NC, C], and a state."""
    ks = jax.random.split(jax.random.key(seed), 6)
    k = jax.random.normal(ks[1], (B_, H_, NC_, C_, DK_)) / np.sqrt(DK_)
    q = jax.random.normal(ks[0], (B_, H_, NC_, C_, DK_)) * DK_ ** -0.5
    v = jax.random.normal(ks[2], (B_, H_, NC_, C_, DV_))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B_, H_, NC_, C_)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B_, H_, NC_, C_)))
    state = jax.random.normal(ks[5], (B_, H_, DK_, DV_))
    return q, k, v, g, beta, state


def _dew_pieces(q, k, v, g, beta, state):
    """dew's chunked rule from its three pieces: the cumulated decay as hi (lo = 0)."""
    gc = jnp.cumsum(g, axis=-1)
    w, u = dew.delta_prep.chunk_prep(k, v, beta, gc, jnp.zeros_like(gc))
    entered, corrected, final = dew.delta_chunks.chunk_states(k, w, u, gc, state)
    out = dew.delta_output.chunk_output(q, k, gc, jnp.zeros_like(gc), entered, corrected)
    return out, final


def _recurrence64(q, k, v, g, beta, state):
    """The gated delta rule step by step in float64 NumPy, over dew's layout."""
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
    b, h, nc, c = g.shape
    flat = lambda a: a.reshape(b, h, nc * c, *a.shape[4:])  # noqa: E731
    q, k, v, g, beta = map(flat, (q, k, v, g, beta))
    out = np.zeros(v.shape)
    s = s.copy()
    for t in range(nc * c):
        s = np.exp(g[:, :, t])[..., None, None] * s
        pred = np.einsum("bhkv,bhk->bhv", s, k[:, :, t])
        s = s + (beta[:, :, t, None] * k[:, :, t])[..., None] * (v[:, :, t] - pred)[..., None, :]
        out[:, :, t] = np.einsum("bhkv,bhk->bhv", s, q[:, :, t])
    return out.reshape(b, h, nc, c, -1), s


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def test_delta_pieces_compose_to_the_gated_delta_rule():
    """dew's chunk_prep, chunk_states and chunk_output, composed as dew's chunked rule
    composes them, give the step-by-step rule's outputs and final state (float64
    recurrence), to fp32 accuracy; every output is fp32 and in dew's layout."""
    args = _chunked_rule_inputs()
    out, final = jax.jit(_dew_pieces)(*args)
    want_out, want_final = _recurrence64(*args)
    assert out.dtype == final.dtype == jnp.float32
    assert out.shape == (B_, H_, NC_, C_, DV_) and final.shape == (B_, H_, DK_, DV_)
    assert _rel(out, want_out) < 1e-5 and _rel(final, want_final) < 1e-5


def test_delta_pieces_differentiate_as_the_rule_does():
    """Gradients through the three pieces (JAX's autodiff) equal those of pallasite's
    plain-JAX sequential rule, for q, k, v, g, beta and the entering state."""
    from pallasite.reference.gated_delta_rule import gated_delta_rule_sequential

    args = _chunked_rule_inputs(seed=1)
    weights = jnp.cos(jnp.arange(B_ * H_ * NC_ * C_ * DV_, dtype=jnp.float32))

    def loss_of(out, final):
        return jnp.sum(out.reshape(-1) * weights) + jnp.sum(final ** 2)

    def sequential(q, k, v, g, beta, state):
        flat = lambda a: jnp.moveaxis(a.reshape(B_, H_, NC_ * C_, *a.shape[4:]), 1, 2)  # noqa: E731
        o, final = gated_delta_rule_sequential(*map(flat, (q, k, v, g, beta)), scale=1.0,
                                               initial_state=state, output_final_state=True)
        return jnp.moveaxis(o, 2, 1).reshape(B_, H_, NC_, C_, DV_), final

    argnums = tuple(range(6))
    got = jax.jit(jax.grad(lambda *a: loss_of(*_dew_pieces(*a)), argnums))(*args)
    want = jax.jit(jax.grad(lambda *a: loss_of(*sequential(*a)), argnums))(*args)
    for name, g_, w_ in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        assert _rel(g_, w_) < 1e-4, name


def test_delta_chunk_states_returns_each_entered_state_and_corrected_values():
    """chunk_states' entered states: the given state for chunk 0, then each chunk's
    leaving state; corrected values u - w S; final the last leaving state."""
    q, k, v, g, beta, state = _chunked_rule_inputs(seed=2)
    gc = jnp.cumsum(g, axis=-1)
    w, u = dew.delta_prep.chunk_prep(k, v, beta, gc, jnp.zeros_like(gc))
    entered, corrected, final = dew.delta_chunks.chunk_states(k, w, u, gc, state)
    np.testing.assert_array_equal(entered[:, :, 0], state)
    for i in range(NC_):
        s = entered[:, :, i]
        np.testing.assert_allclose(corrected[:, :, i], u[:, :, i] - jnp.einsum(
            "bhck,bhkv->bhcv", w[:, :, i], s, precision="highest"), rtol=1e-5, atol=1e-5)
        leave = jnp.exp(gc[:, :, i, -1:] - gc[:, :, i])
        nxt = jnp.exp(gc[:, :, i, -1])[..., None, None] * s + jnp.einsum(
            "bhck,bhcv->bhkv", k[:, :, i] * leave[..., None], corrected[:, :, i],
            precision="highest")
        want = entered[:, :, i + 1] if i + 1 < NC_ else final
        np.testing.assert_allclose(want, nxt, rtol=1e-5, atol=1e-5)


def test_delta_pieces_check_their_operands_by_name():
    q, k, v, g, beta, state = _chunked_rule_inputs()
    gc = jnp.cumsum(g, axis=-1)
    assert dew.delta_prep.refusal(k, v) is None
    assert dew.delta_chunks.refusal(k, v) is None
    assert dew.delta_output.refusal(k, v) is None
    assert "not" in dew.delta_prep.refusal(k, v[:, :, :2])
    with pytest.raises(ValueError, match="beta"):
        dew.delta_prep.chunk_prep(k, v, beta[..., :4], gc, gc)
    with pytest.raises(ValueError, match="state"):
        dew.delta_chunks.chunk_states(k, k, v, gc, state[:1])
    with pytest.raises(ValueError, match="h must"):
        dew.delta_output.chunk_output(q, k, gc, gc, v[:, :, :1], v)


def _step_inputs(seed, rows=4, heads=2, dk=8, dv=16):
    ks = jax.random.split(jax.random.key(seed), 7)
    state = jax.random.normal(ks[0], (rows, heads, dk, dv))
    query = jax.random.normal(ks[1], (rows, heads, dk)) * dk ** -0.5
    key = jax.random.normal(ks[2], (rows, heads, dk)) / np.sqrt(dk)
    value = jax.random.normal(ks[3], (rows, heads, dv))
    decay = jnp.exp(-jax.nn.softplus(jax.random.normal(ks[4], (rows, heads, dk))))
    beta = jax.nn.sigmoid(jax.random.normal(ks[5], (rows, heads)))
    return state, query, key, value, decay, beta


def test_delta_rule_step_with_a_decay_per_key_dimension():
    """step: S' = diag(decay) S + k delta^T, delta = beta (v - (k decay)^T S), out =
    q^T S', against float64 NumPy with a different decay per key dimension; with one
    decay per head it is pallasite's own step (reference.one_step, scale 1)."""
    from pallasite.reference.gated_delta_rule import one_step

    state, q, k, v, d, beta = _step_inputs(3)
    new, out = jax.jit(dew.delta_rule.step)(state, q, k, v, d, beta)
    s, q64, k64, v64, d64, b64 = (np.asarray(a, np.float64) for a in (state, q, k, v, d, beta))
    delta = b64[..., None] * (v64 - np.einsum("rhk,rhkv->rhv", k64 * d64, s))
    want = d64[..., None] * s + k64[..., None] * delta[..., None, :]
    assert new.dtype == jnp.float32 and out.dtype == q.dtype
    assert _rel(new, want) < 1e-6
    assert _rel(out, np.einsum("rhkv,rhk->rhv", want, q64)) < 1e-6
    g = -jax.nn.softplus(jax.random.normal(jax.random.key(4), beta.shape))
    same = jnp.broadcast_to(jnp.exp(g)[..., None], d.shape)
    new, out = dew.delta_rule.step(state, q, k, v, same, beta)
    o_ref, s_ref = one_step(state, q, k, v, g, beta, 1.0)
    assert _rel(new, s_ref) < 1e-6 and _rel(out, o_ref) < 1e-6


def test_delta_rule_step_leaves_idle_rows_alone():
    """A row marked inactive keeps its state bit for bit and gets zeros; the others step."""
    state, q, k, v, d, beta = _step_inputs(5)
    active = jnp.asarray([True, False, True, False])
    new, out = dew.delta_rule.step(state, q, k, v, d, beta, active)
    np.testing.assert_array_equal(new[1], state[1])
    np.testing.assert_array_equal(new[3], state[3])
    assert not np.asarray(out[1]).any() and not np.asarray(out[3]).any()
    full, full_out = dew.delta_rule.step(state, q, k, v, d, beta)
    np.testing.assert_array_equal(new[0], full[0])
    np.testing.assert_array_equal(out[2], full_out[2])


def test_delta_rule_step_rounds_a_bf16_state_stochastically():
    """A bf16 state is written through round_to_bf16: each value is one of the two bf16
    neighbours of the fp32 update (both directions occur), the same bits on a second
    call, and different noise for a different token."""
    state, q, k, v, d, beta = _step_inputs(6, rows=8, heads=4, dk=16, dv=32)
    held = state.astype(jnp.bfloat16)
    new, _ = dew.delta_rule.step(held, q, k, v, d, beta)
    again, _ = dew.delta_rule.step(held, q, k, v, d, beta)
    assert new.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(again, np.float32))
    exact, _ = dew.delta_rule.step(held.astype(jnp.float32), q, k, v, d, beta)
    exact = np.asarray(exact, np.float32)
    toward = np.asarray(exact.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    away = np.asarray((exact.view(np.uint32) & np.uint32(0xFFFF0000))
                      + np.uint32(0x10000)).view(np.float32)
    got = np.asarray(new, np.float32)
    assert ((got == toward) | (got == away)).all()
    moved = exact != toward
    assert (got[moved] == away[moved]).any() and (got[moved] == toward[moved]).any()
    other, _ = dew.delta_rule.step(held, q, k, v * 1.5, d, beta)
    assert dew.delta_rule.round_to_bf16(exact, k, v).dtype == jnp.bfloat16
    assert not np.array_equal(np.asarray(other, np.float32), got)


def test_delta_rule_step_checks_its_operands_by_name():
    state, q, k, v, d, beta = _step_inputs(7)
    assert dew.delta_rule.fits(state) and dew.delta_rule.fits(state.astype(jnp.bfloat16))
    assert not dew.delta_rule.fits(state.astype(jnp.float16))
    assert not dew.delta_rule.fits(state[0])
    with pytest.raises(ValueError, match="decay"):
        dew.delta_rule.step(state, q, k, v, d[..., :4], beta)
    with pytest.raises(ValueError, match="active"):
        dew.delta_rule.step(state, q, k, v, d, beta, jnp.ones((2,), bool))
    with pytest.raises(ValueError, match="state"):
        dew.delta_rule.step(state.astype(jnp.float16), q, k, v, d, beta)
