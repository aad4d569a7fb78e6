"""H200: which construct stalls the Mosaic GPU grouped projection (issue 7 follow-up).

The GPU test `test_gpu_parity[total_lt_m-default]` (total < m and two empty groups) did
not finish in two runs (killed after 20-40 s) while the three cases before it (total == m,
no empty group) passed in seconds. Suspects, each run here in its own subprocess with a
timeout so one stall does not hide the others:
  gmm_tail    gmm, total < m, no empty group   (tiles that skip the pipeline, store zeros)
  gmm_empty   gmm, total == m, one empty group (no tile for that group)
  tgmm_empty  tgmm, one empty group            (tiles that skip the pipeline)
  tgmm_tail   tgmm, total < m, no empty group
  ref_tgmm    the XLA reference tgmm with an empty group (not our kernel)

  python3 tools/device/grouped_projection_mosaic_gpu_hang.py [--timeout-s 25]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

# Time the configs named here (or the table/defaults), never an autotune on a miss.
os.environ.setdefault("PALLASITE_AUTOTUNE", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {
    "gmm_tail": ("gmm", [500, 700, 300, 800]),
    "gmm_empty": ("gmm", [1000, 0, 1048, 2048]),
    "tgmm_empty": ("tgmm", [1000, 0, 1048, 2048]),
    "tgmm_tail": ("tgmm", [500, 700, 300, 800]),
    "ref_tgmm": ("ref", [1000, 0, 1048, 2048]),
}

CHILD = r"""
import sys, time
for p in ("reference", "kernels", "tuning", "bench"):
    sys.path.insert(0, "{root}/packages/" + p)
import jax, jax.numpy as jnp, numpy as np
from pallasite.kernels.grouped_projection import pallas_mosaic_gpu as M
from pallasite.reference.grouped_projection import gmm_reference, tgmm_reference
op, sizes = "{op}", {sizes}
m, k, n, g = 4096, 256, 384, len(sizes)
gs = jnp.array(sizes, jnp.int32)
x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (g, k, n), jnp.float32).astype(jnp.bfloat16)
dy = jax.random.normal(jax.random.key(2), (m, n), jnp.float32).astype(jnp.bfloat16)
t = time.time()
if op == "gmm":
    out = M.gmm(x, w, gs, out_dtype=jnp.float32)
    ref = gmm_reference(x.astype(jnp.float32), w.astype(jnp.float32), gs)
elif op == "tgmm":
    out = M.tgmm(x, dy, gs, num_groups=g, out_dtype=jnp.float32)
    ref = tgmm_reference(x.astype(jnp.float32), dy.astype(jnp.float32), gs, g)
else:
    out = ref = tgmm_reference(x.astype(jnp.float32), dy.astype(jnp.float32), gs, g)
out.block_until_ready()
err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
print("OK", round(time.time() - t, 2), "s rel_l2", err)
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--timeout-s", type=float, default=25.0)
    args = p.parse_args()
    for name, (op, sizes) in CASES.items():
        code = CHILD.format(root=ROOT, op=op, sizes=sizes)
        t = time.time()
        try:
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=args.timeout_s)
            tail = (r.stdout.strip().splitlines() or [""])[-1] or r.stderr.strip()[-400:]
            print(f"{name}: rc={r.returncode} {tail}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"{name}: STALLED (> {args.timeout_s:.0f} s)", flush=True)
        print(f"  ({time.time() - t:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
