"""Tile loaders from HBM into shared memory: the tile engine's Q_i^T, K_j^T and V_j for one `layout.Layout`, and
the CUDA-core backward's row-major tiles.

    load_q, load_kv = make_loaders(layout)
    load_q(q, b, h, row0, rows, smem, off, tid)                       # Q_i^T at off
    load_kv(k, v, b, h, row0, rows, smem, k_off, v_off, tid)          # K_j^T at k_off, V_j at v_off
    load = row_tile_loader(W, D, stride, T, HD, in_flight)            # the backward's Q, dO, K or V
    load(src, b, h, row0, rows, smem, off, tid)

Tiles are loaded cooperatively: Q^T and K^T with the tile's row index fastest across threads (stores to
consecutive banks, conflict-free; the strided global reads hit the same cache lines, so HBM traffic is
unchanged), V and the backward's tiles with d fastest (coalesced). Each element is read from HBM once per
load, rows past `rows` and columns past d are never read (zeros instead), and float16 / bfloat16 become float32
once, on load. A thread issues a chunk of its loads (`layout.in_flight`, the backward's IN_FLIGHT) into
registers before it stores any, so a tile costs a round trip to memory per chunk, not one per element; where
both fit, K_j and V_j travel in the same round trip. The engine (`kernels.engine`) and the backward
(`kernels.backward`) build their kernels' other device functions around these.
"""

from __future__ import annotations

from numba import cuda, float32, uint64 as u64

from fa_numba import backend, warp
from fa_numba.kernels.common import ZERO, to_f32
from fa_numba.kernels.layout import Layout, in_flight


def _rows_python(src, b, h, r, x):
    """rows_from as the CUDA simulator runs it: src[b, h] from element (r, x) on, as one flat NumPy view, where
    src is C-contiguous (else None: the simulator runs the other path)."""
    if not src.flags.c_contiguous:
        return None
    return src[b, h].reshape(-1)[r * src.shape[3] + x:]


@cuda.jit(device=True, inline=True)
def _rows_cuda(src, b, h, r, x):
    """rows_from for the CUDA compiler: row r's 1-d view from column x on, whose index k d reaches (r + k, x)
    (Numba does not check a view's bounds, and a C-contiguous slab's rows are d elements apart)."""
    return src[b, h, r][x:]


#: rows_from(src, b, h, r, x): where src is C-contiguous (`not warp.strided(src)`, compile-time on the GPU), a
#: line whose element k d is src[b, h, r + k, x], so that a thread reading down a column indexes it at
#: compile-time offsets (immediate offsets of its loads) instead of a run-time stride per load. Pass it only
#: r < src.shape[2] and x < src.shape[3].
rows_from = _rows_python if backend.name() == "simulator" else _rows_cuda


def _per_thread(total: int, threads: int) -> int:
    """Steps for `threads` threads to cover `total` elements, one element per thread per step."""
    return -(-total // threads)


def chunked(fetch, put, steps, chunk):
    """load(src, b, h, row0, rows, smem, off, tid): the tile chunk by chunk, a chunk's loads in flight, then
    its stores. The chunks are written out (generated source: a few lines of fetch and put calls, each first
    a compile-time constant): a loop over them stayed rolled where a chunk's body is large (16-bit inputs at
    d = 256), and its run-time first left every bound check and conversion in the loop: 14 load waits for
    V's 16 loads a chunk, 53 branches, v2 d = 256 float16."""
    calls = "".join(f"    fetch(src, b, h, row0, rows, values, tid, {first})\n"
                    f"    put(values, smem, off, tid, {first})\n" for first in range(0, steps, chunk))
    namespace = {"fetch": fetch, "put": put, "cuda": cuda, "float32": float32, "CHUNK": chunk,
                 "__name__": __name__}  # the function's module: this one
    exec("def load(src, b, h, row0, rows, smem, off, tid):\n"  # our own text: the chunks' calls
         f"    values = cuda.local.array(CHUNK, float32)\n{calls}", namespace)
    return cuda.jit(device=True, inline=True)(namespace["load"])


def make_loaders(layout: Layout):
    """(load_q, load_kv): the layout's tile loaders (module docstring), device functions inlined by the caller."""
    BR, BC, D, T = layout.block_q, layout.block_k, layout.d_pad, layout.threads
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
            through a line from the thread's first row instead (kernels.tile_loads.rows_from), whose steps are
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

    return load_q, load_kv


def row_tile_loader(W: int, D: int, stride: int, T: int, HD: int, in_flight: int):
    """load(src, b, h, row0, rows, smem, off, tid): the backward's tiles (Q, dO, K, V): rows row0 .. row0 + W - 1
    of src, D features wide, row-major into smem, element (r, x) at off + r stride + x; rows past `rows` and
    features past HD (the operand's own head dim) are zeros, never read. Consecutive threads take consecutive
    features (coalesced reads, consecutive banks), STEPS elements a thread in chunks of at most in_flight loads
    (`chunked`).

    Where T divides D or D divides T, a step's tile row and feature are compile-time offsets from the thread's
    first (no division per element); where also D = HD and src is C-contiguous, the tile's rows lie end to end
    in HBM and each load is a compile-time offset along one line from the tile's first row (`rows_from`). Else
    each element takes the 4-d index (a strided view, or padding features)."""
    STEPS = _per_thread(W * D, T)
    CHUNK = min(STEPS, in_flight)
    RAGGED = (W * D) % T != 0  # a step can fall past the tile: checked; else compiled out
    UNPADDED = D == HD

    @cuda.jit(device=True, inline=True)
    def place(tid, step):
        """(r, x): the tile row and feature of the thread's step-th element, tid + step T in row-major order."""
        if T % D == 0:
            return tid // D + step * (T // D), tid % D
        if D % T == 0:
            return (step * T) // D, (step * T) % D + tid
        idx = tid + step * T
        r = idx // D
        return r, idx - r * D

    @cuda.jit(device=True, inline=True)
    def fetch(src, b, h, row0, rows, values, tid, first):
        flat = UNPADDED and not warp.strided(src)  # a compile-time constant on the GPU
        run = rows_from(src, b, h, u64(row0), u64(0))
        left = rows * HD - tid  # the tile's elements from the thread's first on
        for i in range(CHUNK):
            step = first + i
            r, x = place(tid, step)
            value = ZERO
            if step < STEPS and (not RAGGED or tid + step * T < W * D):
                if flat:
                    if step * T < left:  # r < rows
                        value = to_f32(run[u64(tid + step * T)])
                elif r < rows and (UNPADDED or x < HD):
                    value = to_f32(src[b, h, u64(row0 + r), u64(x)])
            values[i] = value

    @cuda.jit(device=True, inline=True)
    def put(values, smem, off, tid, first):
        for i in range(CHUNK):
            step = first + i
            r, x = place(tid, step)
            if step < STEPS and (not RAGGED or tid + step * T < W * D):
                smem[u64(off + r * stride + x)] = values[i]

    return chunked(fetch, put, STEPS, CHUNK)
