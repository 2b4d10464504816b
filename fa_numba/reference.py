"""The definition: dense attention that materialises S and P, and the derived tolerance rule.

    S = scale * Q K^T,  S_ij = -inf where key j is masked,
    LSE_i = log sum_j exp(S_ij),  O_i = sum_j exp(S_ij - LSE_i) V_j.

`attention` computes this in float64 and is what every other layer is checked against.
`attention_naive_f32` is the same computation in float32: its error against the float64 result is the
yardstick of the tolerance rule (DESIGN.md, proofs/L6_floating_point.md):

    err(x) = max |x - ref_float64|,   pass iff err(x) <= 2 * err(naive float32) + floor,
    floor  = 2 * max |fl32(ref + 0.3) - 0.3 - ref|.

Causal masking is bottom-right aligned (FlashAttention >= 2.1): query i sees key j iff j <= i + N_k - N_q.
A row with no visible key (possible when N_q > N_k) has O = 0 and LSE = -inf; no NaN and no warning.
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


def _dense(q, k, v, causal, scale, dtype):
    prob = shapes.problem(q, k, v)
    causal = shapes.check_causal(causal)
    scale = dtype(shapes.resolve_scale(scale, prob.d))
    q4, k4, v4 = (shapes.as_4d(np.asarray(x)).astype(dtype) for x in (q, k, v))
    # GQA: query head h reads K/V head h // group.
    k4 = np.repeat(k4, prob.group, axis=1)
    v4 = np.repeat(v4, prob.group, axis=1)
    s = scale * np.matmul(q4, np.swapaxes(k4, -1, -2))  # S: (B, H, N_q, N_k)
    if causal:
        s = np.where(causal_mask(prob.n_q, prob.n_k), s, dtype(-np.inf))
    m = s.max(axis=-1)  # row max, -inf on a fully masked row
    m_safe = np.where(np.isfinite(m), m, dtype(0))  # shift by 0 on empty rows: exp(-inf - 0) = 0, not NaN
    p = np.exp(s - m_safe[..., None])  # every exponent argument <= 0
    l = p.sum(axis=-1)
    visible = l > 0
    lse = np.full_like(m, -np.inf)
    np.add(m_safe, np.log(l, where=visible, out=np.zeros_like(l)), out=lse, where=visible)
    p = np.divide(p, l[..., None], where=visible[..., None], out=np.zeros_like(p))
    out = np.matmul(p, v4)
    return shapes.drop_lead(out, q.ndim), shapes.drop_lead(lse, q.ndim)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None):
    """Float64 dense attention. Returns (out, lse) with out like q and lse like q without its last axis.

    >>> import numpy as np
    >>> q = k = v = np.eye(2)
    >>> out, lse = attention(q, k, v, causal=True)
    >>> out[0].tolist(), round(float(lse[0]), 6)   # query 0 sees only key 0: LSE = S_00 = 1/sqrt(2)
    ([1.0, 0.0], 0.707107)
    """
    return _dense(q, k, v, causal, scale, np.float64)


def attention_naive_f32(q, k, v, *, causal: bool = False, scale: float | None = None):
    """The same dense computation in float32: the baseline the tolerance rule scales with."""
    return _dense(q, k, v, causal, scale, np.float32)


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
    """floor = 2 * max |fl32(ref + 0.3) - 0.3 - ref|: twice the float32 rounding step at the data's magnitude."""
    expected = np.asarray(expected, dtype=np.float64)
    finite = expected[np.isfinite(expected)]
    if finite.size == 0:
        return 0.0
    shifted = (finite + 0.3).astype(np.float32).astype(np.float64)
    return 2.0 * float(np.max(np.abs(shifted - 0.3 - finite)))


def tolerance(expected: np.ndarray, naive: np.ndarray) -> float:
    """atol = 2 * err(naive float32) + floor, for one output tensor (O or LSE)."""
    return 2.0 * max_error(naive, expected) + rounding_floor(expected)


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
    # an empty row) must be reproduced exactly, and a NaN or inf where the reference is finite never passes.
    nonfinite_bad = np.where(finite, ~np.isfinite(actual), ~(actual == expected))
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


def check_attention(out, lse, q, k, v, *, causal: bool = False, scale: float | None = None, name: str = "kernel"):
    """Check (out, lse) from any implementation against the float64 reference with the derived rule."""
    ref_out, ref_lse = attention(q, k, v, causal=causal, scale=scale)
    naive_out, naive_lse = attention_naive_f32(q, k, v, causal=causal, scale=scale)
    atol_out = tolerance(ref_out, naive_out)
    atol_lse = tolerance(ref_lse, naive_lse)
    err_out = assert_close(out, ref_out, atol_out, name=f"{name} out")
    err_lse = assert_close(lse, ref_lse, atol_lse, name=f"{name} lse")
    return Check(err_out, err_lse, atol_out, atol_lse)
