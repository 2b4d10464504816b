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

Masks (proofs/L8): `causal=True`, or `mask=` any `fa_numba.masks` mask (not both: shapes.check_mask). The
schedules are `tiling.schedule`'s, i.e. the walks of `tiling.block_mask`'s lists: v2 (and the backward's
"q" order) visits, for each query tile, exactly its non-SKIP key tiles in increasing j; v1 (and "kv"), for
each key tile, exactly its non-SKIP query tiles in increasing i. FULL tiles are folded without a mask,
PARTIAL tiles (and SKIP tiles visited with skip=False) with their slice of the dense visible matrix
(`reference.visible_mask`: `mask.dense`, or `causal_mask` for causal=True, so causal=True and
mask=masks.causal() run the same operations on the same bits). Whether a row sees any key is that
matrix's row: a dead row is finalised to O = 0, LSE = -inf (zero gradients) whatever its state holds. A
tile list that is empty loads nothing: v2 and "q" skip Q_i (and dO_i, LSE_i, D_i), v1 and "kv" skip K_j,
V_j. The block mask itself (lists, row intervals, dense bytes) is metadata the kernels read beside the
data and is not in the ledger (its size: `iomodel`'s docstring).

`attention_backward` is the backward's spec (proofs/L7_backward.md), with a ledger over BACKWARD_TENSORS:
a preprocess pass D = rowsum(dO o O), then order "kv" (K/V outer: K_j, V_j read once per K/V head for
the whole group, dK_j, dV_j on chip, dQ accumulated in HBM, or with deterministic=True written by a
separate Q-outer dQ pass) or "q" (Q outer: dQ_i on chip, dK, dV accumulated in HBM). P, dP and dS are
recomputed per tile from Q_i K_j^T and LSE (`online_softmax.recompute_p`, `score_gradient`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fa_numba import online_softmax as osm
from fa_numba import shapes, tiling
from fa_numba.reference import visible_mask, visible_matmul
from fa_numba.tiling import FULL

TENSORS = ("Q", "K", "V", "O", "l", "m", "LSE")
# The backward's HBM tensors: the inputs, the forward's O and LSE, dO, D = rowsum(dO o O) and the gradients.
BACKWARD_TENSORS = ("Q", "K", "V", "O", "dO", "LSE", "D", "dQ", "dK", "dV")


@dataclass
class Ledger:
    """Elements read from and written to HBM, per tensor (the forward's TENSORS unless made with `empty`)."""

    reads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENSORS, 0))
    writes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENSORS, 0))

    @classmethod
    def empty(cls, tensors: tuple[str, ...] = TENSORS) -> "Ledger":
        """A ledger of zero counts for `tensors` (e.g. BACKWARD_TENSORS); counting any other name is a KeyError."""
        return cls(dict.fromkeys(tensors, 0), dict.fromkeys(tensors, 0))

    def read(self, tensor: str, count: int) -> None:
        self.reads[tensor] += int(count)

    def write(self, tensor: str, count: int) -> None:
        self.writes[tensor] += int(count)

    def scaled(self, factor: int) -> "Ledger":
        return Ledger({t: c * factor for t, c in self.reads.items()}, {t: c * factor for t, c in self.writes.items()})


@dataclass(frozen=True)
class _Mask:
    """The mask of one call as the spec reads it: `visible` (N_q, N_k) bool, the pairs a query sees
    (`reference.visible_mask`), or None without masking; `alive` (N_q,) bool, the rows that see a key."""

    visible: np.ndarray | None
    alive: np.ndarray

    @classmethod
    def of(cls, n_q: int, n_k: int, causal: bool, mask) -> "_Mask":
        if not causal and mask is None:
            return cls(None, np.ones(n_q, dtype=bool))
        visible = visible_mask(n_q, n_k, causal, mask)
        return cls(visible, visible.any(axis=1))

    def tile(self, grid, i, j, kind):
        """The visible pairs of tile (i, j) if it needs its mask (PARTIAL, or SKIP visited with skip=False),
        else None (FULL: every pair visible)."""
        if kind == FULL or self.visible is None:
            return None
        (r0, r1), (c0, c1) = grid.rows(i), grid.cols(j)
        return self.visible[r0:r1, c0:c1]


def _scores(q_i, k_j, scale, grid, i, j, kind, mask):
    """S_ij = scale * Q_i K_j^T and the tile's visible pairs: None (all) on a FULL tile, the tile's slice
    of the mask on PARTIAL (or visited SKIP) tiles."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and inf - inf where the inputs hold them
        s = scale * (q_i @ k_j.T)
    return s, mask.tile(grid, i, j, kind)


def _encode(state):
    """v1's HBM form of a state (Algorithm 1 keeps O normalised): O = acc / l where l > 0, else O = acc
    (0, or NaN carried from the inputs), so that `_decode` gives the state back on every row."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((state.l > 0)[:, None], state.acc / state.l[:, None], state.acc)


def _decode(m, l, O):
    """acc = O l where l > 0, else acc = O: the inverse of `_encode`."""
    return osm.State(m, l, np.where((l > 0)[:, None], O * l[:, None], O))


def _run_v1(q, k, v, scale, sched, mask, ledger):
    grid = sched.grid
    n_q, d = q.shape[0], v.shape[1]  # d: O's head dim, V's (d_v)
    # Algorithm 1, line 2: O = 0, l = 0, m = -inf in HBM.
    O = np.zeros((n_q, d), dtype=q.dtype)
    l = np.zeros(n_q, dtype=q.dtype)
    m = np.full(n_q, -np.inf, dtype=q.dtype)
    for name, count in (("O", n_q * d), ("l", n_q), ("m", n_q)):
        ledger.write(name, count)
    loaded_j = None
    for i, j, kind in sched.visits:  # j outer, i inner: the query tiles of key tile j's list
        c0, c1 = grid.cols(j)
        if j != loaded_j:  # K_j, V_j: (B_c, d) on chip, loaded once per key tile with a non-empty list
            k_j, v_j = k[c0:c1], v[c0:c1]
            ledger.read("K", k_j.size)
            ledger.read("V", v_j.size)
            loaded_j = j
        r0, r1 = grid.rows(i)
        q_i = q[r0:r1]  # Q_i, O_i, l_i, m_i: read from HBM on every visit
        state = _decode(m[r0:r1], l[r0:r1], O[r0:r1])  # O is stored normalised
        for name, count in (("Q", q_i.size), ("O", (r1 - r0) * d), ("l", r1 - r0), ("m", r1 - r0)):
            ledger.read(name, count)
        s, visible = _scores(q_i, k_j, scale, grid, i, j, kind, mask)
        state = osm.update(state, s, v_j, visible)
        O[r0:r1] = _encode(state)
        l[r0:r1], m[r0:r1] = state.l, state.m
        for name, count in (("O", (r1 - r0) * d), ("l", r1 - r0), ("m", r1 - r0)):
            ledger.write(name, count)
    # Last pass: LSE = m + log l (-inf on rows that see no key, by the mask). O already holds acc / l, except
    # on a row that sees keys whose scores are all -inf (l = 0: only infinite inputs do that), where it
    # becomes 0/0.
    alive = mask.alive
    out, lse = osm.finalize(_decode(m, l, O), alive)
    empty_sum = alive & ~(l > 0) & ~np.isnan(l)
    O[empty_sum] = out[empty_sum]
    ledger.read("l", n_q)
    ledger.read("m", n_q)
    ledger.write("LSE", n_q)
    ledger.write("O", int(empty_sum.sum()) * d)
    return O, lse


def _run_v2(q, k, v, scale, sched, mask, ledger):
    grid = sched.grid
    n_q, d = q.shape[0], v.shape[1]  # d: O's head dim, V's (d_v)
    O = np.empty((n_q, d), dtype=q.dtype)
    lse = np.empty(n_q, dtype=q.dtype)
    by_row = {i: [] for i in range(grid.t_r)}
    for i, j, kind in sched.visits:  # i outer, j inner: query tile i's list of key tiles
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
            s, visible = _scores(q_i, k_j, scale, grid, i, j, kind, mask)
            state = osm.update(state, s, v_j, visible)
        O[r0:r1], lse[r0:r1] = osm.finalize(state, mask.alive[r0:r1])  # written once; dead rows 0, -inf
        ledger.write("O", (r1 - r0) * d)
        ledger.write("LSE", r1 - r0)
    return O, lse


def _check_spec_args(prob, block_q, block_k, causal, dtype, scale, mask):
    """The spec's common arguments, validated: (block_q, block_k, causal, mask, dtype, scale in that dtype)."""
    block_q = shapes.check_block("block_q", block_q)
    block_k = shapes.check_block("block_k", block_k)
    causal, mask = shapes.check_mask(causal, mask)
    if mask is not None:
        mask.check(prob.n_q, prob.n_k)
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype must be float32 or float64, got {dtype}")
    return block_q, block_k, causal, mask, dtype, dtype.type(shapes.resolve_scale(scale, prob.d))


def attention(q, k, v, *, order: str, block_q: int, block_k: int, causal: bool = False,
              scale: float | None = None, dtype=np.float64, skip: bool = True, mask=None):
    """Run the v1 or v2 schedule tile by tile. Returns (out, lse, ledger) in the caller's layout.

    dtype is the compute dtype (float64 for the spec, float32 to mimic the kernels' arithmetic).
    mask: any `fa_numba.masks` mask (not with causal=True, its short form): only its non-SKIP tiles are
    visited, only PARTIAL ones masked, and a row it shows no key gets O = 0, LSE = -inf. The ledger sums
    all batches and heads and equals `iomodel.traffic(order, ..., mask=mask)`.
    """
    prob = shapes.problem(q, k, v, value_dim=True)
    tiling.check_order(order)
    block_q, block_k, causal, mask, dtype, scale = _check_spec_args(prob, block_q, block_k, causal, dtype, scale,
                                                                    mask)
    q4, k4, v4 = (shapes.as_4d(np.asarray(x)).astype(dtype) for x in (q, k, v))
    sched = tiling.schedule(order, prob.n_q, prob.n_k, block_q, block_k, causal, skip=skip, mask=mask)
    visible = _Mask.of(prob.n_q, prob.n_k, causal, mask)
    run = _run_v1 if order == "v1" else _run_v2
    out = np.empty(q4.shape[:-1] + (prob.d_v,), dtype=dtype)
    lse = np.empty(q4.shape[:-1], dtype=dtype)
    ledger = Ledger()
    for b in range(prob.batch):
        for h in range(prob.heads):
            h_kv = h // prob.group
            out[b, h], lse[b, h] = run(q4[b, h], k4[b, h_kv], v4[b, h_kv], scale, sched, visible, ledger)
    return shapes.drop_lead(out, q.shape[:-2]), shapes.drop_lead(lse, q.shape[:-2]), ledger


# ----------------------------------------------------------------------------------------------------
# The backward pass (proofs/L7_backward.md): dQ, dK, dV recomputed tile by tile from Q, K, V, O, LSE, dO.


def _preprocess(out, dout):
    """D_i = sum_x dO_ix O_ix for every row of one query head (L7.1): the preprocess pass."""
    return (dout * out).sum(axis=-1)


def _tile_backward(q_i, k_j, v_j, do_i, lse_i, D_i, scale, grid, i, j, kind, mask):
    """One tile's P and dS (L7): S from Q_i K_j^T, P = exp(S - sigma(LSE)) recomputed, dP = dO_i V_j^T,
    dS = P o (dP - D). Returns (p, ds, visible); visible (rows, cols) on a masked tile, else None."""
    s, visible = _scores(q_i, k_j, scale, grid, i, j, kind, mask)
    p = osm.recompute_p(s, lse_i, visible)
    with np.errstate(invalid="ignore", over="ignore"):
        dp = do_i @ v_j.T
    return p, osm.score_gradient(p, dp, D_i, visible), visible


def _transposed(visible):
    return None if visible is None else visible.T


def _backward_kv(q, k, v, lse, D, dout, dq, scale, sched, mask, ledger, accumulate_dq):
    """K/V outer (FlashAttention-2's backward) for one K/V head. q, lse, D, dout, dq hold the `group`
    query heads that read it, (group, N_q, ...). Returns (dk, dv) of the head; adds into dq if accumulate_dq."""
    grid = sched.grid
    by_col = {j: [] for j in range(grid.t_c)}
    for i, j, kind in sched.visits:  # j outer, i inner: key tile j's list of query tiles
        by_col[j].append((i, kind))
    dk = np.empty_like(k)
    dv = np.empty_like(v)
    for j, col_visits in by_col.items():  # invariant (L7.6): dk_j, dv_j hold the visited (h, i) so far
        c0, c1 = grid.cols(j)
        k_j, v_j = k[c0:c1], v[c0:c1]  # K_j, V_j: (B_c, d) on chip, read once per key tile with a non-empty list
        if col_visits:
            ledger.read("K", k_j.size)
            ledger.read("V", v_j.size)
        dk_j = np.zeros_like(k_j)  # dK_j, dV_j: (B_c, d) on chip for the whole inner loop
        dv_j = np.zeros_like(v_j)
        for h in range(q.shape[0]):  # the query heads of the group share K_j, V_j and dK_j, dV_j
            for i, kind in col_visits:
                r0, r1 = grid.rows(i)
                q_i, do_i = q[h, r0:r1], dout[h, r0:r1]  # Q_i, dO_i, LSE_i, D_i: read on every visit
                for name, count in (("Q", q_i.size), ("dO", do_i.size), ("LSE", r1 - r0), ("D", r1 - r0)):
                    ledger.read(name, count)
                p, ds, visible = _tile_backward(q_i, k_j, v_j, do_i, lse[h, r0:r1], D[h, r0:r1], scale, grid,
                                                i, j, kind, mask)
                dv_j += visible_matmul(p.T, do_i, _transposed(visible))
                dk_j += visible_matmul(ds.T, q_i, _transposed(visible))
                if accumulate_dq:  # dQ_i += scale dS K_j in HBM: an atomic read-modify-write
                    dq[h, r0:r1] += scale * visible_matmul(ds, k_j, visible)
                    ledger.read("dQ", q_i.size)
                    ledger.write("dQ", q_i.size)
        dk[c0:c1] = scale * dk_j  # dK_j, dV_j: written once (zeros for a key tile no query tile sees)
        dv[c0:c1] = dv_j
        ledger.write("dK", dk_j.size)
        ledger.write("dV", dv_j.size)
    return dk, dv


def _backward_q(q, k, v, lse, D, dout, scale, sched, mask, ledger, dk=None, dv=None):
    """Q outer for one query head: returns its dq. With dk, dv (the HBM gradients of its K/V head) it also
    adds into them (order "q"); without, it is the dQ pass of the deterministic "kv" order."""
    grid = sched.grid
    by_row = {i: [] for i in range(grid.t_r)}
    for i, j, kind in sched.visits:  # i outer, j inner
        by_row[i].append((j, kind))
    dq = np.empty_like(q)
    for i, row_visits in by_row.items():
        r0, r1 = grid.rows(i)
        if not row_visits:  # a query tile that sees no key: dQ_i = 0, nothing read
            dq[r0:r1] = 0
            ledger.write("dQ", dq[r0:r1].size)
            continue
        q_i, do_i = q[r0:r1], dout[r0:r1]  # Q_i, dO_i, LSE_i, D_i: read once
        for name, count in (("Q", q_i.size), ("dO", do_i.size), ("LSE", r1 - r0), ("D", r1 - r0)):
            ledger.read(name, count)
        dq_i = np.zeros_like(q_i)  # dQ_i: (B_r, d) on chip for the whole inner loop
        for j, kind in row_visits:  # invariant (L7.6): dq_i holds the key tiles visited so far
            c0, c1 = grid.cols(j)
            k_j, v_j = k[c0:c1], v[c0:c1]  # K_j, V_j: read once per query tile
            ledger.read("K", k_j.size)
            ledger.read("V", v_j.size)
            p, ds, visible = _tile_backward(q_i, k_j, v_j, do_i, lse[r0:r1], D[r0:r1], scale, grid, i, j, kind,
                                            mask)
            dq_i += visible_matmul(ds, k_j, visible)
            if dk is not None:  # dK_j, dV_j += ... in HBM: atomic read-modify-writes
                dv[c0:c1] += visible_matmul(p.T, do_i, _transposed(visible))
                dk[c0:c1] += scale * visible_matmul(ds.T, q_i, _transposed(visible))
                for name, count in (("dK", k_j.size), ("dV", v_j.size)):
                    ledger.read(name, count)
                    ledger.write(name, count)
        dq[r0:r1] = scale * dq_i  # written once
        ledger.write("dQ", dq_i.size)
    return dq


def attention_backward(q, k, v, out, lse, dout, *, order: str, block_q: int, block_k: int, causal: bool = False,
                       scale: float | None = None, dtype=np.float64, deterministic: bool = False, skip: bool = True,
                       mask=None):
    """The backward of one attention call, tile by tile, in order "kv" or "q". Returns (dq, dk, dv, ledger).

    out and lse are the forward's (any order, any precision), dout the upstream gradient; out and dout are
    like q, lse like q without its last axis. dq comes out like q, dk and dv like k and v (H_kv heads).
    dtype is the compute dtype (float64 for the spec, float32 to mimic the kernels). Every order starts
    with the preprocess pass D = rowsum(dO o O), then (proofs/L7_backward.md):

    - "kv" (K/V outer, FlashAttention-2's backward): per K/V head, per key tile j: K_j, V_j read once
      (if any query tile visits j), dK_j, dV_j on chip while every query head of the group walks the query
      tiles that visit j (Q_i, dO_i, LSE_i, D_i read on each visit), dK_j, dV_j written once (zeros for a
      key tile no query tile visits). dQ is accumulated in HBM (zeroed
      by the preprocess, one atomic read-modify-write per visit); with deterministic=True instead a
      separate Q-outer pass recomputes S, P, dP, dS and writes each dQ_i once, without atomics.
    - "q" (Q outer): dK, dV zeroed in HBM; per query head, per query tile i: Q_i, dO_i, LSE_i, D_i read
      once, dQ_i on chip while the visible key tiles stream through (K_j, V_j read, dK_j, dV_j atomically
      added into HBM), dQ_i written once. deterministic=True is refused (it would need a dK/dV pass).

    mask: causal=True, or any `fa_numba.masks` mask (the forward's): the visits are its block-mask lists.
    SKIP tiles are left out (skip=False visits them with a full mask: the gradients are the same, bit for
    bit, only the ledger grows); only PARTIAL tiles are masked; a query tile that sees no key is never
    loaded and writes dQ_i = 0; a row that sees no key (by the mask) has P = dS = 0 on every pair, so a
    zero dQ row and nothing in dK, dV. Any IEEE inputs (proofs/L7.8): masked pairs are never multiplied
    (`visible_matmul`), so a NaN or inf reaches only dQ of the rows that see it and dK, dV of the keys those
    rows see. The ledger (BACKWARD_TENSORS) sums all batches and heads, elements
    per tensor, and equals `iomodel.traffic_backward(..., mask=mask)`. FLOPs per visited tile, r x c: 5
    matrix products of 2 r c d each (S, dP, dV, dK, dQ); the deterministic dQ pass adds 3 (S, dP, dQ), so 8
    instead of 5.
    """
    prob = shapes.problem(q, k, v, value_dim=True)
    shapes.check_like("out", out, shapes.out_shape(q, v), "as q with v's head dim")
    shapes.check_like("lse", lse, q.shape[:-1], "as q without its last axis")
    shapes.check_like("dout", dout, shapes.out_shape(q, v), "as q with v's head dim")
    order, deterministic = tiling.check_backward_order(order, deterministic)
    block_q, block_k, causal, mask, dtype, scale = _check_spec_args(prob, block_q, block_k, causal, dtype, scale,
                                                                    mask)
    q4, k4, v4, out4, do4 = (shapes.as_4d(np.asarray(x)).astype(dtype) for x in (q, k, v, out, dout))
    lse4 = np.asarray(lse).reshape(q4.shape[:-1]).astype(dtype)
    sched = tiling.schedule(tiling.BACKWARD_VISIT_ORDER[order], prob.n_q, prob.n_k, block_q, block_k, causal,
                            skip=skip, mask=mask)
    visible = _Mask.of(prob.n_q, prob.n_k, causal, mask)
    ledger = Ledger.empty(BACKWARD_TENSORS)
    group = prob.group
    n_qd, n_kd = prob.n_q * prob.d, prob.n_k * prob.d
    n_qv, n_kv = prob.n_q * prob.d_v, prob.n_k * prob.d_v  # O, dO, dV: V's head dim

    # Preprocess, per query head: read O and dO, write D (and with atomic dQ, zero it).
    D = _preprocess(out4, do4)
    heads_q = prob.batch * prob.heads
    ledger.read("O", heads_q * n_qv)
    ledger.read("dO", heads_q * n_qv)
    ledger.write("D", heads_q * prob.n_q)
    dq = np.zeros(q4.shape, dtype=dtype)
    dk = np.zeros(k4.shape, dtype=dtype)
    dv = np.zeros(v4.shape, dtype=dtype)
    if order == "kv":
        if not deterministic:
            ledger.write("dQ", heads_q * n_qd)  # dQ = 0 in HBM before the atomic adds
        for b in range(prob.batch):
            for h_kv in range(prob.heads_kv):
                heads = slice(h_kv * group, (h_kv + 1) * group)
                dk[b, h_kv], dv[b, h_kv] = _backward_kv(q4[b, heads], k4[b, h_kv], v4[b, h_kv], lse4[b, heads],
                                                        D[b, heads], do4[b, heads], dq[b, heads], scale, sched,
                                                        visible, ledger, accumulate_dq=not deterministic)
        if deterministic:  # the dQ pass: Q outer, one write per dQ_i
            q_sched = tiling.schedule(tiling.BACKWARD_VISIT_ORDER["q"], prob.n_q, prob.n_k, block_q, block_k, causal,
                                      skip=skip, mask=mask)
            for b in range(prob.batch):
                for h in range(prob.heads):
                    dq[b, h] = _backward_q(q4[b, h], k4[b, h // group], v4[b, h // group], lse4[b, h], D[b, h],
                                           do4[b, h], scale, q_sched, visible, ledger)
    else:
        ledger.write("dK", prob.batch * prob.heads_kv * n_kd)  # dK = dV = 0 in HBM before the atomic adds
        ledger.write("dV", prob.batch * prob.heads_kv * n_kv)
        for b in range(prob.batch):
            for h in range(prob.heads):
                dq[b, h] = _backward_q(q4[b, h], k4[b, h // group], v4[b, h // group], lse4[b, h], D[b, h],
                                       do4[b, h], scale, sched, visible, ledger, dk[b, h // group], dv[b, h // group])
    dq, dk, dv = (shapes.drop_lead(g, x.shape[:-2]) for g, x in ((dq, q), (dk, k), (dv, v)))
    return dq, dk, dv, ledger
