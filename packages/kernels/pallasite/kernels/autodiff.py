"""Which kind of differentiation an op is being traced under, seen from its operands.

pallasite's ops differentiate through a hand-written custom_vjp: first-order reverse mode
(jax.grad, jax.vjp, jax.linearize, jax.jacrev). JAX cannot run a custom_vjp in forward
mode (jax.jvp, jax.jacfwd, jax.hessian), and a second derivative would differentiate the
backward's kernels, which have no derivative rules. So each op looks at its operands when
it is traced: forward mode shows as a JVPTracer, reverse mode as a LinearizeTracer, and a
derivative of a derivative as two such tracers of different transformations (through any
vmap). Anything but plain first-order reverse mode then takes the op's plain-JAX path,
which JAX differentiates to any order, or, where the caller named a Pallas backend, stops
with an error that says so.

`values_from` gives one function's values with another's derivative (a fused forward
whose gradients come from a composition JAX differentiates).

`differentiated_checkpoint` sees, from the trace stack, a jax.checkpoint that reverse
mode will differentiate: the ops' interpreted Mosaic backends refuse to run there.

The tracer and trace classes are JAX internals (jax._src, seen on jax 0.11.2); the tests exercise
each transformation, so a JAX that renames them fails there first.
"""

from __future__ import annotations

import jax
from jax._src import core
from jax._src.interpreters import ad, batching


def beyond_first_order(*operands) -> str | None:
    """None under no differentiation or first-order reverse mode; otherwise what is
    being asked ('forward-mode differentiation (jvp)' or 'higher-order
    differentiation')."""
    forward, levels = False, set()
    stack = [o for o in operands if o is not None]
    while stack:
        t = stack.pop()
        if isinstance(t, ad.JVPTracer):
            forward = True
            levels.add(id(t._trace))
            stack += [t.primal, t.tangent]
        elif isinstance(t, ad.LinearizeTracer):
            levels.add(id(t._trace))
            stack.append(t.primal)
        elif isinstance(t, batching.BatchTracer):
            stack.append(t.val)
    if forward:
        return "forward-mode differentiation (jvp)"
    if len(levels) > 1:
        return "higher-order differentiation"
    return None


def first_order_error(op: str, backend: str, why: str, supported: str) -> NotImplementedError:
    """The error for a named backend that cannot do `why`."""
    return NotImplementedError(
        f"{op}: {backend} supports first-order reverse mode only (jax.grad, jax.vjp, "
        f"jax.linearize); {why} needs implementation={supported!r}, which JAX "
        f"differentiates to any order")


def differentiated_checkpoint() -> bool:
    """Whether the op is being traced inside jax.checkpoint (jax.remat) that JAX will
    differentiate: reverse mode then partial-evaluates the checkpointed function, which it
    refuses for one that holds host-callback effects, as the Pallas Mosaic interpreters'
    kernels do ("Effects not supported in AD of checkpoint/remat: IOEffect"). Seen from the
    trace stack: a checkpoint trace with a JVP or linearize trace below it. A jitted
    function traced before, outside the checkpoint, is cached and not seen again."""
    trace, checkpointed = core.trace_ctx.trace, False
    while trace is not None:
        if checkpointed and isinstance(trace, (ad.JVPTrace, ad.LinearizeTrace)):
            return True
        info = getattr(getattr(trace, "frame", None), "debug_info", None)
        checkpointed |= "checkpoint" in str(getattr(info, "traced_for", ""))
        trace = getattr(trace, "parent_trace", None)
    return False


def checkpoint_refusal(op: str, backend: str) -> str:
    """Why an interpreted Mosaic backend cannot run under a differentiated checkpoint."""
    return (f"pallasite {op}: {backend} runs here through the Pallas Mosaic interpreter, "
            "whose host callbacks (IOEffect) JAX cannot differentiate inside "
            "jax.checkpoint (jax.remat); on CPU use implementation='xla' or "
            "'pallas_triton' there (the compiled kernels have no such callbacks)")


def values_from(primal, differentiated):
    """A function with primal's values whose derivative is differentiated's: reverse mode
    runs differentiated's forward (its residuals saved) and its backward, and never
    primal. For a forward that has a faster form of its own (a fused kernel) where the
    gradients are better taken from another (a composition JAX differentiates). Both take
    the same arguments and give the same values up to rounding."""

    @jax.custom_vjp
    def function(*args):
        return primal(*args)

    def forward(*args):
        return jax.vjp(differentiated, *args)

    def backward(vjp, cotangents):
        return vjp(cotangents)

    function.defvjp(forward, backward)
    return function
