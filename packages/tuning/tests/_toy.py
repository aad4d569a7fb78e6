"""A toy op for the tuning tests: a config type, a table, and a fake benchmark."""

from __future__ import annotations

import dataclasses

import numpy as np

from pallasite.tuning import Benchmark
from pallasite.tuning.tables import parse_table


@dataclasses.dataclass(frozen=True)
class Cfg:
    block: int = 64
    warps: int = 4

    def __post_init__(self):
        if self.block <= 0 or self.block & (self.block - 1):
            raise ValueError(f"block={self.block}: need a power of two")


DEFAULT = Cfg()
SHAPE = {"m": 1000, "n": 300}


def table(entries=(), candidates=None):
    return parse_table({
        "format": 1,
        "op": "toy",
        "buckets": {"m": [["small", 1, 511], ["big", 512, None]],
                    "n": [["narrow", 1, 255], ["wide", 256, 4096]]},
        "candidates": {"impl": candidates if candidates is not None else
                       [{"block": 32}, {"block": 128}, {"block": 256, "warps": 8}]},
        "entries": list(entries),
    })


def entry(config, *, m="big", n="wide", device="Toy Chip", dtypes=("bfloat16",), impl="impl"):
    return {"implementation": impl, "device_kind": device, "dtypes": list(dtypes),
            "bucket": {"m": m, "n": n}, "config": config}


def fits(cfg, shape):
    return cfg.block <= shape["m"]


def bench(times=None, fail=None, wrong=(), calls=None):
    """Output = reference except for configs in `wrong`; 'time' is simulated by a cost dict."""
    ref = np.arange(6, dtype=np.float32)
    times = times or {}
    fail = fail or {}

    def build(cfg):
        if calls is not None:
            calls.append(cfg)
        if cfg in fail:
            raise fail[cfg]
        out = ref + (1.0 if cfg in wrong else 0.0)
        spin = times.get(cfg, 0.0)

        def run():
            if spin:
                import time
                end = time.perf_counter() + spin
                while time.perf_counter() < end:
                    pass
            return out

        return run

    return Benchmark(build=build, reference=lambda: ref, atol=1e-6, rtol=0.0, warmup=0, reps=2)
