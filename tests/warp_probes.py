"""One-warp probe kernels of the warp primitives (fa_numba.warp), as plain functions.

test_warp.py launches them with cuda.jit (in the simulator, or on a GPU when there is one) and checks what
they return against tests/fragments.py, the host-side reading of the PTX ISA; run as a script in a process
with the real numba.cuda (NUMBA_ENABLE_CUDASIM=0), this compiles each for sm_90a through the launch path and
prints the opcodes of its SASS as JSON (test_warp's SASS test reads it).
Every probe is launched as one block of 32 threads: lane = threadIdx.x.
"""

import json
import os
import sys

if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

from fa_numba import warp  # noqa: E402  (first: fa_numba chooses the backend before numba.cuda is imported)
from numba import cuda, types, uint16  # noqa: E402

SMEM = 1024  # 16-bit elements of the probes' shared memory (2 KB)


def _mma_probe(product):
    """A probe of one mma: lane l's fragments a[l], b[l], c[l] in, its D fragment out[l]."""
    def probe(a, b, c, out):
        lane = cuda.threadIdx.x
        d = product((c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3]),
                    (a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3]), (b[lane, 0], b[lane, 1]))
        for i in range(4):
            out[lane, i] = d[i]

    return probe


mma_f16_probe = _mma_probe(warp.mma_f16)
mma_bf16_probe = _mma_probe(warp.mma_bf16)
mma_tf32_probe = _mma_probe(warp.mma_tf32)


@cuda.jit(device=True, inline=True)
def _stage(mem, sm):
    """Every lane copies its share of mem into shared memory; then a barrier (all 32 threads reach it)."""
    for i in range(cuda.threadIdx.x, SMEM, 32):
        sm[i] = mem[i]
    cuda.syncthreads()


def _ldmatrix_probe(load, num):
    """A probe of one ldmatrix: mem staged in shared memory, lane l gives the address addr[l], out[l] its
    `num` registers."""
    def probe(mem, addr, out):
        sm = cuda.shared.array(SMEM, uint16)
        _stage(mem, sm)
        r = load(sm, addr[cuda.threadIdx.x])
        for i in range(num):
            out[cuda.threadIdx.x, i] = r[i]

    return probe


ldmatrix_x4_probe = _ldmatrix_probe(warp.ldmatrix_x4, 4)
ldmatrix_x4_trans_probe = _ldmatrix_probe(warp.ldmatrix_x4_trans, 4)
ldmatrix_x2_probe = _ldmatrix_probe(warp.ldmatrix_x2, 2)
ldmatrix_x2_trans_probe = _ldmatrix_probe(warp.ldmatrix_x2_trans, 2)


Q_AT, K_AT, V_AT, STRIDE = 0, 384, 576, 24  # qk_pv_probe's tiles in shared memory (16-bit elements)


def qk_pv_probe(mem, s_out, o_out):
    """The operand paths of an attention tile (proofs/L10, claims 2 to 4), from one shared array holding
    A: 16 x 16 at Q_AT (rows STRIDE apart), K: 8 keys x 16 at K_AT (rows STRIDE apart, as keys are stored),
    V: 16 keys x 8 at V_AT (rows 8 apart). s_out: A K^T, o_out: A V (A playing P), as D fragments."""
    sm = cuda.shared.array(SMEM, uint16)
    _stage(mem, sm)
    lane = cuda.threadIdx.x
    m, r = lane // 8, lane % 8  # this lane gives row r of matrix m
    a = warp.ldmatrix_x4(sm, Q_AT + (r + 8 * (m % 2)) * STRIDE + 8 * (m // 2))  # quadrants [A00, A10, A01, A11]
    bk = warp.ldmatrix_x2(sm, K_AT + r * STRIDE + 8 * (m % 2))  # key r: dims 0-7 (matrix 0), 8-15 (matrix 1)
    bv = warp.ldmatrix_x2_trans(sm, V_AT + (r + 8 * (m % 2)) * 8)  # keys 0-7 (matrix 0), 8-15 (matrix 1)
    zero = (types.float32(0), types.float32(0), types.float32(0), types.float32(0))
    s = warp.mma_f16(zero, a, bk)
    o = warp.mma_f16(zero, a, bv)
    for i in range(4):
        s_out[lane, i] = s[i]
        o_out[lane, i] = o[i]


def cp_async_probe(src, nbytes, out):
    """Lane l copies 16 bytes (its nbytes[l] of them, the rest zeros) of src[8l:] into shared memory, waits,
    and the block writes shared memory back out; shared memory starts at 0xFFFF so a zero fill is seen."""
    sm = cuda.shared.array(SMEM, uint16)
    for i in range(cuda.threadIdx.x, SMEM, 32):
        sm[i] = 0xFFFF
    cuda.syncthreads()
    lane = cuda.threadIdx.x
    warp.cp_async16(sm, 8 * lane, src, 8 * lane, nbytes[lane])
    warp.cp_async_commit()
    warp.cp_async_wait_all()
    cuda.syncthreads()  # every lane's copy has landed: all threads reach this barrier
    for i in range(lane, SMEM, 32):
        out[i] = sm[i]


def cp_async_groups_probe(src, first, out):
    """Two groups per lane (src[8l:] into shared [8l:], then src[256 + 8l:] into [256 + 8l:]); after
    wait_group 1 the first is read into `first`, after wait_group 0 everything into `out`."""
    sm = cuda.shared.array(SMEM, uint16)
    lane = cuda.threadIdx.x
    warp.cp_async16(sm, 8 * lane, src, 8 * lane, 16)
    warp.cp_async_commit()
    warp.cp_async16(sm, 256 + 8 * lane, src, 256 + 8 * lane, 16)
    warp.cp_async_commit()
    warp.cp_async_wait_1()
    cuda.syncthreads()
    for i in range(lane, 256, 32):
        first[i] = sm[i]
    warp.cp_async_wait_all()
    cuda.syncthreads()
    for i in range(lane, 512, 32):
        out[i] = sm[i]


def cp_async_no_wait_probe(src, out):
    """A copy that is never waited for: what shared memory holds then is not defined on the hardware."""
    sm = cuda.shared.array(SMEM, uint16)
    lane = cuda.threadIdx.x
    for i in range(lane, SMEM, 32):
        sm[i] = 0xFFFF
    cuda.syncthreads()
    warp.cp_async16(sm, 8 * lane, src, 8 * lane, 16)
    warp.cp_async_commit()
    cuda.syncthreads()
    for i in range(lane, SMEM, 32):
        out[i] = sm[i]


def conversions_probe(x, f16x2, bf16x2, tf32, tf32_back, exp2):
    """Per thread, no warp operation: the packs of (x[l, 0], x[l, 1]), x[l, 0] to tf32 and back, 2^x[l, 0]."""
    lane = cuda.threadIdx.x
    f16x2[lane] = warp.pack_f16x2(x[lane, 0], x[lane, 1])
    bf16x2[lane] = warp.pack_bf16x2(x[lane, 0], x[lane, 1])
    t = warp.to_tf32(x[lane, 0])
    tf32[lane] = t
    tf32_back[lane] = warp.tf32_value(t)
    exp2[lane] = warp.ex2(x[lane, 0])


def min_max_nan_probe(a, b, mins, maxs):
    """Per thread, no warp operation: min.NaN and max.NaN of (a[l], b[l])."""
    lane = cuda.threadIdx.x
    mins[lane] = warp.min_nan(a[lane], b[lane])
    maxs[lane] = warp.max_nan(a[lane], b[lane])


def shuffles_probe(vals, xor1, xor16, idx, up3, down5):
    lane = cuda.threadIdx.x
    v = vals[lane]
    xor1[lane] = cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
    xor16[lane] = cuda.shfl_xor_sync(0xFFFFFFFF, v, 16)
    idx[lane] = cuda.shfl_sync(0xFFFFFFFF, v, (lane * 7 + 3) % 32)
    up3[lane] = cuda.shfl_up_sync(0xFFFFFFFF, v, 3)
    down5[lane] = cuda.shfl_down_sync(0xFFFFFFFF, v, 5)


def _arrays(*specs):
    return tuple(types.Array(dtype, ndim, "C") for dtype, ndim in specs)


f32, u32, u16, i32 = types.float32, types.uint32, types.uint16, types.int32
SIGNATURES = {
    "mma_f16_probe": _arrays((u32, 2), (u32, 2), (f32, 2), (f32, 2)),
    "mma_bf16_probe": _arrays((u32, 2), (u32, 2), (f32, 2), (f32, 2)),
    "mma_tf32_probe": _arrays((u32, 2), (u32, 2), (f32, 2), (f32, 2)),
    "ldmatrix_x4_probe": _arrays((u16, 1), (i32, 1), (u32, 2)),
    "ldmatrix_x4_trans_probe": _arrays((u16, 1), (i32, 1), (u32, 2)),
    "ldmatrix_x2_probe": _arrays((u16, 1), (i32, 1), (u32, 2)),
    "ldmatrix_x2_trans_probe": _arrays((u16, 1), (i32, 1), (u32, 2)),
    "qk_pv_probe": _arrays((u16, 1), (f32, 2), (f32, 2)),
    "cp_async_probe": _arrays((u16, 1), (i32, 1), (u16, 1)),
    "cp_async_groups_probe": _arrays((u16, 1), (u16, 1), (u16, 1)),
    "conversions_probe": _arrays((f32, 2), (u32, 1), (u32, 1), (u32, 1), (f32, 1), (f32, 1)),
    "shuffles_probe": _arrays((i32, 1), (i32, 1), (i32, 1), (i32, 1), (i32, 1), (i32, 1)),
    "min_max_nan_probe": _arrays((f32, 1), (f32, 1), (f32, 1), (f32, 1)),
}


def main() -> int:
    """Compile every probe for sm_90a as a launch does; print {probe: {opcode: count, "registers": n, ...}}."""
    from fa_numba import profile, sass

    found = {}
    for name, argtypes in SIGNATURES.items():
        cubin, log, _ = profile.compile_for_launch(globals()[name], argtypes)
        instructions, _, _ = sass.parse_sass(profile.disassemble(cubin))
        counts = {}
        for inst in instructions:
            counts[inst.opcode] = counts.get(inst.opcode, 0) + 1
        found[name] = {"opcodes": counts, **profile.parse_ptxas(log)}
    json.dump(found, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
