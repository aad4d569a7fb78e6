"""Mamba-2 SSD (state space duality) oracles: the sequential definition and chunked forms.

Math, per batch element and head, with `a = A*dt <= 0` per step and x already scaled by dt:
the state `S [p, n]` evolves as `S_t = exp(a_t) S_{t-1} + x_t B_t^T` and the output is
`y_t = S_t C_t`. Over a chunk of C steps entered with state S, with
`acs_i = a_0 + ... + a_i` and `segsum_ij = a_{j+1} + ... + a_i` (i >= j):

    y_i = sum_{j<=i} (C_i . B_j) exp(segsum_ij) x_j  +  exp(acs_i) S C_i
    S'  = exp(acs_last) S  +  sum_j exp(segsum_{last,j}) x_j B_j^T

Forms (all return y in x.dtype and states in fp32, computing in fp32 internally, or float64
when x64 is enabled and an input is float64, so tests can hold them equal in float64):
- `ssd_sequential`: a lax.scan over steps. The definition; O(length) sequential steps.
- `ssd_chunk_scan_reference`: the chunked layout of the kernels' contract, in one of two
  forms that compute the same numbers:
    * plain: every chunk's intra-chunk `[C, C]` tiles at once (`[b, nc, h, C, C]`), then a
      scan over chunks of the `[h, p, n]` states only;
    * blockwise: a lax.scan over chunks that builds one chunk's tiles at a time, for
      sequences where the plain form's tiles would be huge (`form="auto"` switches above
      `PLAIN_TILE_BYTES`).
- `ssd_chunked`: the same in `[batch, length, heads, ...]` layout (to_chunks/from_chunks).

Layouts: `[b, l, h, p]` x, `[b, l, h]` a, `[b, l, g, n]` B and C; chunked: x
`[b, nc, C, h, p]`, a `[b, nc, C, h]`, B/C `[b, nc, C, g, n]`, states `[b, h, p, n]`.
B and C carry g groups shared by h // g consecutive heads (head i uses group
i // (h // g)); heads are viewed as `[g, h // g]` so B and C are never copied per head.

Contractions run at HIGHEST precision: these are oracles, and on GPU the default fp32 dot
is TF32.

Non-finite inputs stay causal, as in the definition: a NaN or inf in x or B at step t
reaches outputs from step t on, never before. A chunked form multiplies every chunk's
[C, C] tile by x, above the diagonal too, where 0 * NaN would poison the whole chunk; so
the tile is masked by a select and the product takes x's finite part, and the outputs
from a non-finite x's step on (per element) are set to NaN afterwards
(`finite_part`, `nonfinite_since`, `poison`; the kernels use the same functions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped

__all__ = [
    "segsum",
    "finite_part",
    "nonfinite_since",
    "poison",
    "segsum_cumsum_difference",
    "validate_ssd",
    "validate_ssd_chunked",
    "validate_chunk_size",
    "to_chunks",
    "from_chunks",
    "ssd_sequential",
    "ssd_chunk_scan_reference",
    "ssd_chunked",
    "PLAIN_TILE_BYTES",
]

_HIGHEST = jax.lax.Precision.HIGHEST

# Above this many bytes of fp32 [b, nc, h, C, C] tiles, form="auto" takes the blockwise
# form. 1 GiB is what the first docs/targets.md row (b=8, l=4096, h=32, C=256) needs
# (b*nc*h*C*C*4 bytes), so every TARGETS row up to that size runs plain; beyond it the
# blockwise form holds 1/nc of the tiles at a time, paying a sequential scan over chunks
# (its scan body is rematerialised, so reverse mode too keeps only the carried states).
PLAIN_TILE_BYTES = 1 << 30


# --------------------------------------------------------------------------- segment sums


def segsum_cumsum_difference(a: Float[Array, "... t"]) -> Float[Array, "... t t"]:
    """`cs_i - cs_j` with `cs = cumsum(a)`; -inf above the diagonal. Kept for comparison.

    Each entry inherits the rounding error of the whole prefix (~eps * |cs_i|) even where the
    segment itself is short: see `segsum` for the measured cost.
    """
    t = a.shape[-1]
    cs = jnp.cumsum(a, axis=-1)
    diff = cs[..., :, None] - cs[..., None, :]
    return jnp.where(jnp.tril(jnp.ones((t, t), bool)), diff, -jnp.inf)


def segsum(a: Float[Array, "... t"]) -> Float[Array, "... t t"]:
    """Segment sums `out[..., i, j] = a_{j+1} + ... + a_i` for i >= j, -inf above.

    The stable form: a_i is copied into row i of a strictly-lower mask (columns j < i) and
    summed down the rows, so each entry is a sum of exactly its own segment's terms and its
    error scales with that segment, not with the whole prefix.

    Measured: fp32 evaluation against float64 segment sums of the same fp32 inputs, C=256,
    64 rows, a drawn as in docs/targets.md (a = -exp(U[0,1)) * softplus(N(0,1) - 4), prefix sums
    reaching ~-14): max |exp(segsum) - exact| is 9.3e-08 here vs 2.0e-06 for the
    cumulative-sum-difference form (22x worse); with dt 50x larger (prefix sums ~-680)
    3.8e-08 vs 4.6e-05 (1200x worse). Evaluated in float64 the two sit 2.8e-16 vs 4.1e-15
    from exact. (`tests/test_ssd.py::test_segsum_stable_form_is_more_accurate` re-measures
    at C=128.) The cost is a
    [t, t] cumulative sum instead of [t] one, negligible for an oracle.
    """
    t = a.shape[-1]
    rows = jnp.broadcast_to(a[..., :, None], a.shape + (t,))
    rows = jnp.where(jnp.tril(jnp.ones((t, t), bool), -1), rows, 0)
    sums = jnp.cumsum(rows, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((t, t), bool)), sums, -jnp.inf)


# ---------------------------------------------------------------------- non-finite inputs


def finite_part(t: Shaped[Array, "..."]) -> Shaped[Array, "..."]:
    """t with every non-finite entry set to 0: the operand of a product whose masked-out
    terms must stay 0 (0 * NaN is NaN)."""
    return jnp.where(jnp.isfinite(t), t, jnp.zeros((), t.dtype))


def nonfinite_since(t: Shaped[Array, "..."], axis: int) -> Shaped[Array, "..."]:
    """True at each step along `axis` at or after the first non-finite entry of t (per
    element of the other axes): where a product over `finite_part(t)` must be NaN to be
    what the product over t would be on and below the diagonal. A minimum over the
    steps, not a cumulative sum, so it runs inside the kernels as it is."""
    steps = jax.lax.broadcasted_iota(jnp.int32, t.shape, axis % t.ndim)
    past = jnp.asarray(t.shape[axis], steps.dtype)  # typed: int64 under jax_enable_x64
    first = jnp.min(jnp.where(jnp.isfinite(t), past, steps), axis=axis,
                    keepdims=True)
    return steps >= first


def poison(y: Shaped[Array, "..."], since: Shaped[Array, "..."]) -> Shaped[Array, "..."]:
    """y set to NaN where `since` holds."""
    return jnp.where(since, jnp.asarray(jnp.nan, y.dtype), y)


# ----------------------------------------------------------------------------- validation


def _shape(t) -> tuple[int, ...]:
    return tuple(getattr(t, "shape", np.shape(t)))


def _check_floating(**arrays) -> None:
    for name, t in arrays.items():
        if t is not None and not jnp.issubdtype(t.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating; got {t.dtype} (shape {_shape(t)})")


def _check_ranks(ranks: dict[str, int], layout: dict[str, str], **arrays) -> None:
    for name, t in arrays.items():
        if len(_shape(t)) != ranks[name]:
            raise ValueError(f"{name} must be rank {ranks[name]} {layout[name]}; got shape {_shape(t)}")


def _check_common(x, a, b, c, initial_state, lead: int) -> None:
    """Shared checks once ranks are right; `lead` = number of leading step axes."""
    xs, as_, bs, cs = _shape(x), _shape(a), _shape(b), _shape(c)
    steps = xs[: 1 + lead]
    if as_[: 1 + lead] != steps or as_[1 + lead] != xs[1 + lead]:
        raise ValueError(
            f"a must match x's batch, steps and heads: a shape {as_}, x shape {xs}"
        )
    if bs[: 1 + lead] != steps:
        raise ValueError(f"b must match x's batch and steps: b shape {bs}, x shape {xs}")
    if cs != bs:
        raise ValueError(f"c must have b's shape: c shape {cs}, b shape {bs}")
    heads, groups = xs[1 + lead], bs[1 + lead]
    if groups < 1 or heads % groups:
        raise ValueError(
            f"heads ({heads}, x shape {xs}) must be a multiple of groups ({groups}, b shape {bs})"
        )
    if initial_state is not None:
        want = (xs[0], heads, xs[-1], bs[-1])
        if _shape(initial_state) != want:
            raise ValueError(
                f"initial_state must be [batch, heads, head_dim, state] = {want}; "
                f"got shape {_shape(initial_state)}"
            )
    _check_floating(x=x, a=a, b=b, c=c, initial_state=initial_state)


def validate_chunk_size(length: int, chunk_size: int) -> None:
    """chunk_size must be a positive int dividing length."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"chunk_size must be an int; got {chunk_size!r}")
    if chunk_size < 1 or length % chunk_size:
        raise ValueError(
            f"chunk_size ({chunk_size}) must be positive and divide the sequence length ({length})"
        )


def validate_ssd(
    x: Shaped[Array, "..."],
    a: Shaped[Array, "..."],
    b: Shaped[Array, "..."],
    c: Shaped[Array, "..."],
    initial_state: Shaped[Array, "..."] | None = None,
    *,
    chunk_size: int | None = None,
) -> None:
    """Checks for [batch, length, heads, ...] inputs; a ValueError/TypeError names the argument.

    x [b, l, h, p], a [b, l, h], b and c [b, l, g, n] with h % g == 0, initial_state
    [b, h, p, n] if given, all floating; chunk_size (if given) divides l.
    """
    layout = {"x": "[batch, length, heads, head_dim]", "a": "[batch, length, heads]",
              "b": "[batch, length, groups, state]", "c": "[batch, length, groups, state]"}
    _check_ranks({"x": 4, "a": 3, "b": 4, "c": 4}, layout, x=x, a=a, b=b, c=c)
    _check_common(x, a, b, c, initial_state, lead=1)
    if chunk_size is not None:
        validate_chunk_size(_shape(x)[1], chunk_size)


def validate_ssd_chunked(
    x: Shaped[Array, "..."],
    a: Shaped[Array, "..."],
    b: Shaped[Array, "..."],
    c: Shaped[Array, "..."],
    initial_state: Shaped[Array, "..."] | None = None,
) -> None:
    """Checks for the chunked layout of the kernels' contract (see module docstring).

    x [b, nc, C, h, p], a [b, nc, C, h], b and c [b, nc, C, g, n] with h % g == 0,
    initial_state [b, h, p, n] if given, all floating.
    """
    layout = {"x": "[batch, chunks, chunk, heads, head_dim]", "a": "[batch, chunks, chunk, heads]",
              "b": "[batch, chunks, chunk, groups, state]",
              "c": "[batch, chunks, chunk, groups, state]"}
    _check_ranks({"x": 5, "a": 4, "b": 5, "c": 5}, layout, x=x, a=a, b=b, c=c)
    _check_common(x, a, b, c, initial_state, lead=2)


# ------------------------------------------------------------------------------- layouts


def to_chunks(t: Float[Array, "batch length ..."], chunk_size: int) -> Float[Array, "batch nc chunk ..."]:
    """[b, l, ...] -> [b, l // chunk_size, chunk_size, ...]."""
    validate_chunk_size(t.shape[1], chunk_size)
    return t.reshape(t.shape[0], t.shape[1] // chunk_size, chunk_size, *t.shape[2:])


def from_chunks(t: Float[Array, "batch nc chunk ..."]) -> Float[Array, "batch length ..."]:
    """[b, nc, C, ...] -> [b, nc * C, ...]."""
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])


def _wide(*arrays) -> np.dtype:
    """fp32, or float64 when an input is float64 (only possible with x64 enabled)."""
    if any(t is not None and t.dtype == jnp.float64 for t in arrays):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


# ----------------------------------------------------------------------- the definition


def ssd_sequential(
    x: Float[Array, "batch length heads head_dim"],
    a: Float[Array, "batch length heads"],
    b: Float[Array, "batch length groups state"],
    c: Float[Array, "batch length groups state"],
    initial_state: Float[Array, "batch heads head_dim state"] | None = None,
) -> tuple[Float[Array, "batch length heads head_dim"], Float[Array, "batch heads head_dim state"]]:
    """The recurrence, one step at a time: `S = exp(a_t) S + x_t B_t^T; y_t = S C_t`.

    Returns (y in x.dtype, final_state fp32). A lax.scan over the length: slow, obvious,
    and the definition every other form is held to.
    """
    validate_ssd(x, a, b, c, initial_state)
    wide = _wide(x, a, b, c, initial_state)
    bsz, _, h, p = x.shape
    g, n = b.shape[2], b.shape[3]
    xg = x.astype(wide).reshape(*x.shape[:2], g, h // g, p)
    ag = a.astype(wide).reshape(*a.shape[:2], g, h // g)
    s0 = _initial(initial_state, (bsz, h, p, n), wide).reshape(bsz, g, h // g, p, n)

    def step(state, inputs):
        x_t, a_t, b_t, c_t = inputs  # [b,g,r,p], [b,g,r], [b,g,n], [b,g,n]
        state = jnp.exp(a_t)[..., None, None] * state + x_t[..., None] * b_t[:, :, None, None, :]
        y_t = jnp.einsum("bgrpn,bgn->bgrp", state, c_t, precision=_HIGHEST)
        return state, y_t

    steps = tuple(jnp.moveaxis(t, 1, 0) for t in (xg, ag, b.astype(wide), c.astype(wide)))
    final, ys = jax.lax.scan(step, s0, steps)
    y = jnp.moveaxis(ys, 0, 1).reshape(x.shape).astype(x.dtype)
    return y, final.reshape(bsz, h, p, n)


def _initial(initial_state, shape, wide) -> Array:
    if initial_state is None:
        return jnp.zeros(shape, wide)
    return initial_state.astype(wide)


# --------------------------------------------------------- chunk pieces (any leading dims)
# Grouped views: x [..., C, g, r, p], a [..., C, g, r], B/C [..., C, g, n], S [..., g, r, p, n]
# with r = heads // groups; "..." is (b, nc) in the plain form and (b,) in the blockwise one.


def _decays(a):
    """exp(segsum) tiles [..., g, r, C, C] and the prefix sums acs [..., C, g, r]."""
    seg = segsum(jnp.moveaxis(a, -3, -1))  # [..., g, r, C, C]
    return jnp.exp(seg), jnp.cumsum(a, axis=-3)


def _intra_chunk(x, b, c, tiles):
    """sum_{j<=i} (C_i . B_j) exp(segsum_ij) x_j: scores per group, decays per head.

    Causal for non-finite x and B (module docstring): the weights above the diagonal are
    selected away, x enters as its finite part, and rows from a non-finite x on are NaN."""
    scores = jnp.einsum("...ign,...jgn->...gij", c, b, precision=_HIGHEST)
    # Two explicit steps: a three-operand einsum may pair scores with x first and build a
    # [g, C, C, r, p] intermediate, p times the tiles.
    t = tiles.shape[-1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jnp.where(causal, scores[..., :, None, :, :] * tiles, 0)  # [..., g, r, C, C]
    y = jnp.einsum("...grij,...jgrp->...igrp", weights, finite_part(x), precision=_HIGHEST)
    return poison(y, nonfinite_since(x, axis=-4))


def _chunk_contribution(x, b, tiles):
    """The state one chunk adds from zero: sum_j exp(segsum_{last,j}) x_j B_j^T."""
    to_end = tiles[..., -1, :]  # [..., g, r, C]: row `last` of the segment-sum tiles
    decayed = jnp.moveaxis(to_end, -1, -3)[..., None] * x  # [..., C, g, r, p]
    return jnp.einsum("...jgrp,...jgn->...grpn", decayed, b, precision=_HIGHEST)


def _state_output(c, acs, state):
    """exp(acs_i) S C_i: what the state entering the chunk adds to each step's output."""
    out = jnp.einsum("...ign,...grpn->...igrp", c, state, precision=_HIGHEST)
    return jnp.exp(acs)[..., None] * out


def _pass_states(s0, contributions, chunk_decay):
    """Scan over chunks: S_{z+1} = exp(acs_last_z) S_z + contribution_z (axis 1 = chunks)."""

    def step(state, inputs):
        contribution, decay = inputs
        return decay[..., None, None] * state + contribution, state

    final, entering = jax.lax.scan(
        step, s0, (jnp.moveaxis(contributions, 1, 0), jnp.moveaxis(chunk_decay, 1, 0))
    )
    return final, jnp.moveaxis(entering, 0, 1)


def _plain(x, a, b, c, s0):
    """Every chunk's tiles at once; the scan carries only [h, p, n] states."""
    tiles, acs = _decays(a)
    contributions = _chunk_contribution(x, b, tiles)
    final, entering = _pass_states(s0, contributions, jnp.exp(acs[:, :, -1]))
    y = _intra_chunk(x, b, c, tiles) + _state_output(c, acs, entering)
    return y, final, entering


def _blockwise(x, a, b, c, s0):
    """A scan over chunks holding one chunk's [C, C] tiles at a time.

    The body is under jax.checkpoint: without it, reverse mode would save every chunk's
    tiles as residuals and rebuild the plain form's footprint.
    """

    @jax.checkpoint
    def step(state, inputs):
        x_z, a_z, b_z, c_z = inputs
        tiles, acs = _decays(a_z)
        y_z = _intra_chunk(x_z, b_z, c_z, tiles) + _state_output(c_z, acs, state)
        new = jnp.exp(acs[:, -1])[..., None, None] * state + _chunk_contribution(x_z, b_z, tiles)
        return new, (y_z, state)

    final, (ys, entering) = jax.lax.scan(step, s0, tuple(jnp.moveaxis(t, 1, 0) for t in (x, a, b, c)))
    return jnp.moveaxis(ys, 0, 1), final, jnp.moveaxis(entering, 0, 1)


def _plain_tile_bytes(x, b) -> int:
    bsz, nc, chunk, h = x.shape[:4]
    return 4 * bsz * nc * h * chunk * chunk


def ssd_chunk_scan_reference(
    x: Float[Array, "batch nc chunk heads head_dim"],
    a: Float[Array, "batch nc chunk heads"],
    b: Float[Array, "batch nc chunk groups state"],
    c: Float[Array, "batch nc chunk groups state"],
    initial_state: Float[Array, "batch heads head_dim state"] | None = None,
    *,
    form: str = "auto",
    return_chunk_states: bool = False,
):
    """The chunked SSD in the kernels' layout -> (y, final_state[, chunk_states]).

    y [b, nc, C, h, p] in x.dtype, final_state [b, h, p, n] fp32, and with
    `return_chunk_states=True` also chunk_states [b, nc, h, p, n] fp32: the state each chunk
    entered with (what a backend's forward returns as its residual). `form` is "plain",
    "blockwise", or "auto" (plain unless its fp32 [b, nc, h, C, C] tiles exceed
    PLAIN_TILE_BYTES). initial_state None means zeros.
    """
    validate_ssd_chunked(x, a, b, c, initial_state)
    if form not in ("auto", "plain", "blockwise"):
        raise ValueError(f"form must be 'auto', 'plain' or 'blockwise'; got {form!r}")
    if form == "auto":
        form = "plain" if _plain_tile_bytes(x, b) <= PLAIN_TILE_BYTES else "blockwise"
    wide = _wide(x, a, b, c, initial_state)
    bsz, nc, chunk, h, p = x.shape
    g, n = b.shape[3], b.shape[4]
    r = h // g
    xg = x.astype(wide).reshape(bsz, nc, chunk, g, r, p)
    ag = a.astype(wide).reshape(bsz, nc, chunk, g, r)
    s0 = _initial(initial_state, (bsz, h, p, n), wide).reshape(bsz, g, r, p, n)
    run = _plain if form == "plain" else _blockwise
    y, final, entering = run(xg, ag, b.astype(wide), c.astype(wide), s0)
    y = y.reshape(x.shape).astype(x.dtype)
    final = final.reshape(bsz, h, p, n)
    if return_chunk_states:
        return y, final, entering.reshape(bsz, nc, h, p, n)
    return y, final


def ssd_chunked(
    x: Float[Array, "batch length heads head_dim"],
    a: Float[Array, "batch length heads"],
    b: Float[Array, "batch length groups state"],
    c: Float[Array, "batch length groups state"],
    chunk_size: int,
    initial_state: Float[Array, "batch heads head_dim state"] | None = None,
    *,
    form: str = "auto",
) -> tuple[Float[Array, "batch length heads head_dim"], Float[Array, "batch heads head_dim state"]]:
    """The chunked SSD in [batch, length, heads, ...] layout -> (y in x.dtype, final fp32).

    chunk_size must divide length. See ssd_chunk_scan_reference for `form`.
    """
    validate_ssd(x, a, b, c, initial_state, chunk_size=chunk_size)
    y, final = ssd_chunk_scan_reference(
        *(to_chunks(t, chunk_size) for t in (x, a, b, c)), initial_state, form=form
    )
    return from_chunks(y), final
