"""The executable spec: a schedule run tile by tile in NumPy, with a ledger of HBM traffic.

This is what the kernels do, written so a reader can step through it. Arrays named like HBM tensors
(O, l, m, LSE) stand for global memory; every read or write of them, and of Q, K, V, is counted in
elements in the ledger. Local variables stand for on-chip memory (shared memory, registers).

- v1 (FlashAttention, Algorithm 1): O = 0, l = 0, m = -inf are initialised in HBM. For each key tile j
  (outer) K_j, V_j are loaded once; for each query tile i (inner) Q_i, O_i, l_i, m_i are read, tile (i, j)
  is folded in and O_i (normalised, as in the paper), l_i, m_i are written back. A last pass reads l, m
  and writes LSE = m + log l.
- v2 (FlashAttention-2): for each query tile i (outer) Q_i is read once and (m, l, acc) stay on chip while
  the key tiles j (inner) stream through; O_i and LSE_i are written once. A query tile that sees no key
  is not loaded at all: it writes O_i = 0 and LSE_i = -inf.

SKIP tiles are left out of both schedules (pass skip=False to compute them with a full -inf mask instead).
K/V traffic is counted per query head: with GQA each query head still streams its own copy of its K/V head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fa_numba import online_softmax as osm
from fa_numba import shapes, tiling
from fa_numba.tiling import PARTIAL, SKIP

TENSORS = ("Q", "K", "V", "O", "l", "m", "LSE")


@dataclass
class Ledger:
    """Elements read from and written to HBM, per tensor."""

    reads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENSORS, 0))
    writes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENSORS, 0))

    def read(self, tensor: str, count: int) -> None:
        self.reads[tensor] += int(count)

    def write(self, tensor: str, count: int) -> None:
        self.writes[tensor] += int(count)

    def scaled(self, factor: int) -> "Ledger":
        return Ledger({t: c * factor for t, c in self.reads.items()}, {t: c * factor for t, c in self.writes.items()})


def _scores(q_i, k_j, scale, grid, i, j, kind):
    """S_ij = scale * Q_i K_j^T and the tile's visible pairs: None (all) on a FULL tile, the causal mask
    on PARTIAL (or visited SKIP) tiles."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and inf - inf where the inputs hold them
        s = scale * (q_i @ k_j.T)
    if kind in (PARTIAL, SKIP):
        r0, r1 = grid.rows(i)
        c0, c1 = grid.cols(j)
        return s, np.arange(c0, c1)[None, :] <= np.arange(r0, r1)[:, None] + grid.delta
    return s, None


def _alive(grid, r0, r1, causal):
    """Rows [r0, r1) that see at least one key: every row, or with causal masking i + delta >= 0."""
    rows = np.arange(r0, r1)
    return rows + grid.delta >= 0 if causal else np.ones(r1 - r0, dtype=bool)


def _encode(state):
    """v1's HBM form of a state (Algorithm 1 keeps O normalised): O = acc / l where l > 0, else O = acc
    (0, or NaN carried from the inputs), so that `_decode` gives the state back on every row."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((state.l > 0)[:, None], state.acc / state.l[:, None], state.acc)


def _decode(m, l, O):
    """acc = O l where l > 0, else acc = O: the inverse of `_encode`."""
    return osm.State(m, l, np.where((l > 0)[:, None], O * l[:, None], O))


def _run_v1(q, k, v, scale, sched, causal, ledger):
    grid = sched.grid
    n_q, d = q.shape
    # Algorithm 1, line 2: O = 0, l = 0, m = -inf in HBM.
    O = np.zeros((n_q, d), dtype=q.dtype)
    l = np.zeros(n_q, dtype=q.dtype)
    m = np.full(n_q, -np.inf, dtype=q.dtype)
    for name, count in (("O", n_q * d), ("l", n_q), ("m", n_q)):
        ledger.write(name, count)
    loaded_j = None
    for i, j, kind in sched.visits:  # j outer, i inner
        c0, c1 = grid.cols(j)
        if j != loaded_j:  # K_j, V_j: (B_c, d) on chip, loaded once per outer step
            k_j, v_j = k[c0:c1], v[c0:c1]
            ledger.read("K", k_j.size)
            ledger.read("V", v_j.size)
            loaded_j = j
        r0, r1 = grid.rows(i)
        q_i = q[r0:r1]  # Q_i, O_i, l_i, m_i: read from HBM on every visit
        state = _decode(m[r0:r1], l[r0:r1], O[r0:r1])  # O is stored normalised
        for name, count in (("Q", q_i.size), ("O", q_i.size), ("l", r1 - r0), ("m", r1 - r0)):
            ledger.read(name, count)
        s, visible = _scores(q_i, k_j, scale, grid, i, j, kind)
        state = osm.update(state, s, v_j, visible)
        O[r0:r1] = _encode(state)
        l[r0:r1], m[r0:r1] = state.l, state.m
        for name, count in (("O", q_i.size), ("l", r1 - r0), ("m", r1 - r0)):
            ledger.write(name, count)
    # Last pass: LSE = m + log l (-inf on rows that see no key). O already holds acc / l, except on a row
    # that sees keys whose scores are all -inf (l = 0: only infinite inputs do that), where it becomes 0/0.
    alive = _alive(grid, 0, n_q, causal)
    out, lse = osm.finalize(_decode(m, l, O), alive)
    empty_sum = alive & ~(l > 0) & ~np.isnan(l)
    O[empty_sum] = out[empty_sum]
    ledger.read("l", n_q)
    ledger.read("m", n_q)
    ledger.write("LSE", n_q)
    ledger.write("O", int(empty_sum.sum()) * d)
    return O, lse


def _run_v2(q, k, v, scale, sched, causal, ledger):
    grid = sched.grid
    n_q, d = q.shape
    O = np.empty((n_q, d), dtype=q.dtype)
    lse = np.empty(n_q, dtype=q.dtype)
    by_row = {i: [] for i in range(grid.t_r)}
    for i, j, kind in sched.visits:  # i outer, j inner: group the visits by query tile
        by_row[i].append((j, kind))
    for i, row_visits in by_row.items():
        r0, r1 = grid.rows(i)
        state = osm.identity(r1 - r0, d, q.dtype)  # (m, l, acc): on chip for the whole inner loop
        if row_visits:
            q_i = q[r0:r1]  # Q_i: read once
            ledger.read("Q", q_i.size)
        for j, kind in row_visits:
            c0, c1 = grid.cols(j)
            k_j, v_j = k[c0:c1], v[c0:c1]  # K_j, V_j: read once per query tile
            ledger.read("K", k_j.size)
            ledger.read("V", v_j.size)
            s, visible = _scores(q_i, k_j, scale, grid, i, j, kind)
            state = osm.update(state, s, v_j, visible)
        O[r0:r1], lse[r0:r1] = osm.finalize(state, _alive(grid, r0, r1, causal))  # written once
        ledger.write("O", (r1 - r0) * d)
        ledger.write("LSE", r1 - r0)
    return O, lse


def attention(q, k, v, *, order: str, block_q: int, block_k: int, causal: bool = False,
              scale: float | None = None, dtype=np.float64, skip: bool = True):
    """Run the v1 or v2 schedule tile by tile. Returns (out, lse, ledger) in the caller's layout.

    dtype is the compute dtype (float64 for the spec, float32 to mimic the kernels' arithmetic).
    The ledger sums all batches and heads.
    """
    prob = shapes.problem(q, k, v)
    tiling.check_order(order)
    block_q = shapes.check_block("block_q", block_q)
    block_k = shapes.check_block("block_k", block_k)
    causal = shapes.check_causal(causal)
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype must be float32 or float64, got {dtype}")
    scale = dtype.type(shapes.resolve_scale(scale, prob.d))
    q4, k4, v4 = (shapes.as_4d(np.asarray(x)).astype(dtype) for x in (q, k, v))
    sched = tiling.schedule(order, prob.n_q, prob.n_k, block_q, block_k, causal, skip=skip)
    run = _run_v1 if order == "v1" else _run_v2
    out = np.empty(q4.shape, dtype=dtype)
    lse = np.empty(q4.shape[:-1], dtype=dtype)
    ledger = Ledger()
    for b in range(prob.batch):
        for h in range(prob.heads):
            h_kv = h // prob.group
            out[b, h], lse[b, h] = run(q4[b, h], k4[b, h_kv], v4[b, h_kv], scale, sched, causal, ledger)
    return shapes.drop_lead(out, q.ndim), shapes.drop_lead(lse, q.ndim), ledger
