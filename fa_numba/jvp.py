"""Forward-mode AD of attention on the host: the float64 JVP and its online form (proofs/L15).

With S = scale Q K^T (masked pairs -inf), P = softmax(S) per row, O = P V, LSE = logsumexp(S) and tangents
Q', K', V' of the inputs:

    S' = scale (Q' K^T + Q K'^T),   mu_i = sum_j P_ij S'_ij,
    O'_i = sum_j P_ij (S'_ij - mu_i) V_j + sum_j P_ij V'_j,   LSE'_i = mu_i.

`dense` computes them in float64 by those formulas (the definition this layer is checked against: by central
differences and by torch's own forward-mode AD in the tests). `online` computes them in one pass over key tiles,
the way a kernel would: the online-softmax state (m, l, acc) grows three accumulators, a = sum_j e_j S'_j V_j,
b = sum_j e_j V'_j and c = sum_j e_j S'_j (e_j = exp(S_j - m)), rescaled by the same exp(m_old - m_new) as
acc and l, so the extended state is still a monoid (`merge`, proofs/L15) and finalises as

    O = acc / l,   LSE = m + log l,   LSE' = c / l,   O' = (a + b) / l - (c / l) O.

A row that sees no key has O = 0, LSE = -inf and zero tangents. Not yet: the kernels (tile engine, tensor
cores) and the torch entry points, which still refuse a tangent (`torch_ops.refuse_forward_ad`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_numba import reference, shapes


def _operands(q, k, v, dq, dk, dv, scale):
    """(q, k, v, dq, dk, dv) 4-D float64 with K/V heads repeated per query head (GQA), the problem, the scale."""
    prob = shapes.problem(q, k, v, value_dim=True)
    for name, x, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        shapes.check_like(name, x, tuple(np.shape(like)), f"as {name[1:]}")
    four = [shapes.as_4d(np.asarray(x)).astype(np.float64) for x in (q, k, v, dq, dk, dv)]
    for t in (1, 2, 4, 5):
        four[t] = np.repeat(four[t], prob.group, axis=1)
    return four, prob, shapes.resolve_scale(scale, prob.d)


def dense(q, k, v, dq, dk, dv, *, causal: bool = False, scale: float | None = None, mask=None):
    """(O, LSE, O', LSE') in float64 by the formulas of the module docstring, in the caller's layout (O and O'
    like q with v's head dim, LSE and LSE' like q without its last axis)."""
    (q4, k4, v4, dq4, dk4, dv4), prob, scale = _operands(q, k, v, dq, dk, dv, scale)
    visible = reference.visible_mask(prob.n_q, prob.n_k, causal, shapes.check_mask(causal, mask)[1],
                                     batch=prob.batch, heads=prob.heads)
    out, lse = reference.attention(q, k, v, causal=causal, scale=scale, mask=mask)
    out4, lse4 = shapes.as_4d(out), shapes.as_4d(lse[..., None])[..., 0]
    s = np.where(visible, scale * q4 @ np.swapaxes(k4, -1, -2), -np.inf)
    ds = np.where(visible, scale * (dq4 @ np.swapaxes(k4, -1, -2) + q4 @ np.swapaxes(dk4, -1, -2)), 0.0)
    alive = np.isfinite(lse4)
    with np.errstate(invalid="ignore"):
        p = np.where(visible & alive[..., None], np.exp(s - np.where(alive, lse4, 0.0)[..., None]), 0.0)
    mu = (p * ds).sum(axis=-1)
    dout = (p * (ds - mu[..., None])) @ v4 + p @ dv4
    lead = tuple(np.shape(q)[:-2])
    return (out, lse, shapes.drop_lead(dout, lead), shapes.drop_lead(np.where(alive, mu, 0.0), lead))


@dataclass(frozen=True)
class State:
    """The extended online-softmax state of one or more rows: m, l (rows,), acc, a, b (rows, d_v), c (rows,)."""

    m: np.ndarray
    l: np.ndarray
    acc: np.ndarray
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray


def identity(rows: int, d_v: int) -> State:
    """The state of no key: m = -inf and every sum 0."""
    return State(np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, d_v)), np.zeros((rows, d_v)),
                 np.zeros((rows, d_v)), np.zeros(rows))


def block(s: np.ndarray, ds: np.ndarray, v: np.ndarray, dv: np.ndarray) -> State:
    """The state of a block of keys: scores s and their tangents ds (rows, n), values v and tangents dv (n, d_v);
    masked pairs have s = -inf (and any ds)."""
    m = s.max(axis=1)
    shift = np.where(m == -np.inf, 0.0, m)
    e = np.exp(s - shift[:, None])
    ds = np.where(e > 0, ds, 0.0)
    return State(m, e.sum(axis=1), e @ v, (e * ds) @ v, e @ dv, (e * ds).sum(axis=1))


def merge(x: State, y: State) -> State:
    """The merge of two states of disjoint key sets: each rescaled to the larger max, then added (L15)."""
    m = np.maximum(x.m, y.m)
    shift = np.where(m == -np.inf, 0.0, m)
    alpha, beta = np.exp(x.m - shift), np.exp(y.m - shift)
    return State(m, alpha * x.l + beta * y.l, alpha[:, None] * x.acc + beta[:, None] * y.acc,
                 alpha[:, None] * x.a + beta[:, None] * y.a, alpha[:, None] * x.b + beta[:, None] * y.b,
                 alpha * x.c + beta * y.c)


def finalize(state: State):
    """(O, LSE, O', LSE') of a state; a row without a key gets (0, -inf, 0, 0)."""
    alive = state.l > 0
    l = np.where(alive, state.l, 1.0)
    out = np.where(alive[:, None], state.acc / l[:, None], 0.0)
    mu = np.where(alive, state.c / l, 0.0)
    dout = np.where(alive[:, None], (state.a + state.b) / l[:, None] - mu[:, None] * out, 0.0)
    return out, np.where(alive, state.m + np.log(l), -np.inf), dout, mu


def online(q, k, v, dq, dk, dv, *, causal: bool = False, scale: float | None = None, mask=None,
           block_k: int = 16):
    """(O, LSE, O', LSE') by one pass over key tiles of block_k keys per (batch, head), the v2 order's fold of
    `block` states with `merge`, in float64; the caller's layout as `dense`."""
    (q4, k4, v4, dq4, dk4, dv4), prob, scale = _operands(q, k, v, dq, dk, dv, scale)
    visible = reference.visible_mask(prob.n_q, prob.n_k, causal, shapes.check_mask(causal, mask)[1],
                                     batch=prob.batch, heads=prob.heads)
    visible = np.broadcast_to(visible, (prob.batch, prob.heads, prob.n_q, prob.n_k))
    results = [np.zeros((prob.batch, prob.heads, prob.n_q, prob.d_v)), np.zeros((prob.batch, prob.heads, prob.n_q)),
               np.zeros((prob.batch, prob.heads, prob.n_q, prob.d_v)), np.zeros((prob.batch, prob.heads, prob.n_q))]
    for bi in range(prob.batch):
        for h in range(prob.heads):
            state = identity(prob.n_q, prob.d_v)
            for c0 in range(0, prob.n_k, block_k):
                keys = slice(c0, min(c0 + block_k, prob.n_k))
                seen = visible[bi, h, :, keys]
                s = np.where(seen, scale * q4[bi, h] @ k4[bi, h, keys].T, -np.inf)
                ds = scale * (dq4[bi, h] @ k4[bi, h, keys].T + q4[bi, h] @ dk4[bi, h, keys].T)
                state = merge(state, block(s, np.where(seen, ds, 0.0), v4[bi, h, keys], dv4[bi, h, keys]))
            for r, x in zip(results, finalize(state)):
                r[bi, h] = x
    lead = tuple(np.shape(q)[:-2])
    return tuple(shapes.drop_lead(r, lead) for r in results)
