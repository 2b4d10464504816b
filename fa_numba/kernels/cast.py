"""Casting a float32 result on the device to a 16-bit type, for Numba device arrays (`arrays.cast`: torch and
CuPy results are cast by their own library, NumPy results by NumPy); the C-contiguous copy of a strided
4-D device array (`contiguous_copy`), for the kernels that do not read strides (api._prepare); and a copy
with another last axis (`resized_copy`): zeros appended, or the tail cut, for a value head dim d_v != d
(api: the kernels take one head dim, so the narrower operands are padded with zeros, which is exact).

- float16: round to nearest even (Numba's float32 -> float16 conversion, cvt.rn.f16.f32 on a GPU).
- bfloat16: Numba has no bfloat16 type, so the result is its uint16 bits, as the kernels take bfloat16
  inputs: the float32 bits rounded to nearest even on the top 16 (u + 0x7FFF + bit 16 of u, shifted), a NaN
  the canonical quiet NaN 0x7FC0 (a NaN's low mantissa bits could otherwise round it into an infinity).
A grid-stride loop over the flattened array, 256 threads a block.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, uint16, uint32

from fa_numba import backend
from fa_numba.kernels import disk_cache

THREADS = 256
MAX_BLOCKS = 4096


@functools.lru_cache(maxsize=None)
def _kernels():
    @disk_cache.jit
    def to_f16(src, dst):
        start = cuda.grid(1)
        for i in range(start, src.size, cuda.gridsize(1)):
            dst[i] = src[i]  # the store converts: float32 -> float16, round to nearest even

    @disk_cache.jit
    def to_bf16_bits(bits, dst):
        start = cuda.grid(1)
        for i in range(start, bits.size, cuda.gridsize(1)):
            u = bits[i]
            if (u & uint32(0x7F800000)) == uint32(0x7F800000) and (u & uint32(0x007FFFFF)) != 0:
                dst[i] = uint16(0x7FC0 | ((u >> 16) & 0x8000))  # NaN, its sign kept
            else:
                dst[i] = uint16((u + uint32(0x7FFF) + ((u >> 16) & uint32(1))) >> 16)

    @disk_cache.jit
    def copy4(src, dst):  # unsigned-integer views: a bit copy, 0 is +0.0 in every float type
        start = cuda.grid(1)
        n1, n2, n3 = dst.shape[1], dst.shape[2], dst.shape[3]
        width = src.shape[3]
        for i in range(start, dst.size, cuda.gridsize(1)):
            e = i % n3
            r = (i // n3) % n2
            h = (i // (n3 * n2)) % n1
            b = i // (n3 * n2 * n1)
            if e < width:
                dst[b, h, r, e] = src[b, h, r, e]
            else:
                dst[b, h, r, e] = 0

    return to_f16, to_bf16_bits, copy4


def contiguous_copy(x, stream=0):
    """A new C-contiguous device array with the values of the 4-D device array x (any strides), on `stream`:
    what `.contiguous()` is for a torch tensor, for a Numba device array (one read and one write of x)."""
    out = cuda.device_array(tuple(x.shape), dtype=x.dtype, stream=stream)
    resized_copy(x, out, stream=stream)
    return out


BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def resized_copy(src, dst, stream=0) -> None:
    """dst[..., e] = src[..., e] for e < the narrower last axis, dst[..., e] = 0 beyond src's: two 4-D device
    arrays of one dtype that differ at most in their last axis, src any strides, on `stream` (bits copied as
    they are: a NaN's payload and -0.0 stay; one read of what dst keeps and one write of dst)."""
    for name, x in (("src", src), ("dst", dst)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be a 4-D device array, got shape {tuple(x.shape)}")
    if tuple(src.shape[:3]) != tuple(dst.shape[:3]) or src.dtype != dst.dtype:
        raise ValueError(f"src and dst must share their first three axes and dtype, got {tuple(src.shape)} "
                         f"{src.dtype} and {tuple(dst.shape)} {dst.dtype}")
    if dst.size:
        bits = BITS[np.dtype(dst.dtype).itemsize]
        blocks = min(MAX_BLOCKS, -(-dst.size // THREADS))
        with backend.serialised(THREADS):
            _kernels()[2][blocks, THREADS, stream](src.view(bits), dst.view(bits))


def cast_device(result, name: str, stream=0):
    """A new device array: the float32 device array `result` as float16 (name "float16") or as the uint16 bits
    of bfloat16 (name "bfloat16"), same shape, on `stream`."""
    if np.dtype(result.dtype) != np.float32:
        raise TypeError(f"result must be a float32 device array, got {result.dtype}")
    if name not in ("float16", "bfloat16"):
        raise ValueError(f"name must be 'float16' or 'bfloat16', got {name!r}")
    to_f16, to_bf16_bits, _ = _kernels()
    flat = result.reshape(result.size)
    out = cuda.device_array(result.size, dtype=np.float16 if name == "float16" else np.uint16, stream=stream)
    if result.size:
        blocks = min(MAX_BLOCKS, -(-result.size // THREADS))
        with backend.serialised(THREADS):
            if name == "float16":
                to_f16[blocks, THREADS, stream](flat, out)
            else:
                to_bf16_bits[blocks, THREADS, stream](flat.view(np.uint32), out)
    return out.reshape(result.shape)
