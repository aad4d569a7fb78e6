"""A traced function's equations, nested jaxprs included, and among them its Pallas kernel
calls (their names, cost estimates and aliases), read off its jaxpr."""

from __future__ import annotations

import jax
import jax.extend

KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")  # mpmd_map: pl.kernel's


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in it (scans, custom_vjp calls,
    kernel bodies...), in order, each before those nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from equations(sub)


def pallas_calls(jaxpr):
    """Every kernel call's equation in `jaxpr` and in the jaxprs nested in it, in order
    (its params hold the call's name, cost_estimate, input_output_aliases...)."""
    return (eqn for eqn in equations(jaxpr) if eqn.primitive.name in KERNEL_PRIMITIVES)


def traced_pallas_calls(fn, *args):
    """pallas_calls of `fn` traced on `args` (arrays or ShapeDtypeStructs)."""
    return list(pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr))
