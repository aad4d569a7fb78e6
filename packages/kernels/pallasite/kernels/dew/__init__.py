"""dew's `dew.nn.kernels` names on pallasite's kernels: a drop-in for code written for dew.

dew (github.com/AshishKumar4/dew) exposes its Pallas kernels as `dew.nn.kernels`; this
module has every one of those names with dew's signature and meaning, so such code can
import from here instead. The work runs on pallasite's kernels (Triton on GPUs from sm80,
Mosaic TPU by name), held to pallasite's numerics contracts. Where dew and pallasite use
different conventions, the difference is translated here and nowhere else:

- `ssd_chunk_scan(x_c, b_c, c_c, a_c, state, platform)` takes dew's chunk-major layout
  (x_c [chunks, batch, chunk, heads, head_dim], b_c and c_c [chunks, batch, chunk, heads,
  state] with the groups expanded, a_c [chunks, batch, heads, chunk]) and a JAX platform
  name ("gpu" or "tpu"), returns the output in fp32, and interprets the kernel where the
  process holds no device of that platform (how dew's CPU tests read the kernel).
  pallasite's own `ssd_chunk_scan` is batch-major, takes Mamba's operand order (x, a, b, c),
  returns y in x's dtype and names backends.
- `ssd_kernel_runs(..., "gpu" | "tpu")` and `ssd_kernel_platform` speak platforms, not
  backend names; the geometry rule is pallasite's (it is pallasite's kernel that runs), and
  `ssd_kernel_platform` offers a kernel only where pallasite admits it by default (so a TPU
  gets None until a TPU benchmark admits the Mosaic kernel; naming "tpu" still runs it).
- `device_generation` returns an unknown TPU's device kind unchanged, as dew does
  (pallasite's returns "tpu"); `bf16_dot_runs` takes a generation string; `triton_runs`
  asks about every GPU of the process.
- `grouped_projection` casts any integer group sizes to int32 (pallasite asks for int32);
  concrete sizes int32 cannot hold are refused first, showing the values given.

dew's chunked gated delta rule is built from three modules of pieces and a decode step,
offered here as submodules with dew's names, layouts and meaning: `delta_prep`
(`chunk_prep`, the in-chunk WY correction), `delta_chunks` (`chunk_states`, the state
across chunks), `delta_output` (`chunk_output`), each with its `refusal`, and
`delta_rule` (`step`, one token with a decay per key dimension; `fits`;
`round_to_bf16`). pallasite's own rule fuses those pieces in its kernels behind one
hand-written backward, so the pieces are plain-JAX forms (every device, differentiable
by JAX); docs/dew.md says so per name.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallasite.kernels import grouped_matmul
from pallasite.kernels import ssd as pallasite_ssd
from pallasite.kernels.dew import delta_chunks, delta_output, delta_prep, delta_rule
from pallasite.kernels.grouped_matmul import predicates as grouped_predicates
from pallasite.reference.grouped_projection import Dtype, PrecisionLike

__all__ = [
    "bf16_dot_runs",
    "delta_chunks",
    "delta_output",
    "delta_prep",
    "delta_rule",
    "device_generation",
    "grouped_projection",
    "ragged_dot_runs",
    "sm_version",
    "ssd_chunk_scan",
    "ssd_kernel_platform",
    "ssd_kernel_runs",
    "triton_runs",
]

# dew's names for the TPU device kinds it knows; any other kind is returned unchanged.
TPU_GENERATIONS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                   "TPU v6 lite": "v6e"}
# The first GPU generation with bf16 tensor cores (Ampere), and Triton's lower bound.
BF16_GPU = 80
# dew's platform names -> pallasite's SSD backends.
SSD_BACKENDS = {"gpu": "pallas_triton", "tpu": "pallas_mosaic_tpu"}


def _devices():
    return jax.devices()


# ------------------------------------------------------------------------- generations


def device_generation() -> str:
    """The default device's generation: 'sm89' for compute capability 8.9, 'v6e' for a
    TPU v6e (an unknown TPU kind unchanged), else the platform name."""
    device = _devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and capability:
        return "sm" + str(capability).replace(".", "")
    if device.platform == "tpu":
        kind = device.device_kind or "tpu"
        return TPU_GENERATIONS.get(kind, kind)
    return device.platform


def sm_version(generation: str) -> int | None:
    """89 for 'sm89'; None for anything that is not a GPU generation."""
    digits = generation[2:]
    return int(digits) if generation.startswith("sm") and digits.isdigit() else None


def bf16_dot_runs(generation: str | None = None) -> bool:
    """Whether `generation` (the default device's when None) runs a bf16 x bf16 -> fp32
    dot natively: every TPU and CPU, a GPU from sm80."""
    version = sm_version(device_generation() if generation is None else generation)
    return version is None or version >= BF16_GPU


def _gpu_versions() -> list[int]:
    return [int(str(d.compute_capability).replace(".", "")) for d in _devices()
            if d.platform == "gpu"]


def triton_runs() -> bool:
    """The process holds GPUs and every one is sm80 or later (Triton's lower bound)."""
    versions = _gpu_versions()
    return bool(versions) and min(versions) >= BF16_GPU


def _triton_compiles() -> bool:
    """triton_runs, or no GPU at all: a kernel named for 'gpu' then runs the interpreter."""
    versions = _gpu_versions()
    return not versions or min(versions) >= BF16_GPU


# ----------------------------------------------------------------------------- SSD


def ssd_kernel_runs(chunk_size: int, head_dim: int, state_size: int, backend: str) -> bool:
    """Whether the SSD kernel for platform `backend` ('gpu' or 'tpu'; anything else is
    False) takes this geometry. 'gpu' also needs a process whose GPUs are all sm80+ (or
    none, for the interpreter). The geometry rule is pallasite's ssd_kernel_runs."""
    if backend not in SSD_BACKENDS or (backend == "gpu" and not _triton_compiles()):
        return False
    return pallasite_ssd.ssd_kernel_runs(chunk_size, head_dim, state_size,
                                         SSD_BACKENDS[backend])


def ssd_kernel_platform(chunk_size: int, head_dim: int, state_size: int) -> str | None:
    """The platform ('gpu', 'tpu') to build this scan's kernel for, or None for the XLA
    path: the default backend, where its kernel takes the geometry and pallasite admits it
    by default."""
    backend = jax.default_backend()
    if not ssd_kernel_runs(chunk_size, head_dim, state_size, backend):
        return None
    if pallasite_ssd.ssd_kernel_platform(chunk_size, head_dim, state_size) is None:
        return None
    return backend


def _interpreting(platform: str) -> bool:
    """No device of `platform` in the process: the kernel runs Pallas's interpreter."""
    return all(d.platform != platform for d in _devices())


def _batch_major(t):
    """[chunks, batch, chunk, heads, width] -> [batch, chunks, chunk, heads, width]."""
    return jnp.swapaxes(t, 0, 1)


def _scan(x_c, b_c, c_c, a_c, state, platform):
    if platform not in SSD_BACKENDS:
        raise ValueError(f"platform must be one of {sorted(SSD_BACKENDS)} (a JAX platform "
                         f"name); got {platform!r}")
    if a_c.ndim != 4:
        raise ValueError(f"a_c must be [chunks, batch, heads, chunk]; got shape {a_c.shape}")
    a = jnp.transpose(a_c, (1, 0, 3, 2))  # -> [batch, chunks, chunk, heads]
    y, final = pallasite_ssd.ssd_chunk_scan(
        _batch_major(x_c), a, _batch_major(b_c), _batch_major(c_c), state,
        (SSD_BACKENDS[platform], _interpreting(platform)))
    return _batch_major(y).astype(jnp.float32), final.astype(jnp.float32)


def _scan_fwd(x_c, b_c, c_c, a_c, state, platform):
    out, pullback = jax.vjp(lambda *t: _scan(*t, platform), x_c, b_c, c_c, a_c, state)
    return out, pullback


def _scan_bwd(platform, pullback, cotangents):
    del platform
    return pullback(cotangents)


def _ssd_chunk_scan(
    x_c: Float[Array, "nc b C h p"],
    b_c: Float[Array, "nc b C h n"],
    c_c: Float[Array, "nc b C h n"],
    a_c: Float[Array, "nc b h C"],
    state: Float[Array, "b h p n"],
    platform: str,
) -> tuple[Float[Array, "nc b C h p"], Float[Array, "b h p n"]]:
    """(y [chunks, batch, chunk, heads, head_dim] fp32, final state [batch, heads,
    head_dim, state] fp32) of the chunked SSD scan on pallasite's kernel for `platform`
    ('gpu': Pallas Triton, 'tpu': Mosaic TPU; interpreted without such a device). x_c
    carries dt; a_c is the per-step A*dt. Differentiable (pallasite's hand-written
    backward); `platform` is not."""
    return _scan(x_c, b_c, c_c, a_c, state, platform)


ssd_chunk_scan = jax.custom_vjp(_ssd_chunk_scan, nondiff_argnums=(5,))
ssd_chunk_scan.defvjp(_scan_fwd, _scan_bwd)


# ------------------------------------------------------------------ grouped projection


def ragged_dot_runs(compute: Dtype, operands: Sequence[Dtype], precision: PrecisionLike) -> bool:
    """Whether the grouped kernels compute the product asked for: no x64; compute and
    operand dtypes (dtypes, not arrays) promote with fp32 to fp32; 16-bit compute at any
    precision, fp32 compute at the default precision only."""
    if jnp.result_type(compute, *operands, jnp.float32) != jnp.dtype(jnp.float32):
        return False
    return grouped_predicates.ragged_dot_runs(compute, (), precision)


def grouped_projection(
    x: Float[Array, "m k"],
    kernel: Float[Array, "g k n"],
    group_sizes: Int[Array, "g"],
    compute: Dtype,
    interpret_on_cpu: bool,
) -> Float[Array, "m n"]:
    """pallasite.kernels.grouped_projection with group sizes of any integer dtype (cast to
    int32, as dew does): [m, n] in `compute`, fp32 sums rounded once, differentiable in x
    and kernel. Concrete sizes int32 cannot hold are refused before the cast (it would
    wrap them); traced ones are cast as they are."""
    # hasattr, not getattr with a default: the default would be evaluated eagerly, and
    # np.asarray of a tracer (group sizes under jit) raises.
    dtype = np.dtype(group_sizes.dtype if hasattr(group_sizes, "dtype")
                     else np.asarray(group_sizes).dtype)
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"group_sizes must be integers; got {dtype} "
                        f"(shape {tuple(np.shape(group_sizes))})")
    _check_int32_holds(group_sizes, dtype)
    return grouped_matmul.grouped_projection(x, kernel, jnp.asarray(group_sizes, jnp.int32),
                                             compute, interpret_on_cpu)


def _check_int32_holds(group_sizes, dtype: np.dtype) -> None:
    """ValueError showing the given values where concrete group sizes lie outside int32
    (the cast would wrap 2**32 + 16 to 16, a uint32 4e9 to a negative)."""
    if isinstance(group_sizes, jax.core.Tracer):
        return
    values = np.asarray(group_sizes)
    limits = np.iinfo(np.int32)
    if values.size and (values.min() < limits.min or values.max() > limits.max):
        raise ValueError(f"group_sizes must fit int32; got {values.tolist()} ({dtype}, "
                         f"shape {values.shape})")
