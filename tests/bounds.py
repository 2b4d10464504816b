"""Derived float64 rounding bounds for the property tests: no tolerance here is a guessed constant.

The model (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 2.2), float64, U64 = 2^-53:
- +, -, *, / are correctly rounded: fl(x op y) = (x op y)(1 + d), |d| <= U64;
- np.exp and np.log are within 1 ulp of the correctly rounded result: NumPy asserts this in its own test suite
  (numpy/_core/tests/data/umath-validation-set-{exp,log}.csv, ulperrortol 1 for float64). One ulp of y is at
  most 2 U64 |y|, so fl(exp x) = e^x (1 + d) with |d| <= 1.5 ulp <= EXP = 3 U64, and the same for log;
- an exponent argument is itself rounded: e^{fl(a - b)} = e^{a - b} e^t with |t| <= U64 |a - b|;
- below the normal range a rounding errs by at most half the smallest subnormal in absolute terms instead.

A term that passes through `exps` exponentials, `ops` other roundings, and exponent arguments whose sizes add
up to `gap` is computed as (its exact value)(1 + theta) with

    |theta| <= factor(exps, ops, gap) = (1 + EXP)^exps (1 + U64)^ops e^{U64 gap} - 1,

so a sum of such terms x_g is off by at most sum_g |x_g| factor_g: relative to the condition sum_g |x_g| of
the sum, never to its value, which can cancel (proofs/L2, "In floating point"; proofs/L6, part 5).
Scores computed as scale * (q . k) over d products are off by at most gamma(d + 1) |scale| sum_x |q_x k_x|,
and a perturbation ds_j of the scores moves a softmax output by sum_j P_j (V_j - O) ds_j and its LSE by
sum_j P_j ds_j, to first order.
"""

from __future__ import annotations

import numpy as np

from fa_numba import tolerance

U64 = 2.0**-53  # unit roundoff of float64
EXP = 3 * U64  # relative error of np.exp / np.log in float64: 1 ulp off the correctly rounded value
UNDERFLOW = float(np.finfo(np.float64).smallest_subnormal)  # absolute slack per rounding below the normal range


def gamma(n: int, u: float = U64) -> float:
    """Higham's gamma_n = n u / (1 - n u), in float64's unit roundoff by default (tolerance.gamma, whose
    default is float32's)."""
    return tolerance.gamma(n, u)


def dot_bound(magnitude, n: int):
    """Bound on |computed - exact| of a sum of n products a_j b_j evaluated in any order (index order, reversed,
    a balanced tree, BLAS's blocks, fused multiply-adds): gamma(n) sum_j |a_j b_j| (Higham (3.5): each product
    is rounded at most once and each term meets at most n - 1 additions), plus one half subnormal per rounding
    below the normal range. magnitude = sum_j |a_j b_j| (e.g. |a| @ |b|), any shape."""
    return gamma(n) * np.asarray(magnitude, float) + 2 * n * UNDERFLOW


def factor(exps, ops, gap):
    """Bound on |theta| for a term through `exps` exponentials, `ops` roundings, exponent arguments of total size gap."""
    return (1 + EXP) ** np.asarray(exps, float) * (1 + U64) ** np.asarray(ops, float) * np.exp(U64 * np.asarray(gap)) - 1


# Per-term operation counts of each evaluation order the tests compare, final division included.
# A key's weight gets its own exp, then one rescale per level of the fold or merge tree above its block;
# its product with V_j and the sum inside its block cost at most one rounding per key of the block; each level
# adds a multiplication and an addition, and the end one division. With K blocks of at most b keys
# (b + K <= n + 1) that is at most K exps and b + 2K <= n + K + 1 other roundings.
def dense_counts(n_k: int) -> tuple[int, int]:
    """exp(s - m), P = p / l, then P V: 1 exp, 1 division + n_k roundings in the dot product."""
    return 1, n_k + 1


def online_counts(n: int) -> tuple[int, int]:
    """Any fold or merge tree of online-softmax states over n keys (at most n blocks)."""
    return n, 2 * n + 1


def tiled_counts(n_k: int, block_k: int) -> tuple[int, int]:
    """The tiled spec of either order: T_c levels, plus v1's two roundings per round trip (T_c - 1 of them)."""
    t_c = -(-n_k // block_k)
    return t_c, min(block_k, n_k) + 2 * t_c + 2 * (t_c - 1)


def weighted_sum_bound(logw, x, exps, ops):
    """Bound on |computed - exact| of sum_g e^{logw_g - M} x_g, M = max_g logw_g, where term g passes through
    exps[g] exponentials and ops[g] other roundings and its exponent arguments add up to M - logw_g.

    logw: (G, rows) with -inf for an empty term (exactly 0); x: (G, rows) or (G, rows, D). Returns (rows[, D]).
    This is the bound for merging G online-softmax states (m_g = logw_g, l_g or acc_g = x_g) by any tree.
    """
    logw = np.asarray(logw, float)
    x = np.abs(np.asarray(x, float))
    present = np.isfinite(logw)
    top = np.where(present, logw, -np.inf).max(axis=0)
    gap = np.where(present, np.where(np.isfinite(top), top, 0) - np.where(present, logw, 0), 0)
    weight = np.where(present, np.exp(-gap), 0)
    per_term = weight * factor(np.asarray(exps)[:, None], np.asarray(ops)[:, None], gap)  # (G, rows)
    if x.ndim == 3:
        per_term = per_term[..., None]
    slack = len(logw) * (max(exps) + max(ops)) * UNDERFLOW * max(1.0, float(x.max(initial=0)))
    return (per_term * x).sum(axis=0) + slack


def softmax_bound(scores, values, exps: int, ops: int, sigma=None):
    """Bounds on |computed - exact| of O = softmax(scores) V and LSE = logsumexp(scores), per row.

    scores (..., n) with -inf where masked; values broadcastable to (..., n, D); every key's weight passes through
    at most `exps` exponentials and `ops` roundings (final division included); sigma (..., n), if given, bounds
    the rounding of each score (first-order effect added). Returns (out bound (..., D), lse bound (...)), 0 on
    rows without a visible key (those are compared exactly).
    """
    s = np.asarray(scores, float)
    v = np.asarray(values, float)
    visible = np.isfinite(s)
    top = np.where(visible.any(axis=-1), np.where(visible, s, -np.inf).max(axis=-1), 0.0)
    gap = np.where(visible, top[..., None] - np.where(visible, s, 0), 0.0)
    w = np.where(visible, np.exp(-gap), 0.0)
    l = w.sum(axis=-1)
    nonempty = l > 0
    p = np.divide(w, l[..., None], where=nonempty[..., None], out=np.zeros_like(w))  # P, exact to first order
    out = (p[..., None] * v).sum(axis=-2)
    phi = np.where(visible, factor(exps, ops, gap), 0.0)
    theta_l = (p * phi).sum(axis=-1)  # |relative error of l| (its terms pass through no more roundings)
    assert (theta_l < 0.5).all()
    out_bound = (p[..., None] * np.abs(v) * (phi + theta_l[..., None])[..., None]).sum(axis=-2) / (1 - theta_l[..., None])
    t = -np.log1p(-theta_l)  # |log(1 + theta)| for |theta| <= theta_l
    log_l = np.log(np.where(nonempty, l, 1.0))
    lse_bound = t + EXP * (np.abs(log_l) + t) + U64 * (np.abs(top) + (np.abs(log_l) + t) * (1 + EXP))
    if sigma is not None:
        sig = np.where(visible, sigma, 0.0)
        out_bound = out_bound + (p[..., None] * np.abs(v - out[..., None, :]) * sig[..., None]).sum(axis=-2)
        lse_bound = lse_bound + (p * sig).sum(axis=-1)
    slack = (exps + ops) * s.shape[-1] * UNDERFLOW * max(1.0, float(np.abs(v).max(initial=0)))
    return np.where(nonempty[..., None], out_bound + slack, 0.0), np.where(nonempty, lse_bound + slack, 0.0)


def merge_bound(lse, o, lse_err=0.0, out_err=0.0):
    """Bounds (out (rows, D), lse (rows,)) on |computed - exact| of merging S normalised states (LSE_s, 1, O_s)
    by any fold or tree of online-softmax merges (`split_kv.combine`, the ring's merge), each LSE_s and O_s
    itself within lse_err_s and out_err_s of its exact value: lse (S, rows), -inf for a state with no key;
    o (S, rows, D); the errors broadcast against them.

    The merged O = sum_s pi_s O_s and LSE = log sum_s e^{LSE_s}, pi_s = e^{LSE_s - LSE}. Each state's weight
    passes through at most S exps and 2 S other roundings, final division included (`online_counts(S)`; its
    exponent arguments telescope to M - LSE_s): softmax_bound over the states. The inputs' errors move O by
    sum_s pi_s (|O_s - O| lse_err_s + out_err_s) and LSE by sum_s pi_s lse_err_s to first order (softmax_bound's
    sigma term is the part from lse_err)."""
    lse = np.asarray(lse, float)
    o = np.asarray(o, float)
    splits = lse.shape[0]
    lse_err = np.broadcast_to(np.asarray(lse_err, float), lse.shape)
    out_err = np.broadcast_to(np.asarray(out_err, float), o.shape)
    scores, values = np.moveaxis(lse, 0, -1), np.moveaxis(o, 0, -2)  # (rows, S), (rows, S, D)
    out_bound, lse_bound = softmax_bound(scores, values, *online_counts(splits), sigma=np.moveaxis(lse_err, 0, -1))
    top = np.where(np.isfinite(scores), scores, -np.inf).max(axis=-1, keepdims=True)
    w = np.where(np.isfinite(scores), np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    pi = np.divide(w, w.sum(axis=-1, keepdims=True), where=w.sum(axis=-1, keepdims=True) > 0, out=np.zeros_like(w))
    return out_bound + (pi[..., None] * np.moveaxis(out_err, 0, -2)).sum(axis=-2), lse_bound


def input_rel(scores, values, sigma=None) -> float:
    """The largest relative error, against its magnitude, of the inputs a restated rule term is made of, in one
    dense float64 evaluation: every visible P_ij (softmax_bound with the identity for values, against P_ij) and
    every O_ix (softmax_bound, against sum_j P_ij |V_jx|). scores (..., n), -inf where masked; values (..., n, D)
    broadcastable; sigma: the scores' rounding, if they are not exact."""
    s = np.asarray(scores, float)
    n = s.shape[-1]
    p_err, _ = softmax_bound(s, np.eye(n), *dense_counts(n), sigma=sigma)
    o_err, _ = softmax_bound(s, values, *dense_counts(n), sigma=sigma)
    visible = np.isfinite(s)
    top = np.where(visible.any(axis=-1), np.where(visible, s, -np.inf).max(axis=-1), 0.0)[..., None]
    w = np.where(visible, np.exp(np.where(visible, s, 0.0) - top), 0.0)
    l = w.sum(axis=-1, keepdims=True)
    p = np.divide(w, l, where=l > 0, out=np.zeros_like(w))
    magnitude = (p[..., None] * np.abs(np.asarray(values, float))).sum(axis=-2)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_p = np.where(p > 0, p_err / p, 0.0)
        rel_o = np.where(magnitude > 0, o_err / magnitude, 0.0)
    return float(max(rel_p.max(initial=0.0), rel_o.max(initial=0.0)))


def restated_bound(magnitude, rel: float, degree: int, ops: int):
    """abs for comparing a rule term with its restatement, two float64 evaluations of one expression made of
    inputs each side computes for itself: sums and products of P_ij, |O_ix|, |partial sums of P V| (at most
    `degree` of them in one product), each within rel of its magnitude (input_rel), and each side's own
    arithmetic at most `ops` roundings per term. A product of degree factors each off by rel relative to its
    magnitude is off by at most degree rel (first order) times the product of the magnitudes; the roundings
    add gamma(ops) of it; so each side is within (degree rel + gamma(ops)) magnitude of the exact term, where
    `magnitude` is the expression evaluated with every input replaced by its magnitude (|O| by sum_j P_j |V_j|,
    |a partial sum| by the sum of its terms' absolute values). Two sides: twice that."""
    return 2 * (degree * rel + gamma(ops)) * np.asarray(magnitude, float)


def attention_bound(q, k, v, *, causal: bool, counts: tuple[int, int], scale: float | None = None, mask=None,
                    bias=None, score_ops: int | None = None):
    """Bounds (out (B, H, N_q, d), lse (B, H, N_q)) on |computed - exact| of one float64 evaluation of attention
    (4-D q, k, v) in an order with the given per-term `counts` (exps, ops), score rounding included; `mask`
    a `fa_numba.masks` mask (not with causal=True). bias: an additive score mod (ALiBi's slope (j - i)), the
    same bits on every side, broadcast against (B, H, N_q, N_k): one more rounding of each score,
    sigma' = (1 + U64) sigma + U64 |S + bias|. score_ops: roundings of one score, d + 1 by default (the d-term
    dot product and the product by scale); d + 2 for q . k / sqrt(d) (the quotient and 1 / fl(sqrt(d)) against
    the scale fl(1 / fl(sqrt(d))))."""
    from fa_numba import reference

    q, k, v = (np.asarray(x, float) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    s = scale * q @ np.swapaxes(k, -1, -2)
    sigma = gamma(d + 1 if score_ops is None else score_ops) * abs(scale) * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2))
    if bias is not None:
        s = s + bias
        sigma = (1 + U64) * sigma + U64 * np.abs(s)
    s = np.where(reference.visible_mask(q.shape[2], k.shape[2], causal, mask, q.shape[0], q.shape[1]), s, -np.inf)
    return softmax_bound(s, v[:, :, None], *counts, sigma=sigma)


def assert_within(actual, expected, bound, name="value", equal_nan: bool = False):
    """|actual - expected| <= bound entrywise, -inf and NaN patterns equal; reports the worst ratio.
    equal_nan: NaN is allowed where expected has NaN too (non-finite inputs), and +inf patterns must match."""
    actual, expected = np.asarray(actual, float), np.asarray(expected, float)
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected), err_msg=f"{name}: -inf pattern")
    if equal_nan:
        np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=f"{name}: NaN pattern")
        np.testing.assert_array_equal(np.isposinf(actual), np.isposinf(expected), err_msg=f"{name}: +inf pattern")
    else:
        assert not np.isnan(actual).any(), f"{name}: NaN"
    finite = np.isfinite(expected)
    diff = np.abs(actual[finite] - expected[finite])
    bound = np.broadcast_to(bound, expected.shape)[finite]
    bad = ~(diff <= bound)
    assert not bad.any(), (f"{name}: {int(bad.sum())} entries beyond the derived bound; worst "
                           f"|diff| / bound = {float(np.max(diff[bad] / np.maximum(bound[bad], 1e-300))):.3g}")
