"""FlashAttention (Algorithm 1) forward on the tile engine: the register-tiled v1 kernel (K/V outer, Q inner).

Math (per query row i): the same online softmax as v2, but the running state lives in HBM between visits:
O_i is stored normalised (acc / l, or acc itself where l = 0: tiled._encode), with l_i and m_i beside it,
exactly as in the paper.

HBM traffic per (batch, head), in elements: exactly that of the one-thread-per-row v1 (iomodel.traffic("v1",
...), proofs/L5): init writes O, l, m; K and V read once (N_k d each); per visit of query tile i: Q_i and
O_i read, O_i written (r_i d each), l_i and m_i read and written (r_i each); the last pass reads l, m and
writes LSE. Non-causal: Q read T_c N_q d, O read T_c N_q d and written (T_c + 1) N_q d.

Launch: grid (B H,), block (B_c / TN, B_r / TM) threads (layout.Layout): one block per (batch, head) runs
the whole j-outer loop, as the original FlashAttention kernel does. Per visit (i, j): read each thread's O
micro-tile and (tx = 0) m_i, l_i into registers, their loads issued before Q_i^T's so that all are in flight
together (each thread reads what it wrote on the last visit: no barrier needed); load Q_i^T, S = scale
Q_i K_j^T; m_i, l_i into shared memory beside the row maxima, rebuild acc = O l; p, P^T and the row sums
through shared memory, acc = alpha acc + P V; write O = acc / l, m and l back.

Limits and departures from the paper:
- Parallelism is B H blocks: the cost of reading K and V once. A block holds 256 threads (default tiles,
  d <= 128), but B H = 64 blocks still leave 68 of an H200's 132 SMs idle: the structural cap the
  whole-kernel estimate shows (docs/profile.md).
- The paper keeps l and m as outputs; a last pass turns them into LSE = m + log l so that both orders
  return the same thing. l and m are float32 workspaces of shape (B, H, N_q).
- FP32 CUDA cores only; static shared memory <= 48 KB (kernels.default_tiles); inputs float32, float16 or
  bfloat16 (its bits), arithmetic, O, l, m and LSE in float32.
"""

from __future__ import annotations

import functools

from numba import boolean, cuda, float32, uint64 as u64

from fa_numba.kernels.block_lists import PAIR_FORMS
from fa_numba.kernels.common import NAN, NEG_INF, ZERO, Config, V1Kernel, log_sum_exp
from fa_numba.kernels.mask_mod import mask_slice
from fa_numba.kernels.score_mod import has_scores, tile_mod
from fa_numba.kernels.engine import GUARD_CAUSAL, GUARD_MARKED, GUARD_NONE, make_engine
from fa_numba.tiling import PARTIAL


def kernel_source(config: Config):
    """The Python function of the kernel (compiled by cuda.jit for a launch, and by fa_numba.profile for sm_90a)."""
    layout = config.layout
    E = make_engine(layout, config.mod)  # device functions bound to names below: a kernel can only call globals and closures
    owner, column, load_q, load_kv, masked_scores = E.owner, E.column, E.load_q, E.load_kv, E.masked_scores
    row_max_partials, softmax, store_p, pv = E.row_max_partials, E.softmax, E.store_p, E.pv
    write_partials, row_sum = E.write_partials, E.row_sum
    BR, BC, TM, TN, TD, CX, T = (layout.block_q, layout.block_k, layout.tm, layout.tn, layout.td, layout.cx,
                                 layout.threads)
    CAUSAL, ALIASED, LISTS, DENSE = config.causal, layout.aliased, config.lists, config.form in PAIR_FORMS
    # how P V keeps masked value rows out of PARTIAL tiles (engine.pv)
    GUARD_PARTIAL = GUARD_MARKED if LISTS else GUARD_CAUSAL
    PARTIAL_KIND = int(PARTIAL)
    MOD = has_scores(config.mod)  # a score mod compiled in (kernels.score_mod): applied after the mask
    modded_tile = tile_mod(config.mod, TM, TN)
    OFF = layout.offsets
    SMEM, Q, K, V, RED, STAT = OFF["_total"], OFF["q"], OFF["k"], OFF["v"], OFF["red"], OFF["stat"]
    VALUE_DIM = config.value_dim != 0  # O's head dim its own (compile-time: else the code of d_v = d, unchanged)

    def flash_v1_engine(q, k, v, o, lse, l_hbm, m_hbm, scale, row_ptrs, col_idxs, col_kinds, col_ptrs, row_idxs,
                        row_kinds, lohis, denses, captured):
        bh = cuda.blockIdx.x  # (batch, head)
        tid = cuda.threadIdx.y * CX + cuda.threadIdx.x  # the hardware's thread (and lane) order
        ty, tx = owner(tid)  # layout.owner: the row group and the column group of the thread
        # tx: keys tx TN + c of S, features layout.column(tx, e) of O; ty: rows ty TM .. ty TM + TM - 1
        heads, n_q, n_k, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
        d_v = o.shape[3] if VALUE_DIM else d
        b = bh // heads
        h = bh - b * heads
        h_kv = h // (heads // k.shape[1])  # GQA: query head h reads K/V head h // group
        row_ptr, col_idx, col_kind = mask_slice(row_ptrs, b, h), mask_slice(col_idxs, b, h), mask_slice(col_kinds, b, h)
        col_ptr, row_idx, row_kind = mask_slice(col_ptrs, b, h), mask_slice(row_idxs, b, h), mask_slice(row_kinds, b, h)
        lohi, dense = mask_slice(lohis, b, h), mask_slice(denses, b, h)  # this (batch, head)'s mask (kernels.mask_mod)
        delta = n_k - n_q
        t_r = (n_q + BR - 1) // BR
        t_c = (n_k + BC - 1) // BC

        smem = cuda.shared.array(SMEM, float32)  # Q^T | K^T | V | P^T | red | stat at layout.offsets
        s = cuda.local.array((TM, TN), float32)  # S_ij then P_ij: registers
        dead = cuda.local.array((TM, TN), boolean)  # masked pairs of the block-mask path
        for a in range(TM):
            for c in range(TN):
                dead[a, c] = False
        acc = cuda.local.array((TM, TD), float32)  # O_i l_i, rebuilt on every visit: registers
        m = cuda.local.array(TM, float32)
        l = cuda.local.array(TM, float32)  # l_i read from HBM, then the new l_i
        part = cuda.local.array(TM, float32)  # the thread's part of the tile's row sums
        alpha = cuda.local.array(TM, float32)
        m_prev = cuda.local.array(TM, float32)  # m_i, l_i as read from HBM by tx == 0
        l_prev = cuda.local.array(TM, float32)
        limit = cuda.local.array(TM, float32)  # last visible key of each row, relative to the tile

        # Algorithm 1, line 2: O = 0, l = 0, m = -inf in HBM, every element written once.
        for idx in range(tid, n_q * d_v, T):
            row = idx // d_v
            o[b, h, row, idx - row * d_v] = ZERO
        for row in range(tid, n_q, T):
            l_hbm[b, h, row] = ZERO
            m_hbm[b, h, row] = NEG_INF
        stats = smem[u64(STAT):]  # m_i at [0, B_r), l_i at [B_r, 2 B_r)

        for j in range(t_c):  # invariant: O, l, m in HBM hold the state of keys [0, j B_c) (L2, L4)
            c0 = j * BC
            cols = min(BC, n_k - c0)
            # The query tiles that visit key tile j, in increasing i; the rest are SKIP (L3): with causal masking
            # I_j .. T_r - 1 (iomodel's closed form), with a block mask the list row_idx[col_ptr[j]:col_ptr[j + 1]].
            start = 0
            stop = t_r
            if CAUSAL:
                start = min(max(-((-(c0 + 1 - delta)) // BR) - 1, 0), t_r - 1)
            if LISTS:
                start = col_ptr[j]
                stop = col_ptr[j + 1]
            # every thread has finished the last visit (reads of K^T, V) before they are overwritten; also
            # orders the initialisation above before the first visit's reads of O, l, m
            cuda.syncthreads()
            if stop > start:  # a key tile no query tile sees is never loaded
                load_kv(k, v, b, h_kv, c0, cols, smem, K, V, tid)  # K_j^T and V_j: loaded once per j
            for idx in range(start, stop):  # invariant: the query tiles before this one have folded tile j (L4)
                i = row_idx[idx] if LISTS else idx
                r0 = i * BR
                rows = min(BR, n_q - r0)
                row = r0 + ty * TM  # the thread's first row
                # The state of the visit from HBM, its loads issued before Q_i^T's so that they are all in
                # flight together: each thread reads the elements of O it wrote itself on the last visit (and
                # tx == 0 the m_i, l_i it wrote), so no barrier is needed for them.
                for a in range(TM):
                    r = row + a
                    m_prev[a] = NEG_INF
                    l_prev[a] = ZERO
                    if r < n_q and tx == 0:
                        m_prev[a] = m_hbm[b, h, r]
                        l_prev[a] = l_hbm[b, h, r]
                    for e in range(TD):
                        x = column(tx, e)
                        value = ZERO
                        if r < n_q and x < d_v:
                            value = o[b, h, r, x]
                        acc[a, e] = value
                load_q(q, b, h, r0, rows, smem, Q, tid)  # Q_i^T: reloaded on every visit
                # Q_i^T (and on the first visit K_j^T, V_j) is complete before any thread reads it
                cuda.syncthreads()
                # PARTIAL tile: the mask is needed inside it
                partial = row_kind[idx] == PARTIAL_KIND if LISTS else CAUSAL and c0 + cols - 1 > r0 + delta
                masked_scores(smem, s, dead, ty, tx, scale, row, c0, cols, n_q, n_k, delta, partial, CAUSAL, LISTS, lohi,
                              dense, DENSE, b, h, captured)
                if MOD:  # S' = mod(S) at the visible pairs (the masked ones keep their -inf)
                    modded_tile(s, dead, b, h, row, c0 + tx * TN, n_q, n_k, delta, partial, CAUSAL, LISTS, captured)
                if ALIASED:
                    # P^T, red and stat live in Q^T's space: every thread has read Q^T before they are written
                    cuda.syncthreads()
                if tx == 0:  # m_i, l_i: read from HBM once per row, shared through shared memory
                    for a in range(TM):
                        if row + a < n_q:
                            stats[u64(ty * TM + a)] = m_prev[a]
                            stats[u64(BR + ty * TM + a)] = l_prev[a]
                row_max_partials(smem, s, ty, tx)
                # every partial row max and m_i, l_i are written before any thread reads them
                cuda.syncthreads()
                for a in range(TM):  # the state from HBM; O is stored normalised: acc = O l (O itself where l = 0)
                    r = row + a
                    m[a] = NEG_INF
                    l[a] = ZERO
                    if r < n_q:
                        m[a] = stats[u64(ty * TM + a)]
                        l[a] = stats[u64(BR + ty * TM + a)]
                    if l[a] > ZERO:
                        for e in range(TD):
                            acc[a, e] *= l[a]
                    part[a] = ZERO
                softmax(smem, s, m, part, alpha, ty)  # m becomes the new max, part the thread's row sums
                store_p(smem, s, dead, LISTS and partial, ty, tx)
                # P^T is complete, and every thread has read the row maxima before red takes the row sums
                cuda.syncthreads()
                write_partials(smem, RED, part, ty, tx)
                for a in range(TM):
                    limit[a] = float32(row + a + delta - c0)
                pv(smem, acc, alpha, ty, tx, GUARD_PARTIAL if partial else GUARD_NONE, limit)
                # every partial row sum is written before any thread adds them up
                cuda.syncthreads()
                row_sum(smem, RED, part, ty)
                for a in range(TM):
                    r = row + a
                    l_new = alpha[a] * l[a] + part[a]
                    if r < n_q:
                        for e in range(TD):
                            x = column(tx, e)
                            if x < d_v:
                                o[b, h, r, x] = acc[a, e] / l_new if l_new > ZERO else acc[a, e]
                        if tx == 0:
                            l_hbm[b, h, r] = l_new
                            m_hbm[b, h, r] = m[a]
                # every thread has read Q^T, P^T, red and stat before the next visit overwrites them
                cuda.syncthreads()

        # Last pass: LSE = m + log l, from HBM (the threads that wrote them are others: the barrier at the end
        # of the last visit orders their writes before these reads). A row that sees keys whose scores are
        # all -inf (l = 0, infinite inputs only) gets O = 0/0 = NaN here (tiled._run_v1).
        cuda.syncthreads()
        for row in range(tid, n_q, T):
            m_row = m_hbm[b, h, row]
            l_row = l_hbm[b, h, row]
            alive = not CAUSAL or row + delta >= 0
            if LISTS:
                alive = lohi[row, 0] < lohi[row, 1]
            lse[b, h, row] = log_sum_exp(m_row, l_row, alive)
            if alive and l_row == ZERO:
                for x in range(d_v):
                    o[b, h, row, x] = NAN

    return flash_v1_engine


class FlashV1Engine(V1Kernel):
    """A compiled register-tiled v1 specialisation; the l, m workspace is allocated unless given."""

    def launch_shape(self, batch, heads, n_q):
        layout = self.config.layout
        return (batch * heads,), (layout.cx, layout.ry)


@functools.lru_cache(maxsize=None)
def make_v1_engine(block_q: int, block_k: int, head_dim: int, causal: bool, mask_form: str = "none",
                   mod=None, value_dim: int = 0) -> FlashV1Engine:
    """Build (once per configuration) the register-tiled v1 kernel for these compile-time tile sizes (mod: a
    score_mod.KernelMod compiled in, or None; value_dim: V's and O's head dim d_v where it differs from d, the
    tiles then staged max(d, d_v) wide, `Layout.d_pad`)."""
    return FlashV1Engine(Config("v1", block_q, block_k, head_dim, bool(causal), engine=True, mask_form=mask_form,
                                mod=mod, value_dim=value_dim).check(),
                         kernel_source)
