"""The SSD oracles: chunked == sequential, gradients, segsum accuracy, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.reference import inputs, parity, ssd

F64 = jnp.float64

# (batch, length, heads, head_dim, state, groups, chunk)
CONFIGS = [
    (2, 16, 4, 3, 5, 1, 4),    # Mamba-2 default: one group shared by every head
    (2, 16, 4, 3, 5, 2, 8),    # two heads per group
    (1, 24, 6, 2, 3, 3, 6),    # chunk not a power of two
    (1, 12, 4, 2, 4, 4, 12),   # one chunk, a group per head
    (2, 8, 2, 4, 4, 2, 1),     # chunk of one step
    (1, 32, 2, 2, 3, 1, 16),   # longer chunks
]


def _ids(config):
    b, l, h, p, n, g, c = config
    return f"b{b}-l{l}-h{h}-p{p}-n{n}-g{g}-C{c}"


def _draw(config, dtype, seed=0, initial=True):
    b, l, h, p, n, g, _ = config
    kx, ks = jax.random.split(jax.random.key(seed))
    x, a, bb, cc = inputs.ssd_inputs(kx, b, l, h, p, n, g, dtype)
    wide = F64 if dtype == F64 else jnp.float32
    s0 = inputs.ssd_initial_state(ks, b, h, p, n, wide) if initial else None
    return x, a, bb, cc, s0


# Jitted once per shape: eager dispatch of each primitive costs more than the math here.
_sequential = jax.jit(ssd.ssd_sequential)
_chunked = jax.jit(ssd.ssd_chunked, static_argnames=("chunk_size", "form"))


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_chunked_equals_sequential_in_float64(config):
    chunk = config[-1]
    # initial_state=None (zeros) is a separate compile: two configs cover it.
    initials = (True, False) if config in (CONFIGS[0], CONFIGS[4]) else (True,)
    forms = jax.jit(lambda *t: (ssd.ssd_sequential(*t),
                                ssd.ssd_chunked(*t[:4], chunk, t[4], form="plain"),
                                ssd.ssd_chunked(*t[:4], chunk, t[4], form="blockwise")))
    with jax.enable_x64(True):
        for initial in initials:
            x, a, b, c, s0 = _draw(config, F64, seed=chunk, initial=initial)
            (y_seq, s_seq), *chunked = forms(x, a, b, c, s0)
            for form, (y_chk, s_chk) in zip(("plain", "blockwise"), chunked):
                assert y_chk.dtype == s_chk.dtype == F64
                what = f"{form} initial={initial}"
                parity.assert_close(y_chk, y_seq, dtype=F64, what=f"y {what}")
                parity.assert_close(s_chk, s_seq, dtype=F64, what=f"final_state {what}")


def test_chunk_states_are_the_states_each_chunk_entered_with():
    config = (2, 16, 4, 3, 5, 2, 4)
    chunk = config[-1]
    with jax.enable_x64(True):
        x, a, b, c, s0 = _draw(config, F64, seed=3)
        chunked = [ssd.to_chunks(t, chunk) for t in (x, a, b, c)]
        for form in ("plain", "blockwise"):
            y, final, states = ssd.ssd_chunk_scan_reference(*chunked, s0, form=form,
                                                            return_chunk_states=True)
            assert states.shape == (2, 4, 4, 3, 5)
            parity.assert_close(states[:, 0], s0, dtype=F64, what="chunk 0 enters with s0")
            for z in (1, 3):
                _, want = _sequential(*(t[:, :z * chunk] for t in (x, a, b, c)), s0)
                parity.assert_close(states[:, z], want, dtype=F64, what=f"{form} chunk {z}")


def test_gradients_of_chunked_and_sequential_agree_in_float64():
    config = (2, 12, 4, 2, 3, 2, 4)  # batch 2, three chunks, two heads per group
    chunk = config[-1]
    with jax.enable_x64(True):
        x, a, b, c, s0 = _draw(config, F64, seed=5)
        ky, ks = jax.random.split(jax.random.key(6))
        wy = jax.random.normal(ky, x.shape, F64)
        ws = jax.random.normal(ks, s0.shape, F64)

        def loss(fn):
            def f(*args):
                y, s = fn(*args)
                return jnp.sum(y * wy) + jnp.sum(s * ws)
            return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))

        want = loss(ssd.ssd_sequential)(x, a, b, c, s0)
        for form in ("plain", "blockwise"):
            chunked = lambda *t, form=form: ssd.ssd_chunked(*t[:4], chunk, t[4], form=form)
            got = loss(chunked)(x, a, b, c, s0)
            for name, g, w in zip(("dx", "da", "db", "dc", "dinitial_state"), got, want):
                assert np.all(np.isfinite(np.asarray(g))), name
                parity.assert_close(g, w, dtype=F64, what=f"{form} {name}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_bf16_fp32_within_documented_tolerance(dtype):
    """Low-precision inputs vs the float64 definition on the same (rounded) inputs."""
    config = (2, 32, 4, 8, 8, 2, 8)
    x, a, b, c, s0 = _draw(config, dtype, seed=7)
    y, final = _chunked(x, a, b, c, 8, s0)
    assert y.dtype == dtype and final.dtype == jnp.float32
    tol = parity.tolerance(dtype) if dtype == jnp.bfloat16 else parity.EXACT_FP32
    with jax.enable_x64(True):
        y64, s64 = _sequential(*(jnp.asarray(np.asarray(t, np.float64))
                                        for t in (x, a, b, c, s0)))
    parity.assert_close(y, y64, dtype=dtype, tol=tol, what="y")
    parity.assert_close(final, s64, dtype=jnp.float32, tol=parity.EXACT_FP32, what="final_state")


def _exact_segsum(a):
    """float64 sums of each segment's own terms, [..., t, t] (-inf above the diagonal)."""
    a = np.asarray(a, np.float64)
    t = a.shape[-1]
    out = np.full(a.shape + (t,), -np.inf)
    for j in range(t):  # column j: segments starting after step j, summed in float64
        tail = np.cumsum(a[..., j + 1:], axis=-1)
        out[..., j:, j] = np.concatenate([np.zeros(a.shape[:-1] + (1,)), tail], axis=-1)
    return out


def test_segsum_stable_form_is_more_accurate():
    """Re-measures the segsum docstring's figure (C=128 here to stay quick)."""
    kx, ka = jax.random.split(jax.random.key(8))
    for dt_scale in (1.0, 50.0):
        dt = jax.nn.softplus(jax.random.normal(kx, (32, 128)) - 4.0) * dt_scale
        a = -jnp.exp(jax.random.uniform(ka, (32, 1))) * dt
        exact = np.exp(_exact_segsum(a))
        stable = np.abs(np.exp(np.asarray(jax.jit(ssd.segsum)(a), np.float64)) - exact).max()
        diff = np.abs(np.exp(np.asarray(jax.jit(ssd.segsum_cumsum_difference)(a), np.float64))
                      - exact).max()
        assert stable < 3e-7, stable
        assert stable * 5 < diff, (dt_scale, stable, diff)


def test_segsum_forms_agree_in_float64_and_mask_above_diagonal():
    with jax.enable_x64(True):
        a = -jnp.abs(jax.random.normal(jax.random.key(9), (3, 16), F64))
        s = jax.jit(ssd.segsum)(a)
        np.testing.assert_allclose(np.asarray(s), _exact_segsum(a), rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(np.asarray(jax.jit(ssd.segsum_cumsum_difference)(a)), np.asarray(s),
                                   rtol=1e-12, atol=1e-12)
        assert np.all(np.isneginf(np.asarray(s)[..., np.triu_indices(16, 1)[0],
                                                np.triu_indices(16, 1)[1]]))
        grad = jax.jit(jax.grad(lambda a: jnp.sum(jnp.exp(ssd.segsum(a)))))(a)
        assert np.all(np.isfinite(np.asarray(grad)))


def _largest_intermediate(jaxpr) -> int:
    """The most elements of any value in a jaxpr, looking inside scans and checkpoints."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                biggest = max(biggest, _largest_intermediate(inner))
    return biggest


def test_blockwise_never_builds_every_chunks_tiles():
    b, l, h, p, n, g, chunk = 1, 64, 2, 2, 2, 1, 16
    x, a, bb, cc, s0 = _draw((b, l, h, p, n, g, chunk), jnp.float32, initial=True)
    all_tiles = b * (l // chunk) * h * chunk * chunk

    def size(form, grad):
        def f(x, a, bb, cc):
            y, s = ssd.ssd_chunked(x, a, bb, cc, chunk, s0, form=form)
            return jnp.sum(y) + jnp.sum(s)
        fn = jax.grad(f, argnums=(0, 1, 2, 3)) if grad else f
        return _largest_intermediate(jax.make_jaxpr(fn)(x, a, bb, cc).jaxpr)

    assert size("plain", grad=False) >= all_tiles
    assert size("blockwise", grad=False) < all_tiles
    assert size("blockwise", grad=True) < all_tiles


def test_auto_form_switches_to_blockwise_above_the_tile_budget(monkeypatch):
    config = (1, 16, 2, 2, 3, 1, 4)
    x, a, b, c, s0 = _draw(config, jnp.float32)
    plain = _chunked(x, a, b, c, 4, s0, form="plain")
    monkeypatch.setattr(ssd, "PLAIN_TILE_BYTES", 0)
    auto = jax.make_jaxpr(lambda *t: ssd.ssd_chunked(*t, 4, s0))(x, a, b, c)
    assert "checkpoint" in str(auto) or "remat" in str(auto)
    got = jax.jit(lambda *t: ssd.ssd_chunked(*t, 4, s0))(x, a, b, c)  # a fresh trace
    for g, w in zip(got, plain):
        parity.assert_close(g, w, dtype=jnp.float32, tol=parity.EXACT_FP32)


def test_to_chunks_from_chunks_round_trip():
    t = jnp.arange(2 * 12 * 3).reshape(2, 12, 3)
    chunks = ssd.to_chunks(t, 4)
    assert chunks.shape == (2, 3, 4, 3)
    np.testing.assert_array_equal(chunks[1, 2, 3], t[1, 11])
    np.testing.assert_array_equal(ssd.from_chunks(chunks), t)


# --------------------------------------------------------------------------- bad input


def _good():
    f = np.float32
    return dict(x=np.ones((2, 8, 4, 3), f), a=-np.ones((2, 8, 4), f), b=np.ones((2, 8, 2, 5), f),
                c=np.ones((2, 8, 2, 5), f), initial_state=np.ones((2, 4, 3, 5), f))


BAD = [
    ("x_rank", dict(x=np.ones((2, 8, 4), np.float32)), ValueError,
     r"x must be rank 4 \[batch, length, heads, head_dim\]; got shape \(2, 8, 4\)"),
    ("a_rank", dict(a=-np.ones((2, 8, 4, 1), np.float32)), ValueError, r"a must be rank 3 .*\(2, 8, 4, 1\)"),
    ("b_rank", dict(b=np.ones((2, 8, 5), np.float32)), ValueError, r"b must be rank 4 .*\(2, 8, 5\)"),
    ("c_rank", dict(c=np.ones((2, 8, 5), np.float32)), ValueError, r"c must be rank 4 .*\(2, 8, 5\)"),
    ("a_heads", dict(a=-np.ones((2, 8, 3), np.float32)), ValueError,
     r"a must match x's batch, steps and heads: a shape \(2, 8, 3\), x shape \(2, 8, 4, 3\)"),
    ("a_length", dict(a=-np.ones((2, 7, 4), np.float32)), ValueError, r"a must match x's .*\(2, 7, 4\)"),
    ("b_batch", dict(b=np.ones((1, 8, 2, 5), np.float32)), ValueError,
     r"b must match x's batch and steps: b shape \(1, 8, 2, 5\), x shape \(2, 8, 4, 3\)"),
    ("c_shape", dict(c=np.ones((2, 8, 2, 6), np.float32)), ValueError,
     r"c must have b's shape: c shape \(2, 8, 2, 6\), b shape \(2, 8, 2, 5\)"),
    ("groups", dict(b=np.ones((2, 8, 3, 5), np.float32), c=np.ones((2, 8, 3, 5), np.float32)),
     ValueError, r"heads \(4, x shape \(2, 8, 4, 3\)\) must be a multiple of groups \(3, b shape"),
    ("initial_state", dict(initial_state=np.ones((2, 4, 5, 3), np.float32)), ValueError,
     r"initial_state must be \[batch, heads, head_dim, state\] = \(2, 4, 3, 5\); got shape \(2, 4, 5, 3\)"),
    ("x_int", dict(x=np.ones((2, 8, 4, 3), np.int32)), TypeError, r"x must be floating; got int32"),
    ("a_int", dict(a=np.ones((2, 8, 4), np.int32)), TypeError, r"a must be floating; got int32"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
@pytest.mark.parametrize("fn", ["validate", "sequential", "chunked"])
def test_bad_input_names_argument_and_shape(case, fn):
    _, change, error, message = case
    args = {**_good(), **change}
    call = {
        "validate": lambda: ssd.validate_ssd(**args),
        "sequential": lambda: ssd.ssd_sequential(**args),
        "chunked": lambda: ssd.ssd_chunked(**args, chunk_size=4),
    }[fn]
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("chunk_size, error, message", [
    (3, ValueError, r"chunk_size \(3\) must be positive and divide the sequence length \(8\)"),
    (0, ValueError, r"chunk_size \(0\) must be positive"),
    (16, ValueError, r"chunk_size \(16\) must be positive and divide"),
    (4.0, TypeError, r"chunk_size must be an int; got 4.0"),
])
def test_bad_chunk_size(chunk_size, error, message):
    with pytest.raises(error, match=message):
        ssd.ssd_chunked(**_good(), chunk_size=chunk_size)


def test_bad_chunked_layout_and_form():
    good = {k: ssd.to_chunks(jnp.asarray(v), 4) if k != "initial_state" else v
            for k, v in _good().items()}
    with pytest.raises(ValueError, match=r"x must be rank 5 \[batch, chunks, chunk, heads, head_dim\]"):
        ssd.ssd_chunk_scan_reference(**{**good, "x": good["x"][0]})
    with pytest.raises(ValueError, match=r"a must match x's batch, steps and heads"):
        ssd.validate_ssd_chunked(**{**good, "a": good["a"][:, :, :2]})
    with pytest.raises(ValueError, match=r"form must be 'auto', 'plain' or 'blockwise'; got 'fast'"):
        ssd.ssd_chunk_scan_reference(**good, form="fast")
