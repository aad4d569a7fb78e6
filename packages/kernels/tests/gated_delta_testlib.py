"""What the gated delta rule's test files share: random inputs (never zeros), the
gradients of a fixed projection of (o, final) wrt all six inputs, and the relative L2
errors of a chunked form against the float64 step-by-step definition."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.reference import parity
from pallasite.reference.gated_delta_rule import gated_delta_rule_sequential

REL_L2 = 1e-5  # fp32 inputs against the float64 definition
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def inputs(seed, b=2, t=150, hk=2, hv=4, dk=16, dv=32, n=None, decay=3.0,
           dtype=jnp.float32):
    """q, k, v in `dtype`; g = -decay * softplus(noise) (<= 0); beta in (0, 1); fp32
    initial states [b, or n sequences, hv, dk, dv]."""
    ks = jax.random.split(jax.random.key(seed), 6)
    f = lambda i, s: jax.random.normal(ks[i], s, jnp.float32)  # noqa: E731
    return dict(q=f(0, (b, t, hk, dk)).astype(dtype), k=f(1, (b, t, hk, dk)).astype(dtype),
                v=f(2, (b, t, hv, dv)).astype(dtype),
                g=-decay * jax.nn.softplus(f(3, (b, t, hv))),
                beta=jax.nn.sigmoid(f(4, (b, t, hv))),
                initial_state=f(5, (b if n is None else n, hv, dk, dv)))


def with_extremes(a):
    """`a` with beta exactly 0 on every third step and exactly 1 on the next, and g = -20
    on every seventh step."""
    steps = np.arange(a["beta"].shape[1])
    beta = np.asarray(a["beta"]).copy()
    beta[:, steps % 3 == 0] = 0.0
    beta[:, steps % 3 == 1] = 1.0
    g = np.asarray(a["g"]).copy()
    g[:, steps % 7 == 0] = -20.0
    return dict(a, beta=jnp.asarray(beta), g=jnp.asarray(g))


def on_host(tree):
    """`tree` on the host CPU, where float64 is native (a TPU emulates it): the float64
    definition, the tests' ground truth, runs there."""
    return jax.device_put(tree, jax.devices("cpu")[0])


def wide(a):
    """`a` in float64 on the host CPU (on_host)."""
    return on_host({k: v.astype(jnp.float64) for k, v in a.items()})


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def values_and_grads(fn, a, **kw):
    """(o, final) and the gradients of a fixed projection of both wrt all six inputs."""

    def loss(*args):
        o, final = fn(*args[:5], initial_state=args[5], output_final_state=True, **kw)
        wo = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        wf = jnp.sin(jnp.arange(final.size, dtype=jnp.float32)).reshape(final.shape)
        return jnp.sum(o * wo) + jnp.sum(final * wf), (o, final)

    grads, out = jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(
        *(a[k] for k in NAMES))
    return out, grads


def forward_alone(fn, a, cu_seqlens=None, **kw):
    """(o, final) of the forward alone, jitted (cu_seqlens traced) and not differentiated
    (a kernel may then keep no residuals and take other forms)."""
    return jax.jit(lambda arrays, cu: fn(*(arrays[k] for k in NAMES[:5]),
                                         initial_state=arrays["initial_state"],
                                         output_final_state=True, cu_seqlens=cu, **kw))(
        a, cu_seqlens)


def errors(chunked, a, **kw):
    """Relative L2 of o, the final states and the six gradients of `chunked` (a function
    with chunk_gated_delta_rule's arguments) against the definition, keyed by name; and of
    o and the final states from the forward alone ("o_alone", "final_alone")."""
    definition = functools.partial(gated_delta_rule_sequential,
                                   **{k: v for k, v in kw.items() if k != "chunk_size"})
    (o, final), grads = values_and_grads(functools.partial(chunked, **kw), a)
    (o_ref, final_ref), grads_ref = values_and_grads(definition, wide(a))
    assert o.dtype == a["v"].dtype and final.dtype == jnp.float32
    out = {"o": rel(o, o_ref), "final": rel(final, final_ref)}
    out.update({"d" + k: rel(g, r) for k, g, r in zip(NAMES, grads, grads_ref)})
    o_alone, final_alone = forward_alone(chunked, a, **kw)
    out.update(o_alone=rel(o_alone, o_ref), final_alone=rel(final_alone, final_ref))
    return out


PACKED_OUTPUTS = ["o", "final"] + ["d" + name for name in NAMES]


def packed_errors(chunked, a, cu):
    """(got, want, {output: relative L2}) of the values and six gradients with traced
    cu_seqlens (a jit argument) against the definition in float64 on the host."""

    def run(fn, arrays, cu):
        return values_and_grads(fn, arrays, cu_seqlens=cu)

    got = jax.jit(functools.partial(run, chunked))(a, cu)
    want = run(gated_delta_rule_sequential, wide(a), on_host(cu))
    errors = [rel(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    return got, want, dict(zip(PACKED_OUTPUTS, errors, strict=True))


def check_packed(chunked, a, cu):
    """Values and gradients with traced cu_seqlens within REL_L2 of the definition;
    sequence 1 is empty, so its final state is its initial state, to the bit."""
    got, want, errors = packed_errors(chunked, a, cu)
    assert max(errors.values()) <= REL_L2, errors
    np.testing.assert_array_equal(np.asarray(got[0][1][1]), np.asarray(a["initial_state"][1]))
    check_packed_forward(chunked, a, cu, want[0])


def check_packed_forward(chunked, a, cu, want):
    """The forward alone (no residuals kept: the kernels may read the packed rows in
    place) with traced cu_seqlens: (o, final) within REL_L2 of `want`, the definition's,
    every step of o written and finite; the empty sequence 1's final state its initial
    state, to the bit."""

    o, final = forward_alone(chunked, a, cu_seqlens=cu)
    assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32))))
    errors = [rel(o, want[0]), rel(final, want[1])]
    assert max(errors) <= REL_L2, errors
    np.testing.assert_array_equal(np.asarray(final[1]), np.asarray(a["initial_state"][1]))


def check_bf16(chunked, a):
    """bf16 inputs: o, the final states and the six gradients within the bf16 parity
    tolerance of the definition on the same (rounded) inputs."""
    (o, final), grads = values_and_grads(chunked, a)
    widened = {k: v.astype(jnp.float32) for k, v in a.items()}
    (o_ref, final_ref), grads_ref = values_and_grads(gated_delta_rule_sequential, widened)
    assert o.dtype == jnp.bfloat16
    for name, got, want in [("o", o, o_ref), ("final", final, final_ref)] + [
            ("d" + k, g, r) for k, g, r in zip(NAMES, grads, grads_ref)]:
        parity.assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32),
                            dtype=jnp.bfloat16, what=name)
