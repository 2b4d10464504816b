"""The tensor-core backward's deterministic dQ pass (Q outer, no atomics; kernels.mma.backward's docstring has
its fragments and traffic): the second kernel of `deterministic=True`.
"""

from __future__ import annotations

from types import SimpleNamespace

from numba import cuda, float32, uint16, uint32

from fa_numba import warp
from fa_numba.kernels.common import ZERO
from fa_numba.kernels.mma import masking
from fa_numba.kernels.mma.backward_kv import _exact_product, _row_writer, row_fragments, store_pair
from fa_numba.kernels.mma.engine import LOG2E, make_ops
from fa_numba.kernels.mma.products16 import fragments_times_staged
from fa_numba.kernels.mma.tf32 import unrolled
from fa_numba.kernels.score_mod import apply_fn, apply_grad, has_scores
from fa_numba.tiling import PARTIAL


def dq_products16(config):
    """The 16-bit pieces of the dq pass, for `dq_source`: staging (the forward engine's), Q_i's and dO_i's A
    fragments held for the block's life (`hold`), one 8-key block of S and dP (`block_scores`), the warp's dS rows
    into shared memory for the exact path (`store_ds`) and dQ += dS K_j (`dq_product`). The float32 inputs'
    pieces are kernels.mma.backward_tf32's."""
    E = make_ops(config.staging())
    mma, pack = E.mma, E.pack
    BC, DP, SQ = config.block_k, config.padded_dim, config.row_stride
    KS, DN, PK = DP // 16, DP // 8, BC // 16
    SV, KSV, KSM = E.sizes.SV, E.sizes.DPV // 16, max(DP, E.sizes.DPV) // 16  # dP = dO_i V_j^T runs over d_v
    SDK = BC + 8  # the exact path's dS rows, 16-bit, B_c + 8 apart
    hold_rows = row_fragments(KS, KSV, SQ, SV)  # Q_i's and dO_i's A fragments, read once

    @cuda.jit(device=True, inline=True)
    def block_scores(nt, qf, of, sq, sdo, sk, sv, wid, mrow, mat):
        """(S, dP) of 8-key block nt for the warp's 16 rows: Q_i's and dO_i's held fragments, K_j's and V_j's by
        ldmatrix x2."""
        d4 = (ZERO, ZERO, ZERO, ZERO)
        e4 = (ZERO, ZERO, ZERO, ZERO)
        for ks in range(KSM):  # S's k-steps run over d, dP's over d_v
            if ks < KS:
                d4 = mma(d4, (qf[ks, 0], qf[ks, 1], qf[ks, 2], qf[ks, 3]),
                         warp.ldmatrix_x2(sk, (8 * nt + mrow) * SQ + 16 * ks + 8 * (mat & 1)))
            if ks < KSV:
                e4 = mma(e4, (of[ks, 0], of[ks, 1], of[ks, 2], of[ks, 3]),
                         warp.ldmatrix_x2(sv, (8 * nt + mrow) * SV + 16 * ks + 8 * (mat & 1)))
        return d4, e4

    @cuda.jit(device=True, inline=True)
    def store_ds(sds, dp, wid, g, t):
        """The warp's own 16 rows of dS into sds, rounded to 16 bits as the mma path reads them."""
        for nt in range(BC // 8):
            base = (16 * wid + g) * SDK + 8 * nt + 2 * t
            store_pair(sds, base, pack(dp[nt, 0], dp[nt, 1]))
            store_pair(sds, base + 8 * SDK, pack(dp[nt, 2], dp[nt, 3]))

    # acc += dS K_j: dS's A fragments the warp's own (rounded to 16 bits), K_j's B fragments by ldmatrix x4 .trans
    dq_product = fragments_times_staged(PK, DN, SQ, mma, pack)

    return SimpleNamespace(stage_two=E.stage_two, any_bad=E.any_bad, any_bad_v=E.any_bad_v, to_f32=E.to_f32,
                           element=uint16, fragment=uint32, held=(KS, 4), held_v=(KSV, 4), SV=SV, SDK=SDK,
                           hold=hold_rows, block_scores=block_scores, store_ds=store_ds, dq_product=dq_product,
                           written_out=False)


def dq_source(config, P):
    """The Python function of the deterministic dQ pass: bwd_dq_mma(q, k, v, do, lse, dvec, dq, scale); P its
    products' pieces (`dq_products16`, or kernels.mma.backward_tf32's for float32 inputs)."""
    stage_two, any_bad, any_bad_v, to_f32 = P.stage_two, P.any_bad, P.any_bad_v, P.to_f32
    hold_rows, block_scores, store_ds, dq_product = P.hold, P.block_scores, P.store_ds, P.dq_product
    ELEM, FRAG, HELD, HELDV, SV, SDK = P.element, P.fragment, P.held, P.held_v, P.SV, P.SDK
    BR, BC, D, DP, SQ = config.block_q, config.block_k, config.head_dim, config.padded_dim, config.row_stride
    NT, DN = BC // 8, DP // 8
    CAUSAL = config.causal
    M = masking.make(CAUSAL, config.mask_form, config.mod)  # as in the kv kernel
    GUARDED, LISTS, PARTIAL_KIND, slot, visible = M.GUARDED, M.LISTS, int(PARTIAL), masking.slot, M.visible
    exact_dq = _exact_product(BC, SDK, DN, SQ, to_f32, visible, lane_owns_keys=False)
    write_rows = _row_writer(D, DN)
    Q_SIZE, KV_SIZE, DS_SIZE, DO_SIZE, V_SIZE = BR * SQ, BC * SQ, BR * SDK, BR * SV, BC * SV
    MOD = has_scores(config.mod)
    modded, slope = apply_fn(config.mod), apply_grad(config.mod)

    @cuda.jit(device=True, inline=True)
    def ds_block(nt, dp, tiles, where, rows, lists):
        """dS of 8-key block nt of the warp's 16 rows into dp[nt]: S and dP by the products, P = exp(S - LSE),
        dS = P (dP - D), 0 at masked pairs."""
        qf, of, sq, sdo, sk, sv = tiles
        wid, mrow, mat, row0, c0, t, n_q, n_k, delta, b, h, sb, sh = where
        masked, scale, lse0, lse1, d0, d1 = rows
        lohis, denses, captured = lists
        d4, e4 = block_scores(nt, qf, of, sq, sdo, sk, sv, wid, mrow, mat)
        for e in range(4):
            row = row0 + 8 * (e >> 1)
            ds = ZERO
            if not masked or visible(row, c0 + 8 * nt + 2 * t + (e & 1), n_q, n_k, delta, lohis, denses, sb, sh,
                                     b, h, captured):
                x = scale * d4[e]
                if MOD:  # as in the kv kernel (proofs/L13)
                    key = c0 + 8 * nt + 2 * t + (e & 1)
                    p = warp.ex2(modded(x, b, h, row, key, captured) * LOG2E - (lse0 if e < 2 else lse1))
                    ds = p * (e4[e] - (d0 if e < 2 else d1)) * slope(x, b, h, row, key, captured)
                else:
                    p = warp.ex2(x * LOG2E - (lse0 if e < 2 else lse1))
                    ds = p * (e4[e] - (d0 if e < 2 else d1))
            dp[nt, e] = ds

    @cuda.jit(device=True, inline=True)
    def ds_block_fenced(nt, dp, tiles, where, rows, lists):
        """ds_block, then a warp barrier between blocks: with it ptxas no longer interleaves the blocks' k-steps
        (their spills went away, 1116 bytes at d = 128 without it)."""
        ds_block(nt, dp, tiles, where, rows, lists)
        cuda.syncwarp()

    # The 3xTF32 products' key-block body is large enough that ptxas keeps the block loop rolled, so nt is a
    # run-time value and dp[nt] sends dp to local memory (32 to 176 bytes of stack, the estimate withheld); those
    # products ask for the blocks written out (P.written_out), fenced, since written out alone their k-steps
    # interleave and spill (1116 bytes at d = 128). The 16-bit loop is unrolled by the compiler as it is.
    WRITTEN_OUT = P.written_out
    ds_blocks = unrolled(NT, ds_block_fenced)

    def bwd_dq_mma(q, k, v, do, lse, dvec, dq, scale, row_ptrs, col_idxs, col_kinds, col_ptrs, row_idxs, row_kinds,
                   lohis, denses, captured):
        sq = cuda.shared.array(Q_SIZE, ELEM)
        sdo = cuda.shared.array(DO_SIZE, ELEM)
        sk = cuda.shared.array(KV_SIZE, ELEM)
        sv = cuda.shared.array(V_SIZE, ELEM)
        sds = cuda.shared.array(DS_SIZE, ELEM)  # the exact path's dS, each warp its own 16 rows
        slse = cuda.shared.array(BR, float32)  # LSE_i and D_i, read once per row (not once per lane of a quad)
        sd = cuda.shared.array(BR, float32)
        qf = cuda.local.array(HELD, FRAG)  # this lane's A fragments of Q_i and dO_i, where P holds them
        of = cuda.local.array(HELDV, FRAG)
        dp = cuda.local.array((NT, 4), float32)  # dS of the warp's 16 rows x B_c keys
        acc = cuda.local.array((DN, 4), float32)  # dQ without the scale
        i, bh = cuda.blockIdx.x, cuda.blockIdx.y
        lane, wid = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
        g, t = lane >> 2, lane & 3
        mrow, mat = lane & 7, lane >> 3
        heads, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
        b = bh // heads
        h = bh - b * heads
        h_kv = h // (heads // k.shape[1])
        delta = n_k - n_q
        r0 = i * BR
        row0 = r0 + 16 * wid + g
        last = min(r0 + BR, n_q) - 1 + delta
        sb, sh = slot(lohis, b, h)
        start, stop = 0, (n_k + BC - 1) // BC  # the key tiles as the forward's v2 walks them
        if CAUSAL:
            stop = min(stop, (last + BC) // BC) if last >= 0 else 0
        if LISTS:
            start, stop = row_ptrs[sb, sh, i], row_ptrs[sb, sh, i + 1]

        stage_two(q, do, b, h, r0, n_q, sq, sdo, BR)
        tid = cuda.threadIdx.x
        if tid < BR:  # B_r = 16 W rows for 32 W threads: one row each
            slse[tid] = lse[b, h, r0 + tid] * LOG2E if r0 + tid < n_q else ZERO  # LSE_i log2(e): P by ex2
            sd[tid] = dvec[b, h, r0 + tid] if r0 + tid < n_q else ZERO
        cuda.syncthreads()
        q_bad = False
        if GUARDED:
            q_bad = cuda.syncthreads_or(1 if (any_bad(sq, BR) or any_bad_v(sdo, BR)) else 0) != 0
        hold_rows(sq, qf, sdo, of, wid, mrow, mat)
        local = 16 * wid + g
        lse0, lse1, d0, d1 = slse[local], slse[local + 8], sd[local], sd[local + 8]
        for dn in range(DN):
            for e in range(4):
                acc[dn, e] = ZERO
        for idx in range(start, stop):
            j = col_idxs[sb, sh, idx] if LISTS else idx
            c0 = j * BC
            cuda.syncthreads()  # the previous K_j, V_j are no longer read
            stage_two(k, v, b, h_kv, c0, n_k, sk, sv, BC)
            cuda.syncthreads()
            hidden = col_kinds[sb, sh, idx] == PARTIAL_KIND if LISTS else CAUSAL and c0 + BC - 1 > r0 + delta
            masked = hidden or c0 + BC > n_k or r0 + BR > n_q
            guard = False
            if GUARDED and masked:
                bad = q_bad or any_bad(sk, BC) or any_bad_v(sv, BC)
                guard = cuda.syncthreads_or(1 if bad else 0) != 0
            tiles, where = (qf, of, sq, sdo, sk, sv), (wid, mrow, mat, row0, c0, t, n_q, n_k, delta, b, h, sb, sh)
            rows, lists = (masked, scale, lse0, lse1, d0, d1), (lohis, denses, captured)
            if WRITTEN_OUT:  # each block's nt a constant: dp stays in registers
                ds_blocks(dp, tiles, where, rows, lists)
            else:
                for nt in range(NT):
                    ds_block(nt, dp, tiles, where, rows, lists)
            if guard:  # the warp's own rows of sds
                store_ds(sds, dp, wid, g, t)
                cuda.syncwarp()
                exact_dq(acc, sds, sk, row0, 16 * wid + g, c0, n_q, n_k, delta, t, lohis, denses, sb, sh, b, h,
                         captured)
                cuda.syncwarp()
            else:
                dq_product(acc, dp, sk, mrow, mat)
        write_rows(dq, b, h, row0, n_q, acc, scale, t)

    return bwd_dq_mma


__all__ = ["dq_products16", "dq_source"]
