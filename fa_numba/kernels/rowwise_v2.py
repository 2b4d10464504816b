"""FlashAttention-2 forward (Q outer, K/V inner), one thread per query row (registered as v2-rowwise).

Math (per query row i, proofs/L2 and L4): fold the visible key tiles j into (m, l, acc) with the online
softmax, then O_i = acc / l, LSE_i = m + log l.

HBM traffic per (batch, head), in elements (iomodel.traffic("v2", ...), proofs/L5_hbm_traffic.md):
    reads   Q: sum over query tiles that see a key of r_i d   K, V: d sum_i K_i   (K_i keys seen by tile i)
    writes  O: N_q d   LSE: N_q
Non-causal that is Q: N_q d, K and V: T_r N_k d each.

Launch: grid (T_r, B H), block (B_r,): one block per query tile, one thread per query row.

The register-tiled kernel of the same order is engine_v2.py (registered as v2); this one mirrors the
paper line by line.

Limits and departures from the paper:
- One thread per row with its Q row, scores and accumulator in per-thread local arrays; K_j, V_j in shared
  memory. No tensor cores, no warp-level matmul, no split-K: this kernel is written to be checked, and its
  speed is what a plain CUDA-core implementation of the loop order gives.
- Inputs float32 or float16, arithmetic and outputs (O, LSE) in float32.
- Shared memory is static: 2 B_c d 4 bytes <= 48 KB, checked in the factory.
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from fa_numba.kernels.block_lists import PAIR_FORMS
from fa_numba.kernels.common import (NEG_INF, ZERO, Config, V2Kernel, load_kv_tile, log_sum_exp,
                                     output, row_steps, to_f32, visible_range)
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

    def flash_v2(q, k, v, o, lse, scale, row_ptrs, col_idxs, col_kinds, col_ptrs, row_idxs, row_kinds, lohis, denses,
                 captured):
        i = cuda.blockIdx.x  # query tile
        bh = cuda.blockIdx.y  # (batch, head)
        tid = cuda.threadIdx.x  # query row within the tile
        heads, n_q, n_k, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]  # d == D (checked at launch)
        b = bh // heads
        h = bh - b * heads
        h_kv = h // (heads // k.shape[1])  # GQA: query head h reads K/V head h // group
        row_ptr, col_idx, col_kind = mask_slice(row_ptrs, b, h), mask_slice(col_idxs, b, h), mask_slice(col_kinds, b, h)
        col_ptr, row_idx, row_kind = mask_slice(col_ptrs, b, h), mask_slice(row_idxs, b, h), mask_slice(row_kinds, b, h)
        lohi, dense = mask_slice(lohis, b, h), mask_slice(denses, b, h)  # this (batch, head)'s mask (kernels.mask_mod)
        delta = n_k - n_q
        r0 = i * BR
        r1 = min(r0 + BR, n_q)
        row = r0 + tid
        active = row < n_q
        # The key tiles this query tile visits, in increasing j; the rest are SKIP (proofs/L3_causal_tiles.md):
        # with causal masking 0 .. j_end - 1, with a block mask the list col_idx[row_ptr[i]:row_ptr[i + 1]].
        start = 0
        stop = (n_k + BC - 1) // BC
        if CAUSAL:
            last_key = r1 - 1 + delta
            stop = min(stop, last_key // BC + 1) if last_key >= 0 else 0
        if LISTS:
            start = row_ptr[i]
            stop = row_ptr[i + 1]

        k_tile = cuda.shared.array((BC, D), float32)  # K_j: (B_c, d) shared, reloaded per j
        v_tile = cuda.shared.array((BC, D), float32)  # V_j: (B_c, d) shared, reloaded per j
        q_row = cuda.local.array(D, float32)  # Q_i[row]: (d,) local, loaded once
        acc = cuda.local.array(D, float32)  # acc: (d,) local, lives across the whole j loop
        s = cuda.local.array(BC, float32)  # S_ij[row] then P_ij[row]: (B_c,) local

        m = NEG_INF
        l = ZERO
        for x in range(d):
            acc[x] = ZERO
        if active and stop > start:  # a query tile that sees no key never reads Q
            for x in range(d):
                q_row[x] = to_f32(q[b, h, row, x])

        for idx in range(start, stop):  # invariant: (m, l, acc) is the state of the visited tiles so far (L2, L4)
            j = col_idx[idx] if LISTS else idx
            c0 = j * BC
            cols = min(BC, n_k - c0)
            # every thread has finished reading the previous K_j, V_j before they are overwritten
            cuda.syncthreads()
            load_kv_tile(k, v, b, h_kv, c0, cols, d, k_tile, v_tile, tid, BR)
            # the whole K_j, V_j tile is in shared memory before any thread reads it
            cuda.syncthreads()
            if active:
                # PARTIAL tile: mask inside it
                partial = col_kind[idx] == PARTIAL_KIND if LISTS else CAUSAL and c0 + cols - 1 > r0 + delta
                c_lo, c_hi = visible_range(row, c0, cols, delta, partial and not LISTS, partial and LISTS, lohi)
                use_dense = DENSE and partial
                score_row(q_row, k_tile, c_lo, c_hi, d, scale, s, row, c0, use_dense, dense, b, h, captured)
                if MOD:  # S' = mod(S) at the visible keys
                    modded_row(s, c_lo, c_hi, b, h, row, c0, use_dense, dense, captured)
                m, l = online_update(m, l, acc, s, c_lo, c_hi, d, v_tile, row, c0, use_dense, dense, b, h,
                                         captured)

        if active:  # O_i and LSE_i written once; a row with no visible key (by the mask) gets 0 and -inf
            alive = not CAUSAL or row + delta >= 0
            if LISTS:
                alive = lohi[row, 0] < lohi[row, 1]
            for x in range(d):
                o[b, h, row, x] = output(acc[x], l, alive)
            lse[b, h, row] = log_sum_exp(m, l, alive)

    return flash_v2


class FlashV2(V2Kernel):
    """A compiled v2 specialisation (it needs no workspace)."""

    def launch_shape(self, batch, heads, n_q):
        return ((n_q + self.config.block_q - 1) // self.config.block_q, batch * heads), (self.config.block_q,)


@functools.lru_cache(maxsize=None)
def make_v2(block_q: int, block_k: int, head_dim: int, causal: bool, mask_form: str = "none",
            mod=None) -> FlashV2:
    """Build (once per configuration) the v2 kernel for these compile-time tile sizes (mod: a
    score_mod.KernelMod compiled in, or None)."""
    return FlashV2(Config("v2", block_q, block_k, head_dim, bool(causal), mask_form=mask_form, mod=mod).check(),
               kernel_source)
