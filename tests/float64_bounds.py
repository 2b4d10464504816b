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

from bounds import U64
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
