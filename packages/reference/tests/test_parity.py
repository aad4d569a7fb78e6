"""The parity harness and the seeded input generators."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.reference import inputs, parity


# ------------------------------------------------------------------------- error_stats


def test_error_stats_values():
    stats = parity.error_stats(np.array([1.0, 2.0, 4.0]), np.array([1.0, 2.5, 3.0]))
    assert stats.max_abs == 1.0
    assert stats.mean_abs == pytest.approx(0.5)
    assert stats.rel_l2 == pytest.approx(math.sqrt(0.25 + 1.0) / math.sqrt(1 + 6.25 + 9))
    assert stats.scale == 3.0


def test_error_stats_in_float64_from_bf16():
    """The statistic adds no error: a one-ulp bf16 difference is measured exactly."""
    actual = jnp.asarray([1.0078125], jnp.bfloat16)  # 1 + 2^-7
    stats = parity.error_stats(actual, jnp.ones((1,), jnp.bfloat16))
    assert stats.max_abs == 2.0 ** -7


def test_error_stats_zero_expected_and_empty():
    assert parity.error_stats(np.zeros(3), np.zeros(3)).rel_l2 == 0.0
    assert parity.error_stats(np.ones(3), np.zeros(3)).rel_l2 == math.inf
    assert parity.error_stats(np.zeros((0, 4)), np.zeros((0, 4))).max_abs == 0.0


def test_error_stats_refuses_shape_mismatch():
    with pytest.raises(ValueError, match=r"actual shape \(3,\) != expected shape \(1, 3\)"):
        parity.error_stats(np.zeros(3), np.zeros((1, 3)))


def test_nan_fails_every_tolerance():
    stats = parity.error_stats(np.array([1.0, np.nan]), np.array([1.0, 1.0]))
    assert math.isnan(stats.max_abs)
    assert not parity.tolerance(jnp.bfloat16).admits(stats)


# -------------------------------------------------------------------------- tolerances


def test_tolerances_order_by_precision():
    """fp32 admits TF32 (fp16's 10-bit mantissa), so it is no tighter than fp16."""
    order = [parity.tolerance(jnp.bfloat16), parity.tolerance(jnp.float16),
             parity.tolerance(jnp.float32), parity.EXACT_FP32, parity.tolerance(jnp.float64)]
    for wide, narrow in zip(order[1:], order[:-1]):
        assert wide.rel_l2 <= narrow.rel_l2
    assert parity.EXACT_FP32.rel_l2 < parity.tolerance(jnp.float32).rel_l2


def test_tolerance_is_frozen_and_unknown_dtype_refused():
    with pytest.raises(Exception):
        parity.tolerance(jnp.float32).rel_l2 = 1.0
    with pytest.raises(ValueError, match=r"no parity tolerance for dtype int32"):
        parity.tolerance(jnp.int32)


def test_max_abs_is_relative_to_the_largest_expected_value():
    tol = parity.Tolerance(rel_l2=1.0, max_abs=1e-2)
    expected = np.array([100.0, 0.001])
    assert tol.admits(parity.error_stats(expected + [0.0, 0.5], expected))
    assert not tol.admits(parity.error_stats(expected + [2.0, 0.0], expected))


def test_bf16_tolerance_admits_one_rounding_and_catches_a_wrong_row():
    exact = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)
    rounded = exact.astype(jnp.bfloat16)
    parity.assert_close(rounded, exact, dtype=jnp.bfloat16)
    wrong = rounded.at[3].set(0)
    with pytest.raises(AssertionError):
        parity.assert_close(wrong, exact, dtype=jnp.bfloat16)


# ------------------------------------------------------------------------ assert_close


def test_assert_close_failure_is_a_table_row():
    with pytest.raises(AssertionError) as info:
        parity.assert_close(jnp.ones((3, 4)) * 1.1, jnp.ones((3, 4)), dtype=jnp.float32, what="dx")
    message = str(info.value)
    assert message.startswith("dx not close:")
    for cell in ("name", "rel_l2", "dx", "3x4", "float32", "1.000e-01", "FAIL"):
        assert cell in message


def test_assert_close_returns_stats_and_takes_an_override():
    stats = parity.assert_close(np.ones(4) * 1.5, np.ones(4), dtype=jnp.float32,
                                tol=parity.Tolerance(rel_l2=1.0, max_abs=1.0))
    assert stats.rel_l2 == pytest.approx(0.5)


# ------------------------------------------------------------------------ check_parity


def _run_case(case, key):
    shape = tuple(case.shape.values()) if isinstance(case.shape, dict) else case.shape
    expected = jax.random.normal(key, shape, jnp.float32)
    if case.params.get("raise"):
        error = RuntimeError("kernel exploded\n\nthe operation involved: ...")
        error.add_note("For simplicity, JAX has removed its internal frames ...")  # as JAX
        raise error
    actual = expected * (1 + case.params.get("error", 0.0))
    return {"y": (actual.astype(case.dtype), expected), "dx": (expected, expected)}


CASES = [
    parity.Case("small", (8, 4), jnp.float32),
    parity.Case("skewed", {"m": 16, "k": 4}, jnp.bfloat16, params={"error": 0.2}),
    parity.Case("broken", (2, 2), jnp.float32, params={"raise": True}),
    parity.Case("large", (32, 4), jnp.bfloat16),
]


def test_check_parity_runs_every_case_and_fails_once_with_the_table():
    with pytest.raises(AssertionError) as info:
        parity.check_parity(CASES, lambda c, k: _run_case(c, k))
    message = str(info.value)
    assert message.startswith("parity failed for 2 of 7 outputs:")
    lines = message.splitlines()
    assert lines[1].split()[:8] == ["name", "shape", "dtype", "max_abs", "mean_abs", "rel_l2",
                                    "tol", "ok"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {"small/y", "small/dx", "skewed/y", "skewed/dx", "broken",
                         "large/y", "large/dx"}
    assert rows["skewed/y"].rstrip().endswith("FAIL") and "m=16 k=4" in rows["skewed/y"]
    assert rows["broken"].rstrip().endswith("ERROR: RuntimeError: kernel exploded")
    assert rows["large/y"].rstrip().endswith("ok")  # ran after the failures


def test_check_parity_draws_fresh_inputs_per_case_and_reports():
    seen, reported = [], []

    def run(case, key):
        seen.append(np.asarray(jax.random.key_data(key)).tolist())
        x = jax.random.normal(key, case.shape)
        return x, x

    cases = [parity.Case(f"c{i}", (2,), jnp.float32) for i in range(3)]
    rows = parity.check_parity(cases, run, report=reported.append)
    assert len({str(s) for s in seen}) == 3
    assert [r.ok for r in rows] == [True] * 3
    assert "c2" in reported[0]


def test_check_parity_reports_a_shape_mismatch_as_a_failed_row():
    with pytest.raises(AssertionError, match=r"actual shape \(3,\) != expected shape \(4,\)"):
        parity.check_parity([parity.Case("bad", (4,), jnp.float32)],
                            lambda c, k: (np.zeros(3), np.zeros(4)))


# ---------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("m, g, total", [(1000, 8, None), (1000, 8, 700), (64, 64, 64), (5, 8, None)])
def test_random_group_sizes_sum_and_dtype(m, g, total):
    sizes = inputs.random_group_sizes(jax.random.key(1), m, g, total=total)
    assert sizes.dtype == jnp.int32 and sizes.shape == (g,)
    assert int(sizes.sum()) == (m if total is None else total)
    assert int(sizes.min()) >= 0


def test_random_group_sizes_are_seeded_and_uneven():
    a = inputs.random_group_sizes(jax.random.key(2), 4096, 16)
    np.testing.assert_array_equal(a, inputs.random_group_sizes(jax.random.key(2), 4096, 16))
    assert not np.array_equal(a, inputs.random_group_sizes(jax.random.key(3), 4096, 16))
    assert int(a.max()) > int(a.min())


def test_group_size_helpers():
    empty = inputs.random_group_sizes(jax.random.key(4), 100, 6, empty=(0, 5))
    assert int(empty[0]) == int(empty[5]) == 0 and int(empty.sum()) == 100
    skewed = inputs.skewed_group_sizes(jax.random.key(5), 100, 4, hot=2, hot_fraction=0.9)
    assert int(skewed.sum()) == 100 and int(skewed[2]) >= 90
    one = inputs.one_group_sizes(10, 4, index=3, total=7)
    np.testing.assert_array_equal(one, [0, 0, 0, 7])
    assert inputs.one_group_sizes(10, 4).dtype == jnp.int32
    with pytest.raises(ValueError, match=r"total must be in \[0, m=10\]; got 11"):
        inputs.random_group_sizes(jax.random.key(6), 10, 4, total=11)
    with pytest.raises(ValueError, match=r"every group is empty but total=10"):
        inputs.random_group_sizes(jax.random.key(6), 10, 2, empty=(0, 1))


def test_grouped_projection_inputs():
    x, kernel, sizes = inputs.grouped_projection_inputs(jax.random.key(7), 48, 16, 8, 3,
                                                        jnp.bfloat16)
    assert x.shape == (48, 16) and kernel.shape == (3, 16, 8) and sizes.shape == (3,)
    assert x.dtype == kernel.dtype == jnp.bfloat16 and int(sizes.sum()) == 48
    assert np.all(np.asarray(x) != 0)
    # kernel ~ N(0, 1/k): outputs stay O(1) whatever k is.
    assert 0.1 < float(jnp.std(kernel.astype(jnp.float32))) * 4 < 2.0


def test_ssd_inputs_follow_targets_distribution():
    x, a, b, c = inputs.ssd_inputs(jax.random.key(8), 2, 64, 4, 8, 16, 2, jnp.bfloat16)
    assert x.shape == (2, 64, 4, 8) and a.shape == (2, 64, 4)
    assert b.shape == c.shape == (2, 64, 2, 16)
    assert x.dtype == b.dtype == c.dtype == jnp.bfloat16 and a.dtype == jnp.float32
    a = np.asarray(a)
    assert np.all(a < 0) and a.max() > -1.0  # a = A*dt: negative, small (dt ~ 0.02)
    for t in (x, b, c):
        assert np.all(np.asarray(t, np.float32) != 0)
    # x arrives scaled by dt: much smaller than unit normal.
    assert float(jnp.abs(x.astype(jnp.float32)).mean()) < 0.1
    s0 = inputs.ssd_initial_state(jax.random.key(9), 2, 4, 8, 16)
    assert s0.shape == (2, 4, 8, 16) and s0.dtype == jnp.float32
    with jax.enable_x64(True):
        x64, a64, _, _ = inputs.ssd_inputs(jax.random.key(8), 1, 4, 2, 2, 2, 1, jnp.float64)
        assert x64.dtype == a64.dtype == jnp.float64
