"""The definition: dense attention that materialises S and P, and the derived tolerance rule.

    S = scale * Q K^T,  S_ij = -inf where key j is masked,
    LSE_i = log sum_j exp(S_ij),  O_i = sum_j exp(S_ij - LSE_i) V_j.

`attention` computes this in float64 and is what every other layer is checked against.
`attention_naive_f32` is the same computation in float32: its error against the float64 result is the
yardstick of the tolerance rule (DESIGN.md, proofs/L6_floating_point.md):

    err(x) = max |x - ref_float64|,   pass iff err(x) <= 2 * err(naive float32) + floor + score floor,
    floor  = 2 * max |fl32(ref + 0.3) - 0.3 - ref|, taken at its bound ulp32(max |ref| + 0.3),

and for a tiled order also + the rescaling terms, and for the output of the v1 order + the round-trip term.

Refinements, all because the simulator's tensors are tiny (a few dozen entries), where one sample of
rounding noise can be lucky: err(naive float32) is the largest error over five evaluation orders of the
sums (BLAS matmul; plain loops forward and reversed that round every product as a kernel without FMA does;
a balanced tree, as SIMD reductions sum; fused multiply-adds in index order, as a GPU kernel's FFMA loop
does), and the floor is the ulp bound its DESIGN.md formula tends to on large tensors. Three terms are
derived (proofs/L6, parts 3, 4 and 6), with u = U32 = 2^-24 and W_ij = P_ij u |S_ij|:

- score floor: every float32 implementation rounds each score at least once; to first order that moves
  O_ix by at most sum_j W_ij (|V_jx| + |O_ix|) and LSE_i by at most sum_j W_ij (max over entries). The naive
  evaluation rounds its scores too, but on a tiny tensor its rounding of the few scores that matter (a near
  tie of two keys) can happen to be almost exact.
- v1 round trips: v1 keeps O = acc / l in HBM between the visits of a row (Algorithm 1), so after each of
  its key tiles but the last it rebuilds acc = O l: acc times (1 + d1)(1 + d2), two roundings the naive
  computation never makes. They move O by at most
  gamma_2 (1 + gamma_2)^(R - 1) max_{i,x} sum_{t < T_i - 1} |sum_{j < c_1(t)} P_ij V_jx|,
  T_i the key tiles row i's query tile visits, R = max T_i - 1, gamma_n = n u / (1 - n u). l, m and LSE
  make no round trip. The term needs the tiles: baseline(..., block_q=, block_k=), judged with order="v1".
- online rescalings (v1 and v2): when a visited tile raises the row max, acc and l are multiplied by
  alpha = exp(m_old - m_new), which the naive computation never computes: alpha's own error (EXP_REL, 3 ulps
  of a float32 exp), the rounding of m_old - m_new and of the product, e(t) = EXP_REL + u + u |m_new - m_old|
  relative, reweight the keys seen so far against the later ones: O moves by at most
  e(t) (|Pi(t)| + |O| mass(t)) and LSE = m + log l by e(t) mass(t), Pi(t) and mass(t) the partial output and
  weight before the rescaling. Judged with order="v1" or "v2" and the tiles.

Causal masking is bottom-right aligned (FlashAttention >= 2.1): query i sees key j iff j <= i + N_k - N_q.
Any other mask (`fa_numba.masks`: window, documents, prefix-LM, a function, a dense array) is passed as
`mask=` and applied densely through `mask.dense(N_q, N_k)`; `causal=True` is the short form of
`mask=masks.causal()`, and passing both is a ValueError. `visible_mask` is where every dense mask is made.

The backward (proofs/L7_backward.md): `attention_backward` gives the float64 gradients (dq, dk, dv) of
<dO, O> for a given dO, `attention_backward_naive_f32` the same formulas in float32 (P recomputed from its
own float32 LSE, as every FlashAttention backward does), and `baseline_backward` / `judge_backward` /
`check_attention_backward` the gradients' rule: err <= 3 err(naive float32) + floor, the floor adding one
float32 ulp of what the backward recomputes (dP - D where it cancels, and LSE) to `rounding_floor`. Each
takes `mask=` as the forward does.

Non-finite values (proofs/L2, L3, L8). Whether a row sees any key is decided by the mask alone: a row with no
visible key (causal: possible when N_q > N_k; any mask may have such rows) has O = 0 and LSE = -inf, whatever its query holds; no NaN, no
warning. Every other row follows the dense formula with max shift, in IEEE arithmetic: a NaN in its query,
in a visible key or in a visible score makes its O (all columns) and LSE NaN; a NaN in column x of a
visible value makes O[:, x] NaN and leaves the LSE alone; a +inf score makes the row NaN (exp(inf - inf));
visible scores that are all -inf give O = 0/0 = NaN and LSE = log 0 = -inf. A masked key is never
touched: its scores are -inf by the mask and its value row is never multiplied (0 * NaN would be NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_numba import shapes


U32 = 2.0**-24  # unit roundoff of float32, the kernels' arithmetic: |fl(x) - x| <= U32 |x|


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): |prod_{k<=n} (1 + d_k) - 1| <= gamma_n whenever every |d_k| <= u."""
    if n < 0 or n * u >= 1:
        raise ValueError(f"gamma needs 0 <= n u < 1, got n = {n}, u = {u}")
    return n * u / (1 - n * u)


ROUND_TRIP = gamma(2)  # one v1 round trip, fl(fl(acc / l) l) = acc (1 + d1)(1 + d2): at most gamma_2 relative
# A float32 exp is within 3 ulps of the exact value (NumPy's SIMD float32 exp documents 2.52 ulps, CUDA's expf
# 2 ulps), and an ulp of y is at most 2^-23 |y|: a relative error of at most EXP_REL.
EXP_ULPS = 3
EXP_REL = EXP_ULPS * 2.0**-23


def visits(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool) -> np.ndarray:
    """(N_q,) number of key tiles the query tile of each row visits: T_c, or with `causal` the non-SKIP
    prefix J_i + 1 of L3 (0 for a tile that sees no key). A v1 row makes visits - 1 round trips.

    >>> visits(4, 4, 2, 2, causal=True).tolist(), visits(4, 6, 2, 4, causal=False).tolist()
    ([1, 1, 2, 2], [2, 2, 2, 2])
    """
    for name, value in (("n_q", n_q), ("n_k", n_k), ("block_q", block_q), ("block_k", block_k)):
        shapes.check_block(name, value)
    t_c = -(-n_k // block_k)
    if not causal:
        return np.full(n_q, t_c)
    tile_end = np.minimum((np.arange(n_q) // block_q + 1) * block_q, n_q)  # r_1 of each row's query tile
    last_key = tile_end - 1 + (n_k - n_q)  # the last key the tile's last row sees (bottom-right causal)
    return np.where(last_key >= 0, np.minimum(last_key // block_k, t_c - 1) + 1, 0)


def causal_mask(n_q: int, n_k: int) -> np.ndarray:
    """Boolean (N_q, N_k) mask of visible pairs: True iff j <= i + (N_k - N_q) (bottom-right aligned)."""
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    return j <= i + (n_k - n_q)


def visible_mask(n_q: int, n_k: int, causal: bool = False, mask=None) -> np.ndarray:
    """Boolean (N_q, N_k) mask of the pairs a query sees: `mask.dense`, `causal_mask`, or every pair.

    `mask` is a `fa_numba.masks` mask; with causal=True as well it is a ValueError naming both.
    """
    causal, mask = shapes.check_mask(causal, mask)
    if mask is None:
        return causal_mask(n_q, n_k) if causal else np.ones((n_q, n_k), dtype=bool)
    visible = np.asarray(mask.dense(n_q, n_k))
    if visible.shape != (n_q, n_k) or visible.dtype != np.bool_:
        raise TypeError(f"mask {mask!r}: dense({n_q}, {n_k}) must give an ({n_q}, {n_k}) bool array, "
                        f"got {visible.dtype} {visible.shape}")
    return visible


def visible_matmul(p: np.ndarray, v: np.ndarray, visible: np.ndarray | None = None,
                   contraction: str = "matmul") -> np.ndarray:
    """sum_j p_ij v_j over the visible pairs only, (..., rows, keys) x (..., keys, d) -> (..., rows, d).

    A plain p @ v multiplies the value row of a masked key by its weight 0, and 0 * NaN = NaN would poison
    a row that cannot see that key. Here the finite part of v goes through the contraction and each
    non-finite value entry is added to the visible rows only, so the result is the dense formula's sum
    over visible keys, NaN and infinity included (they make the sum non-finite in any order).
    """
    finite = np.isfinite(v)
    if finite.all():
        return _contract(p, v, contraction)
    out = _contract(p, np.where(finite, v, v.dtype.type(0)), contraction)
    if visible is None:
        visible = np.ones(p.shape[-2:], dtype=bool)
    for *lead, j, x in np.argwhere(~finite):
        lead = tuple(lead)
        column = out[lead + (Ellipsis, x)] if lead else out[..., x]
        with np.errstate(invalid="ignore"):  # 0 * inf = NaN and inf - inf = NaN, as the dense formula has them
            column += np.where(visible[..., j], p[lead + (Ellipsis, j)] * v[lead + (j, x)], p.dtype.type(0))
    return out


CONTRACTIONS = ("matmul", "loop", "loop_reversed", "pairwise", "fma")


def _pairwise(a, b, lo, hi):
    """sum_{x in [lo, hi)} a[..., x] b[x, :] as a balanced tree, every product and every sum rounded."""
    if hi - lo == 1:
        return a[..., lo, None] * b[..., lo, None, :]
    mid = (lo + hi) // 2
    return _pairwise(a, b, lo, mid) + _pairwise(a, b, mid, hi)


def _contract(a, b, contraction):
    """a @ b over the last axis of a, in one of the CONTRACTIONS orders (see attention_naive_f32)."""
    if contraction == "matmul":
        return np.matmul(a, b)
    if contraction == "pairwise":
        return _pairwise(a, b, 0, a.shape[-1])
    total = np.zeros(a.shape[:-1] + b.shape[-1:], dtype=a.dtype)
    if contraction == "fma":  # float32 products are exact in float64; the sum is then rounded to float32
        for x in range(a.shape[-1]):
            total = (a[..., x, None].astype(np.float64) * b[..., x, None, :] + total).astype(a.dtype)
        return total
    steps = range(a.shape[-1]) if contraction == "loop" else reversed(range(a.shape[-1]))
    for x in steps:
        total += a[..., x, None] * b[..., x, None, :]
    return total


@dataclass(frozen=True)
class Terms:
    """The derived terms of the tolerance rule, from the float64 reference of one problem (proofs/L6).

    With W_ij = P_ij u |S_ij| (u = U32), the score floor is score_out = max_{i,x} (W |V| + |O| sum_j W)_ix and
    score_lse = max_i sum_j W_ij: what one float32 rounding of every score can move O and LSE by, to first
    order. v1_out = ROUND_TRIP (1 + ROUND_TRIP)^(R - 1) max_{i,x} sum_{t < T_i - 1} |sum_{j < c_1(t)} P_ij V_jx|,
    T_i = visits(...)_i, R = max_i T_i - 1: what v1's round trips of O through HBM can move O by. online_out and
    online_lse: what the online softmax's rescalings (acc and l times alpha = exp(m_old - m_new), both
    orders) can move O and LSE by (proofs/L6, part 6). The tiled terms are None when the tiles were not given.
    """

    score_out: float
    score_lse: float
    v1_out: float | None = None
    online_out: float | None = None
    online_lse: float | None = None


@dataclass(frozen=True)
class _TileSums:
    """What the tiled orders' extra roundings act on, per row (proofs/L6, parts 3 and 6); see `_tile_sums`."""

    trips: np.ndarray  # (B, H, N_q, d): sum over v1's round trips of |Pi(t)|
    max_trips: int  # R: the most round trips a row makes
    rescaled: np.ndarray  # (B, H, N_q, d): sum over the rescalings of e(t) (|Pi(t)| + |O| mass(t))
    rescaled_lse: np.ndarray  # (B, H, N_q): sum over the rescalings of e(t) mass(t)
    max_rescales: int  # the most rescalings a row makes
    max_shift: float  # the largest |m_new - m_old| of a rescaling


def _tile_sums(p, v4, s, visible, out, tiles) -> _TileSums:
    """Sums over the key tiles each row's query tile visits, in order (float64, from the reference's P, S, O).

    A query tile visits the key tiles where it sees at least one key (`visible`): with causal masking the
    prefix `visits` counts, with any other mask the non-SKIP tiles of its row of the block mask. With
    Pi(t) = P_i,:c_1(t) V_:c_1(t) the partial output and mass(t) = sum_{j < c_1(t)} P_ij the partial weight
    after key tile t:
    - v1 makes a round trip of O through HBM after every visited tile but the last (part 3);
    - both orders rescale acc and l by alpha = exp(m_old - m_new) when a visited tile raises the row max
      (part 6), with a relative error of at most e(t) = EXP_REL + u + u |m_new - m_old| (alpha's exp, the
      product, the rounded difference); a tile whose max is within the rounding of the scores,
      2u (|m_old| + |tile max|), of the running max m_old may raise the float32 max, so it counts too. A
      rescaling of an empty state (mass 0) is exact and is not counted.
    """
    block_q, block_k = tiles
    n_q, n_k = visible.shape
    t_c = -(-n_k // block_k)
    rows = np.arange(n_q) // block_q
    starts = np.arange(0, n_q, block_q)
    # seen[r, t]: query tile r sees a key of key tile t; tile_visits[i, t] the same for row i's query tile
    seen = np.logical_or.reduceat(np.logical_or.reduceat(visible, starts, axis=0),
                                  np.arange(0, n_k, block_k), axis=1)
    tile_visits = seen[rows]
    last = np.where(tile_visits.any(axis=1), t_c - 1 - np.argmax(tile_visits[:, ::-1], axis=1), -1)
    partial = np.zeros(p.shape[:-1] + v4.shape[-1:])
    trips = np.zeros_like(partial)
    rescaled = np.zeros_like(partial)
    mass = np.zeros(p.shape[:-1])
    rescaled_mass = np.zeros_like(mass)
    rescaled_lse = np.zeros_like(mass)
    rescales = np.zeros(mass.shape, dtype=int)
    running_max = np.full(mass.shape, -np.inf)  # max of the visible scores of the keys before the tile
    max_shift = 0.0
    with np.errstate(invalid="ignore", over="ignore"):  # rows the inputs make NaN stay NaN and are skipped
        for t in range(t_c):
            c0, c1 = t * block_k, min((t + 1) * block_k, n_k)
            tile_max = s[..., c0:c1].max(axis=-1)  # -inf on rows that see no key of the tile
            near = 2 * U32 * (np.abs(np.where(np.isfinite(running_max), running_max, 0))
                              + np.abs(np.where(np.isfinite(tile_max), tile_max, 0)))
            rescale = tile_visits[:, t] & (mass > 0) & (tile_max >= running_max - near)
            shift = np.where(rescale, np.maximum(tile_max - running_max, 0.0), 0.0)
            max_shift = max(max_shift, _finite_max(shift))
            error = np.where(rescale, EXP_REL + U32 + U32 * shift, 0.0)  # e(t), 0 where nothing is rescaled
            rescaled += error[..., None] * np.abs(partial)
            rescaled_mass += error * mass
            rescaled_lse += error * mass
            rescales += rescale
            partial += visible_matmul(p[..., c0:c1], v4[..., c0:c1, :], visible[:, c0:c1])
            mass += p[..., c0:c1].sum(axis=-1)
            running_max = np.fmax(running_max, tile_max)
            trip = tile_visits[:, t] & (t < last)  # a round trip after tile t: visited, and not the last visit
            trips += np.where(trip[:, None], np.abs(partial), 0.0)
        rescaled += np.abs(out) * rescaled_mass[..., None]
    return _TileSums(trips, int((tile_visits.sum(axis=1) - 1).max(initial=0)), rescaled, rescaled_lse,
                     int(rescales.max(initial=0)), max_shift)


def _dense(q, k, v, causal, scale, dtype, contraction="matmul", mask=None, terms=False, tiles=None):
    if contraction not in CONTRACTIONS:
        raise ValueError(f"contraction must be one of {CONTRACTIONS}, got {contraction!r}")
    prob = shapes.problem(q, k, v)
    causal, mask = shapes.check_mask(causal, mask)
    scale = dtype(shapes.resolve_scale(scale, prob.d))
    q4, k4, v4 = (shapes.as_4d(np.asarray(x)).astype(dtype) for x in (q, k, v))
    # GQA: query head h reads K/V head h // group.
    k4 = np.repeat(k4, prob.group, axis=1)
    v4 = np.repeat(v4, prob.group, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):  # IEEE: inf * 0 = NaN where the inputs hold an infinity
        s = scale * _contract(q4, np.swapaxes(k4, -1, -2), contraction)  # S: (B, H, N_q, N_k)
    visible = visible_mask(prob.n_q, prob.n_k, causal, mask)
    alive = visible.any(axis=-1)  # rows with a visible key: decided by the mask, never by the values
    s = np.where(visible, s, dtype(-np.inf))
    with np.errstate(invalid="ignore", divide="ignore"):  # IEEE: NaN and log 0 = -inf where the inputs say so
        m = s.max(axis=-1)  # row max over visible scores: -inf on a dead row, NaN if a visible score is
        shift = np.where(m == -np.inf, dtype(0), m)  # exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN
        p = np.where(visible, np.exp(s - shift[..., None]), dtype(0))  # every finite exponent argument <= 0
        l = _contract(p, np.ones(p.shape[-1:] + (1,), dtype=dtype), contraction)[..., 0]
        lse = np.where(alive, shift + np.log(l), dtype(-np.inf))
        p = np.where(alive[:, None], p / l[..., None], dtype(0))
    out = visible_matmul(p, v4, visible, contraction)
    result = shapes.drop_lead(out, q.ndim), shapes.drop_lead(lse, q.ndim)
    if not terms:
        return result
    v1_out = online_out = online_lse = None
    if tiles is not None:
        sums = _tile_sums(p, v4, s, visible, out, tiles)
        v1_out = ROUND_TRIP * (1 + ROUND_TRIP) ** max(sums.max_trips - 1, 0) * _finite_max(sums.trips)
        # each rescaling multiplies the state by (1 + e), |e| <= EXP_REL + 2u + u max|shift|; they compound
        compound = (1 + EXP_REL + 2 * U32 + U32 * sums.max_shift) ** max(sums.max_rescales - 1, 0)
        online_out = compound * _finite_max(sums.rescaled)
        online_lse = compound * _finite_max(sums.rescaled_lse)
    with np.errstate(invalid="ignore", over="ignore"):  # rows the inputs make NaN stay NaN, and are skipped
        w = np.abs(s, out=s)  # reuse S's memory for W = P u |S|, 0 where P = 0 (a masked P |S| would be 0 inf)
        np.copyto(w, 0, where=p == 0)
        w *= p
        w *= U32
        w_sum = w.sum(axis=-1)
        score_out = visible_matmul(w, np.abs(v4), visible) + np.abs(out) * w_sum[..., None]
    return result + (Terms(_finite_max(score_out), _finite_max(w_sum), v1_out, online_out, online_lse),)


def _finite_max(x: np.ndarray) -> float:
    """max of the finite entries of x (0.0 if none): rows made non-finite by their inputs are judged by
    assert_close's non-finite check, not by a tolerance."""
    finite = x[np.isfinite(x)]
    return float(finite.max()) if finite.size else 0.0


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, mask=None):
    """Float64 dense attention. Returns (out, lse) with out like q and lse like q without its last axis.

    mask: a `fa_numba.masks` mask applied densely (not with causal=True; that is mask=masks.causal()).

    >>> import numpy as np
    >>> q = k = v = np.eye(2)
    >>> out, lse = attention(q, k, v, causal=True)
    >>> out[0].tolist(), round(float(lse[0]), 6)   # query 0 sees only key 0: LSE = S_00 = 1/sqrt(2)
    ([1.0, 0.0], 0.707107)
    """
    return _dense(q, k, v, causal, scale, np.float64, mask=mask)


def attention_naive_f32(q, k, v, *, causal: bool = False, scale: float | None = None, contraction: str = "matmul",
                        mask=None):
    """The same dense computation in float32: the baseline the tolerance rule scales with.

    contraction picks how the three sums (over d for S, over keys for l and for P V) are evaluated:
    "matmul" (BLAS, which may fuse multiply-adds and block the sums), "loop" (one rounded product and one
    rounded add per term, in index order, as a CUDA-core kernel without FMA does), "loop_reversed",
    "pairwise" (a balanced tree of rounded sums, as SIMD reductions do) or "fma" (index order, one rounding
    per fused multiply-add, as a GPU's FFMA loop does; emulated by an exact float64 product and a float64 sum
    rounded to float32, which differs from one rounding only in rare double-rounding ties).
    """
    return _dense(q, k, v, causal, scale, np.float32, contraction, mask)


# ----------------------------------------------------------------------------------------------------
# The derived tolerance rule.


def max_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| over entries where `expected` is finite (0.0 if there are none).

    Non-finite entries are compared by `assert_close`, never skipped there.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    finite = np.isfinite(expected)
    if not finite.any():
        return 0.0
    diff = np.abs(actual[finite] - expected[finite])
    return float(np.max(diff)) if np.isfinite(diff).all() else float("inf")


def rounding_floor(expected: np.ndarray) -> float:
    """floor = ulp32(max |ref| + 0.3): the float32 rounding step at the data's magnitude.

    DESIGN.md writes it as 2 max |fl32(ref + 0.3) - 0.3 - ref|. Each |fl32(x) - x| is at most half an
    ulp of x, and on a large tensor the max reaches that bound, so the formula tends to ulp32(max|ref| + 0.3).
    We use the bound itself: on the simulator's tiny tensors the realised max can be far below it by luck.
    """
    expected = np.asarray(expected, dtype=np.float64)
    finite = np.abs(expected[np.isfinite(expected)])
    if finite.size == 0:
        return 0.0
    return float(np.spacing(np.float32(finite.max() + 0.3)))


def tolerance(expected: np.ndarray, naive, score_floor: float = 0.0) -> float:
    """atol = 2 * err(naive float32) + floor + score floor for one output tensor (O or LSE).

    `naive` is one float32 evaluation or a sequence of them (e.g. the CONTRACTIONS); err(naive) is the
    largest of their errors, which estimates float32 rounding noise better than one evaluation on a tiny tensor.
    `score_floor` is Terms.score_out or Terms.score_lse of the problem (0 leaves it out).
    """
    naive = [naive] if isinstance(naive, np.ndarray) else list(naive)
    return 2.0 * max(max_error(n, expected) for n in naive) + rounding_floor(expected) + score_floor


def assert_close(actual, expected, atol: float, *, name: str = "value") -> float:
    """Assert |actual - expected| <= atol entrywise; non-finite entries must match exactly.

    Returns the max error. The AssertionError reports how many entries fail and the first few indices,
    with NaN/inf mismatches counted separately from finite ones that are too far.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {actual.shape} != expected {expected.shape}")
    finite = np.isfinite(expected)
    # Any disagreement in NaN/inf status is its own category: a non-finite reference entry (LSE = -inf on
    # an empty row, NaN where the inputs hold one) must be reproduced exactly (NaN by NaN, inf by the same
    # inf), and a NaN or inf where the reference is finite never passes.
    same_nonfinite = (actual == expected) | (np.isnan(actual) & np.isnan(expected))
    nonfinite_bad = np.where(finite, ~np.isfinite(actual), ~same_nonfinite)
    with np.errstate(invalid="ignore"):
        finite_bad = finite & np.isfinite(actual) & ~(np.abs(actual - expected) <= atol)
    problems = []
    for label, bad in (("non-finite mismatch", nonfinite_bad), ("beyond atol", finite_bad)):
        count = int(bad.sum())
        if count:
            first = [tuple(int(c) for c in idx) for idx in np.argwhere(bad)[:5]]
            shown = ", ".join(f"{idx}: got {actual[idx]!r}, expected {expected[idx]!r}" for idx in first)
            problems.append(f"{count} entries {label} (first: {shown})")
    err = max_error(actual, expected)
    if problems:
        raise AssertionError(f"{name}: max error {err:.3e} vs atol {atol:.3e}; " + "; ".join(problems))
    return err


@dataclass(frozen=True)
class Check:
    """The outcome of `check_attention`: errors and tolerances of O and LSE."""

    err_out: float
    err_lse: float
    atol_out: float
    atol_lse: float


@dataclass(frozen=True)
class Baseline:
    """The float64 reference of one problem and the tolerances the derived rule allows around it.

    atol_out and atol_lse are the rule for a dense implementation; `tolerances("v2")` adds the online
    softmax's rescaling terms and `tolerances("v1")` those and v1's round-trip term, which need the
    baseline to have been built with the tiles (baseline(..., block_q=, block_k=)).
    """

    out: np.ndarray
    lse: np.ndarray
    atol_out: float
    atol_lse: float
    terms: Terms

    def tolerances(self, order: str | None = None) -> tuple[float, float]:
        """(atol_out, atol_lse) for an implementation of `order`: None for a dense one; "v2" adds the online
        softmax's rescaling terms, "v1" those and its round-trip term (all need the tiles)."""
        if order is None:
            return self.atol_out, self.atol_lse
        if order not in ("v1", "v2"):
            raise ValueError(f"order must be 'v1', 'v2' or None, got {order!r}")
        if self.terms.online_out is None:
            raise ValueError(f"judging order {order!r} needs the tiles: build the baseline with block_q= and block_k=")
        atol_out = self.atol_out + self.terms.online_out + (self.terms.v1_out if order == "v1" else 0.0)
        return atol_out, self.atol_lse + self.terms.online_lse


def baseline(q, k, v, *, causal: bool = False, scale: float | None = None, contractions=CONTRACTIONS,
             mask=None, block_q: int | None = None, block_k: int | None = None) -> Baseline:
    """Reference and tolerances, computed once per problem and shared by every implementation checked.

    The naive float32 baseline is evaluated once per contraction order; pass contractions=("matmul",) on
    large tensors, where one evaluation already samples the rounding noise well and the loops are slow.
    Give the tiles (block_q and block_k) to judge a v1 implementation: its round-trip term depends on them.
    """
    if (block_q is None) != (block_k is None):
        raise ValueError("give both block_q and block_k, or neither")
    tiles = None if block_q is None else (block_q, block_k)
    ref_out, ref_lse, terms = _dense(q, k, v, causal, scale, np.float64, mask=mask, terms=True, tiles=tiles)
    naive = [attention_naive_f32(q, k, v, causal=causal, scale=scale, contraction=c, mask=mask) for c in contractions]
    return Baseline(ref_out, ref_lse, tolerance(ref_out, [n[0] for n in naive], terms.score_out),
                    tolerance(ref_lse, [n[1] for n in naive], terms.score_lse), terms)


def judge(out, lse, base: Baseline, *, name: str = "kernel", order: str | None = None) -> Check:
    """Assert (out, lse) is within the baseline's tolerances for `order`; returns the errors and tolerances."""
    atol_out, atol_lse = base.tolerances(order)
    err_out = assert_close(out, base.out, atol_out, name=f"{name} out")
    err_lse = assert_close(lse, base.lse, atol_lse, name=f"{name} lse")
    return Check(err_out, err_lse, atol_out, atol_lse)


def check_attention(out, lse, q, k, v, *, causal: bool = False, scale: float | None = None, name: str = "kernel",
                    contractions=CONTRACTIONS, mask=None, order: str | None = None, block_q: int | None = None,
                    block_k: int | None = None) -> Check:
    """Check (out, lse) from any implementation against the float64 reference with the derived rule.

    For a v1 implementation pass order="v1" and its tiles, so that its round-trip term is allowed for.
    """
    base = baseline(q, k, v, causal=causal, scale=scale, contractions=contractions, mask=mask, block_q=block_q,
                    block_k=block_k)
    return judge(out, lse, base, name=name, order=order)


# ----------------------------------------------------------------------------------------------------
# The backward pass (proofs/L7_backward.md): the gradients of f = <dO, O(q, k, v)>, for a given dO.
#
#     D_i = sum_x dO_ix O_ix,   dP_ij = dO_i . V_j,   dS_ij = P_ij (dP_ij - D_i),
#     dV_j = sum_i P_ij dO_i,   dQ_i = scale sum_j dS_ij K_j,   dK_j = scale sum_i dS_ij Q_i,
#
# with P the forward's probabilities (0 on masked pairs); dK and dV of a K/V head sum over the query heads
# of its group. Tolerance rule for gradients (DESIGN.md): 3x instead of 2x, as flash-attn's own suite.

GRAD_FACTOR = 3.0
ULP32_PER_UNIT = 2.0**-23  # ulp32(x) <= 2^-23 |x|: the float32 spacing relative to the magnitude


def _dense_backward(q, k, v, dout, causal, scale, dtype, contraction="matmul", floors=False, mask=None):
    prob = shapes.problem(q, k, v)
    shapes.check_like("dout", dout, q.shape, "as q")
    causal, mask = shapes.check_mask(causal, mask)
    # Its own forward, in the same dtype and contraction order: O and LSE as `attention` returns them.
    out, lse = _dense(q, k, v, causal, scale, dtype, contraction, mask)
    scale = dtype(shapes.resolve_scale(scale, prob.d))
    q4, k4, v4, do4 = (shapes.as_4d(np.asarray(x)).astype(dtype) for x in (q, k, v, dout))
    out4, lse4 = shapes.as_4d(out), lse.reshape(q4.shape[:-1])
    k4 = np.repeat(k4, prob.group, axis=1)  # GQA: query head h reads K/V head h // group
    v4 = np.repeat(v4, prob.group, axis=1)
    visible = visible_mask(prob.n_q, prob.n_k, causal, mask)
    # P recomputed from the saved LSE, P_ij = exp(S_ij - sigma(LSE_i)), exactly the softmax in real
    # arithmetic (L7.2). In float32 this keeps the rounding of LSE at its magnitude |LSE|, an error of
    # about ulp(LSE) in every exponent that the forward's exp(S - m) / l does not have: the baseline must
    # carry it, as every implementation that recomputes P from a float32 LSE does (proofs/L7, FP section).
    s = np.where(visible, scale * _contract(q4, np.swapaxes(k4, -1, -2), contraction), dtype(-np.inf))
    shift = np.where(lse4 == -np.inf, dtype(0), lse4)  # sigma: a dead row computes exp(-inf - 0) = 0
    with np.errstate(invalid="ignore"):  # NaN where the inputs hold one
        p = np.where(visible, np.exp(s - shift[..., None]), dtype(0))
    # The gradients (L7.1, L7.3, L7.5). Masked pairs get dS = 0 by the mask, and their operands are never
    # multiplied (visible_matmul), so a row with no visible key gives exactly 0 in dQ and adds nothing to
    # dK, dV, whatever its dO holds.
    d_row = _contract(do4 * out4, np.ones((prob.d, 1), dtype=dtype), contraction)[..., 0]  # D: (B, H, N_q)
    dp = _contract(do4, np.swapaxes(v4, -1, -2), contraction)  # dP: (B, H, N_q, N_k)
    with np.errstate(invalid="ignore"):
        ds = np.where(visible, p * (dp - d_row[..., None]), dtype(0))  # dS
    dv = visible_matmul(np.swapaxes(p, -1, -2), do4, visible.T, contraction)
    dk = scale * visible_matmul(np.swapaxes(ds, -1, -2), q4, visible.T, contraction)
    dq = scale * visible_matmul(ds, k4, visible, contraction)
    # GQA: K/V head h_kv is used by query heads h_kv * group ... (h_kv + 1) * group - 1; its gradient is the sum.
    grouped = (prob.batch, prob.heads_kv, prob.group, prob.n_k, prob.d)
    dk = dk.reshape(grouped).sum(axis=2)
    dv = dv.reshape(grouped).sum(axis=2)
    grads = shapes.drop_lead(dq, q.ndim), shapes.drop_lead(dk, k.ndim), shapes.drop_lead(dv, v.ndim)
    if not floors:
        return grads
    # Two floors that a naive evaluation can be right about by luck (proofs/L7, floating point), each one
    # float32 ulp at the magnitude of the data, ulp32(x) <= 2^-23 |x| (L6's floor, placed where the backward
    # needs it):
    # - the cancellation dP_ij - D_i: two d-term dot products, exactly equal where a row sees one key or its
    #   P is one-hot; an evaluation that rounds both alike has dS = 0 exactly, 3x its error is 0. One ulp
    #   each at the magnitude of its terms, sum_x |dO_ix| |V_jx| and sum_x |dO_ix| |O_ix|, times P_ij.
    # - the stored LSE_i, rounded at its magnitude: one ulp of it is a relative error of every P_ij of the
    #   row, times |dP_ij - D_i| in dS and times |dO_i| in dV (a forward whose LSE is a few ulps off is
    #   still right by the forward's rule).
    # Carried into dQ = scale dS K, dK = scale dS^T Q and dV = P^T dO, over the visible pairs only as the
    # gradients are (L7.8): a NaN or inf that a row or key cannot see (padding, say) must not make its
    # floor NaN, which _finite_max would drop, leaving the row judged without its floor.
    with np.errstate(invalid="ignore", over="ignore"):
        mag_dp = np.matmul(np.abs(do4), np.swapaxes(np.abs(v4), -1, -2))  # sum_x |dO_ix| |V_jx|
        mag_d = (np.abs(do4) * np.abs(out4)).sum(axis=-1)  # sum_x |dO_ix| |O_ix|
        p_lse = np.where(visible, p * ULP32_PER_UNIT * np.abs(shift)[..., None], dtype(0))  # P ulp(LSE)
        e = np.where(visible, p * ULP32_PER_UNIT * (mag_dp + mag_d[..., None]) + p_lse * np.abs(dp - d_row[..., None]),
                     dtype(0))
        # magnitudes: |scale|, so that a negative scale gives the same (non-negative) floor as its opposite
        floor_dq = abs(scale) * visible_matmul(e, np.abs(k4), visible)
        floor_dk = (abs(scale) * visible_matmul(np.swapaxes(e, -1, -2), np.abs(q4), visible.T)).reshape(grouped).sum(axis=2)
        floor_dv = visible_matmul(np.swapaxes(p_lse, -1, -2), np.abs(do4), visible.T).reshape(grouped).sum(axis=2)
    return grads, (_finite_max(floor_dq), _finite_max(floor_dk), _finite_max(floor_dv))


def attention_backward(q, k, v, dout, *, causal: bool = False, scale: float | None = None, mask=None):
    """Float64 gradients (dq, dk, dv) of <dout, O(q, k, v)>, densely from its own float64 forward (O, LSE).

    dout is like q; dq comes out like q, dk and dv like k and v (H_kv heads: with GQA each is the sum over
    the query heads of its group). mask: a `fa_numba.masks` mask applied densely, as in `attention` (not with
    causal=True): masked pairs have P = 0 and dS = 0 and their operands are never multiplied. A row with no
    visible key (causal with N_q > N_k, or any mask's empty row) gives a zero row of dq and nothing to dk,
    dv. The formulas and their proof: proofs/L7_backward.md. Materialises S, P, dP, dS:
    B H N_q N_k elements each (it is the definition, not a memory-efficient algorithm).

    >>> import numpy as np
    >>> q = k = v = np.eye(2)
    >>> dq, dk, dv = attention_backward(q, k, v, np.ones((2, 2)), causal=True)
    >>> p10 = 1 / (1 + np.exp(1 / np.sqrt(2)))   # query 1's weight on key 0; query 0 puts all on key 0
    >>> np.allclose(dv, [[1 + p10] * 2, [1 - p10] * 2], rtol=1e-15, atol=0)   # dV_j = sum_i P_ij dO_i
    True
    """
    return _dense_backward(q, k, v, dout, causal, scale, np.float64, mask=mask)


def attention_backward_naive_f32(q, k, v, dout, *, causal: bool = False, scale: float | None = None,
                                 contraction: str = "matmul", mask=None):
    """The same dense gradients in float32: the baseline of the gradients' tolerance rule.

    contraction picks how every sum (over d for S, dP and D; over keys for l, O and dQ; over queries for
    dK and dV) is evaluated, as in `attention_naive_f32`: one of CONTRACTIONS.
    """
    return _dense_backward(q, k, v, dout, causal, scale, np.float32, contraction, mask=mask)


def tolerance_backward(expected: np.ndarray, naive, recompute: float = 0.0) -> float:
    """atol = 3 * err(naive float32) + floor for one gradient (dq, dk or dv): `tolerance` with 3x.

    `naive` is one float32 evaluation or a sequence of them (the CONTRACTIONS). The floor is
    `rounding_floor(expected)` plus `recompute`: one float32 ulp of the two quantities the backward
    recomputes, dP - D (where it cancels) and the stored LSE, carried into this gradient
    (`baseline_backward` computes it). Why 3x and why the second floor: proofs/L7_backward.md, floating
    point. In short: the backward chains more rounded steps than the forward (P from a rounded LSE, D
    from a rounded O, the difference dP - D), and flash-attn's own suite allows gradients 3x; where
    dP - D cancels exactly, or an LSE happens to round well, a naive evaluation is right by luck, which
    the measured 3x cannot see.
    """
    naive = [naive] if isinstance(naive, np.ndarray) else list(naive)
    return GRAD_FACTOR * max(max_error(n, expected) for n in naive) + rounding_floor(expected) + recompute


@dataclass(frozen=True)
class CheckBackward:
    """The outcome of `check_attention_backward`: errors and tolerances of dq, dk, dv."""

    err_dq: float
    err_dk: float
    err_dv: float
    atol_dq: float
    atol_dk: float
    atol_dv: float


@dataclass(frozen=True)
class BaselineBackward:
    """The float64 gradients of one problem and the tolerances the 3x rule allows around them."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    atol_dq: float
    atol_dk: float
    atol_dv: float


def baseline_backward(q, k, v, dout, *, causal: bool = False, scale: float | None = None,
                      contractions=CONTRACTIONS, mask=None) -> BaselineBackward:
    """Reference gradients and their tolerances, computed once per problem (as `baseline` for the forward)."""
    ref, floors = _dense_backward(q, k, v, dout, causal, scale, np.float64, floors=True, mask=mask)
    naive = [attention_backward_naive_f32(q, k, v, dout, causal=causal, scale=scale, contraction=c, mask=mask)
             for c in contractions]
    atols = [tolerance_backward(r, [n[t] for n in naive], floors[t]) for t, r in enumerate(ref)]
    return BaselineBackward(*ref, *atols)


def judge_backward(dq, dk, dv, base: BaselineBackward, *, name: str = "kernel") -> CheckBackward:
    """Assert (dq, dk, dv) are within the baseline's tolerances; returns the errors."""
    err_dq = assert_close(dq, base.dq, base.atol_dq, name=f"{name} dq")
    err_dk = assert_close(dk, base.dk, base.atol_dk, name=f"{name} dk")
    err_dv = assert_close(dv, base.dv, base.atol_dv, name=f"{name} dv")
    return CheckBackward(err_dq, err_dk, err_dv, base.atol_dq, base.atol_dk, base.atol_dv)


def check_attention_backward(dq, dk, dv, q, k, v, dout, *, causal: bool = False, scale: float | None = None,
                             name: str = "kernel", contractions=CONTRACTIONS, mask=None) -> CheckBackward:
    """Check gradients from any implementation against the float64 reference with the 3x rule (mask as
    in `attention_backward`)."""
    base = baseline_backward(q, k, v, dout, causal=causal, scale=scale, contractions=contractions, mask=mask)
    return judge_backward(dq, dk, dv, base, name=name)
