"""The definition: dense attention that materialises S and P, and the derived tolerance rule.

    S = scale * Q K^T,  S_ij = -inf where key j is masked,
    LSE_i = log sum_j exp(S_ij),  O_i = sum_j exp(S_ij - LSE_i) V_j.

`attention` computes this in float64 and is what every other layer is checked against.
`attention_naive_f32` is the same computation in float32: its error against the float64 result is the
yardstick of the tolerance rule (DESIGN.md, proofs/L6_floating_point.md):

    err(x) = max |x - ref_float64|,   pass iff err(x) <= 2 * err(naive float32) + floor,
    floor  = 2 * max |fl32(ref + 0.3) - 0.3 - ref|, taken at its bound ulp32(max |ref| + 0.3).

Two refinements, both because the simulator's tensors are tiny (a few dozen entries), where one sample of
rounding noise can be lucky: err(naive float32) is the largest error over three evaluation orders of the
sums (BLAS matmul, and plain loops forward and reversed that round every product as a kernel without
FMA does), and the floor is the ulp bound its DESIGN.md formula tends to on large tensors.

Causal masking is bottom-right aligned (FlashAttention >= 2.1): query i sees key j iff j <= i + N_k - N_q.
Any other mask (`fa_numba.masks`: window, documents, prefix-LM, a function, a dense array) is passed as
`mask=` and applied densely through `mask.dense(N_q, N_k)`; `causal=True` is the short form of
`mask=masks.causal()`, and passing both is a ValueError. `visible_mask` is where every dense mask is made.

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
        column += np.where(visible[..., j], p[lead + (Ellipsis, j)] * v[lead + (j, x)], p.dtype.type(0))
    return out


CONTRACTIONS = ("matmul", "loop", "loop_reversed")


def _contract(a, b, contraction):
    """a @ b over the last axis of a, by BLAS or by a plain loop that rounds every product (no FMA)."""
    if contraction == "matmul":
        return np.matmul(a, b)
    steps = range(a.shape[-1]) if contraction == "loop" else reversed(range(a.shape[-1]))
    total = np.zeros(a.shape[:-1] + b.shape[-1:], dtype=a.dtype)
    for x in steps:
        total += a[..., x, None] * b[..., x, None, :]
    return total


def _dense(q, k, v, causal, scale, dtype, contraction="matmul", mask=None):
    if contraction not in CONTRACTIONS:
        raise ValueError(f"contraction must be one of {CONTRACTIONS}, got {contraction!r}")
    prob = shapes.problem(q, k, v)
    causal, mask = shapes.check_mask(causal, mask)
    scale = dtype(shapes.resolve_scale(scale, prob.d))
    q4, k4, v4 = (shapes.as_4d(np.asarray(x)).astype(dtype) for x in (q, k, v))
    # GQA: query head h reads K/V head h // group.
    k4 = np.repeat(k4, prob.group, axis=1)
    v4 = np.repeat(v4, prob.group, axis=1)
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
    return shapes.drop_lead(out, q.ndim), shapes.drop_lead(lse, q.ndim)


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
    rounded add per term, in index order, as a CUDA-core kernel without FMA does) or "loop_reversed".
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


def tolerance(expected: np.ndarray, naive) -> float:
    """atol = 2 * err(naive float32) + floor for one output tensor (O or LSE).

    `naive` is one float32 evaluation or a sequence of them (e.g. the CONTRACTIONS); err(naive) is the
    largest of their errors, which estimates float32 rounding noise better than one evaluation on a tiny tensor.
    """
    naive = [naive] if isinstance(naive, np.ndarray) else list(naive)
    return 2.0 * max(max_error(n, expected) for n in naive) + rounding_floor(expected)


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
    """The float64 reference of one problem and the tolerances the derived rule allows around it."""

    out: np.ndarray
    lse: np.ndarray
    atol_out: float
    atol_lse: float


def baseline(q, k, v, *, causal: bool = False, scale: float | None = None, contractions=CONTRACTIONS,
             mask=None) -> Baseline:
    """Reference and tolerances, computed once per problem and shared by every implementation checked.

    The naive float32 baseline is evaluated once per contraction order; pass contractions=("matmul",) on
    large tensors, where one evaluation already samples the rounding noise well and the loops are slow.
    """
    ref_out, ref_lse = attention(q, k, v, causal=causal, scale=scale, mask=mask)
    naive = [attention_naive_f32(q, k, v, causal=causal, scale=scale, contraction=c, mask=mask) for c in contractions]
    return Baseline(ref_out, ref_lse, tolerance(ref_out, [n[0] for n in naive]), tolerance(ref_lse, [n[1] for n in naive]))


def judge(out, lse, base: Baseline, *, name: str = "kernel") -> Check:
    """Assert (out, lse) is within the baseline's tolerances; returns the errors."""
    err_out = assert_close(out, base.out, base.atol_out, name=f"{name} out")
    err_lse = assert_close(lse, base.lse, base.atol_lse, name=f"{name} lse")
    return Check(err_out, err_lse, base.atol_out, base.atol_lse)


def check_attention(out, lse, q, k, v, *, causal: bool = False, scale: float | None = None, name: str = "kernel",
                    contractions=CONTRACTIONS, mask=None) -> Check:
    """Check (out, lse) from any implementation against the float64 reference with the derived rule."""
    return judge(out, lse, baseline(q, k, v, causal=causal, scale=scale, contractions=contractions, mask=mask),
                 name=name)
