"""The grouped projection oracle: two forms equal, the numerics contract, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.reference import grouped_projection as gp
from pallasite.reference import inputs, parity

M, K, N, G = 24, 8, 6, 4

# name -> group sizes for M rows, G groups: the edge cases the issue names.
PATTERNS = {
    "uneven": [5, 9, 3, 7],
    "empty_groups": [0, 11, 0, 13],
    "first_and_last_empty": [0, 10, 14, 0],
    "all_empty": [0, 0, 0, 0],
    "one_group_holds_all": [0, 0, 24, 0],
    "m_above_total": [3, 0, 8, 2],
}


def _dense_oracle(x, kernel, sizes):
    """float64 numpy: the math with no JAX in it."""
    x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
    out, start = np.zeros((x.shape[0], kernel.shape[2])), 0
    for i, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size] @ kernel[i]
        start += size
    return out


def _operands(key, dtype, m=M, k=K, n=N, g=G):
    kx, kk, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (m, k), dtype)
    kernel = jax.random.normal(kk, (g, k, n), dtype)
    dy = jax.random.normal(kd, (m, n), dtype)
    return x, kernel, dy


def _value_and_grads(fn, x, kernel, sizes, compute, dy):
    out, vjp = jax.vjp(lambda x, w: fn(x, w, sizes, compute), x, kernel)
    return (out, *vjp(dy.astype(out.dtype)))


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_forms_agree_in_float64(pattern):
    sizes_list = PATTERNS[pattern]
    sizes = jnp.asarray(sizes_list, jnp.int32)
    with jax.enable_x64(True):
        x, kernel, dy = _operands(jax.random.key(1), jnp.float64)
        ragged = _value_and_grads(gp.grouped_projection, x, kernel, sizes, jnp.float64, dy)
        dense = _value_and_grads(gp.grouped_projection_per_group, x, kernel, sizes, jnp.float64, dy)
        for what, r, d in zip(("out", "dx", "dkernel"), ragged, dense):
            assert r.dtype == d.dtype == jnp.float64, what
            parity.assert_close(r, d, dtype=jnp.float64, what=what)
        # Both equal the numpy math; dx and dkernel written out by hand.
        total = sum(sizes_list)
        parity.assert_close(ragged[0], _dense_oracle(x, kernel, sizes_list), dtype=jnp.float64)
        want_dx = _dense_oracle(dy, np.swapaxes(np.asarray(kernel), 1, 2), sizes_list)
        parity.assert_close(ragged[1], want_dx, dtype=jnp.float64, what="dx")
        starts = np.cumsum([0] + sizes_list)
        want_dk = np.stack([np.asarray(x)[s:e].T @ np.asarray(dy)[s:e]
                            for s, e in zip(starts[:-1], starts[1:])])
        parity.assert_close(ragged[2], want_dk, dtype=jnp.float64, what="dkernel")
        # Rows past the total: zero output, zero gradient; empty groups: zero dkernel.
        assert not np.asarray(ragged[0][total:]).any()
        assert not np.asarray(ragged[1][total:]).any()
        for i, size in enumerate(sizes_list):
            assert (not np.asarray(ragged[2][i]).any()) == (size == 0)


@pytest.mark.parametrize("pattern", ["uneven", "empty_groups", "m_above_total"])
def test_building_blocks_agree_with_per_group(pattern):
    sizes = jnp.asarray(PATTERNS[pattern], jnp.int32)
    x, kernel, dy = _operands(jax.random.key(2), jnp.float32)
    parity.assert_close(gp.gmm_reference(x, kernel, sizes), gp.gmm_per_group(x, kernel, sizes),
                        dtype=jnp.float32, tol=parity.EXACT_FP32, what="gmm")
    dx = gp.gmm_reference(dy, kernel, sizes, transpose_rhs=True)  # kernel read as [g, n, k]
    assert dx.shape == (M, K) and dx.dtype == jnp.float32
    parity.assert_close(dx, gp.gmm_per_group(dy, kernel, sizes, transpose_rhs=True),
                        dtype=jnp.float32, tol=parity.EXACT_FP32, what="gmm transposed")
    dk = gp.tgmm_reference(x, dy, sizes, G)
    assert dk.shape == (G, K, N) and dk.dtype == jnp.float32
    parity.assert_close(dk, gp.tgmm_per_group(x, dy, sizes, G),
                        dtype=jnp.float32, tol=parity.EXACT_FP32, what="tgmm")


def test_building_blocks_accumulate_in_fp32_from_bf16():
    x, kernel, dy = _operands(jax.random.key(3), jnp.bfloat16)
    sizes = jnp.asarray(PATTERNS["uneven"], jnp.int32)
    assert gp.gmm_reference(x, kernel, sizes).dtype == jnp.float32
    assert gp.tgmm_reference(x, dy, sizes, G).dtype == jnp.float32


@pytest.mark.parametrize("compute", [jnp.bfloat16, jnp.float32])
def test_within_documented_tolerance_of_float64(compute):
    """bf16/fp32 compute vs the float64 math on the same (rounded) operands."""
    key = jax.random.key(4)
    x, kernel, sizes = inputs.grouped_projection_inputs(key, 64, 32, 16, 4, jnp.float32)
    dy = jax.random.normal(jax.random.key(5), (64, 16), jnp.float32).astype(compute)
    out, dx, dk = _value_and_grads(gp.grouped_projection, x, kernel, sizes, compute, dy)
    assert out.dtype == compute and dx.dtype == jnp.float32 and dk.dtype == jnp.float32
    xr, kr = np.asarray(x.astype(compute), np.float64), np.asarray(kernel.astype(compute), np.float64)
    sz = np.asarray(sizes).tolist()
    tol = parity.tolerance(compute) if compute == jnp.bfloat16 else parity.EXACT_FP32
    parity.assert_close(out, _dense_oracle(xr, kr, sz), dtype=compute, tol=tol, what="out")
    # dx/dkernel are rounded once to fp32, from an fp32 sum: fp32-exact whatever compute is.
    dyr = np.asarray(dy, np.float64)
    parity.assert_close(dx, _dense_oracle(dyr, np.swapaxes(kr, 1, 2), sz), dtype=jnp.float32,
                        tol=parity.EXACT_FP32, what="dx")
    starts = np.cumsum([0] + sz)
    want_dk = np.stack([xr[s:e].T @ dyr[s:e] for s, e in zip(starts[:-1], starts[1:])])
    parity.assert_close(dk, want_dk, dtype=jnp.float32,
                        tol=parity.EXACT_FP32, what="dkernel")


def test_gradients_round_once_to_operand_dtypes():
    """fp32 x with bf16 compute: dx is an fp32 sum, not a bf16 result widened afterwards."""
    x, kernel, dy = _operands(jax.random.key(6), jnp.float32)
    kernel = kernel.astype(jnp.bfloat16)
    sizes = jnp.asarray(PATTERNS["uneven"], jnp.int32)
    out, dx, dk = _value_and_grads(gp.grouped_projection, x, kernel, sizes, jnp.bfloat16, dy)
    assert (out.dtype, dx.dtype, dk.dtype) == (jnp.bfloat16, jnp.float32, jnp.bfloat16)
    assert np.any(np.asarray(dx) != np.asarray(dx.astype(jnp.bfloat16).astype(jnp.float32)))


def test_traced_group_sizes_under_jit():
    x, kernel, _ = _operands(jax.random.key(7), jnp.float32)
    sizes = jnp.asarray(PATTERNS["m_above_total"], jnp.int32)
    fn = jax.jit(gp.grouped_projection, static_argnums=3)
    parity.assert_close(fn(x, kernel, sizes, jnp.float32),
                        gp.grouped_projection_per_group(x, kernel, sizes, jnp.float32),
                        dtype=jnp.float32, tol=parity.EXACT_FP32)


def _good():
    return (np.zeros((M, K), np.float32), np.zeros((G, K, N), np.float32),
            np.asarray(PATTERNS["uneven"], np.int32), jnp.bfloat16)


BAD = [
    ("x", lambda x, w, s, c: (x[None], w, s, c), ValueError, r"x must be rank 2 .*\(1, 24, 8\)"),
    ("kernel", lambda x, w, s, c: (x, w[0], s, c), ValueError, r"kernel must be rank 3 .*\(8, 6\)"),
    ("k", lambda x, w, s, c: (x[:, :5], w, s, c), ValueError,
     r"x and kernel disagree on k: x shape \(24, 5\).*kernel shape \(4, 8, 6\)"),
    ("no_groups", lambda x, w, s, c: (x, w[:0], s[:0], c), ValueError, r"at least one group"),
    ("gs_length", lambda x, w, s, c: (x, w, s[:3], c), ValueError,
     r"group_sizes must be rank 1 of length g=4 .*got shape \(3,\)"),
    ("gs_rank", lambda x, w, s, c: (x, w, s[None], c), ValueError,
     r"group_sizes must be rank 1 .*got shape \(1, 4\)"),
    ("gs_int64", lambda x, w, s, c: (x, w, s.astype(np.int64), c), TypeError,
     r"group_sizes must be int32; got int64"),
    ("gs_float", lambda x, w, s, c: (x, w, s.astype(np.float32), c), TypeError,
     r"group_sizes must be int32; got float32"),
    ("x_int", lambda x, w, s, c: (x.astype(np.int32), w, s, c), TypeError, r"x must be floating"),
    ("kernel_int", lambda x, w, s, c: (x, w.astype(np.int8), s, c), TypeError,
     r"kernel must be floating"),
    ("compute_int", lambda x, w, s, c: (x, w, s, jnp.int32), TypeError,
     r"compute must be a floating dtype; got int32"),
    ("compute_junk", lambda x, w, s, c: (x, w, s, "not-a-dtype"), TypeError,
     r"compute must be a floating dtype"),
    ("negative", lambda x, w, s, c: (x, w, np.asarray([5, -1, 3, 7], np.int32), c), ValueError,
     r"group_sizes must be non-negative; got \[5, -1, 3, 7\]"),
    ("oversized", lambda x, w, s, c: (x, w, np.asarray([5, 9, 3, 8], np.int32), c), ValueError,
     r"group_sizes sum to 25, more than the m=24 rows of x"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("fn", [gp.validate_grouped_projection, gp.grouped_projection,
                                gp.grouped_projection_per_group])
def test_bad_input_names_argument_and_shape(case, fn):
    _, mutate, error, message = case
    with pytest.raises(error, match=message):
        fn(*mutate(*_good()))


def test_static_checks_skip_traced_group_sizes():
    """Under jit the sizes are unknown: no refusal, and no ConcretizationTypeError."""
    x, w, s, c = _good()
    jax.jit(lambda s: gp.grouped_projection(x, w, s, c))(s)
