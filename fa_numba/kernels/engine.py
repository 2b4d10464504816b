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
from dataclasses import dataclass
from types import SimpleNamespace

from numba import cuda, float32, uint64 as u64

from fa_numba.kernels.common import NEG_INF, SHARED_BYTES_LIMIT, ZERO, to_f32

FLOAT_BYTES = 4
MICRO_CHOICES = (4, 2, 1)
GUARD_NONE, GUARD_CAUSAL, GUARD_MARKED = 0, 1, 2  # how `pv` keeps masked value rows out (see pv)
NEG_ZERO = float32(-0.0)
ONE = float32(1.0)
UNROLL_BUDGET = 120  # operations per unrolled loop body (see make_engine)
# Global loads a thread keeps in flight while loading a tile (registers held until they are stored), by order:
# v2's 16 cover a whole K_j and V_j at the shipped d <= 128 tiles (d = 256 would otherwise hold 64 and halve
# its occupancy); v1 runs one block per (batch, head), typically one per SM, so registers cost it no occupancy
# until a block no longer fits, and its Q_i^T at d = 128 (32 loads per thread) goes in one round trip; but
# its 128-thread blocks at d = 256 spill at 32 (255 registers, 108 bytes), so they keep 16.
IN_FLIGHT = {"v1": 32, "v2": 16}
IN_FLIGHT_SMALL_BLOCKS = 16  # blocks of fewer than 256 threads, either order


def in_flight(layout: "Layout") -> int:
    """Global loads a thread of this layout keeps in flight while it loads a tile (IN_FLIGHT)."""
    return IN_FLIGHT[layout.order] if layout.threads >= 256 else IN_FLIGHT_SMALL_BLOCKS


@dataclass(frozen=True)
class Layout:
    """Compile-time shape of one engine kernel: tiles, micro-tiles, threads and shared-memory regions."""

    order: str
    block_q: int  # B_r
    block_k: int  # B_c
    head_dim: int  # d
    tm: int  # rows of S (and O) per thread
    tn: int  # key columns of S per thread
    budget: int = SHARED_BYTES_LIMIT  # bytes of static shared memory (tests lower it to exercise aliasing)

    @property
    def ry(self) -> int:
        return self.block_q // self.tm

    @property
    def cx(self) -> int:
        return self.block_k // self.tn

    @property
    def threads(self) -> int:
        return self.ry * self.cx

    @property
    def d_pad(self) -> int:
        """D: d rounded up to a multiple of CX, so that every thread owns TD = D / CX columns of O."""
        return -(-self.head_dim // self.cx) * self.cx

    @property
    def td(self) -> int:
        return self.d_pad // self.cx

    @property
    def pairs_rows(self) -> bool:
        """Whether `owner` interleaves row groups: CX a power of two with 2 CX <= 32 and RY even."""
        cx = self.cx
        return cx & (cx - 1) == 0 and 2 * cx <= 32 and self.ry % 2 == 0

    def owner(self, tid: int) -> tuple[int, int]:
        """(ty, tx) of the block's thread tid (threadIdx.y CX + threadIdx.x, as the hardware numbers lanes).

        Where `pairs_rows`, groups of 2 CX consecutive threads hold two row groups, the lowest bit of tid
        choosing between them: ty = 2 (tid // 2 CX) + tid % 2, tx = (tid % 2 CX) // 2. Then lanes n and n ^ 1
        share tx (their V and K^T fragments) and lanes n and n ^ 2 share ty (their P^T and Q^T fragments),
        so every 128-bit fragment load is a paired load (banks' rule: 2 wavefronts, not 4), and a quarter
        warp's P^T stores spread over 8 bank groups. Otherwise ty = tid // CX, tx = tid % CX."""
        if self.pairs_rows:
            group, within = divmod(tid, 2 * self.cx)
            return 2 * group + within % 2, within // 2
        return divmod(tid, self.cx)

    @property
    def vw(self) -> int:
        """Columns of O a thread owns side by side (a vector of V): the largest of 4, 2, 1 dividing TD."""
        return next(w for w in (4, 2, 1) if self.td % w == 0)

    def column(self, tx: int, e: int) -> int:
        """The head-dim column of a thread's e-th O column: chunks of VW adjacent columns, the CX threads' chunks
        side by side, so that a warp's V fragment loads are consecutive 16-byte vectors (no bank conflict):
        column = (e // VW) CX VW + tx VW + e % VW, a bijection of (tx < CX, e < TD) onto 0..D-1."""
        return (e // self.vw) * self.cx * self.vw + tx * self.vw + e % self.vw

    def _store_p_wavefronts(self, stride: int) -> int:
        """Wavefronts (banks' rule) of `store_p`'s stores for the first warp, with P^T rows `stride` floats
        apart: lane t = (ty, tx) (`owner`) writes TM adjacent words at (tx TN + c) stride + ty TM, one store per c."""
        from fa_numba import banks

        width = 4 * next(w for w in (4, 2, 1) if self.tm % w == 0)
        lanes = [self.owner(t) for t in range(min(banks.WARP, self.threads))]
        total = 0
        for c in range(self.tn):
            for a in range(0, self.tm, width // 4):
                addresses = [4 * ((tx * self.tn + c) * stride + ty * self.tm + a) for ty, tx in lanes]
                total += banks.wavefronts(addresses, width, "store")
        return total

    @functools.cached_property
    def p_stride(self) -> int:
        """Floats between rows of P^T: B_r, or B_r padded (by multiples of the store's vector, so that the
        vector stores stay aligned) to the stride whose `store_p` costs the fewest wavefronts, if the padded
        layout still fits the budget without aliasing more. The tx stride TN B_r is a multiple of 32 banks at the shipped tiles
        (an 8-way conflict); B_r + 4 cuts it to 2-way at TN = 2 and to none at TN = 1."""
        step = next(w for w in (4, 2, 1) if self.tm % w == 0)
        candidates = [self.block_q + step * i for i in range(32 // step)]
        best = min(candidates, key=self._store_p_wavefronts)  # min keeps the first (the least padding) of ties
        padded, plain = self._offsets(best), self._offsets(self.block_q)
        if padded["_total"] * FLOAT_BYTES > self.budget or padded["_aliased"] > plain["_aliased"]:
            return self.block_q  # no room, or only by aliasing (one more barrier per tile): unpadded
        return best

    def _sizes(self, p_stride: int | None = None) -> dict[str, int]:
        d, br, bc = self.d_pad, self.block_q, self.block_k
        stride = self.p_stride if p_stride is None else p_stride
        sizes = {"q": d * br, "k": d * bc, "v": bc * d, "p": bc * stride, "red": br * self.cx}
        if self.order == "v1":
            sizes["stat"] = 2 * br  # m_i and l_i of the visit, read from HBM once per row
        return sizes

    @functools.cached_property
    def offsets(self) -> dict[str, int]:
        """Float offset of each region in the flat shared array, "_total" floats in all and "_aliased" (0/1):
        every region on its own if that fits the budget, else P^T, red (and stat) inside the dead operand."""
        return self._offsets(self.p_stride)

    def _offsets(self, p_stride: int) -> dict[str, int]:
        sizes = self._sizes(p_stride)
        offsets, end = {}, 0
        for name, size in sizes.items():
            offsets[name] = end
            end += size
        if end * FLOAT_BYTES <= self.budget:
            return {**offsets, "_total": end, "_aliased": 0}
        dead = "k" if self.order == "v2" else "q"  # the operand of S this order reloads before it is needed again
        offsets, end = {}, 0
        for name in ("q", "k", "v"):
            offsets[name] = end
            end += sizes[name]
        inside, room = offsets[dead], sizes[dead]
        for name in [n for n in sizes if n not in ("q", "k", "v")]:  # fill the dead operand first, then append
            if sizes[name] <= room:
                offsets[name], inside, room = inside, inside + sizes[name], room - sizes[name]
            else:
                offsets[name], end = end, end + sizes[name]
        return {**offsets, "_total": end, "_aliased": 1}

    @property
    def aliased(self) -> bool:
        return bool(self.offsets["_aliased"])

    @property
    def shared_bytes(self) -> int:
        return self.offsets["_total"] * FLOAT_BYTES

    def check(self) -> "Layout":
        for name in ("block_q", "block_k", "head_dim", "tm", "tn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.block_q % self.tm or self.block_k % self.tn:
            raise ValueError(f"block_q = {self.block_q} must be a multiple of tm = {self.tm} and block_k = "
                             f"{self.block_k} of tn = {self.tn}")
        if self.threads > 1024:
            raise ValueError(f"block_q x block_k / (tm x tn) = {self.threads} threads per block, over 1024: "
                             f"use smaller tiles (block_q = {self.block_q}, block_k = {self.block_k})")
        if self.shared_bytes > self.budget:
            raise ValueError(
                f"block_q = {self.block_q}, block_k = {self.block_k} with d = {self.head_dim} need {self.shared_bytes} "
                f"bytes of shared memory for Q^T, K^T, V, P^T and the row partials, over the {self.budget}-byte "
                f"static limit even with P^T aliased: use smaller tiles (e.g. kernels.default_tiles({self.head_dim}))")
        return self


# The shipped configurations by head dim: (B_r, B_c, TM, TN), each within 48 KB of static shared memory.
# 256 threads per block (v1 runs one block per (batch, head): it needs many warps per block to fill an SM)
# except at d > 128, where Q^T alone is 16 B_r KB.
DEFAULTS = ((32, (64, 64, 4, 4)), (64, (64, 32, 4, 2)), (128, (64, 16, 4, 1)), (256, (16, 16, 2, 1)))


def default_config(head_dim: int) -> tuple[int, int, int, int]:
    """(B_r, B_c, TM, TN) of the first DEFAULTS row whose head dim bound holds d."""
    for bound, config in DEFAULTS:
        if head_dim <= bound:
            return config
    raise ValueError(f"head dim d must be <= {DEFAULTS[-1][0]}, got {head_dim}")


def micro_for(block_q: int, block_k: int, head_dim: int) -> tuple[int, int]:
    """(TM, TN): the shipped micro-tile for the default tiles of d, otherwise the largest of 4, 2, 1 that
    divides each tile side."""
    if head_dim <= DEFAULTS[-1][0]:
        br, bc, tm, tn = default_config(head_dim)
        if (br, bc) == (block_q, block_k):
            return tm, tn
    return (next(t for t in MICRO_CHOICES if block_q % t == 0), next(t for t in MICRO_CHOICES if block_k % t == 0))


def _per_thread(total: int, threads: int) -> int:
    """Steps for `threads` threads to cover `total` elements, one element per thread per step."""
    return -(-total // threads)


@functools.lru_cache(maxsize=None)
def make_engine(layout: Layout) -> SimpleNamespace:
    """The engine's device functions, specialised (compile-time constants) for one layout.

    Indices into shared and global memory are formed as non-negative int64 expressions and passed as
    uint64 (`u64`): Numba then emits no negative-index wraparound, and a compile-time constant inside the
    index becomes an immediate offset of the load. Thread-dependent parts go into array views once.
    """
    BR, BC, D, TM, TN, TD, CX, T = (layout.block_q, layout.block_k, layout.d_pad, layout.tm, layout.tn, layout.td,
                                    layout.cx, layout.threads)
    PS, VW = layout.p_stride, layout.vw  # P^T's row stride; O columns a thread owns side by side
    OFF = layout.offsets
    Q, K, V, P, RED = OFF["q"], OFF["k"], OFF["v"], OFF["p"], OFF["red"]
    # Steps unrolled per loop iteration, written as an inner loop the compiler unrolls: as many as keep the
    # body (FFMAs plus fragment loads per step) within UNROLL_BUDGET operations. A larger body is not
    # unrolled (and the loop then recomputes every address); a smaller one pays the loop's own branch and
    # counter more often. `python -m fa_numba profile` shows the result.
    # One step always: a layout whose single step is over the budget (wide micro-tiles at a large d, e.g. 16x16
    # tiles at d = 128) runs that step without unrolling more.
    STEP = next((t for t in (16, 8, 4, 2) if D % t == 0 and t * (TM * TN + TM + TN) <= UNROLL_BUDGET), 1)
    KSTEP = next((t for t in (8, 4, 2) if BC % t == 0 and t * (TM * TD + TM + TD) <= UNROLL_BUDGET), 1)

    HD = layout.head_dim  # the kernel's d: a launch with another is refused (Kernel.__call__)

    def tile_loader(W, transposed):
        """(fetch, put, STEPS) for a W-row tile of src (rows past `rows` and features past d read as zeros):
        the thread moves STEPS elements, in chunks of at most IN_FLIGHT; fetch reads one chunk from HBM into
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
            instead of the whole 4-d index with its runtime strides."""
            if KEEP:
                inner = tid % INNER
                if transposed:  # the thread's row r = inner; its features x = outer vary
                    keep = inner < rows
                    line = src[b, h, u64(row0 + min(inner, rows - 1))]
                else:  # the thread's feature x = inner; its rows r = outer vary
                    keep = not PADDED or inner < HD
                    line = src[b, h, :, u64(min(inner, HD - 1))]
                for i in range(CHUNK):
                    outer = tid // INNER + (first + i) * (T // INNER)
                    value = ZERO
                    if first + i < STEPS and (not RAGGED or outer < OUTER) and keep:
                        if transposed:
                            if not PADDED or outer < HD:
                                value = to_f32(line[u64(outer)])
                        elif outer < rows:
                            value = to_f32(line[u64(row0 + outer)])
                    values[i] = value
                return
            for i in range(CHUNK):
                idx, inner, outer = place(tid, first + i)
                r = inner if transposed else outer
                x = outer if transposed else inner
                value = ZERO
                if first + i < STEPS and (not RAGGED or outer < OUTER) and r < rows and (not PADDED or x < HD):
                    value = to_f32(src[b, h, u64(row0 + r), u64(x)])
                values[i] = value

        @cuda.jit(device=True, inline=True)
        def put(values, smem, off, tid, first):
            for i in range(CHUNK):
                idx, inner, outer = place(tid, first + i)
                if first + i < STEPS and (not RAGGED or outer < OUTER):
                    smem[u64(off + idx)] = values[i]

        return fetch, put, STEPS, CHUNK

    fetch_q, put_q, Q_STEPS, Q_CHUNK = tile_loader(BR, True)  # Q_i^T
    fetch_k, put_k, K_STEPS, K_CHUNK = tile_loader(BC, True)  # K_j^T
    fetch_v, put_v, V_STEPS, V_CHUNK = tile_loader(BC, False)  # V_j
    KV_TOGETHER = K_STEPS + V_STEPS <= in_flight(layout)  # both tiles' loads in flight at once

    @cuda.jit(device=True, inline=True)
    def load_q(q, b, h, row0, rows, smem, off, tid):
        """Q_i^T into smem at off: a chunk of the thread's loads in flight, then its stores, and so on."""
        values = cuda.local.array(Q_CHUNK, float32)
        for first in range(0, Q_STEPS, Q_CHUNK):
            fetch_q(q, b, h, row0, rows, values, tid, first)
            put_q(values, smem, off, tid, first)

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
            for first in range(0, K_STEPS, K_CHUNK):
                fetch_k(k, b, h, row0, rows, k_values, tid, first)
                put_k(k_values, smem, k_off, tid, first)
            for first in range(0, V_STEPS, V_CHUNK):
                fetch_v(v, b, h, row0, rows, v_values, tid, first)
                put_v(v_values, smem, v_off, tid, first)

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
    def mask_rows(s, dead, row, col, n_q, n_k, lohi, dense, use_dense):
        """The block-mask path (any mask but causal): -inf, and dead, where key col + c is past N_k or not
        visible to query row + a: outside the row's interval [lohi[r, 0], lohi[r, 1]) or, for a dense mask,
        not set in it (read only here, in PARTIAL tiles: one byte per pair)."""
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
                    visible = dense[r, key] != 0
                dead[a, c] = not visible
                if not visible:
                    s[a, c] = NEG_INF

    @cuda.jit(device=True, inline=True)
    def masked_scores(smem, s, dead, ty, tx, scale, row, c0, cols, n_q, n_k, delta, partial, causal, lists, lohi,
                      dense, use_dense):
        """S of the thread's micro-tile (`scores`), then the mask only where a tile needs one: a PARTIAL tile
        of the block-mask path (`mask_rows`), a causal PARTIAL tile or the ragged last key tile (`mask`)."""
        scores(smem, s, ty, tx, scale)
        if lists and partial:
            mask_rows(s, dead, row, c0 + tx * TN, n_q, n_k, lohi, dense, use_dense)
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
                        vf[e] = vw[u64(k * D + (e // VW) * CX * VW + e % VW)]
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
                        vf[e] = vw[u64(k * D + (e // VW) * CX * VW + e % VW)]
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
                        vf[e] = vw[u64(k * D + (e // VW) * CX * VW + e % VW)]
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

    return SimpleNamespace(owner=owner, load_q=load_q, load_kv=load_kv, masked_scores=masked_scores,
                           row_max_partials=row_max_partials, softmax=softmax, store_p=store_p, pv=pv,
                           write_partials=write_partials, row_sum=row_sum)
