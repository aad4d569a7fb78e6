"""select_block_sizes: precedence caller > table > cache > autotune > default, env switches."""

import pytest

from pallasite.tuning import cache, recording, select_block_sizes
from pallasite.tuning.autotune import COMPILE_ERROR, OK, SMEM_OVERFLOW, WRONG_RESULT
from _toy import DEFAULT, SHAPE, Cfg, bench, entry, fits, table


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(cache.ENV_AUTOTUNE, raising=False)


def select(t=None, **kw):
    args = dict(device_kind="Toy Chip", dtypes=("bfloat16",), shape=SHAPE, config_type=Cfg,
                default=DEFAULT, fits=fits, table=t if t is not None else table())
    args.update(kw)
    return select_block_sizes("toy", "impl", **args)


FAST = Cfg(block=128)


def test_precedence_caller_table_cache_autotune_default():
    calls = []
    measure = bench(times={DEFAULT: 0.004, Cfg(block=32): 0.003}, calls=calls)
    # Nothing anywhere and no measure: the default.
    assert select().source == "default" and select().config == DEFAULT
    # A miss with a measure autotunes (and caches), Cfg(32)... no: fastest is block=128/256.
    tuned = select(measure=measure)
    assert tuned.source == "autotune" and tuned.config in (FAST, Cfg(256, 8))
    assert {t.status for t in tuned.tune.trials} == {OK}
    # The second call reads the cache; no building.
    calls.clear()
    cached = select(measure=measure)
    assert (cached.source, cached.config, calls) == ("cache", tuned.config, [])
    # A table entry beats the cache.
    t = table([entry({"block": 32, "warps": 2})])
    assert select(t, measure=measure).config == Cfg(32, 2)
    assert select(t, measure=measure).source == "table"
    # The caller beats everything, unchecked.
    mine = Cfg(block=2048)
    assert select(t, caller=mine, measure=measure) == select(caller=mine)
    assert select(t, caller=mine).source == "caller" and select(t, caller=mine).config is mine


def test_table_entry_that_does_not_fit_or_is_stale_is_passed_over():
    small = {"m": 100, "n": 300}  # bucket small/wide
    t = table([entry({"block": 256}, m="small"), entry({"block": 64, "lanes": 3}, m="big")])
    sel = select(t, shape=small)
    assert sel.source == "default" and "does not fit" in sel.detail
    sel = select(t)
    assert sel.source == "default" and "stale" in sel.detail


def test_autotune_off_by_env_uses_table_cache_and_default(monkeypatch):
    calls = []
    monkeypatch.setenv(cache.ENV_AUTOTUNE, "0")
    sel = select(measure=bench(calls=calls))
    assert sel.source == "default" and calls == [] and "autotune off" in sel.detail
    monkeypatch.setenv(cache.ENV_AUTOTUNE, "1")
    assert select(measure=bench()).source == "autotune"
    monkeypatch.setenv(cache.ENV_AUTOTUNE, "off")
    assert select(measure=bench()).source == "cache"  # filled entries are still used


def test_cache_dir_env_moves_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "a"))
    assert select(measure=bench()).source == "autotune"
    assert list((tmp_path / "a").glob("toy.impl.*.json"))
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "b"))
    assert cache.cache_dir() == tmp_path / "b"
    assert select(measure=bench()).source == "autotune"  # a fresh cache: tuned again
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "a"))
    assert select(measure=bench()).source == "cache"


def test_default_cache_dir_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(cache.ENV_CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "pallasite" / "autotune"


def test_no_viable_candidate_is_cached_and_not_retuned():
    every = [DEFAULT, Cfg(32), Cfg(128), Cfg(256, 8)]
    calls = []
    measure = bench(fail={c: RuntimeError("boom") for c in every}, calls=calls)
    first = select(measure=measure)
    assert first.source == "default" and "no viable" in first.detail
    assert {t.status for t in first.tune.trials} == {COMPILE_ERROR}
    calls.clear()
    again = select(measure=measure)
    assert again.source == "default" and "cached: no viable" in again.detail and calls == []
    # A different candidate list is a different question: the verdict is stale.
    assert select(measure=bench(), candidates=[Cfg(512)]).source == "autotune"


def test_compile_failures_and_smem_overflows_are_recorded_in_the_cache():
    measure = bench(fail={Cfg(256, 8): RuntimeError("out of resource: shared memory, Required: 262144"),
                          Cfg(32): ValueError("Mosaic lowering failed")}, wrong=(Cfg(128),))
    sel = select(measure=measure)
    assert sel.source == "autotune" and sel.config == DEFAULT
    (path,) = cache.cache_dir().glob("toy.impl.*.json")
    import json
    statuses = {json.dumps(t["config"], sort_keys=True): t["status"] for t in json.loads(path.read_text())["trials"]}
    assert statuses == {'{"block": 64, "warps": 4}': OK, '{"block": 32, "warps": 4}': COMPILE_ERROR,
                        '{"block": 128, "warps": 4}': WRONG_RESULT, '{"block": 256, "warps": 8}': SMEM_OVERFLOW}


def test_cached_config_that_does_not_fit_is_retuned():
    select(measure=bench(times={DEFAULT: 0.003}))  # caches block 128 or 256 for bucket big/wide
    tiny_big = {"m": 600, "n": 300}
    assert select(measure=bench(), shape=tiny_big).source in ("cache", "autotune")
    narrow = {"m": 512, "n": 300}  # same bucket; block 256 fits, 128 fits
    assert select(shape=narrow).source == "cache"


def test_measure_factory_is_built_only_on_a_miss():
    built = []

    def factory():
        built.append(1)
        return bench()

    select(measure=factory)
    select(measure=factory)
    assert built == [1]


def test_unwritable_cache_still_selects_and_memoizes(tmp_path, monkeypatch):
    from pallasite.tuning import select as select_module
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(blocker / "sub"))
    monkeypatch.setattr(select_module, "_memo", {})
    calls = []
    assert select(measure=bench(calls=calls)).source == "autotune"
    calls.clear()
    assert select(measure=bench(calls=calls)).source == "cache" and calls == []


def test_op_without_table_keys_the_cache_by_exact_shape():
    sel = select_block_sizes("toy", "impl", device_kind="Toy Chip", dtypes="float32",
                             shape={"m": 700, "n": 3}, config_type=Cfg, default=DEFAULT,
                             table=None, measure=bench())
    assert sel.source == "autotune"
    (path,) = cache.cache_dir().glob("toy.impl.*.json")
    assert '"=700"' in path.read_text()


def test_failure_building_or_running_the_benchmark_logs_and_gives_the_default(monkeypatch, caplog):
    from pallasite.tuning import Benchmark
    from pallasite.tuning import select as select_module

    monkeypatch.setattr(select_module, "_failed", {})
    built = []

    def factory():
        built.append(1)
        raise MemoryError("no room for the synthetic inputs")

    with caplog.at_level("WARNING", logger="pallasite.tuning.select"):
        sel = select(measure=factory)
    assert (sel.source, sel.config) == ("default", DEFAULT) and "MemoryError" in sel.detail
    assert "autotune of toy/impl" in caplog.text and "MemoryError" in caplog.text
    # Not retried on every trace in this process, and nothing cached on disk.
    again = select(measure=factory)
    assert again.source == "default" and "failed earlier" in again.detail and built == [1]
    assert not list(cache.cache_dir().glob("*.json"))

    def bad_reference():
        raise RuntimeError("reference failed")

    b = Benchmark(build=bench().build, reference=bad_reference)
    sel = select(shape={"m": 1000, "n": 10}, measure=b)  # another key
    assert sel.source == "default" and "reference failed" in sel.detail


def test_on_miss_bound_is_small_and_starts_with_the_default(monkeypatch):
    from pallasite.tuning import select as select_module

    many = [{"block": 2 ** i} for i in range(1, 13)]  # 12 candidates; the default (64) among them
    sel = select(table(candidates=many), measure=bench())
    assert sel.source == "autotune"
    tried = [t.config for t in sel.tune.trials]
    assert len(tried) == select_module.ON_MISS_MAX_CANDIDATES == 8 and tried[0] == DEFAULT
    assert select_module.ON_MISS_BUDGET_S <= 10
    # The budget: a first candidate that spends it leaves the rest skipped.
    monkeypatch.setattr(select_module, "ON_MISS_BUDGET_S", 0.01)
    sel = select(table(candidates=many), shape={"m": 1000, "n": 10}, measure=bench(times={DEFAULT: 0.02}))
    assert sel.config == DEFAULT and {t.status for t in sel.tune.trials[1:]} == {"skipped_budget"}


def _traced_bench(calls):
    """A real benchmark: inputs made by jax on a miss, a jitted computation per config."""
    import jax
    import jax.numpy as jnp

    from pallasite.tuning import Benchmark

    def make():
        x = jax.random.normal(jax.random.key(0), (64, 256), jnp.float32)
        ref = jnp.sum(x * x, axis=1)

        def build(cfg):
            calls.append(cfg)
            f = jax.jit(lambda a: jnp.sum((a * a).reshape(64, -1, cfg.block), axis=(1, 2)))
            return lambda: f(x)

        return Benchmark(build=build, reference=lambda: ref, atol=1e-3, rtol=1e-4, warmup=1, reps=2)

    return make


def test_tunes_eagerly_while_jit_and_custom_vjp_trace_the_caller():
    """Kernels resolve block sizes while their caller is traced: inputs, compiles and timing
    must still run concretely there (the tuner's worker thread)."""
    import jax
    import jax.numpy as jnp

    calls, seen = [], []
    cands = [Cfg(32), Cfg(128)]

    def resolve(shape):
        sel = select(shape=shape, candidates=cands, measure=_traced_bench(calls))
        seen.append(sel)
        return sel.config

    @jax.jit
    def under_jit(a):
        return a * resolve({"m": 1000, "n": 300}).block

    assert float(under_jit(jnp.ones(())))  # a concrete result: the tuner left no tracer behind
    sel = seen.pop()
    assert sel.source == "autotune" and {t.status for t in sel.tune.trials} == {OK}
    assert sorted(c.block for c in set(calls)) == [32, 64, 128]  # the default, then the rest
    assert len(list(cache.cache_dir().glob("toy.impl.*.json"))) == 1

    @jax.custom_vjp
    def f(a):
        return a * 2

    def f_fwd(a):
        resolve({"m": 300, "n": 300})  # another bucket: a fresh miss
        return a * 2, None

    f.defvjp(f_fwd, lambda _, g: (g * 2,))
    grad = jax.jit(jax.grad(lambda a: f(a).sum()))(jnp.ones(3))
    assert grad.tolist() == [2.0, 2.0, 2.0]
    sel = seen.pop()
    assert sel.source == "autotune" and {t.status for t in sel.tune.trials} == {OK}
    assert len(list(cache.cache_dir().glob("toy.impl.*.json"))) == 2
    # And the next trace reads the cache.
    under_jit(jnp.ones((2,)))
    assert seen.pop().source == "cache"


def test_recording_collects_the_selections_made_inside_it():
    select()
    with recording() as outer:
        select(caller=FAST)
        with recording() as inner:
            select()
    select()
    assert [(op, impl, sel.config, sel.source) for op, impl, sel in outer] == [
        ("toy", "impl", FAST, "caller"), ("toy", "impl", DEFAULT, "default")]
    assert [sel.source for _, _, sel in inner] == ["default"]
