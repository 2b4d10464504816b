"""The tensor-core products of 16-bit inputs (mma.sync m16n8k16, float16 or bfloat16): what `engine.make_ops`
takes for those kinds (the float32 kinds take `kernels.mma.tf32`'s). Q_i is staged in shared memory and its A
fragments read by ldmatrix x4, K's B fragments by ldmatrix x4 (two k-steps a load; x2 for an odd last one), V's by
ldmatrix x4 .trans (two 8-column blocks a load); P is packed to the input type in the lane that holds it
(proofs/L10, claim 5); the exact path reads the staged bits back as float32.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from numba import cuda, uint16, uint32

from fa_numba import backend, warp
from fa_numba.kernels.common import ZERO
from fa_numba.kernels.mma.tf32 import unrolled

_EXP_MASK = {"float16": 0x7C00, "bfloat16": 0x7F80}  # a 16-bit value is inf or NaN iff these bits are all set


def make_products(config, sizes: SimpleNamespace) -> SimpleNamespace:
    """The 16-bit engine's products (mma.sync m16n8k16): Q_i staged in shared memory and its A fragments read
    by ldmatrix x4, K's B fragments by ldmatrix x4 (x2 for an odd last k-step), V's by ldmatrix x4 .trans, P
    packed to the input type in the lane that holds it (L10, claim 5)."""
    DP, SQ, KS, NT, RB = sizes.DP, sizes.SQ, sizes.KS, sizes.NT, sizes.RB
    DNV, SV = sizes.DNV, sizes.SV  # O's blocks and V_j's row stride: V's head dim d_v
    PK = sizes.BC // 16  # k-steps of P V
    EXP_MASK = _EXP_MASK[config.kind]
    mma = warp.mma_f16 if config.kind == "float16" else warp.mma_bf16
    pack = warp.pack_f16x2 if config.kind == "float16" else warp.pack_bf16x2
    to_f32 = _to_f32_function(config.kind)
    ZERO16 = uint16(0)

    @cuda.jit(device=True, inline=True)
    def nonfinite(bits):
        return (bits & EXP_MASK) == EXP_MASK  # a 16-bit value is inf or NaN iff its exponent bits are all set

    @cuda.jit(device=True, inline=True)
    def store(tile, index, bits):
        tile[index] = bits

    @cuda.jit(device=True, inline=True)
    def settle(tile, rows):
        return False  # a staged 16-bit tile is what the products read

    @cuda.jit(device=True, inline=True)
    def value(tile, index):
        return to_f32(tile[index])

    @cuda.jit(device=True, inline=True)
    def score_step(ks, s, sq, sk, top, key):
        """k-step ks of S for two row blocks: their Q fragments (ldmatrix x4 at `top`, the row block's first
        row) and each key block's K fragment (ldmatrix x2 at `key`), each feeding both row blocks' products."""
        a0 = warp.ldmatrix_x4(sq, top + 16 * ks)
        a1 = warp.ldmatrix_x4(sq, top + 16 * SQ + 16 * ks)
        for nt in range(NT):
            bk = warp.ldmatrix_x2(sk, key + 8 * nt * SQ + 16 * ks)
            d4 = mma((s[nt, 0], s[nt, 1], s[nt, 2], s[nt, 3]), a0, bk)
            u4 = mma((s[NT + nt, 0], s[NT + nt, 1], s[NT + nt, 2], s[NT + nt, 3]), a1, bk)
            for e in range(4):
                s[nt, e] = d4[e]
                s[NT + nt, e] = u4[e]

    # the k-steps written out (tf32.unrolled): ptxas keeps a loop of this size rolled, a loop the tile's
    # products would then run through with a run-time k-step
    score_steps = unrolled(KS, score_step)

    @cuda.jit(device=True, inline=True)
    def q_fragments(q, b, h, r0, n_q, sq, qf, wid, mrow, mat):
        """This lane's A fragments of the staged Q_i (ldmatrix x4), kept in registers for the whole loop; with two
        row blocks a warp none (`scores` reads them from the staged Q_i at every tile, as FlashAttention-2 does:
        32 more registers would spill)."""
        if RB == 1:
            for ks in range(KS):
                a = warp.ldmatrix_x4(sq, (16 * wid + mrow + 8 * (mat & 1)) * SQ + 16 * ks + 8 * (mat >> 1))
                for e in range(4):
                    qf[ks, e] = a[e]

    @cuda.jit(device=True, inline=True)
    def scores(qf, s, sk, mrow, mat, sq, wid):
        """s[R' NT + nt, e] = this lane's entries of Q_i K_j^T (unscaled) in row block R' (RB of them)."""
        if RB == 1:
            for nt in range(NT):
                d4 = (ZERO, ZERO, ZERO, ZERO)
                for kp in range(KS // 2):  # two k-steps' B fragments (matrices 0-1, then 2-3) per ldmatrix x4
                    ks = 2 * kp
                    bk = warp.ldmatrix_x4(sk, (8 * nt + mrow) * SQ + 16 * ks + 8 * mat)
                    d4 = mma(d4, (qf[ks, 0], qf[ks, 1], qf[ks, 2], qf[ks, 3]), (bk[0], bk[1]))
                    d4 = mma(d4, (qf[ks + 1, 0], qf[ks + 1, 1], qf[ks + 1, 2], qf[ks + 1, 3]), (bk[2], bk[3]))
                if KS % 2:  # an odd last k-step (d = 48, 80, ...): ldmatrix x2
                    ks = KS - 1
                    bk = warp.ldmatrix_x2(sk, (8 * nt + mrow) * SQ + 16 * ks + 8 * (mat & 1))
                    d4 = mma(d4, (qf[ks, 0], qf[ks, 1], qf[ks, 2], qf[ks, 3]), bk)
                for e in range(4):
                    s[nt, e] = d4[e]
        else:  # two row blocks: k-steps outer, each Q fragment read once and each K fragment feeding two products
            for x in range(2 * NT):
                for e in range(4):
                    s[x, e] = ZERO
            top = (32 * wid + mrow + 8 * (mat & 1)) * SQ + 8 * (mat >> 1)  # row block 0's ldmatrix address of Q_i
            score_steps(s, sq, sk, top, mrow * SQ + 8 * (mat & 1))

    product = fragments_times_staged(PK, DNV, SV, mma, pack, RB)

    @cuda.jit(device=True, inline=True)
    def pv(s, acc, sv, mrow, mat):
        """acc += P V_j, P rounded to the input type (L10, claim 5: P's A fragment for keys 16 kk .. 16 kk + 15),
        every row block's; each V_j fragment read feeds the products of every row block."""
        product(acc, s, sv, mrow, mat)

    @cuda.jit(device=True, inline=True)
    def key_dots(qf, sq, sk, c, qrow0, t):
        """Q_i K_j^T of rows qrow0, qrow0 + 8 (of the tile) with key c, in float32 from shared memory."""
        dot0, dot1 = ZERO, ZERO
        for x in range(DP):
            kx = to_f32(sk[c * SQ + x])
            dot0 += to_f32(sq[qrow0 * SQ + x]) * kx
            dot1 += to_f32(sq[(qrow0 + 8) * SQ + x]) * kx
        return dot0, dot1

    return SimpleNamespace(q_fragments=q_fragments, scores=scores, pv=pv, key_dots=key_dots, nonfinite=nonfinite,
                           nonfinite_staged=nonfinite, store=store, settle=settle, settles=False, value=value,
                           to_f32=to_f32, zero=ZERO16, element=uint16, fragment=uint32, fragment_width=4, chunk=8,
                           q_in_shared=True,
                           mma=mma, pack=pack)


def fragments_times_staged(k_steps: int, blocks: int, stride: int, mma, pack, row_blocks: int = 1):
    """The device function acc += X Y on the tensor cores, X's A fragments the warp's own float32 accumulator
    fragments (x: (2 k_steps, 4) in the C layout, 8 columns a block) rounded to 16 bits by `pack` where they are
    (L10, claim 5), Y a staged 16-bit tile (rows `stride` elements apart) whose B fragments ldmatrix x4 .trans
    reads two 8-column blocks at a time (`blocks` is even); acc: (blocks, 4). The forward's P V_j and the
    backward's P^T dO_i and dS^T Q_i are this product. row_blocks 2: x and acc hold two m16 row blocks one
    after the other (x[2 k_steps + ...], acc[blocks + ...]), and each B fragment read feeds both products."""
    R2 = row_blocks == 2
    if row_blocks not in (1, 2):
        raise ValueError(f"row_blocks must be 1 or 2, got {row_blocks}")

    @cuda.jit(device=True, inline=True)
    def product(acc, x, src, mrow, mat):
        for kk in range(k_steps):
            a = (pack(x[2 * kk, 0], x[2 * kk, 1]), pack(x[2 * kk, 2], x[2 * kk, 3]),
                 pack(x[2 * kk + 1, 0], x[2 * kk + 1, 1]), pack(x[2 * kk + 1, 2], x[2 * kk + 1, 3]))
            u = 2 * k_steps + 2 * kk if R2 else 2 * kk  # the second row block's rows of x (R2)
            a2 = (pack(x[u, 0], x[u, 1]), pack(x[u, 2], x[u, 3]),
                  pack(x[u + 1, 0], x[u + 1, 1]), pack(x[u + 1, 2], x[u + 1, 3])) if R2 else a
            for pair in range(blocks // 2):
                index = (16 * kk + mrow + 8 * (mat & 1)) * stride + 8 * (2 * pair + (mat >> 1))
                bs = warp.ldmatrix_x4_trans(src, index)
                for half in range(2):
                    dn = 2 * pair + half
                    d4 = mma((acc[dn, 0], acc[dn, 1], acc[dn, 2], acc[dn, 3]), a, (bs[2 * half], bs[2 * half + 1]))
                    for e in range(4):
                        acc[dn, e] = d4[e]
                    if R2:
                        dm = blocks + dn
                        d4 = mma((acc[dm, 0], acc[dm, 1], acc[dm, 2], acc[dm, 3]), a2,
                                 (bs[2 * half], bs[2 * half + 1]))
                        for e in range(4):
                            acc[dm, e] = d4[e]

    return product


def _to_f32_function(kind: str):
    """A 16-bit input's bits as float32, for the exact fallback (float16: through the half type)."""
    from fa_numba.kernels.common import to_f32

    if kind == "bfloat16":
        return to_f32
    if backend.name() == "simulator":
        return lambda bits: np.float32(np.uint16(bits).view(np.float16))
    return _f16_bits_to_f32


def _make_f16_bits_to_f32():
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    @intrinsic
    def f16_bits_to_f32(typingctx, bits):
        def codegen(context, builder, sig, args):
            half = builder.bitcast(args[0], ir.HalfType())
            return builder.fpext(half, ir.FloatType())

        return types.float32(types.uint16), codegen

    return f16_bits_to_f32


_f16_bits_to_f32 = None if backend.name() == "simulator" else _make_f16_bits_to_f32()


__all__ = ["fragments_times_staged", "make_products"]
