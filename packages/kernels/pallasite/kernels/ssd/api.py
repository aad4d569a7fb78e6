"""The SSD scan's public functions: `ssd_chunk_scan` (custom_vjp) and `chunk_ssd`.

`ssd_chunk_scan(x, a, b, c, initial_state, platform)` works in the chunked layout of the
backends' contract (see pallasite.kernels.ssd.xla) and differentiates by the backend's own
hand-written backward: the forward saves the inputs and each chunk's entry state, nothing
of the [C, C] work. `platform` names the backend ("xla", "pallas_mosaic_tpu",
"pallas_triton"), or is a (name, interpret) pair; by default a Pallas backend interprets
when JAX's default backend is the CPU.

Every Pallas backend call runs inside an explicit jax.shard_map (here, or inside the backend
where it says SHARDS_ITSELF, as pallas_triton does): batch over the mesh's
"data" axis, heads over its "model" axis, the sequence (chunks) local because the scan
carries state across it. The mesh is the one in context (jax.set_mesh), else a one-device
mesh. An axis is used only where it divides the dimension (and, for heads, where B/C's
groups split with them or there is a single group); dB and dC of a replicated single group
are summed over the model axis.

`chunk_ssd` is the [batch, length, heads, ...] form: it validates, pads the length to a
multiple of the chunk (a = 0, x = B = C = 0 steps leave the state unchanged and their
outputs are cut off; a test proves both), and picks the implementation.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from pallasite.kernels.ssd import predicates
from pallasite.reference.ssd import validate_ssd, validate_ssd_chunked

_LOG = logging.getLogger("pallasite.ssd")

IMPLEMENTATIONS = ("xla",) + predicates.BACKENDS
DATA_AXIS, MODEL_AXIS = "data", "model"
_FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


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
    """(backend name, interpret?) from a name or a (name, interpret) pair."""
    if isinstance(platform, tuple):
        return platform
    return platform, platform != "xla" and jax.default_backend() == "cpu"


def _mesh():
    """The mesh in context, else one device, with the sizes of its data and model axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        devices = np.array(jax.devices()[:1]).reshape(1, 1)
        mesh = jax.sharding.Mesh(devices, (DATA_AXIS, MODEL_AXIS))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return mesh, sizes.get(DATA_AXIS), sizes.get(MODEL_AXIS)


def _axes(mesh_sizes, bsz, heads, groups):
    """Mesh axes for (batch, heads, groups): each only where it divides the dimension."""
    data, model = mesh_sizes
    batch_ax = DATA_AXIS if data and bsz % data == 0 else None
    head_ax = MODEL_AXIS if model and heads % model == 0 and (
        groups == 1 or groups % model == 0) else None
    group_ax = head_ax if head_ax and groups % model == 0 else None
    return batch_ax, head_ax, group_ax


def _shards_itself(name, module) -> bool:
    """XLA partitions itself; a backend that wraps its own shard_map says SHARDS_ITSELF
    (pallas_triton shards the batch inside its forward/backward): no nested shard_map."""
    return name == "xla" or getattr(module, "SHARDS_ITSELF", name == "pallas_triton")


def _forward(platform, x, a, b, c, initial_state):
    name, interpret = _platform(platform)
    module = _backend(name)
    if _shards_itself(name, module):
        kwargs = {} if name == "xla" else {"interpret": interpret}
        return module.forward(x, a, b, c, initial_state, **kwargs)
    mesh, *sizes = _mesh()
    bt, hd, gr = _axes(sizes, x.shape[0], x.shape[3], b.shape[3])
    xs, as_, bs, ss = P(bt, None, None, hd, None), P(bt, None, None, hd), \
        P(bt, None, None, gr, None), P(bt, hd, None, None)

    def local(*args):
        return module.forward(*args, interpret=interpret)

    return jax.shard_map(local, mesh=mesh, in_specs=(xs, as_, bs, bs, ss),
                         out_specs=(xs, ss, P(bt, None, hd, None, None)),
                         check_vma=False)(x, a, b, c, initial_state)


def _backward(platform, x, a, b, c, chunk_states, dy, dfinal):
    name, interpret = _platform(platform)
    module = _backend(name)
    if _shards_itself(name, module):
        kwargs = {} if name == "xla" else {"interpret": interpret}
        return module.backward(x, a, b, c, chunk_states, dy, dfinal, **kwargs)
    mesh, *sizes = _mesh()
    bt, hd, gr = _axes(sizes, x.shape[0], x.shape[3], b.shape[3])
    xs, as_, bs, ss = P(bt, None, None, hd, None), P(bt, None, None, hd), \
        P(bt, None, None, gr, None), P(bt, hd, None, None)
    cs = P(bt, None, hd, None, None)

    def local(*args):
        dx, da, db, dc, dinit = module.backward(*args, interpret=interpret)
        if hd is not None and gr is None:  # one group, replicated: sum over head shards
            db, dc = jax.lax.psum((db, dc), MODEL_AXIS)
        return dx, da, db, dc, dinit

    return jax.shard_map(local, mesh=mesh, in_specs=(xs, as_, bs, bs, cs, xs, ss),
                         out_specs=(xs, as_, bs, bs, ss),
                         check_vma=False)(x, a, b, c, chunk_states, dy, dfinal)


# ------------------------------------------------------------------------ custom_vjp


def _scan(
    x: Float[Array, "b nc C h p"],
    a: Float[Array, "b nc C h"],
    b: Float[Array, "b nc C g n"],
    c: Float[Array, "b nc C g n"],
    initial_state: Float[Array, "b h p n"],
    platform: str | tuple[str, bool],
) -> tuple[Float[Array, "b nc C h p"], Float[Array, "b h p n"]]:
    check_chunked(x, a, b, c, initial_state)
    y, final, _ = _forward(platform, x, a, b, c, initial_state)
    return y, final


def _scan_fwd(x, a, b, c, initial_state, platform):
    check_chunked(x, a, b, c, initial_state)
    y, final, chunk_states = _forward(platform, x, a, b, c, initial_state)
    dtype_token = jnp.zeros((0,), initial_state.dtype)
    return (y, final), (x, a, b, c, chunk_states, dtype_token)


def _scan_bwd(platform, residuals, cotangents):
    x, a, b, c, chunk_states, dtype_token = residuals
    dy, dfinal = cotangents
    dx, da, db, dc, dinit = _backward(platform, x, a, b, c, chunk_states,
                                      dy.astype(x.dtype), dfinal.astype(jnp.float32))
    return dx, da, db, dc, dinit.astype(dtype_token.dtype)


ssd_chunk_scan = jax.custom_vjp(_scan, nondiff_argnums=(5,))
ssd_chunk_scan.defvjp(_scan_fwd, _scan_bwd)
ssd_chunk_scan.__doc__ = """(y [b,nc,C,h,p] in x.dtype, final_state [b,h,p,n] fp32).

Chunked layout: x [b, nc, C, h, p], a [b, nc, C, h], b and c [b, nc, C, g, n],
initial_state [b, h, p, n]; `platform` is a backend name or (name, interpret).
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


def _refusal(name, chunk_size, head_dim, state_size) -> str | None:
    """Why `name` cannot run this geometry on this device, or None."""
    if name == "xla":
        return None
    reason = predicates.ssd_kernel_reason(chunk_size, head_dim, state_size, name)
    if reason:
        return reason
    device = jax.default_backend()
    runs_on = {"pallas_mosaic_tpu": ("tpu", "cpu"), "pallas_triton": ("gpu", "cuda", "cpu")}
    if device not in runs_on[name]:
        return f"{name} does not run on {device} (runs on {runs_on[name]}, cpu interpreted)"
    return None


def _pad(t, length, padded):
    if padded == length:
        return t
    widths = [(0, 0)] * t.ndim
    widths[1] = (0, padded - length)
    return jnp.pad(t, widths)


def chunk_ssd(
    x: Float[Array, "batch length heads head_dim"],
    a: Float[Array, "batch length heads"],
    b: Float[Array, "batch length groups state"],
    c: Float[Array, "batch length groups state"],
    *,
    chunk_size: int = 256,
    initial_state: Float[Array, "batch heads head_dim state"] | None = None,
    implementation: str | Sequence[str] | None = None,
) -> tuple[Float[Array, "batch length heads head_dim"], Float[Array, "batch heads head_dim state"]]:
    """(y [batch, length, heads, head_dim] in x.dtype, final_state fp32).

    implementation: one name (refused geometry or device -> ValueError at once), a
    sequence (tried in order, each fallback logged, all failures raised together), or None
    (ssd_kernel_platform's choice, then "xla").
    """
    check_sequence(x, a, b, c, initial_state, chunk_size)
    bsz, length, h, p = x.shape
    g, n = b.shape[-2:]
    if initial_state is None:
        initial_state = jnp.zeros((bsz, h, p, n), jnp.float32)
    names = _candidates(implementation, chunk_size, p, n)
    nc = -(-length // chunk_size)
    padded = nc * chunk_size
    chunked = [_pad(t, length, padded).reshape(bsz, nc, chunk_size, *t.shape[2:])
               for t in (x, a, b, c)]
    failures = []
    for name in names:
        reason = _refusal(name, chunk_size, p, n)
        if reason is None:
            try:
                y, final = ssd_chunk_scan(*chunked, initial_state, name)
                return y.reshape(bsz, padded, h, p)[:, :length], final
            except Exception as error:  # noqa: BLE001 - try the next, raise all at the end
                reason = f"{type(error).__name__}: {error}"
        failures.append(f"{name}: {reason}")
        if len(names) > 1:
            _LOG.warning("chunk_ssd: %s failed (%s); trying the next implementation",
                         name, reason)
    raise ValueError("chunk_ssd: no implementation ran:\n  " + "\n  ".join(failures))
