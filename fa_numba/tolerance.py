"""The tolerance rule: how far a float32 result of attention may be from the float64 reference.

The definition itself (`reference.attention`, its float32 twin `reference.attention_naive_f32` in every
summation order of `reference.CONTRACTIONS`, the gradients) is in `fa_numba.reference`; this module holds
the rule that judges an implementation against it (DESIGN.md, proofs/L6_floating_point.md):

    err(x) = max |x - ref_float64|,   pass iff err(x) <= 2 * err(naive float32) + floor + score floor,
    floor  = 2 * max |fl32(ref + 0.3) - 0.3 - ref|, taken at its bound ulp32(max |ref| + 0.3),

and for a tiled order also + the rescaling terms, and for the output of the v1 order + the round-trip term.
`baseline` computes the reference and the tolerances once per problem, `judge` checks a result against them,
`check_attention` does both; `max_error`, `rounding_floor`, `tolerance` and `assert_close` are the pieces.

Refinements, all because the simulator's tensors are tiny (a few dozen entries), where one sample of
rounding noise can be lucky: err(naive float32) is the largest error over five evaluation orders of the
sums (BLAS matmul; plain loops forward and reversed that round every product as a kernel without FMA does;
a balanced tree, as SIMD reductions sum; fused multiply-adds in index order, as a GPU kernel's FFMA loop
does), and the floor is the ulp bound its DESIGN.md formula tends to on large tensors. Three terms are
derived (proofs/L6, parts 3, 4 and 6), with u = U32 = 2^-24 and W_ij = P_ij u |S_ij|, from the S, P and O the
float64 reference materialises (`reference.dense`):

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
- P rounded to 16 bits (the tensor-core kernels, proofs/L6 part 7): P V takes each weight e = exp(s - m(t))
  in [0, 1] rounded to the input's 16-bit type, |fl16(e) - e| <= u16 e + eta16, while l sums the float32
  weights. O moves by at most u16 sum_j P_ij |V_jx| + eta16 (max_j P_ij) sum_j |V_jx| (sum over the row's
  visible keys; e / l = P exp(m_final - m(t)) <= P and 1 / l = max_j P_ij); LSE does not move. u16 = 2^-11,
  eta16 = 2^-25 (half the smallest subnormal) for float16; 2^-8 and 2^-134 for bfloat16. `p_dtype=`.
- tf32 products of float32 inputs (proofs/L6 part 9): 3xTF32 errs by at most eps |a| |b| + eta (|a| + |b|) per
  product, eps = 3 u_t^2 + 2 u_t^3 (u_t = 2^-11: the dropped lo lo product and the residuals' rounding), eta =
  2^-124 (parts below the normal range), plain TF32 by eps = 2 u_t + u_t^2. In Q K^T that is a score perturbation
  dS_ij = |scale| sum_x (eps |q_ix| |k_jx| + eta (|q_ix| + |k_jx|)), moving O and LSE as the score floor's does
  with W = P dS; in P V it is the P-rounding term's form with u16 = eps, eta16 = eta. `products=` ("3xtf32" or
  "tf32").
- the weights by ex2 (every tensor-core forward, proofs/L6 part 10): 2^(fl(s L) - fl(m(t) L)), L = fl(log2 e),
  by ex2.approx.ftz: each weight errs by phi_ij = u (2 |S_ij| + 3 (m_i - S_ij)) + EXP_REL relative and below
  2^-126 absolutely (flushed), moving O by sum_j P_ij phi_ij (|V_jx| + |O_ix|) and LSE by sum_j P_ij phi_ij
  (plus the flushes). Added with `p_dtype=` or `products=`, which name a tensor-core forward (`exp2_terms`).
- with a score mod (`score_mod=`, a `fa_numba.mods.ScoreMod`; proofs/L13 claim 5): the reference and the naive
  evaluations apply it, and the score term's W becomes W' = P u |S| |mod'(S)| (the score's rounding seen
  through the mod).

The gradients' rule (3x, proofs/L7_backward.md) is in `fa_numba.tolerance_backward`, built on this module's
`max_error`, `rounding_floor` and `assert_close`; this module does not import it.

NaN or inf where the reference is finite always fails (`assert_close`); a non-finite reference entry must be
reproduced exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fa_numba import mods, reference, shapes


U32 = 2.0**-24  # unit roundoff of float32, the kernels' arithmetic: |fl(x) - x| <= U32 |x|
# A 16-bit type P is rounded to before P V: (unit roundoff, largest absolute error below its normal range)
P_ROUNDING = {"float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 2.0**-134)}
U_TF32 = 2.0**-11  # unit roundoff of tf32 (10 stored significand bits, round to nearest: cvt.rn)
# Tensor-core products of float32 inputs (proofs/L6 part 9): (eps, eta), one product a b errs by at most
# eps |a| |b| + eta (|a| + |b|): eps relative (3xTF32 drops lo_a lo_b and rounds each residual, plain TF32 rounds
# both operands), eta for the parts below float32's normal range (a subnormal part rounded to tf32, or flushed to
# zero by the tensor core: PTX does not say), per unit of the other operand.
SPLIT_ROUNDING = {"3xtf32": (3 * U_TF32**2 + 2 * U_TF32**3, 2.0**-124), "tf32": (2 * U_TF32 + U_TF32**2, 2.0**-124)}


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
# ex2.approx.ftz.f32 flushes a result below float32's normal range to zero: an absolute error below this
FLUSH = 2.0**-126


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


@dataclass(frozen=True)
class Terms:
    """The derived terms of the tolerance rule, from the float64 reference of one problem (proofs/L6).

    With W_ij = P_ij u |S_ij| (u = U32), the score floor is score_out = max_{i,x} (W |V| + |O| sum_j W)_ix and
    score_lse = max_i sum_j W_ij: what one float32 rounding of every score can move O and LSE by, to first
    order. v1_out = ROUND_TRIP (1 + ROUND_TRIP)^(R - 1) max_{i,x} sum_{t < T_i - 1} |sum_{j < c_1(t)} P_ij V_jx|,
    T_i = visits(...)_i, R = max_i T_i - 1: what v1's round trips of O through HBM can move O by. online_out and
    online_lse: what the online softmax's rescalings (acc and l times alpha = exp(m_old - m_new), both
    orders) can move O and LSE by (proofs/L6, part 6). The tiled terms are None when the tiles were not given.
    p_out: what rounding P to a 16-bit type before P V can move O by (`p_rounding_term`, proofs/L6 part 7).
    split_out, split_lse: what tf32 products of float32 inputs (3xTF32 or plain TF32) can move O and LSE by
    (`split_terms`, proofs/L6 part 9). exp2_out, exp2_lse: what the tensor-core forwards' weights, 2^(s log2(e)
    - m log2(e)) by ex2.approx, can move O and LSE by (`exp2_terms`, proofs/L6 part 10).
    """

    score_out: float
    score_lse: float
    v1_out: float | None = None
    online_out: float | None = None
    online_lse: float | None = None
    p_out: float = 0.0  # P rounded to a 16-bit type before P V (p_rounding_term); 0 for float32 P
    split_out: float = 0.0  # tf32 products of float32 inputs (split_terms, proofs/L6 part 9); 0 without
    split_lse: float = 0.0
    exp2_out: float = 0.0  # the weights by ex2 (exp2_terms, proofs/L6 part 10); 0 for exp
    exp2_lse: float = 0.0

    def cuda_cores(self) -> "Terms":
        """These terms without the tensor-core ones (P's rounding, the tf32 products', the ex2 weights'): what a
        CUDA-core kernel on the same problem is judged with."""
        return replace(self, p_out=0.0, split_out=0.0, split_lse=0.0, exp2_out=0.0, exp2_lse=0.0)


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
    prefix `visits` counts, with any other mask the non-SKIP tiles of its row of the block mask; with a mask
    per batch and head ((B_m, H_m, N_q, N_k) visible) those of its own slice. With
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
    n_q, n_k = visible.shape[-2:]
    t_c = -(-n_k // block_k)
    rows = np.arange(n_q) // block_q
    starts = np.arange(0, n_q, block_q)
    # seen[..., r, t]: query tile r sees a key of key tile t (in its slice); tile_visits[..., i, t] the same for
    # row i's query tile
    seen = np.logical_or.reduceat(np.logical_or.reduceat(visible, starts, axis=-2),
                                  np.arange(0, n_k, block_k), axis=-1)
    tile_visits = seen[..., rows, :]
    last = np.where(tile_visits.any(axis=-1), t_c - 1 - np.argmax(tile_visits[..., ::-1], axis=-1), -1)
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
            rescale = tile_visits[..., t] & (mass > 0) & (tile_max >= running_max - near)
            shift = np.where(rescale, np.maximum(tile_max - running_max, 0.0), 0.0)
            max_shift = max(max_shift, _finite_max(shift))
            error = np.where(rescale, EXP_REL + U32 + U32 * shift, 0.0)  # e(t), 0 where nothing is rescaled
            rescaled += error[..., None] * np.abs(partial)
            rescaled_mass += error * mass
            rescaled_lse += error * mass
            rescales += rescale
            partial += reference.visible_matmul(p[..., c0:c1], v4[..., c0:c1, :], visible[..., c0:c1])
            mass += p[..., c0:c1].sum(axis=-1)
            running_max = np.fmax(running_max, tile_max)
            trip = tile_visits[..., t] & (t < last)  # a round trip after tile t: visited, and not the last visit
            trips += np.where(trip[..., None], np.abs(partial), 0.0)
        rescaled += np.abs(out) * rescaled_mass[..., None]
    return _TileSums(trips, int((tile_visits.sum(axis=-1) - 1).max(initial=0)), rescaled, rescaled_lse,
                     int(rescales.max(initial=0)), max_shift)


def _p_rounding(p_dtype: str) -> tuple[float, float]:
    """(u16, eta16) of the 16-bit type `p_dtype` (P_ROUNDING); a ValueError naming anything else."""
    if p_dtype not in P_ROUNDING:
        raise ValueError(f"p_dtype must be one of {sorted(P_ROUNDING)} (or None for float32 P), got {p_dtype!r}")
    return P_ROUNDING[p_dtype]


def _rounded_operand_bound(a: np.ndarray, b: np.ndarray, visible: np.ndarray, p_dtype: str | None,
                           eta_weight=1.0, rounding: tuple[float, float] | None = None) -> np.ndarray:
    """u16 sum_j |a_ij| |b_jx| + eta16 w_i sum_j |b_jx| over the visible pairs (i, j), entrywise (..., rows, d):
    how far rounding every a_ij of the product a b to `p_dtype`, |fl16(a) - a| <= u16 |a| + eta16, can move
    each entry, when the rounded a_ij reach the result weighted by at most w_i (`eta_weight`, broadcast
    against (..., rows, 1)). a: (..., rows, keys), 0 off the visible pairs; b: (..., keys, d); visible:
    (rows, keys) or (B_m, H_m, rows, keys). A non-finite b that no row sees is never multiplied
    (`reference.visible_matmul`); an entry made NaN by a visible NaN stays NaN, for `_finite_max` to drop.
    rounding: (u16, eta16) given outright instead of `p_dtype`'s (the tf32 products' SPLIT_ROUNDING)."""
    u16, eta16 = _p_rounding(p_dtype) if rounding is None else rounding
    abs_b = np.abs(b)
    with np.errstate(invalid="ignore", over="ignore"):
        weighted = reference.visible_matmul(np.abs(a), abs_b, visible)
        ones = np.broadcast_to(visible, a.shape).astype(np.float64)
        total = reference.visible_matmul(ones, abs_b, visible)
        return u16 * weighted + eta16 * eta_weight * total


def p_rounding_term(p: np.ndarray, v4: np.ndarray, visible: np.ndarray, p_dtype: str) -> float:
    """max_{i,x} u16 sum_j P_ij |V_jx| + eta16 (max_j P_ij) sum_j |V_jx|, sums over the visible keys: how far
    rounding every weight of P V to `p_dtype` can move O (proofs/L6, part 7). The forward rounds
    e = exp(s - m(t)) and divides by l afterwards, so eta16 reaches O times 1 / l = max_j P_ij."""
    _p_rounding(p_dtype)
    with np.errstate(invalid="ignore"):
        weight = p.max(axis=-1, initial=0.0)[..., None]
    return _finite_max(_rounded_operand_bound(p, v4, visible, p_dtype, weight))


def _products(products: str) -> tuple[float, float]:
    """(eps, eta) of the tf32 products `products` (SPLIT_ROUNDING); a ValueError naming anything else."""
    if products not in SPLIT_ROUNDING:
        raise ValueError(f"products must be one of {sorted(SPLIT_ROUNDING)} (or None), got {products!r}")
    return SPLIT_ROUNDING[products]


def score_magnitudes(q, k, scale: float | None = None, eps: float = 1.0, eta: float = 0.0) -> np.ndarray:
    """|scale| sum_x (eps |q_ix| |k_jx| + eta (|q_ix| + |k_jx|)) for every (batch, head, i, j), float64 (GQA: query
    head h with K/V head h // group): the bound on a score's error from products that err by eps |a| |b| +
    eta (|a| + |b|) each (eps = 1, eta = 0: the magnitudes sum_x |q_ix| |k_jx| themselves)."""
    prob = shapes.problem(q, k, k)
    scale = abs(float(shapes.resolve_scale(scale, prob.d)))
    q4, k4 = (np.abs(shapes.as_4d(np.asarray(x)).astype(np.float64)) for x in (q, k))
    k4 = np.repeat(k4, prob.group, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        bound = eps * (q4 @ np.swapaxes(k4, -1, -2))
        if eta:
            bound += eta * (q4.sum(axis=-1)[..., :, None] + k4.sum(axis=-1)[..., None, :])
        return scale * bound


def split_terms(dense: reference.Dense, score_errors: np.ndarray, products: str) -> tuple[float, float]:
    """(out, lse): how far tf32 products of float32 inputs can move O and LSE (proofs/L6 part 9). Each product
    a b errs by at most eps |a| |b| + eta (|a| + |b|) (`SPLIT_ROUNDING[products]`): a score by dS_ij =
    `score_magnitudes(q, k, scale, eps, eta)` (`score_errors`; seen through a score mod's |mod'(S)|), which moves
    O_ix by sum_j P_ij dS_ij (|V_jx| + |O_ix|) and LSE_i by sum_j P_ij dS_ij to first order, as the score floor's
    rounding does; P V's products move O_ix by eps sum_j P_ij |V_jx| + eta (max_j P_ij) sum_j |V_jx| (the
    P-rounding term's form, `p_rounding_term`) and by eta sum_j P_ij = eta for the weights' own parts, which is
    below 2^-98 of the rule's floor and left out (L6 part 9)."""
    eps, eta = _products(products)
    p, v4, visible, out = dense.p, dense.v, dense.visible, dense.out
    with np.errstate(invalid="ignore", over="ignore"):
        ds = score_errors
        if dense.score_mod is not None:
            ds = ds * np.abs(mods.derivatives(dense.score_mod, dense.s_raw, visible))
        w = np.where(p == 0, 0.0, p * ds)
        w_sum = w.sum(axis=-1)
        score_out = reference.visible_matmul(w, np.abs(v4), visible) + np.abs(out) * w_sum[..., None]
        weight = p.max(axis=-1, initial=0.0)[..., None]
        pv_out = _rounded_operand_bound(p, v4, visible, None, weight, rounding=(eps, eta))
    return _finite_max(score_out + pv_out), _finite_max(w_sum)


def ex2_weight_error(score: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """phi = u (2 |S| + 3 gap) + EXP_REL: the relative error of a weight exp(S - m) formed as 2^(fl(S L) - fl(m L)),
    L = fl(log2 e), by ex2.approx, gap = m - S >= 0 (proofs/L6 part 10; the backward's m is LSE, proofs/L7)."""
    return U32 * (2 * np.abs(score) + 3 * gap) + EXP_REL


def exp2_terms(dense: reference.Dense) -> tuple[float, float]:
    """(out, lse): how far computing every weight exp(s - m(t)) as 2^(fl(s L) - fl(m(t) L)), L = fl(log2 e), by
    ex2.approx.ftz (the tensor-core forwards' fold) can move O and LSE (proofs/L6 part 10). Each weight errs by
    phi_ij = u (2 |S_ij| + 3 (m_i - S_ij)) + EXP_REL relative (the argument's three roundings and L's, ex2's
    2 ulps) and by less than FLUSH absolutely (a result below float32's normal range flushed to zero), which
    reaches O as sum_j P_ij phi_ij (|V_jx| + |O_ix|) + FLUSH (max_j P_ij) sum_j (|V_jx| + |O_ix|) and LSE as
    sum_j P_ij phi_ij + FLUSH n_i max_j P_ij (first order; sums over the row's n_i visible keys, S the softmax's
    scores: S' = mod(S) with a score mod, m_i their row max)."""
    p, s, v4, visible, out = dense.p, dense.s, dense.v, dense.visible, dense.out
    with np.errstate(invalid="ignore", over="ignore"):
        m = s.max(axis=-1, keepdims=True)  # the row max over the visible scores (-inf on a dead row: P is 0 there)
        phi = ex2_weight_error(s, m - s)
        w = np.where(p == 0, 0.0, p * phi)  # masked pairs: P = 0 and s = -inf, never multiplied
        del phi
        w_sum = w.sum(axis=-1)
        out_term = reference.visible_matmul(w, np.abs(v4), visible) + np.abs(out) * w_sum[..., None]
        weight = p.max(axis=-1, initial=0.0)[..., None]
        count = np.broadcast_to(visible, p.shape).sum(axis=-1)[..., None]
        out_term += _rounded_operand_bound(p, v4, visible, None, weight, rounding=(0.0, FLUSH))
        out_term += FLUSH * weight * count * np.abs(out)
        lse_term = w_sum + FLUSH * (weight * count)[..., 0]
    return _finite_max(out_term), _finite_max(lse_term)


def _terms(dense: reference.Dense, tiles, p_dtype: str | None = None, split=None, exp2: bool = False) -> Terms:
    """The derived terms from the float64 reference's S, P and O (`reference.dense`); the tiled ones with `tiles`,
    the P-rounding one with `p_dtype`, the tf32 products' with split = (score magnitudes, products), the ex2
    weights' with `exp2`.

    Consumes `dense`: S's memory is reused for W (its S holds W afterwards).
    """
    p, v4, s, visible, out = dense.p, dense.v, dense.s, dense.visible, dense.out
    v1_out = online_out = online_lse = None
    p_out = 0.0 if p_dtype is None else p_rounding_term(p, v4, visible, p_dtype)
    split_out, split_lse = (0.0, 0.0) if split is None else split_terms(dense, *split)
    exp2_out, exp2_lse = exp2_terms(dense) if exp2 else (0.0, 0.0)
    if tiles is not None:
        sums = _tile_sums(p, v4, s, visible, out, tiles)
        v1_out = ROUND_TRIP * (1 + ROUND_TRIP) ** max(sums.max_trips - 1, 0) * _finite_max(sums.trips)
        # each rescaling multiplies the state by (1 + e), |e| <= EXP_REL + 2u + u max|shift|; they compound
        compound = (1 + EXP_REL + 2 * U32 + U32 * sums.max_shift) ** max(sums.max_rescales - 1, 0)
        online_out = compound * _finite_max(sums.rescaled)
        online_lse = compound * _finite_max(sums.rescaled_lse)
    with np.errstate(invalid="ignore", over="ignore"):  # rows the inputs make NaN stay NaN, and are skipped
        if dense.score_mod is None:
            w = np.abs(s, out=s)  # reuse S's memory for W = P u |S|, 0 where P = 0 (a masked P |S| is 0 inf)
        else:  # the score's rounding reaches S' = mod(S) times |mod'(S)| (proofs/L13, claim 5): W' = P u |S| |mod'(S)|
            w = np.abs(dense.s_raw) * np.abs(mods.derivatives(dense.score_mod, dense.s_raw, visible))
        np.copyto(w, 0, where=p == 0)
        w *= p
        w *= U32
        w_sum = w.sum(axis=-1)
        score_out = reference.visible_matmul(w, np.abs(v4), visible) + np.abs(out) * w_sum[..., None]
    return Terms(_finite_max(score_out), _finite_max(w_sum), v1_out, online_out, online_lse, p_out, split_out,
                 split_lse, exp2_out, exp2_lse)


def _finite_max(x: np.ndarray) -> float:
    """max of the finite entries of x (0.0 if none): rows made non-finite by their inputs are judged by
    assert_close's non-finite check, not by a tolerance."""
    finite = x[np.isfinite(x)]
    return float(finite.max()) if finite.size else 0.0


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

    `naive` is one float32 evaluation or a sequence of them (e.g. the `reference.CONTRACTIONS`); err(naive) is the
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
        terms = self.terms
        extra_out, extra_lse = terms.p_out + terms.split_out + terms.exp2_out, terms.split_lse + terms.exp2_lse
        if order is None:
            return self.atol_out + extra_out, self.atol_lse + extra_lse
        if order not in ("v1", "v2"):
            raise ValueError(f"order must be 'v1', 'v2' or None, got {order!r}")
        if self.terms.online_out is None:
            raise ValueError(f"judging order {order!r} needs the tiles: build the baseline with block_q= and block_k=")
        atol_out = (self.atol_out + self.terms.online_out + (self.terms.v1_out if order == "v1" else 0.0)
                    + extra_out)
        return atol_out, self.atol_lse + self.terms.online_lse + extra_lse


def baseline(q, k, v, *, causal: bool = False, scale: float | None = None, contractions=reference.CONTRACTIONS,
             mask=None, block_q: int | None = None, block_k: int | None = None,
             p_dtype: str | None = None, score_mod=None, products: str | None = None) -> Baseline:
    """Reference and tolerances, computed once per problem and shared by every implementation checked.

    The naive float32 baseline is evaluated once per contraction order; pass contractions=("matmul",) on
    large tensors, where one evaluation already samples the rounding noise well and the loops are slow.
    Give the tiles (block_q and block_k) to judge a v1 implementation: its round-trip term depends on them.
    p_dtype ("float16" or "bfloat16"): the implementation rounds P to that type before P V (tensor cores).
    products ("3xtf32" or "tf32"): the implementation multiplies float32 inputs on tensor cores so (`split_terms`).
    Either names a tensor-core forward, whose weights are also ex2's: both add `exp2_terms` (proofs/L6 part 10).
    score_mod (a `fa_numba.mods.ScoreMod` with its grad): the reference and the naive evaluations apply it, and
    the score term carries the mod's derivative, W' = P u |S| |mod'(S)| (proofs/L13, claim 5).
    """
    if score_mod is not None and mods.check_score_mod(score_mod).grad is None:
        raise ValueError(f"score_mod {score_mod.name} has no grad: the rule's score term needs d fn / d score "
                         "(proofs/L13, claim 5)")
    if (block_q is None) != (block_k is None):
        raise ValueError("give both block_q and block_k, or neither")
    tiles = None if block_q is None else (block_q, block_k)
    split = None
    if products is not None:
        if p_dtype is not None:
            raise ValueError("give p_dtype (16-bit P) or products (tf32 products of float32 inputs), not both")
        split = (score_magnitudes(q, k, scale, *_products(products)), products)
    dense = reference.dense(q, k, v, causal=causal, scale=scale, mask=mask, score_mod=score_mod)
    exp2 = p_dtype is not None or products is not None  # a tensor-core forward: its weights by ex2 (L6 part 10)
    (ref_out, ref_lse), terms = dense.result(), _terms(dense, tiles, p_dtype, split, exp2)
    del dense  # its S and P (B H N_q N_k each): the naive evaluations need not hold them beside their own
    naive = [reference.attention_naive_f32(q, k, v, causal=causal, scale=scale, contraction=c, mask=mask,
                                           score_mod=score_mod)
             for c in contractions]
    return Baseline(ref_out, ref_lse, tolerance(ref_out, [n[0] for n in naive], terms.score_out),
                    tolerance(ref_lse, [n[1] for n in naive], terms.score_lse), terms)


def judge(out, lse, base: Baseline, *, name: str = "kernel", order: str | None = None) -> Check:
    """Assert (out, lse) is within the baseline's tolerances for `order`; returns the errors and tolerances."""
    atol_out, atol_lse = base.tolerances(order)
    err_out = assert_close(out, base.out, atol_out, name=f"{name} out")
    err_lse = assert_close(lse, base.lse, atol_lse, name=f"{name} lse")
    return Check(err_out, err_lse, atol_out, atol_lse)


def check_attention(out, lse, q, k, v, *, causal: bool = False, scale: float | None = None, name: str = "kernel",
                    contractions=reference.CONTRACTIONS, mask=None, order: str | None = None,
                    block_q: int | None = None, block_k: int | None = None, p_dtype: str | None = None,
                    score_mod=None, products: str | None = None) -> Check:
    """Check (out, lse) from any implementation against the float64 reference with the derived rule.

    For a v1 implementation pass order="v1" and its tiles, so that its round-trip term is allowed for; for a
    tensor-core one p_dtype, the 16-bit type its P V takes P in, or products ("3xtf32", "tf32") for float32
    inputs on tensor cores; for one that applies a score mod, score_mod.
    """
    base = baseline(q, k, v, causal=causal, scale=scale, contractions=contractions, mask=mask, block_q=block_q,
                    block_k=block_k, p_dtype=p_dtype, score_mod=score_mod, products=products)
    return judge(out, lse, base, name=name, order=order)
