"""The definition: dense attention that materialises S and P, and its gradients.

    S = scale * Q K^T,  S_ij = -inf where key j is masked,
    LSE_i = log sum_j exp(S_ij),  O_i = sum_j exp(S_ij - LSE_i) V_j.

`attention` computes this in float64 and is what every other layer is checked against.
`attention_naive_f32` is the same computation in float32, its sums evaluated in one of the CONTRACTIONS
orders (BLAS, plain loops both ways, a balanced tree, fused multiply-adds): its error against the float64
result is the yardstick of the tolerance rule, which is not here but in `fa_numba.tolerance` (DESIGN.md,
proofs/L6_floating_point.md). `dense` returns, beside the result, what the computation materialises (S, P,
the values as each query head reads them, the visible pairs), which the rule's derived terms are computed
from. `visible_matmul` is the sum over visible keys that never multiplies a masked key's value.

Causal masking is bottom-right aligned (FlashAttention >= 2.1): query i sees key j iff j <= i + N_k - N_q.
Any other mask (`fa_numba.masks`: window, documents, prefix-LM, a function, a dense array) is passed as
`mask=` and applied densely through `mask.dense(N_q, N_k)`; `causal=True` is the short form of
`mask=masks.causal()`, and passing both is a ValueError. `visible_mask` is where every dense mask is made. A mask
that differs by batch and head (`fa_numba.slice_masks`: a 4-D `masks.from_dense`, `masks.mask_mod`) is made
(B_m, H_m, N_q, N_k) by its `dense_slices` and broadcast against S: each (b, h) slice is masked by its own.

The backward (proofs/L7_backward.md): `attention_backward` gives the float64 gradients (dq, dk, dv) of
<dO, O> for a given dO, `attention_backward_naive_f32` the same formulas in float32 (P recomputed from its
own float32 LSE, as every FlashAttention backward does), the yardstick of the gradients' rule
(`tolerance_backward.baseline_backward`); `dense_backward` returns what they materialise as well (P, dP, D).
Each takes `mask=` as the forward does.

Non-finite values (proofs/L2, L3, L8). Whether a row sees any key is decided by the mask alone: a row with no
visible key (causal: possible when N_q > N_k; any mask may have such rows) has O = 0 and LSE = -inf, whatever
its query holds; no NaN, no warning. Every other row follows the dense formula with max shift, in IEEE
arithmetic: a NaN in its query, in a visible key or in a visible score makes its O (all columns) and LSE NaN;
a NaN in column x of a visible value makes O[:, x] NaN and leaves the LSE alone; a +inf score makes the row
NaN (exp(inf - inf)); visible scores that are all -inf give O = 0/0 = NaN and LSE = log 0 = -inf. A masked
key is never touched: its scores are -inf by the mask and its value row is never multiplied (0 * NaN would
be NaN).

Sinks (proofs/L14): `sinks=` (H,), one logit s_h per query head, is a column every row of head h sees and that
has no value (gpt-oss's learnable sinks): LSE_i = log(exp(s_h) + sum_j exp(S_ij)), O_i = sum_j exp(S_ij - LSE_i)
V_j, so a row's weights sum to 1 - exp(s_h - LSE_i); a row with no visible key has O = 0 and LSE = s_h. -inf is no
sink. The backward's dsinks_h = -sum_{b, i} exp(s_h - LSE_i) D_i.

Score mods (`fa_numba.mods`, proofs/L13_score_mods.md): `dense`, `attention`, `dense_backward`,
`attention_backward` and the float32 twins take `score_mod=` (a `mods.ScoreMod`; None, the default, leaves
every result bit for bit as without it). The forward then uses S'_bhij = mod(S_bhij, b, h, i, j) on the
visible pairs, after the scale and before the mask and the max (FlexAttention's order), and softmax(S') V;
mod is evaluated at visible pairs only, so what it would give at a masked pair (NaN, inf, an exception)
cannot reach anything. The backward takes dS' = P (dP - D) from the softmax as before and dS = dS' mod'(S)
(the chain rule, L13), so dQ = scale dS K and dK = scale dS^T Q; `attention_backward_mod` also returns the
captured arrays' gradients (sums of dS' d mod / d entry over the pairs that read each entry, in a fixed
order). The mod is called from Python once per visible pair and function (about a microsecond each):
test sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_numba import mods, shapes


def causal_mask(n_q: int, n_k: int) -> np.ndarray:
    """Boolean (N_q, N_k) mask of visible pairs: True iff j <= i + (N_k - N_q) (bottom-right aligned)."""
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    return j <= i + (n_k - n_q)


def visible_mask(n_q: int, n_k: int, causal: bool = False, mask=None, batch: int = 1, heads: int = 1) -> np.ndarray:
    """Boolean (N_q, N_k) mask of the pairs a query sees: `mask.dense`, `causal_mask`, or every pair; for a
    mask that differs by batch and head (`fa_numba.slice_masks`) the (B_m, H_m, N_q, N_k) `mask.dense_slices`
    of a (batch, heads) problem, B_m in {1, batch}, H_m in {1, heads} (it broadcasts against (B, H, N_q, N_k)).

    `mask` is a `fa_numba.masks` mask; with causal=True as well it is a ValueError naming both.
    """
    causal, mask = shapes.check_mask(causal, mask)
    if mask is None:
        return causal_mask(n_q, n_k) if causal else np.ones((n_q, n_k), dtype=bool)
    if getattr(mask, "sliced", False):
        visible = np.asarray(mask.dense_slices(batch, heads, n_q, n_k))
        b_m, h_m = mask.slices(batch, heads)
        if visible.shape != (b_m, h_m, n_q, n_k) or visible.dtype != np.bool_:
            raise TypeError(f"mask {mask!r}: dense_slices must give a ({b_m}, {h_m}, {n_q}, {n_k}) bool array, "
                            f"got {visible.dtype} {visible.shape}")
        return visible
    visible = np.asarray(mask.dense(n_q, n_k))
    if visible.shape != (n_q, n_k) or visible.dtype != np.bool_:
        raise TypeError(f"mask {mask!r}: dense({n_q}, {n_k}) must give an ({n_q}, {n_k}) bool array, "
                        f"got {visible.dtype} {visible.shape}")
    return visible


def visible_matmul(p: np.ndarray, v: np.ndarray, visible: np.ndarray | None = None,
                   contraction: str = "matmul") -> np.ndarray:
    """sum_j p_ij v_j over the visible pairs only, (..., rows, keys) x (..., keys, d) -> (..., rows, d); visible:
    (rows, keys), or (B_m, H_m, rows, keys) broadcast against p (a mask per batch and head slice).

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
    elif visible.ndim > 2:  # a mask per (batch, head) slice, (B_m, H_m, rows, keys): index it like p
        visible = np.broadcast_to(visible, p.shape)
    for *lead, j, x in np.argwhere(~finite):
        lead = tuple(lead)
        column = out[lead + (Ellipsis, x)] if lead else out[..., x]
        seen = visible[..., j] if visible.ndim == 2 else visible[lead + (Ellipsis, j)]
        with np.errstate(invalid="ignore"):  # 0 * inf = NaN and inf - inf = NaN, as the dense formula has them
            column += np.where(seen, p[lead + (Ellipsis, j)] * v[lead + (j, x)], p.dtype.type(0))
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
class Dense:
    """What the dense forward materialises, 4-D (B, H, ...), K/V heads repeated per query head (GQA).

    s: (B, H, N_q, N_k) the scores the softmax sees, -inf on masked pairs: S, or S' = mod(S) with a score_mod;
    p: the same shape, P = exp(s - m) / l, 0 on masked pairs and on rows with no visible key; v: (B, H, N_k, d_v)
    the values as each query head reads them; visible: (N_q, N_k) bool, the visible pairs, or (B_m, H_m, N_q,
    N_k) for a mask that differs by batch and head (`visible_mask`; it broadcasts against s); out: (B, H, N_q, d_v)
    O; lse: (B, H, N_q) LSE; lead: q's axes before N (q.shape[:-2]), which `result` gives back. With a
    score_mod: s_raw, the scores S = scale Q K^T before it (-inf on masked pairs), and score_mod itself; both
    None without one.
    """

    s: np.ndarray
    p: np.ndarray
    v: np.ndarray
    visible: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    lead: tuple
    s_raw: np.ndarray | None = None
    score_mod: mods.ScoreMod | None = None

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(out, lse) in the caller's layout: out like q with v's head dim d_v, lse like q without its last axis."""
        return shapes.drop_lead(self.out, self.lead), shapes.drop_lead(self.lse, self.lead)


def dense(q, k, v, *, causal: bool = False, scale: float | None = None, mask=None, dtype=np.float64,
          contraction: str = "matmul", score_mod=None, sinks=None) -> Dense:
    """The dense forward in `dtype`, its sums in the `contraction` order, with what it materialises.

    `attention` (float64) and `attention_naive_f32` (float32) return its `result()`; the tolerance rule's
    derived terms (`fa_numba.tolerance`) read its S, P and O. Materialises S and P: B H N_q N_k elements each.
    score_mod: a `mods.ScoreMod`, evaluated on `dtype` scalars at the visible pairs (module docstring).
    sinks: (H,) one logit per query head, a column every row of that head sees that has no value (module
    docstring); P then sums to 1 - exp(sink - LSE) on a row.
    """
    if contraction not in CONTRACTIONS:
        raise ValueError(f"contraction must be one of {CONTRACTIONS}, got {contraction!r}")
    prob = shapes.problem(q, k, v, value_dim=True)
    causal, mask = shapes.check_mask(causal, mask)
    score_mod = mods.check_score_mod(score_mod)
    if score_mod is not None:
        score_mod.check_sizes(prob.batch, prob.heads, prob.n_q, prob.n_k)
    scale = dtype(shapes.resolve_scale(scale, prob.d))
    q4, k4, v4 = (shapes.as_4d(np.asarray(x)).astype(dtype) for x in (q, k, v))
    # GQA: query head h reads K/V head h // group.
    k4 = np.repeat(k4, prob.group, axis=1)
    v4 = np.repeat(v4, prob.group, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):  # IEEE: inf * 0 = NaN where the inputs hold an infinity
        s = scale * _contract(q4, np.swapaxes(k4, -1, -2), contraction)  # S: (B, H, N_q, N_k)
    visible = visible_mask(prob.n_q, prob.n_k, causal, mask, batch=prob.batch, heads=prob.heads)
    alive = visible.any(axis=-1)  # rows with a visible key: decided by the mask, never by the values
    s = np.where(visible, s, dtype(-np.inf))
    s_raw = None
    if score_mod is not None:  # S' = mod(S) on the visible pairs, -inf on the masked ones, mod never called there
        s_raw, s = s, mods.scores(score_mod, s, visible, dtype)
    sink = None if sinks is None else shapes.check_sinks(sinks, prob.heads).astype(dtype)[:, None]  # (H, 1)
    with np.errstate(invalid="ignore", divide="ignore"):  # IEEE: NaN and log 0 = -inf where the inputs say so
        m = s.max(axis=-1)  # row max over visible scores: -inf on a dead row, NaN if a visible score is
        if sink is not None:  # the sink's column joins the max and the sum, never P V
            m = np.maximum(m, sink)
            alive = alive | (sink != -np.inf)
        shift = np.where(m == -np.inf, dtype(0), m)  # exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN
        p = np.where(visible, np.exp(s - shift[..., None]), dtype(0))  # every finite exponent argument <= 0
        l = _contract(p, np.ones(p.shape[-1:] + (1,), dtype=dtype), contraction)[..., 0]
        if sink is not None:
            l = l + np.exp(sink - shift)
        lse = np.where(alive, shift + np.log(l), dtype(-np.inf))
        p = np.where(alive[..., None], p / l[..., None], dtype(0))
    out = visible_matmul(p, v4, visible, contraction)
    return Dense(s, p, v4, visible, out, lse, tuple(np.shape(q)[:-2]), s_raw, score_mod)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, mask=None, score_mod=None, sinks=None):
    """Float64 dense attention. Returns (out, lse) with out like q (its last axis v's head dim d_v, which may differ
    from q's d) and lse like q without its last axis.

    mask: a `fa_numba.masks` mask applied densely (not with causal=True; that is mask=masks.causal()).
    score_mod: a `fa_numba.mods.ScoreMod`: softmax(mod(S)) V with mod applied after the scale, at the visible
    pairs only (module docstring); LSE is then log sum_j exp(mod(S_ij)).
    sinks: (H,) sink logits, one column per head that every row sees and that has no value (module docstring).

    >>> import numpy as np
    >>> q = k = v = np.eye(2)
    >>> out, lse = attention(q, k, v, causal=True)
    >>> out[0].tolist(), round(float(lse[0]), 6)   # query 0 sees only key 0: LSE = S_00 = 1/sqrt(2)
    ([1.0, 0.0], 0.707107)
    """
    return dense(q, k, v, causal=causal, scale=scale, mask=mask, score_mod=score_mod, sinks=sinks).result()


def attention_naive_f32(q, k, v, *, causal: bool = False, scale: float | None = None, contraction: str = "matmul",
                        mask=None, score_mod=None, sinks=None):
    """The same dense computation in float32: the baseline the tolerance rule scales with (`tolerance`).

    contraction picks how the three sums (over d for S, over keys for l and for P V) are evaluated:
    "matmul" (BLAS, which may fuse multiply-adds and block the sums), "loop" (one rounded product and one
    rounded add per term, in index order, as a CUDA-core kernel without FMA does), "loop_reversed",
    "pairwise" (a balanced tree of rounded sums, as SIMD reductions do) or "fma" (index order, one rounding
    per fused multiply-add, as a GPU's FFMA loop does; emulated by an exact float64 product and a float64 sum
    rounded to float32, which differs from one rounding only in rare double-rounding ties).
    score_mod: evaluated on float32 scalars, its result rounded to float32 once (a kernel's own evaluation of
    the mod may round more: proofs/L13, after claim 5).
    """
    return dense(q, k, v, causal=causal, scale=scale, mask=mask, dtype=np.float32,
                 contraction=contraction, score_mod=score_mod, sinks=sinks).result()


# ----------------------------------------------------------------------------------------------------
# The backward pass (proofs/L7_backward.md): the gradients of f = <dO, O(q, k, v)>, for a given dO.
#
#     D_i = sum_x dO_ix O_ix,   dP_ij = dO_i . V_j,   dS_ij = P_ij (dP_ij - D_i),
#     dV_j = sum_i P_ij dO_i,   dQ_i = scale sum_j dS_ij K_j,   dK_j = scale sum_i dS_ij Q_i,
#
# with P the forward's probabilities (0 on masked pairs); dK and dV of a K/V head sum over the query heads
# of its group.


@dataclass(frozen=True)
class DenseBackward:
    """The dense gradients and what they materialise, 4-D (B, H, ...), K/V heads repeated per query head.

    dq, dk, dv: the gradients in the caller's layout (dk and dv summed over each group: H_kv heads);
    q, k, v, dout, out: the operands in the backward's dtype, (B, H, N, d); shift: (B, H, N_q) sigma(LSE), the
    forward's LSE with 0 where it is -inf; p: (B, H, N_q, N_k) P recomputed from it; dp: dP = dO V^T, the same
    shape; d_row: (B, H, N_q) D = rowsum(dO o O); visible: as `Dense.visible`; scale: the resolved scale, in the
    backward's dtype; problem: the sizes (`shapes.Problem`). With a score_mod (None or () without one): p is
    recomputed from S' = mod(S); s_raw: (B, H, N_q, N_k) S before the mod, -inf on masked pairs; ds_mod: dS' =
    P (dP - D), the gradient with respect to S'; mod_grad: mod'(S) on visible pairs, 0 on masked ones (the
    dS behind dq and dk is ds_mod * mod_grad); dcaptured: one entry per captured array of the mod, its
    gradient (an array like it, in the backward's dtype) or None where it takes none.
    """

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    out: np.ndarray
    shift: np.ndarray
    p: np.ndarray
    dp: np.ndarray
    d_row: np.ndarray
    visible: np.ndarray
    scale: np.floating
    problem: shapes.Problem
    s_raw: np.ndarray | None = None
    ds_mod: np.ndarray | None = None
    mod_grad: np.ndarray | None = None
    dcaptured: tuple = ()
    dsinks: np.ndarray | None = None


def dense_backward(q, k, v, dout, *, causal: bool = False, scale: float | None = None, mask=None, dtype=np.float64,
                   contraction: str = "matmul", score_mod=None, sinks=None, dlse=None) -> DenseBackward:
    """The dense gradients in `dtype`, from their own forward (`dense`) in the same dtype and contraction order.

    `attention_backward` (float64) and `attention_backward_naive_f32` (float32) return its dq, dk, dv; the
    gradients' rule (`fa_numba.tolerance_backward`) reads its P, dP, D and operands for its floors. Materialises
    S, P, dP and dS: B H N_q N_k elements each. score_mod: a `mods.ScoreMod` with a grad (ValueError without one):
    dS = dS' mod'(S), and the captured arrays' gradients in `dcaptured` (module docstring, proofs/L13).
    sinks: the forward's (H,) sink logits; their gradient in `dsinks`, (H,) in `dtype`. dlse: a cotangent of
    LSE, like LSE (None: the loss reads O alone): <dlse, LSE> joins the function differentiated, so D - dlse
    takes D's place in dS and in dsinks (proofs/L14).
    """
    prob = shapes.problem(q, k, v, value_dim=True)
    shapes.check_like("dout", dout, shapes.out_shape(q, v), "as q with v's head dim")
    causal, mask = shapes.check_mask(causal, mask)
    score_mod = mods.check_score_mod(score_mod)
    if score_mod is not None and score_mod.grad is None:
        raise ValueError(f"score_mod {score_mod.name} has no grad: the backward needs d fn / d score "
                         "(mods.ScoreMod(fn, grad=...))")
    # Its own forward, in the same dtype and contraction order: O and LSE as `attention` computes them.
    forward = dense(q, k, v, causal=causal, scale=scale, mask=mask, dtype=dtype, contraction=contraction,
                    score_mod=score_mod, sinks=sinks)
    out4, lse4 = forward.out, forward.lse  # (B, H, N_q, d), (B, H, N_q)
    del forward  # its S and P: the backward recomputes its own
    scale = dtype(shapes.resolve_scale(scale, prob.d))
    q4, k4, v4, do4 = (shapes.as_4d(np.asarray(x)).astype(dtype) for x in (q, k, v, dout))
    k4 = np.repeat(k4, prob.group, axis=1)  # GQA: query head h reads K/V head h // group
    v4 = np.repeat(v4, prob.group, axis=1)
    visible = visible_mask(prob.n_q, prob.n_k, causal, mask, batch=prob.batch, heads=prob.heads)
    # P recomputed from the saved LSE, P_ij = exp(S_ij - sigma(LSE_i)), exactly the softmax in real
    # arithmetic (L7.2). In float32 this keeps the rounding of LSE at its magnitude |LSE|, an error of
    # about ulp(LSE) in every exponent that the forward's exp(S - m) / l does not have: the baseline must
    # carry it, as every implementation that recomputes P from a float32 LSE does (proofs/L7, FP section).
    s = np.where(visible, scale * _contract(q4, np.swapaxes(k4, -1, -2), contraction), dtype(-np.inf))
    s_raw = None
    if score_mod is not None:  # P from S' = mod(S), as the forward's (L13)
        s_raw, s = s, mods.scores(score_mod, s, visible, dtype)
    shift = np.where(lse4 == -np.inf, dtype(0), lse4)  # sigma: a dead row computes exp(-inf - 0) = 0
    with np.errstate(invalid="ignore"):  # NaN where the inputs hold one
        p = np.where(visible, np.exp(s - shift[..., None]), dtype(0))
    # The gradients (L7.1, L7.3, L7.5). Masked pairs get dS = 0 by the mask, and their operands are never
    # multiplied (visible_matmul), so a row with no visible key gives exactly 0 in dQ and adds nothing to
    # dK, dV, whatever its dO holds.
    d_row = _contract(do4 * out4, np.ones((prob.d_v, 1), dtype=dtype), contraction)[..., 0]  # D: (B, H, N_q)
    if dlse is not None:  # dS_ij = P_ij (dP_ij - D_i) + dlse_i P_ij (proofs/L14)
        shapes.check_like("dlse", dlse, tuple(np.shape(q))[:-1], "as q without its last axis (LSE's shape)")
        d_row = d_row - np.asarray(dlse).reshape(d_row.shape).astype(dtype)
    dsinks = None
    if sinks is not None:  # d sink_h = -sum_{b, i} P_sink (D_i - dlse_i), P_sink = exp(sink_h - LSE_i) (proofs/L14)
        sink = shapes.check_sinks(sinks, prob.heads).astype(dtype)[:, None]
        with np.errstate(invalid="ignore", over="ignore"):
            p_sink = np.where(lse4 == -np.inf, dtype(0), np.exp(sink - shift))
            dsinks = -_contract((p_sink * d_row).transpose(1, 0, 2).reshape(prob.heads, 1, -1),
                                np.ones((prob.batch * prob.n_q, 1), dtype=dtype), contraction)[:, 0, 0]
    dp = _contract(do4, np.swapaxes(v4, -1, -2), contraction)  # dP: (B, H, N_q, N_k)
    with np.errstate(invalid="ignore"):
        ds = np.where(visible, p * (dp - d_row[..., None]), dtype(0))  # dS
    ds_mod = mod_grad = None
    dcaptured = ()
    if score_mod is not None:  # the chain rule through S' = mod(S) (L13): dS = dS' mod'(S), on visible pairs only
        ds_mod = ds
        mod_grad = mods.derivatives(score_mod, s_raw, visible, dtype)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf where the inputs hold them
            ds = np.where(visible, ds_mod * mod_grad, dtype(0))
        dcaptured = mods.captured_gradients(score_mod, s_raw, ds_mod, visible, dtype)
    visible_t = np.swapaxes(visible, -1, -2)  # (keys, rows): visible.T, per slice for a sliced mask
    dv = visible_matmul(np.swapaxes(p, -1, -2), do4, visible_t, contraction)
    dk = scale * visible_matmul(np.swapaxes(ds, -1, -2), q4, visible_t, contraction)
    dq = scale * visible_matmul(ds, k4, visible, contraction)
    # GQA: K/V head h_kv is used by query heads h_kv * group ... (h_kv + 1) * group - 1; its gradient is the sum.
    grouped = (prob.batch, prob.heads_kv, prob.group, prob.n_k, -1)  # -1: d for dk, d_v for dv
    dk = dk.reshape(grouped).sum(axis=2)
    dv = dv.reshape(grouped).sum(axis=2)
    dq, dk, dv = (shapes.drop_lead(g, x.shape[:-2]) for g, x in ((dq, q), (dk, k), (dv, v)))
    return DenseBackward(dq, dk, dv,
                         q4, k4, v4, do4, out4, shift, p, dp, d_row, visible, scale, prob,
                         s_raw, ds_mod, mod_grad, dcaptured, dsinks)


def attention_backward(q, k, v, dout, *, causal: bool = False, scale: float | None = None, mask=None,
                       score_mod=None, sinks=None, dlse=None):
    """Float64 gradients (dq, dk, dv) of <dout, O(q, k, v)>, densely from its own float64 forward (O, LSE).

    dout is like the forward's out (q's shape with v's head dim d_v); dq comes out like q, dk and dv like k and
    v (H_kv heads: with GQA each is the sum over the query heads of its group). mask: a `fa_numba.masks` mask applied densely, as in `attention` (not with
    causal=True): masked pairs have P = 0 and dS = 0 and their operands are never multiplied. A row with no
    visible key (causal with N_q > N_k, or any mask's empty row) gives a zero row of dq and nothing to dk,
    dv. The formulas and their proof: proofs/L7_backward.md. Materialises S, P, dP, dS:
    B H N_q N_k elements each (it is the definition, not a memory-efficient algorithm).
    score_mod: a `fa_numba.mods.ScoreMod` with a grad: the gradients of <dout, O> with O = softmax(mod(S)) V,
    dS = P (dP - D) mod'(S) (proofs/L13). Returns (dq, dk, dv); `attention_backward_mod` adds the
    captured arrays' gradients. sinks: the forward's sink logits: (dq, dk, dv, dsinks). dlse: LSE's cotangent,
    for a loss that reads LSE too (proofs/L14).

    >>> import numpy as np
    >>> q = k = v = np.eye(2)
    >>> dq, dk, dv = attention_backward(q, k, v, np.ones((2, 2)), causal=True)
    >>> p10 = 1 / (1 + np.exp(1 / np.sqrt(2)))   # query 1's weight on key 0; query 0 puts all on key 0
    >>> np.allclose(dv, [[1 + p10] * 2, [1 - p10] * 2], rtol=1e-15, atol=0)   # dV_j = sum_i P_ij dO_i
    True
    """
    grads = dense_backward(q, k, v, dout, causal=causal, scale=scale, mask=mask, score_mod=score_mod, sinks=sinks,
                           dlse=dlse)
    return (grads.dq, grads.dk, grads.dv) + (() if sinks is None else (grads.dsinks,))


def attention_backward_mod(q, k, v, dout, *, score_mod, causal: bool = False, scale: float | None = None,
                           mask=None):
    """Float64 gradients of <dout, O> with a score_mod, its captured arrays' included: (dq, dk, dv, dcaptured).

    dq, dk, dv: as `attention_backward(..., score_mod=score_mod)`. dcaptured: a tuple with one entry per array
    in score_mod.captured: for an array with a captured_grad, a float64 array of its shape,

        dcaptured[k][e] = sum over the visible pairs (b, h, i, j) whose captured_grad[k] names entry e of
                          dS'_bhij * (the derivative it gives),   dS' = P (dP - D),

    summed in the order (b, h, i, j) lexicographic (bitwise repeatable; proofs/L13, claim 4); None for an
    array without one (e.g. relative_bias's int offset). Masked pairs and rows with no visible key add
    nothing.

    >>> import numpy as np
    >>> from fa_numba import mods
    >>> q = k = v = np.eye(2)
    >>> dq, dk, dv, (dslopes,) = attention_backward_mod(q, k, v, np.ones((2, 2)), score_mod=mods.alibi([0.5]))
    >>> dslopes.shape, bool(np.isfinite(dslopes).all())
    ((1,), True)
    """
    if score_mod is None:
        raise ValueError("attention_backward_mod needs a score_mod (attention_backward without one)")
    grads = dense_backward(q, k, v, dout, causal=causal, scale=scale, mask=mask, score_mod=score_mod)
    return grads.dq, grads.dk, grads.dv, grads.dcaptured


def attention_backward_naive_f32(q, k, v, dout, *, causal: bool = False, scale: float | None = None,
                                 contraction: str = "matmul", mask=None, score_mod=None, sinks=None, dlse=None):
    """The same dense gradients in float32: the baseline of the gradients' tolerance rule.

    contraction picks how every sum (over d for S, dP and D; over keys for l, O and dQ; over queries for
    dK and dV) is evaluated, as in `attention_naive_f32`: one of CONTRACTIONS. score_mod: evaluated on
    float32 scalars, as in `attention_naive_f32`. sinks, dlse: as `attention_backward` (dsinks fourth).
    """
    grads = dense_backward(q, k, v, dout, causal=causal, scale=scale, mask=mask, dtype=np.float32,
                           contraction=contraction, score_mod=score_mod, sinks=sinks, dlse=dlse)
    return (grads.dq, grads.dk, grads.dv) + (() if sinks is None else (grads.dsinks,))
