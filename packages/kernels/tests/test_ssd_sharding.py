"""chunk_ssd on many devices (8 forced CPU devices; two GPUs where present).

Batch and heads (with B/C's groups where they split with the heads) sharded on any mesh
axes; the sequence split in runs of whole chunks scanned where it lies (context
parallelism: only state-sized arrays move), any other split gathered; forward and
backward against the unsharded call:
  - jit over sharded arrays without a mesh in context (Auto axes), and under
    jax.set_mesh with Explicit and Auto axes;
  - inside the caller's shard_map (check_vma on and off), on the local arrays;
  - groups that do not split with the heads (resharded, documented) still exact.
The compiled HLO is read: no all-gather where the layout is used locally, and only the
dB/dC reductions a single replicated group needs.

Backends: XLA and the Triton kernels (interpreted) for values; the Mosaic TPU kernel is
compiled and its collectives read (test_grouped_projection_sharding says why the Mosaic
interpreters do not run on 8 devices here); test_gpus runs the compiled kernels.
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
from pallasite.kernels import chunk_ssd
from pallasite.reference import parity
from pallasite.reference.inputs import ssd_initial_state, ssd_inputs

B, L, H, D, N, CHUNK = 2, 128, 8, 16, 16, 64


def _inputs(groups, seed=0, batch=B, dtype=jnp.float32):
    kx, ks, ky = jax.random.split(jax.random.key(seed), 3)
    x, a, b, c = ssd_inputs(kx, batch, L, H, D, N, groups, dtype)
    s0 = ssd_initial_state(ks, batch, H, D, N)
    weights = jax.random.normal(ky, (batch, L, H, D), jnp.float32)
    return x, a, b, c, s0, weights


def _loss(implementation):
    """(loss, grads of x, a, b, c, initial_state) of a weighted sum of y and final."""
    def loss(x, a, b, c, s0, weights):
        y, final = chunk_ssd(x, a, b, c, chunk_size=CHUNK, initial_state=s0,
                             implementation=implementation)
        return jnp.sum(y.astype(jnp.float32) * weights) + jnp.sum(final ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))


def _want(implementation, *args):
    """The same implementation unsharded, on one device (inputs fetched to the host)."""
    return jax.jit(_loss(implementation))(*(np.asarray(t) for t in args))


def _assert_close(got, want, rtol=2e-5, atol=2e-5, dtype=None):
    """Elementwise in fp32 (same summation up to the order of the shards' sums); with a
    16-bit dtype the parity tolerance of that dtype (relative L2 and max against the
    reference's scale), since a rounding flip in a bf16 gradient is not a sharding bug."""
    (value, grads), (value_ref, grads_ref) = got, want
    np.testing.assert_allclose(value, value_ref, rtol=max(rtol, 1e-4) if dtype else rtol,
                               atol=atol)
    for what, g, w in zip(("dx", "da", "db", "dc", "dinitial_state"), grads, grads_ref):
        if dtype is None:
            np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=atol, err_msg=what)
        else:
            parity.assert_close(g, w, dtype=dtype, what=what)


def _place(mesh, args, batch_axis, head_axis, groups_split):
    x, a, b, c, s0, weights = args
    group_axis = head_axis if groups_split else None
    return (st.put(x, mesh, batch_axis, None, head_axis), st.put(a, mesh, batch_axis, None, head_axis),
            st.put(b, mesh, batch_axis, None, group_axis), st.put(c, mesh, batch_axis, None, group_axis),
            st.put(s0, mesh, batch_axis, head_axis),
            st.put(weights, mesh, batch_axis, None, head_axis))


def _reductions(found):
    return {op: st.big(shapes) for op, shapes in found.items() if st.big(shapes)}


# (groups, whether they split with the 4 head shards, reductions of the compiled fwd+bwd)
GROUPINGS = {
    "groups_split": (4, True, {}),
    # one group, replicated over the head shards: dB and dC summed over them.
    "one_group": (1, False, {"all-reduce": [(B // 2, L // CHUNK, CHUNK, 1, N)] * 2}),
}


def _check(found, grouping):
    assert "all-gather" not in found, f"gathered: {found['all-gather']}"
    assert "all-to-all" not in found, found
    got = _reductions(found)
    want = GROUPINGS[grouping][2]
    # dB and dC may be combined into one all-reduce or kept apart: compare the shapes.
    assert got == want, f"collectives {got}, expected {want}"


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_jit_no_mesh_in_context(grouping, implementation):
    groups, split, _ = GROUPINGS[grouping]
    mesh = st.mesh((2, 4), ("batch", "heads"), st.AUTO)
    args = _place(mesh, _inputs(groups), "batch", "heads", split)
    fn = _loss(implementation)
    _check(st.compiled_collectives(fn, *args), grouping)
    _assert_close(jax.jit(fn)(*args), _want(implementation, *args))


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO], ids=["explicit", "auto"])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_jit_under_set_mesh(grouping, axis_type, implementation):
    groups, split, _ = GROUPINGS[grouping]
    mesh = st.mesh((2, 4), ("dp", "tp"), axis_type)
    args = _place(mesh, _inputs(groups, seed=1), "dp", "tp", split)
    fn = _loss(implementation)
    with jax.set_mesh(mesh):
        _check(st.compiled_collectives(fn, *args), grouping)
        got = jax.jit(fn)(*args)
        y, _ = jax.jit(functools.partial(chunk_ssd, chunk_size=CHUNK,
                                         implementation=implementation))(*args[:4])
    assert st.dims(y)[0] == ("dp",) and st.dims(y)[2] == ("tp",)
    _assert_close(got, _want(implementation, *args))


@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_mosaic_tpu_compiles_with_the_same_collectives(grouping):
    groups, split, _ = GROUPINGS[grouping]
    mesh = st.mesh((2, 4), ("data", "model"), st.EXPLICIT)
    args = _place(mesh, _inputs(groups), "data", "model", split)
    with jax.set_mesh(mesh):
        _check(st.compiled_collectives(_loss("pallas_mosaic_tpu"), *args), grouping)


def test_groups_that_do_not_split_with_the_heads_are_resharded():
    """Two groups over four head shards: the heads are taken replicated (docs/sharding.md:
    an all-gather of the head-sharded operands), values still exact."""
    mesh = st.mesh((2, 4), ("data", "model"), st.EXPLICIT)
    args = _place(mesh, _inputs(2), "data", "model", False)
    fn = _loss("xla")
    with jax.set_mesh(mesh):
        got = jax.jit(fn)(*args)
    _assert_close(got, _want("xla", *args))


def test_batch_over_two_axes():
    """The batch split over two mesh axes at once (8 shards of batch 8)."""
    mesh = st.mesh((2, 4), ("a", "b"), st.EXPLICIT)
    args = _inputs(1, batch=8)
    args = tuple(st.put(t, mesh, ("a", "b")) for t in args)
    fn = _loss("pallas_triton")
    with jax.set_mesh(mesh):
        found = st.compiled_collectives(fn, *args)
        got = jax.jit(fn)(*args)
    assert not _reductions(found) and "all-gather" not in found, found
    _assert_close(got, _want("pallas_triton", *args))


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_inside_shard_map(check_vma, implementation):
    """The caller's shard_map, batch over one manual axis and heads over another, one
    group replicated: each shard scans its local arrays, and dB, dC and the replicated
    parts are summed as JAX sums them for plain jnp code."""
    mesh = st.mesh((2, 4), ("bt", "hd"), st.EXPLICIT)
    args = _place(mesh, _inputs(1, seed=2), "bt", "hd", False)
    specs = (P("bt", None, "hd"), P("bt", None, "hd"), P("bt"), P("bt"), P("bt", "hd"),
             P("bt", None, "hd"))

    def body(x, a, b, c, s0, weights):
        y, final = chunk_ssd(x, a, b, c, chunk_size=CHUNK, initial_state=s0,
                             implementation=implementation)
        local = jnp.sum(y.astype(jnp.float32) * weights) + jnp.sum(final ** 2)
        return jax.lax.psum(local, ("bt", "hd"))

    def loss(*args):
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(),
                             check_vma=check_vma)(*args)

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    _assert_close(got, _want(implementation, *args))


# ------------------------------------------------------------------------- GPUs


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["pallas_triton", "xla"])
@pytest.mark.parametrize("mode", ["batch_explicit", "heads_auto", "shard_map_vma",
                                  "shard_map_no_vma"])
def test_gpus(mode, implementation):
    """On two GPUs, bf16, TARGETS geometry (chunk 256, head_dim 64, state 128): batch over
    both (Explicit), heads over both (Auto, no mesh in context, one replicated group), and
    the caller's shard_map over the batch (on one GPU too); values and gradients against
    one device."""
    devices = st.gpus(two=not mode.startswith("shard_map"))
    kx, ks, ky = jax.random.split(jax.random.key(9), 3)
    x, a, b, c = ssd_inputs(kx, 2, 1024, 8, 64, 128, 1, jnp.bfloat16)
    s0 = ssd_initial_state(ks, 2, 8, 64, 128)
    weights = jax.random.normal(ky, x.shape, jnp.float32)
    args = (x, a, b, c, s0, weights)

    def loss(x, a, b, c, s0, weights):
        y, final = chunk_ssd(x, a, b, c, chunk_size=256, initial_state=s0,
                             implementation=implementation)
        return jnp.sum(y.astype(jnp.float32) * weights) + jnp.sum(final ** 2)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    want = jax.jit(grad)(*args)
    mesh = st.mesh((len(devices),), ("d",), st.AUTO if mode == "heads_auto" else st.EXPLICIT,
                   devices)
    if mode == "heads_auto":
        placed = _place(mesh, args, None, "d", False)
        got = jax.jit(grad)(*placed)
        found = st.compiled_collectives(grad, *placed)
        assert "all-gather" not in found, found
    elif mode == "batch_explicit":
        placed = tuple(st.put(t, mesh, "d") for t in args)
        with jax.set_mesh(mesh):
            got = jax.jit(grad)(*placed)
            found = st.compiled_collectives(grad, *placed)
        assert "all-gather" not in found and not _reductions(found), found
    else:
        placed = tuple(st.put(t, mesh, "d") for t in args)

        def total(*t):
            return jax.shard_map(lambda *u: jax.lax.psum(loss(*u), "d"), mesh=mesh,
                                 in_specs=(P("d"),) * 6, out_specs=P(),
                                 check_vma=mode == "shard_map_vma")(*t)

        got = jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2, 3, 4)))(*placed)
    _assert_close(got, want, dtype=jnp.bfloat16)


# ----------------------------------------------------------------- sequence sharded


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("context", ["set_mesh", "no_mesh"])
@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO], ids=["explicit", "auto"])
def test_sequence_over_more_devices_than_chunks(axis_type, context, implementation):
    """Length 256 in chunks of 64 (4 chunks) with the sequence over 8 devices: no
    layout of the chunked arrays follows from that one, so the sequence is gathered
    (docs/sharding.md) and the values and gradients are the unsharded call's. Under
    Explicit axes y comes back in x's layout."""
    mesh = st.mesh((8,), ("seq",), axis_type)
    kx, ks, ky = jax.random.split(jax.random.key(3), 3)
    x, a, b, c = ssd_inputs(kx, 2, 256, 2, D, N, 1, jnp.float32)
    s0 = ssd_initial_state(ks, 2, 2, D, N)
    weights = jax.random.normal(ky, x.shape, jnp.float32)
    args = (x, a, b, c, s0, weights)
    placed = tuple(st.put(t, mesh, None, "seq") if t.ndim > 2 and t.shape[1] == 256
                   else st.put(t, mesh) for t in args)
    fn = jax.jit(_loss(implementation))
    forward = jax.jit(functools.partial(chunk_ssd, chunk_size=CHUNK,
                                        implementation=implementation))
    with jax.set_mesh(mesh) if context == "set_mesh" else contextlib.nullcontext():
        got = fn(*placed)
        y, _ = forward(*placed[:4])
    _assert_close(got, _want(implementation, *args))
    if axis_type == st.EXPLICIT:
        assert st.dims(y)[1] == ("seq",)


def _sequence_inputs(length, seed=5, batch=2, heads=2, groups=1):
    kx, ks, ky = jax.random.split(jax.random.key(seed), 3)
    x, a, b, c = ssd_inputs(kx, batch, length, heads, D, N, groups, jnp.float32)
    s0 = ssd_initial_state(ks, batch, heads, D, N)
    return x, a, b, c, s0, jax.random.normal(ky, x.shape, jnp.float32)


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO], ids=["explicit", "auto"])
def test_sequence_split_in_whole_chunks_is_scanned_where_it_lies(axis_type, implementation):
    """Length 1024 in chunks of 64 over 8 devices (2 chunks each): each device scans its
    chunks from the entering state the others pass it (context parallelism). Values and
    gradients are the unsharded call's; the compiled program moves only state-sized
    arrays, the parts' final states (and cotangents) and total decays, never x, a, B, C,
    y or their gradients; under Explicit axes y keeps x's layout."""
    mesh = st.mesh((8,), ("seq",), axis_type)
    args = _sequence_inputs(1024)
    x, s0 = args[0], args[4]
    placed = tuple(st.put(t, mesh, None, "seq") if t.ndim > 2 and t.shape[1] == 1024
                   else st.put(t, mesh) for t in args)
    with jax.set_mesh(mesh):
        got = jax.jit(_loss(implementation))(*placed)
        found = st.compiled_collectives(_loss(implementation), *placed)
        y, _ = jax.jit(functools.partial(chunk_ssd, chunk_size=CHUNK,
                                         implementation=implementation))(*placed[:4])
    _assert_close(got, _want(implementation, *args))
    state_size = 8 * s0.size  # every part's [b, h, p, n]
    moved = [shape for shapes in found.values() for shape in st.big(shapes)]
    assert moved and all(int(np.prod(s)) <= state_size for s in moved), found
    assert "all-to-all" not in found, found
    if axis_type == st.EXPLICIT:
        assert st.dims(y)[1] == ("seq",)


def test_sequence_and_batch_split_together():
    """Batch over one axis, the sequence over another (Explicit): both stay where they
    are; the exchange runs over the sequence axis only."""
    mesh = st.mesh((2, 4), ("bt", "seq"), st.EXPLICIT)
    args = _sequence_inputs(512, seed=6)
    placed = tuple(st.put(t, mesh, "bt", "seq") if t.ndim > 2 and t.shape[1] == 512
                   else st.put(t, mesh, "bt") for t in args)
    with jax.set_mesh(mesh):
        got = jax.jit(_loss("xla"))(*placed)
        found = st.compiled_collectives(_loss("xla"), *placed)
    _assert_close(got, _want("xla", *args))
    moved = [shape for shapes in found.values() for shape in st.big(shapes)]
    assert all(int(np.prod(s)) <= 4 * args[4].size for s in moved), found


def test_a_sequence_not_in_whole_chunks_is_gathered_and_says_so(caplog):
    """Length 1000 (the last chunk padded) over 8 devices: the split cannot stay, so the
    sequence is gathered, logged, and the values are still the unsharded call's."""
    mesh = st.mesh((8,), ("seq",), st.EXPLICIT)
    args = _sequence_inputs(1000, seed=7)
    placed = tuple(st.put(t, mesh, None, "seq") if t.ndim > 2 and t.shape[1] == 1000
                   else st.put(t, mesh) for t in args)
    with jax.set_mesh(mesh), caplog.at_level("INFO", logger="pallasite.ssd"):
        got = jax.jit(_loss("xla"))(*placed)
    _assert_close(got, _want("xla", *args))
    assert "gathered" in caplog.text


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_sequence_split_inside_a_callers_shard_map(check_vma, implementation):
    """Inside the caller's shard_map, `sequence_axes` names the axis its sequence is split
    over: 800 steps over 8 devices, 100 each (each part padded to whole chunks of 64 on
    its own), values and gradients the unsharded call's, the final state the whole
    sequence's on every device."""
    args = _sequence_inputs(800, seed=8, batch=1)
    x, a, b, c, s0, weights = args
    mesh = st.mesh((8,), ("seq",), st.AUTO)

    def loss(x, a, b, c, s0, weights, **kw):
        y, final = chunk_ssd(x, a, b, c, chunk_size=CHUNK, initial_state=s0,
                             implementation=implementation, **kw)
        return jnp.sum(y * weights), final

    def body(x, a, b, c, s0, weights):
        grads, final = jax.grad(lambda *t: loss(*t, weights, sequence_axes="seq"),
                                argnums=(0, 1, 2, 3, 4), has_aux=True)(x, a, b, c, s0)
        return grads, final

    seq = P(None, "seq")
    got = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(seq, seq, seq, seq, P(), seq),
        out_specs=((seq, seq, seq, seq, P()), P()), check_vma=check_vma))(*args)
    want = jax.jit(jax.grad(lambda *t: loss(*t, weights), argnums=(0, 1, 2, 3, 4),
                            has_aux=True))(x, a, b, c, s0)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_sequence_axes_must_name_manual_axes():
    x, a, b, c = _sequence_inputs(128)[:4]
    with pytest.raises(ValueError, match="sequence_axes='seq'"):
        chunk_ssd(x, a, b, c, chunk_size=CHUNK, sequence_axes="seq")


def test_sequence_over_more_devices_than_chunks_forward_mode():
    """The same layout through forward mode (chunk_ssd's plain-JAX scan), Explicit axes."""
    mesh = st.mesh((8,), ("seq",), st.EXPLICIT)
    x, a, b, c = ssd_inputs(jax.random.key(4), 2, 256, 2, D, N, 1, jnp.float32)

    def run(*t):
        return chunk_ssd(*t, chunk_size=CHUNK)[0]

    tangents = tuple(jnp.ones_like(t) for t in (x, a, b, c))
    want = jax.jvp(run, (x, a, b, c), tangents)
    placed = tuple(st.put(t, mesh, None, "seq") for t in (x, a, b, c))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda p, t: jax.jvp(run, p, t))(placed, tangents)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------- the lowered program


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("mode", ["explicit", "explicit_no_mesh", "auto", "auto_no_mesh",
                                  "shard_map_vma", "shard_map_no_vma"])
def test_lowered_program_holds_the_kernel_boundaries(mode, implementation):
    """The forward and backward (two products) each run in pallasite's own shard_map
    over the batch and head axes (Explicit), in a custom_partitioning (Auto), or directly
    in the caller's shard_map with nothing nested (docs/sharding.md, "Kernel
    boundaries"); read from the jaxpr and the StableHLO."""
    way = "caller" if mode.startswith("shard_map") else mode.removesuffix("_no_mesh")
    axis_type = st.AUTO if way == "auto" else st.EXPLICIT
    mesh = st.mesh((2, 4), ("bt", "hd"), axis_type)
    args = _place(mesh, _inputs(1), "bt", "hd", False)
    fn = _loss(implementation)
    if way == "caller":
        specs = (P("bt", None, "hd"), P("bt", None, "hd"), P("bt"), P("bt"), P("bt", "hd"),
                 P("bt", None, "hd"))

        def body(*t):
            value, grads = _loss(implementation)(*t)
            return jax.lax.psum(value, ("bt", "hd")), grads

        fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), specs[:5]),
                           check_vma=mode == "shard_map_vma")
    with jax.set_mesh(mesh) if not mode.endswith("no_mesh") else contextlib.nullcontext():
        found = st.assert_kernel_boundaries(fn, args, way=way, axes=("bt", "hd"), products=2)
    pallas = [f for f in found if f[0] == "pallas_call"]
    assert len(pallas) == (5 if implementation == "pallas_triton" else 0), pallas
