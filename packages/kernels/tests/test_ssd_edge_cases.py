"""SSD edge cases on every backend: state resets (a = -inf), strong decay against a
float64 recurrence, zero-size batch and length, and what higher-order differentiation
does. CPU: the XLA path and both interpreters; the `gpu` tests run the compiled Triton
kernels on the same cases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.kernels.ssd import chunk_ssd
from pallasite.reference.ssd import ssd_chunked, ssd_sequential

CPU_BACKENDS = ["xla", "pallas_triton", "pallas_mosaic_tpu"]


def _inputs(seed, batch=1, length=128, heads=2, head_dim=16, state=16, groups=1):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (batch, length, heads, head_dim), jnp.float32)
    a = -jax.random.uniform(ks[1], (batch, length, heads), jnp.float32, 0.5, 2.0)
    b = jax.random.normal(ks[2], (batch, length, groups, state), jnp.float32)
    c = jax.random.normal(ks[3], (batch, length, groups, state), jnp.float32)
    s0 = jax.random.normal(ks[4], (batch, heads, head_dim, state), jnp.float32)
    return x, a, b, c, s0


def recurrence_f64(x, a, b, c, s0):
    """The definition in numpy float64: S = exp(a_t) S + x_t B_t^T, y_t = S C_t."""
    x, a, b, c, s = (np.asarray(t, np.float64) for t in (x, a, b, c, s0))
    heads, groups = x.shape[2], b.shape[2]
    head_group = np.arange(heads) // (heads // groups)
    ys = np.zeros_like(x)
    for t in range(x.shape[1]):
        bt, ct = b[:, t, head_group], c[:, t, head_group]  # [batch, heads, n]
        s = np.exp(a[:, t])[..., None, None] * s + x[:, t, :, :, None] * bt[:, :, None, :]
        ys[:, t] = np.einsum("bhpn,bhn->bhp", s, ct)
    return ys, s


def rel_l2(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _strong_decay(seed=0, **shape):
    x, a, b, c, s0 = _inputs(seed, **shape)
    return x, a.at[:, 37].set(-1e4), b, c, s0


# ------------------------------------------------------------------- strong decay


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_strong_decay_within_5e7_of_float64(backend):
    """fp32, a ~ -U(0.5, 2) with one step at -1e4, two chunks of 64: y and the final state
    within 5e-7 (rel L2) of the float64 recurrence."""
    x, a, b, c, s0 = _strong_decay()
    y, final = chunk_ssd(x, a, b, c, chunk_size=64, initial_state=s0, implementation=backend)
    y64, final64 = recurrence_f64(x, a, b, c, s0)
    assert rel_l2(y, y64) < 5e-7
    assert rel_l2(final, final64) < 5e-7


# ------------------------------------------------------------------- state resets


def _with_resets(seed=1, **shape):
    x, a, b, c, s0 = _inputs(seed, **shape)
    a = a * 0.05  # mild decay, so the state before a reset is far from zero
    return x, a.at[:, 0].set(-jnp.inf).at[:, 40].set(-jnp.inf).at[:, 64].set(-jnp.inf), b, c, s0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_minus_inf_is_an_exact_state_reset(backend):
    """a = -inf at steps 0, 40 and 64 (a chunk boundary): the scan equals separate scans
    of the pieces from a zero state, and the initial state never reaches the output."""
    x, a, b, c, s0 = _with_resets()
    y, final = chunk_ssd(x, a, b, c, chunk_size=64, initial_state=s0, implementation=backend)
    assert np.isfinite(np.asarray(y)).all() and np.isfinite(np.asarray(final)).all()
    pieces = []
    for lo, hi in ((0, 40), (40, 64), (64, 128)):
        part = [t[:, lo:hi] for t in (x, a, b, c)]
        y_part, final_part = recurrence_f64(*part, np.zeros(s0.shape))
        pieces.append(y_part)
    assert rel_l2(y, np.concatenate(pieces, axis=1)) < 5e-7
    assert rel_l2(final, final_part) < 5e-7


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradients_through_a_reset_are_finite_and_match(backend):
    """Gradients with a = -inf steps: finite, zero for a at the resets, and equal to the
    gradients of the sequential definition (which differentiates exp(-inf) = 0)."""
    x, a, b, c, s0 = _with_resets(length=128)

    def loss(fn):
        def f(x, a, b, c, s0):
            y, final = fn(x, a, b, c, s0)
            return jnp.sum(y * jnp.cos(y)) + jnp.sum(final)
        return jax.grad(f, argnums=(0, 1, 2, 3, 4))

    got = loss(lambda *t: chunk_ssd(*t[:4], chunk_size=64, initial_state=t[4],
                                    implementation=backend))(x, a, b, c, s0)
    want = loss(lambda *t: ssd_sequential(*t))(x, a, b, c, s0)
    for name, g, w in zip(("dx", "da", "db", "dc", "dinitial"), got, want):
        assert np.isfinite(np.asarray(g)).all(), name
        if name == "dinitial":  # the reset at step 0 cuts the initial state off
            assert not np.asarray(g).any()
            continue
        assert rel_l2(jnp.where(jnp.isfinite(w), w, 0), g) < 2e-5, name
    assert not np.asarray(got[1])[:, [0, 40, 64]].any()


# ------------------------------------------------------------------- zero sizes


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("batch,length", [(0, 128), (2, 0)], ids=["batch0", "length0"])
def test_zero_size_batch_or_length(backend, batch, length):
    """Zeros of the right shapes (final state = initial state at length 0) and zero or
    identity gradients; no kernel runs."""
    x, a, b, c, s0 = _inputs(0, batch=max(batch, 1), length=max(length, 1))
    x, a, b, c, s0 = x[:batch, :length], a[:batch, :length], b[:batch, :length], \
        c[:batch, :length], s0[:batch]
    y, final = chunk_ssd(x, a, b, c, chunk_size=64, initial_state=s0, implementation=backend)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert final.shape == s0.shape and final.dtype == jnp.float32
    np.testing.assert_array_equal(final, s0)

    def f(x, a, b, c, s0):
        y, final = chunk_ssd(x, a, b, c, chunk_size=64, initial_state=s0,
                             implementation=backend)
        return jnp.sum(y) + jnp.sum(final)

    grads = jax.grad(f, argnums=(0, 1, 2, 3, 4))(x, a, b, c, s0)
    for g, t in zip(grads, (x, a, b, c, s0)):
        assert g.shape == t.shape
    np.testing.assert_array_equal(grads[4], np.ones(s0.shape))


# ------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_strong_decay_within_5e7_of_float64():
    """The compiled Triton kernels (fp32 dots at full precision) under strong decay,
    forward, at the TARGETS chunk (256) and widths."""
    x, a, b, c, s0 = _strong_decay(length=512, heads=4, head_dim=64, state=128)
    y, final = chunk_ssd(x, a, b, c, chunk_size=256, initial_state=s0,
                         implementation="pallas_triton")
    y64, final64 = recurrence_f64(x, a, b, c, s0)
    assert rel_l2(y, y64) < 5e-7
    assert rel_l2(final, final64) < 5e-7


@pytest.mark.gpu
def test_gpu_minus_inf_reset_and_zero_sizes():
    """The compiled Triton kernels: a = -inf resets are exact with finite gradients, and
    zero-size batch and length return without launching a kernel."""
    test_minus_inf_is_an_exact_state_reset("pallas_triton")
    test_gradients_through_a_reset_are_finite_and_match("pallas_triton")
    test_zero_size_batch_or_length("pallas_triton", 0, 128)
    test_zero_size_batch_or_length("pallas_triton", 2, 0)


# ------------------------------------------------------------------- differentiation


def _scan_sum(implementation):
    def f(x, a, b, c, s0):
        y, final = chunk_ssd(x, a, b, c, chunk_size=64, initial_state=s0,
                             implementation=implementation)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final ** 2)
    return f


def test_forward_mode_and_second_order_take_the_plain_scan():
    """jvp and a second derivative on the default order: equal to the sequential
    definition's (which JAX differentiates itself)."""
    x, a, b, c, s0 = _inputs(3, length=128)
    want = _scan_sum("xla")

    def sequential(x, a, b, c, s0):
        y, final = ssd_sequential(x, a, b, c, s0)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final ** 2)

    tangent = tuple(jnp.ones_like(t) * 0.1 for t in (x, a, b, c, s0))
    _, got = jax.jvp(_scan_sum(None), (x, a, b, c, s0), tangent)
    _, ref = jax.jvp(sequential, (x, a, b, c, s0), tangent)
    assert abs(float(got) - float(ref)) <= 1e-4 * abs(float(ref))
    second = jax.grad(lambda x: jnp.sum(jax.grad(want)(x, a, b, c, s0) ** 2))(x)
    second_ref = jax.grad(lambda x: jnp.sum(jax.grad(sequential)(x, a, b, c, s0) ** 2))(x)
    assert rel_l2(second, second_ref) < 1e-4


@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_mosaic_tpu"])
def test_a_named_kernel_says_first_order_reverse_mode(backend):
    x, a, b, c, s0 = _inputs(3, length=128)
    with pytest.raises(NotImplementedError, match="first-order reverse mode.*'xla'"):
        jax.jvp(_scan_sum(backend), (x, a, b, c, s0), (x, a, b, c, s0))
    with pytest.raises(NotImplementedError, match="first-order reverse mode"):
        jax.grad(lambda x: jnp.sum(jax.grad(_scan_sum(backend))(x, a, b, c, s0)))(x)


# ------------------------------------------------------------------- non-finite inputs
# Every path chunk_ssd can take (the backends, the plain-JAX scan forward mode runs) and
# the reference's chunked forms, held to the definition: where the float64 recurrence is
# non-finite, and only there.

PATHS = CPU_BACKENDS + ["forward_mode", "reference_plain", "reference_blockwise"]


def _on_path(path, x, a, b, c, s0):
    """(y, final_state) of `path` at chunk 64."""
    if path.startswith("reference_"):
        return ssd_chunked(x, a, b, c, 64, s0, form=path.removeprefix("reference_"))
    if path == "forward_mode":  # a jvp takes chunk_ssd's plain-JAX scan
        def run(*t):
            return chunk_ssd(*t[:4], chunk_size=64, initial_state=t[4])
        primals = (x, a, b, c, s0)
        return jax.jvp(run, primals, tuple(jnp.zeros_like(t) for t in primals))[0]
    return chunk_ssd(x, a, b, c, chunk_size=64, initial_state=s0, implementation=path)


def _assert_like_the_definition(got, want):
    """Non-finite exactly where the float64 recurrence is; the rest within 5e-7."""
    got, want = np.asarray(got), np.asarray(want)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    assert rel_l2(got[finite], want[finite]) < 5e-7


def _recurrence_nonfinite(*args):
    with np.errstate(invalid="ignore", over="ignore"):
        return recurrence_f64(*args)


@pytest.mark.parametrize("path", PATHS)
def test_nan_in_a_propagates_and_is_no_reset(path):
    """A NaN step of `a` (head 0, step 40) makes that head's y NaN from step 40 on, as
    the definition does (exp(NaN) = NaN); it is not taken as a reset (a <= -1e4 only)."""
    x, a, b, c, s0 = _inputs(4)
    a = (a * 0.05).at[:, 40, 0].set(jnp.nan)
    y, final = _on_path(path, x, a, b, c, s0)
    y64, final64 = _recurrence_nonfinite(x, a, b, c, s0)
    assert not np.isfinite(y64[:, 40:, 0]).any() and np.isfinite(y64[:, :40]).all()
    _assert_like_the_definition(y, y64)
    _assert_like_the_definition(final, final64)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nan_in_a_gives_a_nan_gradient(backend):
    """The gradient of a NaN step of `a` is NaN, not the zero of a reset."""
    x, a, b, c, s0 = _inputs(4)
    a = (a * 0.05).at[:, 40, 0].set(jnp.nan)

    def f(a):
        y, final = chunk_ssd(x, a, b, c, chunk_size=64, initial_state=s0,
                             implementation=backend)
        return jnp.sum(y) + jnp.sum(final)

    assert np.isnan(np.asarray(jax.grad(f)(a))[:, 40, 0]).all()


# Where one non-finite value goes: x at (step 40, head 0, column 3), or B at (step 40,
# group 0, state column 5); 40 is mid-chunk, so the steps 0..39 of its chunk must stay
# finite, and the next chunk is reached through the state.
POISONED = {"x": (0, (slice(None), 40, 0, 3)), "b": (2, (slice(None), 40, 0, 5))}


def _poisoned(operand, value, step=40):
    """Inputs with one non-finite value in `operand` at `step` (POISONED's place)."""
    args = list(_inputs(5, heads=4, groups=2))
    args[1] = args[1] * 0.05
    index, where = POISONED[operand]
    args[index] = args[index].at[(where[0], step, *where[2:])].set(value)
    return args


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("operand", list(POISONED))
@pytest.mark.parametrize("path", PATHS + ["pallas_triton_16_rows"])
def test_non_finite_x_or_b_is_causal(path, operand, value):
    """A NaN or inf in x or B at step t reaches y from step t on, where the definition's
    does (x: that head and column; B: every head of that group), and never before t.
    The Triton kernels also run at 16-row blocks, where the value sits below the diagonal
    block for some rows and on it for others."""
    x, a, b, c, s0 = _poisoned(operand, value)
    if path == "pallas_triton_16_rows":
        from pallasite.kernels.ssd import pallas_triton  # noqa: PLC0415

        y, final = chunk_ssd(x, a, b, c, chunk_size=64, initial_state=s0,
                             implementation="pallas_triton",
                             block_sizes=pallas_triton.BlockSizes(block_m=16, block_t=16,
                                                                  block_n=16, heads=1))
    else:
        y, final = _on_path(path, x, a, b, c, s0)
    y64, final64 = _recurrence_nonfinite(x, a, b, c, s0)
    assert np.isfinite(y64[:, :40]).all() and not np.isfinite(y64[:, 40:]).all()
    _assert_like_the_definition(y, y64)
    _assert_like_the_definition(final, final64)


@pytest.mark.parametrize("operand", list(POISONED))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradients_with_a_non_finite_input(backend, operand):
    """What the backward does (docs/ssd.md): every gradient the definition's makes
    non-finite is non-finite, and beyond that only da and dC of the poisoned chunk's
    steps up to the value's (its [C, C] products meet the value above the diagonal); the
    chunk before stays finite."""
    step, chunk_start = 100, 64
    x, a, b, c, s0 = _poisoned(operand, np.nan, step)

    def grads(fn):
        def total(*t):
            y, final = fn(*t)
            return jnp.sum(y) + jnp.sum(final)
        return jax.grad(total, argnums=(0, 1, 2, 3, 4))(x, a, b, c, s0)

    got = grads(lambda *t: chunk_ssd(*t[:4], chunk_size=64, initial_state=t[4],
                                     implementation=backend))
    want = grads(ssd_sequential)
    for name, g, w in zip(("dx", "da", "db", "dc", "dinitial"), got, want):
        bad, bad_want = ~np.isfinite(np.asarray(g)), ~np.isfinite(np.asarray(w))
        assert (bad >= bad_want).all(), name
        extra = bad & ~bad_want
        if name in ("da", "dc"):
            extra[:, chunk_start:step + 1] = False
        assert not extra.any(), name
