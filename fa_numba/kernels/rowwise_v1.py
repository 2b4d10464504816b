"""FlashAttention (Algorithm 1) forward: K/V outer, Q inner, one thread per query row (registered as v1-rowwise).

Math (per query row i): the same online softmax as v2, but the running state lives in HBM between
visits: O_i is stored normalised (acc / l), with l_i and m_i beside it, exactly as in the paper. Where
l = 0 (no visible score yet, or only -inf ones) O holds acc itself (0, or a NaN from the inputs), so the
next visit rebuilds acc exactly (tiled._encode / _decode, proofs/L4).

HBM traffic per (batch, head), in elements (iomodel.traffic("v1", ...), proofs/L5_hbm_traffic.md):
    init    writes O: N_q d, l: N_q, m: N_q                       (O = 0, l = 0, m = -inf)
    visits  K, V: read N_k d once;  per visit of query tile i: read Q_i, O_i (r_i d), l_i, m_i (r_i),
            write O_i (r_i d), l_i, m_i (r_i)
    last    read l, m (N_q each), write LSE (N_q)
Non-causal: Q read T_c N_q d, O read T_c N_q d and written (T_c + 1) N_q d.

Launch: grid (B H,), block (B_r,): one block per (batch, head) runs the whole j-outer loop, as the original
FlashAttention kernel does; within a block one thread per query row of the current query tile.

The register-tiled kernel of the same order is engine_v1.py (registered as v1); this one mirrors the
paper line by line.

Limits and departures from the paper:
- Parallelism is only B H blocks of B_r threads: that is the cost of keeping K and V read once, and it is
  why FlashAttention-2 swapped the loops. Expect it to be slow on a large GPU at small B H.
- The paper keeps l and m as outputs; here a last pass turns them into LSE = m + log l so that both
  orders return the same thing. l and m are float32 workspaces of shape (B, H, N_q).
- Inputs float32 or float16; arithmetic, O, l, m and LSE in float32. Shared memory 2 B_c d 4 bytes <= 48 KB.
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from fa_numba.kernels.block_lists import PAIR_FORMS
from fa_numba.kernels.common import (NAN, NEG_INF, ZERO, Config, V1Kernel, load_kv_tile, log_sum_exp,
                                     row_steps, to_f32, visible_range)
from fa_numba.kernels.mask_mod import mask_slice
from fa_numba.kernels.score_mod import has_scores, row_mod
from fa_numba.tiling import PARTIAL


def kernel_source(config: Config):
    """The Python function of the kernel (compiled by cuda.jit for a launch, and by fa_numba.profile for sm_90a)."""
    BR, BC, D, CAUSAL = config.block_q, config.block_k, config.head_dim, config.causal
    LISTS, DENSE, PARTIAL_KIND = config.lists, config.form in PAIR_FORMS, int(PARTIAL)
    MOD = has_scores(config.mod)  # a score mod compiled in (kernels.score_mod)
    modded_row = row_mod(config.mod)
    steps = row_steps(config.mod)  # the PARTIAL tiles' pair test: dense bytes or a mask_mod (kernels.mask_mod)
    score_row, online_update = steps.score_row, steps.online_update

    def flash_v1(q, k, v, o, lse, l_hbm, m_hbm, scale, row_ptrs, col_idxs, col_kinds, col_ptrs, row_idxs, row_kinds, lohis,
                 denses, captured):
        bh = cuda.blockIdx.x  # (batch, head)
        tid = cuda.threadIdx.x
        heads, n_q, n_k, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]  # d == D (checked at launch)
        b = bh // heads
        h = bh - b * heads
        h_kv = h // (heads // k.shape[1])  # GQA: query head h reads K/V head h // group
        row_ptr, col_idx, col_kind = mask_slice(row_ptrs, b, h), mask_slice(col_idxs, b, h), mask_slice(col_kinds, b, h)
        col_ptr, row_idx, row_kind = mask_slice(col_ptrs, b, h), mask_slice(row_idxs, b, h), mask_slice(row_kinds, b, h)
        lohi, dense = mask_slice(lohis, b, h), mask_slice(denses, b, h)  # this (batch, head)'s mask (kernels.mask_mod)
        delta = n_k - n_q
        t_r = (n_q + BR - 1) // BR
        t_c = (n_k + BC - 1) // BC

        k_tile = cuda.shared.array((BC, D), float32)  # K_j: (B_c, d) shared, loaded once per j
        v_tile = cuda.shared.array((BC, D), float32)  # V_j: (B_c, d) shared, loaded once per j
        q_row = cuda.local.array(D, float32)  # Q_i[row]: (d,) local, reloaded on every visit
        acc = cuda.local.array(D, float32)  # O_i[row] l_i[row]: (d,) local, rebuilt on every visit
        s = cuda.local.array(BC, float32)  # S_ij[row] then P_ij[row]: (B_c,) local

        # Algorithm 1, line 2: O = 0, l = 0, m = -inf in HBM. Thread tid owns rows tid + k B_r, the same
        # rows it updates in every visit below, so no barrier is needed between these writes and reads.
        for row in range(tid, n_q, BR):
            for x in range(d):
                o[b, h, row, x] = ZERO
            l_hbm[b, h, row] = ZERO
            m_hbm[b, h, row] = NEG_INF

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
            # every thread has finished reading the previous K_j, V_j before they are overwritten
            cuda.syncthreads()
            if stop > start:  # a key tile no query tile sees is never loaded
                load_kv_tile(k, v, b, h_kv, c0, cols, d, k_tile, v_tile, tid, BR)
            # the whole K_j, V_j tile is in shared memory before any thread reads it
            cuda.syncthreads()
            for idx in range(start, stop):  # invariant: the query tiles before this one have folded tile j (L4)
                i = row_idx[idx] if LISTS else idx
                r0 = i * BR
                row = r0 + tid
                if row < n_q:
                    # PARTIAL tile: mask inside it
                    partial = row_kind[idx] == PARTIAL_KIND if LISTS else CAUSAL and c0 + cols - 1 > r0 + delta
                    c_lo, c_hi = visible_range(row, c0, cols, delta, partial and not LISTS, partial and LISTS, lohi)
                    use_dense = DENSE and partial
                    for x in range(d):
                        q_row[x] = to_f32(q[b, h, row, x])
                    m = m_hbm[b, h, row]
                    l = l_hbm[b, h, row]
                    for x in range(d):  # O is stored normalised: acc = O l (O itself where l = 0)
                        acc[x] = o[b, h, row, x] * l if l > ZERO else o[b, h, row, x]
                    score_row(q_row, k_tile, c_lo, c_hi, d, scale, s, row, c0, use_dense, dense, b, h, captured)
                    if MOD:  # S' = mod(S) at the visible keys
                        modded_row(s, c_lo, c_hi, b, h, row, c0, use_dense, dense, captured)
                    m, l = online_update(m, l, acc, s, c_lo, c_hi, d, v_tile, row, c0, use_dense, dense, b, h,
                                         captured)
                    for x in range(d):
                        o[b, h, row, x] = acc[x] / l if l > ZERO else acc[x]
                    l_hbm[b, h, row] = l
                    m_hbm[b, h, row] = m

        # Last pass: LSE = m + log l. Same row ownership as above: no barrier needed. A row that sees keys
        # whose scores are all -inf (l = 0, infinite inputs only) gets O = 0/0 = NaN here (tiled._run_v1).
        for row in range(tid, n_q, BR):
            m = m_hbm[b, h, row]
            l = l_hbm[b, h, row]
            alive = not CAUSAL or row + delta >= 0
            if LISTS:
                alive = lohi[row, 0] < lohi[row, 1]
            lse[b, h, row] = log_sum_exp(m, l, alive)
            if alive and l == ZERO:
                for x in range(d):
                    o[b, h, row, x] = NAN

    return flash_v1


class FlashV1(V1Kernel):
    """A compiled v1 specialisation; the l, m workspace is allocated unless given."""

    def launch_shape(self, batch, heads, n_q):
        return (batch * heads,), (self.config.block_q,)


@functools.lru_cache(maxsize=None)
def make_v1(block_q: int, block_k: int, head_dim: int, causal: bool, mask_form: str = "none",
            mod=None) -> FlashV1:
    """Build (once per configuration) the v1 kernel for these compile-time tile sizes (mod: a
    score_mod.KernelMod compiled in, or None)."""
    return FlashV1(Config("v1", block_q, block_k, head_dim, bool(causal), mask_form=mask_form, mod=mod).check(),
               kernel_source)
