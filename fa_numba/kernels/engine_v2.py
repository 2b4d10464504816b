"""FlashAttention-2 forward (Q outer, K/V inner) on the tile engine: the register-tiled v2 kernel.

Math (per query row i, proofs/L2 and L4): fold the visible key tiles j into (m, l, acc) with the online
softmax, then O_i = acc / l, LSE_i = m + log l. A row that sees no key (by the mask) gets 0 and -inf.

HBM traffic per (batch, head), in elements: exactly that of the one-thread-per-row v2 (iomodel.traffic("v2",
...), proofs/L5): Q read once per query tile that sees a key, K and V read d K_i per query tile, O written
N_q d, LSE written N_q. Non-causal: Q N_q d, K and V T_r N_k d each.

Launch: grid (T_r, B H), block (B_r / TM) (B_c / TN) threads (layout.Layout); each thread owns a TM x TN
micro-tile of S and a TM x TD micro-tile of O in registers. Per key tile: load K_j^T and V_j, S = scale Q_i
K_j^T, row max through shared memory, p = exp(s - shift), P^T through shared memory, O = alpha O + P V.

Limits and departures from the paper:
- FP32 CUDA cores only (FFMA): no tensor cores, no asynchronous copies, no warp shuffles (the simulator
  has none; the reductions go through shared memory). Scalar global loads (Numba has no vector load).
- Static shared memory <= 48 KB: tiles and micro-tiles per head dim in `kernels.default_tiles`.
- Inputs float32, float16 or bfloat16 (as its bits); arithmetic, O and LSE in float32.
"""

from __future__ import annotations

import functools

from numba import boolean, cuda, float32

from fa_numba.kernels.block_lists import PAIR_FORMS
from fa_numba.kernels.common import NEG_INF, ZERO, Config, V2Kernel, log_sum_exp, output
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
    BR, BC, TM, TN, TD, CX = layout.block_q, layout.block_k, layout.tm, layout.tn, layout.td, layout.cx
    CAUSAL, ALIASED, LISTS, DENSE = config.causal, layout.aliased, config.lists, config.form in PAIR_FORMS
    OFF = layout.offsets
    SMEM, Q, K, V, RED = OFF["_total"], OFF["q"], OFF["k"], OFF["v"], OFF["red"]
    # how P V keeps masked value rows out of PARTIAL tiles (engine.pv)
    GUARD_PARTIAL = GUARD_MARKED if LISTS else GUARD_CAUSAL
    PARTIAL_KIND = int(PARTIAL)
    MOD = has_scores(config.mod)  # a score mod compiled in (kernels.score_mod): applied after the mask
    modded_tile = tile_mod(config.mod, TM, TN)
    VALUE_DIM = config.value_dim != 0  # O's head dim its own (compile-time: else the code of d_v = d, unchanged)

    def flash_v2_engine(q, k, v, o, lse, scale, row_ptrs, col_idxs, col_kinds, col_ptrs, row_idxs, row_kinds, lohis, denses,
                        captured):
        i = cuda.blockIdx.x  # query tile
        bh = cuda.blockIdx.y  # (batch, head)
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
        r0 = i * BR
        rows = min(BR, n_q - r0)
        row = r0 + ty * TM  # the thread's first row
        # The key tiles this query tile visits, in increasing j; the rest are SKIP (L3): with causal masking
        # 0 .. j_end - 1 (closed form), with a block mask the list col_idx[row_ptr[i]:row_ptr[i + 1]].
        start = 0
        stop = (n_k + BC - 1) // BC
        if CAUSAL:
            last_key = r0 + rows - 1 + delta
            stop = min(stop, last_key // BC + 1) if last_key >= 0 else 0
        if LISTS:
            start = row_ptr[i]
            stop = row_ptr[i + 1]

        smem = cuda.shared.array(SMEM, float32)  # Q^T | K^T | V | P^T | red at layout.offsets
        s = cuda.local.array((TM, TN), float32)  # S_ij then P_ij: registers
        dead = cuda.local.array((TM, TN), boolean)  # masked pairs of the block-mask path
        acc = cuda.local.array((TM, TD), float32)  # O_i, unnormalised: registers, across the whole j loop
        m = cuda.local.array(TM, float32)  # row max so far
        l = cuda.local.array(TM, float32)  # the thread's partial row sum (its columns only)
        alpha = cuda.local.array(TM, float32)
        limit = cuda.local.array(TM, float32)  # last visible key of each row, relative to the tile

        for a in range(TM):
            m[a] = NEG_INF
            l[a] = ZERO
            for e in range(TD):
                acc[a, e] = ZERO
            for c in range(TN):
                dead[a, c] = False
        if stop > start:  # a query tile that sees no key never reads Q
            load_q(q, b, h, r0, rows, smem, Q, tid)  # Q_i^T: loaded once

        for idx in range(start, stop):  # invariant: (m, l, acc) is the state of the visited tiles so far (L2, L4)
            j = col_idx[idx] if LISTS else idx
            c0 = j * BC
            cols = min(BC, n_k - c0)
            # every thread has finished the previous tile's P V (reads of V and P^T) before they are overwritten
            cuda.syncthreads()
            load_kv(k, v, b, h_kv, c0, cols, smem, K, V, tid)  # K_j^T and V_j: reloaded per j
            # K_j^T, V_j (and Q_i^T) are complete before any thread reads them
            cuda.syncthreads()
            # PARTIAL tile: the mask is needed inside it
            partial = col_kind[idx] == PARTIAL_KIND if LISTS else CAUSAL and c0 + cols - 1 > r0 + delta
            masked_scores(smem, s, dead, ty, tx, scale, row, c0, cols, n_q, n_k, delta, partial, CAUSAL, LISTS, lohi,
                          dense, DENSE, b, h, captured)
            if MOD:  # S' = mod(S) at the visible pairs (the masked ones keep their -inf)
                modded_tile(s, dead, b, h, row, c0 + tx * TN, n_q, n_k, delta, partial, CAUSAL, LISTS, captured)
            if ALIASED:
                # P^T and red live in K^T's space: every thread has read K^T before they are written
                cuda.syncthreads()
            row_max_partials(smem, s, ty, tx)
            # every partial row max is written before any thread reads them
            cuda.syncthreads()
            softmax(smem, s, m, l, alpha, ty)
            store_p(smem, s, dead, LISTS and partial, ty, tx)
            # P^T is complete before the P V product reads it
            cuda.syncthreads()
            for a in range(TM):
                limit[a] = float32(row + a + delta - c0)
            pv(smem, acc, alpha, ty, tx, GUARD_PARTIAL if partial else GUARD_NONE, limit)

        # The row sum: add the row group's partial sums (red was last read before the last P^T barrier).
        write_partials(smem, RED, l, ty, tx)
        # every partial row sum is written before any thread adds them up
        cuda.syncthreads()
        row_sum(smem, RED, l, ty)
        for a in range(TM):  # O_i and LSE_i written once; a row with no visible key (by the mask) gets 0, -inf
            r = row + a
            if r < n_q:
                alive = not CAUSAL or r + delta >= 0
                if LISTS:
                    alive = lohi[r, 0] < lohi[r, 1]
                for e in range(TD):
                    x = column(tx, e)
                    if x < d_v:
                        o[b, h, r, x] = output(acc[a, e], l[a], alive)
                if tx == 0:
                    lse[b, h, r] = log_sum_exp(m[a], l[a], alive)

    return flash_v2_engine


class FlashV2Engine(V2Kernel):
    """A compiled register-tiled v2 specialisation (it needs no workspace)."""

    def launch_shape(self, batch, heads, n_q):
        layout = self.config.layout
        return ((n_q + self.config.block_q - 1) // self.config.block_q, batch * heads), (layout.cx, layout.ry)


@functools.lru_cache(maxsize=None)
def make_v2_engine(block_q: int, block_k: int, head_dim: int, causal: bool, mask_form: str = "none",
                   micro: tuple | None = None, mod=None, value_dim: int = 0) -> FlashV2Engine:
    """Build (once per configuration) the register-tiled v2 kernel for these compile-time tile sizes (micro:
    the (TM, TN) micro-tile, by default layout.micro_for's; the decode kernels' layouts choose their own; mod:
    a score_mod.KernelMod compiled in, or None; value_dim: V's and O's head dim d_v where it differs from d,
    the tiles then staged max(d, d_v) wide, `Layout.d_pad`)."""
    return FlashV2Engine(Config("v2", block_q, block_k, head_dim, bool(causal), engine=True, mask_form=mask_form,
                                micro=micro, mod=mod, value_dim=value_dim).check(), kernel_source)
