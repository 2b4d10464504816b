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

Tiles are loaded cooperatively: Q^T and K^T with the tile's row index fastest across threads (stores to
consecutive banks, conflict-free; the strided global reads hit the same cache lines, so HBM traffic is
unchanged), V with d fastest (coalesced). Each element is read from HBM once per load, rows past N and
columns past d are never read (zeros instead), and float16 / bfloat16 become float32 once, on load. A
thread issues all its loads of a tile (IN_FLIGHT at most) into registers before it stores any, so a tile
costs one round trip to memory, not one per element; v2 loads K_j and V_j in the same round trip.

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

from fa_numba import warp
from fa_numba.kernels.common import NEG_INF, ZERO, rows_from, to_f32
from fa_numba.kernels.layout import Layout, in_flight
from fa_numba.kernels.mask_mod import pair_visible

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


def _per_thread(total: int, threads: int) -> int:
    """Steps for `threads` threads to cover `total` elements, one element per thread per step."""
    return -(-total // threads)


@functools.lru_cache(maxsize=None)
def make_engine(layout: Layout, kmod=None) -> SimpleNamespace:
    """The engine's device functions, specialised (compile-time constants) for one layout, and for the pair
    test of a PARTIAL tile of a block mask: kmod's mask_mod, or the dense byte mask (kernels.mask_mod).

    Indices into shared and global memory are formed as non-negative int64 expressions and passed as
    uint64 (`u64`): Numba then emits no negative-index wraparound, and a compile-time constant inside the
    index becomes an immediate offset of the load. Thread-dependent parts go into array views once.
    """
    pair = pair_visible(kmod)
    BR, BC, D, TM, TN, TD, CX, T = (layout.block_q, layout.block_k, layout.d_pad, layout.tm, layout.tn, layout.td,
                                    layout.cx, layout.threads)
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

    HD = layout.head_dim  # the kernel's d: a launch with another is refused (Kernel.__call__)
    HDV = layout.d_v  # V's head dim d_v (d unless the layout names its own)

    def tile_loader(W, transposed, HD):
        """(fetch, put, STEPS, CHUNK) for a W-row tile of src (rows past `rows` and features past HD, the operand's
        own head dim, read as zeros):
        the thread moves STEPS elements, in chunks of CHUNK <= in_flight(layout); fetch reads one chunk from HBM into
        registers, every load issued before any is used (one round trip to memory per chunk, not one per
        element), and put stores it into smem at off: transposed (Q_i^T, K_j^T) element (r, x) goes to
        off + x W + r, else (V_j) to off + r D + x.

        Consecutive threads take consecutive smem addresses (conflict-free stores); when T is a multiple of
        the inner extent each thread keeps one inner index and walks the outer one by T / inner, so no
        division is left in the loop. One HBM read per element."""
        INNER, OUTER = (W, D) if transposed else (D, W)
        STEPS = _per_thread(INNER * OUTER, T)
        CHUNK = min(STEPS, in_flight(layout))
        KEEP = T % INNER == 0
        # compile-time: whether a step can fall past the tile (T does not divide it), and whether the tile
        # has padding columns (D > d); where not, those checks are compiled out (64-bit compares, two ISETPs
        # each, per element)
        RAGGED = (INNER * OUTER) % T != 0
        PADDED = D != HD

        @cuda.jit(device=True, inline=True)
        def place(tid, step):
            """(idx, inner, outer) of the thread's step-th element."""
            idx = tid + step * T
            if KEEP:
                inner = tid % INNER
                outer = tid // INNER + step * (T // INNER)
            else:
                outer = idx // INNER
                inner = idx - outer * INNER
            return idx, inner, outer

        @cuda.jit(device=True, inline=True)
        def fetch(src, b, h, row0, rows, values, tid, first):
            """values[i] = the thread's element of step first + i (i < CHUNK; zero past the tile).

            Where each thread keeps its inner index (KEEP), its elements lie on one line of src: a row of Q or K
            for the transposed tiles, a column of V otherwise. That line is taken as a view once (at a clamped
            index, so that the view itself is always in bounds), and each load is then one step along it
            instead of the whole 4-d index with its runtime strides. A column of a C-contiguous V is read
            through a line from the thread's first row instead (kernels.common.rows_from), whose steps are
            compile-time multiples of d."""
            if KEEP:
                inner = tid % INNER
                if transposed:  # the thread's row r = inner; its features x = outer vary
                    keep = inner < rows
                    line = src[b, h, u64(row0 + min(inner, rows - 1))]
                    flat = False
                else:  # the thread's feature x = inner; its rows r = outer vary
                    keep = not PADDED or inner < HD
                    x = min(inner, HD - 1)
                    # a C-contiguous operand: the thread's first row as a line that reaches the rows below it,
                    # so each load is a compile-time offset (the column view below costs a 64-bit multiply by
                    # the run-time stride, and its predicate, per load: 10 to 12 instructions each, v2 d = 64)
                    flat = not warp.strided(src)  # a compile-time constant on the GPU
                    left = rows - tid // INNER  # the tile's rows from the thread's first on
                    # two names, not one: views of two layouts assigned to one variable unify to the strided one
                    run = rows_from(src, b, h, u64(row0 + min(tid // INNER, rows - 1)), u64(x))
                    line = src[b, h, :, u64(x)]
                for i in range(CHUNK):
                    outer = tid // INNER + (first + i) * (T // INNER)
                    value = ZERO
                    if first + i < STEPS and (not RAGGED or outer < OUTER) and keep:
                        if transposed:
                            if not PADDED or outer < HD:
                                value = to_f32(line[u64(outer)])
                        elif (first + i) * (T // INNER) < left:  # outer < rows
                            if flat:
                                value = to_f32(run[u64((first + i) * (T // INNER) * HD)])
                            else:
                                value = to_f32(line[u64(row0 + outer)])
                    values[i] = value
                return
            # V unpadded (D = d): the tile is rows x d elements laid end to end where V is C-contiguous, and the
            # thread's step-th element is element idx of that run, a compile-time offset from tid (d = 256's
            # 2 x 1 layout: 557 integer instructions and 16 waits for its 16 V loads a chunk before)
            FLAT = not transposed and not PADDED
            flat = FLAT and not warp.strided(src)  # a compile-time constant on the GPU
            run = rows_from(src, b, h, u64(row0), u64(0))
            left = rows * HD - tid  # the tile's elements from the thread's first on
            for i in range(CHUNK):
                idx, inner, outer = place(tid, first + i)
                r = inner if transposed else outer
                x = outer if transposed else inner
                value = ZERO
                if first + i < STEPS and (not RAGGED or outer < OUTER):
                    if flat:
                        if (first + i) * T < left:  # r < rows
                            value = to_f32(run[u64(tid + (first + i) * T)])
                    elif r < rows and (not PADDED or x < HD):
                        value = to_f32(src[b, h, u64(row0 + r), u64(x)])
                values[i] = value

        @cuda.jit(device=True, inline=True)
        def put(values, smem, off, tid, first):
            for i in range(CHUNK):
                idx, inner, outer = place(tid, first + i)
                if first + i < STEPS and (not RAGGED or outer < OUTER):
                    smem[u64(off + idx)] = values[i]

        return fetch, put, STEPS, CHUNK

    def chunked(fetch, put, steps, chunk):
        """load(src, b, h, row0, rows, smem, off, tid): the tile chunk by chunk, a chunk's loads in flight, then
        its stores. The chunks are written out (generated source: a few lines of fetch and put calls, each first
        a compile-time constant): a loop over them stayed rolled where a chunk's body is large (16-bit inputs at
        d = 256), and its run-time first left every bound check and conversion in the loop: 14 load waits for
        V's 16 loads a chunk, 53 branches, v2 d = 256 float16."""
        calls = "".join(f"    fetch(src, b, h, row0, rows, values, tid, {first})\n"
                        f"    put(values, smem, off, tid, {first})\n" for first in range(0, steps, chunk))
        namespace = {"fetch": fetch, "put": put, "cuda": cuda, "float32": float32, "CHUNK": chunk}
        exec("def load(src, b, h, row0, rows, smem, off, tid):\n"  # our own text: the chunks' calls
             f"    values = cuda.local.array(CHUNK, float32)\n{calls}", namespace)
        return cuda.jit(device=True, inline=True)(namespace["load"])

    fetch_q, put_q, Q_STEPS, Q_CHUNK = tile_loader(BR, True, HD)  # Q_i^T
    fetch_k, put_k, K_STEPS, K_CHUNK = tile_loader(BC, True, HD)  # K_j^T
    fetch_v, put_v, V_STEPS, V_CHUNK = tile_loader(BC, False, HDV)  # V_j
    KV_TOGETHER = K_STEPS + V_STEPS <= in_flight(layout)  # both tiles' loads in flight at once
    load_q = chunked(fetch_q, put_q, Q_STEPS, Q_CHUNK)  # Q_i^T into smem at off
    load_k, load_v = chunked(fetch_k, put_k, K_STEPS, K_CHUNK), chunked(fetch_v, put_v, V_STEPS, V_CHUNK)

    @cuda.jit(device=True, inline=True)
    def load_kv(k, v, b, h, row0, rows, smem, k_off, v_off, tid):
        """K_j^T and V_j into smem: every load of both tiles in flight together where IN_FLIGHT allows, else
        each tile chunk by chunk."""
        k_values = cuda.local.array(K_CHUNK, float32)
        v_values = cuda.local.array(V_CHUNK, float32)
        if KV_TOGETHER:
            fetch_k(k, b, h, row0, rows, k_values, tid, 0)
            fetch_v(v, b, h, row0, rows, v_values, tid, 0)
            put_k(k_values, smem, k_off, tid, 0)
            put_v(v_values, smem, v_off, tid, 0)
        else:
            load_k(k, b, h, row0, rows, smem, k_off, tid)
            load_v(v, b, h, row0, rows, smem, v_off, tid)

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
