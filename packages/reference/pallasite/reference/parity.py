"""Parity harness: error statistics, per-dtype tolerances and a shape/dtype grid runner.

Every kernel test and the benchmark judge a result against its reference with these
functions, so "close" means the same thing everywhere:

- `error_stats(actual, expected)`: max abs, mean abs and relative L2 error, computed in
  float64 numpy (so the statistic itself adds no error), plus the scale max|expected|.
- `tolerance(dtype)`: the per-dtype `Tolerance`; a result passes when
  `rel_l2 <= tol.rel_l2` and `max_abs <= tol.max_abs * max(max|expected|, tiny)`.
  The max-abs bound is relative to the largest expected magnitude, not elementwise: a
  kernel that sums in another order legitimately differs by a few ulps of the *large*
  partial sums, which is a large relative error on an element that cancels to near zero.
- `assert_close(actual, expected, *, dtype, what="")`: one comparison, raising with a table
  row that says what failed.
- `check_parity(cases, run_case)`: runs every case with fresh random inputs (a key folded
  from the case's index), keeps going after a failure or an exception, and fails once at the
  end with a table of all cases.

NaN or Inf in the difference fails every bound (comparisons are written as `x <= bound`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, ArrayLike

__all__ = [
    "ErrorStats",
    "Tolerance",
    "TOLERANCES",
    "EXACT_FP32",
    "tolerance",
    "error_stats",
    "assert_close",
    "Case",
    "ParityRow",
    "check_parity",
    "format_table",
]


@dataclasses.dataclass(frozen=True)
class ErrorStats:
    """Error of `actual` against `expected`, in float64."""

    max_abs: float
    mean_abs: float
    rel_l2: float
    scale: float  # max |expected|: what max_abs is judged against


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Bounds a result must meet: rel_l2 absolute, max_abs relative to max|expected|."""

    rel_l2: float
    max_abs: float

    def admits(self, stats: ErrorStats) -> bool:
        scale = stats.scale if stats.scale > 0 else 1.0
        return bool(stats.rel_l2 <= self.rel_l2 and stats.max_abs <= self.max_abs * scale)

    def __str__(self) -> str:
        return f"l2<={self.rel_l2:.0e} max<={self.max_abs:.0e}*|e|"


# Why each value (u = unit roundoff of the compute dtype; every contract rounds the output
# once, so a kernel and its oracle differ by fp32 summation order plus at most an ulp or two
# of that final rounding, or of intermediates a kernel keeps in the compute dtype):
TOLERANCES: Mapping[str, Tolerance] = {
    # bf16: u = 2^-8 = 3.9e-3. One rounding of a result alone gives rel_l2 ~ u/sqrt(3) =
    # 2.3e-3 and a max error of u*|e| <= 3.9e-3*|e|; kernels that also feed bf16
    # intermediates to the MXU/tensor cores (SSD's C.B scores, exp-weighted x) add a few
    # more roundings. 2e-2 / 3e-2 (about 4 ulps at the largest value) admits that and still
    # catches a wrong row, group or chunk (those give rel_l2 of order 1e-1 and up).
    "bfloat16": Tolerance(rel_l2=2e-2, max_abs=3e-2),
    # fp16: u = 2^-11 = 4.9e-4; same reasoning, 8x tighter than bf16.
    "float16": Tolerance(rel_l2=3e-3, max_abs=4e-3),
    # fp32: the contract runs fp32 compute as TF32 on GPU (u = 2^-11 for the operands), so
    # a GPU kernel at default precision sits ~5e-4 rel_l2 from a HIGHEST-precision oracle.
    # 3e-3 / 1e-2 admits TF32; use EXACT_FP32 where both sides are true fp32 (CPU).
    "float32": Tolerance(rel_l2=3e-3, max_abs=1e-2),
    # float64 (x64 tests of one oracle against another): only summation order differs;
    # measured ~1e-15 on the test shapes, bound at 1e-12.
    "float64": Tolerance(rel_l2=1e-12, max_abs=1e-11),
}

# True fp32 on both sides (CPU interpret mode, HIGHEST precision): summation order only,
# u = 6e-8 times sqrt(terms) and a growth factor for the SSD's exp chains.
EXACT_FP32 = Tolerance(rel_l2=2e-5, max_abs=1e-4)


def tolerance(dtype) -> Tolerance:
    """The default tolerance for results computed in `dtype` (see TOLERANCES for why)."""
    name = np.dtype(dtype).name
    if name not in TOLERANCES:
        raise ValueError(f"no parity tolerance for dtype {name}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[name]


def _as_f64(a: ArrayLike) -> np.ndarray:
    return np.asarray(jax.device_get(a)).astype(np.float64)


def error_stats(actual: ArrayLike | Array, expected: ArrayLike | Array) -> ErrorStats:
    """max abs, mean abs and relative L2 error of `actual` vs `expected`, in float64.

    rel_l2 = ||actual - expected||_2 / ||expected||_2; where expected is all zeros it is 0
    for an exact match and inf otherwise. Shapes must match exactly (no broadcasting: a
    broadcast would hide a wrong output shape).
    """
    a, e = _as_f64(actual), _as_f64(expected)
    if a.shape != e.shape:
        raise ValueError(f"actual shape {a.shape} != expected shape {e.shape}")
    if a.size == 0:
        return ErrorStats(0.0, 0.0, 0.0, 0.0)
    diff = np.abs(a - e)
    max_abs = float(np.max(diff))  # NaN propagates, and then fails every bound
    err_norm = float(np.linalg.norm(diff.ravel()))
    ref_norm = float(np.linalg.norm(e.ravel()))
    if ref_norm > 0:
        rel_l2 = err_norm / ref_norm
    else:
        rel_l2 = 0.0 if err_norm == 0 else math.inf
    scale = float(np.max(np.abs(e)))
    return ErrorStats(max_abs, float(np.mean(diff)), rel_l2, scale)


# ---------------------------------------------------------------------------- reporting


@dataclasses.dataclass(frozen=True)
class ParityRow:
    """One compared output of one case: the row of the report table."""

    name: str
    shape: str
    dtype: str
    stats: ErrorStats | None
    tol: Tolerance
    ok: bool
    error: str = ""  # the exception, where the case raised instead of returning


_HEADER = ("name", "shape", "dtype", "max_abs", "mean_abs", "rel_l2", "tol", "ok")


def _cells(row: ParityRow) -> tuple[str, ...]:
    if row.stats is None:
        nums = ("-", "-", "-")
    else:
        nums = tuple(f"{v:.3e}" for v in (row.stats.max_abs, row.stats.mean_abs, row.stats.rel_l2))
    ok = "ok" if row.ok else ("ERROR: " + row.error if row.error else "FAIL")
    return (row.name, row.shape, row.dtype, *nums, str(row.tol), ok)


def format_table(rows: Sequence[ParityRow]) -> str:
    """A fixed-width text table of `rows` (header first)."""
    lines = [_HEADER] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(_HEADER) - 1)]
    out = []
    for line in lines:
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1])
    return "\n".join(out)


def _shape_str(shape: Any) -> str:
    if isinstance(shape, Mapping):
        return " ".join(f"{k}={v}" for k, v in shape.items())
    if isinstance(shape, (tuple, list)):
        return "x".join(str(d) for d in shape)
    return str(shape)


def _dtype_name(dtype) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def assert_close(
    actual: ArrayLike | Array,
    expected: ArrayLike | Array,
    *,
    dtype,
    what: str = "",
    tol: Tolerance | None = None,
) -> ErrorStats:
    """Fail (AssertionError with a table row) unless `actual` is within `dtype`'s tolerance.

    `dtype` is the compute dtype the result was produced in (it picks the tolerance, not a
    cast); `tol` overrides the default. Returns the stats so callers can log them.
    """
    tol = tol or tolerance(dtype)
    stats = error_stats(actual, expected)
    if not tol.admits(stats):
        row = ParityRow(what or "value", _shape_str(np.shape(expected)), _dtype_name(dtype),
                        stats, tol, False)
        raise AssertionError(f"{what or 'value'} not close:\n" + format_table([row]))
    return stats


# ------------------------------------------------------------------------ the grid runner


@dataclasses.dataclass(frozen=True)
class Case:
    """One point of a parity grid.

    `shape` is free-form (a dict of named dims prints as `m=64 k=32`, a tuple as `64x32`);
    `params` carries whatever else `run_case` needs (chunk size, group pattern, ...).
    `tol` overrides the dtype's default tolerance for this case.
    """

    name: str
    shape: Any
    dtype: Any
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tol: Tolerance | None = None


# run_case(case, key) -> (actual, expected) or {what: (actual, expected)}.
RunCase = Callable[[Case, jax.Array], Any]


def _outputs(result: Any) -> list[tuple[str, Any, Any]]:
    if isinstance(result, Mapping):
        return [(what, pair[0], pair[1]) for what, pair in result.items()]
    actual, expected = result
    return [("", actual, expected)]


def _error_line(e: BaseException) -> str:
    """`Type: first line of the message` (200 characters at most). The exception's own
    text, not its notes: JAX appends one on traceback filtering, which named no error."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]


def _run_one(case: Case, key: jax.Array, run_case: RunCase) -> list[ParityRow]:
    shape, dtype = _shape_str(case.shape), _dtype_name(case.dtype)
    tol = case.tol or tolerance(case.dtype)
    try:
        outputs = _outputs(run_case(case, key))
    except Exception as e:  # noqa: BLE001 - report every case, fail once at the end
        return [ParityRow(case.name, shape, dtype, None, tol, False, _error_line(e))]
    rows = []
    for what, actual, expected in outputs:
        name = f"{case.name}/{what}" if what else case.name
        try:
            stats = error_stats(actual, expected)
        except ValueError as e:
            rows.append(ParityRow(name, shape, dtype, None, tol, False, str(e)))
            continue
        rows.append(ParityRow(name, shape, dtype, stats, tol, tol.admits(stats)))
    return rows


def check_parity(
    cases: Sequence[Case],
    run_case: RunCase,
    *,
    seed: int = 0,
    report: Callable[[str], None] | None = None,
) -> list[ParityRow]:
    """Run every case, then fail once with a table of all of them if any failed.

    `run_case(case, key)` draws its inputs from `key` (a fresh key per case, folded from
    `seed` and the case's index) and returns `(actual, expected)` or a mapping
    `{what: (actual, expected)}` (e.g. `{"y": ..., "dx": ...}`), each becoming one row.
    A case that raises is a failed row carrying its type and first line; the others
    still run. `report`, if given, receives the table whether or not anything failed.
    Returns the rows (the benchmark records them).
    """
    base = jax.random.key(seed)
    rows: list[ParityRow] = []
    for index, case in enumerate(cases):
        rows.extend(_run_one(case, jax.random.fold_in(base, index), run_case))
    table = format_table(rows)
    if report is not None:
        report(table)
    failed = [r for r in rows if not r.ok]
    if failed:
        raise AssertionError(
            f"parity failed for {len(failed)} of {len(rows)} outputs:\n{table}"
        )
    return rows
