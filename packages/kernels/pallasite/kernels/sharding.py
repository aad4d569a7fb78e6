"""How a pallasite kernel runs on sharded arrays: one mechanism for every op and backend.

JAX's SPMD is the distributed engine; pallasite adds no device logic of its own. A
pallas_call is a custom call with no partitioning rule: left to XLA's partitioner under a
multi-device jit it would gather every operand and compute the whole product on every
device. So each kernel call (the forward and each backward product) goes through `run`
with a *planner*: a pure function from the mesh axes that shard each operand dimension to
a `Plan` (the layouts the op can use locally, and a local function over the shards that
may use `jax.lax.axis_index` and `psum` on the plan's axes). `run` applies the plan in the
one of three ways the calling context allows:

1. Inside the caller's shard_map with every mesh axis manual (or the rest Auto): the
   arrays are already local. The planner sees nothing sharded and the local function runs
   on them directly: no nested shard_map over manual axes. Under check_vma the operands
   are first cast to vary over the union of their varying axes (`vary_together`), so the
   kernels, scans and outputs agree on one type.
2. Explicit mesh axes in context (`jax.set_mesh`, `jax.make_mesh`'s default): the layouts
   are in the types (`jax.typeof(x).sharding`). Operands whose layout the plan does not
   take are resharded (`jax.sharding.reshard`), then one `jax.shard_map` over the
   explicit axes runs the local function.
3. Auto axes, with or without a mesh in context: only the compiler knows the layouts, so
   the call is a `jax.experimental.custom_partitioning` with a Shardy sharding rule; its
   partition callback runs the same planner on the shardings the partitioner chose and
   returns the local function as the per-device program. Without a mesh, on one device,
   the custom call lowers to the plain function.

The differentiation rules call `cotangent_like` on each cotangent: under check_vma a
cotangent that varies over axes its primal did not is summed over them (the transpose of
the implicit broadcast, as jax.grad does for jnp.dot), and under Explicit axes it is
resharded to its primal's layout, as custom_vjp requires.

So every kernel runs in a shard_map (pallasite's or the caller's) or, under Auto axes, in
a custom_partitioning's per-device program: a shard_map cannot be built there, since its
layouts are needed when it is traced and only the compiler knows them (docs/sharding.md,
"Kernel boundaries"). The backends' kernel wrappers that `run` calls are marked
`local_operands`: called directly on an array laid out over explicit mesh axes, they
refuse it by name instead of letting JAX gather it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]  # the mesh axes that shard one dimension, major to minor
Dims = tuple[Axes, ...]  # one Axes per dimension of an array


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a planner decided: the layout of each operand and result (one Axes per
    dimension, () for replicated) and the function that runs on the local shards.

    out_like: where a result should end up when the plan had to narrow it (say heads
    taken replicated because B/C's groups do not split with them): under Explicit axes
    the result is resharded there, so it keeps its inputs' layout. None: out_dims."""

    in_dims: tuple[Dims, ...]
    out_dims: tuple[Dims, ...]
    local: Callable[..., tuple]
    out_like: tuple[Dims, ...] | None = None


# A planner: (operand dims as given, mesh axis sizes) -> Plan. It may only narrow the
# layouts it is given (drop axes), never invent new ones, so resharding is a slice or a
# gather and never moves data between unrelated devices.
Planner = Callable[[tuple[Dims, ...], Mapping[str, int]], Plan]


# ----------------------------------------------------------------------- layouts


def dims_of(spec, ndim: int) -> Dims:
    """A PartitionSpec (or None) as one Axes per dimension."""
    entries = tuple(spec) if spec is not None else ()
    out = []
    for i in range(ndim):
        entry = entries[i] if i < len(entries) else None
        if entry is None or entry is P.UNCONSTRAINED:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return tuple(out)


def spec_of(dims: Dims) -> P:
    """The PartitionSpec of one Axes per dimension."""
    return P(*(None if not a else a[0] if len(a) == 1 else a for a in dims))


def replicated(ndim: int) -> Dims:
    return ((),) * ndim


def size(axes: Axes, axis_sizes: Mapping[str, int]) -> int:
    """How many shards `axes` cut a dimension into."""
    out = 1
    for a in axes:
        out *= axis_sizes[a]
    return out


def fits(axes: Axes, dim: int, axis_sizes: Mapping[str, int]) -> Axes:
    """`axes` where they divide `dim` evenly, else () (that dimension is replicated)."""
    return axes if axes and dim % size(axes, axis_sizes) == 0 else ()


def _axes_tuple(sequence_axes) -> tuple:
    return (sequence_axes,) if isinstance(sequence_axes, str) else tuple(sequence_axes)


def sequence_axes_in_context(sequence_axes, *, auto_too: bool = False) -> tuple[str, ...]:
    """An op's `sequence_axes` argument as a tuple of manual mesh axes of the shard_map
    in context (the axes a caller's shard_map splits the sequence over); () for None.
    auto_too: the op also takes Auto axes of a jit's mesh (`auto_sequence_axes`), and
    the error says so."""
    if sequence_axes is None:
        return ()
    axes = _axes_tuple(sequence_axes)
    mesh = jax.sharding.get_abstract_mesh()
    manual = mesh.manual_axes
    missing = [a for a in axes if not isinstance(a, str) or a not in manual]
    if not axes or missing:
        also = (f", or under jit the Auto axes of the mesh in context (jax.set_mesh; Auto "
                f"here: {tuple(mesh.auto_axes)})" if auto_too else "")
        raise ValueError(f"sequence_axes={sequence_axes!r}: name the manual axes of the "
                         f"shard_map in context that split the sequence (manual here: "
                         f"{tuple(manual)}){also}")
    return axes


def auto_sequence_axes(sequence_axes) -> tuple[str, ...]:
    """`sequence_axes` as a tuple where, under jit, every one is an Auto axis of the mesh
    in context (not a shard_map's manual axis): the axes an op is asked to split its
    sequence over itself. () otherwise (None, or axes for sequence_axes_in_context)."""
    if sequence_axes is None:
        return ()
    axes = _axes_tuple(sequence_axes)
    auto = jax.sharding.get_abstract_mesh().auto_axes
    return axes if axes and all(isinstance(a, str) and a in auto for a in axes) else ()


def shard_index(axes: Axes):
    """This shard's index along a dimension split over `axes` (0 when unsplit)."""
    return jax.lax.axis_index(axes) if axes else jnp.int32(0)


def psum_f32(value, axes: Axes, dtype):
    """`value` (fp32 partial sums) summed over `axes` and rounded once to `dtype`."""
    if axes:
        value = jax.lax.psum(value, axes)
    return value.astype(dtype)


# ---------------------------------------------------------------- varying types


def _mat(x):
    return getattr(jax.typeof(x), "mat", None)


def varying_axes(x) -> frozenset:
    """The manual axes `x` varies over (empty outside shard_map or without check_vma)."""
    mat = _mat(x)
    return frozenset(mat.varying) if mat is not None else frozenset()


def varying_union(values) -> frozenset:
    """The manual axes any of `values` varies over (None entries ignored)."""
    return frozenset().union(*(varying_axes(v) for v in values if v is not None))


def needs_sum(sources, primal) -> bool:
    """Whether a cotangent computed from `sources` varies over a manual axis its primal
    does not, so that `cotangent_like` will still sum it (compute it in fp32 then)."""
    return bool(varying_union(sources) - varying_axes(primal))


def cotangent_dtype(sources, primal, dtype):
    """The dtype to compute a cotangent in: fp32 where `cotangent_like` will still sum it
    over manual axes (so it rounds once), else `dtype` (a kernel writes it rounded, with
    no fp32 copy of a weight-sized gradient in memory)."""
    return jnp.float32 if needs_sum(sources, primal) else jnp.dtype(dtype)


def vary_together(args: Sequence):
    """`args` cast to vary over the union of their varying axes (a no-op without
    check_vma): kernels, scans and their outputs then carry one varying type."""
    return _vary_as(args, varying_union(args))


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A pallas_call result of `shape` and `dtype` that varies like operand `like`
    (pallas_call needs the varying axes spelled out under check_vma)."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, manual_axis_type=_mat(like))


def cotangent_like(ct, primal):
    """A cotangent with its primal's type: summed over the manual axes it varies over and
    the primal does not, and resharded to the primal's explicit layout."""
    extra = varying_axes(ct) - varying_axes(primal)
    if extra:
        ct = jax.lax.psum(ct, tuple(sorted(extra)))
    return layout_like(ct, jax.typeof(primal).sharding)


def cotangents_like(grads, primals) -> tuple:
    """Each gradient as `cotangent_like` makes it, summed in fp32 where it is summed
    (rounded once), in its primal's dtype; None stays None (an absent operand)."""
    return tuple(None if g is None else cotangent_like(
        g.astype(jnp.float32) if needs_sum((g,), p) else g, p).astype(p.dtype)
        for g, p in zip(grads, primals))


def layout_like(t, want):
    """t resharded to `want` (a sharding from a type), where that has explicit axes and
    lays t out otherwise; t as it is under Auto axes (the compiler chooses)."""
    have = jax.typeof(t).sharding
    if (want is not None and not want.mesh.empty and want.mesh.explicit_axes
            and dims_of(want.spec, t.ndim) != dims_of(have.spec, t.ndim)):
        t = jax.sharding.reshard(t, want)
    return t


def whole_along(t, dims: Sequence[int], like=None):
    """t with dimensions `dims` unsharded, the others as they were: for code that reshapes
    a dimension in a way no layout follows from (chunk_ssd cuts a sequence split over 8
    devices into 4 chunks: JAX has no layout for that reshape, and the compiler's
    sub-axis split cannot be named in a custom_partitioning callback).
    Explicit axes: resharded (a gather over the axes dropped). Auto axes: a sharding
    constraint on `dims` alone, the rest left to the partitioner. Inside a shard_map
    (manual axes, local arrays) or without a mesh: t as it is.
    like: an operand of the op that made t, whose mesh to use under Auto axes with no
    mesh in context (a custom call's result carries none in its type)."""
    mesh = context_mesh([t] if like is None else [t, like])
    if mesh.empty:
        return t
    if mesh.explicit_axes:
        have = explicit_dims(t)
        want = tuple(() if i in dims else axes for i, axes in enumerate(have))
        return _resharded((t,), (want,), (have,), mesh)[0]
    if mesh.manual_axes:
        return t
    spec = P(*(None if i in dims else P.UNCONSTRAINED for i in range(t.ndim)))
    return jax.lax.with_sharding_constraint(t, NamedSharding(mesh, spec))


# ------------------------------------------------------------- local-only wrappers


def local_operands(public: str):
    """Marks a backend's kernel wrapper (grouped gmm and tgmm, the SSD forward and
    backward of a Pallas backend) as one that runs on local arrays: `run` calls it on the
    shards (inside a shard_map or a custom_partitioning's per-device program), never on a
    sharded array. Called directly on an operand laid out over explicit mesh axes, it
    raises a ValueError naming the argument, its shape and layout, and `public` (the op
    that shards it): a pallas_call has no partitioning rule, so JAX would either refuse
    to slice it or gather it and compute everything on every device. Under Auto axes the
    layout is not known while tracing: there the wrapper computes on the whole arrays
    (the partitioner gathers them), as docs/sharding.md says."""

    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            for name, value in signature.bind(*args, **kwargs).arguments.items():
                axes = explicit_dims(value) if isinstance(value, jax.Array) else ()
                if any(axes):
                    raise ValueError(
                        f"{fn.__module__}.{fn.__name__}: {name} {tuple(value.shape)} is laid "
                        f"out over mesh axes {spec_of(axes)}; this backend function runs "
                        f"on local arrays. Call {public}, which runs it on the shards, or "
                        "call it inside a shard_map over those axes.")
            return fn(*args, **kwargs)

        return checked

    return wrap


def explicit_dims(value) -> Dims:
    """The explicit mesh axes of each dimension of array `value`, from its type (() for a
    dimension no explicit axis splits)."""
    layout = jax.typeof(value).sharding
    if layout is None or layout.mesh.empty or not layout.mesh.explicit_axes:
        return replicated(value.ndim)
    explicit = frozenset(layout.mesh.explicit_axes)
    return tuple(tuple(a for a in axes if a in explicit)
                 for axes in dims_of(layout.spec, value.ndim))


# ----------------------------------------------------------------------------- run


def backend_options(name: str, interpret) -> dict:
    """`run`'s options for backend `name` ("xla", "pallas_triton", "pallas_mosaic_*"):
    an interpreted Pallas kernel needs invariant operands, and the Mosaic interpreters
    cannot lower inside a custom_partitioning."""
    interpreted = bool(interpret) and name != "xla"
    return {"partitionable": not (interpreted and name.startswith("pallas_mosaic")),
            "interpreted": interpreted}


def context_mesh(args):
    """The mesh in context (a jit's or shard_map's abstract mesh), else the first
    operand's type's mesh, else the empty mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    for a in args:
        sharding = jax.typeof(a).sharding
        if sharding is not None and not sharding.mesh.empty:
            return sharding.mesh
    return mesh


def run(planner: Planner, args: Sequence[jax.Array], *, rule: str,
        reduction_factors: Sequence[str] = (), partitionable: bool = True,
        interpreted: bool = False, factor_sizes: Mapping[str, int] | None = None) -> tuple:
    """The planner's local function over the shards of `args`, in whichever of the three
    ways (module docstring) the context allows; returns its outputs as a tuple.

    rule: the Shardy sharding rule of the op, einsum-like ("m k, g k n, G -> m n"),
    used only where the compiler chooses the layouts (Auto axes); a dimension may be a
    compound of factors ("b (c s) h"), with factor_sizes giving the size of each factor
    that is never a whole dimension of its own.
    partitionable=False: under Auto axes, run on the global arrays (the partitioner
    gathers what is sharded) instead of through a custom_partitioning, for code that
    cannot lower inside one: the Mosaic interpreters' ordered host callbacks (CPU tests).
    interpreted: the local function runs a Pallas interpreter, which fails on operands
    that vary over manual axes (JAX 0.11.2: its loops mix varying blocks with invariant
    grid indices); under check_vma it then runs on invariant copies (`_on_invariant`).

    Under jax.vmap the call runs once per batch element (`_mapped`): neither a
    custom_partitioning nor ragged_dot (over any dimension but 0) has a batching rule."""
    return _mapped(lambda *a: _run(planner, a, rule, tuple(reduction_factors), partitionable,
                                   interpreted, dict(factor_sizes or {})), tuple(args))


def run_explicit(planner: Planner, args: Sequence[jax.Array]) -> tuple:
    """For plain-JAX forms that XLA's partitioner handles itself under Auto axes and in a
    shard_map, but whose ops have no rule under Explicit axes (a select between a
    replicated mask and sharded operands): under Explicit axes, the planner's local
    function in a shard_map over them, as `run` does; anywhere else, the local function
    on the arrays as they are."""
    mesh = context_mesh(args)
    if mesh.empty or not mesh.explicit_axes:
        return tuple(planner(tuple(replicated(a.ndim) for a in args), {}).local(*args))
    axis_sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return _run_explicit(planner, tuple(args), mesh, axis_sizes, interpreted=False)


def _mapped(fn, args: tuple) -> tuple:
    """fn(*args) with a batching rule: over a vmapped axis, jax.lax.map runs fn on one
    element of the batched operands at a time (the others closed over), so every kernel,
    plan and collective inside sees the unbatched shapes it was written for. Sequential:
    a vmap of n costs n calls (docs/sharding.md)."""
    call = jax.custom_batching.custom_vmap(lambda *a: tuple(fn(*a)))

    @call.def_vmap
    def rule(axis_size, in_batched, *operands):
        del axis_size
        batched = tuple(o for o, b in zip(operands, in_batched) if b)

        def one(slices):
            it = iter(slices)
            return tuple(fn(*(next(it) if b else o for o, b in zip(operands, in_batched))))

        out = jax.lax.map(one, batched)
        return out, tuple(True for _ in out)

    return call(*args)


def _run(planner, args, rule, reduction_factors, partitionable, interpreted,
         factor_sizes) -> tuple:
    mesh = context_mesh(args)
    axis_sizes = dict(zip(mesh.axis_names, mesh.axis_sizes)) if not mesh.empty else {}
    if not mesh.empty and mesh.explicit_axes:
        return _run_explicit(planner, args, mesh, axis_sizes, interpreted)
    if not mesh.empty and mesh.manual_axes:
        # The caller's shard_map: local arrays (remaining Auto axes replicate the call).
        return local_call(_unsharded(planner, args, axis_sizes).local, args, interpreted)
    if not partitionable:
        return tuple(_unsharded(planner, args, axis_sizes).local(*args))
    return _run_auto(planner, args, rule, reduction_factors, factor_sizes)


def _unsharded(planner, args, axis_sizes) -> Plan:
    """The plan for operands that are not sharded (local arrays, or whole ones)."""
    return planner(tuple(replicated(a.ndim) for a in args), axis_sizes)


def local_call(local, args, interpreted: bool) -> tuple:
    """local(*args) on operands cast to one varying type (vary_together); for the
    interpreters (interpreted) inside a shard_map, computed from invariant copies
    (_on_invariant). Returns local's outputs as a tuple."""
    axes = varying_union(args)
    args = _vary_as(args, axes)
    if interpreted and axes:
        return _on_invariant(local, args, tuple(sorted(axes)))
    return tuple(local(*args))


def _on_invariant(local, args, axes) -> tuple:
    """local(*args) for operands varying over manual `axes`, computed from invariant
    copies: every shard's operands gathered, the function mapped over the shards, this
    shard's results kept. Exact, and n times the work: for the Pallas interpreters
    (tests on CPU), never for compiled kernels."""
    me = jax.lax.axis_index(axes)
    shards = jax.lax.psum(1, axes)
    # Each shard's operands placed in its own row and summed: an invariant [shards, ...]
    # copy (JAX 0.11.2's all_gather keeps the operand's varying type).
    whole = [jax.lax.psum(jnp.zeros((shards,) + a.shape, a.dtype).at[me].set(a), axes)
             for a in args]
    outs = jax.vmap(lambda *shard: tuple(local(*shard)))(*whole)
    return tuple(o[me] for o in outs)


def _run_explicit(planner, args, mesh, axis_sizes, interpreted):
    free = frozenset(mesh.explicit_axes)
    given = tuple(
        tuple(tuple(a for a in axes if a in free)
              for axes in dims_of(jax.typeof(x).sharding.spec, x.ndim))
        for x in args)
    plan = planner(given, axis_sizes)
    caller_axes = varying_union(args)
    args = _resharded(args, plan.in_dims, given, mesh)

    def body(*local_args):
        return local_call(plan.local, local_args, interpreted)

    outs = jax.shard_map(
        body, mesh=mesh, axis_names=free,
        in_specs=tuple(spec_of(d) for d in plan.in_dims),
        out_specs=tuple(spec_of(d) for d in plan.out_dims),
        # The plans are checked by the tests; the Pallas interpreters cannot run under
        # check_vma (JAX 0.11.2: their loops mix varying blocks with invariant indices).
        check_vma=False,
    )(*args)
    outs = _resharded(outs, plan.out_like or plan.out_dims, plan.out_dims, mesh)
    # Inside a caller's shard_map over other axes (check_vma on), the results vary over
    # that caller's axes as the operands did; the inner shard_map runs without check_vma.
    return _vary_as(outs, caller_axes)


def _resharded(values, wants: Sequence[Dims], haves: Sequence[Dims], mesh) -> tuple:
    """Each value laid out as `wants` says, where that differs from `haves`."""
    return tuple(v if want == have else jax.sharding.reshard(v, NamedSharding(mesh, spec_of(want)))
                 for v, want, have in zip(values, wants, haves))


def _vary_as(values, axes: frozenset) -> tuple:
    return tuple(v if v is None or not axes - varying_axes(v)
                 else jax.lax.pcast(v, tuple(sorted(axes - varying_axes(v))), to="varying")
                 for v in values)


def _named_dims(sharding, ndim) -> Dims:
    if isinstance(sharding, NamedSharding):
        return dims_of(sharding.spec, ndim)
    return replicated(ndim)  # a layout with no axis names: take it replicated


def _run_auto(planner, args, rule, reduction_factors, factor_sizes):
    unsharded = _unsharded(planner, args, {})

    @custom_partitioning
    def call(*operands):
        return tuple(unsharded.local(*operands))

    def partition(mesh, arg_shapes, result_shape):
        given = tuple(_named_dims(s.sharding, len(s.shape)) for s in arg_shapes)
        plan = planner(given, dict(mesh.shape))
        in_shardings = tuple(NamedSharding(mesh, spec_of(d)) for d in plan.in_dims)
        out_shardings = tuple(NamedSharding(mesh, spec_of(d)) for d in plan.out_dims)
        return mesh, lambda *shards: tuple(plan.local(*shards)), out_shardings, in_shardings

    call.def_partition(partition=partition, sharding_rule=rule,
                       reduction_factors=reduction_factors, **factor_sizes)
    return call(*args)
