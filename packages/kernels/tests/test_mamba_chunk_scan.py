"""mamba_chunk_scan (the whole Mamba-2 scan) against its oracle on every SSD backend
(the Pallas kernels through their interpreters on CPU): values and the gradients of
every array argument with every option on, packing by seq_idx and by cu_seqlens,
varlen_states and their gradients, the return order, a prefill followed by decode steps
against one scan, the sequence split over 8 devices (under jit and inside a caller's
shard_map), the argument checks, and the lowering for CUDA."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding_testlib as st
from cuda_export_testlib import TRITON_CALL, cuda_module
from pallasite.kernels import autodiff, mamba_chunk_scan, selective_state_update
from pallasite.reference import parity
from pallasite.reference.mamba_chunk_scan import mamba_chunk_scan_reference

BACKENDS = ["xla", "pallas_triton", "pallas_mosaic_tpu"]
CHUNK = 64


def _inputs(seed, b=1, l=200, h=4, p=16, g=2, n=16, dtype=jnp.float32, d_shape="hp"):
    k = jax.random.split(jax.random.key(seed), 10)
    f = lambda i, s, dt=dtype: jax.random.normal(k[i], s, jnp.float32).astype(dt)  # noqa: E731
    return dict(x=f(0, (b, l, h, p)), dt=f(1, (b, l, h), jnp.float32) - 2.0,
                A=-jnp.exp(f(2, (h,), jnp.float32)), B=f(3, (b, l, g, n)),
                C=f(4, (b, l, g, n)), D=f(5, {"hp": (h, p), "h": (h,)}[d_shape], jnp.float32),
                z=f(6, (b, l, h, p)), dt_bias=f(7, (h,), jnp.float32),
                initial_states=f(8, (b, h, p, n), jnp.float32))


CU = np.array([0, 37, 37, 64, 150, 200], np.int32)  # an empty sequence, a chunk-end one
OPTIONS = dict(dt_softplus=True, dt_limit=(0.01, 3.0), return_final_states=True)
DIFFERENTIABLE = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def _seq_idx(cu, length):
    return jnp.asarray(np.searchsorted(cu[1:], np.arange(length), side="right")[None],
                       jnp.int32)


def _loss_and_grads(fn, arrays, weights, **kw):
    """Every output of the call not differentiated, and the gradient of every array
    argument of a random projection of the outputs. The two are separate programs: on
    the fused Triton route only the first runs the fused forward (a differentiated call
    takes the composition's forward and backward, mamba_scan.api)."""

    def call(*args):
        return fn(**dict(zip(DIFFERENTIABLE, args)), **kw)

    def loss(*args):
        return sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(call(*args), weights))

    args = [arrays[k] for k in DIFFERENTIABLE]
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(DIFFERENTIABLE)))))(*args)
    return jax.jit(call)(*args), grads


def _weights(seed, shapes):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


def _check(got, want, dtype, what):
    tol = parity.EXACT_FP32 if jnp.dtype(dtype) == jnp.float32 else parity.tolerance(dtype)
    parity.assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32),
                        dtype=jnp.float32, tol=tol, what=what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_option_values_and_gradients(backend):
    """D, z, dt_bias, softplus, dt_limit, initial states, packing by cu_seqlens (an empty
    sequence, one ending on a chunk boundary, a padded last chunk), final and varlen
    states: values and all nine gradients against jax.grad of the oracle."""
    a = _inputs(1)
    kw = dict(OPTIONS, chunk_size=CHUNK, cu_seqlens=jnp.asarray(CU), return_varlen_states=True)
    shapes = [a["x"].shape, a["initial_states"].shape, (len(CU) - 1,) + a["initial_states"].shape[1:]]
    weights = _weights(2, shapes)
    got, got_grads = _loss_and_grads(
        functools.partial(mamba_chunk_scan, implementation=backend), a, weights, **kw)
    want, want_grads = _loss_and_grads(mamba_chunk_scan_reference, a, weights, **kw)
    for name, g, w in zip(("y", "final_states", "varlen_states"), got, want):
        _check(g, w, jnp.float32, name)
    for name, g, w in zip(DIFFERENTIABLE, got_grads, want_grads):
        _check(g, w, jnp.float32, "d" + name)


@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
def test_bf16_inputs_with_seq_idx_and_per_head_d(backend):
    a = _inputs(3, b=2, dtype=jnp.bfloat16, d_shape="h", g=1)
    seq_idx = jnp.concatenate([_seq_idx(CU, 200), _seq_idx(np.array([0, 120, 200]), 200)])
    kw = dict(OPTIONS, chunk_size=CHUNK, seq_idx=seq_idx)
    weights = _weights(4, [a["x"].shape, a["initial_states"].shape])
    got, got_grads = _loss_and_grads(
        functools.partial(mamba_chunk_scan, implementation=backend), a, weights, **kw)
    want, want_grads = _loss_and_grads(mamba_chunk_scan_reference, a, weights, **kw)
    assert got[0].dtype == jnp.bfloat16
    for name, g, w in zip(("y", "final_states"), got, want):
        _check(g, w, jnp.bfloat16, name)
    for name, g, w in zip(DIFFERENTIABLE, got_grads, want_grads):
        _check(g, w, jnp.bfloat16, "d" + name)


def test_cu_seqlens_alone_packs_as_seq_idx_does():
    a = _inputs(5)
    args = [a[k] for k in ("x", "dt", "A", "B", "C")]
    by_cu = mamba_chunk_scan(*args, CHUNK, cu_seqlens=jnp.asarray(CU))
    by_idx = mamba_chunk_scan(*args, CHUNK, seq_idx=_seq_idx(CU, 200))
    np.testing.assert_array_equal(np.asarray(by_cu), np.asarray(by_idx))
    unpacked = mamba_chunk_scan(*args, CHUNK)
    assert not np.allclose(np.asarray(unpacked), np.asarray(by_cu))


def test_return_order_is_mamba_ssms():
    a = _inputs(6)
    args = [a[k] for k in ("x", "dt", "A", "B", "C")]
    cu = jnp.asarray(CU)
    y = mamba_chunk_scan(*args, CHUNK)
    assert isinstance(y, jax.Array) and y.shape == a["x"].shape
    y2, final = mamba_chunk_scan(*args, CHUNK, return_final_states=True)
    y3, varlen = mamba_chunk_scan(*args, CHUNK, cu_seqlens=cu, return_varlen_states=True)
    y4, final4, varlen4 = mamba_chunk_scan(*args, CHUNK, cu_seqlens=cu,
                                           return_final_states=True,
                                           return_varlen_states=True)
    assert final.shape == a["initial_states"].shape and final.dtype == jnp.float32
    assert varlen.shape == (len(CU) - 1,) + final.shape[1:]
    np.testing.assert_array_equal(np.asarray(y3), np.asarray(y4))
    np.testing.assert_array_equal(np.asarray(varlen), np.asarray(varlen4))
    # The last sequence ends the row: its state is the final state.
    np.testing.assert_allclose(np.asarray(varlen4[-1]), np.asarray(final4[0]), rtol=1e-6,
                               atol=1e-6)


def test_prefill_then_decode_steps_equal_one_scan():
    """A prefill of 180 steps through mamba_chunk_scan, its final state as the decode
    cache, then 20 selective_state_update steps: the outputs and the state equal one scan
    over the 200 steps (every option on)."""
    a = _inputs(7)
    opts = dict(D=a["D"], dt_bias=a["dt_bias"], dt_softplus=True)
    seq = {k: a[k] for k in ("x", "dt", "B", "C")}
    y_all, final_all = mamba_chunk_scan(**seq, A=a["A"], z=a["z"], chunk_size=CHUNK,
                                        initial_states=a["initial_states"],
                                        return_final_states=True, **opts)
    cut = 180
    _, cache = mamba_chunk_scan(**{k: v[:, :cut] for k, v in seq.items()}, A=a["A"],
                                z=a["z"][:, :cut], chunk_size=CHUNK,
                                initial_states=a["initial_states"], return_final_states=True,
                                **opts)
    step = jax.jit(functools.partial(selective_state_update, **opts))
    for t in range(cut, 200):
        y_t, cache = step(cache, a["x"][:, t], a["dt"][:, t], a["A"], a["B"][:, t],
                          a["C"][:, t], z=a["z"][:, t])
        np.testing.assert_allclose(np.asarray(y_t), np.asarray(y_all[:, t]), rtol=2e-5,
                                   atol=2e-5)
    np.testing.assert_allclose(np.asarray(cache), np.asarray(final_all), rtol=2e-5,
                               atol=2e-5)


def _count_fused(monkeypatch):
    """A list that gets "fused" for each call of the fused Triton route."""
    from pallasite.kernels.mamba_scan import fused

    routes = []
    real = fused.scan
    monkeypatch.setattr(fused, "scan", lambda *a, **k: routes.append("fused") or real(*a, **k))
    return routes


@pytest.mark.parametrize("implementation", [None, "pallas_triton"], ids=["default", "fused"])
@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO], ids=["explicit", "auto"])
def test_sequence_split_over_devices_with_packing(axis_type, implementation, monkeypatch):
    """Length 1024 over 8 devices (2 chunks each) with seq_idx packing sequences whose
    boundaries fall inside and between devices' parts: values and gradients equal the
    unsharded call's, on the default backend (the composition around chunk_ssd) and on
    the fused Triton route (each part's fused forward from the state the exchange gives
    it; the gradients the composition's); there neither the forward's nor the
    gradients' compiled program moves an array larger than a state."""
    routes = _count_fused(monkeypatch)
    a = _inputs(8, l=1024, h=2, g=1)
    cu = np.array([0, 100, 128, 129, 600, 1024], np.int32)
    seq_idx = _seq_idx(cu, 1024)
    kw = dict(OPTIONS, chunk_size=CHUNK, seq_idx=seq_idx, implementation=implementation)
    weights = _weights(9, [a["x"].shape, a["initial_states"].shape])
    mesh = st.mesh((8,), ("seq",), axis_type)
    placed = {k: (st.put(v, mesh, None, "seq") if v.ndim > 2 and v.shape[1] == 1024
                  else st.put(v, mesh)) for k, v in a.items()}
    kw_placed = dict(kw, seq_idx=st.put(seq_idx, mesh, None, "seq"))
    with jax.set_mesh(mesh):
        got, got_grads = _loss_and_grads(mamba_chunk_scan, placed, weights, **kw_placed)
        if implementation and axis_type == st.EXPLICIT:
            def call(*t):
                return mamba_chunk_scan(**dict(zip(DIFFERENTIABLE, t)), **kw_placed)

            def loss(*t):
                return sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(call(*t), weights))

            state = math.prod(a["initial_states"].shape)
            # The fused forward's exchange, and the composition's forward and backward.
            for program in (call, jax.grad(loss, argnums=tuple(range(len(DIFFERENTIABLE))))):
                found = st.compiled_collectives(program, *(placed[k] for k in DIFFERENTIABLE))
                assert all(math.prod(s) <= 8 * state for v in found.values() for s in v), found
    assert bool(routes) == bool(implementation)
    want, want_grads = _loss_and_grads(mamba_chunk_scan, a, weights, **kw)
    for name, g, w in zip(("y", "final_states") + tuple("d" + k for k in DIFFERENTIABLE),
                          list(got) + list(got_grads), list(want) + list(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=3e-5, atol=3e-5,
                                   err_msg=name)


@pytest.mark.parametrize("implementation", [None, "pallas_triton"], ids=["default", "fused"])
def test_sequence_axes_inside_a_callers_shard_map_with_seq_idx(implementation, monkeypatch):
    """Each of 8 devices holds 100 steps; a sequence starts exactly at a part's first step
    (step 300), which only the previous part's last seq_idx shows. Values and the
    gradients of x, dt, B, C and z equal the unsharded call's, on the default backend and
    on the fused Triton route."""
    routes = _count_fused(monkeypatch)
    a = _inputs(10, l=800, h=2, g=1)
    cu = np.array([0, 250, 300, 777, 800], np.int32)
    seq_idx = _seq_idx(cu, 800)
    mesh = st.mesh((8,), ("seq",), st.AUTO)
    names = ("x", "dt", "B", "C", "z")

    def run(x, dt, B, C, z, seq_idx, **kw):
        return mamba_chunk_scan(x, dt, a["A"], B, C, CHUNK, D=a["D"], z=z,
                                dt_bias=a["dt_bias"], dt_softplus=True,
                                initial_states=a["initial_states"], seq_idx=seq_idx,
                                return_final_states=True, implementation=implementation,
                                **kw)

    seq = P(None, "seq")
    sharded = jax.shard_map(functools.partial(run, sequence_axes="seq"), mesh=mesh,
                            in_specs=(seq,) * 6, out_specs=(seq, P()))
    weights = _weights(11, [a["x"].shape, a["initial_states"].shape])

    def values_and_grads(fn):
        def loss(*t):
            return sum(jnp.sum(o * w) for o, w in zip(fn(*t, seq_idx), weights))
        args = [a[k] for k in names]
        grads = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(*args)
        return jax.jit(lambda *t: fn(*t, seq_idx))(*args), grads

    got, got_grads = values_and_grads(sharded)
    want, want_grads = values_and_grads(run)
    assert bool(routes) == bool(implementation)
    for g, w in zip(list(got) + list(got_grads), list(want) + list(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_fused_route_inside_a_shard_map_over_the_batch(monkeypatch):
    """Inside a shard_map over 4 devices, each holding one row of the batch, the fused
    Triton route runs on the local arrays; the gradients of A, D and dt_bias (the same
    on every device) are summed over the devices, and every value and gradient is the
    oracle's on the whole batch."""
    routes = _count_fused(monkeypatch)
    a = _inputs(19, b=4, l=128, h=4, g=2)
    mesh = st.mesh((4,), ("data",), st.AUTO)
    batch = P("data")
    specs = dict(x=batch, dt=batch, A=P(), B=batch, C=batch, D=P(), z=batch, dt_bias=P(),
                 initial_states=batch)
    kw = dict(OPTIONS, chunk_size=CHUNK)
    weights = _weights(20, [a["x"].shape, a["initial_states"].shape])

    def local(*t):
        return mamba_chunk_scan(**dict(zip(DIFFERENTIABLE, t)), implementation="pallas_triton",
                                **kw)

    sharded = jax.shard_map(local, mesh=mesh,
                            in_specs=tuple(specs[k] for k in DIFFERENTIABLE),
                            out_specs=(batch, batch))
    got, got_grads = _loss_and_grads(lambda **t: sharded(*(t[k] for k in DIFFERENTIABLE)),
                                     a, weights)
    assert routes and set(routes) == {"fused"}
    want, want_grads = _loss_and_grads(mamba_chunk_scan_reference, a, weights, **kw)
    for name, g, w in zip(("y", "final_states"), got, want):
        _check(g, w, jnp.float32, name)
    for name, g, w in zip(DIFFERENTIABLE, got_grads, want_grads):
        _check(g, w, jnp.float32, "d" + name)


@pytest.mark.parametrize("change, error, message", [
    (dict(dt=jnp.zeros((1, 200, 3))), ValueError, "dt must be"),
    (dict(D=jnp.zeros((5,))), ValueError, "D must be"),
    (dict(z=jnp.zeros((1, 200, 4, 8))), ValueError, "z must be"),
    (dict(cu_seqlens=jnp.array([0, 10, 150])), ValueError, "end at the length 200"),
    (dict(seq_idx=jnp.zeros((1, 200), jnp.float32)), TypeError, "seq_idx must be an integer"),
    (dict(return_varlen_states=True), ValueError, "needs cu_seqlens"),
    (dict(dt_limit=(2.0, 1.0)), ValueError, "dt_limit"),
    (dict(chunk_size=64.0), TypeError, "chunk_size"),
])
def test_bad_arguments_are_named(change, error, message):
    a = _inputs(11)
    args = dict({k: a[k] for k in ("x", "dt", "A", "B", "C")}, chunk_size=CHUNK)
    with pytest.raises(error, match=message):
        mamba_chunk_scan(**{**args, **change})


def test_varlen_states_with_sequence_axes_is_refused_by_name():
    a = _inputs(12)
    mesh = st.mesh((8,), ("seq",), st.AUTO)

    def body(x):
        return mamba_chunk_scan(x, a["dt"], a["A"], a["B"], a["C"], CHUNK,
                                cu_seqlens=jnp.asarray(CU), return_varlen_states=True,
                                sequence_axes="seq")

    with pytest.raises(NotImplementedError, match="return_varlen_states with sequence_axes"):
        jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(a["x"])


def test_lowers_for_cuda_with_the_triton_kernels(monkeypatch):
    """The whole call lowers for an H200 from the CPU (told it is on a GPU, so the
    kernels compile, not interpret): not differentiated, dt processing, resets and the
    fused forward (dt, D and z in its two kernels); differentiated, the composition's
    forward and chunk_ssd's backward kernels."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    routes = _count_fused(monkeypatch)
    a = _inputs(13, l=256, h=2, p=64, n=64, g=1, dtype=jnp.bfloat16)

    def loss(x, dt, B, C, z):
        y = mamba_chunk_scan(x, dt, a["A"], B, C, CHUNK, D=a["D"][:2], z=z,
                             dt_bias=a["dt_bias"][:2], dt_softplus=True,
                             seq_idx=_seq_idx(np.array([0, 100, 256]), 256),
                             implementation="pallas_triton")
        return jnp.sum(y.astype(jnp.float32))

    args = [a[k] for k in ("x", "dt", "B", "C", "z")]
    texts, fused_calls = {}, {}
    for name, fn in (("forward", loss), ("grad", jax.grad(loss, argnums=(0, 1, 2, 3, 4)))):
        routes.clear()
        texts[name] = cuda_module(fn, *args)
        fused_calls[name] = list(routes)
    # The fused forward: the state scan and the output with dt, D and z.
    assert texts["forward"].count(TRITON_CALL) == 2
    assert fused_calls["forward"] == ["fused"]
    # Differentiated: chunk_ssd's two forward kernels and its three backward kernels; the
    # fused forward is not traced.
    assert texts["grad"].count(TRITON_CALL) == 5
    assert fused_calls["grad"] == []


def test_values_from_gives_one_functions_values_and_the_others_gradients():
    """autodiff.values_from, which the fused route stands on: the primal's values when
    not differentiated; differentiated, the other function's forward and gradients, the
    primal never traced; None operands pass through."""
    calls = []

    def primal(x, y, d):
        calls.append("primal")
        return x * y + 1.0

    def differentiated(x, y, d):
        calls.append("differentiated")
        return x * y if d is None else x * y + d

    f = autodiff.values_from(primal, differentiated)
    x, y = jnp.float32(2.0), jnp.float32(3.0)
    assert float(f(x, y, None)) == 7.0 and calls == ["primal"]
    calls.clear()
    value, grads = jax.value_and_grad(f, argnums=(0, 1))(x, y, None)
    assert float(value) == 6.0 and [float(g) for g in grads] == [3.0, 2.0]
    assert calls == ["differentiated"]


def test_fused_route_under_jax_checkpoint(monkeypatch):
    """Inside jax.checkpoint (remat) the fused forward gives the plain call's values and
    the differentiated call rematerialises the composition's forward: values and all
    nine gradients the oracle's."""
    routes = _count_fused(monkeypatch)
    a = _inputs(23)
    kw = dict(OPTIONS, chunk_size=CHUNK)
    weights = _weights(24, [a["x"].shape, a["initial_states"].shape])

    def checkpointed(**t):
        def call(*v):
            return mamba_chunk_scan(**dict(zip(DIFFERENTIABLE, v)),
                                    implementation="pallas_triton", **kw)
        return jax.checkpoint(call)(*(t[k] for k in DIFFERENTIABLE))

    got, got_grads = _loss_and_grads(checkpointed, a, weights)
    assert routes and set(routes) == {"fused"}  # remat traces the primal as well
    want, want_grads = _loss_and_grads(mamba_chunk_scan_reference, a, weights, **kw)
    for name, g, w in zip(("y", "final_states"), got, want):
        _check(g, w, jnp.float32, name)
    for name, g, w in zip(DIFFERENTIABLE, got_grads, want_grads):
        _check(g, w, jnp.float32, "d" + name)


def test_triton_takes_dt_d_and_z_into_its_kernels(monkeypatch):
    """With Triton first on local operands, x dt is never formed in the forward and the
    output kernel takes dt, D and z (fused.py): the forward is the two kernels."""
    routes = _count_fused(monkeypatch)
    a = _inputs(16, dtype=jnp.bfloat16)
    kw = dict(D=a["D"], z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True)

    def call(x):
        return mamba_chunk_scan(x, a["dt"], a["A"], a["B"], a["C"], CHUNK,
                                implementation="pallas_triton", **kw)

    jaxpr = str(jax.make_jaxpr(call)(a["x"]))
    assert routes == ["fused"]
    assert jaxpr.count("pallas_call[") == 2  # the state scan and the output, nothing else
    assert jaxpr.count("name=ssd_chunk_output") == 1
    want = mamba_chunk_scan_reference(*(a[k].astype(jnp.float32)
                                        for k in ("x", "dt", "A", "B", "C")), CHUNK, **kw)
    _check(call(a["x"]), want, jnp.bfloat16, "y, fused")


def test_a_failing_fused_route_falls_back_to_the_composition(monkeypatch, caplog):
    """With a sequence of implementations, a fused route that fails while tracing is
    logged and the call takes chunk_ssd's selection (values the oracle's); with one name
    its error reaches the caller."""
    from pallasite.kernels.mamba_scan import fused

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(fused, "scan", broken)
    a = _inputs(21)
    kw = dict(D=a["D"], z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True)
    args = [a[k] for k in ("x", "dt", "A", "B", "C")]
    with caplog.at_level("WARNING", logger="pallasite.ssd"):
        got = mamba_chunk_scan(*args, CHUNK, implementation=("pallas_triton", "xla"), **kw)
    assert "fused pallas_triton route failed while tracing (RuntimeError: no kernel today)" \
        in caplog.text
    _check(got, mamba_chunk_scan_reference(*args, CHUNK, **kw), jnp.float32, "y, fallback")
    with pytest.raises(RuntimeError, match="no kernel today"):
        mamba_chunk_scan(*args, CHUNK, implementation="pallas_triton", **kw)


@pytest.mark.parametrize("dt_limit, nonnegative", [((0.0, math.inf), False),
                                                    ((0.0, 1.0), True)],
                         ids=["signed_dt", "dt_clamped_at_zero"])
def test_fused_route_takes_dt_of_either_sign(dt_limit, nonnegative, monkeypatch):
    """Without softplus dt may be negative: the output kernel then scales its tile by dt
    rather than adding log dt to the decay's exponent. A clamp at 0 makes exact zeros
    (log 0 = -inf in the exponent): both match the oracle, values and gradients."""
    from pallasite.kernels.mamba_scan import fused

    seen = []
    real = fused.scan
    monkeypatch.setattr(fused, "scan", lambda *a, **k: seen.append(k["dt_nonnegative"])
                        or real(*a, **k))
    a = _inputs(19)
    # Steps of either sign, small enough that A dt > 0 does not overflow the decay.
    a["dt"] = 0.1 * (a["dt"] + 2.0)
    a["dt_bias"] = jnp.zeros_like(a["dt_bias"])
    assert float(jnp.min(a["dt"])) < 0 < float(jnp.max(a["dt"]))
    kw = dict(chunk_size=CHUNK, dt_limit=dt_limit, return_final_states=True)
    weights = _weights(20, [a["x"].shape, a["initial_states"].shape])
    got, got_grads = _loss_and_grads(
        functools.partial(mamba_chunk_scan, implementation="pallas_triton"), a, weights, **kw)
    want, want_grads = _loss_and_grads(mamba_chunk_scan_reference, a, weights, **kw)
    assert seen and set(seen) == {nonnegative}
    for name, g, w in zip(("y", "final_states"), got, want):
        _check(g, w, jnp.float32, name)
    for name, g, w in zip(DIFFERENTIABLE, got_grads, want_grads):
        _check(g, w, jnp.float32, "d" + name)


@pytest.mark.parametrize("layout", ["batch_and_heads_explicit", "batch_auto",
                                    "sequence_explicit"])
def test_fused_route_over_a_jits_mesh(layout, monkeypatch):
    """Under jit over 8 devices the fused route keeps batch and heads split, or the
    sequence in runs of whole chunks (its planner; the gradients are the composition's),
    with values and all nine gradients the oracle's, and no collective of the gradients'
    program moves an array half x's size."""
    routes = _count_fused(monkeypatch)
    if layout == "sequence_explicit":
        a = _inputs(17, b=1, l=256, h=4, g=2)
        mesh = st.mesh((4,), ("seq",), st.EXPLICIT)
        seq = {"x": P(None, "seq"), "dt": P(None, "seq"), "B": P(None, "seq"),
               "C": P(None, "seq"), "z": P(None, "seq")}
    else:
        a = _inputs(17, b=2, l=200, h=8, g=4)
        kind = st.AUTO if layout == "batch_auto" else st.EXPLICIT
        mesh = st.mesh((2, 4), ("data", "model"), kind)
        heads = "model" if kind == st.EXPLICIT else None
        seq = {"x": P("data", None, heads), "dt": P("data", None, heads),
               "B": P("data", None, heads), "C": P("data", None, heads),
               "z": P("data", None, heads), "D": P(heads), "initial_states": P("data", heads)}
    kw = dict(OPTIONS, chunk_size=CHUNK)
    weights = _weights(18, [a["x"].shape, a["initial_states"].shape])
    with jax.set_mesh(mesh):
        placed = {k: jax.device_put(v, jax.NamedSharding(mesh, seq.get(k, P())))
                  for k, v in a.items()}
        got, got_grads = _loss_and_grads(
            functools.partial(mamba_chunk_scan, implementation="pallas_triton"), placed,
            weights, **kw)
        if layout == "batch_and_heads_explicit":
            def loss(*t):
                out = mamba_chunk_scan(**dict(zip(DIFFERENTIABLE, t)),
                                       implementation="pallas_triton", **kw)
                return sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(out, weights))
            found = st.compiled_collectives(
                jax.grad(loss, argnums=tuple(range(len(DIFFERENTIABLE)))),
                *(placed[k] for k in DIFFERENTIABLE))
            moved = [s for shapes in found.values() for s in shapes]
            assert all(math.prod(s) < a["x"].size // 2 for s in moved), found
    assert routes and set(routes) == {"fused"}
    want, want_grads = _loss_and_grads(mamba_chunk_scan_reference, a, weights, **kw)
    for name, g, w in zip(("y", "final_states"), got, want):
        _check(g, w, jnp.float32, f"{name}, {layout}")
    for name, g, w in zip(DIFFERENTIABLE, got_grads, want_grads):
        _check(g, w, jnp.float32, f"d{name}, {layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_gpu_default_path_against_the_oracle(dtype):
    """On the GPU the default choice (the Triton kernels): every option, packing and
    varlen states, values and gradients, at a real head size."""
    a = _inputs(14, l=1000, h=8, p=64, n=128, g=2, dtype=dtype)
    cu = np.array([0, 300, 301, 777, 1000], np.int32)
    kw = dict(OPTIONS, chunk_size=256, cu_seqlens=jnp.asarray(cu), return_varlen_states=True)
    shapes = [a["x"].shape, a["initial_states"].shape, (len(cu) - 1,) + a["initial_states"].shape[1:]]
    weights = _weights(15, shapes)
    got, got_grads = _loss_and_grads(mamba_chunk_scan, a, weights, **kw)
    want, want_grads = _loss_and_grads(mamba_chunk_scan_reference, a, weights, **kw)
    tol_dtype = dtype  # fp32: the float32 tolerance admits TF32 dots
    for name, g, w in zip(("y", "final_states", "varlen_states"), got, want):
        parity.assert_close(np.asarray(g, np.float32), np.asarray(w, np.float32),
                            dtype=tol_dtype, what=name)
    for name, g, w in zip(DIFFERENTIABLE, got_grads, want_grads):
        parity.assert_close(np.asarray(g, np.float32), np.asarray(w, np.float32),
                            dtype=tol_dtype, what="d" + name)
    assert not math.isnan(float(jnp.sum(got[0].astype(jnp.float32))))
