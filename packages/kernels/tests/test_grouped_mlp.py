"""grouped_mlp against its definition (pallasite.reference.grouped_mlp): values on every
grouped_projection backend (the Pallas kernels interpreted on CPU), both activations, row
weights, empty groups and rows past the total, the four gradients, local experts
(group_offset) and expert parallelism over 8 devices, the fp8 recipe, the argument
checks; and the definition itself against a float64 NumPy loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding_testlib as st
from pallasite.kernels import grouped_mlp
from pallasite.reference import parity
from pallasite.reference.grouped_mlp import grouped_mlp_reference

BACKENDS = ["xla", "pallas_triton", "pallas_mosaic_tpu"]
SIZES = [30, 0, 40, 20]  # an empty group; 6 rows past the total


def _inputs(seed, m=96, d=64, f=64, n=128, g=4, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 4)
    return dict(x=jax.random.normal(k[0], (m, d)).astype(dtype),
                gate_up_kernel=(jax.random.normal(k[1], (g, d, 2 * f)) / 8).astype(dtype),
                down_kernel=(jax.random.normal(k[2], (g, f, n)) / 8).astype(dtype),
                row_weights=jax.random.uniform(k[3], (m,), minval=0.1, maxval=1.0))


def _numpy_mlp(x, wgu, wd, sizes, rw, activation):
    """float64, row by row."""
    x, wgu, wd = (np.asarray(t, np.float64) for t in (x, wgu, wd))
    f = wd.shape[1]
    out = np.zeros((x.shape[0], wd.shape[2]))
    row = 0
    for i, size in enumerate(sizes):
        for r in range(row, row + size):
            pre = x[r] @ wgu[i]
            gate, up = pre[:f], pre[f:]
            if activation == "swiglu":
                act = gate / (1 + np.exp(-gate))
            else:
                act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
            out[r] = (act * up) @ wd[i] * (1.0 if rw is None else float(rw[r]))
        row += size
    return out


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_the_definition_against_a_numpy_loop(activation):
    a = _inputs(1)
    with jax.enable_x64(True):
        wide = {k: v.astype(jnp.float64) for k, v in a.items()}
        got = grouped_mlp_reference(**wide, group_sizes=jnp.asarray(SIZES, jnp.int32),
                                    compute=jnp.float64, activation=activation)
    want = _numpy_mlp(a["x"], a["gate_up_kernel"], a["down_kernel"], SIZES,
                      np.asarray(a["row_weights"]), activation)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


VALUE_CASES = [(b, d) for b in BACKENDS for d in ("fp32", "bf16")] + [
    ("pallas_mosaic_gpu", "bf16")]  # Mosaic GPU takes 16-bit operands only


@pytest.mark.parametrize("backend, dtype_name", VALUE_CASES)
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_values_on_every_backend(backend, dtype_name, activation):
    """fp32: equal to the definition; bf16: within the bf16 tolerance (the composition
    rounds the pre-activation and y once more than the definition)."""
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype_name]
    a = _inputs(2, dtype=dtype)
    gs = jnp.asarray(SIZES, jnp.int32)
    got = jax.jit(functools.partial(grouped_mlp, compute=dtype, interpret_on_cpu=True,
                                    activation=activation, implementation=backend))(
        **a, group_sizes=gs)
    want = grouped_mlp_reference(**a, group_sizes=gs, compute=dtype, activation=activation)
    assert got.dtype == dtype and got.shape == (96, 128)
    assert not np.asarray(got[90:], np.float32).any()  # rows past the total
    tol = parity.EXACT_FP32 if dtype == jnp.float32 else parity.tolerance(dtype)
    parity.assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32),
                        dtype=dtype, tol=tol, what="y")


@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
def test_gradients_of_all_four_arguments(backend):
    a = _inputs(3)
    gs = jnp.asarray(SIZES, jnp.int32)
    cot = jax.random.normal(jax.random.key(4), (96, 128))
    names = ("x", "gate_up_kernel", "down_kernel", "row_weights")

    def grads(fn):
        def loss(*args):
            return jnp.sum(fn(**dict(zip(names, args)), group_sizes=gs,
                              compute=jnp.float32) * cot)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(a[k] for k in names))

    got = grads(functools.partial(grouped_mlp, interpret_on_cpu=True, implementation=backend))
    want = grads(grouped_mlp_reference)
    for name, g, w in zip(names, got, want):
        parity.assert_close(np.asarray(g), np.asarray(w), dtype=jnp.float32,
                            tol=parity.EXACT_FP32, what="d" + name)


def test_local_experts_with_group_offset():
    """The kernels hold experts [2, 4) of 6: only their rows are computed, the rest zero."""
    gs = jnp.asarray([10, 15, 20, 0, 30, 12], jnp.int32)
    local = {k: (v[2:4] if "kernel" in k else v) for k, v in
             _inputs(5, g=6).items()}
    got = grouped_mlp(**local, group_sizes=gs, compute=jnp.float32, group_offset=2)
    want = grouped_mlp_reference(**local, group_sizes=gs, compute=jnp.float32, group_offset=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert not np.asarray(got[:25]).any() and not np.asarray(got[45:]).any()
    assert np.asarray(got[25:45]).any()


@pytest.mark.parametrize("dtype, implementation", [
    (jnp.float32, None), (jnp.bfloat16, "pallas_triton")])  # the composition; fused
def test_expert_parallel_over_eight_devices(dtype, implementation, monkeypatch):
    """Each device holds one of 8 experts (group_offset = its index) and the tokens whole;
    the sum over devices is the whole layer, values and gradients. In bf16 with Triton
    named and fuse_activation, the gate-up runs fused inside the shard_map."""
    seen = _record_fused(monkeypatch)
    g = 8
    a = _inputs(6, m=160, g=g, dtype=dtype)
    gs = jnp.asarray([20, 0, 31, 9, 40, 10, 25, 15], jnp.int32)
    mesh = st.mesh((g,), ("expert",), st.AUTO)
    names = ("x", "gate_up_kernel", "down_kernel", "row_weights")

    def local(x, wgu, wd, rw):
        me = jax.lax.axis_index("expert")
        y = grouped_mlp(x, wgu, wd, gs, dtype, True, row_weights=rw, group_offset=me,
                        implementation=implementation,
                        fuse_activation=implementation is not None)
        return jax.lax.psum(y.astype(jnp.float32), "expert")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("expert"), P("expert"), P()),
                            out_specs=P())
    cot = jax.random.normal(jax.random.key(7), (160, 128))

    def run(fn):
        return jax.jit(jax.value_and_grad(lambda *t: jnp.sum(fn(*t) * cot), argnums=(0, 1, 2, 3)))(
            *(a[k] for k in names))

    got = run(sharded)
    want = run(lambda x, wgu, wd, rw: grouped_mlp_reference(
        x, wgu, wd, gs, dtype, row_weights=rw).astype(jnp.float32))
    for g_, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if dtype == jnp.float32:
            np.testing.assert_allclose(np.asarray(g_), np.asarray(w), rtol=5e-5, atol=5e-5)
        else:
            parity.assert_close(np.asarray(g_, np.float32), np.asarray(w, np.float32),
                                dtype=dtype, what="expert parallel, bf16")
    assert seen == ([implementation] if implementation else [])


def test_fp8_recipe_stays_near_the_definition():
    """recipe="fp8" runs both products in e4m3 (1 x 128 and 128 x 128 blocks): within a
    few percent of the unquantized definition, as grouped_projection's recipe is."""
    a = _inputs(8, m=256, d=256, f=128, n=256)
    gs = jnp.asarray([64, 0, 128, 32], jnp.int32)
    got = grouped_mlp(**a, group_sizes=gs, compute=jnp.bfloat16, recipe="fp8")
    want = grouped_mlp_reference(**a, group_sizes=gs, compute=jnp.float32)
    err = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert 1e-4 < err < 0.1, err  # quantized (not the bf16 result), and close


@pytest.mark.parametrize("change, error, message", [
    (dict(activation="relu"), ValueError, "activation='relu'"),
    (dict(gate_up_kernel=jnp.zeros((4, 64, 127))), ValueError, "odd"),
    (dict(down_kernel=jnp.zeros((4, 32, 128))), ValueError, "down_kernel must be"),
    (dict(row_weights=jnp.zeros((95,))), ValueError, "row_weights must be"),
    (dict(row_weights=jnp.zeros((96,), jnp.int32)), TypeError, "row_weights must be floating"),
    (dict(compute=None), TypeError, "compute"),
    (dict(group_sizes=jnp.asarray([1, 2, 3], jnp.int32)), ValueError, "group_sizes"),
])
def test_bad_arguments_are_named(change, error, message):
    args = dict(_inputs(9), group_sizes=jnp.asarray(SIZES, jnp.int32), compute=jnp.float32)
    with pytest.raises(error, match=message):
        grouped_mlp(**{**args, **change})


# ------------------------------------------------------------------ the fused gate-up route


def _record_fused(monkeypatch, downs=None):
    """The gate-up calls that take the fused route (and, into `downs` where given, the
    down products that take the weighted epilogue)."""
    from pallasite.kernels.expert_mlp import api, ops

    seen = []
    real = ops.gate_up_activation
    monkeypatch.setattr(api.ops, "gate_up_activation",
                        lambda *a, **k: seen.append(k["backend"]) or real(*a, **k))
    if downs is not None:
        real_down = ops.down_weighted
        monkeypatch.setattr(api.ops, "down_weighted",
                            lambda *a, **k: downs.append(k["backend"]) or real_down(*a, **k))
    return seen


@pytest.mark.parametrize("backend", ["pallas_mosaic_gpu", "pallas_triton", None])
def test_fuse_activation_takes_the_fused_gate_up(backend, monkeypatch):
    """bf16 with fuse_activation: the gate-up runs fused on the named backend (or, with
    none named, the first fused backend that runs here: Mosaic GPU, interpreted), h
    rounded once as the definition, values and the four gradients within the bf16
    tolerance of the definition's. Without it a named backend runs the composition."""
    seen = _record_fused(monkeypatch)
    a = _inputs(10, dtype=jnp.bfloat16)
    gs = jnp.asarray(SIZES, jnp.int32)
    names = ("x", "gate_up_kernel", "down_kernel", "row_weights")
    cot = jax.random.normal(jax.random.key(11), (96, 128))

    def run(fn):
        def loss(*t):
            y = fn(**dict(zip(names, t)), group_sizes=gs, compute=jnp.bfloat16)
            return jnp.sum(y.astype(jnp.float32) * cot), y
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            *(a[k] for k in names))

    (_, y), grads = run(functools.partial(grouped_mlp, interpret_on_cpu=True,
                                          implementation=backend, fuse_activation=True))
    assert seen == [backend or "pallas_mosaic_gpu"]
    (_, y_ref), grads_ref = run(grouped_mlp_reference)
    parity.assert_close(y, y_ref, dtype=jnp.bfloat16, what="y")
    for name, g, w in zip(names, grads, grads_ref):
        parity.assert_close(g, w, dtype=jnp.bfloat16, what="d" + name)
    grouped_mlp(**a, group_sizes=gs, compute=jnp.bfloat16, interpret_on_cpu=True,
                implementation=backend)
    assert seen == [backend or "pallas_mosaic_gpu"]  # not asked: the composition


def _saved_arrays(fn, *args):
    """(shape, dtype) of each array the forward keeps for the backward, arguments left out
    (jax's saved-residuals listing, traced abstractly)."""
    from jax._src.ad_checkpoint import saved_residuals
    return [(tuple(a.shape), a.dtype) for a, why in saved_residuals(fn, *args)
            if not why.startswith("from the argument") and a.size]


def test_what_the_forward_keeps_for_the_backward():
    """The composition keeps its bf16 pre-activation [m, 2f], h [m, f] and y [m, n]
    (the activation and the row weighting are rematerialised: no fp32 [m, f] array is
    kept), and the fused route keeps h alone: no [m, 2f] pre-activation and no [m, n]
    y (its down product's backward forms d row_weights from h), on both fused
    backends."""
    m, d, f, n = 96, 64, 64, 80  # n apart from 2f: shapes tell the arrays apart
    a = _inputs(14, m=m, d=d, f=f, n=n, dtype=jnp.bfloat16)
    gs = jnp.asarray(SIZES, jnp.int32)

    def saved(**options):
        def loss(x, wgu, wd, rw):
            y = grouped_mlp(x, wgu, wd, gs, jnp.bfloat16, interpret_on_cpu=True,
                            row_weights=rw, **options)
            return y.astype(jnp.float32).sum()
        arrays = _saved_arrays(loss, a["x"], a["gate_up_kernel"], a["down_kernel"],
                               a["row_weights"])
        big = [s for s in arrays if np.prod(s[0]) >= m * f]  # the activations
        return big, sum(np.prod(s) * np.dtype(t).itemsize for s, t in big)

    big, composition = saved(implementation="pallas_triton")
    assert sorted(big, key=str) == sorted([((m, 2 * f), jnp.bfloat16), ((m, f), jnp.bfloat16),
                                           ((m, n), jnp.bfloat16)], key=str), big
    pre = m * 2 * f * 2
    for backend in ("pallas_triton", "pallas_mosaic_gpu"):
        big, fused = saved(implementation=backend, fuse_activation=True)
        assert big == [((m, f), jnp.bfloat16)], (backend, big)
        assert fused <= composition - pre, (backend, fused, composition)


@pytest.mark.parametrize("change, message", [
    (dict(compute=jnp.float32), "pallas_triton: compute=float32 .*16-bit"),
    (dict(implementation="xla"), "implementation=None or one of"),
    (dict(implementation="xla", recipe="fp8"),
     "recipe='fp8' with fuse_activation=True takes implementation=None or one of"),
    (dict(implementation="pallas_triton", recipe="fp8"), "f=.* is not a multiple of 128"),
    (dict(implementation="pallas_mosaic_gpu", recipe="fp8"),
     "pallas_mosaic_gpu: f=.* is not a multiple of 128"),
    (dict(implementation="pallas_triton", block_sizes=()), "cannot run on pallas_triton: block sizes"),
    (dict(implementation="pallas_triton", fuse_activation=1), "fuse_activation must be a bool"),
])
def test_fuse_activation_says_why_it_cannot_run(change, message):
    """fuse_activation=True where no fused kernel can run raises, naming the reason,
    rather than quietly keeping the [m, 2f] pre-activation it was asked to drop."""
    a = _inputs(13, dtype=jnp.bfloat16)
    args = dict(**a, group_sizes=jnp.asarray(SIZES, jnp.int32), compute=jnp.bfloat16,
                interpret_on_cpu=True, fuse_activation=True)
    error = TypeError if "bool" in message else ValueError
    with pytest.raises(error, match=message):
        grouped_mlp(**{**args, **change})


@pytest.mark.parametrize("shards", [2, 3, 4, 8])
def test_gate_up_pairs_exchange_column_blocks(shards):
    """A [g, k, 2f] kernel split in `shards` contiguous parts: gate_up_pairs gives device
    i the gate and up columns [i f / n, (i + 1) f / n), and gate_up_unpairs returns them
    to the contiguous parts, bit for bit (odd counts included: 3 devices)."""
    from pallasite.kernels.expert_mlp import layouts
    f = 6 * shards
    w = jax.random.normal(jax.random.key(15), (2, 5, 2 * f))
    width = f // shards
    want = jnp.concatenate([jnp.concatenate([w[..., i * width:(i + 1) * width],
                                             w[..., f + i * width:f + (i + 1) * width]], -1)
                            for i in range(shards)], -1)
    mesh = st.mesh((shards,), ("model",))
    spec = P(None, None, "model")

    def over(fn):
        return jax.jit(jax.shard_map(lambda t: fn(t, ("model",), shards), mesh=mesh,
                                     in_specs=spec, out_specs=spec))

    with jax.set_mesh(mesh):
        pairs = over(layouts.gate_up_pairs)(st.put(w, mesh, *spec))
        back = over(layouts.gate_up_unpairs)(pairs)
    np.testing.assert_array_equal(np.asarray(pairs), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(w))


@pytest.mark.parametrize("layout", [
    "rows_explicit", "rows_auto", "experts_explicit", "rows_and_experts_explicit",
    "rows_over_experts_explicit", "columns_explicit", "columns_auto", "width_explicit",
    "width_auto"])
def test_fuse_activation_over_a_jits_mesh(layout, monkeypatch):
    """fuse_activation under jit over 8 devices: the fused gate-up keeps the rows and the
    experts split (its planner) and takes the contraction and the 2f columns whole, and
    the Triton down product with the row weights in its epilogue runs through its own
    planners (the down kernel's f split in "columns_explicit" is a split contraction
    there); the values and the four gradients are the definition's within bf16
    tolerance, for rows split over Explicit and Auto axes, experts split, both, rows
    split over the expert axis too, and kernels split along their columns over a
    tensor-parallel axis (Explicit and Auto): the gate-up kernel stays split, exchanged
    into gate|up pairs by collective permutes, and no collective moves a whole kernel;
    and a down kernel split along its n columns (the model width, "width_*"): y and dy
    stay split along n, the down backward sums dh and d row_weights over it, and no
    collective moves a whole down kernel."""
    downs = []
    seen = _record_fused(monkeypatch, downs)
    g = 8
    n = 96  # apart from 2f = 128: a collective's shape tells the kernels apart
    a = _inputs(12, m=160, g=g, n=n, dtype=jnp.bfloat16)
    gs = jnp.asarray([20, 0, 31, 9, 40, 10, 25, 15], jnp.int32)
    names = ("x", "gate_up_kernel", "down_kernel", "row_weights")
    kind = st.AUTO if layout.endswith("auto") else st.EXPLICIT
    if layout in ("rows_and_experts_explicit",):
        mesh = st.mesh((2, 4), ("data", "expert"), kind)
        specs = (P("data", None), P("expert"), P("expert"), P("data"))
    elif layout == "rows_over_experts_explicit":
        mesh = st.mesh((2, 4), ("data", "expert"), kind)
        specs = (P(("data", "expert"), None), P("expert"), P("expert"), P(("data", "expert")))
    elif layout == "experts_explicit":
        mesh = st.mesh((8,), ("expert",), kind)
        specs = (P(), P("expert"), P("expert"), P())
    elif layout.startswith("columns_"):
        mesh = st.mesh((8,), ("model",), kind)
        specs = (P(), P(None, None, "model"), P(None, "model"), P())
    elif layout.startswith("width_"):
        mesh = st.mesh((8,), ("model",), kind)
        specs = (P(), P(), P(None, None, "model"), P())
    else:
        mesh = st.mesh((8,), ("data",), kind)
        specs = (P("data", None), P(), P(), P("data"))
    cot = jax.random.normal(jax.random.key(13), (160, n))

    def run(fn, args):
        def loss(*t):
            y = fn(*t)
            return jnp.sum(y.astype(jnp.float32) * cot), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)

    def fused(x, wgu, wd, rw):
        return grouped_mlp(x, wgu, wd, gs, jnp.bfloat16, interpret_on_cpu=True,
                           row_weights=rw, implementation="pallas_triton",
                           fuse_activation=True)

    with jax.set_mesh(mesh):
        args = [jax.device_put(a[k], jax.NamedSharding(mesh, spec))
                for k, spec in zip(names, specs)]
        (_, y), grads = run(fused, args)
        if layout.startswith("rows_"):  # no collective moves an array of all 160 rows
            found = st.compiled_collectives(
                jax.grad(lambda *t: jnp.sum(fused(*t).astype(jnp.float32) * cot),
                         argnums=(0, 1, 2, 3)), *args)
            moved = [s for shapes in found.values() for s in shapes]
            assert not [s for s in moved if s and s[0] == 160], found
        if layout.startswith("columns_"):  # pairs exchanged, no kernel gathered
            found = st.compiled_collectives(
                jax.grad(lambda *t: jnp.sum(fused(*t).astype(jnp.float32) * cot),
                         argnums=(0, 1, 2, 3)), *args)
            moved = [s for shapes in found.values() for s in shapes]
            assert found.get("collective-permute"), found
            assert not [s for s in moved if s in ((g, 64, 128), (g, 64, n))], found
        if layout.startswith("width_"):  # the down kernel stays split along n
            found = st.compiled_collectives(
                jax.grad(lambda *t: jnp.sum(fused(*t).astype(jnp.float32) * cot),
                         argnums=(0, 1, 2, 3)), *args)
            moved = [s for shapes in found.values() for s in shapes]
            assert not [s for s in moved if s == (g, 64, n)], found
    assert set(seen) == {"pallas_triton"} and set(downs) == {"pallas_triton"}
    (_, y_ref), grads_ref = run(lambda x, wgu, wd, rw: grouped_mlp_reference(
        x, wgu, wd, gs, jnp.bfloat16, row_weights=rw), [a[k] for k in names])
    parity.assert_close(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                        dtype=jnp.bfloat16, what=f"y, {layout}")
    for name, g_, w in zip(names, grads, grads_ref):
        parity.assert_close(np.asarray(g_, np.float32), np.asarray(w, np.float32),
                            dtype=jnp.bfloat16, what=f"d{name}, {layout}")
