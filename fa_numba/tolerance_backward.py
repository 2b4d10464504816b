"""The gradients' rule: how far float32 gradients (dq, dk, dv) of attention may be from the float64 reference.

The forward's rule is in `fa_numba.tolerance`; this module holds the rule that judges the gradients
(proofs/L7_backward.md, floating point; its floors are L6's float32 ulp placed where the backward needs it):
`baseline_backward` / `judge_backward` / `check_attention_backward` judge (dq, dk, dv) by
err <= 3 err(naive float32) + floor, err(naive) from `reference.attention_backward_naive_f32`, the floor adding
one float32 ulp of what the backward recomputes (dP - D where it cancels, and LSE; `_recompute_floors`) to
`rounding_floor`. Each takes `mask=` as the forward does. A tensor-core backward rounds P (before dV = P^T dO)
and dS (before dK = scale dS^T Q and dQ = scale dS K) to the 16-bit type: `p_dtype=` adds
`grad_rounding_terms`' u16 sum |a| |b| + eta16 sum |b| per gradient; one that takes float32 inputs' products
by tf32 parts (3xTF32) adds `grad_split_terms` with `products=`. With a score mod (`score_mod=`,
proofs/L13) the floors carry |mod'(S)|, and `baseline_captured` / `check_captured_gradients` judge the
gradients of the mod's captured arrays by the same 3x rule, entry by entry (L13, claim 4).

From `fa_numba.tolerance` it takes the forward rule's pieces as they are: `max_error`, `rounding_floor` and
`assert_close` (the error, the floor, the entrywise check with its non-finite cases), and four private helpers,
`_p_rounding` (a 16-bit type's (u16, eta16), P_ROUNDING), `_products` (the tf32 products' (eps, eta),
SPLIT_ROUNDING), `_rounded_operand_bound` (how far rounding one operand of a product to 16 bits moves it) and
`_finite_max` (the max over the finite entries); and the ex2 weights'
error, `ex2_weight_error` and FLUSH, which the tensor-core backward's recomputed P shares with the forward's
weights. `fa_numba.tolerance` does not import this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_numba import mods, reference
from fa_numba.tolerance import (FLUSH, _finite_max, _p_rounding, _products, _rounded_operand_bound, assert_close,
                                ex2_weight_error, max_error, rounding_floor)


# ----------------------------------------------------------------------------------------------------
# The gradients' rule (proofs/L7_backward.md, DESIGN.md): 3x instead of 2x, as flash-attn's own suite, and a
# floor for what the backward recomputes.

GRAD_FACTOR = 3.0
ULP32_PER_UNIT = 2.0**-23  # ulp32(x) <= 2^-23 |x|: the float32 spacing relative to the magnitude


def _ds_floor(grads: reference.DenseBackward) -> tuple[np.ndarray, np.ndarray]:
    """(e, p_lse), (B, H, N_q, N_k) each, 0 off the visible pairs: the floor of dS' = P (dP - D) per pair (the
    two recomputed quantities, `_recompute_floors` says which), and P ulp(LSE), the floor of P."""
    p, dp, d_row, shift, visible = grads.p, grads.dp, grads.d_row, grads.shift, grads.visible
    zero = p.dtype.type(0)
    with np.errstate(invalid="ignore", over="ignore"):
        mag_dp = np.matmul(np.abs(grads.dout), np.swapaxes(np.abs(grads.v), -1, -2))  # sum_x |dO_ix| |V_jx|
        mag_d = (np.abs(grads.dout) * np.abs(grads.out)).sum(axis=-1)  # sum_x |dO_ix| |O_ix|
        p_lse = np.where(visible, p * ULP32_PER_UNIT * np.abs(shift)[..., None], zero)  # P ulp(LSE)
        e = np.where(visible, p * ULP32_PER_UNIT * (mag_dp + mag_d[..., None]) + p_lse * np.abs(dp - d_row[..., None]),
                     zero)
    return e, p_lse


def _recompute_floors(grads: reference.DenseBackward) -> tuple[float, float, float]:
    """The floors of dq, dk, dv for what the backward recomputes, from the float64 reference's P, dP, D and
    its operands (`reference.dense_backward`).

    Two floors that a naive evaluation can be right about by luck (proofs/L7, floating point), each one
    float32 ulp at the magnitude of the data, ulp32(x) <= 2^-23 |x| (L6's floor, placed where the backward
    needs it):
    - the cancellation dP_ij - D_i: two d-term dot products, exactly equal where a row sees one key or its
      P is one-hot; an evaluation that rounds both alike has dS = 0 exactly, 3x its error is 0. One ulp
      each at the magnitude of its terms, sum_x |dO_ix| |V_jx| and sum_x |dO_ix| |O_ix|, times P_ij.
    - the stored LSE_i, rounded at its magnitude: one ulp of it is a relative error of every P_ij of the
      row, times |dP_ij - D_i| in dS and times |dO_i| in dV (a forward whose LSE is a few ulps off is
      still right by the forward's rule).
    Carried into dQ = scale dS K, dK = scale dS^T Q and dV = P^T dO, over the visible pairs only as the
    gradients are (L7.8): a NaN or inf that a row or key cannot see (padding, say) must not make its
    floor NaN, which _finite_max would drop, leaving the row judged without its floor.
    With a score mod (proofs/L13) dS = dS' mod'(S): both floors enter dq and dk times |mod'(S)| (dv's, through
    P only, is unchanged).
    """
    q4, k4, do4, visible, scale = grads.q, grads.k, grads.dout, grads.visible, grads.scale
    prob = grads.problem
    zero = grads.p.dtype.type(0)
    grouped = (prob.batch, prob.heads_kv, prob.group, prob.n_k, -1)  # d for dk, d_v for dv
    e, p_lse = _ds_floor(grads)
    with np.errstate(invalid="ignore", over="ignore"):
        if grads.mod_grad is not None:  # dS = dS' mod'(S) (L13): the floors of dS' carried through mod'
            e = np.where(visible, e * np.abs(grads.mod_grad), zero)
        # magnitudes: |scale|, so that a negative scale gives the same (non-negative) floor as its opposite
        floor_dq = abs(scale) * reference.visible_matmul(e, np.abs(k4), visible)
        visible_t = np.swapaxes(visible, -1, -2)  # visible.T, per slice for a mask per batch and head
        floor_dk = (abs(scale) * reference.visible_matmul(np.swapaxes(e, -1, -2), np.abs(q4), visible_t)
                    ).reshape(grouped).sum(axis=2)
        floor_dv = reference.visible_matmul(np.swapaxes(p_lse, -1, -2), np.abs(do4), visible_t
                                            ).reshape(grouped).sum(axis=2)
    return _finite_max(floor_dq), _finite_max(floor_dk), _finite_max(floor_dv)


def _sink_floor(grads: reference.DenseBackward, sinks) -> float:
    """The recomputation floor of dsinks_h = -sum_{b, i} P_sink (D_i - dlse_i), P_sink = exp(s_h - LSE_i)
    (proofs/L14), as `_recompute_floors` places it: one ulp of the stored LSE_i in every P_sink (times
    |D_i - dlse_i|) and one ulp of D's terms, sum_x |dO_ix| |O_ix| (times P_sink), summed over the rows. With a
    finite sink every LSE_i is finite (shift = LSE); a sink of -inf has P_sink = 0."""
    sink = np.asarray(sinks, dtype=grads.p.dtype)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        p_sink = np.exp(sink - grads.shift)
        mag_d = (np.abs(grads.dout) * np.abs(grads.out)).sum(axis=-1)
        rows = p_sink * ULP32_PER_UNIT * (np.abs(grads.shift) * np.abs(grads.d_row) + mag_d)
    return _finite_max(rows.sum(axis=(0, 2)))


def grad_rounding_terms(grads: reference.DenseBackward, p_dtype: str) -> tuple[float, float, float]:
    """(term_dq, term_dk, term_dv): how far rounding P and dS to the 16-bit type `p_dtype` before their products
    (a tensor-core backward) can move each entry of dq, dk, dv (proofs/L7, floating point), from the float64
    reference's P, dP, D and operands (`reference.dense_backward`).

    Each rounded operand errs by |fl16(a) - a| <= u16 |a| + eta16 (P_ROUNDING), and enters its gradient once,
    linearly; the float32 products and sums are the 3x rule's. With dS_ij = P_ij (dP_ij - D_i), over the
    visible pairs only (a NaN or inf that no row sees stays out, as in `_recompute_floors`):

        term_dv = max_{j,x} sum_{h in group} sum_i (u16 P_ij + eta16) |dO_ix|,
        term_dk = |scale| max_{j,x} sum_{h in group} sum_i (u16 |dS_ij| + eta16) |Q_ix|,
        term_dq = |scale| max_{i,x} sum_j (u16 |dS_ij| + eta16) |K_jx|.

    With a score mod, P is exp(mod(S) - LSE) and the rounded dS is dS' mod'(S) (proofs/L13), what such a kernel
    rounds. Unlike the forward's (`p_rounding_term`) eta16 has no factor: P is already normalised when it is rounded,
    and a dS far below the type's normal range (tiny dO) is rounded to its subnormals with this absolute error.
    """
    _p_rounding(p_dtype)  # a bad p_dtype is a ValueError naming it
    q4, k4, do4, p, dp, d_row = grads.q, grads.k, grads.dout, grads.p, grads.dp, grads.d_row
    visible, prob = grads.visible, grads.problem
    grouped = (prob.batch, prob.heads_kv, prob.group, prob.n_k, -1)  # d for dk, d_v for dv
    with np.errstate(invalid="ignore", over="ignore"):  # rows the inputs make NaN stay NaN and are skipped
        ds = np.where(visible, p * (dp - d_row[..., None]), p.dtype.type(0))  # dS, 0 off the visible pairs
        if grads.mod_grad is not None:  # with a score mod the rounded operand is dS = dS' mod'(S) (proofs/L13)
            ds = np.where(visible, ds * grads.mod_grad, p.dtype.type(0))
        term_dq = abs(grads.scale) * _rounded_operand_bound(ds, k4, visible, p_dtype)
        visible_t = np.swapaxes(visible, -1, -2)  # visible.T, per slice for a mask per batch and head
        term_dk = (abs(grads.scale) * _rounded_operand_bound(np.swapaxes(ds, -1, -2), q4, visible_t, p_dtype)
                   ).reshape(grouped).sum(axis=2)
        term_dv = _rounded_operand_bound(np.swapaxes(p, -1, -2), do4, visible_t, p_dtype).reshape(grouped).sum(axis=2)
    return _finite_max(term_dq), _finite_max(term_dk), _finite_max(term_dv)


def weight_errors(grads: reference.DenseBackward) -> np.ndarray:
    """phi_ij = u (2 |S_ij| + 3 (LSE_i - S_ij)) + EXP_REL on the visible pairs with P_ij > 0, else 0: the relative
    error of P_ij = exp(S_ij - LSE_i) recomputed as 2^(fl(S_ij L) - fl(LSE_i L)) by ex2.approx (proofs/L7, the ex2
    weights; the forward's bound of proofs/L6 part 10 with LSE_i in place of the running max). S is the softmax's
    score (S' = mod(S) with a score mod), read off P itself: LSE_i - S_ij = -log P_ij."""
    p, lse = grads.p, grads.shift[..., None]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        gap = -np.log(np.where(p > 0, p, 1.0))  # LSE_i - S_ij >= 0
        phi = ex2_weight_error(lse - gap, gap)
    return np.where(p > 0, phi, 0.0)


def grad_exp2_terms(grads: reference.DenseBackward) -> tuple[float, float, float]:
    """(term_dq, term_dk, term_dv): how far recomputing P as 2^(fl(S L) - fl(LSE L)) by ex2.approx.ftz (the
    tensor-core backward) can move dq, dk, dv (proofs/L7, the ex2 weights). P_ij errs by phi_ij P_ij
    (`weight_errors`) and by less than FLUSH where ex2 flushes it to zero; P enters dV = P^T dO and dS =
    P (dP - D) (times mod'(S) with a score mod) linearly, so, over the visible pairs:

        term_dv = max_{j,x} sum_{h in group} sum_i (phi_ij P_ij + FLUSH) |dO_ix|,
        term_dk = |scale| max_{j,x} sum_{h in group} sum_i (phi_ij |dS_ij| + FLUSH |dP_ij - D_i| |mod'|) |Q_ix|,
        term_dq = |scale| max_{i,x} sum_j (phi_ij |dS_ij| + FLUSH |dP_ij - D_i| |mod'|) |K_jx|.
    """
    q4, k4, do4, p, dp, d_row = grads.q, grads.k, grads.dout, grads.p, grads.dp, grads.d_row
    visible, prob = grads.visible, grads.problem
    grouped = (prob.batch, prob.heads_kv, prob.group, prob.n_k, -1)
    visible_t = np.swapaxes(visible, -1, -2)
    phi = weight_errors(grads)
    exact = (1.0, 0.0)  # _rounded_operand_bound's (u, eta) for sum_j |a_ij| |b_jx| as it is
    with np.errstate(invalid="ignore", over="ignore"):  # rows the inputs make NaN stay NaN and are skipped
        spread = np.where(visible, dp - d_row[..., None], p.dtype.type(0))  # dP - D: what P multiplies in dS
        if grads.mod_grad is not None:
            spread = np.where(visible, spread * grads.mod_grad, p.dtype.type(0))
        ds_part = phi * np.abs(p * spread) + FLUSH * np.abs(spread)
        term_dq = abs(grads.scale) * _rounded_operand_bound(ds_part, k4, visible, None, rounding=exact)
        term_dk = (abs(grads.scale) * _rounded_operand_bound(np.swapaxes(ds_part, -1, -2), q4, visible_t, None,
                                                             rounding=exact)).reshape(grouped).sum(axis=2)
        p_part = np.swapaxes(phi * p, -1, -2)
        term_dv = (_rounded_operand_bound(p_part, do4, visible_t, None, rounding=exact)
                   + _rounded_operand_bound(np.ones_like(p_part), do4, visible_t, None, rounding=(0.0, FLUSH))
                   ).reshape(grouped).sum(axis=2)
    return _finite_max(term_dq), _finite_max(term_dk), _finite_max(term_dv)


def grad_split_terms(grads: reference.DenseBackward, products: str = "3xtf32") -> tuple[float, float, float]:
    """(term_dq, term_dk, term_dv): how far taking every product of the backward by tf32 parts (3xTF32, the
    tensor-core backward of float32 inputs) can move dq, dk, dv (proofs/L7, the 3xTF32 backward). Each product a b
    errs by at most eps |a| |b| + eta (|a| + |b|) (`tolerance.SPLIT_ROUNDING[products]`), so, over the visible
    pairs, with M = |mod'(S)| (1 without a score mod):
    - a score by sigma_ij = |scale| sum_x (eps |Q_ix| |K_jx| + eta (|Q_ix| + |K_jx|)), so P_ij by the relative
      phi_ij = expm1(M sigma_ij), and dP_ij by delta_ij = sum_x (eps |dO_ix| |V_jx| + eta (|dO_ix| + |V_jx|));
    - dS_ij = P_ij (dP_ij - D_i) M by err_ij = (phi_ij |P_ij (dP_ij - D_i)| + (1 + phi_ij) P_ij delta_ij) M;
    - the gradients' own products, on operands already that far off:

        term_dv = max_{j,x} sum_{h in group} sum_i (phi_ij P_ij |dO_ix| + eps P'_ij |dO_ix| + eta (P'_ij + |dO_ix|)),
        term_dk = |scale| max_{j,x} sum_{h in group} sum_i (err_ij |Q_ix| + eps |dS'_ij| |Q_ix|
                  + eta (|dS'_ij| + |Q_ix|)),
        term_dq = |scale| max_{i,x} sum_j (err_ij |K_jx| + eps |dS'_ij| |K_jx| + eta (|dS'_ij| + |K_jx|)),

      P' = (1 + phi) P and |dS'| = |dS| + err the perturbed operands' magnitudes. First order in the products' errors
    as the forward's split term (L6 part 9); the float32 roundings are the 3x rule's, the ex2 weights
    `grad_exp2_terms`'."""
    eps, eta = _products(products)
    q4, k4, v4, do4, p, dp, d_row = grads.q, grads.k, grads.v, grads.dout, grads.p, grads.dp, grads.d_row
    visible, prob, zero = grads.visible, grads.problem, grads.p.dtype.type(0)
    grouped = (prob.batch, prob.heads_kv, prob.group, prob.n_k, -1)
    visible_t = np.swapaxes(visible, -1, -2)

    def product_error(a, b):  # sum_j |a_ij| |b_jx| eps + eta (|a_ij| + |b_jx|) over the visible j
        exact = _rounded_operand_bound(a, b, visible, None, rounding=(eps, eta))
        return exact + eta * np.abs(a).sum(axis=-1)[..., None]

    with np.errstate(invalid="ignore", over="ignore"):  # rows the inputs make NaN stay NaN and are skipped
        aq, ak, av, ado = np.abs(q4), np.abs(k4), np.abs(v4), np.abs(do4)
        sigma = abs(grads.scale) * (eps * (aq @ np.swapaxes(ak, -1, -2))
                                    + eta * (aq.sum(axis=-1)[..., :, None] + ak.sum(axis=-1)[..., None, :]))
        delta = eps * (ado @ np.swapaxes(av, -1, -2)) + eta * (ado.sum(axis=-1)[..., :, None]
                                                              + av.sum(axis=-1)[..., None, :])
        slope = np.abs(grads.mod_grad) if grads.mod_grad is not None else 1.0
        phi = np.where(visible & (p > 0), np.expm1(sigma * slope), zero)
        ds = np.where(visible, p * (dp - d_row[..., None]) * slope, zero)  # |dS| with the mod's factor
        err = np.where(visible, (phi * np.abs(ds) + (1 + phi) * p * delta * slope), zero)
        ds_mag = np.abs(ds) + err
        exact = (1.0, 0.0)
        term_dq = abs(grads.scale) * (_rounded_operand_bound(err, k4, visible, None, rounding=exact)
                                      + product_error(ds_mag, k4))
        err_t, ds_t = np.swapaxes(err, -1, -2), np.swapaxes(ds_mag, -1, -2)
        term_dk = abs(grads.scale) * (
            _rounded_operand_bound(err_t, q4, visible_t, None, rounding=exact)
            + _rounded_operand_bound(ds_t, q4, visible_t, None, rounding=(eps, eta))
            + eta * ds_t.sum(axis=-1)[..., None]).reshape(grouped).sum(axis=2)
        p_t, phi_p_t = np.swapaxes((1 + phi) * p, -1, -2), np.swapaxes(phi * p, -1, -2)
        term_dv = (_rounded_operand_bound(phi_p_t, do4, visible_t, None, rounding=exact)
                   + _rounded_operand_bound(p_t, do4, visible_t, None, rounding=(eps, eta))
                   + eta * p_t.sum(axis=-1)[..., None]).reshape(grouped).sum(axis=2)
    return _finite_max(term_dq), _finite_max(term_dk), _finite_max(term_dv)


def tolerance_backward(expected: np.ndarray, naive, recompute: float = 0.0) -> float:
    """atol = 3 * err(naive float32) + floor for one gradient (dq, dk or dv): `tolerance` with 3x.

    `naive` is one float32 evaluation or a sequence of them (the `reference.CONTRACTIONS`). The floor is
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
    dsinks: np.ndarray | None = None  # with sinks: their gradient (H,) and its atol
    atol_dsinks: float = 0.0


def baseline_backward(q, k, v, dout, *, causal: bool = False, scale: float | None = None,
                      contractions=reference.CONTRACTIONS, mask=None, p_dtype: str | None = None,
                      score_mod=None, products: str | None = None, sinks=None, dlse=None) -> BaselineBackward:
    """Reference gradients and their tolerances, computed once per problem (as `baseline` for the forward).

    p_dtype ("float16" or "bfloat16"): the implementation rounds P (before dV) and dS (before dK and dQ) to
    that type (a tensor-core backward); each gradient's atol gets `grad_rounding_terms`' term, and
    `grad_exp2_terms`' (such a backward recomputes P by ex2). None: float32.
    products ("3xtf32"): the implementation takes every product by tf32 parts (the tensor-core backward of
    float32 inputs): each gradient's atol gets `grad_split_terms`' term and `grad_exp2_terms`'. Not with p_dtype.
    score_mod (a `fa_numba.mods.ScoreMod` with its grad): the reference and the naive evaluations apply it
    (the mod and its derivative on float32 scalars, each rounded to float32 once, as the kernels evaluate
    them), and the recomputation floors carry |mod'(S)| (`_recompute_floors`; proofs/L13, the kernels).
    With both, the 16-bit terms round P = exp(mod(S) - LSE) and dS = dS' mod'(S), what a tensor-core backward
    with the mod rounds (`grad_rounding_terms`).
    sinks, dlse (proofs/L14): the forward's sink logits and LSE's cotangent, in the reference and the naive
    evaluations; with sinks, dsinks is judged by the same 3x rule with its own recomputation floor
    (`_sink_floor`). The 16-bit and tf32 terms are the ones without sinks: a sink only lowers every P.
    """
    if p_dtype is not None:
        _p_rounding(p_dtype)  # a bad p_dtype fails before the reference is computed
    if products is not None:
        _products(products)  # a bad products fails before the reference is computed
        if p_dtype is not None:
            raise ValueError("p_dtype (16-bit products) and products (tf32 parts of float32) name two different "
                             "tensor-core backwards: give one")
    grads = reference.dense_backward(q, k, v, dout, causal=causal, scale=scale, mask=mask, score_mod=score_mod,
                                     sinks=sinks, dlse=dlse)
    ref, floors = (grads.dq, grads.dk, grads.dv), _recompute_floors(grads)
    if sinks is not None:
        ref, floors = ref + (grads.dsinks,), floors + (_sink_floor(grads, sinks),)
    terms = (0.0, 0.0, 0.0)
    if p_dtype is not None:  # a tensor-core backward: P and dS rounded to 16 bits, P recomputed by ex2
        terms = tuple(a + b for a, b in zip(grad_rounding_terms(grads, p_dtype), grad_exp2_terms(grads)))
    elif products is not None:  # the float32 inputs' tensor-core backward: tf32 parts, P recomputed by ex2
        terms = tuple(a + b for a, b in zip(grad_split_terms(grads, products), grad_exp2_terms(grads)))
    del grads  # its P and dP (B H N_q N_k each): the naive evaluations need not hold them beside their own
    naive = [reference.attention_backward_naive_f32(q, k, v, dout, causal=causal, scale=scale, contraction=c, mask=mask,
                                                    score_mod=score_mod, sinks=sinks, dlse=dlse)
             for c in contractions]
    terms += (0.0,) * (len(ref) - 3)
    atols = [tolerance_backward(r, [n[t] for n in naive], floors[t]) + terms[t] for t, r in enumerate(ref)]
    if sinks is None:
        return BaselineBackward(*ref, *atols)
    return BaselineBackward(*ref[:3], *atols[:3], ref[3], atols[3])


def judge_backward(dq, dk, dv, base: BaselineBackward, *, name: str = "kernel", dsinks=None) -> CheckBackward:
    """Assert (dq, dk, dv) are within the baseline's tolerances, and dsinks for a baseline with sinks (which
    must be given then); returns the errors of dq, dk, dv."""
    if (dsinks is None) != (base.dsinks is None):
        raise ValueError("give dsinks exactly when the baseline was built with sinks")
    if dsinks is not None:
        assert_close(dsinks, base.dsinks, base.atol_dsinks, name=f"{name} dsinks")
    err_dq = assert_close(dq, base.dq, base.atol_dq, name=f"{name} dq")
    err_dk = assert_close(dk, base.dk, base.atol_dk, name=f"{name} dk")
    err_dv = assert_close(dv, base.dv, base.atol_dv, name=f"{name} dv")
    return CheckBackward(err_dq, err_dk, err_dv, base.atol_dq, base.atol_dk, base.atol_dv)


def check_attention_backward(dq, dk, dv, q, k, v, dout, *, causal: bool = False, scale: float | None = None,
                             name: str = "kernel", contractions=reference.CONTRACTIONS, mask=None,
                             p_dtype: str | None = None, score_mod=None, products: str | None = None
                             ) -> CheckBackward:
    """Check gradients from any implementation against the float64 reference with the 3x rule (mask as
    in `attention_backward`; p_dtype for a tensor-core backward, the 16-bit type P and dS are rounded to;
    products="3xtf32" for the tensor-core backward of float32 inputs; score_mod for one that applies a score
    mod, `baseline_backward`)."""
    base = baseline_backward(q, k, v, dout, causal=causal, scale=scale, contractions=contractions, mask=mask,
                             p_dtype=p_dtype, score_mod=score_mod, products=products)
    return judge_backward(dq, dk, dv, base, name=name)


# ----------------------------------------------------------------------------------------------------
# The captured arrays' gradients of a score mod (proofs/L13, claim 4): the same 3x rule, entry by entry.


@dataclass(frozen=True)
class BaselineCaptured:
    """The float64 gradients of a mod's captured arrays (None where one takes none) and their atols."""

    expected: tuple
    atols: tuple


def baseline_captured(q, k, v, dout, *, score_mod, causal: bool = False, scale: float | None = None, mask=None,
                      contractions=reference.CONTRACTIONS) -> BaselineCaptured:
    """Reference gradients of score_mod's captured arrays and their tolerances: per array,

        atol = 3 * err(naive float32) + rounding_floor(expected) + max_e sum_{p -> e} floor(dS'_p) |c_p|,

    the gradients' rule applied to dC[e] = sum_{p -> e} dS'_p c_p (c_p: the pair's derivative of the mod with
    respect to that entry): the naive float32 evaluations (`attention_backward_naive_f32`'s twin, summing in
    float32 in the pairs' order) measure the rounding, and the floor carries the two recomputed quantities of
    dS' (`_ds_floor`) through |c_p|, as `_recompute_floors` carries them into dq and dk."""
    mod = mods.check_score_mod(score_mod)
    if mod is None or mod.grad is None:
        raise ValueError("score_mod must be a ScoreMod with its grad (the captured gradients come from dS')")
    grads = reference.dense_backward(q, k, v, dout, causal=causal, scale=scale, mask=mask, score_mod=mod)
    expected = grads.dcaptured
    e, _ = _ds_floor(grads)
    floors = mods.captured_gradients(mod, grads.s_raw, e, grads.visible, absolute=True)
    del grads
    naive = [reference.dense_backward(q, k, v, dout, causal=causal, scale=scale, mask=mask, dtype=np.float32,
                                      contraction=c, score_mod=mod).dcaptured for c in contractions]
    atols = tuple(None if want is None else
                  tolerance_backward(want, [n[t] for n in naive], _finite_max(floors[t]))
                  for t, want in enumerate(expected))
    return BaselineCaptured(tuple(expected), atols)


def check_captured_gradients(dcaptured, q, k, v, dout, *, score_mod, causal: bool = False,
                             scale: float | None = None, mask=None, name: str = "kernel",
                             contractions=reference.CONTRACTIONS) -> tuple:
    """Check a mod's captured gradients from any implementation against the float64 reference with the 3x
    rule (`baseline_captured`); returns the errors (None where an array takes no gradient)."""
    base = baseline_captured(q, k, v, dout, score_mod=score_mod, causal=causal, scale=scale, mask=mask,
                             contractions=contractions)
    if len(dcaptured) != len(base.expected):
        raise AssertionError(f"{name}: {len(dcaptured)} captured gradients for {len(base.expected)} arrays")
    errors = []
    for t, (ours, want, atol) in enumerate(zip(dcaptured, base.expected, base.atols)):
        if (ours is None) != (want is None):
            raise AssertionError(f"{name} captured[{t}]: got {'None' if ours is None else 'a gradient'}, expected "
                                 f"{'None' if want is None else 'a gradient'}")
        errors.append(None if want is None else assert_close(ours, want, atol, name=f"{name} captured[{t}]"))
    return tuple(errors)
