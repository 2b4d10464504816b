"""The tensor-core backward's products for float32 inputs by 3xTF32 (kernels.mma.tf32's split, proofs/L6 part 9
and L7's 3xTF32 part): the pieces `backward_kv.kv_source` and `backward_dq.dq_source` take in place of
`kv_products16`'s and `dq_products16`'s, so both kernels (their visits, masks, score mods, non-finite rules, GQA,
atomic or deterministic dQ) are the 16-bit kernels' own.

Every product is m16n8k8 on tf32 parts: each float32 operand x is split at its use into hi = tf32(x) and
lo = tf32(x - hi), and a b is taken as lo_a hi_b + hi_a lo_b + hi_a hi_b (three mma.sync, the small terms
first). The tiles are staged raw, float32 as they are (cp.async or plain loads): the split is made in registers
where a fragment is read. The forward splits K_j and V_j once when staged, holding both parts in shared memory;
here four tiles are staged per visit (K_j, V_j, Q_i, dO_i) and two parts of each would not fit 48 KB at useful
tiles, so each warp splits what it reads (more instructions, half the shared memory).

Fragments (proofs/L10, the m16n8k8 tables; g = lane >> 2, t = lane & 3; rows SQ = DP + 4 words apart, DP = d
rounded up to 8; every read below lands on 32 distinct banks):
    S^T  = K_j Q_i^T    A: K_j[16 w + g (+ 8)][8 ks + t (+ 4)], B: Q_i[8 nt + g][8 ks + t (+ 4)]
    dP^T = V_j dO_i^T   the same on V_j and dO_i
    dV  += P^T dO_i     A: P^T from its own accumulator: the k-step is 8 queries and any order of them gives the
                         same sum, so k-index t stands for query 2t and t + 4 for 2t + 1, and the S^T accumulator
                         of block nt (P^T[g][2t], P^T[g][2t + 1], P^T[g + 8][2t], P^T[g + 8][2t + 1]) is the A
                         fragment with no data moved (as the forward's P V, L10 claim 7);
                         B: dO_i[8 nt + 2t (+ 1)][8 dn + g], the same order
    dK  += dS^T Q_i     the same on dS^T and Q_i
    dQ_i += scale dS K_j  dS^T goes through shared memory as float32 ([key][query], rows B_r + 4 apart); the
                         k-step is 8 keys, reordered alike: A: dS[16 mi + g (+ 8)][8 kk + 2t (+ 1)] read from it,
                         B: K_j[8 kk + 2t (+ 1)][8 dn + g]; atomic adds as the 16-bit kernel's.
P is a softmax weight in [0, 1] (its split needs no clamp); the other operands are clamped to +-TF32_MAX before
their high parts are taken (tf32.split), so a finite value cannot become an infinite high part.

The deterministic mode's dq pass (`dq_products`): S = Q_i K_j^T and dP = dO_i V_j^T with A = Q_i's (dO_i's) rows
16 w + g (+ 8) and B = K_j's (V_j's) rows 8 nt + g, as the forward's S; dQ += dS K_j with dS's own accumulators
as A in claim 7's key order, B = K_j[8 nt + 2t (+ 1)][8 dn + g]; Q_i's and dO_i's fragments are split at every
k-step, not held (both would take 128 registers at d = 64). Its 8-key blocks are written out, a warp barrier
between them (`written_out`: backward_dq.dq_source), so dS stays in registers.

Not built: a value head dim of its own (the API pads V to d, fa_numba.value_dims), plain TF32 ("mma-tf32") for
the backward.
"""

from __future__ import annotations

from types import SimpleNamespace

from numba import cuda, float32, uint32

from fa_numba import warp
from fa_numba.kernels.common import ZERO
from fa_numba.kernels.mma.backward_kv import dq_adder, dq_split
from fa_numba.kernels.mma.staging import stagers
from fa_numba.kernels.mma.tf32 import FLOAT32_MAX, fourfold, split, split_weight, unrolled

CH, ITEM_SHIFT = 4, 2  # cp.async moves 16 bytes: four float32 (an element's bytes 2^2)


def _pieces(config) -> SimpleNamespace:
    """What both kernels' float32 pieces share: raw staging of two tiles (one commit and one wait on the cp.async
    path), the non-finite test of a staged value, and a product of split operands with the splits it takes."""
    D, DP, SQ = config.head_dim, config.padded_dim, config.row_stride
    THREADS, ASYNC = 32 * config.warps, config.async_copy
    mma = warp.mma_tf32

    @cuda.jit(device=True, inline=True)
    def store(tile, index, x):
        tile[index] = x

    @cuda.jit(device=True, inline=True)
    def nonfinite(x):
        return not abs(x) <= FLOAT32_MAX  # inf or NaN

    stage, stage_async, any_bad = stagers(D, DP, SQ, THREADS, CH, ITEM_SHIFT, ZERO, store, nonfinite, nonfinite)

    @cuda.jit(device=True, inline=True)
    def stage_two(x, y, b, h, r0, n, tile_x, tile_y, rows):
        """Stage two tiles of the same rows (K_j and V_j, or Q_i and dO_i), raw; on the cp.async path one commit
        and one wait for both. The caller's barrier makes them visible."""
        if ASYNC:
            stage_async(x, b, h, r0, n, tile_x, rows)
            stage_async(y, b, h, r0, n, tile_y, rows)
            warp.cp_async_commit()
            warp.cp_async_wait_all()
        else:
            stage(x, b, h, r0, n, tile_x, rows)
            stage(y, b, h, r0, n, tile_y, rows)

    @cuda.jit(device=True, inline=True)
    def product(c, ahi, alo, bhi, blo):
        """c + a b on one m16n8k8 block from split operands: three tf32 products, the small ones first."""
        c = mma(c, alo, bhi)
        c = mma(c, ahi, blo)
        return mma(c, ahi, bhi)

    @cuda.jit(device=True, inline=True)
    def split2(x0, x1):
        h0, l0 = split(x0)
        h1, l1 = split(x1)
        return (h0, h1), (l0, l1)

    @cuda.jit(device=True, inline=True)
    def identity(x):
        return x

    return SimpleNamespace(stage_two=stage_two, any_bad=any_bad, product=product, split2=split2,
                           split4=fourfold(split), split4_weights=fourfold(split_weight), identity=identity)


def kv_products(config) -> SimpleNamespace:
    """The float32 (3xTF32) pieces of the K/V-outer kernel, for `backward_kv.kv_source` (which documents each
    piece's role on `kv_products16`)."""
    BR, BC, D, DP, SQ, SDS = (config.block_q, config.block_k, config.head_dim, config.padded_dim, config.row_stride,
                              config.ds_stride)
    KS, NQ, DN, KK = DP // 8, BR // 8, DP // 8, BC // 8  # k-steps of 8 (d, then keys), 8-query and 8-column blocks
    DNS = dq_split(config)[1]
    add_dq = dq_adder(D)
    X = _pieces(config)
    product, split2, split4, split4_weights = X.product, X.split2, X.split4, X.split4_weights

    @cuda.jit(device=True, inline=True)
    def hold(sk, kf, sv, vf, wid, mrow, mat):
        """Nothing is held: each k-step splits its fragments where it reads them."""
        return None

    # The loops below are written out with compile-time indices (tf32.unrolled): rolled, they leave the
    # fragment arrays indexed at run time, in local memory (`profile` saw 128 bytes of stack at d = 64)
    @cuda.jit(device=True, inline=True)
    def score_step(ks, s, dp, tiles, bases, unused):
        """k-step ks of S^T = K_j Q_i^T and dP^T = V_j dO_i^T for every 8-query block: K_j's and V_j's A fragments
        split once for all of them. bases: this lane's K_j (V_j) and Q_i (dO_i) words at k-step 0."""
        sk, sv, sq, sdo = tiles
        a = bases[0] + 8 * ks  # a0 = X[g][t], a1 = X[g + 8][t], a2 = X[g][t + 4], a3 = X[g + 8][t + 4]
        khi, klo = split4(sk[a], sk[a + 8 * SQ], sk[a + 4], sk[a + 8 * SQ + 4])
        vhi, vlo = split4(sv[a], sv[a + 8 * SQ], sv[a + 4], sv[a + 8 * SQ + 4])
        for nt in range(NQ):
            bidx = bases[1] + 8 * nt * SQ + 8 * ks  # b0 = Y[g][t], b1 = Y[g][t + 4] of the 8-query block
            qhi, qlo = split2(sq[bidx], sq[bidx + 4])
            ohi, olo = split2(sdo[bidx], sdo[bidx + 4])
            d4 = product((s[nt, 0], s[nt, 1], s[nt, 2], s[nt, 3]), khi, klo, qhi, qlo)
            e4 = product((dp[nt, 0], dp[nt, 1], dp[nt, 2], dp[nt, 3]), vhi, vlo, ohi, olo)
            for e in range(4):
                s[nt, e] = d4[e]
                dp[nt, e] = e4[e]

    score_steps = unrolled(KS, score_step)

    @cuda.jit(device=True, inline=True)
    def scores(s, dp, kf, vf, sk, sv, sq, sdo, wid, mrow, mat):
        """S^T = K_j Q_i^T into s and dP^T = V_j dO_i^T into dp, k-steps outer."""
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        for nt in range(NQ):
            for e in range(4):
                s[nt, e] = ZERO
                dp[nt, e] = ZERO
        score_steps(s, dp, (sk, sv, sq, sdo), ((16 * wid + g) * SQ + t, g * SQ + t), 0)

    @cuda.jit(device=True, inline=True)
    def grad_step(dn, dva, dka, parts, tiles, base):
        """Column block dn of dV += P^T dO_i and dK += dS^T Q_i for one 8-query block: parts its split A
        fragments (P^T's, dS^T's), base this lane's word of dO_i (Q_i) at row 2t of the block."""
        sdo, sq = tiles
        phi, plo, shi, slo = parts
        bidx = base + 8 * dn
        ohi, olo = split2(sdo[bidx], sdo[bidx + SQ])
        qhi, qlo = split2(sq[bidx], sq[bidx + SQ])
        v4 = product((dva[dn, 0], dva[dn, 1], dva[dn, 2], dva[dn, 3]), phi, plo, ohi, olo)
        k4 = product((dka[dn, 0], dka[dn, 1], dka[dn, 2], dka[dn, 3]), shi, slo, qhi, qlo)
        for e in range(4):
            dva[dn, e] = v4[e]
            dka[dn, e] = k4[e]

    grad_steps = unrolled(DN, grad_step)

    @cuda.jit(device=True, inline=True)
    def block_step(nt, dva, dka, s, dp, ctx):
        """8-query block nt of both products: its A fragments split once for every column block."""
        tiles, base = ctx
        phi, plo = split4_weights(s[nt, 0], s[nt, 2], s[nt, 1], s[nt, 3])
        shi, slo = split4(dp[nt, 0], dp[nt, 2], dp[nt, 1], dp[nt, 3])
        grad_steps(dva, dka, (phi, plo, shi, slo), tiles, base + 8 * nt * SQ)

    block_steps = unrolled(NQ, block_step)

    @cuda.jit(device=True, inline=True)
    def grads(dva, dka, s, dp, sdo, sq, mrow, mat):
        """dV += P^T dO_i and dK += dS^T Q_i (without the scale): A from the warp's own accumulators in the
        module docstring's query order, B from dO_i and Q_i rows 2t, 2t + 1 of each block."""
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        block_steps(dva, dka, s, dp, ((sdo, sq), 2 * t * SQ + g))

    @cuda.jit(device=True, inline=True)
    def store_rows(sds, x, wid, g, t):
        """This warp's 16 rows of x^T (P^T or dS^T, 16 keys x B_r queries) into sds as float32, at rows
        16 w + g (+ 8), queries 8 nt + 2t (+ 1)."""
        for nt in range(NQ):
            base = (16 * wid + g) * SDS + 8 * nt + 2 * t
            sds[base] = x[nt, 0]
            sds[base + 1] = x[nt, 1]
            sds[base + 8 * SDS] = x[nt, 2]
            sds[base + 8 * SDS + 1] = x[nt, 3]

    @cuda.jit(device=True, inline=True)
    def ds_step(kk, af, sds, a0, unused1, unused2):
        """dS's A fragment of 8-key step kk, split (high parts, then residuals) into af[kk]: a0 this lane's
        word dS^T[2t][g] of the slice at step 0."""
        a = a0 + 8 * kk * SDS  # dS[g][2t] = dS^T[2t][g], then row g + 8, then key 2t + 1
        hi, lo = split4(sds[a], sds[a + 8], sds[a + SDS], sds[a + SDS + 8])
        for e in range(4):
            af[kk, e] = hi[e]
            af[kk, 4 + e] = lo[e]

    ds_steps = unrolled(KK, ds_step)

    @cuda.jit(device=True, inline=True)
    def dq_step(dd, af, sk, dq, at, ctx):
        """Column block part DNS + dd of the slice: dQ += scale dS K_j over the tile's 8-key steps, then the
        atomic adds. at: (b, h, row0, part); ctx: (this lane's K_j word at row 2t, column g; scale, n_q, t)."""
        b, h, row0, part = at
        base, scale, n_q, t = ctx
        dn = part * DNS + dd
        d4 = (ZERO, ZERO, ZERO, ZERO)
        for kk in range(KK):
            bidx = base + 8 * kk * SQ + 8 * dn  # K[2t][g], K[2t + 1][g]
            khi, klo = split2(sk[bidx], sk[bidx + SQ])
            d4 = product(d4, (af[kk, 0], af[kk, 1], af[kk, 2], af[kk, 3]),
                         (af[kk, 4], af[kk, 5], af[kk, 6], af[kk, 7]), khi, klo)
        add_dq(dq, b, h, row0, dn, d4, scale, n_q, t)

    dq_steps = unrolled(DNS, dq_step)

    @cuda.jit(device=True, inline=True)
    def dq_unit(af, sds, sk, dq, b, h, row0, mi, part, scale, n_q, g, t, mrow, mat):
        """dQ_i's 16-row slice mi, its column blocks `part`, += scale dS K_j by atomic adds: dS's A fragments
        (split once per 8-key step, kept in af) and K_j's B fragments from shared memory in the module
        docstring's key order."""
        ds_steps(af, sds, 2 * t * SDS + 16 * mi + g, 0, 0)
        dq_steps(af, sk, dq, (b, h, row0, part), (2 * t * SQ + g, scale, n_q, t))

    return SimpleNamespace(stage_two=X.stage_two, any_bad=X.any_bad, any_bad_v=X.any_bad, to_f32=X.identity,
                           element=float32, fragment=uint32, held=(1, 4), held_v=(1, 4), af=(KK, 8),
                           DV=D, SV=SQ, DNV=DN, hold=hold, scores=scores, grads=grads, store_rows=store_rows,
                           dq_unit=dq_unit)


def dq_products(config) -> SimpleNamespace:
    """The float32 (3xTF32) pieces of the deterministic dQ pass, for `backward_dq.dq_source` (which documents each
    piece's role on `dq_products16`): S = Q_i K_j^T and dP = dO_i V_j^T with Q_i's and dO_i's A fragments split
    per k-step (not held: both would take 128 registers at d = 64), dQ += dS K_j with dS's own accumulators as A
    fragments in the keys' order of L10 claim 7 and B = K_j[8 nt + 2t (+ 1)][8 dn + g]."""
    BC, DP, SQ = config.block_k, config.padded_dim, config.row_stride
    KS, NT, DN = DP // 8, BC // 8, DP // 8
    SDK = BC + 4  # the exact path's dS rows, float32
    X = _pieces(config)
    product, split2, split4 = X.product, X.split2, X.split4

    @cuda.jit(device=True, inline=True)
    def hold(sq, qf, sdo, of, wid, mrow, mat):
        """Nothing is held: each k-step splits the fragments it reads."""
        return None

    @cuda.jit(device=True, inline=True)
    def score_step(ks, c, tiles, bases, unused1, unused2):
        """k-step ks of one 8-key block's S (c[0]) and dP (c[1]). bases: this lane's Q_i (dO_i) word of row
        16 w + g and K_j (V_j) word of key 8 nt + g, at k-step 0."""
        sq, sdo, sk, sv = tiles
        a = bases[0] + 8 * ks  # a0 = X[g][t], a1 = X[g + 8][t], a2 = X[g][t + 4], a3 = X[g + 8][t + 4]
        qhi, qlo = split4(sq[a], sq[a + 8 * SQ], sq[a + 4], sq[a + 8 * SQ + 4])
        ohi, olo = split4(sdo[a], sdo[a + 8 * SQ], sdo[a + 4], sdo[a + 8 * SQ + 4])
        bidx = bases[1] + 8 * ks  # b0 = Y[g][t], b1 = Y[g][t + 4]
        khi, klo = split2(sk[bidx], sk[bidx + 4])
        vhi, vlo = split2(sv[bidx], sv[bidx + 4])
        d4 = product((c[0, 0], c[0, 1], c[0, 2], c[0, 3]), qhi, qlo, khi, klo)
        e4 = product((c[1, 0], c[1, 1], c[1, 2], c[1, 3]), ohi, olo, vhi, vlo)
        for e in range(4):
            c[0, e] = d4[e]
            c[1, e] = e4[e]

    score_steps = unrolled(KS, score_step)

    @cuda.jit(device=True, inline=True)
    def block_scores(nt, qf, of, sq, sdo, sk, sv, wid, mrow, mat):
        """(S, dP) of 8-key block nt for the warp's 16 rows."""
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        c = cuda.local.array((2, 4), float32)
        for e in range(4):
            c[0, e] = ZERO
            c[1, e] = ZERO
        score_steps(c, (sq, sdo, sk, sv), ((16 * wid + g) * SQ + t, (8 * nt + g) * SQ + t), 0, 0)
        return (c[0, 0], c[0, 1], c[0, 2], c[0, 3]), (c[1, 0], c[1, 1], c[1, 2], c[1, 3])

    @cuda.jit(device=True, inline=True)
    def store_ds(sds, dp, wid, g, t):
        """The warp's own 16 rows of dS into sds as float32 (the exact path's)."""
        for nt in range(NT):
            base = (16 * wid + g) * SDK + 8 * nt + 2 * t
            sds[base] = dp[nt, 0]
            sds[base + 1] = dp[nt, 1]
            sds[base + 8 * SDK] = dp[nt, 2]
            sds[base + 8 * SDK + 1] = dp[nt, 3]

    @cuda.jit(device=True, inline=True)
    def column_step(dn, acc, parts, sk, base, unused):
        """Column block dn of acc += dS K_j for one 8-key block: parts dS's split A fragment, base this lane's
        K_j word of key 2t of the block, column g."""
        bidx = base + 8 * dn
        khi, klo = split2(sk[bidx], sk[bidx + SQ])
        d4 = product((acc[dn, 0], acc[dn, 1], acc[dn, 2], acc[dn, 3]), parts[0], parts[1], khi, klo)
        for e in range(4):
            acc[dn, e] = d4[e]

    column_steps = unrolled(DN, column_step)

    @cuda.jit(device=True, inline=True)
    def key_step(nt, acc, dp, sk, base, unused):
        hi, lo = split4(dp[nt, 0], dp[nt, 2], dp[nt, 1], dp[nt, 3])  # keys 2t, 2t + 1: claim 7's order
        column_steps(acc, (hi, lo), sk, base + 8 * nt * SQ, 0)

    key_steps = unrolled(NT, key_step)

    @cuda.jit(device=True, inline=True)
    def dq_product(acc, dp, sk, mrow, mat):
        """acc += dS K_j over the tile's 8-key blocks."""
        lane = cuda.threadIdx.x & 31
        key_steps(acc, dp, sk, 2 * (lane & 3) * SQ + (lane >> 2), 0)

    return SimpleNamespace(stage_two=X.stage_two, any_bad=X.any_bad, any_bad_v=X.any_bad, to_f32=X.identity,
                           element=float32, fragment=uint32, held=(1, 4), held_v=(1, 4), SV=SQ, SDK=SDK,
                           hold=hold, block_scores=block_scores, store_ds=store_ds, dq_product=dq_product,
                           written_out=True)


__all__ = ["dq_products", "kv_products"]
