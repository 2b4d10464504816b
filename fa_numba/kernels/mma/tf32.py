"""The tensor-core products of float32 inputs: 3xTF32 (kind "float32", float32-grade) and plain TF32 (kind
"tf32", an opt-in that is not float32-exact). `engine.make_ops` takes these in place of the 16-bit products;
everything else of the engine (staging, the online softmax on the fragments, masking) is shared.

3xTF32 (proofs/L6 part 9). mma.sync m16n8k8 multiplies tf32 operands (10 stored significand bits) exactly into
a float32 accumulator. Each float32 operand x is split into a tf32 high part and a tf32 residual,

    hi = tf32(x),  lo = tf32(x - hi)       (cvt.rn: round to nearest, ties to even; x - hi is exact in float32),

and a b is taken as lo_a hi_b + hi_a lo_b + hi_a hi_b (three mma.sync into one accumulator, the small terms
first); the dropped lo_a lo_b and the residuals' own rounding leave at most (3 u_t^2 + 2 u_t^3) |a| |b| per
product, u_t = 2^-11, against float32's u = 2^-24 per rounded product (tolerance.SPLIT_ROUNDING). Plain TF32 takes
hi_a hi_b alone: (2 u_t + u_t^2) |a| |b|, about 2^-10 relative, which is why it is an opt-in
(`engine="mma-tf32"`). x is clamped to +-TF32_MAX before its high part is taken, so a finite x near float32's
largest value cannot round to an infinite hi (and hi - x to NaN); an infinite x keeps an infinite residual, a
NaN a NaN one, so non-finite inputs still reach the products (the README's rules).

Layouts (proofs/L10, the m16n8k8 tables; g = lane >> 2, t = lane & 3):
- S = Q K^T: A = Q's 16 x 8 slice, a lane's a0..a3 = Q[g][t], Q[g+8][t], Q[g][t+4], Q[g+8][t+4] of the k-step
  (read from HBM once per query tile into float32 registers, split at each key tile: the 16-bit engine's Q tile
  in shared memory is not staged at all); B = K^T, b0, b1 = K[g][t], K[g][t+4], high parts and residuals read
  from K_j in shared memory by plain 32-bit loads (no ldmatrix: its rows are 16-bit pairs).
- acc += P V without moving data between lanes: the k-step of P V is 8 keys, and any order of those keys gives
  the same sum, so k-index t stands for key 2t and t + 4 for key 2t + 1. The S accumulator of a key block holds,
  in lane (g, t), P[g][2t], P[g][2t+1], P[g+8][2t], P[g+8][2t+1]: exactly the A fragment under that order
  (a0 = P[g][2t], a1 = P[g+8][2t], a2 = P[g][2t+1], a3 = P[g+8][2t+1]; proofs/L10 claim 7); V's B fragment
  follows it: b0 = V[2t][g], b1 = V[2t+1][g] of the block.
- K_j and V_j are split once per block, when staged: each shared tile holds the tf32 high parts (rows DP + 4
  words apart; DP: d rounded up to 8, zeros past d), then the residuals, HALF = B_c (DP + 4) words further. A
  warp-level split at every use would split each element once per warp (`profile` put those splits at 2560 of
  the 4065 instructions of a d = 64 iteration, and the estimate at 65 TFLOP/s). The pad, DP / 4 + 1 odd, puts
  K's reads (8 rows g, 4 columns t) and V's (rows 2t, 2t + 1, 8 columns g) on 32 distinct banks.
- The float32 engine needs twice the 16-bit engine's shared memory per staged element pair: block_k 32 up to
  d = 64, 16 above (engines.mma_tiles), under the 48 KB static limit.

Cost, per k-step of 8 and key block: three mma.sync and four 32-bit shared loads; Q's split is made once per
query tile at d <= 64 (kept in registers), else once per (key tile, k-step), and P's once per key block
(cvt.rn.tf32 is one instruction on sm_90, F2FP.TF32.F32; cvt.rna, used until 2026-12-05, is three).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from numba import boolean, cuda, float32, uint32

from fa_numba import warp
from fa_numba.kernels.common import ZERO

FLOAT32_KINDS = ("float32", "tf32")  # 3xTF32 and plain TF32, both on float32 inputs
TF32_MAX = float32((2.0 - 2.0**-10) * 2.0**127)  # the largest finite tf32 (10 stored significand bits)
FLOAT32_MAX = float32(np.finfo(np.float32).max)


@cuda.jit(device=True, inline=True)
def split(x):
    """(hi, lo): the tf32 bits of x's high part and of its residual, hi + lo = x up to u_t^2 |x| (|x| <= TF32_MAX;
    plain TF32 uses hi alone, and the residual's instructions are dropped as dead code). hi is taken of x clamped
    to +-TF32_MAX, so a finite x cannot round to an infinite hi; inf keeps an infinite residual, NaN a NaN hi and
    residual. The clamp must keep a NaN: min(max(x, -T), T) compiles to fmaxf / fminf (FMNMX), which drop one
    (hi = -TF32_MAX), and the first H200 run (2026-12-04) failed tests/test_mma_tf32.py's device split test on it
    (the simulator, then running Python's min and max, had not). It is min.NaN and max.NaN (warp.min_nan,
    max_nan: two FMNMX.NAN); two comparisons did the same in three instructions (FSETP, FMNMX.NAN, FSEL) until
    2026-12-05. With cvt.rn's one instruction a split is five: two FMNMX.NAN, F2FP.TF32, FADD, F2FP.TF32."""
    clamped = warp.max_nan(warp.min_nan(x, TF32_MAX), -TF32_MAX)
    hi = warp.to_tf32(clamped)
    return hi, warp.to_tf32(x - warp.tf32_value(hi))


def unrolled(n: int, step):
    """A device function run(a, b, c, d, e) that calls step(i, a, b, c, d, e) for i = 0 .. n - 1 in turn, each i a
    compile-time constant: the loop written out. The compiler does not fully unroll a loop nest this big (a k-step
    of three mma.sync and six splits per key block), and a fragment array indexed by a run-time i leaves the
    registers for local memory (`profile` saw 256 bytes of stack at d = 64 before this).

    The n calls are one flat function body, generated as source: Numba inlines each `inline=True` callee by
    running its untyped passes and copying its IR at every call site, so a chain of n nested functions (run_i
    calling run_i-1, then step) took time quadratic in n to compile, where this body costs n copies of step: the
    3xTF32 v1-mma build at d = 64 compiled in 137 s chained, 52 s flat, to the same SASS (2026-12-04, 2 cores)."""
    calls = "".join(f"    step({i}, a, b, c, d, e)\n" for i in range(n))
    namespace = {"step": step, "__name__": __name__}  # the function's module: this one
    exec(f"def run(a, b, c, d, e):\n{calls}    return None\n", namespace)  # our own text: n lines of step calls
    return cuda.jit(device=True, inline=True)(namespace["run"])


@cuda.jit(device=True, inline=True)
def split_weight(x):
    """`split` of a softmax weight, in [0, 1] or NaN: no clamp needed (its high part cannot overflow)."""
    hi = warp.to_tf32(x)
    return hi, warp.to_tf32(x - warp.tf32_value(hi))


def fourfold(one):
    """A device function splitting four values by `one` (a fragment's registers): (the 4 hi, the 4 lo)."""
    @cuda.jit(device=True, inline=True)
    def four(x0, x1, x2, x3):
        h0, l0 = one(x0)
        h1, l1 = one(x1)
        h2, l2 = one(x2)
        h3, l3 = one(x3)
        return (h0, h1, h2, h3), (l0, l1, l2, l3)

    return four


def padded_dim(head_dim: int) -> int:
    """d rounded up to whole k-steps of 8 (the k of m16n8k8)."""
    return -(-head_dim // 8) * 8


def make_products(kind: str, sizes: SimpleNamespace, quad_sum) -> SimpleNamespace:
    """The float32 engine's pieces for `engine.make_ops`: q_fragments (Q's fragments from HBM), scores (S = Q K_j^T
    into s), pv (acc += P V_j), key_dots (the exact path's two dot products of a key, by quad sums), how a staged
    element is stored (`store`: split into its tf32 parts, the high part at i and the residual at i + HALF;
    `settle`: the same in place for a tile cp.async staged raw) and read back (`value`: hi + lo), and the
    non-finite tests; `sizes` the engine's compile-time sizes (KS here counts k-steps of 8)."""
    if kind not in FLOAT32_KINDS:
        raise ValueError(f"kind must be one of {FLOAT32_KINDS} for the float32 products, got {kind!r}")
    THREE = kind == "float32"
    D, SQ, KS, NT, DN, DP, HALF = sizes.D, sizes.SQ, sizes.KS, sizes.NT, sizes.DN, sizes.DP, sizes.HALF
    THREADS = 32 * sizes.W
    # Q's fragments split once per query tile where registers allow (d <= 64: 8 words a k-step, hi then lo);
    # above, kept as float32 and split at each key tile (4 words a k-step)
    QSPLIT = KS <= 8
    TILE = sizes.BC * DP  # elements of a staged K or V tile
    ROWS_PER_STEP = THREADS // DP if THREADS % DP == 0 else 0  # a step of THREADS elements is whole rows
    mma = warp.mma_tf32

    split4, split4_weights = fourfold(split), fourfold(split_weight)

    @cuda.jit(device=True, inline=True)
    def product(c, ahi, alo, bhi, blo):
        """c + a b on one m16n8k8 block from split operands: three tf32 products (3xTF32), the small ones first, or
        one (plain TF32)."""
        if THREE:
            c = mma(c, alo, bhi)
            c = mma(c, ahi, blo)
        return mma(c, ahi, bhi)

    @cuda.jit(device=True, inline=True)
    def accumulate(c, row, ahi, alo, tile, at, step):
        """c[row, :] += A B on one m16n8k8 block, B's two registers the staged tile's words at and at + step
        (their high parts, and the residuals HALF further)."""
        d4 = product((c[row, 0], c[row, 1], c[row, 2], c[row, 3]), ahi, alo, (tile[at], tile[at + step]),
                     (tile[HALF + at], tile[HALF + at + step]))
        for e in range(4):
            c[row, e] = d4[e]

    @cuda.jit(device=True, inline=True)
    def store(tile, index, x):
        hi, lo = split(x)
        tile[index] = hi
        tile[index + HALF] = lo

    @cuda.jit(device=True, inline=True)
    def settle_step(step, tile, bad, base, unused1, unused2):
        """Element tid + step THREADS: consecutive lanes on consecutive words (no bank conflict). Where THREADS
        is whole rows (ROWS_PER_STEP), its index is base + step ROWS_PER_STEP SQ, a constant offset, so the
        unrolled steps keep no address registers (computing each from scratch spilled at d = 128)."""
        idx = cuda.threadIdx.x + step * THREADS
        if TILE % THREADS == 0 or idx < TILE:
            if ROWS_PER_STEP:
                i = base + step * ROWS_PER_STEP * SQ
            else:
                r = idx // DP
                i = r * SQ + idx - r * DP
            x = warp.tf32_value(tile[i])  # the float32 whose bits were copied
            if nonfinite(x):
                bad[0] = True
            store(tile, i, x)

    settle_steps = unrolled(-(-TILE // THREADS), settle_step)  # written out: no loop inside the tile loop

    @cuda.jit(device=True, inline=True)
    def settle(tile, rows):
        """Split a K or V tile (rows = B_c) staged raw (float32 bits, by cp.async) in place: this thread's share
        of its elements; returns whether one of them is inf or NaN. The caller's barrier comes before (the
        copies) and after."""
        bad = cuda.local.array(1, boolean)  # one element at a constant index: a register
        bad[0] = False
        tid = cuda.threadIdx.x
        settle_steps(tile, bad, (tid // DP) * SQ + tid % DP, 0, 0)
        return bad[0]

    @cuda.jit(device=True, inline=True)
    def value(tile, index):
        """A staged element back as float32 for the exact path: hi + lo (x to within u_t^2 |x|)."""
        return warp.tf32_value(tile[index]) + warp.tf32_value(tile[index + HALF])

    @cuda.jit(device=True, inline=True)
    def q_fragments(q, b, h, r0, n_q, sq, qf, wid, mrow, mat):
        """This lane's A fragments of Q_i from HBM (zeros past N_q and d): split into tf32 parts (QSPLIT), or
        float32 as they are; no shared memory, no barrier."""
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        for ks in range(KS):
            for e in range(4):
                row = r0 + 16 * wid + g + 8 * (e & 1)
                x = 8 * ks + t + 4 * (e >> 1)
                value = q[b, h, row, x] if (row < n_q and x < D) else ZERO
                if QSPLIT:
                    qf[ks, e], qf[ks, 4 + e] = split(value)
                else:
                    qf[ks, e] = value

    @cuda.jit(device=True, inline=True)
    def q_parts(qf, ks):
        """(hi, lo) of Q's A fragment at k-step ks."""
        if QSPLIT:
            return (qf[ks, 0], qf[ks, 1], qf[ks, 2], qf[ks, 3]), (qf[ks, 4], qf[ks, 5], qf[ks, 6], qf[ks, 7])
        return split4(qf[ks, 0], qf[ks, 1], qf[ks, 2], qf[ks, 3])

    @cuda.jit(device=True, inline=True)
    def q_value(qf, ks, e):
        """Q's fragment entry e at k-step ks as float32 (hi + lo where split: Q to within u_t^2 |Q|)."""
        if QSPLIT:
            return warp.tf32_value(qf[ks, e]) + warp.tf32_value(qf[ks, 4 + e])
        return qf[ks, e]

    @cuda.jit(device=True, inline=True)
    def score_step(ks, qf, s, sk, g, t):
        """k-step ks of S = Q K_j^T for every key block: Q's split made once and used by all of them."""
        ahi, alo = q_parts(qf, ks)
        for nt in range(NT):
            accumulate(s, nt, ahi, alo, sk, (8 * nt + g) * SQ + 8 * ks + t, 4)  # K[g][t], K[g][t + 4]

    score_steps = unrolled(KS, score_step)

    @cuda.jit(device=True, inline=True)
    def scores(qf, s, sk, mrow, mat, sq, wid):
        """s[nt, e] = this lane's entries of Q_i K_j^T (unscaled), k-steps outer (sq, wid: unused, the 16-bit
        engine's two-row-block form reads Q there)."""
        lane = cuda.threadIdx.x & 31
        for nt in range(NT):
            for e in range(4):
                s[nt, e] = ZERO
        score_steps(qf, s, sk, lane >> 2, lane & 3)

    @cuda.jit(device=True, inline=True)
    def pv_step(kk, s, acc, sv, g, t):
        """Key block kk of acc += P V_j: P's float32 weights in s as they are (the module docstring's key order)."""
        ahi, alo = split4_weights(s[kk, 0], s[kk, 2], s[kk, 1], s[kk, 3])
        for dn in range(DN):
            accumulate(acc, dn, ahi, alo, sv, (8 * kk + 2 * t) * SQ + 8 * dn + g, SQ)  # V[2t][g], V[2t + 1][g]

    pv_steps = unrolled(NT, pv_step)

    @cuda.jit(device=True, inline=True)
    def pv(s, acc, sv, mrow, mat):
        """acc += P V_j."""
        lane = cuda.threadIdx.x & 31
        pv_steps(s, acc, sv, lane >> 2, lane & 3)

    @cuda.jit(device=True, inline=True)
    def key_dots(qf, sq, sk, c, qrow0, t):
        """Q_i K_j^T of rows qrow0, qrow0 + 8 with key c of the tile, in float32 on the CUDA cores: each lane
        its columns' part from its Q fragments, the quad's sum by shuffles (the whole warp calls it)."""
        p0, p1 = ZERO, ZERO
        for ks in range(KS):
            k0, k1 = value(sk, c * SQ + 8 * ks + t), value(sk, c * SQ + 8 * ks + t + 4)
            p0 += q_value(qf, ks, 0) * k0 + q_value(qf, ks, 2) * k1
            p1 += q_value(qf, ks, 1) * k0 + q_value(qf, ks, 3) * k1
        return quad_sum(p0), quad_sum(p1)

    @cuda.jit(device=True, inline=True)
    def nonfinite(x):
        return not abs(x) <= FLOAT32_MAX  # inf or NaN

    @cuda.jit(device=True, inline=True)
    def nonfinite_staged(bits):
        return (bits & 0x7F800000) == 0x7F800000  # a tf32 part (or a raw float32) is inf or NaN

    @cuda.jit(device=True, inline=True)
    def identity(x):
        return x

    return SimpleNamespace(q_fragments=q_fragments, scores=scores, pv=pv, key_dots=key_dots, nonfinite=nonfinite,
                           nonfinite_staged=nonfinite_staged, store=store, settle=settle, settles=True, value=value,
                           to_f32=identity, zero=ZERO, element=uint32, fragment=uint32 if QSPLIT else float32,
                           fragment_width=8 if QSPLIT else 4, chunk=4, q_in_shared=False)


__all__ = ["FLOAT32_KINDS", "TF32_MAX", "fourfold", "make_products", "padded_dim", "split", "split_weight", "unrolled"]
