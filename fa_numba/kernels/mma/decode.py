"""Split-KV decoding on tensor cores: the split kernel of `kernels.decode` (the same grid, packed rows, page
table, partials and combine kernel; proofs/L11_split_kv.md) with its tile loop on the mma engine
(`kernels.mma.engine`) and K_j, V_j streamed through a two-stage cp.async pipeline.

Why a pipeline. Decoding reads every key and value once and does two products per element, so its time is the
time to stream K and V from HBM: 4.8 TB/s is 18 bytes per cycle per SM of the H200, about 30 KB per SM in flight
across an HBM round trip. The engine's forward stages a tile and waits for it (one round trip per tile, nothing
in flight while it multiplies); the CUDA-core split kernel loads through registers (39 dependent round trips per
tile at d = 128). Here the copies of tile j + 1 are issued before the block waits for tile j's, so one tile's
copies are always in flight while the block multiplies, and each block's iteration takes an HBM round trip
rather than a round trip plus its work (`cycle_model`: a wait that leaves a group in flight).

Loop (block (i, s) of request b, K/V head h; tiles start .. stop - 1 of split s that its rows can see):

    issue K_start, V_start into buffer 0; commit          (then Q_i staged and waited for: both groups land)
    for j in start .. stop - 1, buffer u = (j - start) % 2:
        if j + 1 < stop: issue K_{j+1}, V_{j+1} into buffer 1 - u
        commit (an empty group on the last tile), wait_group 1: this thread's copies of tile j have landed
        barrier: every thread's copies of tile j have landed
        fold K_j, V_j from buffer u into (m, l, acc)       (the engine's `fold`: S, masking, softmax, P V)
        barrier: every warp is done with buffer u, which iteration j + 1 refills with tile j + 2

The copies of a whole tile (every row a key: all but a request's last tile) take `streamer`'s lean path, one
fixed 16-byte column per thread and rows a constant apart; the last tile takes the engine's general stager,
which zero-fills the rows past n_b. Every wait is `cp.async.wait_group 1` (one group per iteration, the last one
empty), so the SASS has one kind of wait in the loop and the model reads it as pipelined. The simulator's
cp.async lands a group only at the wait that covers it (`warp.emulated_tc`), so a missing wait or barrier reads
stale data there and a test fails.

Rows and masking. Rows are the packed rows of `kernels.decode` (R = g N_q per request and K/V head, warp w of
W owns rows 16 w .. 16 w + 15 of the query tile); row r sees the keys [lo_r, hi_r) of lohi[b, r]: the engine's
"intervals" mask form reads them (lohi viewed as (B, 1, R, 2), the form's (B_m, H_m) slice axes). A tile that
some row does not see whole (PARTIAL: the causal edge, or the request's last, short tile) tests each pair; keys
past n_b are zero-filled by the copies, never read from the cache. A PARTIAL tile whose staged V holds an inf or
NaN takes the engine's exact path (a masked key's value never multiplied), as the tensor-core forward does.

Arithmetic: each split's (m, l, acc) is the tensor-core v2 kernel's fold of its tiles (P rounded to the 16-bit
input type before P V: proofs/L6 part 7), O_s = acc / l and LSE_s = m + log l as the CUDA-core split kernel
writes them; the combine is kernels.decode's, unchanged. HBM traffic: that of kernels.decode
(iomodel.traffic_decode), counted in the simulator (tests/test_decode_mma.py).

A value head dim of its own (d_v != d: the value cache (num_pages, H_kv, page, d_v), O d_v wide) is native: V_j
is staged and streamed d_v wide (its own stager, lean streamer and buffer size, `MmaConfig.value_dim`), O's
accumulator holds d_v columns.

Limits: 16-bit inputs (float16, bfloat16), d and d_v multiples of 8 (16-byte rows for cp.async) up to 128 (at d = 192
the one-warp kernel compiles to 255 registers with a spill: MAX_DECODE_HEAD_DIM), caches whose rows start 16
bytes apart (`staging.aligned16`), B_c a multiple of 16 with both stages in 48 KB.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from numba import cuda, float32

from fa_numba import backend, warp
from fa_numba.kernels import disk_cache
from fa_numba.kernels.common import NEG_INF, ZERO, log_sum_exp, output
from fa_numba.kernels.mma.engine import KINDS, MAX_HEAD_DIM, SHARED_LIMIT, MmaConfig, make_ops
from fa_numba.kernels.mma.staging import aligned16

STAGES = 2  # K_j, V_j buffers: the tile being multiplied and the one in flight
TILE_CANDIDATES = (64, 32, 16)  # B_c by default: the largest whose two stages fit 48 KB
MAX_WARPS = 4  # block_q = 16 W rows: up to 64 packed rows in one query tile
# d = 192 (16 x 16 tiles, one warp) compiles to 255 registers and spills (sm_90a, 2026-12-03); 128: 249, none
MAX_DECODE_HEAD_DIM = MAX_HEAD_DIM


@dataclass(frozen=True)
class DecodeSplit:
    """The tensor-core split kernel's compile-time configuration: the engine's MmaConfig (its kind, warps,
    tiles and the "intervals" mask form) and two K_j, V_j stages."""

    engine: MmaConfig

    @property
    def block_q(self) -> int:
        return self.engine.block_q

    @property
    def block_k(self) -> int:
        return self.engine.block_k

    @property
    def head_dim(self) -> int:
        return self.engine.head_dim

    @property
    def d_v(self) -> int:
        return self.engine.d_v

    @property
    def threads(self) -> int:
        return 32 * self.engine.warps

    @property
    def shared_bytes(self) -> int:
        """Q_i once, K_j and V_j twice (16-bit elements, rows `row_stride` and V's `value_row_stride` apart)."""
        c = self.engine
        return 2 * (c.row_stride * (c.block_q + STAGES * c.block_k) + STAGES * c.value_row_stride * c.block_k)

    def check(self) -> "DecodeSplit":
        self.engine.check()
        if self.engine.kind not in KINDS or not self.engine.async_copy:
            raise ValueError(f"the tensor-core decode kernel takes 16-bit inputs {KINDS} staged by cp.async (d a "
                             f"multiple of 8), got kind {self.engine.kind!r}, d = {self.head_dim}")
        if self.shared_bytes > SHARED_LIMIT:
            raise ValueError(f"block_q {self.block_q}, block_k {self.block_k}, d {self.head_dim}: {self.shared_bytes} "
                             f"bytes of shared memory for {STAGES} stages, over the {SHARED_LIMIT} static limit")
        return self


def decode_split(kind: str, rows: int, head_dim: int, block_k: int | None = None,
                 value_dim: int = 0) -> DecodeSplit:
    """The checked configuration for R = g N_q packed rows: W warps, ceil(R / 16) rounded up to a power of two
    (at most MAX_WARPS: more rows take more query tiles), B_c the largest of TILE_CANDIDATES whose two stages
    fit 48 KB, or `block_k` (a ValueError names a tile that does not fit, or a head dim the kernel does not
    take). value_dim: V's and O's head dim d_v where it differs from d (0: d), natively (`MmaConfig.value_dim`:
    V_j staged d_v wide, O's accumulator d_v wide)."""
    if kind not in KINDS:
        raise ValueError(f"the tensor-core decode kernel takes float16 or bfloat16 inputs, got {kind}")
    for name, dim in (("head dim d", head_dim), ("value head dim d_v", value_dim or head_dim)):
        if dim % 8 or not 1 <= dim <= MAX_DECODE_HEAD_DIM:
            raise ValueError(f"the tensor-core decode kernel needs {name} a multiple of 8 (16-byte rows for its "
                             f"cp.async pipeline) in 8..{MAX_DECODE_HEAD_DIM}, got {dim}")
    value_dim = 0 if value_dim == head_dim else value_dim
    warps = min(MAX_WARPS, 1 << max(0, -(-rows // 16) - 1).bit_length())  # a power of two (MmaConfig)
    errors = []
    for bc in (TILE_CANDIDATES if block_k is None else (block_k,)):
        try:
            return DecodeSplit(MmaConfig(kind, warps, bc, head_dim, False, True, None, "intervals",
                                         value_dim)).check()
        except ValueError as error:
            errors.append(str(error))
    raise ValueError(f"no tensor-core decode tile fits head dim d = {head_dim}: {'; '.join(errors)}")


def streamer(D, DP, SQ, THREADS, ROWS):
    """(stream, LEAN): the copies of a whole cache tile (ROWS keys, every one within the request's length) of a
    C-contiguous cache (num_pages, H_kv, page, d) by cp.async. Where a block's threads cover whole rows of
    16-byte chunks (THREADS a multiple of the chunks per row, ROWS of the rows they cover at once: LEAN), each
    thread copies one fixed column of the rows r_t, r_t + R, ..., so each address is its first plus a constant:
    a few instructions a copy instead of the general stager's index arithmetic (`staging.stagers`, which the
    kernel takes where LEAN is False, and for a request's last tile, whose rows past its length it zero-fills)."""
    CH = 8  # 16-bit elements per 16-byte copy
    CHUNKS = DP // CH
    LEAN = THREADS % CHUNKS == 0 and ROWS % (THREADS // CHUNKS) == 0
    STEP = THREADS // CHUNKS if LEAN else 1  # rows the block covers per copy of each thread
    COPIES = ROWS // STEP

    @cuda.jit(device=True, inline=True)
    def stream(src, page, h, r0, tile):
        rt = cuda.threadIdx.x // CHUNKS
        x = CH * (cuda.threadIdx.x - rt * CHUNKS)
        size = 16 if x < D else 0  # a zero chunk past d (d % 16 == 8)
        first = ((page * src.shape[1] + h) * src.shape[2] + r0 + rt) * D + min(x, D - CH)  # row r0 + r_t
        for c in range(COPIES):
            warp.cp_async16(tile, (rt + c * STEP) * SQ + x, src, first + c * STEP * D, size)

    return stream, LEAN


def split_source(split: DecodeSplit, partial_tiles: bool = True):
    """The Python function of the split kernel (module docstring). partial_tiles=False compiles the PARTIAL-tile
    path out (masking, the exact path, and the general stager of a request's last tile), leaving what every
    FULL tile runs: what `fa_numba.decode_estimate` profiles, never what a launch runs."""
    E = make_ops(split.engine)
    stage_q, stage_async, fold, quad_sum = E.stage_q, E.stage_async, E.fold, E.quad_sum
    stage_v_async, any_bad_v = E.stage_v_async, E.any_bad_v
    Z = E.sizes
    BR, BC, KS, NT, DNV, DV = Z.BR, Z.BC, Z.KS, Z.NT, Z.DNV, Z.DV
    Q_SIZE, KV_SIZE, V_SIZE = Z.Q_SIZE, Z.KV_SIZE, Z.V_SIZE
    ELEMENT, FRAGMENT, QF = Z.ELEMENT, Z.FRAGMENT, Z.QF
    K_BUFFERS, V_BUFFERS = STAGES * KV_SIZE, STAGES * V_SIZE
    PARTIAL_TILES = partial_tiles
    lean_k, LEAN_K = streamer(Z.D, Z.DP, Z.SQ, 32 * Z.W, BC)
    lean_v, LEAN_V = streamer(Z.DV, Z.DPV, Z.SV, 32 * Z.W, BC)  # the same as K's where d_v = d

    @cuda.jit(device=True, inline=True)
    def copy_k(src, page, h, r0, n, tile):
        """Issue the copies of one K tile (rows r0 .. r0 + B_c - 1 of a page; past n zero-filled)."""
        if LEAN_K and (not PARTIAL_TILES or r0 + BC <= n):  # LEAN_K a constant; every row of the tile holds a key
            lean_k(src, page, h, r0, tile)
        else:  # the general stager: rows past n zero-filled from a valid address
            stage_async(src, page, h, r0, n, tile, BC)

    @cuda.jit(device=True, inline=True)
    def copy_v(src, page, h, r0, n, tile):
        """copy_k for a V tile, d_v wide."""
        if LEAN_V and (not PARTIAL_TILES or r0 + BC <= n):
            lean_v(src, page, h, r0, tile)
        else:
            stage_v_async(src, page, h, r0, n, tile, BC)

    def flash_decode_split_mma(q, k, v, o, lse, scale, seqlens, table, lohi, tiles_per_split, denses, captured):
        sq = cuda.shared.array(Q_SIZE, ELEMENT)
        sk = cuda.shared.array(K_BUFFERS, ELEMENT)  # two stages of K_j
        sv = cuda.shared.array(V_BUFFERS, ELEMENT)  # and of V_j
        qf = cuda.local.array((KS, QF), FRAGMENT)
        s = cuda.local.array((NT, 4), float32)
        acc = cuda.local.array((DNV, 4), float32)
        x = cuda.blockIdx.x  # query tile * S + split
        bh = cuda.blockIdx.y  # (request, K/V head)
        lane = cuda.threadIdx.x & 31
        wid = cuda.threadIdx.x >> 5
        g, t = lane >> 2, lane & 3
        mrow, mat = lane & 7, lane >> 3
        heads_kv, n_rows, page = k.shape[1], q.shape[2], k.shape[2]
        splits = o.shape[1] // heads_kv
        i = x // splits
        split = x - i * splits
        b = bh // heads_kv
        h = bh - b * heads_kv
        n_k = seqlens[b]
        r0 = i * BR
        row0 = r0 + 16 * wid + g  # this lane's rows row0 and row0 + 8
        # [lo_min, hi_max) holds every key a row of the tile sees, [lo_max, hi_min) the keys all of them see
        lo_min, lo_max, hi_min, hi_max = n_k, 0, n_k, 0
        for r in range(r0, min(r0 + BR, n_rows)):
            lo_min = min(lo_min, lohi[b, 0, r, 0])
            lo_max = max(lo_max, lohi[b, 0, r, 0])
            hi_min = min(hi_min, lohi[b, 0, r, 1])
            hi_max = max(hi_max, lohi[b, 0, r, 1])
        first = split * tiles_per_split  # the split's key tiles: first .. first + tiles_per_split - 1
        start = max(first, lo_min // BC)
        stop = min(first + tiles_per_split, (hi_max + BC - 1) // BC)

        for dn in range(DNV):
            for e in range(4):
                acc[dn, e] = ZERO
        m0, m1, l0, l1 = NEG_INF, NEG_INF, ZERO, ZERO
        c0 = start * BC  # tile j's first key
        if stop > start:  # block-uniform: a split its rows see nothing of reads neither Q nor the cache
            base = c0 - c0 % page  # the first key of the page that holds tile `start`
            frame = table[b, c0 // page]
            copy_k(k, frame, h, c0 - base, n_k - base, sk)
            copy_v(v, frame, h, c0 - base, n_k - base, sv)
            warp.cp_async_commit()
            frame = table[b, min(start + 1, stop - 1) * BC // page]  # tile start + 1's page (a used one)
            stage_q(q, b, h, r0, n_rows, sq, qf, wid, mrow, mat)  # waits for every group: tile `start` too
        for j in range(start, stop):  # invariant: (m, l, acc) is the state of the split's tiles < j (L2, L11)
            u = (j - start) & 1
            if j + 1 < stop:  # tile j + 1 into the other buffer, which every warp left at the last barrier
                c1 = c0 + BC
                base = c1 - c1 % page
                other_k, other_v = (1 - u) * KV_SIZE, (1 - u) * V_SIZE
                copy_k(k, frame, h, c1 - base, n_k - base, sk[other_k:other_k + KV_SIZE])
                copy_v(v, frame, h, c1 - base, n_k - base, sv[other_v:other_v + V_SIZE])
            # tile j + 2's page, read now and used an iteration later: no wait on the table in the loop
            frame = table[b, min(j + 2, stop - 1) * BC // page]
            warp.cp_async_commit()  # empty on the last tile: one wait_group 1 per iteration either way
            warp.cp_async_wait_1()  # this thread's copies of tile j have landed
            cuda.syncthreads()  # every thread's copies of tile j have landed
            kb = sk[u * KV_SIZE:(u + 1) * KV_SIZE]
            vb = sv[u * V_SIZE:(u + 1) * V_SIZE]
            partial = PARTIAL_TILES and (c0 < lo_max or c0 + BC > hi_min)  # some row does not see the whole tile
            guard = False
            if partial:  # block-uniform: every thread reaches the barrier
                guard = cuda.syncthreads_or(1 if any_bad_v(vb, BC) else 0) != 0
            m0, m1, l0, l1 = fold(qf, s, acc, sq, kb, vb, m0, m1, l0, l1, row0, 16 * wid + g, c0, n_k, 0, scale, t,
                                  mrow, mat, guard, partial, b, 0, n_rows, captured, lohi, denses, b, 0)
            cuda.syncthreads()  # every warp is done with buffer u: iteration j + 1 refills it
            c0 += BC
        l0, l1 = quad_sum(l0), quad_sum(l1)
        key_lo = first * BC
        key_hi = (first + tiles_per_split) * BC
        for half in range(2):  # the split's O_s and LSE_s; a row that sees none of its keys gets 0, -inf
            r = row0 + 8 * half
            if r < n_rows:
                alive = max(lohi[b, 0, r, 0], key_lo) < min(lohi[b, 0, r, 1], key_hi)
                l_row = l0 if half == 0 else l1
                for dn in range(DNV):
                    for e in range(2):
                        col = 8 * dn + 2 * t + e
                        if col < DV:
                            o[b, h * splits + split, r, col] = output(acc[dn, 2 * half + e], l_row, alive)
                if t == 0:
                    lse[b, h * splits + split, r] = log_sum_exp(m0 if half == 0 else m1, l_row, alive)

    return flash_decode_split_mma


@functools.lru_cache(maxsize=None)
def make_split(split: DecodeSplit):
    return disk_cache.jit(split_source(split))


def argtypes():
    """The Numba types of the split kernel's arguments (what `fa_numba.decode_estimate` compiles): 16-bit bits
    for q and the caches, float32 partials, int32 lengths, table and lohi (B, 1, R, 2), the dense-mask and
    captured placeholders (the forward's types: `MmaKernel.array_types`, `block_lists.mask_types`)."""
    from numba import types

    from fa_numba.kernels.block_lists import mask_types
    from fa_numba.kernels.mma.launch import MmaKernel
    from fa_numba.kernels.score_mod import tuple_type

    bits, out, stat = MmaKernel.array_types("float16")
    return (bits, bits, bits, out, stat, types.float32, types.Array(types.int32, 1, "C"),
            types.Array(types.int32, 2, "C"), types.Array(types.int32, 4, "C"), types.int64, mask_types()[7],
            tuple_type(None))


def launch(split: DecodeSplit, grid, stream, q, k, v, o_split, lse_split, scale, seqlens, table, lohi,
           tiles_per_split) -> None:
    """The split kernel's launch (kernels.decode.run calls it): q (B, H_kv, R, d) and the caches (num_pages,
    H_kv, page, d) as uint16 bits, rows 16-byte aligned; lohi (B, R, 2)."""
    from fa_numba.kernels.block_lists import mask_arrays

    for name, x in (("q", q), ("k_cache", k), ("v_cache", v)):
        if not aligned16(x):
            raise ValueError(f"{name}'s rows must start on 16-byte boundaries for the tensor-core decode kernel's "
                             "cp.async copies; use engine='simt'")
    lohi4 = lohi.reshape(lohi.shape[0], 1, lohi.shape[1], lohi.shape[2])
    with backend.serialised(split.threads):
        make_split(split)[grid, split.threads, stream](q, k, v, o_split, lse_split, float32(scale), seqlens, table,
                                                       lohi4, tiles_per_split, mask_arrays(None)[7], ())


__all__ = ["DecodeSplit", "MAX_DECODE_HEAD_DIM", "STAGES", "argtypes", "decode_split", "launch", "make_split",
           "split_source", "streamer"]
