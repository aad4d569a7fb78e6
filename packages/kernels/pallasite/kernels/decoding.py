"""What the decode steps share (selective_state_update, gated_delta_rule_step): which
backend runs, and the refusal to differentiate a step (inference only)."""

from __future__ import annotations

import functools

import jax

from pallasite.kernels import platform

STEP_BACKENDS = ("pallas_triton", "xla")


def _refusal(name: str, explicit: bool) -> str | None:
    """Why `name` cannot run here (None: it can). An explicit pallas_triton on a CPU host
    runs interpreted."""
    if name == "xla":
        return None
    if jax.default_backend() == "cpu":
        return None if explicit else "pallas_triton: interpreted only when named, on a CPU"
    if not platform.triton_runs():
        return (f"pallas_triton needs a CUDA GPU from sm80; the device is "
                f"{platform.device_generation()}")
    return None


def step_backend(op: str, implementation) -> str:
    """The first of `implementation` (a name, a sequence, or None for STEP_BACKENDS in
    order) that can run here; RuntimeError with every reason where none can."""
    names = platform.named_implementations(implementation, STEP_BACKENDS)
    reasons = []
    for name in names:
        why = _refusal(name, implementation is not None)
        if why is None:
            return name
        reasons.append(why)
    raise RuntimeError(f"{op}: no implementation can run here:\n  " + "\n  ".join(reasons))


@functools.cache
def no_gradient(op: str, train_with: str):
    """The identity, whose gradient is a TypeError saying `op` is a decode step and
    naming what to train with."""

    @jax.custom_vjp
    def stop(x):
        return x

    def bwd(_, ct):
        raise TypeError(f"{op} is a decode step and has no gradient; train with "
                        f"{train_with} and decode with this")

    stop.defvjp(lambda x: (x, None), bwd)
    return stop
