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

The tracer classes are JAX internals (jax._src, seen on jax 0.11.2); the tests exercise
each transformation, so a JAX that renames them fails there first.
"""

from __future__ import annotations

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
