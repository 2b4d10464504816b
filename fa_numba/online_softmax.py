"""The per-row online-softmax state (m, l, acc) and its algebra (proofs/L2_online_softmax.md).

For a set X of visible keys of one query row with scores s_j:

    m   = max_{j in X} s_j                       (-inf when X is empty)
    l   = sum_{j in X} exp(s_j - m)              (0 when X is empty)
    acc = sum_{j in X} exp(s_j - m) V_j          (unnormalised output, 0 when X is empty)

`merge` combines the states of two disjoint sets; it is associative and commutative with `identity` as
its neutral element, so the blocks of a row may be folded in any order and bracketing. `update` folds one
tile of scores into a state; it is the NumPy twin of the kernels' device function and keeps its formulas
in the same order. `finalize` gives O = acc / l and LSE = m + log l (O = 0, LSE = -inf on an empty row).

Numerical safety: every argument of exp is s - m_new or m_old - m_new with m_new >= both, so it is <= 0.
When m_new = -inf (nothing visible yet) the shift is 0 instead, so exp(-inf - 0) = 0 rather than NaN.
All functions work on rows vectorised along axis 0 and keep the dtype they are given (float32 or float64).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


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
    m = np.maximum(a.m, b.m)
    shift = _safe_shift(m)
    alpha = _exp_nonpositive(a.m - shift)  # rescales a to the new max
    beta = _exp_nonpositive(b.m - shift)  # rescales b to the new max
    l = alpha * a.l + beta * b.l
    acc = alpha[:, None] * a.acc + beta[:, None] * b.acc
    return State(m, l, acc)


def update(state: State, scores: np.ndarray, values: np.ndarray) -> State:
    """Fold one tile into the state: scores (rows, cols) with -inf where masked, values (cols, d).

    Same order as the device function: tile max, new max, rescale factor, weights, then l and acc.
    """
    m_tile = scores.max(axis=1)
    m_new = np.maximum(state.m, m_tile)
    shift = _safe_shift(m_new)
    alpha = _exp_nonpositive(state.m - shift)
    p = _exp_nonpositive(scores - shift[:, None])
    l_new = alpha * state.l + p.sum(axis=1)
    acc_new = alpha[:, None] * state.acc + p @ values
    return State(m_new, l_new, acc_new)


def from_block(scores: np.ndarray, values: np.ndarray) -> State:
    """The state of one block of keys on its own: update(identity, scores, values)."""
    return update(identity(scores.shape[0], values.shape[1], scores.dtype), scores, values)


def finalize(state: State) -> tuple[np.ndarray, np.ndarray]:
    """(O, LSE) = (acc / l, m + log l); an empty row (l = 0) gives O = 0 and LSE = -inf, without warnings."""
    visible = state.l > 0
    out = np.divide(state.acc, state.l[:, None], where=visible[:, None], out=np.zeros_like(state.acc))
    log_l = np.log(state.l, where=visible, out=np.zeros_like(state.l))
    lse = np.where(visible, state.m + log_l, state.m.dtype.type(-np.inf))
    return out, lse
