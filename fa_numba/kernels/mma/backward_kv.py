"""The tensor-core backward's K/V-outer kernel (FlashAttention-2's backward; kernels.mma.backward's docstring
has the fragments each product reads, the HBM traffic, the exact path for non-finite inputs and the limits),
and the pieces the deterministic dQ pass (kernels.mma.backward_dq) shares with it: packed 16-bit stores, the
row writer of the accumulator fragments and the exact path's CUDA-core reduction.
"""

from __future__ import annotations

import numpy as np
from types import SimpleNamespace

from numba import cuda, float32, uint16, uint32

from fa_numba import warp
from fa_numba.kernels.common import ZERO
from fa_numba.kernels.mma import masking
from fa_numba.kernels.mma.engine import LOG2E, make_ops
from fa_numba.kernels.mma.products16 import fragments_times_staged
from fa_numba.kernels.score_mod import apply_fn, apply_grad, has_scores
from fa_numba.tiling import PARTIAL


@cuda.jit(device=True, inline=True)
def store_pair(tile, index, bits):
    """Two 16-bit values packed in `bits` (lower index in the low half) at tile[index], tile[index + 1]."""
    tile[index] = uint16(bits & 0xFFFF)
    tile[index + 1] = uint16(bits >> 16)


def _row_writer(D: int, DN: int):
    """write_rows(dst, b, h, row0, n, acc, factor, t): this lane's accumulator fragments (rows row0, row0 + 8
    of the C layout, columns 8 dn + 2t, 8 dn + 2t + 1) times factor into dst[b, h], rows < n and columns < d."""

    @cuda.jit(device=True, inline=True)
    def write_rows(dst, b, h, row0, n, acc, factor, t):
        for half in range(2):
            row = row0 + 8 * half
            if row < n:
                for dn in range(DN):
                    for e in range(2):
                        x = 8 * dn + 2 * t + e
                        if x < D:
                            dst[b, h, row, x] = factor * acc[dn, 2 * half + e]

    return write_rows


def _exact_product(count: int, stride: int, DN: int, SQ: int, to_f32, visible, lane_owns_keys: bool):
    """The exact path's product, acc += X src over the visible pairs only, on the CUDA cores in float32 (module
    docstring, non-finite inputs): X is the warp's two rows local0, local0 + 8 of a 16-bit buffer (`stride`
    apart; P^T, dS^T or dS as the mma path reads them, rounded), src a staged tile (rows SQ apart), and the
    reduction runs over `count` entries r, src's rows. The lane's two rows are keys own0, own0 + 8 against
    queries other0 + r (lane_owns_keys: dV, dK in the kv kernel) or queries own0, own0 + 8 against keys
    other0 + r (dQ in the dq pass)."""

    @cuda.jit(device=True, inline=True)
    def exact(acc, buf, src, own0, local0, other0, n_q, n_k, delta, t, lohis, denses, sb, sh, b, h, captured):
        for r in range(count):
            if lane_owns_keys:
                see0 = visible(other0 + r, own0, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
                see1 = visible(other0 + r, own0 + 8, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
            else:
                see0 = visible(own0, other0 + r, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
                see1 = visible(own0 + 8, other0 + r, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
            if see0 or see1:
                x0, x1 = to_f32(buf[local0 * stride + r]), to_f32(buf[(local0 + 8) * stride + r])
                for dn in range(DN):
                    for e in range(2):
                        y = to_f32(src[r * SQ + 8 * dn + 2 * t + e])
                        if see0:
                            acc[dn, e] += x0 * y
                        if see1:
                            acc[dn, 2 + e] += x1 * y

    return exact


# x & NONNEG: x with its sign bit cleared, so the compiler knows it is not negative; an int64 (a Python int this
# large would overflow a simulated int32 index under NumPy's promotion rules)
NONNEG = np.int64(2**63 - 1)


def row_fragments(KS: int, KSV: int, SQ: int, SV: int):
    """hold(x, xf, y, yf, wid, mrow, mat): the A fragments of the warp's 16 rows of two staged tiles into
    registers by ldmatrix x4, x's (d wide, rows SQ apart) into xf[:KS], y's (d_v wide, rows SV apart) into
    yf[:KSV] (K_j and V_j in the kv kernel, Q_i and dO_i in the dq pass)."""
    KSM = max(KS, KSV)

    @cuda.jit(device=True, inline=True)
    def hold(x, xf, y, yf, wid, mrow, mat):
        for ks in range(KSM):
            if ks < KS:
                a = warp.ldmatrix_x4(x, (16 * wid + mrow + 8 * (mat & 1)) * SQ + 16 * ks + 8 * (mat >> 1))
                for e in range(4):
                    xf[ks, e] = a[e]
            if ks < KSV:
                c = warp.ldmatrix_x4(y, (16 * wid + mrow + 8 * (mat & 1)) * SV + 16 * ks + 8 * (mat >> 1))
                for e in range(4):
                    yf[ks, e] = c[e]

    return hold


def kv_products16(config):
    """The 16-bit pieces of the K/V-outer kernel (kernels.mma.backward's docstring: each product's fragments),
    for `kv_source`: staging (the forward engine's), K_j's and V_j's A fragments held or read by ldmatrix, S^T
    and dP^T (`scores`), dV += P^T dO_i and dK += dS^T Q_i (`grads`), the warp's rows of P^T or dS^T into shared
    memory rounded to 16 bits (`store_rows`) and one unit of dQ_i by ldmatrix .trans (`dq_unit`). The float32
    inputs' pieces are kernels.mma.backward_tf32's."""
    E = make_ops(config.staging())
    mma, pack = E.mma, E.pack
    BR, BC, D, DP, SQ, SDS = (config.block_q, config.block_k, config.head_dim, config.padded_dim, config.row_stride,
                              config.ds_stride)
    KS, NQ, DN, KQ, KK = DP // 16, BR // 8, DP // 8, BR // 16, BC // 16
    SV, KSV, DNV = E.sizes.SV, E.sizes.DPV // 16, E.sizes.DNV
    KSC = min(KS, KSV)  # the k-steps S^T and dP^T share
    DNS = dq_split(config)[1]
    HOLD = max(DP, E.sizes.DPV) <= 64  # K_j's and V_j's A fragments held in registers for the block's life
    add_dq = dq_adder(D)

    @cuda.jit(device=True, inline=True)
    def store_rows(sds, x, wid, g, t):
        """This warp's 16 rows of x^T (P^T or dS^T, 16 keys x B_r queries) into sds, rounded to 16 bits: the
        values its A fragments hold, at rows 16 w + g (+ 8), queries 8 nt + 2t."""
        for nt in range(NQ):
            base = (16 * wid + g) * SDS + 8 * nt + 2 * t
            store_pair(sds, base, pack(x[nt, 0], x[nt, 1]))
            store_pair(sds, base + 8 * SDS, pack(x[nt, 2], x[nt, 3]))

    # acc += X^T src: X^T's A fragments the warp's own (x: 16 keys x B_r queries in the C layout, rounded to 16
    # bits), src (Q_i or dO_i, B_r x DP) B fragments by ldmatrix x4 .trans, two column blocks a load
    hold_rows = row_fragments(KS, KSV, SQ, SV)

    @cuda.jit(device=True, inline=True)
    def hold(sk, kf, sv, vf, wid, mrow, mat):
        if HOLD:
            hold_rows(sk, kf, sv, vf, wid, mrow, mat)

    @cuda.jit(device=True, inline=True)
    def a_fragment(held, tile, stride, ks, wid, mrow, mat):
        """The warp's A fragment of X_j (K_j or V_j, rows `stride` apart) at k-step ks: held (HOLD) or read by
        ldmatrix x4."""
        if HOLD:
            return held[ks, 0], held[ks, 1], held[ks, 2], held[ks, 3]
        return warp.ldmatrix_x4(tile, (16 * wid + mrow + 8 * (mat & 1)) * stride + 16 * ks + 8 * (mat >> 1))

    @cuda.jit(device=True, inline=True)
    def b_fragments(tile, stride, ks, np_, mrow, mat):
        """Y_i^T's B fragments (Q_i or dO_i) of the 8-query blocks 2 np_, 2 np_ + 1 at k-step ks: one ldmatrix x4."""
        return warp.ldmatrix_x4(tile, (16 * np_ + 8 * (mat >> 1) + mrow) * stride + 16 * ks + 8 * (mat & 1))

    @cuda.jit(device=True, inline=True)
    def a_times_b(c4, c5, ks, np_, held, sa, sb_, stride, wid, mrow, mat):
        """k-step ks of the two 8-query blocks of X_j Y_i^T alone (S^T or dP^T where the other has no k-step)."""
        a = a_fragment(held, sa, stride, ks, wid, mrow, mat)
        b = b_fragments(sb_, stride, ks, np_, mrow, mat)
        return mma(c4, a, (b[0], b[1])), mma(c5, a, (b[2], b[3]))

    @cuda.jit(device=True, inline=True)
    def scores(s, dp, kf, vf, sk, sv, sq, sdo, wid, mrow, mat):
        """S^T and dP^T in s and dp, two 8-query blocks at a time: K_j's and V_j's A fragments read once per
        k-step for both (at d = 128, B_r = 16, once per visit), Q_i's and dO_i's B fragments of the two blocks
        by one ldmatrix x4 each (NQ = B_r / 8 is even); each block's sum runs over the k-steps in order."""
        for np_ in range(NQ // 2):
            d4, d5 = (ZERO, ZERO, ZERO, ZERO), (ZERO, ZERO, ZERO, ZERO)  # S^T: blocks 2 np_, 2 np_ + 1
            e4, e5 = (ZERO, ZERO, ZERO, ZERO), (ZERO, ZERO, ZERO, ZERO)  # dP^T
            # S^T's k-steps run over d, dP^T's over d_v: both where both have one, then the longer's own
            # (separate loops with constant trips, so each unrolls: no k-step tested in a loop)
            for ks in range(KSC):
                ak = a_fragment(kf, sk, SQ, ks, wid, mrow, mat)
                av = a_fragment(vf, sv, SV, ks, wid, mrow, mat)
                bq = b_fragments(sq, SQ, ks, np_, mrow, mat)
                bo = b_fragments(sdo, SV, ks, np_, mrow, mat)
                d4 = mma(d4, ak, (bq[0], bq[1]))
                d5 = mma(d5, ak, (bq[2], bq[3]))
                e4 = mma(e4, av, (bo[0], bo[1]))
                e5 = mma(e5, av, (bo[2], bo[3]))
            for ks in range(KSC, KS):
                d4, d5 = a_times_b(d4, d5, ks, np_, kf, sk, sq, SQ, wid, mrow, mat)
            for ks in range(KSC, KSV):
                e4, e5 = a_times_b(e4, e5, ks, np_, vf, sv, sdo, SV, wid, mrow, mat)
            for e in range(4):
                s[2 * np_, e], s[2 * np_ + 1, e] = d4[e], d5[e]
                dp[2 * np_, e], dp[2 * np_ + 1, e] = e4[e], e5[e]

    product = fragments_times_staged(KQ, DN, SQ, mma, pack)
    product_v = fragments_times_staged(KQ, DNV, SV, mma, pack)  # dV += P^T dO_i, d_v wide

    @cuda.jit(device=True, inline=True)
    def grads(dva, dka, s, dp, sdo, sq, mrow, mat):
        """dV += P^T dO_i and dK += dS^T Q_i (without the scale) from the warp's own fragments."""
        product_v(dva, s, sdo, mrow, mat)
        product(dka, dp, sq, mrow, mat)

    @cuda.jit(device=True, inline=True)
    def dq_unit(af, sds, sk, dq, b, h, row0, mi, part, scale, n_q, g, t, mrow, mat):
        """dQ_i's 16-row slice mi, its column blocks `part`, += scale dS K_j by atomic adds: dS's A fragments by
        ldmatrix x4 .trans of sds, K_j's B fragments by ldmatrix x2 .trans."""
        for kk in range(KK):
            a = warp.ldmatrix_x4_trans(sds, (16 * kk + mrow + 8 * (mat >> 1)) * SDS + 16 * mi + 8 * (mat & 1))
            for e in range(4):
                af[kk, e] = a[e]
        for dd in range(DNS):
            dn = part * DNS + dd
            d4 = (ZERO, ZERO, ZERO, ZERO)
            for kk in range(KK):
                bk = warp.ldmatrix_x2_trans(sk, (16 * kk + mrow + 8 * (mat & 1)) * SQ + 8 * dn)
                d4 = mma(d4, (af[kk, 0], af[kk, 1], af[kk, 2], af[kk, 3]), bk)
            add_dq(dq, b, h, row0, dn, d4, scale, n_q, t)

    HELD, HELDV = (KS if HOLD else 1), (KSV if HOLD else 1)
    return SimpleNamespace(stage_two=E.stage_two, any_bad=E.any_bad, any_bad_v=E.any_bad_v, to_f32=E.to_f32,
                           element=uint16, fragment=uint32, held=(HELD, 4), held_v=(HELDV, 4), af=(KK, 4),
                           DV=E.sizes.DV, SV=SV, DNV=DNV, hold=hold, scores=scores, grads=grads,
                           store_rows=store_rows, dq_unit=dq_unit)


def dq_split(config) -> tuple[int, int]:
    """(SPLIT, DNS): the warps sharing one 16-row slice of dQ_i, and the 8-column blocks each takes."""
    slices, warps = config.block_q // 16, config.warps
    split = warps // slices if warps > slices else 1
    return split, (config.padded_dim // 8) // split


def dq_adder(D: int):
    """add_dq(dq, b, h, row0, dn, d4, scale, n_q, t): atomically add scale x a lane's dQ fragment (rows row0,
    row0 + 8; 8-column block dn) into dQ. The indices go in with their sign bit cleared (& NONNEG; they are not
    negative): numba-cuda wraps an atomic's index like a negative Python index unless the compiler can prove it
    is not negative, which it could not for these (a test and a select per index and element: a d = 64 visit
    1254 instructions with them, 1165 without; 1070 and 985 at d = 128, sm_90a). The mask keeps them 64-bit
    (L9)."""

    @cuda.jit(device=True, inline=True)
    def add_dq(dq, b, h, row0, dn, d4, scale, n_q, t):
        for e in range(4):
            row = row0 + 8 * (e >> 1)
            x = 8 * dn + 2 * t + (e & 1)
            if row < n_q and x < D:
                cuda.atomic.add(dq, (b & NONNEG, h & NONNEG, row & NONNEG, x & NONNEG), scale * d4[e])

    return add_dq


def kv_source(config, P):
    """The Python function of the K/V-outer kernel (cuda.jit compiles it for a launch, fa_numba.profile for
    sm_90a): bwd_kv_mma(q, k, v, do, lse, dvec, dq, dk, dv, scale); P its products' pieces (`kv_products16`, or
    kernels.mma.backward_tf32's for float32 inputs)."""
    stage_two, any_bad, any_bad_v, to_f32 = P.stage_two, P.any_bad, P.any_bad_v, P.to_f32
    hold, scores, grads, store_rows, dq_unit = P.hold, P.scores, P.grads, P.store_rows, P.dq_unit
    ELEM, FRAG, HELD, HELDV, AF = P.element, P.fragment, P.held, P.held_v, P.af
    W, BR, BC, D, DP, SQ, SDS = (config.warps, config.block_q, config.block_k, config.head_dim, config.padded_dim,
                                 config.row_stride, config.ds_stride)
    NQ, DN = BR // 8, DP // 8
    # V_j, dO_i and dV at d_v: their column blocks (dV) and row stride
    DV, SV, DNV = P.DV, P.SV, P.DNV
    SLICES = BR // 16
    SPLIT, DNS = dq_split(config)  # warps sharing one 16-row slice of dQ_i, each DN / SPLIT blocks
    UNITS = SLICES * SPLIT
    CAUSAL, ATOMIC_DQ = config.causal, not config.deterministic
    # a barrier after each visit's products: the atomic kernel's, before its dQ; the deterministic float32 pass
    # keeps it too: without it ptxas spilled its causal builds at 255 registers (d = 64: 88 bytes, now none and
    # 177 registers; d = 128: 72, now 28; docs/profile.md)
    VISIT_BARRIER = ATOMIC_DQ or config.kind == "float32"
    # Only a causal visit or a block mask can mask a pair between two rows that hold data: without them the
    # masked pairs are those of padded rows or keys (staged as zeros), whose products are 0 whatever the data
    # holds, so the exact path is compiled in for masked kernels only (kernels.mma.backward, non-finite inputs)
    M = masking.make(CAUSAL, config.mask_form, config.mod)
    GUARDED, LISTS, PARTIAL_KIND, slot = M.GUARDED, M.LISTS, int(PARTIAL), masking.slot
    PER_WARP = UNITS // W if UNITS >= W else 1  # dQ units per warp, a constant: the loop unrolls
    Q_SIZE, KV_SIZE, DS_SIZE = BR * SQ, BC * SQ, BC * SDS
    DO_SIZE, V_SIZE = BR * SV, BC * SV
    visible = M.visible
    exact_reduce = _exact_product(BR, SDS, DN, SQ, to_f32, visible, lane_owns_keys=True)  # dK: over Q_i
    exact_reduce_v = _exact_product(BR, SDS, DNV, SV, to_f32, visible, lane_owns_keys=True)  # dV: over dO_i
    write_rows, write_rows_v = _row_writer(D, DN), _row_writer(DV, DNV)
    MOD = has_scores(config.mod)
    modded, slope = apply_fn(config.mod), apply_grad(config.mod)  # fn and d fn / d score (identity, 1 without)

    @cuda.jit(device=True, inline=True)
    def exact_dq(sds, sk, dq, b, h, row0, local0, c0, part, scale, n_q, n_k, delta, t, lohis, denses, sb, sh,
                 captured):
        """dQ_i += scale dS K_j over the visible pairs only, on the CUDA cores in float32, for this lane's entries
        of the slice's column blocks `part` (dS from shared memory, as the mma path reads it)."""
        for dd in range(DNS):
            dn = part * DNS + dd
            for e in range(4):
                row, local = row0 + 8 * (e >> 1), local0 + 8 * (e >> 1)
                x = 8 * dn + 2 * t + (e & 1)
                total = ZERO
                for c in range(BC):
                    if visible(row, c0 + c, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured):
                        total += to_f32(sds[c * SDS + local]) * to_f32(sk[c * SQ + x])
                if row < n_q and x < D:
                    cuda.atomic.add(dq, (b, h, row, x), scale * total)

    def bwd_kv_mma(q, k, v, do, lse, dvec, dq, dk, dv, scale, row_ptrs, col_idxs, col_kinds, col_ptrs, row_idxs,
                   row_kinds, lohis, denses, captured):
        sk = cuda.shared.array(KV_SIZE, ELEM)
        sv = cuda.shared.array(V_SIZE, ELEM)
        sq = cuda.shared.array(Q_SIZE, ELEM)
        sdo = cuda.shared.array(DO_SIZE, ELEM)
        sds = cuda.shared.array(DS_SIZE, ELEM)  # P^T or dS^T of the block's keys, [key][query]
        slse = cuda.shared.array(BR, float32)
        sd = cuda.shared.array(BR, float32)
        kf = cuda.local.array(HELD, FRAG)  # K_j's and V_j's A fragments, where P holds them
        vf = cuda.local.array(HELDV, FRAG)
        s = cuda.local.array((NQ, 4), float32)  # P^T: the warp's 16 keys x B_r queries
        dp = cuda.local.array((NQ, 4), float32)  # dS^T
        dka = cuda.local.array((DN, 4), float32)  # dK's accumulator (without the scale): 16 keys x DP
        dva = cuda.local.array((DNV, 4), float32)  # dV's: 16 keys x d_v padded
        af = cuda.local.array(AF, FRAG)  # dS's A fragments of one dQ slice
        j, bh = cuda.blockIdx.x, cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane, wid = tid & 31, tid >> 5
        g, t = lane >> 2, lane & 3
        mrow, mat = lane & 7, lane >> 3
        heads, heads_kv, n_q, n_k = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
        group = heads // heads_kv
        b = bh // heads_kv
        hk = bh - b * heads_kv
        delta = n_k - n_q
        c0 = j * BC
        key0 = c0 + 16 * wid + g  # this lane's keys: key0 and key0 + 8
        n_row_tiles = (n_q + BR - 1) // BR
        first = 0
        if CAUSAL:  # the first row that sees key c0 is c0 - delta
            first = max(c0 - delta, 0) // BR
        for dn in range(max(DN, DNV)):
            for e in range(4):
                if dn < DN:
                    dka[dn, e] = ZERO
                if dn < DNV:
                    dva[dn, e] = ZERO
        visited = first < n_row_tiles  # some query tile (of some query head of the group) sees key tile j
        if LISTS:
            visited = False
            for hh in range(group):
                sb, sh = slot(lohis, b, hk * group + hh)
                visited = visited or col_ptrs[sb, sh, j + 1] > col_ptrs[sb, sh, j]
        if not visited:  # a key tile no query tile sees is never read: dK_j = dV_j = 0 (the whole block returns)
            write_rows(dk, b, hk, key0, n_k, dka, scale, t)
            write_rows_v(dv, b, hk, key0, n_k, dva, float32(1), t)
            return

        stage_two(k, v, b, hk, c0, n_k, sk, sv, BC)
        cuda.syncthreads()  # K_j, V_j staged: every thread reaches this barrier
        kv_bad = False
        if GUARDED:
            kv_bad = cuda.syncthreads_or(1 if (any_bad(sk, BC) or any_bad_v(sv, BC)) else 0) != 0
        hold(sk, kf, sv, vf, wid, mrow, mat)

        for hh in range(group):
            h = hk * group + hh
            # the query tiles that see key tile j: from `first` on (causal) or all, or the listed ones
            # row_idx[col_ptr[j]:col_ptr[j + 1]] of this query head's slice (L8; under GQA the query heads of
            # one K/V head may have different lists)
            sb, sh = slot(lohis, b, h)
            start, stop = first, n_row_tiles
            if LISTS:
                start, stop = col_ptrs[sb, sh, j], col_ptrs[sb, sh, j + 1]
            for idx in range(start, stop):
                i = row_idxs[sb, sh, idx] if LISTS else idx
                r0 = i * BR
                cuda.syncthreads()  # the previous visit's Q, dO and sds are no longer read
                if tid < BR:  # B_r <= 32 W threads (DEFAULTS): one row each, no loop in the visit
                    row = r0 + tid
                    slse[tid] = lse[b, h, row] * LOG2E if row < n_q else ZERO  # LSE_i log2(e): P by ex2
                    sd[tid] = dvec[b, h, row] if row < n_q else ZERO
                stage_two(q, do, b, h, r0, n_q, sq, sdo, BR)
                cuda.syncthreads()  # Q_i, dO_i, LSE_i, D_i staged
                # some pair of the visit is masked: causal (key c0 + BC - 1 hidden from row r0) or a PARTIAL tile
                # of the lists, or a tail
                hidden = row_kinds[sb, sh, idx] == PARTIAL_KIND if LISTS else CAUSAL and c0 + BC - 1 > r0 + delta
                masked = hidden or c0 + BC > n_k or r0 + BR > n_q
                guard = False
                if GUARDED and masked:  # the same for the whole block: every thread reaches this barrier
                    bad = kv_bad or any_bad(sq, BR) or any_bad_v(sdo, BR)
                    guard = cuda.syncthreads_or(1 if bad else 0) != 0

                scores(s, dp, kf, vf, sk, sv, sq, sdo, wid, mrow, mat)  # S^T and dP^T
                for nt in range(NQ):  # P^T and dS^T in place, 0 at masked pairs
                    for e in range(4):
                        d4e, e4e = s[nt, e], dp[nt, e]
                        col = 8 * nt + 2 * t + (e & 1)
                        p, ds = ZERO, ZERO
                        if not masked or visible(r0 + col, key0 + 8 * (e >> 1), n_q, n_k, delta, lohis, denses, sb, sh,
                                                 b, h, captured):
                            x = scale * d4e
                            if MOD:  # P = exp(mod(S) - LSE), dS = P (dP - D) mod'(S) (proofs/L13)
                                p = warp.ex2(modded(x, b, h, r0 + col, key0 + 8 * (e >> 1), captured) * LOG2E
                                             - slse[col])
                                ds = p * (e4e - sd[col]) * slope(x, b, h, r0 + col, key0 + 8 * (e >> 1), captured)
                            else:
                                p = warp.ex2(x * LOG2E - slse[col])  # exp(x - LSE): proofs/L7, the ex2 weights
                                ds = p * (e4e - sd[col])
                        s[nt, e] = p
                        dp[nt, e] = ds

                if guard:  # the warp's own rows of sds: P^T for dV, then dS^T for dK (and dQ)
                    store_rows(sds, s, wid, g, t)
                    cuda.syncwarp()
                    exact_reduce_v(dva, sds, sdo, key0, 16 * wid + g, r0, n_q, n_k, delta, t, lohis, denses, sb, sh, b,
                                   h, captured)
                    cuda.syncwarp()
                    store_rows(sds, dp, wid, g, t)
                    cuda.syncwarp()
                    exact_reduce(dka, sds, sq, key0, 16 * wid + g, r0, n_q, n_k, delta, t, lohis, denses, sb, sh, b, h,
                                 captured)
                else:
                    grads(dva, dka, s, dp, sdo, sq, mrow, mat)
                    if ATOMIC_DQ:
                        store_rows(sds, dp, wid, g, t)

                if VISIT_BARRIER:
                    cuda.syncthreads()  # dS^T of every warp's keys is in shared memory (atomic dQ)
                if ATOMIC_DQ:
                    for u in range(PER_WARP):  # dQ_i's 16-row slice mi, its column blocks `part`
                        unit = wid + u * W
                        mi = unit // SPLIT
                        part = unit - mi * SPLIT
                        row0 = r0 + 16 * mi + g
                        if guard:
                            exact_dq(sds, sk, dq, b, h, row0, 16 * mi + g, c0, part, scale, n_q, n_k, delta, t, lohis,
                                     denses, sb, sh, captured)
                        else:
                            dq_unit(af, sds, sk, dq, b, h, row0, mi, part, scale, n_q, g, t, mrow, mat)

        write_rows(dk, b, hk, key0, n_k, dka, scale, t)
        write_rows_v(dv, b, hk, key0, n_k, dva, float32(1), t)

    return bwd_kv_mma


__all__ = ["dq_adder", "dq_split", "kv_products16", "kv_source", "row_fragments", "store_pair"]
