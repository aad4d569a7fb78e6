"""Benchmark suites: docs/targets.md shapes, --quick shapes, the CPU parity shapes, filters.

- "targets": every shape of docs/targets.md (grouped_projection: mixtral, dsv3, qwen3,
  olmoe; chunk_ssd: its three Mamba-2 rows, chunk 256), forward and forward+backward.
- "extra": grouped_projection beyond docs/targets.md, forward and forward+backward: the
  mixtral and dsv3 shapes with skewed groups (90% of the rows in one group) and with a
  Zipf split; widths that are multiples of 64 but not of 256 (1408 and 5504, as input or
  output width); small-m shapes (a decode step's batch: a few hundred rows over a handful
  of groups, and a few rows per group over many). chunk_ssd at head_dim 128 with 8 groups
  and a 128-step chunk (a geometry beside the TARGETS rows' 64 / 1-8 / 256).
- "fp8": grouped_projection's TARGETS shapes with groups of whole 128-row blocks, in fp8
  (recipe="fp8"; the forward also from pre-quantized operands, beside torch's fp8
  grouped GEMM and its dense fp8 GEMM) and in bf16, forward and forward+backward, so
  every fp8 figure has the bf16 one of the same run beside it.
- "mamba": mamba_chunk_scan (dt_bias, softplus, D and z on, as a Mamba-2 layer calls it)
  on the TARGETS SSD rows, alone and with 8 sequences packed per row (seq_idx), forward
  and forward+backward, beside mamba_ssm's mamba_chunk_scan_combined.
- "mlp": grouped_mlp at three MoE layers' expert shapes (mixtral: d 4096, f 14336, 8
  experts, 16k tokens top 2; qwen3-30B-A3B: d 2048, f 768, 128 experts, 8k tokens top 8;
  dsv3: d 7168, f 2048, 256 experts, 8k tokens top 8), forward and forward+backward,
  beside the unfused composition (bf16 pre-activation written and read back); in bf16
  and with recipe="fp8".
- "delta": chunk_gated_delta_rule at Qwen3-Next-like (B 1, T 32768, 16 q/k heads, 32 v
  heads, K = V = 128), (B 8, T 4096, 32 heads, 128 x 128) and 16 sequences packed into
  32768 steps, forward and forward+backward, beside flash-linear-attention (fla-core).
- "quick": one small shape per op a GPU runs in seconds (still TARGETS-like proportions).
- "cpu": tiny shapes the Pallas interpreters get through in seconds on two cores; the default
  on a machine without an accelerator whatever else was asked.
- "smoke": the first shape of "cpu", forward only (the CLI test).
- "scaling": the TARGETS shapes (forward+backward, forward) on one device, then on N devices with the
  tokens (batch) N times larger and sharded over a "data" axis (weak scaling: the same
  work per device), and at the one-device size with the kernel's columns (heads) over a
  "model" axis (tensor parallelism). N is every device present (at least 2).
"""

from __future__ import annotations

from pallasite.bench import ops
from pallasite.bench.ops import delta_case, gp_case, mamba_case, mlp_case, ssd_case

_TARGET_GP = (
    ("mixtral", 32768, 4096, 14336, 8),
    ("dsv3", 65536, 7168, 2048, 256),
    ("qwen3", 65536, 2048, 768, 128),
    ("olmoe", 32768, 2048, 1024, 64),
)
_TARGET_SSD = (  # name, b, l, h, p, n, g
    ("mamba2_b8_l4k", 8, 4096, 32, 64, 128, 1),
    ("mamba2_b4_l8k_g8", 4, 8192, 64, 64, 128, 8),
    ("mamba2_b2_l16k", 2, 16384, 80, 64, 128, 1),
)

_EXTRA_GP_SKEWED = (
    ("mixtral_skewed", 32768, 4096, 14336, 8),
    ("dsv3_skewed", 65536, 7168, 2048, 256),
)
_EXTRA_GP_SMALL_M = (  # a decode step's batch
    ("mixtral_small_m", 1024, 4096, 14336, 8),
    ("dsv3_small_m", 2048, 7168, 2048, 256),
    ("mixtral_decode", 256, 4096, 14336, 8),
    ("qwen3_decode", 384, 2048, 768, 8),
)
# Widths that split into 64 but not 256 (DeepSeek-V2-Lite / Qwen1.5-MoE experts: 1408; a
# 5504-wide expert), up (the width is n) and down (it is k).
_EXTRA_GP_WIDTHS = (
    ("w1408_up", 32768, 2048, 1408, 64),
    ("w1408_down", 32768, 1408, 2048, 64),
    ("w5504_up", 32768, 2048, 5504, 16),
    ("w5504_down", 32768, 5504, 2048, 16),
    # k an odd multiple of 64 (2880 = 45 x 64: gpt-oss's hidden size) and its gate-up
    # width, over 128 experts: the odd half-tile of 128 along the contraction.
    ("w2880_gate_up", 65536, 2880, 5760, 128),
)

_EXTRA_SSD = (("mamba2_p128_g8_c128", 4, 8192, 32, 128, 128, 8),)  # chunk 128
_EXTRA_SSD_CHUNK = 128

_EXTRA_GP_ZIPF = (
    ("mixtral_zipf", 32768, 4096, 14336, 8),
    ("dsv3_zipf", 65536, 7168, 2048, 256),
)

_QUICK_GP = (("quick", 8192, 1024, 1024, 16),)
_QUICK_SSD = (("quick", 2, 2048, 16, 64, 64, 1),)
_PACKED = 8  # sequences per row in the "mamba" suite's packed cases
_MLP = (  # name, routed rows, d, f, experts
    ("mixtral_mlp", 32768, 4096, 14336, 8),
    ("qwen3_mlp", 65536, 2048, 768, 128),
    ("dsv3_mlp", 65536, 7168, 2048, 256),
)
_CPU_MLP = (("tiny_mlp", 96, 64, 64, 4),)
_CPU_MLP_FP8 = (("tiny_mlp_fp8", 256, 128, 128, 4),)  # f a multiple of 128: the fused route
_DELTA = (  # name, b, t, hk, hv, k, v, packed sequences
    ("qwen3_next", 1, 32768, 16, 32, 128, 128, 1),
    ("delta_b8_t4k", 8, 4096, 32, 32, 128, 128, 1),
    ("delta_packed16", 1, 32768, 16, 32, 128, 128, 16),
)
_CPU_DELTA = (("tiny_delta", 1, 100, 1, 2, 16, 16, 3),)

# One shape per op keeps the CPU main job near a minute on two cores (each interpreted
# kernel compiles for 2-8 s); b > 1, g > 1 and two chunks still exercise every index map.
_CPU_GP = (("tiny", 96, 64, 128, 4),)
_CPU_SSD = (("tiny", 2, 64, 4, 16, 16, 2),)
_CPU_SSD_CHUNK = 32
# mamba_chunk_scan goes through chunk_ssd's selection, which takes chunks of 64 or more.
_CPU_MAMBA = (("tiny", 2, 128, 4, 16, 16, 2),)
_CPU_MAMBA_CHUNK, _CPU_MAMBA_SEQS = 64, 3


def _cases(gp_shapes, ssd_shapes, directions, chunk=256) -> list[ops.Case]:
    out = []
    for direction in directions:
        out += [gp_case(*s, direction=direction) for s in gp_shapes]
        out += [ssd_case(*s, chunk=chunk, direction=direction) for s in ssd_shapes]
    return out


def scaling(devices: int) -> list[ops.Case]:
    """One-device, weak-scaling (data) and tensor-parallel (model) forms of each TARGETS
    shape, forward+backward and forward."""
    import dataclasses

    n = max(2, devices)
    out = []
    for case in _cases(_TARGET_GP, _TARGET_SSD, ("fwd_bwd", "fwd")):
        grown = "m" if case.op == ops.GP else "b"
        dims = tuple((k, v * n if k == grown else v) for k, v in case.dims)
        out += [case,
                dataclasses.replace(case, dims=dims, mesh=(("data", n),)),
                dataclasses.replace(case, mesh=(("model", n),))]
    return out


def suite(name: str, devices: int = 2) -> list[ops.Case]:
    if name == "scaling":
        return scaling(devices)
    if name == "fp8":
        return [gp_case(*s, direction=d, dtype=dtype, grouping="aligned")
                for dtype in (ops.FP8, "bfloat16") for d in ops.DIRECTIONS for s in _TARGET_GP]
    if name == "targets":
        return _cases(_TARGET_GP, _TARGET_SSD, ops.DIRECTIONS)
    if name == "extra":
        return [gp_case(*s, direction=d, grouping=grouping)
                for d in ops.DIRECTIONS for grouping, shapes in (
                    ("skewed", _EXTRA_GP_SKEWED), ("zipf", _EXTRA_GP_ZIPF))
                for s in shapes] + _cases(_EXTRA_GP_WIDTHS + _EXTRA_GP_SMALL_M, (),
                                          ops.DIRECTIONS) + _cases(
                    (), _EXTRA_SSD, ops.DIRECTIONS, chunk=_EXTRA_SSD_CHUNK)
    if name == "mamba":
        return [mamba_case(*s, seqs=seqs, direction=d) for d in ops.DIRECTIONS
                for seqs in (1, _PACKED) for s in _TARGET_SSD]
    if name == "mlp":
        return [mlp_case(*s, direction=d, dtype=dtype) for dtype in ("bfloat16", ops.FP8)
                for d in ops.DIRECTIONS for s in _MLP]
    if name == "delta":
        return [delta_case(*s[:7], seqs=s[7], direction=d) for d in ops.DIRECTIONS
                for s in _DELTA]
    if name == "quick":
        return _cases(_QUICK_GP, _QUICK_SSD, ops.DIRECTIONS) + [
            mamba_case(*s, seqs=_PACKED, direction=d) for d in ops.DIRECTIONS
            for s in _QUICK_SSD]
    if name == "cpu":
        return _cases(_CPU_GP, _CPU_SSD, ops.DIRECTIONS, chunk=_CPU_SSD_CHUNK) + [
            gp_case(*s, direction=d, dtype=ops.FP8) for d in ops.DIRECTIONS for s in _CPU_GP
        ] + [mamba_case(*s, chunk=_CPU_MAMBA_CHUNK, seqs=_CPU_MAMBA_SEQS, direction=d)
             for d in ops.DIRECTIONS for s in _CPU_MAMBA] + [
            mlp_case(*s, direction=d) for d in ops.DIRECTIONS for s in _CPU_MLP] + [
            mlp_case(*s, direction=d, dtype=ops.FP8) for d in ops.DIRECTIONS
            for s in _CPU_MLP_FP8] + [
            delta_case(*s[:7], chunk=16, seqs=s[7], direction=d) for d in ops.DIRECTIONS
            for s in _CPU_DELTA]
    if name == "smoke":
        return _cases(_CPU_GP[:1], _CPU_SSD[:1], ("fwd",), chunk=_CPU_SSD_CHUNK)
    raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")


SUITES = ("targets", "extra", "fp8", "mamba", "mlp", "delta", "quick", "cpu", "smoke",
          "scaling")


def filter_cases(cases: list[ops.Case], *, ops_: list[str] | None = None,
                 shapes: list[str] | None = None,
                 directions: list[str] | None = None,
                 dtypes: list[str] | None = None) -> list[ops.Case]:
    """Keep cases whose op / shape name matches (substring) and whose direction and dtype
    are among those named (None keeps all)."""
    def hit(value, patterns):
        return not patterns or any(p in value for p in patterns)

    return [c for c in cases if hit(c.op, ops_) and hit(c.shape_name, shapes)
            and (not directions or c.direction in directions)
            and (not dtypes or c.dtype in dtypes)]


def shape_names() -> list[str]:
    names = [s[0] for s in _TARGET_GP + _TARGET_SSD + _EXTRA_GP_SKEWED + _EXTRA_GP_ZIPF
             + _EXTRA_GP_WIDTHS + _EXTRA_GP_SMALL_M + _EXTRA_SSD
             + _QUICK_GP + _CPU_GP + _CPU_SSD + _MLP + _CPU_MLP + _CPU_MLP_FP8 + _CPU_MAMBA + _DELTA + _CPU_DELTA]
    return list(dict.fromkeys(names))
