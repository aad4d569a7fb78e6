"""The SSD scan's public functions: `ssd_chunk_scan` (custom_vjp) and `chunk_ssd`.

`ssd_chunk_scan(x, a, b, c, initial_state, platform)` works in the chunked layout of the
backends' contract (see pallasite.kernels.ssd.xla) and differentiates by the backend's own
hand-written backward: the forward saves the inputs and each chunk's entry state, nothing
of the [C, C] work. `platform` names the backend ("xla", "pallas_mosaic_tpu",
"pallas_triton"), or is a (name, interpret) pair or (name, interpret, block_sizes) triple;
by default a Pallas backend interprets when JAX's default backend is the CPU.

Every backend (XLA included) runs through `pallasite.kernels.sharding.run` with the
planners of `layouts`: inside a caller's shard_map on the local arrays; under jit over
sharded arrays with batch and heads (with their B/C groups) local on whatever mesh axes
shard them, the sequence local because the scan carries state across it. Cotangents take
their primal's type (summed over the manual axes they vary over and it does not).

`chunk_ssd` is the [batch, length, heads, ...] form: it validates, pads the length to a
multiple of the chunk (a = 0, x = B = C = 0 steps leave the state unchanged and their
outputs are cut off; a test proves both), and picks the implementation.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from pallasite.kernels import autodiff, sharding
from pallasite.kernels.ssd import context_parallel, decay, layouts, predicates
from pallasite.reference.ssd import ssd_chunk_scan_reference, validate_ssd, validate_ssd_chunked

_LOG = logging.getLogger("pallasite.ssd")

IMPLEMENTATIONS = ("xla",) + predicates.BACKENDS
_FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
# The backends whose CPU interpreter runs the kernel through host callbacks (Mosaic TPU's;
# Triton's does not), which JAX cannot differentiate inside jax.checkpoint.
CALLBACK_INTERPRETERS = ("pallas_mosaic_tpu",)


# ------------------------------------------------------------------------- validation


def check_chunked(x, a, b, c, initial_state) -> None:
    """Shapes and dtypes of the chunked layout (the reference's checks, one set for both)."""
    validate_ssd_chunked(x, a, b, c, initial_state)
    _check_kernel_dtypes(x=x, a=a, b=b, c=c, initial_state=initial_state)


def check_sequence(x, a, b, c, initial_state, chunk_size) -> None:
    """chunk_ssd's [batch, length, heads, ...] layout; the length need not divide (padded)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"chunk_size must be an int; got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    validate_ssd(x, a, b, c, initial_state)
    _check_kernel_dtypes(x=x, a=a, b=b, c=c, initial_state=initial_state)


def _check_kernel_dtypes(**arrays):
    """The reference takes any floating dtype; the backends only these four."""
    for name, array in arrays.items():
        if array is not None and array.dtype not in [np.dtype(d) for d in _FLOATS]:
            raise TypeError(f"{name} has dtype {array.dtype} (shape {tuple(array.shape)}); "
                            "expected bfloat16, float16, float32 or float64")


# ---------------------------------------------------------------------- backends, mesh


def _backend(name: str):
    """The backend module, imported on first use (a GPU-less install never loads Triton)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown SSD implementation {name!r}; known: {IMPLEMENTATIONS}")
    return importlib.import_module(f"pallasite.kernels.ssd.{name}")


def _platform(platform) -> tuple[str, bool]:
    """(backend name, interpret?) from a name, a (name, interpret) pair or a
    (name, interpret, block_sizes) triple."""
    if isinstance(platform, tuple):
        return platform[:2]
    return platform, platform != "xla" and jax.default_backend() == "cpu"


def _local(platform, pass_name):
    """The backend's forward or backward on local arrays (with the platform's block sizes,
    where it names them)."""
    name, interpret = _platform(platform)
    fn = getattr(_backend(name), pass_name)
    if name == "xla":
        return fn
    blocks = platform[2] if isinstance(platform, tuple) and len(platform) > 2 else None
    return functools.partial(fn, interpret=interpret, block_sizes=blocks)


def _run_options(platform) -> dict:
    return sharding.backend_options(*_platform(platform))


def _empty(x, b) -> bool:
    """Whether the scan has nothing to compute (a zero-size batch, chunk count, chunk,
    head count or width): the XLA path returns its zeros (and the initial state as the
    final one) without launching a kernel on an empty grid."""
    return x.size == 0 or b.size == 0


def _blocks_owner(block_sizes) -> str:
    """The backend whose BlockSizes class `block_sizes` is (TypeError for anything else)."""
    module = type(block_sizes).__module__
    owner = module.rpartition(".")[2]
    if not module.startswith("pallasite.kernels.ssd.") or owner not in predicates.BACKENDS:
        raise TypeError("block_sizes must be an SSD backend's BlockSizes (pallas_triton."
                        f"BlockSizes or pallas_mosaic_tpu.BlockSizes); got {block_sizes!r}")
    return owner


def _with_blocks(name: str, block_sizes):
    """ssd_chunk_scan's platform for backend `name`: the name, or (name, interpret,
    block_sizes) where the blocks are that backend's (another backend keeps its own)."""
    if block_sizes is None or _blocks_owner(block_sizes) != name:
        return name
    return (*_platform(name), block_sizes)


def _forward(platform, x, a, b, c, initial_state, sequence_axes=()):
    if sequence_axes:  # a caller's shard_map splits the sequence: the exchange here
        return context_parallel.split_forward(
            functools.partial(_forward, platform), sequence_axes)(x, a, b, c, initial_state)
    if _empty(x, b):
        platform = "xla"
    planner = layouts.forward_planner(_local(platform, "forward"), x.shape, b.shape[3])
    return sharding.run(planner, (x, a, b, c, initial_state), rule=layouts.FORWARD_RULE,
                        **_run_options(platform))


def _backward(platform, x, a, b, c, chunk_states, dy, dfinal, sequence_axes=()):
    if sequence_axes:
        return context_parallel.split_backward(
            functools.partial(_backward, platform), sequence_axes)(
                x, a, b, c, chunk_states, dy, dfinal)
    if _empty(x, b):
        platform = "xla"
    planner = layouts.backward_planner(_local(platform, "backward"), x.shape, b.shape[3])
    return sharding.run(planner, (x, a, b, c, chunk_states, dy, dfinal),
                        rule=layouts.BACKWARD_RULE, **_run_options(platform))


# ------------------------------------------------------------------------ custom_vjp


def _scan(
    x: Float[Array, "b nc C h p"],
    a: Float[Array, "b nc C h"],
    b: Float[Array, "b nc C g n"],
    c: Float[Array, "b nc C g n"],
    initial_state: Float[Array, "b h p n"],
    platform: str | tuple[str, bool],
    sequence_axes: tuple[str, ...] = (),
) -> tuple[Float[Array, "b nc C h p"], Float[Array, "b h p n"]]:
    check_chunked(x, a, b, c, initial_state)
    y, final, _ = _forward(platform, x, a, b, c, initial_state, sequence_axes)
    return y, final


def _scan_fwd(x, a, b, c, initial_state, platform, sequence_axes=()):
    check_chunked(x, a, b, c, initial_state)
    y, final, chunk_states = _forward(platform, x, a, b, c, initial_state, sequence_axes)
    # initial_state rides along for its dtype and type (varying axes, layout): its
    # cotangent must match it. [b, h, p, n] is 1/nc of chunk_states.
    return (y, final), (x, a, b, c, chunk_states, initial_state)


def summed_in_fp32(x, b, c):
    """(b, c), in fp32 where they are replicated where x varies (a shard_map): dB and dC
    are then summed over those axes in fp32 (the backends compute from the matmul dtype
    either way, so only the sum changes)."""
    if sharding.needs_sum((x,), b) or sharding.needs_sum((x,), c):
        return b.astype(jnp.float32), c.astype(jnp.float32)
    return b, c


def _scan_bwd(platform, sequence_axes, residuals, cotangents):
    x, a, b, c, chunk_states, initial_state = residuals
    dy, dfinal = cotangents
    grads = _backward(platform, x, a, *summed_in_fp32(x, b, c), chunk_states,
                      dy.astype(x.dtype), dfinal.astype(jnp.float32), sequence_axes)
    return sharding.cotangents_like(grads, residuals[:4] + (initial_state,))


ssd_chunk_scan = jax.custom_vjp(_scan, nondiff_argnums=(5, 6))
ssd_chunk_scan.defvjp(_scan_fwd, _scan_bwd)
ssd_chunk_scan.__doc__ = """(y [b,nc,C,h,p] in x.dtype, final_state [b,h,p,n] fp32).

Chunked layout: x [b, nc, C, h, p], a [b, nc, C, h], b and c [b, nc, C, g, n],
initial_state [b, h, p, n]; `platform` is a backend name or (name, interpret).
`sequence_axes`: inside a shard_map, the manual axes the chunks are split over, in
order (context_parallel.py); () when each device holds whole sequences.
Positive `a` (growth) is accepted: see docs/ssd.md.
"""


# -------------------------------------------------------------------------- chunk_ssd


def _candidates(implementation, chunk_size, head_dim, state_size) -> list[str]:
    """The implementations to try, in order (DESIGN: name, sequence, or None)."""
    if implementation is None:
        kernel = predicates.ssd_kernel_platform(chunk_size, head_dim, state_size)
        return [kernel, "xla"] if kernel else ["xla"]
    names = [implementation] if isinstance(implementation, str) else list(implementation)
    if not names:
        raise ValueError("implementation is an empty sequence")
    for name in names:
        if name not in IMPLEMENTATIONS:
            raise ValueError(f"unknown SSD implementation {name!r}; known: {IMPLEMENTATIONS}")
    return names


def _refusal(name, chunk_size, head_dim, state_size, dtypes=None) -> str | None:
    """Why `name` cannot run this geometry on this device, or None: the geometry rule
    (predicates), then the backend's own check of the device and of the operands' dtypes
    ({what: dtype}; its module's `refusal`)."""
    if name == "xla":
        return None
    reason = predicates.ssd_kernel_reason(chunk_size, head_dim, state_size, name)
    if reason:
        return reason
    interpreted = _platform(name)[1]
    if interpreted and name in CALLBACK_INTERPRETERS and autodiff.differentiated_checkpoint():
        return autodiff.checkpoint_refusal("chunk_ssd", name)
    return _backend(name).refusal(jax.default_backend(), dtypes or {})


def _pad(t, length, padded):
    if padded == length:
        return t
    widths = [(0, 0)] * t.ndim
    widths[1] = (0, padded - length)
    return jnp.pad(t, widths)


def chunked_sequence(t, chunk_size: int, split: bool):
    """t [b, l, ...] as [b, nc, chunk_size, ...], the last chunk zero-padded: taken whole
    along the sequence first unless it stays `split` (_sequence_stays_split)."""
    length = t.shape[1]
    nc = -(-length // chunk_size)
    t = t if split else sharding.whole_along(t, (1,))
    return _pad(t, length, nc * chunk_size).reshape(t.shape[0], nc, chunk_size, *t.shape[2:])


def _unchunked(y, x, split: bool = False):
    """y [b, nc, C, h, p] as x's [b, length, h, p], in x's layout where its axes are
    explicit: the chunk axes whole first, so the merge and the cut of the padding never
    meet a layout split across them; or, where the sequence stayed split in runs of
    whole chunks (no padding), merged as it is."""
    bsz, nc, chunk, h, p = y.shape
    if not split:
        y = sharding.whole_along(y, (1, 2), like=x)
    y = y.reshape(bsz, nc * chunk, h, p)
    return sharding.layout_like(y[:, :x.shape[1]], jax.typeof(x).sharding)


def _sequence_stays_split(x, nc: int, whole_chunks: bool) -> bool:
    """Whether x's sequence split (if any) can stay split through the chunked scan: the
    length a whole number of chunks and the chunk count divisible by the shards. Explicit
    axes: x's own sequence axes. Auto axes: every axis of the mesh in context (the
    partitioner picks the split, any part of the mesh). Where a split sequence cannot
    stay split it is gathered, and the log says so."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        layout = jax.typeof(x).sharding
        mesh = layout.mesh if layout is not None else mesh
    if mesh.empty or mesh.manual_axes and not mesh.explicit_axes:
        return False
    if mesh.explicit_axes:
        axes = sharding.explicit_dims(x)[1]
        shards = sharding.size(axes, dict(zip(mesh.axis_names, mesh.axis_sizes)))
        if shards == 1:
            return False
        ok = whole_chunks and nc % shards == 0
        if not ok:
            _LOG.info("chunk_ssd: the sequence split over %s (%d shards) is not in runs of "
                      "whole chunks (%d chunks%s); it is gathered", axes, shards, nc,
                      "" if whole_chunks else ", the last one padded")
        return ok
    return whole_chunks and nc % int(np.prod(mesh.axis_sizes)) == 0


def _plain(x, a, b, c, initial_state):
    """The chunked scan in plain JAX (the reference's), which JAX differentiates in any
    mode and to any order; resets clamped as every backend clamps them (ssd.decay)."""
    return ssd_chunk_scan_reference(x, decay.clamp_resets(a).astype(a.dtype), b, c,
                                    initial_state)


def chunk_ssd(
    x: Float[Array, "batch length heads head_dim"],
    a: Float[Array, "batch length heads"],
    b: Float[Array, "batch length groups state"],
    c: Float[Array, "batch length groups state"],
    *,
    chunk_size: int = 256,
    initial_state: Float[Array, "batch heads head_dim state"] | None = None,
    implementation: str | Sequence[str] | None = None,
    block_sizes=None,
    sequence_axes: str | Sequence[str] | None = None,
) -> tuple[Float[Array, "batch length heads head_dim"], Float[Array, "batch heads head_dim state"]]:
    """(y [batch, length, heads, head_dim] in x.dtype, final_state fp32).

    The sequence split over devices: under jit, a sequence laid out over mesh axes in
    runs of whole chunks is scanned where it lies, the devices passing only state-sized
    arrays (context parallelism); any other split is gathered (logged). Inside a
    shard_map, name the manual axes the local arrays' sequence is split over, in order,
    as `sequence_axes` (each device's part may have any length; the final state and the
    initial state's gradient are then the whole sequence's on every device). Without
    it, each device's arrays are whole sequences.

    implementation: one name (refused geometry or device -> ValueError at once; an error
    while it runs is raised as it is), a sequence (tried in order, each fallback logged,
    all failures raised together), or None (ssd_kernel_platform's choice, then "xla").
    block_sizes: a backend's BlockSizes (pallas_triton.BlockSizes, pallas_mosaic_tpu.
    BlockSizes), used by that backend in place of its tuned table and default; other
    backends, and the XLA path, ignore it. None: the backend's own choice.
    Differentiation: first-order reverse mode (jax.grad, jax.vjp) through the chosen
    backend; forward mode (jax.jvp) and higher orders take a plain-JAX form of the scan
    where "xla" is among the implementations (the default), and otherwise stop with an
    error that says so.
    """
    if block_sizes is not None:
        _blocks_owner(block_sizes)  # a wrong type fails here, before any kernel
    check_sequence(x, a, b, c, initial_state, chunk_size)
    sequence_axes = sharding.sequence_axes_in_context(sequence_axes)
    bsz, length, h, p = x.shape
    g, n = b.shape[-2:]
    if initial_state is None:
        initial_state = jnp.zeros((bsz, h, p, n), jnp.float32)
    names = _candidates(implementation, chunk_size, p, n)
    nc = -(-length // chunk_size)
    padded = nc * chunk_size
    # A sequence split over devices in runs of whole chunks stays split (each device
    # scans its chunks from the state the others pass it: context_parallel.py); any other
    # split is taken whole before it is cut into chunks (docs/sharding.md).
    why = autodiff.beyond_first_order(x, a, b, c, initial_state)
    split = why is None and (bool(sequence_axes)
                             or _sequence_stays_split(x, nc, padded == length))
    chunked = [chunked_sequence(t, chunk_size, split) for t in (x, a, b, c)]
    if why is not None:  # the custom_vjp is first-order reverse mode only
        if "xla" not in names:
            raise autodiff.first_order_error("chunk_ssd", ", ".join(names), why, "xla")
        if sequence_axes:
            raise NotImplementedError(
                f"chunk_ssd: sequence_axes={sequence_axes} runs in first-order reverse mode "
                f"(jax.grad, jax.vjp) only; {why} would need the plain-JAX scan, which "
                "does not pass states between devices")
        y, final = _plain(*chunked, initial_state)  # a split sequence taken whole above
        return _unchunked(y, x), final
    failures = []
    for name in names:
        reason = _refusal(name, chunk_size, p, n, {"x": x.dtype, "b": b.dtype, "c": c.dtype})
        if reason is None:
            try:
                y, final = ssd_chunk_scan(*chunked, initial_state,
                                          _with_blocks(name, block_sizes), sequence_axes)
                return _unchunked(y, x, split), final
            except Exception as error:  # noqa: BLE001 - try the next, raise all at the end
                if len(names) == 1:
                    raise  # one backend: its own error, not a summary of one
                reason = f"{type(error).__name__}: {error}"
        failures.append(f"{name}: {reason}")
        if len(names) > 1:
            _LOG.warning("chunk_ssd: %s failed (%s); trying the next implementation",
                         name, reason)
    raise ValueError("chunk_ssd: no implementation ran:\n  " + "\n  ".join(failures))
