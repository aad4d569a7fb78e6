"""Disassembly check of the Mosaic GPU grouped-projection kernels (issue 7), on the H200.

Compiles the forward, dx and dkernel kernels at one TARGETS shape with Mosaic GPU's dump
switches on (MOSAIC_GPU_DUMP_SASS, MOSAIC_GPU_DUMP_PTXAS, MOSAIC_GPU_DUMP_TO; the SASS dump needs
nvdisasm; where jaxlib cannot start it, each dumped .ptx is assembled with ptxas and
disassembled with cuobjdump from PATH, e.g. /usr/local/cuda/bin) and reports
per dumped module: HGMMA instructions (Hopper's warpgroup matrix multiply; HMMA alone
would mean the slow path), local-memory loads and stores (LDL / STL: register spills or
run-time-indexed arrays), and ptxas's register / spill / stack-frame lines.

    python3 tools/device/grouped_projection_sass.py [--shape mixtral]

Prints one JSON summary and writes it to $OUT/sass_summary.json (and the first module's
SASS to $OUT/sass_forward.txt) when OUT is set.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Time the configs named here (or the table/defaults), never an autotune on a miss.
os.environ.setdefault("PALLASITE_AUTOTUNE", "0")
DUMP = tempfile.mkdtemp(prefix="mgpu_dump_")
os.environ.update(MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=DUMP)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for pkg in ("reference", "kernels", "tuning", "bench"):
    sys.path.insert(0, os.path.join(ROOT, "packages", pkg))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallasite.kernels.grouped_projection import pallas_mosaic_gpu as M  # noqa: E402
from pallasite.reference.inputs import random_group_sizes  # noqa: E402

SHAPES = {"mixtral": (32768, 4096, 14336, 8), "dsv3": (65536, 7168, 2048, 256),
          "qwen3": (65536, 2048, 768, 128)}


def summarise(path: str) -> dict:
    text = open(path, errors="replace").read()
    return {
        "file": os.path.basename(path),
        "bytes": len(text),
        "HGMMA": len(re.findall(r"\bHGMMA\b", text)),
        "HMMA": len(re.findall(r"\bHMMA\b", text)),
        "LDL": len(re.findall(r"\bLDL\b", text)),
        "STL": len(re.findall(r"\bSTL\b", text)),
        "UTMALDG": len(re.findall(r"\bUTMALDG\b", text)),
        "wgmma_ptx": len(re.findall(r"wgmma\.mma_async", text)),
        "ptxas": [ln.strip() for ln in text.splitlines()
                  if re.search(r"registers|spill|stack frame", ln)][:8],
    }


def disassemble(ptx: str) -> str | None:
    """SASS of a dumped .ptx, assembled with ptxas for sm_90a (what Mosaic GPU does), when
    jaxlib's own SASS dump cannot find nvdisasm."""
    ptxas, cuobjdump = shutil.which("ptxas"), shutil.which("cuobjdump")
    if not (ptxas and cuobjdump):
        return None
    cubin = ptx[:-4] + ".cubin"
    subprocess.run([ptxas, "-arch=sm_90a", "-O3", ptx, "-o", cubin], check=True)
    sass = ptx[:-4] + ".sass"
    with open(sass, "w") as f:
        subprocess.run([cuobjdump, "-sass", cubin], check=True, stdout=f)
    return sass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    opts = ap.parse_args()
    m, k, n, g = SHAPES[opts.shape]
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (g, k, n), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
    gs = random_group_sizes(jax.random.key(3), m, g)
    jax.block_until_ready(jax.jit(M.gmm)(x, w, gs))
    jax.block_until_ready(jax.jit(lambda a, b, s: M.gmm(a, b, s, transpose_rhs=True))(dy, w, gs))
    jax.block_until_ready(jax.jit(lambda a, b, s: M.tgmm(a, b, s, num_groups=g))(x, dy, gs))
    for ptx in glob.glob(os.path.join(DUMP, "**", "*.ptx"), recursive=True):
        if not glob.glob(ptx[:-4] + "*sass*"):
            disassemble(ptx)
    files = sorted(p for p in glob.glob(os.path.join(DUMP, "**", "*"), recursive=True)
                   if os.path.isfile(p))
    out = {"shape": opts.shape, "dims": [m, k, n, g], "dump_files": len(files),
           "modules": [summarise(p) for p in files
                       if p.endswith((".sass", ".ptxas", ".ptx", ".txt")) and "layout" not in p]}
    print(json.dumps(out, indent=1))
    target = os.environ.get("OUT")
    if target:
        with open(os.path.join(target, "sass_summary.json"), "w") as f:
            json.dump(out, f, indent=1)
        sass = [p for p in files if "sass" in os.path.basename(p).lower()]
        if sass:
            with open(os.path.join(target, "sass_forward.txt"), "w") as f:
                f.write(open(sass[0], errors="replace").read()[:4_000_000])


if __name__ == "__main__":
    main()
