"""The bounded autotuner: statuses, budget, candidate cap, reference check, under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.tuning.autotune import (COMPILE_ERROR, DOES_NOT_FIT, OK, RUNTIME_ERROR, SKIPPED_BUDGET,
                                       SMEM_OVERFLOW, WRONG_RESULT, Benchmark, autotune,
                                       classify_build_error, max_error)
from _toy import DEFAULT, Cfg, bench

CANDS = [DEFAULT, Cfg(32), Cfg(128), Cfg(256, 8)]


def test_fastest_correct_candidate_wins():
    r = autotune(CANDS, bench(times={DEFAULT: 0.003, Cfg(32): 0.002, Cfg(256, 8): 0.004}))
    assert r.best == Cfg(128) and r.best_time_s < 0.002
    assert r.time_of(DEFAULT) >= 0.003 and [t.status for t in r.trials] == [OK] * 4


def test_every_failure_is_recorded_as_what_it_was():
    def flaky(cfg):
        calls = []

        def run():
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("device lost")
            return np.arange(6, dtype=np.float32)
        return run

    base = bench(fail={Cfg(32): TypeError("cannot lower"),
                       Cfg(128): RuntimeError("RESOURCE_EXHAUSTED: scoped vmem limit")},
                 wrong=(Cfg(256, 8),))
    b = Benchmark(build=lambda c: flaky(c) if c == Cfg(512) else base.build(c),
                  reference=base.reference, atol=1e-6, rtol=0, warmup=0, reps=2)
    r = autotune(CANDS + [Cfg(512), Cfg(1024)], b, fits=lambda c: c.block < 1024)
    assert [t.status for t in r.trials] == [OK, COMPILE_ERROR, SMEM_OVERFLOW, WRONG_RESULT,
                                            RUNTIME_ERROR, DOES_NOT_FIT]
    assert r.best == DEFAULT
    assert "cannot lower" in r.trials[1].error and "max abs error" in r.trials[3].error


def test_no_viable_candidate():
    r = autotune(CANDS, bench(wrong=tuple(CANDS)))
    assert r.best is None and r.best_time_s is None and len(r.trials) == 4


def test_budget_and_candidate_cap():
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]

    r = autotune(CANDS, bench(), budget_s=4.5, clock=clock)
    assert [t.status for t in r.trials][-1] == SKIPPED_BUDGET and r.trials[0].status == OK
    r = autotune(CANDS + CANDS, bench(), max_candidates=2)  # duplicates dropped, then capped
    assert [t.config for t in r.trials] == CANDS[:2]


@pytest.mark.parametrize("message, status", [
    ("OutOfResources: out of resource: shared memory, Required: 233472, Hardware limit: 232448", SMEM_OVERFLOW),
    ("Mosaic GPU: kernel requires 300000 bytes of SMEM", SMEM_OVERFLOW),
    ("XlaRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem", SMEM_OVERFLOW),
    ("ValueError: block shape does not divide", COMPILE_ERROR),
])
def test_classify(message, status):
    assert classify_build_error(RuntimeError(message)) == status


def test_max_error_treats_nan_and_shape_mismatch_as_infinite():
    ref = {"y": np.ones(3), "s": np.zeros(2)}
    assert max_error(ref, ref) == (0.0, 1.0)
    assert max_error({"y": np.array([1, np.nan, 1]), "s": np.zeros(2)}, ref)[0] == np.inf
    assert max_error({"y": np.ones(4), "s": np.zeros(2)}, ref)[0] == np.inf


def test_pallas_benchmark_runs_while_the_caller_is_being_traced():
    """Kernels resolve block sizes at trace time: tuning must build inputs, trace kernels for
    compilation and run them then. The benchmark is a factory making its inputs on a miss."""
    from jax.experimental import pallas as pl

    def kernel_call(cfg, interpret):
        def kernel(x_ref, o_ref):  # program_id: an input-free primitive (see autotune's doc)
            o_ref[...] = x_ref[...] * cfg.warps + pl.program_id(0).astype(jnp.float32)

        return lambda a: pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), grid=(4,),
            in_specs=[pl.BlockSpec((1, 16), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((1, 16), lambda i: (i, 0)), interpret=interpret)(a)

    def make_bench():
        x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)  # a tracer on the caller's thread

        def build(cfg):
            # The kernel as a GPU would compile it, traced (not lowered: this is a CPU) the
            # way compilation does. Under jax.ensure_compile_time_eval this raises
            # "Evaluation rule for 'program_id' not implemented".
            jax.make_jaxpr(kernel_call(cfg, interpret=False))(x)
            f = jax.jit(kernel_call(cfg, interpret=True))
            return lambda: f(x)

        return Benchmark(build=build, reference=lambda: x * 4 + jnp.arange(4.0)[:, None], atol=1e-5, rtol=1e-5)

    seen = []

    @jax.jit
    def traced(a):
        seen.append(autotune([Cfg(64, 4), Cfg(64, 2)], make_bench))
        return a + 1

    traced(jnp.ones(2))
    (r,) = seen
    assert [t.status for t in r.trials] == [OK, WRONG_RESULT] and r.best == Cfg(64, 4)


def test_benchmark_factory_errors_propagate():
    def broken():
        raise MemoryError("no room for the inputs")

    with pytest.raises(MemoryError):
        autotune(CANDS, broken)


def test_sweep_winner_is_retimed_against_the_baseline(monkeypatch):
    """A baseline that reads slow only while it is first (clocks ramping) is kept.

    Each call reports its own duration through a stand-in for the timer (no spinning, no
    wall clock), so the verdicts do not depend on how busy the machine is."""
    from pallasite.tuning import autotune as autotune_module

    calls = {DEFAULT: 0}
    last = {}
    ref = np.arange(6, dtype=np.float32)

    def build(cfg):
        def run():
            if cfg == DEFAULT:
                calls[DEFAULT] += 1
                last["s"] = 0.004 if calls[DEFAULT] <= 3 else 0.001  # slow while swept
            else:
                last["s"] = 0.002
            return ref
        return run

    def timed(fn):
        fn()
        return last["s"]

    monkeypatch.setattr(autotune_module, "_time", timed)
    b = Benchmark(build=build, reference=lambda: ref, atol=0, rtol=0, warmup=0, reps=2)
    r = autotune([DEFAULT, Cfg(32)], b)
    assert r.time_of(DEFAULT) > r.time_of(Cfg(32))  # the sweep alone would pick Cfg(32)
    assert r.best == DEFAULT and r.baseline_time_s == r.best_time_s == 0.001
    calls[DEFAULT] = -100  # now the baseline is always slow: the winner stands
    r = autotune([DEFAULT, Cfg(32)], b, confirm_rounds=2)
    assert r.best == Cfg(32) and r.baseline_time_s > r.best_time_s
    assert autotune([DEFAULT, Cfg(32)], b, confirm_rounds=0).baseline_time_s is None
