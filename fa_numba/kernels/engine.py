"""The tile engine: the device functions both register-tiled kernels (v1 and v2) are built from.

Thread layout. A block has T = RY x CX threads, RY = B_r / TM and CX = B_c / TN; thread t (threadIdx.y CX +
threadIdx.x) is (ty, tx) = `Layout.owner(t)`: t = ty CX + tx, or, at the shipped layouts, two row groups
interleaved lane by lane so that every fragment load is a paired one (see owner). Thread (ty, tx) owns
    the TM x TN micro-tile of S:  rows ty TM + a (a < TM), key columns tx TN + b (b < TN);
    the TM x TD micro-tile of O:  the same rows, head-dim columns Layout.column(tx, e) (e < TD), TD = D / CX,
in registers (`cuda.local.array` indexed only by compile-time constants in fully unrolled loops, which
the compiler keeps in registers: `python -m fa_numba profile` shows no local memory in the hot loop).
D is the head dim d rounded up to a multiple of CX; columns d..D-1 are zeros in shared memory.

Shared memory: one flat float32 array, regions at compile-time offsets (`Layout`):
    Q^T  D x B_r   Q_i transposed: the TM rows of a thread are adjacent (one vector load per step of d)
    K^T  D x B_c   K_j transposed: likewise its TN columns
    V    B_c x D   V_j as in HBM; a thread's TD columns are chunks of VW adjacent ones, the CX threads'
                   chunks side by side (`Layout.column`), so a warp's fragment loads are consecutive vectors
    P^T  B_c x PS  the weights of the tile, transposed for the P V product; rows PS >= B_r floats apart,
                   padded where that removes bank conflicts of the stores (`Layout.p_stride`)
    red  B_r x CX  one partial per (row, thread of the row group): row maxima, then row sums
    stat 2 B_r     (v1 only) m_i and l_i read from HBM once per visit and shared by the row group
When Q^T + K^T + V + P^T + red (+ stat) exceeds the static 48 KB, P^T, red and stat move (as many as fit)
into the operand the order no longer needs once S is computed (K^T in v2, Q^T in v1): `Layout.aliased`,
and each tile pays one more barrier, so that no thread overwrites K^T (Q^T) while another still reads it.

Tiles are loaded by `kernels.tile_loads` (V read at compile-time offsets where it is C-contiguous, a chunk of
each thread's loads in flight before any is stored).

The online softmax over a thread's rows is the twin of online_softmax.update (proofs/L2): the row max of
the tile goes through `red` (each thread writes its partial, every thread of the row group reads all CX),
p = exp(s - shift) with shift = 0 while the row has seen nothing, and each thread keeps its own partial
row sum l, which only `row_sum` adds up (v2: once at the end; v1: at the end of each visit). Masking
happens only in PARTIAL tiles and in the ragged last key tile; in a PARTIAL tile the P V product skips
the masked pairs (a predicated FFMA), so a NaN in a masked value row never reaches a row that cannot see
it (proofs/L3.5).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

from numba import cuda, float32, uint64 as u64

from fa_numba.kernels.common import NEG_INF, ZERO
from fa_numba.kernels.layout import Layout
from fa_numba.kernels.mask_mod import pair_visible
from fa_numba.kernels.tile_loads import make_loaders

GUARD_NONE, GUARD_CAUSAL, GUARD_MARKED = 0, 1, 2  # how `pv` keeps masked value rows out (see pv)
NEG_ZERO = float32(-0.0)
ONE = float32(1.0)
UNROLL_BUDGET = 120  # operations per unrolled loop body (see make_engine)
# P V's body is a rank-1 update per key (TM TD FFMAs from TM + TD loads) and unrolls whole at more: at
# d = 128's 4 x 2 layout (TD 16) two keys a body (168 operations) cost 11 loop instructions per 128 FFMAs
# instead of per 64, 3199 -> 3134 a tile iteration (2026-12-05, sm_90a); 176 (four keys at d = 64) was not
# unrolled (the loop recomputed its addresses: 882 integer instructions an iteration instead of 503), nor was
# S's body at 192 (STEP 8 at d = 64).
PV_UNROLL_BUDGET = 170


@functools.lru_cache(maxsize=None)
def make_engine(layout: Layout, kmod=None) -> SimpleNamespace:
    """The engine's device functions, specialised (compile-time constants) for one layout, and for the pair
    test of a PARTIAL tile of a block mask: kmod's mask_mod, or the dense byte mask (kernels.mask_mod).

    Indices into shared and global memory are formed as non-negative int64 expressions and passed as
    uint64 (`u64`): Numba then emits no negative-index wraparound, and a compile-time constant inside the
    index becomes an immediate offset of the load. Thread-dependent parts go into array views once.
    """
    pair = pair_visible(kmod)
    BR, BC, D, TM, TN, TD, CX = (layout.block_q, layout.block_k, layout.d_pad, layout.tm, layout.tn, layout.td,
                                 layout.cx)
    PS, VW = layout.p_stride, layout.vw  # P^T's row stride; O columns a thread owns side by side
    OFF = layout.offsets
    Q, K, V, P, RED = OFF["q"], OFF["k"], OFF["v"], OFF["p"], OFF["red"]
    # Steps unrolled per loop iteration, written as an inner loop the compiler unrolls: as many as keep the
    # body (FFMAs plus fragment loads per step) within UNROLL_BUDGET operations (P V's: PV_UNROLL_BUDGET). A
    # larger body is not unrolled (and the loop then recomputes every address); a smaller one pays the loop's
    # own branch and counter more often. `python -m fa_numba profile` shows the result.
    # One step always: a layout whose single step is over the budget (wide micro-tiles at a large d, e.g. 16x16
    # tiles at d = 128) runs that step without unrolling more.
    STEP = next((t for t in (16, 8, 4, 2) if D % t == 0 and t * (TM * TN + TM + TN) <= UNROLL_BUDGET), 1)
    KSTEP = next((t for t in (8, 4, 2) if BC % t == 0 and t * (TM * TD + TM + TD) <= PV_UNROLL_BUDGET), 1)


    load_q, load_kv = make_loaders(layout)  # Q_i^T; K_j^T and V_j (kernels.tile_loads)

    PAIRS = layout.pairs_rows

    @cuda.jit(device=True, inline=True)
    def owner(tid):
        """(ty, tx) of thread tid: Layout.owner."""
        if PAIRS:
            group = tid // (2 * CX)
            within = tid - group * (2 * CX)
            return 2 * group + within % 2, within // 2
        ty = tid // CX
        return ty, tid - ty * CX

    @cuda.jit(device=True, inline=True)
    def column(tx, e):
        """The head-dim column of thread tx's e-th O column: Layout.column."""
        return (e // VW) * CX * VW + tx * VW + e % VW

    @cuda.jit(device=True, inline=True)
    def scores(smem, s, ty, tx, scale):
        """s = scale Q_i K_j^T on the thread's TM x TN micro-tile; Q and K fragments from shared memory.

        The thread's offsets go into views (pointers) once; inside the loop every index is a compile-time
        offset from x, which the compiler turns into immediate offsets of (vector) shared-memory loads."""
        qf = cuda.local.array(TM, float32)
        kf = cuda.local.array(TN, float32)
        for a in range(TM):
            for c in range(TN):
                s[a, c] = ZERO
        qv = smem[u64(Q + ty * TM):]
        kv = smem[u64(K + tx * TN):]
        x0 = 0
        while x0 < D:  # invariant: s holds the dot products over features 0..x0 - 1 (L1)
            for xi in range(STEP):
                x = x0 + xi
                for a in range(TM):
                    qf[a] = qv[u64(x * BR + a)]
                for c in range(TN):
                    kf[c] = kv[u64(x * BC + c)]
                for a in range(TM):
                    for c in range(TN):
                        s[a, c] += qf[a] * kf[c]
            x0 += STEP
        for a in range(TM):
            for c in range(TN):
                s[a, c] *= scale

    @cuda.jit(device=True, inline=True)
    def mask(s, row, col, n_k, causal, delta):
        """-inf where key col + c is past N_k or, with causal masking, in the future of query row + a."""
        for a in range(TM):
            for c in range(TN):
                key = col + c
                if key >= n_k or (causal and key > row + a + delta):
                    s[a, c] = NEG_INF

    @cuda.jit(device=True, inline=True)
    def mask_rows(s, dead, row, col, n_q, n_k, lohi, dense, use_dense, b, h, captured):
        """The block-mask path (any mask but causal): -inf, and dead, where key col + c is past N_k or not
        visible to query row + a: outside the row's interval [lohi[r, 0], lohi[r, 1]) or, for a dense mask or
        a mask_mod, not visible by it (`pair`: one byte read, or fn called, per pair, in PARTIAL tiles only)."""
        for a in range(TM):
            r = row + a
            lo = n_k
            hi = 0
            if r < n_q:
                lo = lohi[r, 0]
                hi = lohi[r, 1]
            for c in range(TN):
                key = col + c
                visible = key < n_k and lo <= key and key < hi
                if use_dense and visible:
                    visible = pair(dense, b, h, r, key, captured)
                dead[a, c] = not visible
                if not visible:
                    s[a, c] = NEG_INF

    @cuda.jit(device=True, inline=True)
    def masked_scores(smem, s, dead, ty, tx, scale, row, c0, cols, n_q, n_k, delta, partial, causal, lists, lohi,
                      dense, use_dense, b, h, captured):
        """S of the thread's micro-tile (`scores`), then the mask only where a tile needs one: a PARTIAL tile
        of the block-mask path (`mask_rows`), a causal PARTIAL tile or the ragged last key tile (`mask`)."""
        scores(smem, s, ty, tx, scale)
        if lists and partial:
            mask_rows(s, dead, row, c0 + tx * TN, n_q, n_k, lohi, dense, use_dense, b, h, captured)
        elif partial or cols < BC:
            mask(s, row, c0 + tx * TN, n_k, causal, delta)

    @cuda.jit(device=True, inline=True)
    def write_partials(smem, off, values, ty, tx):
        """red[row, tx] = values[a] for the thread's rows (one partial per thread of the row group)."""
        dst = smem[u64(off + ty * TM * CX + tx):]
        for a in range(TM):
            dst[u64(a * CX)] = values[a]

    @cuda.jit(device=True, inline=True)
    def row_max_partials(smem, s, ty, tx):
        """The thread's max over its TN columns of each of its rows, into red."""
        part = cuda.local.array(TM, float32)
        for a in range(TM):
            mx = NEG_INF
            for c in range(TN):
                mx = max(mx, s[a, c])
            part[a] = mx
        write_partials(smem, RED, part, ty, tx)

    @cuda.jit(device=True, inline=True)
    def softmax(smem, s, m, l, alpha, ty):
        """Fold the tile's scores into (m, l) per row: online_softmax.update, after `row_max_partials`.

        s becomes the weights p = exp(s - shift); l (the thread's partial row sum) becomes
        alpha l + sum of its p; alpha = exp(m_old - shift) is left for the P V step. Every finite exp
        argument is <= 0, and shift = 0 while the row has seen nothing (L2.4)."""
        red = smem[u64(RED + ty * TM * CX):]
        for a in range(TM):
            m_tile = NEG_INF
            for t in range(CX):
                m_tile = max(m_tile, red[u64(a * CX + t)])
            m_new = max(m[a], m_tile)
            shift = m_new if m_new != NEG_INF else ZERO
            alpha[a] = math.exp(m[a] - shift)
            total = ZERO
            for c in range(TN):
                p = math.exp(s[a, c] - shift)
                s[a, c] = p
                total += p
            l[a] = alpha[a] * l[a] + total
            m[a] = m_new

    @cuda.jit(device=True, inline=True)
    def store_p(smem, s, dead, marked, ty, tx):
        """P^T[tx TN + c, ty TM + a] = p[a, c]: the weights of the tile, for every thread's P V product.

        marked (a PARTIAL tile of the block-mask path): a masked pair is stored as -0.0, which exp never
        returns, so that the P V product can tell it from a weight that underflowed to +0.0."""
        dst = smem[u64(P + tx * TN * PS + ty * TM):]
        for c in range(TN):
            for a in range(TM):
                value = s[a, c]
                if marked and dead[a, c]:
                    value = NEG_ZERO
                dst[u64(c * PS + a)] = value

    @cuda.jit(device=True, inline=True)
    def pv(smem, acc, alpha, ty, tx, guard, limit):
        """acc = alpha acc + P V on the thread's TM x TD micro-tile of O.

        In a PARTIAL tile a masked value row, NaN or not, must never be multiplied into a row that cannot
        see it. guard GUARD_CAUSAL: key k enters row a only if k <= limit[a] (float32: exact for these small
        integers, and one FSETP against a constant); GUARD_MARKED: only if its weight is not the -0.0 that
        `store_p` marks masked pairs with; GUARD_NONE: every key (FULL tiles)."""
        pf = cuda.local.array(TM, float32)
        vf = cuda.local.array(TD, float32)
        for a in range(TM):
            for e in range(TD):
                acc[a, e] *= alpha[a]
        pw = smem[u64(P + ty * TM):]
        vw = smem[u64(V + tx * VW):]  # the thread's O columns: layout.column(tx, e)
        if guard == GUARD_MARKED:
            k0 = 0
            while k0 < BC:  # invariant: acc = alpha acc_old + sum over the visible keys < k0 of p v (L3.5)
                for ki in range(KSTEP):
                    k = k0 + ki
                    for a in range(TM):
                        pf[a] = pw[u64(k * PS + a)]
                    for e in range(TD):
                        vf[e] = vw[u64(k * D + column(0, e))]  # tx's offset is in vw
                    for a in range(TM):
                        if math.copysign(ONE, pf[a]) > ZERO:  # not the -0.0 of a masked pair
                            for e in range(TD):
                                acc[a, e] += pf[a] * vf[e]
                k0 += KSTEP
        elif guard == GUARD_CAUSAL:
            rel = cuda.local.array(TM, float32)
            k0 = 0
            while k0 < BC:  # invariant: acc = alpha acc_old + sum over the visible keys < k0 of p v (L2, L3.5)
                for a in range(TM):
                    rel[a] = limit[a] - float32(k0)  # key k0 + ki is visible to row a iff ki <= rel[a]
                for ki in range(KSTEP):
                    k = k0 + ki
                    for a in range(TM):
                        pf[a] = pw[u64(k * PS + a)]
                    for e in range(TD):
                        vf[e] = vw[u64(k * D + column(0, e))]  # tx's offset is in vw
                    for a in range(TM):
                        if float32(ki) <= rel[a]:  # a predicated FFMA: the product is never formed for a masked key
                            for e in range(TD):
                                acc[a, e] += pf[a] * vf[e]
                k0 += KSTEP
        else:
            k0 = 0
            while k0 < BC:  # invariant: acc = alpha acc_old + sum over keys < k0 of p v (L2)
                for ki in range(KSTEP):
                    k = k0 + ki
                    for a in range(TM):
                        pf[a] = pw[u64(k * PS + a)]
                    for e in range(TD):
                        vf[e] = vw[u64(k * D + column(0, e))]  # tx's offset is in vw
                    for a in range(TM):
                        for e in range(TD):
                            acc[a, e] += pf[a] * vf[e]
                k0 += KSTEP

    @cuda.jit(device=True, inline=True)
    def row_sum(smem, off, total, ty):
        """total[a] = the sum over the row group of the partials at smem[off], in the fixed order t = 0..CX-1.

        The caller brackets it: `write_partials(smem, off, part, ...)`, a barrier, then this."""
        src = smem[u64(off + ty * TM * CX):]
        for a in range(TM):
            acc = ZERO
            for t in range(CX):
                acc += src[u64(a * CX + t)]
            total[a] = acc

    return SimpleNamespace(owner=owner, column=column, load_q=load_q, load_kv=load_kv, masked_scores=masked_scores,
                           row_max_partials=row_max_partials, softmax=softmax, store_p=store_p, pv=pv,
                           write_partials=write_partials, row_sum=row_sum)
