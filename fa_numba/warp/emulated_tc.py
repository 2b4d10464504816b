"""The tensor-core operations of `fa_numba.warp.ptx` (mma.sync, ldmatrix, cp.async, packs, ex2), emulated
for the CUDA simulator on top of `emulation`'s warp exchange.

Each function has the signature of its PTX twin: fragments are tuples of 4 or 2 per-lane values (np.uint32
holding two 16-bit values or one tf32, np.float32 accumulators); shared-memory operands are (array, element
index). The fragment tables (PTX ISA "Matrix fragments for mma.m16n8k16" and "mma.m16n8k8", "ldmatrix"),
with g = lane >> 2 and t = lane & 3:

    m16n8k16 A (16x16, f16/bf16)  a0 = A[g][2t:2t+2]  a1 = A[g+8][2t:2t+2]  a2 = A[g][2t+8:2t+10]  a3 = A[g+8][2t+8:..]
    m16n8k16 B (16x8)             b0 = B[2t:2t+2][g]  b1 = B[2t+8:2t+10][g]
    m16n8k8  A (16x8, tf32)       a0 = A[g][t]  a1 = A[g+8][t]  a2 = A[g][t+4]  a3 = A[g+8][t+4]
    m16n8k8  B (8x8, tf32)        b0 = B[t][g]  b1 = B[t+4][g]
    C and D (16x8, f32)           c0 = C[g][2t]  c1 = C[g][2t+1]  c2 = C[g+8][2t]  c3 = C[g+8][2t+1]

A register of two 16-bit values holds the lower index in its low half. ldmatrix .x{1,2,4}: lanes 8m .. 8m+7
give the row addresses of matrix m; lane l receives, in register m, row g's elements 2t and 2t+1 of matrix m
(with .trans: the elements [2t][g] and [2t+1][g], i.e. matrix m transposed).
"""

from __future__ import annotations

import threading

import numpy as np

from fa_numba.warp.emulation import WarpDivergence, _lane_exchange

_L = np.arange(32)
_G, _T = _L >> 2, _L & 3


def _u32(values) -> np.ndarray:
    return np.array([int(v) & 0xFFFFFFFF for v in values], dtype=np.uint32)


def _halves_f16(u: np.ndarray) -> np.ndarray:  # uint32[...] -> float64[..., 2]: (low half, high half)
    return u.astype("<u4").view("<f2").reshape(u.shape + (2,)).astype(np.float64)


def _halves_bf16(u: np.ndarray) -> np.ndarray:
    lo = ((u & 0xFFFF) << 16).astype(np.uint32).view(np.float32)
    hi = (u & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.stack([lo, hi], axis=-1).astype(np.float64)


def _accumulator(vals) -> np.ndarray:
    c = np.array([v[0] for v in vals], dtype=np.float32)  # (32, 4)
    C = np.zeros((16, 8), np.float64)
    for e in range(2):
        C[_G, 2 * _T + e] = c[:, e]
        C[_G + 8, 2 * _T + e] = c[:, 2 + e]
    return C


def _fragments(D: np.ndarray) -> list:
    """Every lane's D fragment of the 16 x 8 result, rounded once to float32 (exact products and sums: an
    assumption, see the module docstring)."""
    D = D.astype(np.float32)
    frags = np.stack([D[_G, 2 * _T], D[_G, 2 * _T + 1], D[_G + 8, 2 * _T], D[_G + 8, 2 * _T + 1]], axis=1)
    return [tuple(row) for row in frags]


def _check_fragments(op: str, c, a, b, na: int) -> None:
    if len(c) != 4 or len(a) != na or len(b) != 2:
        raise TypeError(f"{op}: expected fragments c of 4 float32, a of {na} and b of 2 uint32; got "
                        f"{len(c)}, {len(a)}, {len(b)}")


def _mma16816(op: str, c, a, b, halves) -> tuple:
    _check_fragments(op, c, a, b, 4)

    def product(vals):
        a_h = halves(_u32([x for v in vals for x in v[1]]).reshape(32, 4))  # (32, 4, 2)
        b_h = halves(_u32([x for v in vals for x in v[2]]).reshape(32, 2))  # (32, 2, 2)
        A = np.zeros((16, 16), np.float64)
        B = np.zeros((16, 8), np.float64)
        for e in range(2):
            A[_G, 2 * _T + e] = a_h[:, 0, e]
            A[_G + 8, 2 * _T + e] = a_h[:, 1, e]
            A[_G, 2 * _T + 8 + e] = a_h[:, 2, e]
            A[_G + 8, 2 * _T + 8 + e] = a_h[:, 3, e]
            B[2 * _T + e, _G] = b_h[:, 0, e]
            B[2 * _T + 8 + e, _G] = b_h[:, 1, e]
        return _fragments(A @ B + _accumulator(vals))

    frags, lane = _lane_exchange(op, (tuple(c), tuple(a), tuple(b)), full=True, combine=product)
    return frags[lane]


def mma_f16(c, a, b):
    """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: this lane's D fragment of A B + C."""
    return _mma16816("mma_f16", c, a, b, _halves_f16)


def mma_bf16(c, a, b):
    """mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32."""
    return _mma16816("mma_bf16", c, a, b, _halves_bf16)


def mma_tf32(c, a, b):
    """mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32; the low 13 bits of each operand are ignored."""
    _check_fragments("mma_tf32", c, a, b, 4)

    def product(vals):
        av = (_u32([x for v in vals for x in v[1]]).reshape(32, 4) & 0xFFFFE000).view(np.float32).astype(np.float64)
        bv = (_u32([x for v in vals for x in v[2]]).reshape(32, 2) & 0xFFFFE000).view(np.float32).astype(np.float64)
        A = np.zeros((16, 8), np.float64)
        B = np.zeros((8, 8), np.float64)
        A[_G, _T], A[_G + 8, _T], A[_G, _T + 4], A[_G + 8, _T + 4] = av[:, 0], av[:, 1], av[:, 2], av[:, 3]
        B[_T, _G], B[_T + 4, _G] = bv[:, 0], bv[:, 1]
        return _fragments(A @ B + _accumulator(vals))

    frags, lane = _lane_exchange("mma_tf32", (tuple(c), tuple(a), tuple(b)), full=True, combine=product)
    return frags[lane]


# ---- ldmatrix ------------------------------------------------------------------------------------------------
def _ndarray(a) -> np.ndarray:
    return np.asarray(getattr(a, "_ary", a))


def _byte_offset(op: str, ary: np.ndarray, index, align: int) -> int:
    offset = int(index) * ary.itemsize
    if offset % align or ary.ctypes.data % align:
        raise ValueError(f"{op}: element {int(index)} of a {ary.dtype} array is not {align}-byte aligned "
                         f"(the hardware requires it)")
    if not 0 <= offset <= ary.nbytes - align:
        raise IndexError(f"{op}: element {int(index)} is outside the shared array of {ary.size} elements")
    return offset


def _record(smem, kind: str, byte_offset, width: int) -> None:
    """Log this lane's part of a warp operation when `smem` is a traced shared array (kernels.smem_trace's
    TracedArray: it carries `_trace`, `_site` and its `_offset` in the base array; the tracer's module
    docstring says how it is priced); nothing for any other array. byte_offset None: the lane reads nothing."""
    trace = getattr(smem, "_trace", None)
    if trace is not None:
        offset = None if byte_offset is None else smem._offset + byte_offset
        trace.record((smem._site, kind, offset, width))


def _ldmatrix(op: str, smem, index, num: int, trans: bool) -> tuple:
    ary = _ndarray(smem).reshape(-1)
    lane = threading.current_thread().thread_id % 32
    _record(smem, "matrix", int(index) * ary.itemsize if lane < 8 * num else None, 16)

    def load(vals):
        halves = ary.view(np.uint16).astype(np.uint32)
        out = np.zeros((32, num), np.uint32)
        for m in range(num):
            rows = np.array([_byte_offset(op, ary, vals[8 * m + r], 16) // 2 for r in range(8)])  # lanes 8m + r
            if trans:  # lane (g, t): M[2t][g], M[2t + 1][g]
                lo, hi = halves[rows[2 * _T] + _G], halves[rows[2 * _T + 1] + _G]
            else:  # lane (g, t): M[g][2t], M[g][2t + 1]
                lo, hi = halves[rows[_G] + 2 * _T], halves[rows[_G] + 2 * _T + 1]
            out[:, m] = lo | (hi << 16)
        return [tuple(row) for row in out]

    frags, lane = _lane_exchange(op, int(index), full=True, combine=load)
    return frags[lane]


def ldmatrix_x4(smem, index):
    """ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane l gives &smem[index], row l % 8 of matrix l // 8."""
    return _ldmatrix("ldmatrix_x4", smem, index, 4, False)


def ldmatrix_x4_trans(smem, index):
    return _ldmatrix("ldmatrix_x4_trans", smem, index, 4, True)


def ldmatrix_x2(smem, index):
    """.x2: lanes 0-15 give the rows of two matrices; the other lanes' addresses are not read."""
    return _ldmatrix("ldmatrix_x2", smem, index, 2, False)


def ldmatrix_x2_trans(smem, index):
    return _ldmatrix("ldmatrix_x2_trans", smem, index, 2, True)


# ---- cp.async ------------------------------------------------------------------------------------------------
_pending = threading.local()  # per CUDA thread: the copies not yet committed, and the committed groups
# When a copy lands. The hardware lands it at some time between its issue and the wait for its group, so a
# kernel is right only if it is right at both ends: "wait" (the default) lands each at the wait, so a tile read
# before its wait reads the old bits; "issue" lands it at once, so a copy issued over a tile another read of
# this thread (or of a warp past the same barrier) still needs is seen. Tests set it (tests/test_mma_forward.py).
LAND_AT = "wait"


def _queue():
    if not hasattr(_pending, "open"):
        _pending.open, _pending.groups = [], []
    return _pending


def _memory(a) -> np.ndarray:
    """A global array as an address reaches it: its elements in memory order from its first one (what
    &gmem[gidx] is in PTX, the data pointer plus gidx elements). For a strided view (positive strides, as a
    (B, N, H, d) tensor's transpose, or 0 for a broadcast axis) that is the span of its buffer from its first
    element to its last."""
    ary = _ndarray(a)
    if ary.flags.c_contiguous or ary.size == 0:
        return ary.reshape(-1)
    if any(stride < 0 for stride in ary.strides):
        raise ValueError(f"cp_async16: a global array with strides {ary.strides} (negative strides are not read)")
    span = sum((n - 1) * stride for n, stride in zip(ary.shape, ary.strides)) // ary.itemsize + 1
    return np.lib.stride_tricks.as_strided(ary, shape=(span,), strides=(ary.itemsize,), writeable=False)


def strided(ary) -> bool:
    """Whether the array is not C-contiguous: what the compiled kernel's type says (`ptx.strided`)."""
    return not _ndarray(ary).flags.c_contiguous


def cp_async16(smem, sidx, gmem, gidx, nbytes):
    """cp.async.cg.shared.global [smem + sidx], [gmem + gidx], 16, nbytes: 16 bytes, of which the first
    `nbytes` come from global memory and the rest are zeros (nbytes = 0 reads nothing). gidx counts elements
    from gmem's first one in memory, whatever its strides (`_memory`)."""
    s, g = _ndarray(smem).reshape(-1), _memory(gmem)
    so = _byte_offset("cp_async16 (shared)", s, sidx, 16)
    nbytes = int(nbytes)
    if not 0 <= nbytes <= 16:
        raise ValueError(f"cp_async16: nbytes must be in 0..16, got {nbytes}")
    go = int(gidx) * g.itemsize
    if nbytes:
        if go % 16 or g.ctypes.data % 16:
            raise ValueError(f"cp_async16: global element {int(gidx)} is not 16-byte aligned")
        if not 0 <= go <= g.nbytes - nbytes:
            raise IndexError(f"cp_async16: global element {int(gidx)} + {nbytes} bytes is outside the array")
    _record(smem, "store", so, 16)  # the copy's shared-memory write, priced where it is issued
    if LAND_AT == "issue":
        _land(s, so, g, go, nbytes)
    else:
        _queue().open.append((s, so, g, go, nbytes))


def cp_async_commit():
    q = _queue()
    q.groups.append(q.open)
    q.open = []


def _land(s, so, g, go, nbytes) -> None:
    dst = s.view(np.uint8)
    dst[so:so + nbytes] = g.view(np.uint8)[go:go + nbytes]
    dst[so + nbytes:so + 16] = 0


def _wait_group(n: int) -> None:
    q = _queue()
    while len(q.groups) > n:
        for copy in q.groups.pop(0):
            _land(*copy)


def cp_async_wait_all():
    """cp.async.wait_group 0: this thread's committed copies have landed."""
    _wait_group(0)


def cp_async_wait_1():
    """cp.async.wait_group 1: all but this thread's newest committed group have landed."""
    _wait_group(1)


# ---- conversions ---------------------------------------------------------------------------------------------
def _bf16_bits(x) -> int:
    u = int(np.float32(x).view(np.uint32))
    if (u & 0x7F800000) == 0x7F800000 and u & 0x7FFFFF:
        return 0x7FFF  # cvt to bf16: a NaN becomes the canonical NaN
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF  # round to nearest even


def pack_f16x2(lo, hi):
    """cvt.rn.f16x2.f32 d, hi, lo: f16(lo) in the low half, f16(hi) in the high half."""
    with np.errstate(over="ignore"):
        return np.array([lo, hi], np.float32).astype(np.float16).view(np.uint32)[0]


def pack_bf16x2(lo, hi):
    """cvt.rn.bf16x2.f32 d, hi, lo."""
    return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))


def min_nan(a, b):
    """min.NaN.f32: the smaller of a and b as float32, a NaN if either is NaN."""
    a, b = np.float32(a), np.float32(b)
    if a != a or b != b:
        return np.float32(np.nan)
    return a if a < b else b


def max_nan(a, b):
    """max.NaN.f32: the larger of a and b as float32, a NaN if either is NaN."""
    a, b = np.float32(a), np.float32(b)
    if a != a or b != b:
        return np.float32(np.nan)
    return a if a > b else b


def to_tf32(x):
    """cvt.rn.tf32.f32: round to nearest, ties to even, to 10 mantissa bits (low 13 bits zero); a finite value
    that rounds past the largest tf32 becomes infinite; infinities and NaN pass as they are."""
    u = int(np.float32(x).view(np.uint32))
    if (u & 0x7F800000) == 0x7F800000:
        return np.uint32(u)
    keep_odd = (u >> 13) & 1  # the last kept bit: a tie rounds up only onto an even result
    return np.uint32((u + 0xFFF + keep_odd) & 0xFFFFE000)


def tf32_value(bits):
    """The float32 whose bits are `bits` (a tf32 is a float32 with its low 13 bits zero)."""
    return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)


_TINY = np.float32(2.0**-126)   # the smallest normal float32: below it ex2.approx.ftz flushes to zero


def ex2(x):
    """ex2.approx.ftz.f32: 2^x in float32, subnormal inputs and results flushed to zero.

    The ranges are decided before numpy is called, so that no floating-point warning can arise and no
    np.errstate context (about 4 us of the simulator's time per call; the tensor-core softmax calls this once
    per weight) is needed: x >= 128 overflows to inf, x < -126 gives a subnormal or zero result (flushed),
    |x| < 2^-126 is a subnormal input (flushed: 2^0 = 1); NaN stays NaN, -inf gives 0."""
    x = np.float32(x)
    if x != x:
        return x
    if -_TINY < x < _TINY:
        return np.float32(1.0)
    if x < -126.0:
        return np.float32(0.0)
    if x >= 128.0:
        return np.float32(np.inf)
    # in float64, then rounded: numpy's float32 exp2 is a SIMD kernel whose last bit depends on the CPU (one ulp
    # off 2^127.5 on one machine, exact on another); the hardware's ex2.approx is not correctly rounded either, but
    # the emulation must give one answer everywhere
    return np.float32(np.exp2(np.float64(x)))


__all__ = ["WarpDivergence", "mma_f16", "mma_bf16", "mma_tf32", "ldmatrix_x4", "ldmatrix_x4_trans", "ldmatrix_x2",
           "ldmatrix_x2_trans", "cp_async16", "cp_async_commit", "cp_async_wait_all", "cp_async_wait_1",
           "pack_f16x2", "pack_bf16x2", "to_tf32", "tf32_value", "ex2"]
