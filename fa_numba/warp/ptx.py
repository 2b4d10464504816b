"""Tensor-core and warp operations for Numba CUDA kernels, as `@intrinsic`s that emit inline PTX.

numba-cuda has no tensor-core API, and libNVVM refuses the `llvm.nvvm.mma` names, so each operation here is
an llvmlite `ir.InlineAsm` call (the mechanism numba-cuda uses for its own cache hints). Fragments are Numba
values, UniTuples of float32 or uint32, so they stay in registers as long as a kernel keeps them in values or
in local arrays indexed by compile-time constants (`profile` checks: no LDL/STL). Shared-memory operands are
(array, element index): the array's generic data pointer is cast back to the shared window (address space 3)
and its 32-bit offset handed to PTX, which folds to a direct shared address after LTO
(../shared/tensor_cores/, the feasibility probe these follow).

The per-lane fragment layouts are in `emulated_tc`'s docstring and proofs/L10_fragments.md; the simulator runs
`emulated_tc` instead of these (the choice is made in `fa_numba.warp`). The shuffles are numba-cuda's own
`cuda.shfl_*_sync`: nothing of theirs is here.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

_f32, _u32 = types.float32, types.uint32
F4 = types.UniTuple(_f32, 4)
U4 = types.UniTuple(_u32, 4)
U2 = types.UniTuple(_u32, 2)
_I32, _I64, _FLOAT = ir.IntType(32), ir.IntType(64), ir.FloatType()

MMA = {
    "f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    "bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    "tf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
}
_MMA_OPERANDS = " {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"


def _elements(builder, tup, n):
    return [builder.extract_value(tup, i) for i in range(n)]


def _asm(builder, text, constraint, ret, args, side_effect=False):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(ir.InlineAsm(fnty, text, constraint, side_effect=side_effect), args)


def _make_mma(kind):
    text = MMA[kind] + _MMA_OPERANDS

    @intrinsic
    def mma(typingctx, c, a, b):
        if not (c == F4 and a == U4 and b == U2):
            return None

        def codegen(context, builder, sig, args):
            ret = ir.LiteralStructType([_FLOAT] * 4)
            ops = _elements(builder, args[1], 4) + _elements(builder, args[2], 2) + _elements(builder, args[0], 4)
            res = _asm(builder, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", ret, ops)
            return cgutils.pack_array(builder, _elements(builder, res, 4))

        return F4(F4, U4, U2), codegen

    mma.__doc__ = f"d = {MMA[kind]}(c: 4 x float32, a: 4 x uint32, b: 2 x uint32) -> 4 x float32"
    return mma


mma_f16 = _make_mma("f16")
mma_bf16 = _make_mma("bf16")
mma_tf32 = _make_mma("tf32")


def _shared_address(context, builder, aryty, ary_val, index):
    """The 32-bit shared-window address of ary.flat[index] (a cuda.shared.array)."""
    ary = context.make_array(aryty)(context, builder, ary_val)
    ptr = builder.gep(ary.data, [index])
    shared = ir.PointerType(ptr.type.pointee, 3) if hasattr(ptr.type, "pointee") else ir.PointerType(addrspace=3)
    return builder.ptrtoint(builder.addrspacecast(ptr, shared), _I32)


def _make_ldmatrix(num, trans):
    regs = ",".join(f"${i}" for i in range(num))
    text = f"ldmatrix.sync.aligned.m8n8.x{num}{'.trans' if trans else ''}.shared.b16 {{{regs}}}, [${num}];"
    tuple_type = types.UniTuple(_u32, num)

    @intrinsic
    def ldmatrix(typingctx, smem, index):
        if not isinstance(smem, types.Array) or not isinstance(index, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            addr = _shared_address(context, builder, sig.args[0], args[0], args[1])
            res = _asm(builder, text, "=r," * num + "r,~{memory}", ir.LiteralStructType([_I32] * num), [addr],
                       side_effect=True)
            return cgutils.pack_array(builder, _elements(builder, res, num))

        return tuple_type(smem, index), codegen

    ldmatrix.__doc__ = f"{text.split(' ')[0]}: lane l gives &smem[index] of row l % 8 of matrix l // 8"
    return ldmatrix


ldmatrix_x4 = _make_ldmatrix(4, False)
ldmatrix_x4_trans = _make_ldmatrix(4, True)
ldmatrix_x2 = _make_ldmatrix(2, False)
ldmatrix_x2_trans = _make_ldmatrix(2, True)


@intrinsic
def cp_async16(typingctx, smem, sidx, gmem, gidx, nbytes):
    """cp.async.cg.shared.global [&smem[sidx]], [&gmem[gidx]], 16, nbytes: 16 bytes global -> shared (both
    16-byte aligned), of which the first `nbytes` are read and the rest zero-filled (0 reads nothing)."""
    if not isinstance(nbytes, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        saddr = _shared_address(context, builder, sig.args[0], args[0], args[1])
        gary = context.make_array(sig.args[2])(context, builder, args[2])
        gaddr = builder.ptrtoint(builder.gep(gary.data, [args[3]]), _I64)
        n = context.cast(builder, args[4], sig.args[4], types.uint32)
        _asm(builder, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}", ir.VoidType(),
             [saddr, gaddr, n], side_effect=True)
        return context.get_dummy_value()

    return types.void(smem, sidx, gmem, gidx, nbytes), codegen


def _void(text, doc):
    @intrinsic
    def fn(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, text, "~{memory}", ir.VoidType(), [], side_effect=True)
            return context.get_dummy_value()

        return types.void(), codegen

    fn.__doc__ = doc
    return fn


cp_async_commit = _void("cp.async.commit_group;", "cp.async.commit_group: close this thread's open copies")
cp_async_wait_all = _void("cp.async.wait_group 0;", "cp.async.wait_group 0: all committed groups have landed")
cp_async_wait_1 = _void("cp.async.wait_group 1;", "cp.async.wait_group 1: all but the newest group have landed")


def _two_floats(text, result, result_ir, constraint, swap=False):
    """An intrinsic op(a, b) of two float32 operands emitting `text` ($1, $2: a, b, or b, a where swap)."""
    @intrinsic
    def op(typingctx, a, b):
        def codegen(context, builder, sig, args):
            a_v = context.cast(builder, args[0], sig.args[0], _f32)
            b_v = context.cast(builder, args[1], sig.args[1], _f32)
            return _asm(builder, text, constraint, result_ir, [b_v, a_v] if swap else [a_v, b_v])

        return result(a, b), codegen

    return op


def _make_pack(kind):
    text = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"  # the first source goes to the upper half
    pack = _two_floats(text, _u32, _I32, "=r,f,f", swap=True)  # pack(lo, hi)
    pack.__doc__ = f"{text.split(' ')[0]}: {kind}(lo) in the low half, {kind}(hi) in the high half"
    return pack


pack_f16x2 = _make_pack("f16")
pack_bf16x2 = _make_pack("bf16")


@intrinsic
def to_tf32(typingctx, x):
    """cvt.rn.tf32.f32: x rounded to tf32 (nearest, ties to even), as the bits of a float32. sm_90's one
    instruction for it (F2FP.TF32.F32); cvt.rna (ties away, what this was until 2026-12-05) has none there and
    compiles to three (a NaN test, an add of half a unit, a mask), which the 3xTF32 split pays twice a value."""
    def codegen(context, builder, sig, args):
        x_v = context.cast(builder, args[0], sig.args[0], _f32)
        return _asm(builder, "cvt.rn.tf32.f32 $0, $1;", "=r,f", _I32, [x_v])

    return _u32(x), codegen


@intrinsic
def tf32_value(typingctx, bits):
    """The float32 whose bits are `bits` (a bit cast: no instruction)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], _u32), _FLOAT)

    return _f32(bits), codegen


@intrinsic
def strided(typingctx, ary):
    """Whether `ary` is typed as anything but C-contiguous (a strided view: layout "A" or "F"), as a constant
    i1: a kernel's `if warp.strided(src):` keeps one branch per compilation, the other folded away (no
    instruction; cp.async's row addresses by shape for C-contiguous arrays, by strides for views)."""
    if not isinstance(ary, types.Array):
        return None
    flag = ary.layout != "C"

    def codegen(context, builder, sig, args):
        return ir.Constant(ir.IntType(1), int(flag))

    return types.boolean(ary), codegen


def _make_nan_extreme(op):
    extreme = _two_floats(f"{op}.NaN.f32 $0, $1, $2;", _f32, _FLOAT, "=f,f,f")
    extreme.__doc__ = (f"{op}.NaN.f32 (sm_80): the {op}imum of two float32, NaN if either is NaN (the plain {op} and "
                       f"Python's {op} drop a NaN); one FMNMX.NAN")
    return extreme


min_nan = _make_nan_extreme("min")
max_nan = _make_nan_extreme("max")


@intrinsic
def ex2(typingctx, x):
    """ex2.approx.ftz.f32: 2^x in one MUFU.EX2 (math.exp2 adds a range test and two FMULs)."""
    def codegen(context, builder, sig, args):
        x_v = context.cast(builder, args[0], sig.args[0], _f32)
        return _asm(builder, "ex2.approx.ftz.f32 $0, $1;", "=f,f", _FLOAT, [x_v])

    return _f32(x), codegen
