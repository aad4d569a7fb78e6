"""chunk_gated_delta_rule on 8 host devices: rows or value heads sharded under jit (Explicit
and Auto axes; the plain-JAX form and the Pallas Triton kernels), packed sequences with
the heads sharded, the sequence split over devices (unpacked and packed, under Explicit
axes and inside a caller's shard_map), and inside a caller's shard_map. Values and all
six gradients equal the unsharded call's; with rows or heads split, the compiled program
moves no array of the inputs' size, and with the sequence split only state-sized ones."""

from __future__ import annotations

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding_testlib as st
from pallasite.kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

B, T, HK, HV, K, V = 8, 100, 8, 16, 16, 16


def _inputs(seed=0, b=B, n=None):
    ks = jax.random.split(jax.random.key(seed), 6)
    return (jax.random.normal(ks[0], (b, T, HK, K)), jax.random.normal(ks[1], (b, T, HK, K)),
            jax.random.normal(ks[2], (b, T, HV, V)),
            -jax.nn.softplus(jax.random.normal(ks[3], (b, T, HV))),
            jax.nn.sigmoid(jax.random.normal(ks[4], (b, T, HV))),
            jax.random.normal(ks[5], (n or b, HV, K, V)))


def _loss(*args, cu_seqlens=None, chunk_size=32, implementation=None):
    o, final = chunk_gated_delta_rule(*args[:5], initial_state=args[5], output_final_state=True,
                                      cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                      implementation=implementation)
    weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
    return jnp.sum(o * weights) + jnp.sum(final ** 2)


def _recurrent_loss(*args):
    """_loss through fused_recurrent_gated_delta_rule."""
    o, final = fused_recurrent_gated_delta_rule(*args[:5], initial_state=args[5],
                                                output_final_state=True)
    weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
    return jnp.sum(o * weights) + jnp.sum(final ** 2)


def _grads(fn, args):
    return jax.jit(jax.value_and_grad(fn, argnums=tuple(range(6))))(*args)


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w), np.abs(g - w).max()


def _placed(args, mesh, split):
    q, k, v, g, beta, s0 = args
    if split == "rows":
        return tuple(st.put(t, mesh, "x") for t in args)
    return (st.put(q, mesh, None, None, "x"), st.put(k, mesh, None, None, "x"),
            st.put(v, mesh, None, None, "x"), st.put(g, mesh, None, None, "x"),
            st.put(beta, mesh, None, None, "x"), st.put(s0, mesh, None, "x"))


@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO], ids=["explicit", "auto"])
@pytest.mark.parametrize("split", ["rows", "heads"])
def test_rows_or_heads_split_under_jit(axis_type, split):
    """Rows over 8 devices, or the 16 value heads and 8 key heads over 8 devices (each
    device's two value heads read its own key head)."""
    args = _inputs()
    mesh = st.mesh((8,), ("x",), axis_type)
    placed = _placed(args, mesh, split)
    with jax.set_mesh(mesh):
        got = _grads(_loss, placed)
        found = st.compiled_collectives(jax.grad(_loss, argnums=tuple(range(6))), *placed)
    _assert_close(got, _grads(_loss, args))
    # No array with a time axis crosses devices: at most the states (XLA's partitioner,
    # under Auto axes, may gather the initial state's rows).
    moved = [s for shapes in found.values() for s in st.big(shapes)]
    assert all(int(np.prod(s)) <= B * HV * K * V for s in moved), found


@pytest.mark.parametrize("axis_type", [st.EXPLICIT, st.AUTO], ids=["explicit", "auto"])
@pytest.mark.parametrize("split", ["rows", "heads"])
def test_the_kernels_keep_rows_or_heads_local_under_jit(axis_type, split):
    """pallas_triton (interpreted) with rows or heads over 4 devices: under Auto axes
    each pass (the forward with its residuals, the backward) is a custom_partitioning
    that keeps the rows or heads local, as a shard_map does under Explicit axes; values
    and gradients equal the unsharded call's, and no collective moves more than a
    scalar (the kernels are not handed gathered arrays)."""
    b, t = 4, 48
    args = tuple(a[:b, :t] for a in _inputs(seed=7))
    mesh = st.mesh((4,), ("x",), axis_type, devices=jax.devices()[:4])
    loss = functools.partial(_loss, implementation="pallas_triton", chunk_size=16)
    placed = _placed(args, mesh, split)
    with jax.set_mesh(mesh):
        got = _grads(loss, placed)
        found = st.compiled_collectives(jax.grad(loss, argnums=tuple(range(6))), *placed)
    _assert_close(got, _grads(loss, args))
    assert not [s for shapes in found.values() for s in st.big(shapes)], found


def test_heads_split_with_packed_sequences():
    """cu_seqlens (one row, three sequences) with the heads over 2 devices: each device
    scans its heads' sequences."""
    args = _inputs(seed=1, b=1, n=3)
    cu = jnp.asarray([0, 30, 31, 100], jnp.int32)
    mesh = st.mesh((2,), ("x",), st.EXPLICIT, devices=jax.devices()[:2])
    placed = _placed(args, mesh, "heads")
    loss = functools.partial(_loss, cu_seqlens=cu)
    with jax.set_mesh(mesh):
        got = _grads(loss, placed)
    _assert_close(got, _grads(loss, args))


def test_inside_a_callers_shard_map():
    """The caller's shard_map splits the rows; each device runs the form on its own."""
    args = _inputs(seed=2)
    mesh = st.mesh((8,), ("x",), st.AUTO)

    def local(*a):
        o, final = chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True,
                                          chunk_size=32)
        return o, final

    spec = P("x")
    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6,
                                out_specs=(spec, spec)))(*args)
    want = local(*args)
    _assert_close(got, want)


@pytest.mark.parametrize("split", ["rows", "heads"])
def test_the_step_by_step_form_under_explicit_axes(split):
    """fused_recurrent_gated_delta_rule takes the same plan as the chunked form: under
    Explicit axes its scan over steps (whose carry would otherwise change layout) runs
    on the local rows or heads, values and gradients the unsharded call's."""
    args = _inputs(seed=3)
    mesh = st.mesh((8,), ("x",), st.EXPLICIT)

    with jax.set_mesh(mesh):
        got = _grads(_recurrent_loss, _placed(args, mesh, split))
    _assert_close(got, _grads(_recurrent_loss, args))


# --------------------------------------------------------- the sequence over devices

TS = 96  # 8 parts of 12 steps: fewer chunks (of 32) than devices, each part padded


def _sequence_inputs(seed):
    args = _inputs(seed)
    return tuple(t[:, :TS] for t in args[:5]) + (args[5],)


def _time_split(args, mesh):
    q, k, v, g, beta, s0 = args
    return tuple(st.put(t, mesh, None, "x") for t in (q, k, v, g, beta)) + (st.put(s0, mesh),)


# Packed over 8 parts of 12 steps: an empty sequence, a boundary on a part's edge (24),
# a one-step sequence, and one that crosses four parts (31-70).
PACKED_CU = (0, 5, 5, 24, 30, 31, 70, TS)


def _packed_inputs(seed):
    args = _sequence_inputs(seed)
    n = len(PACKED_CU) - 1
    init = jax.random.normal(jax.random.key(seed + 100), (n, HV, K, V))
    return tuple(t[:1] for t in args[:5]) + (init,), jnp.asarray(PACKED_CU, jnp.int32)


def _state_sized(found, states):
    """Every collective of the compiled program moves at most `states` states."""
    moved = [s for shapes in found.values() for s in st.big(shapes)]
    assert moved, "expected the entering-state exchange"
    assert all(int(np.prod(s)) <= states * HV * K * max(K, V) for s in moved), found


@pytest.mark.parametrize("implementation, packed", [
    ("xla", False), ("xla", True), ("pallas_triton", True)], ids=["rows", "packed",
                                                                  "packed_triton"])
def test_the_sequence_split_under_explicit_axes(implementation, packed):
    """T over 8 devices under jit: each device runs its 12 steps, the entering states
    come from one exchange of state-sized arrays (context_parallel.py), and values and
    all six gradients equal the unsharded call's. Eight rows, or one packed row, whose
    sequence crossing parts carries its state through the exchange and whose final
    states come from the parts holding each last step. Only state-sized arrays move."""
    if packed:
        args, cu = _packed_inputs(seed=7)
        loss = functools.partial(_loss, cu_seqlens=cu, chunk_size=16,
                                 implementation=implementation)
    else:
        args, loss = _sequence_inputs(seed=4), _loss
    mesh = st.mesh((8,), ("x",), st.EXPLICIT)
    placed = _time_split(args, mesh)
    with jax.set_mesh(mesh):
        got = _grads(loss, placed)
        found = st.compiled_collectives(jax.grad(loss, argnums=tuple(range(6))), *placed)
    _assert_close(got, _grads(loss, args))
    _state_sized(found, 8 * (len(PACKED_CU) if packed else B))


@pytest.mark.parametrize("l2norm, in_context", [(False, True), (True, True), (False, False)],
                         ids=["plain", "l2norm", "no_mesh_in_context"])
def test_the_sequence_over_auto_axes_in_whole_chunks_stays_split(l2norm, in_context, caplog):
    """Under Auto axes a T the compiler splits in parts of whole chunks (4 parts of one
    chunk of 16, two rows, grouped value heads) stays split through the kernels' passes:
    each part's forward runs from the entering state one exchange gives it, the backward
    chains the parts' final-state cotangents by hand. Values and all six gradients equal
    the unsharded call's, nothing is gathered (no log), and every collective of the
    compiled program moves state-sized arrays only; with the mesh in context
    (jax.set_mesh) or only in the arrays' shardings."""
    b, t = 2, 64
    args = tuple(a[:b, :t] for a in _inputs(seed=12))
    args = args[:5] + (args[5][:b],)
    mesh = st.mesh((4,), ("x",), st.AUTO, devices=jax.devices()[:4])
    loss = functools.partial(_loss, implementation="pallas_triton", chunk_size=16)
    if l2norm:
        loss = functools.partial(_l2norm_loss, chunk_size=16)
    placed = _time_split(args, mesh)
    with caplog.at_level(logging.INFO, logger="pallasite.gated_delta"):
        with jax.set_mesh(mesh) if in_context else contextlib.nullcontext():
            got = _grads(loss, placed)
            found = st.compiled_collectives(jax.grad(loss, argnums=tuple(range(6))), *placed)
    _assert_close(got, _grads(loss, args))
    assert "is gathered" not in caplog.text, caplog.text
    # Only the exchanges (forward: M and F; backward: M and G), each every part's
    # state-sized array placed in its own row and summed: no residual is gathered.
    moved = sorted({s for shapes in found.values() for s in st.big(shapes)})
    assert set(found) == {"all-reduce"}, found
    assert moved == [(4, b, HV, K, V)], found


def test_the_sequence_over_auto_axes_with_rows_split_too():
    """Rows over one Auto axis and T over another (2 x 2 devices, parts of two chunks of
    16): both stay split through the kernels' passes; values, gradients and the forward
    alone (the pass without residuals) equal the unsharded call's, and only state-sized
    arrays move."""
    b, t = 2, 64
    args = tuple(a[:b, :t] for a in _inputs(seed=13))
    args = args[:5] + (args[5][:b],)
    mesh = st.mesh((2, 2), ("d", "x"), st.AUTO, devices=jax.devices()[:4])
    loss = functools.partial(_loss, implementation="pallas_triton", chunk_size=16)
    q, k, v, g, beta, s0 = args
    placed = tuple(st.put(a, mesh, "d", "x") for a in (q, k, v, g, beta)) + (
        st.put(s0, mesh, "d"),)

    def forward(*a):
        return chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True,
                                      chunk_size=16, implementation="pallas_triton")

    with jax.set_mesh(mesh):
        got = _grads(loss, placed)
        alone = jax.jit(forward)(*placed)
        found = st.compiled_collectives(jax.grad(loss, argnums=tuple(range(6))), *placed)
        found_alone = st.compiled_collectives(forward, *placed)
    _assert_close(got, _grads(loss, args))
    _assert_close(alone, forward(*args))
    for collectives in (found, found_alone):
        assert set(collectives) == {"all-reduce"}, collectives
        moved = sorted({s for shapes in collectives.values() for s in st.big(shapes)})
        assert moved == [(2, b // 2, HV, K, V)], collectives


def _l2norm_loss(*args, chunk_size):
    """_loss through the kernels with q and k L2-normalised in them and a scale."""
    o, final = chunk_gated_delta_rule(*args[:5], initial_state=args[5], output_final_state=True,
                                      chunk_size=chunk_size, implementation="pallas_triton",
                                      use_qk_l2norm_in_kernel=True, scale=0.3)
    weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
    return jnp.sum(o * weights) + jnp.sum(final ** 2)


def test_the_sequence_over_auto_axes_is_gathered_and_says_so(caplog):
    """Under Auto axes the kernels' passes see the sequence's layout only when they are
    partitioned (after differentiation): a T split there in parts that are not whole
    chunks (12 steps, chunks of 16) is taken whole, the values and gradients are the
    unsharded call's, and the log names the axes and says how to keep it split."""
    b, t = 2, 48
    args = tuple(a[:b, :t] for a in _inputs(seed=8))
    mesh = st.mesh((4,), ("x",), st.AUTO, devices=jax.devices()[:4])
    loss = functools.partial(_loss, implementation="pallas_triton", chunk_size=16)
    with caplog.at_level(logging.INFO, logger="pallasite.gated_delta"):
        with jax.set_mesh(mesh):
            got = _grads(loss, _time_split(args, mesh))
    _assert_close(got, _grads(loss, args))
    assert "sequence laid out over Auto axes ('x',) is gathered" in caplog.text, caplog.text


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
def test_the_sequence_split_inside_a_callers_shard_map(implementation, packed):
    """The caller's shard_map splits T over 4 devices (parts of 24 steps) and names the
    axis as sequence_axes: values and gradients equal the unsharded call's (xla under
    check_vma, pallas_triton through its interpreter, which runs without it), and the
    final states are the whole sequence's on every device. Two rows, or one packed row
    with the whole row's cu_seqlens."""
    if packed:
        args, cu = _packed_inputs(seed=9)
    else:
        args, cu = tuple(t[:2] for t in _sequence_inputs(seed=5)), None  # two rows: quick
    mesh = st.mesh((4,), ("x",), st.AUTO, devices=jax.devices()[:4])
    kw = dict(output_final_state=True, chunk_size=16, implementation=implementation,
              cu_seqlens=cu)

    def loss_of(o, final):
        weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        return jnp.sum(o * weights) + jnp.sum(final ** 2)

    def local(*a):
        return chunk_gated_delta_rule(*a[:5], initial_state=a[5], sequence_axes="x", **kw)

    t_spec = P(None, "x")
    split = jax.shard_map(local, mesh=mesh, in_specs=(t_spec,) * 5 + (P(),),
                          out_specs=(t_spec, P()), check_vma=implementation == "xla")
    whole = lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], **kw)  # noqa: E731
    _assert_close(jax.jit(split)(*args), whole(*args))
    got = _grads(lambda *a: loss_of(*split(*a)), args)
    _assert_close(got, _grads(lambda *a: loss_of(*whole(*a)), args))


@pytest.mark.parametrize("implementation, packed, rows_over_data", [
    ("xla", False, False), ("xla", True, False), ("pallas_triton", False, False),
    ("xla", False, True)], ids=["rows", "packed", "triton", "rows_over_data"])
def test_the_sequence_split_over_auto_axes_by_name(implementation, packed, rows_over_data):
    """Under jit with Auto axes, sequence_axes naming an Auto axis of the mesh in context
    splits T over it (4 parts of 24 steps): values and all six gradients equal the
    unsharded call's, and only state-sized arrays move. Also a packed row, the Triton
    kernels (interpreted), and rows over a second Auto axis ("data"), which the compiler
    keeps split inside (the exchange moves each device's half of the rows' states)."""
    if packed:
        args, cu = _packed_inputs(seed=11)
    else:
        args, cu = _sequence_inputs(seed=12), None
    kw = dict(cu_seqlens=cu, chunk_size=16, implementation=implementation)

    def loss(*a, **more):
        o, final = chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True,
                                          **kw, **more)
        weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        return jnp.sum(o * weights) + jnp.sum(final ** 2)

    split = functools.partial(loss, sequence_axes="x")
    if rows_over_data:
        mesh = st.mesh((2, 4), ("data", "x"), st.AUTO)
        placed = tuple(st.put(a, mesh, "data") for a in args)
    else:
        mesh = st.mesh((4,), ("x",), st.AUTO, devices=jax.devices()[:4])
        placed = args
    with jax.set_mesh(mesh):
        got = _grads(split, placed)
        found = st.compiled_collectives(jax.grad(split, argnums=tuple(range(6))), *placed)
    _assert_close(got, _grads(loss, args))
    _state_sized(found, 4 * (len(PACKED_CU) if packed else B))


def test_the_step_by_step_form_over_auto_axes_by_name():
    """fused_recurrent_gated_delta_rule with sequence_axes naming an Auto axis under jit:
    values and gradients the unsharded call's."""
    args = _sequence_inputs(seed=13)
    mesh = st.mesh((4,), ("x",), st.AUTO, devices=jax.devices()[:4])

    def loss(*a, **more):
        o, final = fused_recurrent_gated_delta_rule(*a[:5], initial_state=a[5],
                                                    output_final_state=True, **more)
        weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        return jnp.sum(o * weights) + jnp.sum(final ** 2)

    with jax.set_mesh(mesh):
        got = _grads(functools.partial(loss, sequence_axes="x"), args)
        o, final = jax.jit(lambda *a: fused_recurrent_gated_delta_rule(
            *a[:5], initial_state=a[5], sequence_axes="x"))(*args)
    assert final is None and o.shape == args[2].shape
    _assert_close(got, _grads(loss, args))


def test_sequence_axes_over_auto_axes_are_checked_by_name():
    """Under jit with Auto axes: T must divide by the named axes' devices, and a name
    that is neither a manual nor an Auto axis is refused, the message naming both."""
    args = tuple(t[:, :90] for t in _sequence_inputs(seed=14)[:5])
    mesh = st.mesh((4,), ("x",), st.AUTO, devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"T=90 must divide by their 4 devices"):
            jax.jit(lambda *a: chunk_gated_delta_rule(*a, sequence_axes="x"))(*args)
        with pytest.raises(ValueError, match=r"sequence_axes='y'.*Auto here: \('x',\)"):
            jax.jit(lambda *a: chunk_gated_delta_rule(*a, sequence_axes="y"))(*args)


def test_sequence_axes_and_a_split_packed_row_are_checked_by_name():
    """With sequence_axes, cu_seqlens must end at the whole row's length (4 parts of
    24 steps: 96), and sequence_axes must name the shard_map's manual axes."""
    args, _ = _packed_inputs(seed=6)
    mesh = st.mesh((4,), ("x",), st.AUTO, devices=jax.devices()[:4])
    part_only = jnp.asarray([0, 10, TS // 4], jnp.int32)

    def local(*a):
        return chunk_gated_delta_rule(*a[:5], initial_state=a[5][:2], cu_seqlens=part_only,
                                      sequence_axes="x")

    with pytest.raises(ValueError, match="end at the length 96"):
        jax.shard_map(local, mesh=mesh, in_specs=(P(None, "x"),) * 5 + (P(),),
                      out_specs=(P(None, "x"), P()))(*args)
    with pytest.raises(ValueError, match="sequence_axes='y'"):
        jax.shard_map(lambda *a: chunk_gated_delta_rule(*a[:5], sequence_axes="y"),
                      mesh=mesh, in_specs=(P(None, "x"),) * 5,
                      out_specs=(P(None, "x"), P()))(*args[:5])


def test_the_step_by_step_form_splits_the_sequence_too():
    """fused_recurrent_gated_delta_rule with T over 8 devices under Explicit axes: the
    same exchange of state-sized arrays, values and gradients the unsharded call's."""
    args = _sequence_inputs(seed=8)
    mesh = st.mesh((8,), ("x",), st.EXPLICIT)

    placed = _time_split(args, mesh)
    with jax.set_mesh(mesh):
        got = _grads(_recurrent_loss, placed)
        found = st.compiled_collectives(jax.grad(_recurrent_loss, argnums=tuple(range(6))),
                                        *placed)
    _assert_close(got, _grads(_recurrent_loss, args))
    moved = [s for shapes in found.values() for s in st.big(shapes)]
    assert all(int(np.prod(s)) <= 8 * B * HV * K * max(K, V) for s in moved), found


def test_the_step_by_step_form_splits_packed_sequences_too():
    """fused_recurrent_gated_delta_rule on a packed row over 8 devices: the same
    values and gradients as the unsharded call."""
    args, cu = _packed_inputs(seed=10)

    def loss(*a):
        o, final = fused_recurrent_gated_delta_rule(*a[:5], initial_state=a[5],
                                                    output_final_state=True, cu_seqlens=cu)
        weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        return jnp.sum(o * weights) + jnp.sum(final ** 2)

    mesh = st.mesh((8,), ("x",), st.EXPLICIT)
    with jax.set_mesh(mesh):
        got = _grads(loss, _time_split(args, mesh))
    _assert_close(got, _grads(loss, args))
