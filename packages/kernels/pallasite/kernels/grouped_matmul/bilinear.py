"""A bilinear product as a JAX primitive that vmap runs one element at a time, in every
derivative: what lets the plain-JAX path (plain.py) take jax.jacfwd and jax.hessian.

jax.lax.ragged_dot batches only where every operand, the group sizes included, is
batched on its leading axis (JAX 0.11.2: "ragged_dot vmap over any dim but 0 - NYI"),
and jax.jacfwd is a vmap over the tangents of a jvp, so the tangent product fails there.
jax.custom_batching.custom_vmap would give it a batching rule, but no transpose rule, so
reverse mode through it fails instead. `call(fn, a, b, *rest)` binds one primitive for a
function `fn(a, b, *rest)` bilinear in (a, b) (`rest`: operands held fixed, such as the
group sizes), with rules that keep every derivative a call of the same primitive:
- jvp: fn(da, b) + fn(a, db) (bilinearity);
- transpose: with tau(a, b, c) = <fn(a, b), c>, fn is tau's gradient in c, its
  transposes are tau's gradients in a and in b, and every transpose of those is again
  one of the three (`_Slot`). Only the first two are transposes JAX computes (of fn, by
  jax.linear_transpose); JAX cannot transpose ragged_dot's contraction form, which the
  gradient in b is, so nothing is transposed twice;
- batching: jax.lax.map over the batched operands, one unbatched call per element
  (sequential, as sharding.run's vmap of the kernels);
- evaluation, abstract evaluation and lowering: the function traced as plain JAX.
`fn` must be hashable (a frozen dataclass), as every primitive parameter is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

_bilinear_p = Primitive("pallasite_bilinear")


def call(fn: Callable, a: jax.Array, b: jax.Array, *rest: jax.Array) -> jax.Array:
    """fn(a, b, *rest) for `fn` bilinear in (a, b); see the module docstring."""
    return _bind(_Slot(fn, 2, (0, 1), (None, None)), a, b, *rest)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """The gradient of tau(a, b, c) = <fn(a, b), c> in slot `out` (0: a, 1: b, 2: c) as a
    function of the other two slots' values, given in the order `args`. avals: the types
    of a and b where known (each is set when a transpose makes its slot the output, and
    jax.linear_transpose needs it)."""

    fn: Callable
    out: int
    args: tuple[int, int]
    avals: tuple[Any, Any]

    def __call__(self, x, y, *rest):
        value = dict(zip(self.args, (x, y)))
        if self.out == 2:
            return self.fn(value[0], value[1], *rest)
        if self.out == 0:
            at = lambda a: self.fn(a, value[1], *rest)  # noqa: E731
        else:
            at = lambda b: self.fn(value[0], b, *rest)  # noqa: E731
        return jax.linear_transpose(at, self.avals[self.out])(value[2])[0]

    def transposed(self, operand: int, aval) -> _Slot:
        """This function transposed in its operand `operand` (0 or 1): the slot that
        operand filled becomes the output, and the cotangent fills this function's
        output slot, in the operand's place. aval: the operand's type."""
        slot = self.args[operand]
        args = list(self.args)
        args[operand] = self.out
        avals = list(self.avals)
        if slot < 2:  # the output slot c is fn's own: no type needed
            avals[slot] = aval
        return _Slot(self.fn, slot, tuple(args), tuple(avals))


def _impl(*args, fn):
    return fn(*args)


@functools.lru_cache(maxsize=256)
def _abstract_eval(*avals, fn):
    # Traced, so the result carries what JAX infers for fn (varying manual axes too).
    return jax.make_jaxpr(fn)(*avals).out_avals[0]


def _bind(fn, *args):
    return _bilinear_p.bind(*args, fn=fn)


def _jvp(primals, tangents, *, fn):
    a, b, *rest = primals
    da, db = tangents[:2]
    out = _bind(fn, a, b, *rest)
    terms = [_bind(fn, t, b, *rest) for t in (da,) if type(t) is not ad.Zero]
    terms += [_bind(fn, a, t, *rest) for t in (db,) if type(t) is not ad.Zero]
    if not terms:
        return out, ad.Zero.from_primal_value(out)
    return out, functools.reduce(jnp.add, terms)


def _transpose(ct, a, b, *rest, fn):
    none = [None] * len(rest)
    if type(ct) is ad.Zero:
        return [None, None, *none]
    if ad.is_undefined_primal(a):
        return [_bind(fn.transposed(0, a.aval), ct, b, *rest), None, *none]
    return [None, _bind(fn.transposed(1, b.aval), a, ct, *rest), *none]


def _batch(args, dims, *, fn):
    args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]

    def one(slices):
        it = iter(slices)
        return _bind(fn, *(a if d is None else next(it) for a, d in zip(args, dims)))

    return jax.lax.map(one, [a for a, d in zip(args, dims) if d is not None]), 0


_bilinear_p.def_impl(_impl)
_bilinear_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_bilinear_p, mlir.lower_fun(_impl, multiple_results=False))
ad.primitive_jvps[_bilinear_p] = _jvp
ad.primitive_transposes[_bilinear_p] = _transpose
batching.primitive_batchers[_bilinear_p] = _batch
