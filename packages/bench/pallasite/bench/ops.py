"""What each benchmarked operation is: its cases, flops, minimum bytes, inputs and checks.

A `Case` is one (operation, direction, shape, dtype). Its flops and bytes are the
operation's declared work, not what a kernel happens to do, so records of different
implementations of one case share them and their TFLOP/s are directly comparable:

- grouped_projection: forward 2*m*k*n (docs/targets.md), forward+backward 6*m*k*n (dx and
  dkernel are each another m*k*n product). Minimum bytes: each product reads its operands
  and writes its result once (forward x, kernel, y; dx pass dy, kernel, dx; dkernel pass
  x, dy, dkernel), plus the group sizes.
- chunk_ssd (chunk C, nc = l/C chunks, T = C(C+1)/2 causal pairs): forward per chunk and
  head 2*T*p (masked scores times x) + 2*C*p*n (chunk state) + 2*C*p*n (inter-chunk output)
  + 2*p*n (state passing), and per chunk and *group* 2*T*n (the C.B scores, shared by the
  heads of a group). Only the lower triangle counts: the causal mask's upper half is not
  work, whatever a kernel spends on it. Forward+backward counts 3x forward, as for a matmul.
  docs/targets.md's first row: 52.8 GFLOP forward against 0.31 GB, 172 flop/byte, below the
  H200's ridge (206): memory bound. Minimum bytes: inputs and outputs
  once (x, a in fp32, b, c, the fp32 initial and final states, y); the backward reads
  x, a, b, c, dy, dfinal again and writes dx, da, db, dc, dinitial. docs/targets.md's first SSD
  row comes to 0.77 GB forward+backward (its "about 0.8 GB").

- mamba_chunk_scan (the whole Mamba-2 scan: dt bias and softplus, D, z, and with
  seqs > 1 that many packed sequences per row): chunk_ssd's flops (the elementwise work
  around the scan is not counted); minimum bytes: x, dt (fp32), B, C, z, the fp32
  initial state in, y and the final state out; the backward re-reads them and dy,
  dfinal, and writes dx, ddt, dB, dC, dz and the initial state's gradient.

- grouped_mlp (m routed rows of width d, experts with a [d, 2f] gate-up and an [f, d]
  down kernel): forward 2*m*d*2f + 2*m*f*d = 6*m*d*f, forward+backward 3x that. Minimum
  bytes: x, both kernels and y once; the backward reads x, the kernels and dy and writes
  dx and both kernels' gradients.

- gated_delta_rule (B rows of T steps, Hk key heads, Hv value heads, K x V states, chunk
  C; with seqs > 1 that many packed sequences in one row): per step and value head
  6*K*V for the state's three K x V products (W S, the output's S^T q, the update) and
  C*(3K + 2V) for the in-chunk work (the causal halves of Q K^T and K K^T, their
  products with the updates, the WY products); forward+backward 3x. Minimum bytes: q,
  k, v, g and beta (fp32), the fp32 initial state in, o and the final state out; the
  backward reads them again with do and dfinal and writes a gradient of each input.

Errors are measured against the definition, sampled so they cost little at any size:
grouped_projection rows of y and dx and columns of a few groups' dkernel, each recomputed
on the device with exact bf16 products summed in fp32 at HIGHEST precision; chunk_ssd's y
and final state for a few (batch, head) pairs by a float64 numpy recurrence over the full
sequence, and its gradients against the XLA implementation's in fp32 where that exists;
mamba_chunk_scan's the same way, its dt, D, z and resets applied in float64 around the
recurrence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

GP = "grouped_projection"
SSD = "chunk_ssd"
MAMBA = "mamba_chunk_scan"
GMLP = "grouped_mlp"
GDR = "gated_delta_rule"
DIRECTIONS = ("fwd", "fwd_bwd")

# "fp8": grouped_projection's recipe="fp8", bf16 operands quantized to e4m3 (1 byte each)
# by the implementation; its bytes count the fp8 operands the products read.
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
FP8 = "fp8"
DTYPES = tuple(_ITEMSIZE)  # a case's dtype: its operands' (fp8: recipe="fp8" from bf16)


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmarked point: an op, a direction, a named shape and an operand dtype."""

    op: str  # GP, SSD, MAMBA, GMLP or GDR
    direction: str  # "fwd" or "fwd_bwd"
    shape_name: str
    dims: tuple[tuple[str, int], ...]  # ordered (name, size) pairs
    dtype: str = "bfloat16"  # or "fp8" (grouped_projection's recipe="fp8", bf16 inputs)
    grouping: str = "dirichlet"  # grouped_projection's group sizes: see GROUPINGS
    # Mesh axes the inputs are sharded over, as (name, size) pairs: "data" splits the
    # tokens (m) or the batch, "model" the kernel's columns (n) or the heads; () is one
    # device. The dims are global (pallasite.bench.placement lays the inputs out).
    mesh: tuple[tuple[str, int], ...] = ()

    @property
    def kernel(self) -> str:
        return f"{self.op}.{self.direction}"

    @property
    def devices(self) -> int:
        return int(np.prod([size for _, size in self.mesh])) if self.mesh else 1

    @property
    def mesh_name(self) -> str:
        """"data=2,model=1" style, "" for one device."""
        return ",".join(f"{name}={size}" for name, size in self.mesh)

    @property
    def d(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def shape(self) -> str:
        dims = [f"{k}={v}" for k, v in self.dims]
        if self.grouping != "dirichlet":
            dims.append(f"groups={self.grouping}")
        return self.shape_name + "[" + ",".join(dims) + "]"

    @property
    def flops(self) -> float:
        if self.op in (GP, GMLP, GDR):
            fn = {GP: gp_flops, GMLP: mlp_flops, GDR: delta_flops}[self.op]
            return fn(self.direction, **self.d)
        return ssd_flops(self.direction, **_scan_dims(self.d))

    @property
    def bytes(self) -> float:
        fn = {GP: gp_bytes, SSD: ssd_bytes, MAMBA: mamba_bytes, GMLP: mlp_bytes,
              GDR: delta_bytes}[self.op]
        dims = self.d if self.op in (GP, GMLP, GDR) else _scan_dims(self.d)
        return fn(self.direction, _ITEMSIZE[self.dtype], **dims)


def _scan_dims(d: dict) -> dict:
    """A scan case's dims without mamba_chunk_scan's sequence count."""
    return {k: v for k, v in d.items() if k != "seqs"}


# How grouped_projection's rows are split over the groups (the same split for every seed):
# "dirichlet" is docs/targets.md's Dirichlet(4.0) split; "skewed" puts 90% of the rows in one
# group and splits the rest, the load imbalance a router produces early in training; "zipf"
# gives the group of rank r a share proportional to 1/r (a router's long tail). Each names
# its pallasite.reference.inputs function (imported where the inputs are drawn).
# "aligned" is the Dirichlet split in whole 128-row blocks: fp8 grouped GEMMs that need
# aligned groups (torch._scaled_grouped_mm) run the same problem as pallasite's.
_GROUP_SPLITS = {"dirichlet": "random_group_sizes", "skewed": "skewed_group_sizes",
                 "zipf": "zipf_group_sizes", "aligned": "aligned_group_sizes"}
GROUPINGS = tuple(_GROUP_SPLITS)


def gp_case(name, m, k, n, g, direction="fwd", dtype="bfloat16",
            grouping="dirichlet", mesh=()) -> Case:
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    return Case(GP, direction, name, (("m", m), ("k", k), ("n", n), ("g", g)), dtype, grouping,
                tuple(mesh))


def ssd_case(name, b, l, h, p, n, g, chunk=256, direction="fwd", dtype="bfloat16") -> Case:
    dims = (("b", b), ("l", l), ("h", h), ("p", p), ("n", n), ("g", g), ("chunk", chunk))
    return Case(SSD, direction, name, dims, dtype)


def mlp_case(name, m, d, f, g, direction="fwd", dtype="bfloat16") -> Case:
    """grouped_mlp over m routed rows (Dirichlet-split over g experts) of width d, each
    expert a [d, 2f] gate-up and an [f, d] down kernel, SwiGLU between."""
    return Case(GMLP, direction, name, (("m", m), ("d", d), ("f", f), ("g", g)), dtype)


def delta_case(name, b, t, hk, hv, k, v, chunk=64, seqs=1, direction="fwd",
               dtype="bfloat16") -> Case:
    """chunk_gated_delta_rule; seqs > 1 packs that many sequences of random lengths into
    one row (b must be 1) through cu_seqlens."""
    dims = (("b", b), ("t", t), ("hk", hk), ("hv", hv), ("k", k), ("v", v),
            ("chunk", chunk), ("seqs", seqs))
    return Case(GDR, direction, name, dims, dtype)


def mamba_case(name, b, l, h, p, n, g, chunk=256, seqs=1, direction="fwd",
               dtype="bfloat16") -> Case:
    """mamba_chunk_scan with dt_bias, softplus, D and z on, and `seqs` packed sequences
    per row (1: none, no seq_idx)."""
    dims = (("b", b), ("l", l), ("h", h), ("p", p), ("n", n), ("g", g), ("chunk", chunk),
            ("seqs", seqs))
    return Case(MAMBA, direction, name, dims, dtype)


# ------------------------------------------------------------------------ flops and bytes


def gp_flops(direction: str, m: int, k: int, n: int, g: int) -> float:
    """2*m*k*n forward; 6*m*k*n forward+backward (dx and dkernel products)."""
    return float((2 if direction == "fwd" else 6) * m * k * n)


def gp_bytes(direction: str, itemsize: int, m: int, k: int, n: int, g: int) -> float:
    """Each product reads its two operands and writes its result once; group sizes int32."""
    product = (m * k + g * k * n + m * n) * itemsize + 4 * g
    return float(product if direction == "fwd" else 3 * product)


def ssd_flops(direction: str, b: int, l: int, h: int, p: int, n: int, g: int,
              chunk: int) -> float:
    """The chunked algorithm's matrix work (see the module docstring); fwd_bwd = 3x fwd."""
    nc = l // chunk
    pairs = chunk * (chunk + 1) // 2
    per_head = 2 * pairs * p + 4 * chunk * p * n + 2 * p * n
    per_group = 2 * pairs * n
    fwd = b * nc * (h * per_head + g * per_group)
    return float(fwd if direction == "fwd" else 3 * fwd)


def ssd_bytes(direction: str, itemsize: int, b: int, l: int, h: int, p: int, n: int, g: int,
              chunk: int) -> float:
    """Inputs and outputs once; the backward re-reads the inputs (module docstring)."""
    x = b * l * h * p * itemsize
    a = b * l * h * 4
    bc = 2 * b * l * g * n * itemsize
    state = b * h * p * n * 4
    fwd = x + a + bc + state + x + state  # x, a, b, c, initial in; y, final out
    if direction == "fwd":
        return float(fwd)
    bwd = (x + a + bc) + (x + state) + (x + a + bc + state)  # re-read; dy, dfinal; grads
    return float(fwd + bwd)


def mlp_flops(direction: str, m: int, d: int, f: int, g: int) -> float:
    """2*m*d*2f (gate-up) + 2*m*f*d (down) forward; three times that forward+backward."""
    return float((1 if direction == "fwd" else 3) * 6 * m * d * f)


def mlp_bytes(direction: str, itemsize: int, m: int, d: int, f: int, g: int) -> float:
    """x, both kernels and y once; the backward reads x, the kernels and dy, and writes
    dx and the kernels' gradients."""
    x = m * d * itemsize
    kernels = 3 * g * d * f * itemsize
    fwd = 2 * x + kernels + 4 * g
    if direction == "fwd":
        return float(fwd)
    return float(fwd + (2 * x + kernels) + (x + kernels))


def delta_flops(direction: str, b: int, t: int, hk: int, hv: int, k: int, v: int,
                chunk: int, seqs: int) -> float:
    """6*K*V + C*(3K + 2V) per step and value head (module docstring); fwd_bwd 3x."""
    fwd = b * t * hv * (6 * k * v + chunk * (3 * k + 2 * v))
    return float(fwd if direction == "fwd" else 3 * fwd)


def delta_bytes(direction: str, itemsize: int, b: int, t: int, hk: int, hv: int, k: int,
                v: int, chunk: int, seqs: int) -> float:
    """q, k, v, g, beta and the initial state in; o and the final state out; the
    backward reads the inputs again with do and dfinal, and writes their gradients."""
    qk = 2 * b * t * hk * k * itemsize
    vo = b * t * hv * v * itemsize
    gates = 2 * b * t * hv * 4
    state = max(b, seqs) * hv * k * v * 4
    inputs = qk + vo + gates + state
    fwd = inputs + vo + state
    if direction == "fwd":
        return float(fwd)
    return float(fwd + inputs + (vo + state) + inputs)


def mamba_bytes(direction: str, itemsize: int, b: int, l: int, h: int, p: int, n: int,
                g: int, chunk: int) -> float:
    """x, dt, B, C, z and the initial state in, y and the final state out; the backward
    re-reads the inputs, reads dy and dfinal and writes a gradient of each input."""
    x = b * l * h * p * itemsize
    dt = b * l * h * 4
    bc = 2 * b * l * g * n * itemsize
    state = b * h * p * n * 4
    inputs = 2 * x + dt + bc + state  # x, z, dt, B, C, initial
    fwd = inputs + x + state
    if direction == "fwd":
        return float(fwd)
    return float(fwd + inputs + (x + state) + inputs)


# ------------------------------------------------------------------------------- inputs


def _dtype(name: str):
    import jax.numpy as jnp

    return jnp.dtype(name)


def make_inputs(case: Case, seed: int) -> dict[str, Any]:
    """One input set (never zeros) on the default device, drawn from `seed`.

    grouped_projection: x, kernel, group_sizes (the case's grouping of m rows, the same
    for every seed so all copies share one grouping), and dy for the backward; fp8 cases
    draw bf16 x and kernel and, for the forward, their block-quantized forms too
    (x_values, x_scales, kernel_values, kernel_scales: what a pre-quantized call reads,
    made here so that no timed call pays for them). chunk_ssd: x, a,
    b, c in [batch, length, ...] layout, a random fp32 initial state, and dy, dfinal.
    """
    import jax

    from pallasite.reference import inputs as ref_inputs

    d = case.d
    key = jax.random.key(seed)
    k_in, k_cot, k_state = jax.random.split(key, 3)
    dt = _dtype("bfloat16" if case.dtype == FP8 else case.dtype)
    if case.op == GP:
        x, kernel, _ = ref_inputs.grouped_projection_inputs(
            k_in, d["m"], d["k"], d["n"], d["g"], dt)
        split = getattr(ref_inputs, _GROUP_SPLITS[case.grouping])
        group_sizes = split(jax.random.key(1234), d["m"], d["g"])
        out = {"x": x, "kernel": kernel, "group_sizes": group_sizes}
        if case.dtype == FP8 and case.direction == "fwd":
            from pallasite.kernels import quantize

            xq, kq = quantize(x, (1, 128)), quantize(kernel, (1, 128, 128))
            out.update(x_values=xq.values, x_scales=xq.scales, kernel_values=kq.values,
                       kernel_scales=kq.scales)
        if case.direction == "fwd_bwd":
            out["dy"] = jax.random.normal(k_cot, (d["m"], d["n"]), dt)
        return out
    if case.op == MAMBA:
        return _mamba_inputs(case, k_in, k_cot, k_state, dt)
    if case.op == GMLP:
        return _mlp_inputs(case, k_in, k_cot, dt)
    if case.op == GDR:
        return _delta_inputs(case, k_in, k_cot, k_state, dt)
    x, a, b, c = ref_inputs.ssd_inputs(k_in, d["b"], d["l"], d["h"], d["p"], d["n"], d["g"], dt)
    init = ref_inputs.ssd_initial_state(k_state, d["b"], d["h"], d["p"], d["n"])
    out = {"x": x, "a": a, "b": b, "c": c, "initial_state": init}
    if case.direction == "fwd_bwd":
        k_dy, k_df = jax.random.split(k_cot)
        out["dy"] = jax.random.normal(k_dy, x.shape, dt)
        out["dfinal"] = jax.random.normal(k_df, init.shape, init.dtype)
    return out


# mamba_chunk_scan's arrays, in the order the implementations take (and differentiate) them.
MAMBA_ARGS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_state")


def _mamba_inputs(case: Case, k_in, k_cot, k_state, dtype) -> dict[str, Any]:
    """A Mamba-2 layer's scan inputs: x, z, B, C ~ N(0, 1) in `dtype`; dt ~ N(-4, 1) and
    dt_bias ~ N(0, 0.5) in fp32 (softplus gives Mamba-2's dt range), A = -exp(U[0, 1)),
    D ~ N(0, 1); with seqs > 1, seq_idx [b, l] packs that many sequences of random
    lengths (the same boundaries in every row)."""
    import jax
    import jax.numpy as jnp

    from pallasite.reference import inputs as ref_inputs

    d = case.d
    b, l, h, p, n, g = (d[k] for k in ("b", "l", "h", "p", "n", "g"))
    k = jax.random.split(k_in, 8)
    f32 = jnp.float32
    out = {"x": jax.random.normal(k[0], (b, l, h, p), f32).astype(dtype),
           "dt": jax.random.normal(k[1], (b, l, h), f32) - 4.0,
           "A": -jnp.exp(jax.random.uniform(k[2], (h,), f32)),
           "B": jax.random.normal(k[3], (b, l, g, n), f32).astype(dtype),
           "C": jax.random.normal(k[4], (b, l, g, n), f32).astype(dtype),
           "D": jax.random.normal(k[5], (h,), f32),
           "z": jax.random.normal(k[6], (b, l, h, p), f32).astype(dtype),
           "dt_bias": 0.5 * jax.random.normal(k[7], (h,), f32),
           "initial_state": ref_inputs.ssd_initial_state(k_state, b, h, p, n)}
    if d["seqs"] > 1:
        cuts = np.sort(np.random.default_rng(1234).choice(np.arange(1, l), d["seqs"] - 1,
                                                          replace=False))
        row = np.searchsorted(cuts, np.arange(l), side="right").astype(np.int32)
        out["seq_idx"] = jnp.asarray(np.broadcast_to(row, (b, l)))
    if case.direction == "fwd_bwd":
        k_dy, k_df = jax.random.split(k_cot)
        out["dy"] = jax.random.normal(k_dy, out["x"].shape, f32).astype(dtype)
        out["dfinal"] = jax.random.normal(k_df, (b, h, p, n), f32)
    return out


def _mlp_inputs(case: Case, k_in, k_cot, dtype) -> dict[str, Any]:
    """x ~ N(0, 1), kernels scaled for unit outputs (gate-up by 1/sqrt(d), down by
    1/sqrt(f)), in `dtype`; targets.md's Dirichlet group split (the same every seed)."""
    import jax

    from pallasite.reference import inputs as ref_inputs

    d = case.d
    m, width, f, g = d["m"], d["d"], d["f"], d["g"]
    k = jax.random.split(k_in, 3)
    out = {"x": jax.random.normal(k[0], (m, width)).astype(dtype),
           "gate_up": (jax.random.normal(k[1], (g, width, 2 * f)) / np.sqrt(width)).astype(dtype),
           "down": (jax.random.normal(k[2], (g, f, width)) / np.sqrt(f)).astype(dtype),
           "group_sizes": ref_inputs.random_group_sizes(jax.random.key(1234), m, g)}
    if case.direction == "fwd_bwd":
        out["dy"] = jax.random.normal(k_cot, (m, width)).astype(dtype)
    return out


# chunk_gated_delta_rule's differentiated arrays, in the order the implementations take them.
DELTA_ARGS = ("q", "k", "v", "g", "beta", "initial_state")


def _delta_inputs(case: Case, k_in, k_cot, k_state, dtype) -> dict[str, Any]:
    """Gated DeltaNet's (pallasite.reference.inputs.gated_delta_inputs), a random fp32
    initial state per sequence; with seqs > 1, cu_seqlens of that many random lengths
    (the same every seed)."""
    import jax
    import jax.numpy as jnp

    from pallasite.reference import inputs as ref_inputs

    d = case.d
    b, t, hk, hv, dk, dv = (d[x] for x in ("b", "t", "hk", "hv", "k", "v"))
    out = ref_inputs.gated_delta_inputs(k_in, k_state, b, t, hk, hv, dk, dv, dtype,
                                        states=d["seqs"] if d["seqs"] > 1 else b)
    if d["seqs"] > 1:
        cuts = np.sort(np.random.default_rng(1234).choice(np.arange(1, t), d["seqs"] - 1,
                                                          replace=False))
        out["cu_seqlens"] = jnp.asarray(np.concatenate([[0], cuts, [t]]).astype(np.int32))
    if case.direction == "fwd_bwd":
        k_do, k_df = jax.random.split(k_cot)
        out["do"] = jax.random.normal(k_do, out["v"].shape).astype(dtype)
        out["dfinal"] = jax.random.normal(k_df, out["initial_state"].shape)
    return out


def input_bytes(inputs: dict[str, Any]) -> int:
    return int(sum(v.size * v.dtype.itemsize for v in inputs.values()))


# ------------------------------------------------------------------------------- checks


@dataclasses.dataclass(frozen=True)
class Error:
    """The worst of each statistic over every compared output (parity.error_stats terms)."""

    max_abs: float
    mean_abs: float
    rel_l2: float
    scale: float  # max |expected| of the output with the worst rel_l2
    reference: str  # what the outputs were compared with
    ok: bool  # within parity.tolerance(dtype) on every output


def _stats(actual, expected):
    from pallasite.reference.parity import error_stats

    return error_stats(actual, expected)


def _combine(pairs, dtype: str, reference: str, tol=None) -> Error:
    from pallasite.reference.parity import tolerance

    tol = tol or tolerance(dtype)
    stats = [_stats(a, e) for a, e in pairs]
    worst = max(stats, key=lambda s: s.rel_l2 if np.isfinite(s.rel_l2) else np.inf)
    return Error(
        max_abs=max(s.max_abs for s in stats),
        mean_abs=max(s.mean_abs for s in stats),
        rel_l2=worst.rel_l2,
        scale=worst.scale,
        reference=reference,
        ok=all(tol.admits(s) for s in stats),
    )


def _sample_rows(group_sizes: np.ndarray, count: int, seed: int = 7) -> np.ndarray:
    """Up to `count` rows: the first and last row of non-empty groups spread evenly over
    all of them (the first and the last included, so a fault in late groups shows), then
    random ones."""
    ends = np.cumsum(group_sizes)
    starts = ends - group_sizes
    nonempty = np.flatnonzero(np.asarray(group_sizes) > 0)
    spread = np.linspace(0, len(nonempty) - 1, min(len(nonempty), count // 2))
    picks = nonempty[np.unique(np.round(spread).astype(int))] if len(nonempty) else []
    rows = [int(r) for g in picks for r in (starts[g], ends[g] - 1)]
    total = int(ends[-1]) if len(ends) else 0
    rng = np.random.default_rng(seed)
    rows = list(dict.fromkeys(rows))[:count]
    if total and len(rows) < count:
        rows += [int(r) for r in rng.integers(0, total, count - len(rows))]
    return np.asarray(sorted(set(rows)), np.int32)


def _group_of(rows: np.ndarray, group_sizes: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.cumsum(group_sizes), rows, side="right")


def _by_group(groups: np.ndarray, lhs_rows, weight_of, product):
    """product(lhs_rows, weight_of(g)) for the groups among the sampled rows, each row
    taking its own group's: one group's weights at a time (the rows' own copies of them
    would be 28 GiB in fp32 at mixtral's gate-up)."""
    import jax.numpy as jnp

    out = None
    for g in np.unique(groups):
        full = product(lhs_rows, weight_of(int(g)))
        pick = jnp.asarray(groups == g)[:, None]
        out = full if out is None else jnp.where(pick, full, out)
    return out


def check_grouped_projection(case: Case, inputs: dict, outputs: tuple) -> Error:
    """y (and dx, dkernel for fwd_bwd) on sampled rows/columns against exact products."""
    import jax
    import jax.numpy as jnp

    gs = np.asarray(inputs["group_sizes"])
    rows = _sample_rows(gs, 64)
    groups = _group_of(rows, gs)
    rows_j = jnp.asarray(rows)
    dot = jax.jit(lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32,
                                       precision=jax.lax.Precision.HIGHEST))

    def per_row(lhs_rows, weight_fn):
        return _by_group(groups, lhs_rows, weight_fn, dot)

    x, kernel_of, dy, x_tokens, dy_tokens = _as_multiplied(case, inputs, rows_j)
    pairs = [(jnp.asarray(outputs[0])[rows_j], per_row(x, kernel_of))]
    if case.direction == "fwd_bwd":
        pairs.append((jnp.asarray(outputs[1])[rows_j],
                      per_row(dy, lambda g: kernel_of(g).T)))
        cols = np.linspace(0, case.d["n"] - 1, min(case.d["n"], 16)).astype(np.int32)
        dy_cols = dy_tokens[:, jnp.asarray(cols)]
        ends = np.cumsum(gs)
        for g in _sample_groups(gs):
            mask = (np.arange(case.d["m"]) >= ends[g] - gs[g]) & (np.arange(case.d["m"]) < ends[g])
            xg = jnp.where(jnp.asarray(mask)[:, None], x_tokens, jnp.zeros_like(x_tokens))
            pairs.append((jnp.asarray(outputs[2])[g][:, jnp.asarray(cols)], dot(xg.T, dy_cols)))
    if case.dtype == FP8:  # exact sums of the quantized operands, bf16 outputs
        return _combine(pairs, "bfloat16", "exact products of the fp8-quantized operands, "
                        "fp32 sums (sampled rows/columns)")
    return _combine(pairs, case.dtype, "exact products, fp32 sums (sampled rows/columns)")


def _as_multiplied(case: Case, inputs: dict, rows):
    """(x's and dy's sampled `rows`, group g's kernel as a function of g, x and dy as
    dkernel reads them): the operands as the products multiply them. fp8 cases go
    through the block quantization (the oracle's), whose rounding is the recipe's, not
    an error: x and dy in 1 x 128 blocks (row-local, so the sampled rows alone), the
    kernel in 128 x 128 ones (one group at a time: dsv3's whole kernel in fp32 is 14
    GiB), and dkernel's operands in 128-token blocks aligned to groups."""
    x, kernel, dy = inputs["x"], inputs["kernel"], inputs.get("dy")
    pick = lambda a: None if a is None else a[rows]  # noqa: E731
    if case.dtype != FP8:
        return pick(x), lambda g: kernel[g], pick(dy), x, dy
    from pallasite.reference import quantization as q

    gs = inputs["group_sizes"]
    tokens = (None, None) if dy is None else (q.quantized_tokens(x, gs),
                                              q.quantized_tokens(dy, gs))
    rows_dy = None if dy is None else q.quantized_rows(dy[rows])
    return (q.quantized_rows(x[rows]), lambda g: q.quantized_kernel(kernel[g][None])[0],
            rows_dy) + tokens


def _sample_groups(gs: np.ndarray) -> list[int]:
    """The largest group, the smallest non-empty one and the last one (dedup'd)."""
    nonempty = [i for i in range(len(gs)) if gs[i] > 0]
    if not nonempty:
        return [0]
    picks = [int(np.argmax(gs)), min(nonempty, key=lambda i: gs[i]), len(gs) - 1]
    return list(dict.fromkeys(picks))


def check_ssd_forward(case: Case, inputs: dict, outputs: tuple) -> list[tuple]:
    """(actual, expected) pairs of y and final state for three (batch, head) pairs, expected
    from the float64 recurrence the SSD autotune benchmark checks against."""
    from pallasite.kernels.ssd.tuning_benchmarks import numpy_reference

    d = case.d
    picks = list(dict.fromkeys([(0, 0), (d["b"] - 1, d["h"] - 1), (d["b"] // 2, d["h"] // 2)]))
    expected = numpy_reference(inputs["x"], inputs["a"], inputs["b"], inputs["c"],
                               inputs["initial_state"], picks)
    pairs = []
    for (bi, hi), (y, final) in zip(picks, expected):
        pairs.append((np.asarray(outputs[0][bi, :, hi], np.float64), y))
        pairs.append((np.asarray(outputs[1][bi, hi], np.float64), final))
    return pairs


def check_ssd(case: Case, inputs: dict, outputs: tuple, grads_ref=None) -> Error:
    """Forward outputs against float64 numpy; gradients against `grads_ref` when given."""
    return _check_scan(case, check_ssd_forward(case, inputs, outputs), outputs, grads_ref,
                       "float64 recurrence (3 batch/head pairs)")


def _check_scan(case: Case, pairs: list, outputs: tuple, grads_ref, ref: str) -> Error:
    """A scan's forward pairs, and for fwd_bwd its gradients (outputs[2:]) against
    `grads_ref` when given."""
    if case.direction == "fwd_bwd" and grads_ref is not None and len(outputs) > 2:
        pairs = pairs + list(zip(outputs[2:], grads_ref))
        ref += "; gradients vs xla fp32"
    return _combine(pairs, case.dtype, ref)


def _softplus(t):
    return np.where(t <= 20.0, np.log1p(np.exp(np.minimum(t, 20.0))), t)


def check_mamba_forward(case: Case, inputs: dict, outputs: tuple) -> list[tuple]:
    """(actual, expected) pairs of y and the final state for three (batch, head) pairs:
    dt, the resets, D and z applied in float64 around the float64 recurrence."""
    from pallasite.kernels.ssd.tuning_benchmarks import numpy_reference

    d = case.d
    f64 = lambda k: np.asarray(inputs[k], np.float64)  # noqa: E731
    dt = _softplus(f64("dt") + f64("dt_bias"))
    a = f64("A") * dt
    if "seq_idx" in inputs:
        seq = np.asarray(inputs["seq_idx"])
        starts = np.concatenate([np.zeros_like(seq[:, :1], bool), seq[:, 1:] != seq[:, :-1]],
                                axis=1)
        # A reset: -1e4 (exp underflows to 0; -inf would give -inf - -inf = NaN in the
        # closed form's exponents, and float64 keeps the steps beside it to 1e-12).
        a = np.where(starts[..., None], -1e4, a)
    x = f64("x")
    picks = list(dict.fromkeys([(0, 0), (d["b"] - 1, d["h"] - 1), (d["b"] // 2, d["h"] // 2)]))
    with np.errstate(over="ignore"):  # exp(+1e4) above the diagonal, masked by tril
        expected = numpy_reference(x * dt[..., None], a, f64("B"), f64("C"),
                                   f64("initial_state"), picks)
    z, D = f64("z"), f64("D")
    pairs = []
    for (bi, hi), (y, final) in zip(picks, expected):
        zz = z[bi, :, hi]
        y = (y + D[hi] * x[bi, :, hi]) * zz / (1.0 + np.exp(-zz))
        pairs.append((np.asarray(outputs[0][bi, :, hi], np.float64), y))
        pairs.append((np.asarray(outputs[1][bi, hi], np.float64), final))
    return pairs


def check_mamba(case: Case, inputs: dict, outputs: tuple, grads_ref=None) -> Error:
    """Forward outputs against float64 numpy; the nine gradients against `grads_ref`."""
    return _check_scan(case, check_mamba_forward(case, inputs, outputs), outputs, grads_ref,
                       "float64 recurrence with dt, D, z (3 batch/head pairs)")


# grouped_mlp's fp8 routes against the unquantized definition (relative L2, max abs as a
# share of the largest expected value): x, both kernels and h each in e4m3 (3 mantissa
# bits) put y and dx about 6% (relative L2) from it, measured in test_grouped_mlp_fp8.py;
# a wrong or missing term is O(1).
FP8_MLP_TOLERANCE = {"rel_l2": 1e-1, "max_abs": 0.3}


def check_grouped_mlp(case: Case, inputs: dict, outputs: tuple) -> Error:
    """y (and dx for fwd_bwd) on up to 64 sampled rows against the definition computed
    for those rows alone: fp32 products of the bf16 operands at HIGHEST precision, h
    rounded once, y rounded once; dx through the SwiGLU's derivative from the rows'
    own fp32 pre-activations. The kernels' gradients are not compared here (the tests
    hold them to the definition). fp8 cases are held to the same definition within
    FP8_MLP_TOLERANCE, e4m3's error."""
    import jax
    import jax.numpy as jnp

    gs = np.asarray(inputs["group_sizes"])
    rows = _sample_rows(gs, 64)
    groups = _group_of(rows, gs)
    fp8 = case.dtype == FP8
    dt = _dtype("bfloat16" if fp8 else case.dtype)
    hi = jax.lax.Precision.HIGHEST

    dot = lambda a, w: jnp.dot(a, w, precision=hi)  # noqa: E731
    gate_up = lambda g: inputs["gate_up"][g].astype(jnp.float32)  # noqa: E731
    down = lambda g: inputs["down"][g].astype(jnp.float32)  # noqa: E731

    x = inputs["x"][jnp.asarray(rows)].astype(jnp.float32)
    f = case.d["f"]
    pre = _by_group(groups, x, gate_up, dot)
    gate, up = pre[:, :f], pre[:, f:]
    h = (jax.nn.silu(gate) * up).astype(dt).astype(jnp.float32)
    y = _by_group(groups, h, down, dot).astype(dt)
    pairs = [(jnp.asarray(outputs[0])[jnp.asarray(rows)], y)]
    ref = "definition on sampled rows (fp32 products, h and y rounded once)"
    if case.direction == "fwd_bwd" and len(outputs) > 1:
        dy = inputs["dy"][jnp.asarray(rows)].astype(jnp.float32)
        dh = _by_group(groups, dy.astype(dt).astype(jnp.float32), lambda g: down(g).T, dot)
        sig = jax.nn.sigmoid(gate)
        dgate = dh * up * sig * (1 + gate * (1 - sig))
        dup = dh * jax.nn.silu(gate)
        dx = _by_group(groups, jnp.concatenate([dgate, dup], 1), lambda g: gate_up(g).T, dot)
        pairs.append((jnp.asarray(outputs[1])[jnp.asarray(rows)], dx))
        ref += "; dx on the same rows"
    if fp8:
        from pallasite.reference.parity import Tolerance

        return _combine(pairs, "bfloat16", ref + "; fp8: the unquantized definition, within "
                        "e4m3's error", Tolerance(**FP8_MLP_TOLERANCE))
    return _combine(pairs, case.dtype, ref)


def _delta_numpy(q, k, v, g, beta, state, scale):
    """One (row, value head)'s outputs [T, V] and final state in float64, step by step;
    `state` is reset per sequence by the caller's loop."""
    o = np.zeros((q.shape[0], v.shape[1]))
    for t in range(q.shape[0]):
        state = np.exp(g[t]) * state
        state = state + beta[t] * np.outer(k[t], v[t] - state.T @ k[t])
        o[t] = state.T @ (scale * q[t])
    return o, state


def check_gated_delta_rule(case: Case, inputs: dict, outputs: tuple, grads_ref=None) -> Error:
    """o and the final states of three (row, value head) pairs against a float64 step-by-
    step recurrence (packed sequences each from their own initial state); for fwd_bwd the
    six gradients against `grads_ref` (the XLA form's in fp32) when given."""
    d = case.d
    f64 = lambda key: np.asarray(inputs[key], np.float64)  # noqa: E731
    q, k, v, g, beta, init = (f64(x) for x in DELTA_ARGS)
    rep, scale = d["hv"] // d["hk"], d["k"] ** -0.5
    cu = (np.asarray(inputs["cu_seqlens"]) if "cu_seqlens" in inputs
          else np.array([0, d["t"]]))
    picks = list(dict.fromkeys([(0, 0), (d["b"] - 1, d["hv"] - 1),
                                (d["b"] // 2, d["hv"] // 2)]))
    pairs = []
    for bi, hi in picks:
        parts, finals = [], []
        for s_ in range(len(cu) - 1):
            rows = slice(cu[s_], cu[s_ + 1])
            start = init[s_ if "cu_seqlens" in inputs else bi, hi]
            o, final = _delta_numpy(q[bi, rows, hi // rep], k[bi, rows, hi // rep],
                                    v[bi, rows, hi], g[bi, rows, hi], beta[bi, rows, hi],
                                    start, scale)
            parts.append(o)
            finals.append(final)
        pairs.append((np.asarray(outputs[0][bi, :, hi], np.float64), np.concatenate(parts)))
        got_final = np.asarray(outputs[1], np.float64)
        for s_, final in enumerate(finals):
            pairs.append((got_final[s_ if "cu_seqlens" in inputs else bi, hi], final))
    return _check_scan(case, pairs, outputs, grads_ref,
                       "float64 recurrence (3 row/head pairs)")
