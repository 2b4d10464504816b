"""Masks inside a kernel's PARTIAL tiles, pair by pair, and the per-slice mask arrays (fa_numba.slice_masks).

    pair_visible(kmod)(dense, b, h, r, key, captured) -> bool

With a mask_mod compiled in (KernelMod.mask) it calls fn(b, h, r, key, *mask arrays), the mask arrays being the
captured tuple's entries after the score mod's (spelled out per count, like kernels.score_mod: an inlined
call takes no *args); otherwise it reads the dense byte mask, dense[r, key] != 0. Every kernel asks it only
inside a PARTIAL tile of a block mask and only for pairs already inside the row's interval [lo_r, hi_r), so fn
is never called at a pair past N_q or N_k, nor in a SKIP or FULL tile.

    mask_slice(x, b, h)

The kernel-mask arrays (kernels.block_lists.KernelMask) carry two leading axes (B_m, H_m), each 1 (one mask for
every batch or head) or the problem's: a block reads the view of its own (batch, query head), an axis of
length 1 broadcast. The views keep the rest of each kernel as it was for one (N_q, N_k) mask, at a price in
registers: a view made at the kernel's start holds its pointer, shape and strides in registers, where a
kernel argument's are re-read from the constant bank (block-mask kernels, float32, d = 64: v1-rowwise 94 to
134, bwd-kv with intervals 168 to 216; the kernels without a block mask are unchanged).
"""

from __future__ import annotations

import functools

from numba import cuda


@cuda.jit(device=True, inline=True)
def mask_slice(x, b, h):
    """The (b, h) slice of a per-slice mask array: x[b, h], an axis of length 1 broadcast."""
    return x[min(b, x.shape[0] - 1), min(h, x.shape[1] - 1)]


@cuda.jit(device=True, inline=True)
def _dense_pair(dense, b, h, r, key, captured):
    return dense[r, key] != 0


@functools.lru_cache(maxsize=None)
def mask_caller(f, offset: int, n: int):
    """call(b, h, i, j, captured) -> bool(f(b, h, i, j, captured[offset], ..., captured[offset + n - 1]))."""
    g = cuda.jit(device=True, inline=True)(f)
    a0, a1, a2, a3 = offset, offset + 1, offset + 2, offset + 3  # compile-time tuple indices
    if n == 0:
        def call(b, h, i, j, captured):
            return bool(g(b, h, i, j))
    elif n == 1:
        def call(b, h, i, j, captured):
            return bool(g(b, h, i, j, captured[a0]))
    elif n == 2:
        def call(b, h, i, j, captured):
            return bool(g(b, h, i, j, captured[a0], captured[a1]))
    elif n == 3:
        def call(b, h, i, j, captured):
            return bool(g(b, h, i, j, captured[a0], captured[a1], captured[a2]))
    else:
        def call(b, h, i, j, captured):
            return bool(g(b, h, i, j, captured[a0], captured[a1], captured[a2], captured[a3]))
    return cuda.jit(device=True, inline=True)(call)


@functools.lru_cache(maxsize=None)
def pair_visible(kmod):
    """visible(dense, b, h, r, key, captured) -> bool inside a PARTIAL tile (module docstring)."""
    if kmod is None or kmod.mask is None:
        return _dense_pair
    call = mask_caller(kmod.mask, len(kmod.captured), len(kmod.mask_captured))

    @cuda.jit(device=True, inline=True)
    def fn_pair(dense, b, h, r, key, captured):
        return call(b, h, r, key, captured)

    return fn_pair


__all__ = ["mask_caller", "mask_slice", "pair_visible"]
