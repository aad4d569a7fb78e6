"""Roofline plot (PNG, matplotlib Agg): every timed record as a labelled point.

x: arithmetic intensity (flops / minimum bytes), y: achieved TFLOP/s, both log scale; the
ceilings are the memory slope (bandwidth x intensity) and the flat compute peak of the
records' dtype. A point's label is "<implementation> <gp|ssd> <shape name> <direction>";
the legend keys the markers, and a footnote counts the records left out (not timed:
interpreter parity runs, unsupported or crashed ones) and why.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pallasite.bench.records import Record
from pallasite.bench.roofline import Roofline


_SHORT = {"grouped_projection": "gp", "chunk_ssd": "ssd", "mamba_chunk_scan": "mamba",
          "grouped_mlp": "mlp", "gated_delta_rule": "delta"}


def _label(r: Record) -> str:
    op, _, direction = r.kernel.partition(".")
    return f"{r.implementation} {_SHORT.get(op, op)} {r.shape.split('[')[0]} {direction}"


def colour(r: Record) -> str:
    """Red for a wrong result, whoever's (the title says so); else gray for a peer, blue
    for pallasite."""
    if r.status == "wrong":
        return "tab:red"
    return "tab:gray" if r.peer else "tab:blue"


def _free_offset(ax, x: float, y: float, placed: list, step: float = 9.0) -> float:
    """A vertical label offset (points) that keeps this label off the ones placed so far."""
    px, py = ax.transData.transform((x, y))
    offset = 0.0
    while any(abs(px - qx) < 260 and abs(py + offset * 1.4 - qy) < step * 1.3
              for qx, qy in placed):
        offset -= step
    placed.append((px, py + offset * 1.4))
    return offset


def _left_out(records: Sequence[Record]) -> str:
    """What the plot leaves out and why: records without a time, counted by reason."""
    why: dict[str, int] = {}
    for r in records:
        if r.tflops and r.bytes:
            continue
        reason = ("parity only (interpreter, not timed)" if r.timing.startswith("parity")
                  else r.status)
        why[reason] = why.get(reason, 0) + 1
    return "; ".join(f"{n} record{'s' if n > 1 else ''} {k}" for k, n in why.items())


def roofline_png(records: Sequence[Record], roof: Roofline, path: str,
                 dtype: str = "bfloat16") -> str | None:
    """Write the plot to `path`; return it (None when no record was timed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    timed = [r for r in records if r.tflops and r.bytes]
    if not timed:
        return None
    intensity = np.array([r.flops / r.bytes for r in timed])
    lo, hi = intensity.min() / 4, intensity.max() * 4
    peak = roof.peak_tflops(dtype)
    hi = max(hi, 4 * peak / roof.tbps)
    xs = np.geomspace(lo, hi, 200)
    fig, ax = plt.subplots(figsize=(11, 7), dpi=110)
    ax.plot(xs, np.minimum(peak, roof.tbps * xs), "k-", lw=1.5,
            label=f"{roof.name}: {peak:.3g} TFLOP/s, {roof.tbps:.3g} TB/s")
    markers = {"grouped_projection": "o", "chunk_ssd": "s", "mamba_chunk_scan": "D",
               "grouped_mlp": "v", "gated_delta_rule": "P"}
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(r.tflops for r in timed) / 2, peak * 1.5)
    placed: list[tuple[float, float]] = []  # label anchors in display pixels
    for r, x in sorted(zip(timed, intensity), key=lambda p: (p[1], -p[0].tflops)):
        op = r.kernel.split(".")[0]
        color = colour(r)
        ax.scatter([x], [r.tflops], marker=markers.get(op, "^"), color=color, zorder=3)
        ax.annotate(_label(r), (x, r.tflops), fontsize=7, textcoords="offset points",
                    xytext=(6, _free_offset(ax, x, r.tflops, placed)), color=color,
                    arrowprops={"arrowstyle": "-", "color": color, "lw": 0.4})
    for op, marker in markers.items():  # the marker key, points drawn above
        ax.scatter([], [], marker=marker, color="k", label=f"{_SHORT[op]}: {op}")
    ax.set_xlabel("arithmetic intensity (flop / minimum byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"pallasite roofline on {timed[0].device_kind} ({timed[0].backend}); "
                 "blue pallasite, gray peers, red wrong")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    left_out = _left_out(records)
    if left_out:
        fig.text(0.01, 0.005, "Not on the plot: " + left_out, fontsize=7, va="bottom")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout(rect=(0, 0.03 if left_out else 0, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path
