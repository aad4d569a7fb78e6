"""Registers, spills, shared memory and barriers of pallasite's Pallas Triton kernels as
compiled for an H100/H200 (sm_90), on a machine with no GPU.

The kernels are lowered for CUDA from the CPU (as the tests do), each Triton module that
Pallas emits is caught on its way into the custom call, and the `triton` package (3.6,
the GPU machines' version; its wheel carries ptxas and cuobjdump) compiles it with the
call's num_warps and num_stages (block configs chosen for sm_90's 227 KiB of shared
memory, as on the device, not the CPU fallback's smallest budget). ptxas's register
count and the spill traffic (STL/LDL in the SASS) are the same as on the device; XLA
compiles the same module there with its own Triton, so the figures are a close guide,
not the device's own reading.

    python -m pip install --target /tmp/triton-3.6 triton==3.6.0
    PYTHONPATH=/tmp/triton-3.6:<the four package roots>:packages/kernels/tests \\
        python3 tools/sweeps/triton_resources.py gated_delta [--grad] [--packed 16] \\
        [--set PREP_IN_TWO_KERNELS=1] [--set SOLVE_WARPS=8]
    ... tools/sweeps/triton_resources.py ssd [--grad]

--set NAME=VALUE sets a module flag of the op's Pallas Triton module or of its backward's
(integers; 0/1 for booleans) before lowering. One JSON line per kernel: name, warps, stages, registers,
stack bytes, shared bytes, and counts of SASS instructions (STL/LDL spills, BAR, SHFL,
HMMA/HGMMA tensor-core ops, and FENCE/MEMBAR: the proxy fence, behind a memory barrier,
that follows each register-to-shared-memory write of a wgmma operand and waits for the
thread's in-flight loads and stores).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering

from cuda_export_testlib import cuda_module

SASS_OPS = ("STL", "LDL", "BAR", "SHFL", "HMMA", "HGMMA", "FENCE", "MEMBAR", "LDG", "LDGSTS",
            "STG")
_modules: list[str] = []
_lower = lowering.lower_jaxpr_to_triton_module


def _catching(*args, **kwargs):
    result = _lower(*args, **kwargs)
    _modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result


lowering.lower_jaxpr_to_triton_module = _catching  # the registration looks it up per call


def as_on_sm90():
    """Block configs chosen for an H100/H200's shared memory (227 KiB) while lowering: on
    a machine with no GPU the kernels' budget falls back to the smallest generation's
    (99 KiB), which would pick shallower pipelines (the state passes' stages) than the
    device runs."""
    from pallasite.kernels import platform

    budget = platform.SHARED_MEMORY_KIB["sm90"] * 1024
    platform.triton_shared_memory_budget = lambda device=None: budget


def lowered_kernels(fn, *args) -> list[tuple[str, int, int]]:
    """(Triton module text, num_warps, num_stages) of every Pallas Triton call in fn, in
    the order they were lowered (calls of one kernel name are taken to be one kernel)."""
    _modules.clear()
    with jax.enable_x64(False):
        text = cuda_module(fn, *args)
    calls = {name: (int(warps), int(stages)) for name, stages, warps in re.findall(
        r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)}
    kernels = {}
    for module in _modules:  # a kernel the program does not use (dead code) is left out
        name = re.search(r"tt.func (?:public )?@(\w+)", module).group(1)
        if name in calls:
            kernels[name] = (module, *calls[name])
    if len(kernels) != len(calls):
        raise RuntimeError(f"caught {sorted(kernels)} for the Triton calls {sorted(calls)}")
    return list(kernels.values())


def resources(module: str, num_warps: int, num_stages: int, folder: str) -> dict:
    """Compile one module for sm_90 and read its resources off the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(folder, f"kernel{len(os.listdir(folder))}.ttir")
    with open(path, "w") as f:
        f.write(module)
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    cubin = path.replace(".ttir", ".cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True,
                           check=True).stdout
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True,
                          check=True).stdout
    field = lambda name: int(re.search(name + r":(\d+)", usage).group(1))  # noqa: E731
    return dict(name=re.search(r"\.entry (\w+)", kernel.asm["ptx"]).group(1),
                warps=num_warps, stages=num_stages, registers=field("REG"),
                stack=field("STACK"), shared=kernel.metadata.shared,
                sass={op: len(re.findall(r"\b" + op + r"\b", sass)) for op in SASS_OPS},
                wide=wide_accesses(sass))


def wide_accesses(sass: str) -> dict:
    """Global loads (LDG, LDGSTS) and stores (STG) by their full opcode: a .128 suffix is a
    vectorised access, none (32 bits) or .U16 means the compiler could not prove a row's
    alignment or contiguity."""
    counts = {}
    for opcode in re.findall(r"\b((?:LDGSTS|LDG|STG)(?:\.[\w]+)*)", sass):
        counts[opcode] = counts.get(opcode, 0) + 1
    return counts


def gated_delta(grad: bool, packed: int = 0):
    """chunk_gated_delta_rule's kernels at Qwen3-Next's heads (16 q/k, 32 v, K = V = 128,
    bf16, chunk 64), a short sequence: the forward, or the forward and backward; with
    `packed` sequences, that many packed in the row (cu_seqlens)."""
    from pallasite.kernels.gated_delta import pallas_triton

    s = jax.ShapeDtypeStruct
    t, hk, hv, d = 1024, 16, 32, 128
    args = (s((1, t, hk, d), jnp.bfloat16), s((1, t, hk, d), jnp.bfloat16),
            s((1, t, hv, d), jnp.bfloat16), s((1, t, hv), jnp.float32),
            s((1, t, hv), jnp.float32), s((1, hv, d, d), jnp.float32))

    if packed:
        args = args[:5] + (s((packed, hv, d, d), jnp.float32), s((packed + 1,), jnp.int32))

    def forward(*a):
        return pallas_triton.forward(*a[:5], scale=d ** -0.5, initial_state=a[5],
                                     cu_seqlens=a[6] if packed else None, chunk_size=64,
                                     use_qk_l2norm_in_kernel=False)

    def loss(*a):
        o, final = forward(*a)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    return pallas_triton, (jax.grad(loss, argnums=tuple(range(6))) if grad else forward), args


def ssd(grad: bool):
    """chunk_ssd's kernels at the first SSD target row's head geometry (p 64, n 128, g 1,
    bf16, chunk 256), two chunks of 32 heads: the forward (state scan, output), or the
    backward's three (reverse scan, the two row kernels) on the forward's chunk states."""
    from pallasite.kernels.ssd import pallas_triton

    s = jax.ShapeDtypeStruct
    bc, nc, c, h, p, g, n = 1, 2, 256, 32, 64, 1, 128
    x, a = s((bc, nc, c, h, p), jnp.bfloat16), s((bc, nc, c, h), jnp.float32)
    b, init = s((bc, nc, c, g, n), jnp.bfloat16), s((bc, h, p, n), jnp.float32)
    if grad:
        states = s((bc, nc, h, p, n), jnp.bfloat16)
        return pallas_triton, pallas_triton.backward, (x, a, b, b, states, x, init)
    return pallas_triton, pallas_triton.forward, (x, a, b, b, init)


OPS = {"gated_delta": gated_delta, "ssd": ssd}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=sorted(OPS))
    parser.add_argument("--grad", action="store_true", help="the backward's kernels too")
    parser.add_argument("--packed", type=int, default=0, metavar="N",
                        help="gated_delta: N sequences packed in the row (cu_seqlens)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a module flag of the op's Pallas Triton module")
    args = parser.parse_args(argv)
    as_on_sm90()
    extra = {"packed": args.packed} if args.packed else {}
    module, fn, operands = OPS[args.op](args.grad, **extra)
    # The op's Pallas Triton module, and its backward's where it has one of its own.
    modules = [module]
    if importlib.util.find_spec(module.__name__ + "_bwd") is not None:
        modules.append(importlib.import_module(module.__name__ + "_bwd"))
    for item in args.set:
        name, _, value = item.partition("=")
        owner = next((m for m in modules if hasattr(m, name)), None)
        if owner is None:
            parser.error(f"--set: {' and '.join(m.__name__ for m in modules)} have no "
                         f"flag {name!r}")
        setattr(owner, name, type(getattr(owner, name))(int(value)))
    with tempfile.TemporaryDirectory() as folder:
        for kernel in lowered_kernels(fn, *operands):
            print(json.dumps(resources(*kernel, folder)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
