"""First-order float64 error bounds for the backward's tests (derivations: proofs/L7_backward.md, section
"Floating point"). Two float64 computations of the gradients are compared against a bound built from the
gradients' magnitudes, the formulas with every term replaced by its absolute value, and not against a
guessed rtol: at logits around 1e4 the exact dQ and dK are about e^-gap (P is one-hot), far below their
own rounding noise, so max|g| is no scale at all.

Notation as in the lemma, per query head: S_abs_ij = scale sum_x |Q_ix| |K_jx|, A_ij = sum_x |dO_ix| |V_jx|,
B_i = sum_x |dO_ix| |O_ix|, and the magnitudes
    G_dV_j = sum_i P_ij |dO_i|,  G_dQ_i = scale sum_j P_ij (A_ij + B_i) |K_j|,  G_dK_j = scale sum_i P_ij (A_ij + B_i) |Q_i|
(dK, dV summed over the query heads of the group). u = 2^-53, and gamma_n = n u / (1 - n u) is taken as n u
(first order; n u < 1e-12 on every test shape).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from bounds import EXP, U64, UNDERFLOW, dense_counts, gamma, softmax_bound
from fa_numba import reference, shapes


@dataclass(frozen=True)
class Magnitudes:
    """Float64 quantities of one problem that the bounds are made of, in the (B, H, ...) layout."""

    p: np.ndarray  # (B, H, N_q, N_k) probabilities, 0 on masked pairs
    s_abs: np.ndarray  # (B, H, N_q, N_k) scale sum_x |Q_ix| |K_jx| on visible pairs, else 0
    w: np.ndarray  # (B, H, N_q, N_k) dO_i . V_j
    visible: np.ndarray  # (N_q, N_k)
    g: tuple[np.ndarray, np.ndarray, np.ndarray]  # G_dQ (like q), G_dK, G_dV (like k), 4-D
    f_abs: float  # sum_{i,x} |dO_ix| (P |V|)_ix over all heads: the magnitude of <dO, O>
    scale: float
    group: int
    d: int
    n_k: int
    n_q: int
    terms: int  # B H N_q d, the number of terms of <dO, O>


def magnitudes(q, k, v, dout, causal: bool, scale: float | None = None, mask=None) -> Magnitudes:
    """The magnitudes of one problem, with causal masking or any `fa_numba.masks` mask (mask=)."""
    prob = shapes.problem(q, k, v)
    scale = shapes.resolve_scale(scale, prob.d)
    q4, k4, v4, do4 = (shapes.as_4d(np.asarray(x, dtype=np.float64)) for x in (q, k, v, dout))
    k4 = np.repeat(k4, prob.group, axis=1)
    v4 = np.repeat(v4, prob.group, axis=1)
    out, lse = reference.attention(q, k, v, causal=causal, scale=scale, mask=mask)
    out4, lse4 = shapes.as_4d(out), lse.reshape(q4.shape[:-1])
    visible = reference.visible_mask(prob.n_q, prob.n_k, causal, mask)
    s = scale * q4 @ np.swapaxes(k4, -1, -2)
    shift = np.where(np.isneginf(lse4), 0.0, lse4)
    p = np.where(visible, np.exp(np.where(visible, s, -np.inf) - shift[..., None]), 0.0)
    s_abs = np.where(visible, scale * np.abs(q4) @ np.swapaxes(np.abs(k4), -1, -2), 0.0)
    a = np.abs(do4) @ np.swapaxes(np.abs(v4), -1, -2)
    b = (np.abs(do4) * np.abs(out4)).sum(axis=-1)
    mag_ds = p * (a + b[..., None])
    grouped = (prob.batch, prob.heads_kv, prob.group, prob.n_k, prob.d)
    g_dq = scale * mag_ds @ np.abs(k4)
    g_dk = (scale * np.swapaxes(mag_ds, -1, -2) @ np.abs(q4)).reshape(grouped).sum(axis=2)
    g_dv = (np.swapaxes(p, -1, -2) @ np.abs(do4)).reshape(grouped).sum(axis=2)
    f_abs = float((np.abs(do4) * (p @ np.abs(v4))).sum())
    return Magnitudes(p, s_abs, do4 @ np.swapaxes(v4, -1, -2), visible, (g_dq, g_dk, g_dv), f_abs, scale,
                      prob.group, prob.d, prob.n_k, prob.n_q, prob.batch * prob.heads * prob.n_q * prob.d)


def float64_atols(mag: Magnitudes) -> tuple[float, float, float]:
    """Bounds on max |x - y| for two float64 evaluations x, y of (dq, dk, dv) from the same O and LSE.

    Each evaluation is within u kappa G of the exact gradient (first order, L7 floating point), so two
    are within 2 u kappa max G: kappa_P = d S_abs + 2 for P (the d-term dot product S, the subtraction of
    LSE, exp), + d + 2 for dS (dP and D, d terms each; the subtraction and the product), + the terms
    of the last sum (N_k for dQ, N_q group for dK and dV) + 1 for scale.
    """
    kappa_p = mag.d * float(mag.s_abs.max()) + 2
    kappa = (kappa_p + mag.d + 2 + mag.n_k + 1,
             kappa_p + mag.d + 2 + mag.n_q * mag.group + 1,
             kappa_p + mag.n_q * mag.group)
    return tuple(2 * U64 * kap * float(g.max()) for kap, g in zip(kappa, mag.g))


def finite_difference_bounds(mag: Magnitudes, q, k, step: float):
    """Per-entry bounds (like dq, dk, dv, 4-D) on |central difference - exact derivative| of
    f = <dO, O(q, k, v)> in float64 with step h.

    Truncation: |(f(x+h) - f(x-h)) / 2h - f'(x)| <= h^2 / 6 max |f'''|. Along one coordinate, f is a sum
    over rows of E_p[w] with p = softmax(s + t a) and w_j = dO_i . V_j; its third derivative is the joint
    cumulant kappa(w, a, a, a) = E[w a^3] - 3 E[w a] E[a^2] of the centred w, a, so |f_i'''| <= 4 R_w R_a^3
    with R_w, R_a their ranges over the visible keys. For Q_ix, a_j = scale K_jx (row i only); for K_jx,
    a = scale Q_ix on key j of every row i that sees it; f is linear in V (no truncation).
    Rounding: f is evaluated within eps_f = u (2 d S_abs + 2 N_k + terms + 8) f_abs (the forward's S, exp,
    l, P V and the final sum), so the difference adds eps_f / h (the test divides by the actual step
    x_plus - x_minus, so the rounding of x + h adds nothing).
    """
    w = np.where(mag.visible, mag.w, np.nan)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmax of a dead row (all NaN): 0 below
        r_w = np.nan_to_num(np.nanmax(w, axis=-1) - np.nanmin(w, axis=-1))  # (B, H, N_q)
    rounding = U64 * (2 * mag.d * float(mag.s_abs.max()) + 2 * mag.n_k + mag.terms + 8) * mag.f_abs / step
    q4 = shapes.as_4d(np.asarray(q, dtype=np.float64))
    kk = np.repeat(shapes.as_4d(np.asarray(k, dtype=np.float64)), mag.group, axis=1)[:, :, None]  # (B, H, 1, N_k, d)
    vis = mag.visible[None, None, :, :, None]
    k_range = np.where(vis, kk, -np.inf).max(axis=3) - np.where(vis, kk, np.inf).min(axis=3)  # (B, H, N_q, d)
    k_range = np.where(np.isfinite(k_range), k_range, 0.0)  # a dead row: -inf - inf, no key, no derivative
    m3_q = 4 * r_w[..., None] * (mag.scale * k_range) ** 3
    m3_k = np.einsum("bhi,ij,bhix->bhjx", 4 * r_w, mag.visible.astype(float), (mag.scale * np.abs(q4)) ** 3)
    b, h, n_k, d = m3_k.shape
    m3_k = m3_k.reshape(b, h // mag.group, mag.group, n_k, d).sum(axis=2)
    trunc = step**2 / 6
    return trunc * m3_q + rounding, trunc * m3_k + rounding, np.zeros_like(m3_k) + rounding


def recomputed_p_rel(p, sigma, lse_err):
    """Bound r_ij on the relative error of P_ij recomputed as fl(exp(fl(s_ij - LSE_i))) (`online_softmax.recompute_p`)
    against the exact softmax P_ij of the exact scores, when the scores s are within sigma_ij (..., N_q, N_k) and
    the LSE within lse_err_i (..., N_q) of their exact values:

        p_ij = P_ij e^{ds - dl + t} (1 + e),  |ds| <= sigma_ij, |dl| <= lse_err_i, |e| <= EXP,
        |t| <= U64 |s_ij - LSE_i| <= U64 (-log P_ij + sigma_ij + lse_err_i)   (the rounded exponent argument),

    so r_ij = (1 + EXP) e^{a + U64 (-log P_ij + a)} - 1 with a = sigma_ij + lse_err_i. p: the softmax in float64,
    standing for the exact P in the bound's own magnitudes (first order); r = 0 where p = 0 (masked or below the
    subnormals: the comparisons add UNDERFLOW slack for those)."""
    p = np.asarray(p, float)
    with np.errstate(divide="ignore"):
        gap = np.where(p > 0, -np.log(np.where(p > 0, p, 1.0)), 0.0)
    a = np.where(p > 0, sigma + np.asarray(lse_err, float)[..., None], 0.0)
    return (1 + EXP) * np.exp(a + U64 * (gap + a)) - 1


def backward_bounds(q, k, v, dout, *, causal: bool = False, mask=None, scale: float | None = None, bias=None):
    """Per-entry bounds (dq like q, dk like k, dv like v, ds (B, H, N_q, N_k)), all 4-D, on |computed - exact| of
    one float64 evaluation of the gradients that recomputes its own forward: the reference's (P from its LSE,
    D = dO . O) or autograd through a softmax (P = e / l saved by the forward, D = sum_j P_j dP_j, torch's SDPA
    math path, which scales q and k by sqrt(scale) each). Two such evaluations, in any orders, are within the
    sum of their bounds. First order, the magnitudes from the float64 values themselves; u = U64:

    - scores: sigma = gamma(d + 4) |scale| sum_x |Q_ix| |K_jx| (d products and sums, two scalings, sqrt(scale)'s
      own rounding); with an additive `bias` (an ALiBi-like score mod, the same bits on both sides, broadcast
      against (B, H, N_q, N_k)) one more rounding, (1 + u) sigma + u |S + bias|;
    - O and LSE: softmax_bound in the dense order, omega and lambda;
    - P: relative rho = recomputed_p_rel(P, sigma, lambda) + (N_k + 2) u, which covers e / l too (its exp, the
      N_k-term sum and the division, the scores' errors through sum_k P_k sigma_k <= lambda), plus 2 UNDERFLOW
      absolute (a P below the normal range): E_P = P rho + 2 UNDERFLOW;
    - dP = dO . V: gamma(d_v) A, A_ij = sum_x |dO_ix| |V_jx|; D: the larger of gamma(d_v) B_i + sum_x |dO_ix|
      omega_ix (dO . O) and sum_j (E_P + P (gamma(N_k) + gamma(d_v))) A_ij (sum_j P dP);
    - dS = P (dP - D): E_P |dP - D| + P (gamma(d_v) A + E_D) + gamma(2) |dS|;
    - dV_j = sum_i P_ij dO_i over the N_q g rows of the group: sum_i E_P |dO| + gamma(N_q g + 1) sum_i P |dO|;
      dQ_i = scale sum_j dS_ij K_j: |scale| (sum_j E_dS |K_j| + gamma(N_k + 4) sum_j |dS| |K_j|) (the N_k-term
      sum, and K sqrt(scale), the product by sqrt(scale) and sqrt(scale)'s rounding twice on torch's path); dK
      likewise over the N_q g rows, gamma(N_q g + 4).

    Returns those four and |dS| (B, H, N_q, N_k), the magnitudes of the terms of a sum over dS (a score mod's
    captured gradient).
    """
    from fa_numba import reference

    q, k, v, dout = (np.asarray(x, float) for x in (q, k, v, dout))
    batch, heads, n_q, d = q.shape
    group = heads // k.shape[1]
    n_k, d_v = k.shape[2], v.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    k4, v4 = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    kt = np.swapaxes(k4, -1, -2)
    s = scale * q @ kt
    sigma = gamma(d + 4) * abs(scale) * (np.abs(q) @ np.abs(kt))
    if bias is not None:
        s = s + bias
        sigma = (1 + U64) * sigma + U64 * np.abs(s)
    visible = np.broadcast_to(reference.visible_mask(n_q, n_k, causal, mask, batch, heads), s.shape)
    s = np.where(visible, s, -np.inf)
    sigma = np.where(visible, sigma, 0.0)
    omega, lam = softmax_bound(s, v4[:, :, None], *dense_counts(n_k), sigma=sigma)
    top = np.where(visible.any(axis=-1), s.max(axis=-1), 0.0)[..., None]
    w = np.where(visible, np.exp(s - top), 0.0)
    l = w.sum(axis=-1, keepdims=True)
    p = np.divide(w, l, where=l > 0, out=np.zeros_like(w))
    out = p @ v4
    rho = np.where(visible, recomputed_p_rel(p, sigma, lam) + (n_k + 2) * U64, 0.0)
    p_err = np.where(visible, p * rho + 2 * UNDERFLOW, 0.0)  # a P below the normal range errs absolutely
    a = np.abs(dout) @ np.swapaxes(np.abs(v4), -1, -2)
    b = (np.abs(dout) * np.abs(out)).sum(axis=-1)
    dp = dout @ np.swapaxes(v4, -1, -2)
    big_d = (dout * out).sum(axis=-1)
    e_d = np.maximum(gamma(d_v) * b + (np.abs(dout) * omega).sum(axis=-1),
                     ((p_err + p * (gamma(n_k) + gamma(d_v))) * a).sum(axis=-1))
    spread = np.abs(dp - big_d[..., None])
    ds = p * spread
    e_ds = p_err * spread + p * (gamma(d_v) * a + e_d[..., None]) + gamma(2) * ds
    rows = n_q * group
    grouped = (batch, k.shape[1], group, n_k)
    pt, e_dst, dst = (np.swapaxes(x, -1, -2) for x in (p, e_ds, ds))
    dv = np.swapaxes(p_err, -1, -2) @ np.abs(dout) + gamma(rows + 1) * pt @ np.abs(dout)
    dk = abs(scale) * (e_dst @ np.abs(q) + gamma(rows + 4) * dst @ np.abs(q))
    dq = abs(scale) * (e_ds @ np.abs(k4) + gamma(n_k + 4) * ds @ np.abs(k4))
    dk, dv = (x.reshape(grouped + x.shape[-1:]).sum(axis=2) for x in (dk, dv))
    return dq, dk, dv, e_ds, ds
