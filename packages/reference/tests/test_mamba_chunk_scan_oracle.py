"""The Mamba-2 scan's oracle (pallasite.reference.mamba_chunk_scan) against a float64
NumPy loop written from mamba_ssm's docstring, against the bare SSD definition, and
against sequences scanned one at a time; its argument checks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.reference.mamba_chunk_scan import mamba_chunk_scan_reference
from pallasite.reference.ssd import ssd_sequential


def _inputs(seed=0, b=2, l=23, h=4, p=3, g=2, n=5, d_shape="hp"):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s)  # noqa: E731
    return dict(x=f(b, l, h, p), dt=f(b, l, h) - 1.0, A=-np.exp(f(h)), B=f(b, l, g, n),
                C=f(b, l, g, n), D=f(*{"hp": (h, p), "h": (h,)}[d_shape]), z=f(b, l, h, p),
                dt_bias=0.5 * f(h), initial_states=f(b, h, p, n))


def _numpy_loop(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None):
    """(y, final states, every step's state) by the definition, step by step in float64."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    per = h // B.shape[2]
    dt = dt + (0 if dt_bias is None else dt_bias)
    if dt_softplus:
        dt = np.where(dt <= 20, np.log1p(np.exp(np.minimum(dt, 20))), dt)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = np.clip(dt, *dt_limit)
    y = np.zeros((b, l, h, p))
    states = np.zeros((b, l, h, p, n))
    finals = np.zeros((b, h, p, n))
    for i in range(b):
        s = np.zeros((h, p, n)) if initial_states is None else initial_states[i].copy()
        for t in range(l):
            if seq_idx is not None and t > 0 and seq_idx[i, t] != seq_idx[i, t - 1]:
                s = np.zeros_like(s)
            for hh in range(h):
                grp = hh // per
                s[hh] = (np.exp(A[hh] * dt[i, t, hh]) * s[hh]
                         + dt[i, t, hh] * np.outer(x[i, t, hh], B[i, t, grp]))
                y[i, t, hh] = s[hh] @ C[i, t, grp]
            states[i, t] = s
        finals[i] = s
    if D is not None:
        y = y + (D[:, None] if D.ndim == 1 else D) * x
    if z is not None:
        y = y * z / (1 + np.exp(-z))
    return y, finals, states


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("d_shape", ["hp", "h"])
def test_every_option_against_a_numpy_loop(x64, d_shape):
    a = _inputs(1, d_shape=d_shape)
    seq_idx = np.repeat(np.array([[0, 0, 1, 1, 1, 2, 2, 2] + [3] * 15]), 2, axis=0)
    seq_idx[1] = np.sort(np.random.default_rng(2).integers(0, 4, 23))
    kw = dict(D=a["D"], z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True,
              dt_limit=(0.05, 1.5), initial_states=a["initial_states"], seq_idx=seq_idx)
    y_want, final_want, _ = _numpy_loop(a["x"], a["dt"], a["A"], a["B"], a["C"], **kw)
    j = {k: jnp.asarray(v) for k, v in a.items()}
    jkw = {**kw, **{k: j[k] for k in ("D", "z", "dt_bias", "initial_states")},
           "seq_idx": jnp.asarray(seq_idx)}
    y, final = mamba_chunk_scan_reference(j["x"], j["dt"], j["A"], j["B"], j["C"], 8,
                                          **jkw, return_final_states=True)
    np.testing.assert_allclose(np.asarray(y), y_want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(final), final_want, rtol=1e-12, atol=1e-12)


def test_varlen_states_are_each_sequences_last_state(x64):
    a = _inputs(3, b=1, l=30)
    cu = np.array([0, 4, 4, 17, 30])  # an empty sequence among them
    seq_idx = np.searchsorted(cu[1:], np.arange(30), side="right")[None]
    _, final_want, states = _numpy_loop(a["x"], a["dt"], a["A"], a["B"], a["C"],
                                        initial_states=a["initial_states"], seq_idx=seq_idx)
    j = {k: jnp.asarray(v) for k, v in a.items()}
    y, final, varlen = mamba_chunk_scan_reference(
        j["x"], j["dt"], j["A"], j["B"], j["C"], 8, initial_states=j["initial_states"],
        cu_seqlens=jnp.asarray(cu), return_final_states=True, return_varlen_states=True)
    want = np.stack([states[0, 3], np.zeros_like(states[0, 0]), states[0, 16],
                     states[0, 29]])
    np.testing.assert_allclose(np.asarray(varlen), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(final), final_want, rtol=1e-12, atol=1e-12)
    # cu_seqlens alone packs the sequences: the same y as with the seq_idx it implies.
    y_idx = mamba_chunk_scan_reference(j["x"], j["dt"], j["A"], j["B"], j["C"], 8,
                                       initial_states=j["initial_states"],
                                       seq_idx=jnp.asarray(seq_idx))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_idx))


def test_without_options_it_is_the_ssd_definition(x64):
    a = {k: jnp.asarray(v) for k, v in _inputs(4).items()}
    y = mamba_chunk_scan_reference(a["x"], a["dt"], a["A"], a["B"], a["C"], 4)
    want, _ = ssd_sequential(a["x"] * a["dt"][..., None], a["A"] * a["dt"], a["B"], a["C"])
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-12, atol=1e-12)


def test_packed_sequences_equal_separate_scans(x64):
    a = {k: jnp.asarray(v) for k, v in _inputs(5, b=1, l=20).items()}
    cut = 9
    seq_idx = jnp.asarray((np.arange(20) >= cut).astype(np.int32))[None]
    y = mamba_chunk_scan_reference(a["x"], a["dt"], a["A"], a["B"], a["C"], 4,
                                   D=a["D"], seq_idx=seq_idx)
    for part, start in ((slice(0, cut), True), (slice(cut, 20), False)):
        alone = mamba_chunk_scan_reference(
            *(a[k][:, part] for k in ("x", "dt")), a["A"],
            *(a[k][:, part] for k in ("B", "C")), 4, D=a["D"])
        np.testing.assert_allclose(np.asarray(y[:, part]), np.asarray(alone),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change, message", [
    (dict(dt=np.zeros((2, 23, 3))), "dt must be"),
    (dict(A=np.zeros((4, 1))), "A must be"),
    (dict(C=np.zeros((2, 23, 2, 4))), "C must be"),
    (dict(D=np.zeros((3,))), "D must be"),
    (dict(z=np.zeros((2, 23, 4, 2))), "z must be"),
    (dict(dt_bias=np.zeros((2,))), "dt_bias must be"),
    (dict(initial_states=np.zeros((2, 4, 3, 4))), "initial_states must be"),
    (dict(seq_idx=np.zeros((2, 22), np.int32)), "seq_idx must be"),
    (dict(seq_idx=np.zeros((2, 23))), "seq_idx must be an integer"),
    (dict(dt_limit=(1.0, 0.5)), "dt_limit"),
    (dict(cu_seqlens=np.array([0, 23])), "batch must be 1"),
    (dict(return_varlen_states=True), "needs cu_seqlens"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_bad_arguments_are_named(change, message):
    a = _inputs(6)
    kw = dict(chunk_size=8)
    for k, v in change.items():
        if k in a:
            a[k] = v
        else:
            kw[k] = v
    arrays = {k: (jnp.asarray(v, jnp.float32) if v.dtype.kind == "f" else jnp.asarray(v))
              for k, v in a.items()}
    extra = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    with pytest.raises((ValueError, TypeError), match=message):
        mamba_chunk_scan_reference(**arrays, **extra)


def test_cu_seqlens_must_cover_the_length():
    a = {k: jnp.asarray(v, jnp.float32) for k, v in _inputs(7, b=1).items()}
    with pytest.raises(ValueError, match="end at the length 23"):
        mamba_chunk_scan_reference(**a, chunk_size=8, cu_seqlens=jnp.array([0, 5, 20]))
