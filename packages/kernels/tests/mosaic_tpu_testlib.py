"""What the TPU compiler is handed, read on a CPU host: the Mosaic modules that exporting a
function for TPU produces, as MLIR text by kernel name.

jax.export(..., platforms=["tpu"]) lowers every Pallas TPU kernel to Mosaic but compiles
none, so a module the TPU compiler refuses still exports. Refusals seen on a TPU v5e
(jax 0.10.2, 2026-12-06), which `known_refusals` finds in a module's text:
- under jax_enable_x64 the index maps' literal zeros were int64 ("failed to legalize
  operation 'func.func'"): any int64 or float64 value;
- a product of bf16 operands at fp32 contract precision ("Bad lhs type", in the TPU's own
  ragged dot at HIGHEST precision).
The kernels' lowering tests assert there are none. (fp16 blocks, refused too, are kept
from the kernels by their predicates: platform.MOSAIC_TPU_REFUSED_DTYPES.)"""

from __future__ import annotations

import contextlib
import re

import jax
from jax._src import tpu_custom_call
from jax.sharding import AbstractDevice, AbstractMesh

# A 64-bit integer or float type. A function's attributes (the grid's bounds as
# `array<i64: ...>`, `scalar_prefetch = 2 : i64`) are not values and are cut off first.
_SIXTY_FOUR_BIT = re.compile(r"\b[if]64\b")


@contextlib.contextmanager
def _captured_modules(into: dict):
    real = tpu_custom_call._lower_mosaic_module_to_asm

    def capture(module, **kwargs):
        text = str(module)
        name = re.search(r"func\.func @(\w+)", text).group(1)
        into[name] = text
        return real(module, **kwargs)

    tpu_custom_call._lower_mosaic_module_to_asm = capture
    try:
        yield
    finally:
        tpu_custom_call._lower_mosaic_module_to_asm = real


def mosaic_modules(fn, *args, kind: str = "TPU v5 lite", x64: bool = False
                   ) -> tuple[str, dict[str, str]]:
    """(the exported program's MLIR text, {kernel name: Mosaic module text}) of
    jax.jit(fn)(*args) exported for a TPU of `kind`, traced with jax_enable_x64 set to
    `x64`."""
    modules: dict[str, str] = {}
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(kind, 1, "tpu"))
    with _captured_modules(modules), jax.enable_x64(x64), jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    return exported.mlir_module(), modules


def sixty_four_bit_values(text: str) -> list[str]:
    """The lines of a Mosaic module that hold a 64-bit integer or float value."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if _SIXTY_FOUR_BIT.search(line.split(" attributes {")[0])]


def narrow_products_at_fp32(text: str) -> list[str]:
    """The lines of a Mosaic module that multiply 16-bit operands at fp32 contract
    precision."""
    return [line.strip() for line in text.splitlines()
            if "tpu.matmul" in line and "contract_precision<fp32>" in line
            and re.search(r"vector<[^>]*x(bf16|f16)>", line.split(") -> ")[0])]


def known_refusals(text: str) -> list[str]:
    return sixty_four_bit_values(text) + narrow_products_at_fp32(text)


def assert_no_known_refusals(exported: tuple[str, dict[str, str]], expected: list[str]):
    """mosaic_modules' `exported` program calls the kernels `expected` (one custom call
    each) and none of their modules holds a construct a TPU refused."""
    text, modules = exported
    assert text.count("tpu_custom_call") == len(expected), "expected one call per kernel"
    assert sorted(modules) == sorted(expected), sorted(modules)
    found = {name: known_refusals(module)[:3] for name, module in modules.items()}
    assert not any(found.values()), found
