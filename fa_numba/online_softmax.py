"""The per-row online-softmax state (m, l, acc) and its algebra (proofs/L2_online_softmax.md).

For a set X of visible keys of one query row with scores s_j:

    m   = max_{j in X} s_j                       (-inf when X is empty)
    l   = sum_{j in X} exp(s_j - m)              (0 when X is empty)
    acc = sum_{j in X} exp(s_j - m) V_j          (unnormalised output, 0 when X is empty)

`merge` combines the states of two disjoint sets; it is associative and commutative with `identity` as
its neutral element, so the blocks of a row may be folded in any order and bracketing. `update` folds one
tile of scores into a state; it is the NumPy twin of the kernels' device function and keeps its formulas
in the same order. `finalize` gives O = acc / l and LSE = m + log l (O = 0, LSE = -inf on a row that sees
no key).

Numerical safety: every argument of exp is s - m_new or m_old - m_new with m_new >= both, so it is <= 0.
When m_new = -inf (nothing visible yet) the shift is 0 instead, so exp(-inf - 0) = 0 rather than NaN.

Non-finite inputs (proofs/L2.6). A masked pair is told by the `visible` mask, never by its score: its
weight is exactly 0 and its value row is never multiplied. Whether a row saw any key is told to
`finalize` by `alive` (the mask), not read from the state: the state of keys whose scores are all -inf is
(-inf, 0, 0), the same as the empty set's. Everything else is IEEE arithmetic: a NaN score or value
reaches l or acc through its weight and stays there (NaN * 0 = NaN), so the row finalises to NaN.
All functions work on rows vectorised along axis 0 and keep the dtype they are given (float32 or float64).

The backward needs no state (proofs/L7_backward.md): with the forward's LSE, `recompute_p` gives a tile's
P = exp(S - sigma(LSE)) exactly, and `score_gradient` its dS = P o (dP - D); they are the NumPy twins of
the backward kernels' per-tile formulas.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fa_numba.reference import visible_matmul


class State(NamedTuple):
    """Online-softmax state of `rows` query rows: m (rows,), l (rows,), acc (rows, d)."""

    m: np.ndarray
    l: np.ndarray
    acc: np.ndarray


def _exp_nonpositive(x: np.ndarray) -> np.ndarray:
    """exp of a max-shifted argument (all entries <= 0 or -inf). Tests replace it to assert that claim."""
    return np.exp(x)


def _safe_shift(m_new: np.ndarray) -> np.ndarray:
    """The shift used in exponents: m_new, or 0 where m_new = -inf (then every term is exp(-inf) = 0)."""
    return np.where(m_new == -np.inf, m_new.dtype.type(0), m_new)


def identity(rows: int, d: int, dtype=np.float64) -> State:
    """The neutral element: the state of an empty set of keys (m = -inf, l = 0, acc = 0)."""
    dtype = np.dtype(dtype)
    return State(
        np.full(rows, -np.inf, dtype=dtype),
        np.zeros(rows, dtype=dtype),
        np.zeros((rows, d), dtype=dtype),
    )


def merge(a: State, b: State) -> State:
    """State of the union of two disjoint key sets."""
    with np.errstate(invalid="ignore"):  # inf - inf = NaN only where the scores hold an infinity
        m = np.maximum(a.m, b.m)  # NaN-propagating, like the dense max
        shift = _safe_shift(m)
        alpha = _exp_nonpositive(a.m - shift)  # rescales a to the new max
        beta = _exp_nonpositive(b.m - shift)  # rescales b to the new max
        l = alpha * a.l + beta * b.l
        acc = alpha[:, None] * a.acc + beta[:, None] * b.acc
    return State(m, l, acc)


def update(state: State, scores: np.ndarray, values: np.ndarray, visible: np.ndarray | None = None) -> State:
    """Fold one tile into the state: scores (rows, cols), values (cols, d), visible (rows, cols) bool.

    visible=None means every pair of the tile is visible (a FULL tile); masked pairs get weight exactly 0
    whatever their score, and their value rows are never multiplied. Same order as the device function:
    tile max, new max, rescale factor, weights, then l and acc.
    """
    if visible is not None:
        scores = np.where(visible, scores, scores.dtype.type(-np.inf))
    with np.errstate(invalid="ignore"):
        m_tile = scores.max(axis=1)
        m_new = np.maximum(state.m, m_tile)
        shift = _safe_shift(m_new)
        alpha = _exp_nonpositive(state.m - shift)
        p = _exp_nonpositive(scores - shift[:, None])
        if visible is not None:
            p = np.where(visible, p, p.dtype.type(0))
        l_new = alpha * state.l + p.sum(axis=1)
        acc_new = alpha[:, None] * state.acc + visible_matmul(p, values, visible)
    return State(m_new, l_new, acc_new)


def from_block(scores: np.ndarray, values: np.ndarray, visible: np.ndarray | None = None) -> State:
    """The state of one block of keys on its own: update(identity, scores, values, visible)."""
    return update(identity(scores.shape[0], values.shape[1], scores.dtype), scores, values, visible)


def finalize(state: State, alive: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(O, LSE) = (acc / l, m + log l) on rows that see a key; O = 0 and LSE = -inf on the others.

    alive (rows,) bool says which rows see at least one key: the mask decides, not the state. With
    alive=None a row is taken as empty iff its state is the identity's, (-inf, 0, 0), which is right for
    finite scores; a NaN state is never taken for empty. On an alive row the arithmetic is IEEE: l = 0
    (every visible score -inf) gives O = 0/0 = NaN and LSE = log 0 = -inf, as the dense formula does.
    """
    if alive is None:
        alive = ~((state.m == -np.inf) & (state.l == 0) & (state.acc == 0).all(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(alive[:, None], state.acc / state.l[:, None], state.acc.dtype.type(0))
        lse = np.where(alive, state.m + np.log(state.l), state.m.dtype.type(-np.inf))
    return out, lse


# ----------------------------------------------------------------------------------------------------
# The backward's per-tile formulas (proofs/L7_backward.md): no state to carry, because the forward saved
# LSE, so each tile's probabilities are known exactly on their own.


def recompute_p(scores: np.ndarray, lse: np.ndarray, visible: np.ndarray | None = None) -> np.ndarray:
    """P = exp(S - sigma(LSE)) on visible pairs, exactly 0 on masked ones: scores (rows, cols), lse (rows,).

    With the forward's LSE this is the forward's softmax, exactly in real arithmetic (L7.2), and every
    exponent S_ij - LSE_i is <= 0. sigma(LSE) = LSE, or 0 on a row with LSE = -inf (no visible key), so
    such a row computes exp(-inf - 0) = 0 and never exp(-inf + inf) = NaN; the mask then zeroes every
    masked pair whatever its score (visible=None: a FULL tile, every pair visible).
    """
    if visible is not None:
        scores = np.where(visible, scores, scores.dtype.type(-np.inf))
    with np.errstate(invalid="ignore"):  # NaN where the inputs hold one (IEEE, as the forward)
        p = np.exp(scores - _safe_shift(lse)[:, None])
    if visible is not None:
        p = np.where(visible, p, p.dtype.type(0))
    return p


def score_gradient(p: np.ndarray, dp: np.ndarray, D: np.ndarray, visible: np.ndarray | None = None) -> np.ndarray:
    """dS = P o (dP - D) on visible pairs, exactly 0 on masked ones: p, dp (rows, cols), D (rows,).

    D_i = sum_x dO_ix O_ix = sum_j P_ij dP_ij is the softmax Jacobian's correction (L7.1). A masked pair
    gets 0 by the mask, not by its P = 0 times a dP - D that may not be finite (a dead row's D, say).
    """
    with np.errstate(invalid="ignore"):
        ds = p * (dp - D[:, None])
    if visible is not None:
        ds = np.where(visible, ds, ds.dtype.type(0))
    return ds
