"""Split-KV decoding on the tile engine: a split kernel writes partial (O, LSE) per range of key tiles, and a
combine kernel merges them (proofs/L11_split_kv.md).

Problem. q (B, H, N_q, d) with N_q small, a key/value cache of per-request lengths n_b (`seqlens`, the keys
after any appended ones), read through a page table. GQA is packed: the g = H / H_kv query heads of one K/V
head and their N_q queries are the R = g N_q rows of one problem, row r = t N_q + i (query head h_kv g + t,
query i): q viewed as (B, H_kv, R, d), a reshape without a copy. So K and V are read once per (request, K/V
head, split), not once per query head. Row r sees the keys [lo_r, hi_r) of `lohi[b, r]` (0 and n_b, or
with causal masking bottom-right aligned, hi_r = n_b - N_q + i + 1 clamped to [0, n_b]). The value cache
may have a head dim d_v of its own (O, O_split then have it): the layout (`Layout.value_dim`) stages Q_i,
K_j and V_j max(d, d_v) wide, each zero past its own width, so the caches are read where they are.

Pages. The cache is (num_pages, H_kv, page, d) and key position c of request b lives in page table[b, c //
page] at row c % page; `page` is a multiple of B_c, so a key tile never straddles two pages. A contiguous
cache (B, H_kv, N_max, d) is the paged one with page = N_max and table[b] = [b]: one code path, so the two
are the same arithmetic on the same numbers (bitwise equal).

Split kernel. Grid (T_r S, B H_kv), S splits: block (i, s) folds the key tiles s T_s .. s T_s + T_s - 1 (T_s =
tiles_per_split) that its query tile can see, in increasing order, exactly as the v2 engine kernel folds a
row (the same device functions), and writes O_s = acc / l and LSE_s = m + log l into o_split[b, h_kv S + s]
and lse_split (0 and -inf for a row that sees no key of the split). Tiles are classified per query tile from
the rows' intervals: SKIP outside [min lo, max hi), FULL when every row sees the whole tile, PARTIAL
otherwise (masked by the intervals, `engine.mask_rows`, and the P V product guarded against masked keys).

Combine kernel. One block per output row, d threads (one feature each): the fold over s = 0 .. S - 1 of
online_softmax.merge with the split states (LSE_s, 1, O_s), skipping every empty split (LSE_s = -inf: the
identity), then O = acc / l, LSE = m + log l (0 and -inf on a row that sees no key). The first non-empty
split initialises the state, so one split comes back exactly: O = O_s / 1, LSE = LSE_s + log 1.

HBM traffic (iomodel.traffic_decode): K and V of every visited tile once per (request, K/V head, query tile,
split), Q once per (query tile, split) that visits a tile, the partials written once and read once by the
combine (O_s only for non-empty splits), O and LSE written once.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import boolean, cuda, float32

from fa_numba import backend
from fa_numba.kernels import disk_cache
from fa_numba.kernels.common import NEG_INF, ZERO, check_grid, log_sum_exp, output
from fa_numba.kernels.engine import GUARD_MARKED, GUARD_NONE, make_engine
from fa_numba.kernels.layout import Layout

MAX_SPLITS = 128  # the combine keeps every split's LSE in shared memory (flash-attn has the same bound)
TILE_CANDIDATES = (64, 32, 16)  # B_c by default, largest first, the first whose layout fits 48 KB
ROW_TILES = (4, 8, 16)  # B_r: the smallest that holds a (request, K/V head)'s g N_q rows, else 16
ROW_GROUPS = 4  # B_r / TM: four row groups of TM rows
MAX_COLUMN_GROUP = 32  # B_c / TN: at most a warp's width of column groups


def decode_layout(rows: int, head_dim: int, block_k: int | None = None, value_dim: int = 0) -> Layout:
    """The split kernel's checked layout for R = g N_q rows per (request, K/V head); value_dim: V's and O's
    head dim d_v where it differs from d (0: d). The tiles are staged max(d, d_v) wide (`Layout.d_pad`).

    Decoding is a stream of K and V with a few rows, so the layout spends threads on columns, not rows: B_r
    the smallest of ROW_TILES that holds R (a query tile re-reads K and V, so R > 16 pays per tile of 16),
    TM = B_r / 4, and TN the smallest that keeps B_c / TN <= 32: at d = 128, 4 x 32 tiles run 128 threads with
    a 1 x 1 micro-tile of S, each thread moving 64 elements of K_j and V_j per tile. B_c (block_k) defaults to
    the largest of TILE_CANDIDATES that fits the static 48 KB. A ValueError names a tile that does not fit."""
    block_q = next((b for b in ROW_TILES if rows <= b), ROW_TILES[-1])
    errors = []
    for bc in (TILE_CANDIDATES if block_k is None else (block_k,)):
        tn = next(t for t in range(1, bc + 1) if bc % t == 0 and bc // t <= MAX_COLUMN_GROUP)
        try:
            return Layout("v2", block_q, bc, head_dim, block_q // ROW_GROUPS, tn,
                          value_dim=value_dim).check()
        except ValueError as error:
            errors.append(str(error))
    raise ValueError(f"no decode tile fits head dim d = {head_dim}: {'; '.join(errors)}")


def split_source(layout: Layout, partial_tiles: bool = True):
    """The Python function of the split kernel for one layout (compiled by `make_split`).

    partial_tiles=False compiles the PARTIAL-tile path out, leaving the code every FULL tile runs: what
    `fa_numba.decode_estimate` profiles (a request has at most two PARTIAL tiles, its first and its last,
    among thousands), never what a launch runs."""
    E = make_engine(layout)
    owner, column, load_q, load_kv, masked_scores = E.owner, E.column, E.load_q, E.load_kv, E.masked_scores
    row_max_partials, softmax, store_p, pv = E.row_max_partials, E.softmax, E.store_p, E.pv
    write_partials, row_sum = E.write_partials, E.row_sum
    BR, BC, TM, TN, TD, CX = layout.block_q, layout.block_k, layout.tm, layout.tn, layout.td, layout.cx
    ALIASED = layout.aliased
    OFF = layout.offsets
    SMEM, Q, K, V, RED = OFF["_total"], OFF["q"], OFF["k"], OFF["v"], OFF["red"]
    PARTIAL_TILES = partial_tiles
    VALUE_DIM = layout.value_dim != 0  # O's head dim its own (compile-time: else the code of d_v = d, unchanged)

    def flash_decode_split(q, k, v, o, lse, scale, seqlens, table, lohi, tiles_per_split):
        x = cuda.blockIdx.x  # query tile * S + split
        bh = cuda.blockIdx.y  # (request, K/V head)
        tid = cuda.threadIdx.y * CX + cuda.threadIdx.x
        ty, tx = owner(tid)
        heads_kv, n_rows, page = k.shape[1], q.shape[2], k.shape[2]
        splits = o.shape[1] // heads_kv
        d_v = o.shape[3] if VALUE_DIM else q.shape[3]
        i = x // splits
        split = x - i * splits
        b = bh // heads_kv
        h = bh - b * heads_kv
        n_k = seqlens[b]
        rows_lohi = lohi[b]  # (R, 2): the keys [lo, hi) each row sees
        r0 = i * BR
        rows = min(BR, n_rows - r0)
        row = r0 + ty * TM
        # The tile's key range: [lo_min, hi_max) holds every key a row sees, [lo_max, hi_min) the keys all see.
        lo_min = n_k
        lo_max = 0
        hi_min = n_k
        hi_max = 0
        for r in range(r0, r0 + rows):
            lo_min = min(lo_min, rows_lohi[r, 0])
            lo_max = max(lo_max, rows_lohi[r, 0])
            hi_min = min(hi_min, rows_lohi[r, 1])
            hi_max = max(hi_max, rows_lohi[r, 1])
        first = split * tiles_per_split  # the split's key tiles: first .. first + tiles_per_split - 1
        start = max(first, lo_min // BC)
        stop = min(first + tiles_per_split, (hi_max + BC - 1) // BC)

        smem = cuda.shared.array(SMEM, float32)
        s = cuda.local.array((TM, TN), float32)
        dead = cuda.local.array((TM, TN), boolean)
        acc = cuda.local.array((TM, TD), float32)
        m = cuda.local.array(TM, float32)
        l = cuda.local.array(TM, float32)
        alpha = cuda.local.array(TM, float32)
        limit = cuda.local.array(TM, float32)  # unused by the marked guard; pv's signature takes it

        for a in range(TM):
            m[a] = NEG_INF
            l[a] = ZERO
            limit[a] = ZERO
            for e in range(TD):
                acc[a, e] = ZERO
            for c in range(TN):
                dead[a, c] = False
        if stop > start:  # a split its rows see nothing of never reads Q
            load_q(q, b, h, r0, rows, smem, Q, tid)

        for j in range(start, stop):  # invariant: (m, l, acc) is the state of the split's tiles < j (L2, L11)
            c0 = j * BC
            cols = min(BC, n_k - c0)
            slot = c0 // page
            cuda.syncthreads()  # the previous tile's P V has read V and P^T
            load_kv(k, v, table[b, slot], h, c0 - slot * page, cols, smem, K, V, tid)
            cuda.syncthreads()  # K_j^T, V_j and Q_i^T complete
            partial = PARTIAL_TILES and (c0 < lo_max or c0 + BC > hi_min)  # some row does not see the whole tile
            # the last three (b, h, captured) feed only a pair test, which use_dense=False never runs
            masked_scores(smem, s, dead, ty, tx, scale, row, c0, cols, n_rows, n_k, 0, partial, False, True,
                          rows_lohi, rows_lohi, False, b, h, seqlens)
            if ALIASED:
                cuda.syncthreads()  # P^T and red live in K^T's space
            row_max_partials(smem, s, ty, tx)
            cuda.syncthreads()
            softmax(smem, s, m, l, alpha, ty)
            store_p(smem, s, dead, partial, ty, tx)
            cuda.syncthreads()
            pv(smem, acc, alpha, ty, tx, GUARD_MARKED if partial else GUARD_NONE, limit)

        write_partials(smem, RED, l, ty, tx)
        cuda.syncthreads()
        row_sum(smem, RED, l, ty)
        key_lo = first * BC
        key_hi = (first + tiles_per_split) * BC
        for a in range(TM):  # the split's O_s and LSE_s; a row that sees none of its keys gets 0, -inf
            r = row + a
            if r < n_rows:
                alive = max(rows_lohi[r, 0], key_lo) < min(rows_lohi[r, 1], key_hi)
                for e in range(TD):
                    col = column(tx, e)
                    if col < d_v:
                        o[b, h * splits + split, r, col] = output(acc[a, e], l[a], alive)
                if tx == 0:
                    lse[b, h * splits + split, r] = log_sum_exp(m[a], l[a], alive)

    return flash_decode_split


def combine_source(threads: int):
    """The Python function of the combine kernel for blocks of `threads` >= d threads."""

    def flash_decode_combine(o_split, lse_split, o, lse, lohi):
        x = cuda.threadIdx.x  # the feature this thread combines
        heads_kv, n_rows, d = o.shape[1], o.shape[2], o.shape[3]
        splits = o_split.shape[1] // heads_kv
        row_id = cuda.blockIdx.x
        r = row_id % n_rows
        bh = row_id // n_rows
        h = bh % heads_kv
        b = bh // heads_kv
        weights = cuda.shared.array(MAX_SPLITS, float32)
        for t in range(x, splits, threads):  # every LSE_s read once from HBM
            weights[t] = lse_split[b, h * splits + t, r]
        cuda.syncthreads()
        m = NEG_INF
        l = ZERO
        acc = ZERO
        seen = False
        for t in range(splits):  # invariant: (m, l, acc) is the merge of the non-empty splits < t (L2, L11)
            m_s = weights[t]
            if m_s != NEG_INF:  # an empty split is the identity: skipped, not multiplied by 0
                o_s = o_split[b, h * splits + t, r, x] if x < d else ZERO
                if not seen:  # merge(identity, a) = a, exactly
                    m = m_s
                    l = float32(1.0)
                    acc = o_s
                    seen = True
                else:
                    m_new = max(m, m_s)
                    alpha = math.exp(m - m_new)
                    beta = math.exp(m_s - m_new)
                    l = alpha * l + beta
                    acc = alpha * acc + beta * o_s
                    m = m_new
        alive = rows_alive(lohi, b, r)
        if x < d:
            o[b, h, r, x] = output(acc, l, alive)
        if x == 0:
            lse[b, h, r] = log_sum_exp(m, l, alive)

    return flash_decode_combine


@cuda.jit(device=True, inline=True)
def rows_alive(lohi, b, r):
    """Whether row r of request b sees any key (the mask's word, not the state's: L2.6)."""
    return lohi[b, r, 0] < lohi[b, r, 1]


@disk_cache.jit
def append_kv(cache, new, starts, table):
    """cache[page of position starts[b] + t, h, its row, :] = new[b, h, t, :]: grid (B H_kv, N_new), a thread
    per feature. The positions a call appends never overlap (each request's own pages, checked on the host)."""
    bh = cuda.blockIdx.x
    t = cuda.blockIdx.y
    x = cuda.threadIdx.x
    heads_kv, page = new.shape[1], cache.shape[2]
    b = bh // heads_kv
    h = bh - b * heads_kv
    position = starts[b] + t
    slot = position // page
    if x < new.shape[3]:
        cache[table[b, slot], h, position - slot * page, x] = new[b, h, t, x]


def append(cache, new, starts, table, stream=0) -> None:
    """Write new (B, H_kv, N_new, d) into the device cache (num_pages, H_kv, page, d) at positions starts[b] ..
    starts[b] + N_new - 1 of each request, through the page table (`append_kv`)."""
    batch, heads_kv, n_new, d = new.shape
    if batch * n_new == 0:
        return
    grid = (batch * heads_kv, n_new)
    check_grid(grid, ("batch * heads_kv", "new keys"), "cache append")
    threads = combine_threads(d)
    with backend.serialised(threads):
        append_kv[grid, (threads,), stream](cache, new, starts, table)


@functools.lru_cache(maxsize=None)
def make_split(layout: Layout):
    return disk_cache.jit(split_source(layout))


@functools.lru_cache(maxsize=None)
def make_combine(threads: int):
    return disk_cache.jit(combine_source(threads))


def combine_threads(head_dim: int) -> int:
    """Threads of a combine block, one per feature: d rounded up to a warp on a GPU; in the simulator d
    rounded up to 8, since every simulated thread is a Python thread and idle ones cost as much as busy ones
    (the kernel takes any block size: features past d and LSE loads strided by the block's size)."""
    unit = 8 if backend.name() == "simulator" else 32
    return -(-head_dim // unit) * unit


def run(q, k, v, o_split, lse_split, out, lse, scale: float, seqlens, table, lohi, *, layout, tiles_per_split: int,
        stream=0) -> None:
    """Both launches on device arrays: q (B, H_kv, R, d) packed rows; k (num_pages, H_kv, page, d) and v
    (num_pages, H_kv, page, d_v); o_split (B, H_kv S, R, d_v) and lse_split (B, H_kv S, R) float32 partials;
    out (B, H_kv, R, d_v) and lse (B, H_kv, R)
    float32; seqlens (B,) and table (B, pages) int32; lohi (B, R, 2) int32. layout: the split kernel's, a
    `decode_layout` (this module's CUDA-core kernel, any input dtype) or a `kernels.mma.decode.DecodeSplit` (the
    tensor-core kernel, q and the caches as 16-bit bits); the combine is the same for both."""
    batch, heads_kv, n_rows, d = q.shape
    d_v = v.shape[3]
    splits = o_split.shape[1] // heads_kv
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {splits}")
    if (layout.head_dim, layout.d_v) != (d, d_v):
        raise ValueError(f"q and v must have head dims {layout.head_dim} and {layout.d_v} for this layout, got "
                         f"{d} and {d_v}")
    grid = (-(-n_rows // layout.block_q) * splits, batch * heads_kv)
    check_grid(grid, ("ceil(R / block_q) * num_splits", "batch * heads_kv"), "decode split")
    threads = combine_threads(d_v)
    check_grid((batch * heads_kv * n_rows,), ("batch * heads_kv * rows",), "decode combine")
    if isinstance(layout, Layout):
        with backend.serialised(layout.threads):
            make_split(layout)[grid, (layout.cx, layout.ry), stream](
                q, k, v, o_split, lse_split, float32(scale), seqlens, table, lohi, np.int64(tiles_per_split))
    else:
        from fa_numba.kernels.mma import decode as mma_decode

        mma_decode.launch(layout, grid, stream, q, k, v, o_split, lse_split, scale, seqlens, table, lohi,
                          np.int64(tiles_per_split))
    with backend.serialised(threads):
        make_combine(threads)[(batch * heads_kv * n_rows,), (threads,), stream](o_split, lse_split, out, lse, lohi)


__all__ = ["MAX_SPLITS", "append", "combine_threads", "decode_layout", "make_combine", "make_split", "run"]
