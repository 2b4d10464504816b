"""Staging tiles of the tensor-core kernels into shared memory: plain loads (with the non-finite test the exact
path needs) or cp.async copies of 16-byte chunks, rows found by the shape for C-contiguous arrays and by the
strides for views (`warp.strided`), for any row width: the engine takes one set for Q_i and K_j (d) and, where
it differs, one for V_j (d_v). `aligned16` says whether an array's rows can be copied by cp.async at all.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fa_numba import warp


def stagers(D, DP, SQ, THREADS, CH, ITEM_SHIFT, ZERO_ELEM, store, nonfinite, nonfinite_staged):
    """(stage, stage_async, any_bad) of tiles whose rows hold D values, padded to DP and SQ apart in shared
    memory: make_ops takes one set for Q_i and K_j (d) and, where it differs, one for V_j (d_v)."""
    CHUNKS = DP // CH

    @cuda.jit(device=True, inline=True)
    def stage(src, b, h, r0, n, tile, rows):
        """tile[r SQ + x] = src[b, h, r0 + r, x] for r < rows, x < DP; zeros past N and past d. Returns whether
        a staged element is inf or NaN."""
        bad = False
        for idx in range(cuda.threadIdx.x, rows * DP, THREADS):
            r = idx // DP
            x = idx - r * DP
            val = ZERO_ELEM
            if r0 + r < n and x < D:
                val = src[b, h, r0 + r, x]
            store(tile, r * SQ + x, val)
            bad = bad or nonfinite(val)
        return bad

    @cuda.jit(device=True, inline=True)
    def stage_async(src, b, h, r0, n, tile, rows):
        """Issue the copies of the same tile by cp.async, 16 bytes (CH elements) a copy, rows past N zero-filled
        (d % CH == 0 here, so a row is whole chunks, and d < x < DP is a whole zero chunk): no element passes
        through a register. The caller commits and waits (one round trip for all the copies it issued) and its
        barrier makes them visible to the block. `rows` is a constant at every call, so the trip count is one
        too and the loop unrolls: no remainder loop, and a guard only where the copies do not divide evenly.
        Rows are found by src's strides, so a strided view with a unit-stride last axis (a (B, N, H, d) tensor's
        transpose) is read where it is; each stride a multiple of 16 bytes (MmaKernel checks it)."""
        if warp.strided(src):  # a compile-time constant: one of the two forms is compiled
            # strides in bytes, multiples of the element's: a shift by a constant (src.itemsize would be read
            # at run time, and `//` by it is a 64-bit division routine)
            base = b * (src.strides[0] >> ITEM_SHIFT) + h * (src.strides[1] >> ITEM_SHIFT)
            s_row = src.strides[2] >> ITEM_SHIFT
        else:  # C-contiguous: rows D apart, by the shape (no strides held in registers)
            base = (b * src.shape[1] + h) * src.shape[2] * D
            s_row = D
        total = rows * CHUNKS
        for step in range((total + THREADS - 1) // THREADS):
            idx = cuda.threadIdx.x + step * THREADS
            if total % THREADS == 0 or idx < total:
                r = idx // CHUNKS
                x = CH * (idx - r * CHUNKS)
                row = min(r0 + r, n - 1)  # a valid address even where nothing is read
                nbytes = 16 if (r0 + r < n and x < D) else 0
                warp.cp_async16(tile, r * SQ + x, src, base + row * s_row + min(x, D - CH), nbytes)

    @cuda.jit(device=True, inline=True)
    def any_bad(tile, rows):
        """Whether a staged element (this thread's share of them) is inf or NaN."""
        bad = False
        for idx in range(cuda.threadIdx.x, rows * DP, THREADS):
            r = idx // DP
            bad = bad or nonfinite_staged(tile[r * SQ + idx - r * DP])
        return bad

    return stage, stage_async, any_bad


def aligned16(x) -> bool:
    """A device array whose rows all start on a 16-byte boundary: its data pointer and its strides but the
    last (which is one element) multiples of 16 bytes, as cp.async's 16-byte copies need (an axis of size 1
    is only ever indexed at 0: its stride does not matter)."""
    face = getattr(x, "__cuda_array_interface__", None)
    start = face["data"][0] if face is not None else np.asarray(getattr(x, "_ary", x)).ctypes.data
    return start % 16 == 0 and all(stride % 16 == 0 for n, stride in zip(tuple(x.shape)[:-1], tuple(x.strides)[:-1])
                                   if n > 1)


__all__ = ["aligned16", "stagers"]
