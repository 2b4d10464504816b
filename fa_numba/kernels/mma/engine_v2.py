"""FlashAttention-2's order on tensor cores (Q outer): one block of W warps per query tile, (m, l, acc) in
registers across the key tiles; the engine (mma.sync products, online softmax on the fragments, staging,
masking) is `kernels.mma.engine`.

HBM traffic per (batch, head), in elements, by construction that of the CUDA-core v2 (iomodel.traffic("v2",
...)): Q read once per query tile, K and V once per visited (query tile, key tile), O written N_q d, LSE N_q;
no key past N is read; counted in the simulator equal to iomodel.traffic("v2", ...)
(tests/test_registry_mma.py); with a block mask, K and V once per listed tile, as the CUDA-core v2's.
Launch: grid (ceil(N_q / B_r), B H), 32 W threads; B_r = 16 W R (R row blocks a warp: MmaConfig.row_blocks).
Causal blocks of two row blocks a warp take their query tiles heaviest first (block x takes tile T_r - 1 - x).
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from fa_numba import warp
from fa_numba.kernels.common import NEG_INF, ZERO, log_sum_exp, output
from fa_numba.kernels.mma import masking
from fa_numba.kernels.mma.engine import KINDS, MAX_HEAD_DIM, MmaConfig, async_multiple, make_ops
from fa_numba.kernels.mma.launch import MmaKernel
from fa_numba.tiling import PARTIAL


def kernel_source(config: MmaConfig):
    """The Python function of the kernel (cuda.jit compiles it for a launch, fa_numba.profile for sm_90a)."""
    E = make_ops(config)
    stage_q, stage_kv, quad_sum = E.stage_q, E.stage_kv, E.quad_sum
    scores, weigh, copy_k, copy_v, split_k, landed = E.scores, E.weigh_blocks, E.copy_k, E.copy_v, E.split_k, E.landed
    PIPELINED = config.pipelines
    Z = E.sizes
    BR, BC, KS, NT, Q_SIZE, KV_SIZE, V_SIZE = Z.BR, Z.BC, Z.KS, Z.NT, Z.Q_SIZE, Z.KV_SIZE, Z.V_SIZE
    RB = Z.RB  # m16 row blocks a warp: the warp's rows 16 RB wid .. 16 RB (wid + 1) - 1 of the block
    DV, DNV = Z.DV, Z.DNV  # O's head dim (V's, d_v) and its accumulator blocks
    # local arrays' sizes (Python ints: constants to Numba); two row blocks keep no Q fragments (products16)
    QF_ROWS, S_ROWS, ACC_ROWS = KS if RB == 1 else 1, RB * NT, RB * DNV
    ELEMENT, FRAGMENT, QF = Z.ELEMENT, Z.FRAGMENT, Z.QF  # shared tiles' type; Q's fragments: type, per k-step
    CAUSAL, LISTS, PARTIAL_KIND = config.causal, config.lists, int(PARTIAL)
    slot = masking.slot

    def flash_v2_mma(q, k, v, o, lse, scale, row_ptrs, col_idxs, col_kinds, col_ptrs, row_idxs, row_kinds, lohis,
                     denses, captured):
        sq = cuda.shared.array(Q_SIZE, ELEMENT)  # 16-bit bits, or float32 (whose engine stages no Q)
        sk = cuda.shared.array(KV_SIZE, ELEMENT)
        sv = cuda.shared.array(V_SIZE, ELEMENT)
        qf = cuda.local.array((QF_ROWS, QF), FRAGMENT)  # one row block: this lane's A fragments of Q
        s = cuda.local.array((S_ROWS, 4), float32)  # S, then P, of the warp's 16 RB rows x B_c keys
        acc = cuda.local.array((ACC_ROWS, 4), float32)  # O's accumulator, 16 RB rows x d_v padded columns
        ml = cuda.local.array((RB, 4), float32)  # each row block's (m0, m1, l0, l1): its two rows' statistics
        # causal, two row blocks: the heaviest query tiles first (the last tile sees every key tile, the first one):
        # blocks start in x order, so the grid ends on each head's lightest tiles, not on a long block alone (one
        # row block keeps x order: its causal builds, capped at 168 registers, spill with the reversed index)
        i = cuda.gridDim.x - 1 - cuda.blockIdx.x if CAUSAL and RB > 1 else cuda.blockIdx.x
        bh = cuda.blockIdx.y
        lane = cuda.threadIdx.x & 31
        wid = cuda.threadIdx.x >> 5
        g, t = lane >> 2, lane & 3
        mrow, mat = lane & 7, lane >> 3  # ldmatrix: this lane gives row mrow of matrix mat
        heads, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
        b = bh // heads
        h = bh - b * heads
        h_kv = h // (heads // k.shape[1])  # GQA: query head h reads K/V head h // group
        delta = n_k - n_q
        r0 = i * BR
        qrow0 = 16 * RB * wid + g  # this lane's rows in the tile: qrow0 + 16 R' and qrow0 + 16 R' + 8
        row0 = r0 + qrow0
        sb, sh = slot(lohis, b, h)  # this block's slice of the block mask (kernels.mma.masking)
        # key tiles: all of them, (causal) up to the one holding the last key the block's last row sees, or
        # (a block mask) the listed ones col_idx[row_ptr[i]:row_ptr[i + 1]], in increasing j (L8)
        last = min(r0 + BR, n_q) - 1 + delta
        start, stop = 0, (n_k + BC - 1) // BC
        if CAUSAL:
            stop = min(stop, (last + BC) // BC) if last >= 0 else 0
        if LISTS:
            start, stop = row_ptrs[sb, sh, i], row_ptrs[sb, sh, i + 1]

        if PIPELINED and start < stop:  # K of the first tile travels with Q_i (stage_q waits for both)
            copy_k(k, b, h_kv, (col_idxs[sb, sh, start] if LISTS else start) * BC, n_k, sk)
        stage_q(q, b, h, r0, n_q, sq, qf, wid, mrow, mat)
        for dn in range(ACC_ROWS):
            for e in range(4):
                acc[dn, e] = ZERO
        for rb in range(RB):
            ml[rb, 0], ml[rb, 1], ml[rb, 2], ml[rb, 3] = NEG_INF, NEG_INF, ZERO, ZERO
        for idx in range(start, stop):
            j = col_idxs[sb, sh, idx] if LISTS else idx
            c0 = j * BC
            # some key of the tile is hidden from some row
            partial = col_kinds[sb, sh, idx] == PARTIAL_KIND if LISTS else CAUSAL and c0 + BC - 1 > r0 + delta
            masked = partial or c0 + BC > n_k  # only a PARTIAL or the last, short tile hides keys
            if PIPELINED:
                # K_j was issued an iteration ago (or with Q_i); V_j now, to travel while S = Q K_j^T is computed,
                # and K_j+1 once every warp has read K_j, to travel while the softmax and P V_j run
                # (FlashAttention-2's order: one buffer each, two barriers a tile; four on float32 inputs, which are
                # split into tf32 parts where they land)
                warp.cp_async_wait_all()
                cuda.syncthreads()  # K_j visible, and every warp is past P V_j-1: V's buffer is free
                copy_v(v, b, h_kv, c0, n_k, sv)
                split_k(sk)  # float32 inputs: K_j into tf32 parts, and a barrier
                scores(qf, s, sq, sk, wid, row0, c0, n_k, delta, scale, t, mrow, mat, masked, b, h, n_q, captured,
                       lohis, denses, sb, sh)
                guard = landed(sv, partial)  # V_j visible, and every warp is past S: K's buffer is free
                more = idx + 1 < stop
                # K_j+1's first key is written at both copy sites: computed once before them, the float16 d = 64
                # build took 132 registers and 4% more instructions (issue-bound, estimate 402.6 -> 391.6)
                if more and not guard:  # the exact path reads K_j again: then K_j+1 waits for it (below)
                    copy_k(k, b, h_kv, (col_idxs[sb, sh, idx + 1] if LISTS else idx + 1) * BC, n_k, sk)
                weigh(qf, s, acc, sq, sk, sv, ml, row0, qrow0, c0, n_k, delta, scale, t, mrow, mat, guard, b, h, n_q,
                      captured, lohis, denses, sb, sh)
                if more and guard:  # block-uniform
                    cuda.syncthreads()  # every warp's exact path has read K_j
                    copy_k(k, b, h_kv, (col_idxs[sb, sh, idx + 1] if LISTS else idx + 1) * BC, n_k, sk)
            else:  # one stage: K_j and V_j staged together, then folded
                cuda.syncthreads()  # the previous tile's K_j and V_j are no longer read: every thread comes here
                guard = stage_kv(k, v, b, h_kv, c0, n_k, sk, sv, partial)
                scores(qf, s, sq, sk, wid, row0, c0, n_k, delta, scale, t, mrow, mat, masked, b, h, n_q, captured,
                       lohis, denses, sb, sh)
                weigh(qf, s, acc, sq, sk, sv, ml, row0, qrow0, c0, n_k, delta, scale, t, mrow, mat, guard, b, h, n_q,
                      captured, lohis, denses, sb, sh)
        for rb in range(RB):
            l0, l1 = quad_sum(ml[rb, 2]), quad_sum(ml[rb, 3])  # every lane of the quad takes part in the shuffles
            for half in range(2):
                row = row0 + 16 * rb + 8 * half
                l_row = l0 if half == 0 else l1  # constant indices only: ml stays in registers
                if row < n_q:
                    alive = (not CAUSAL or row + delta >= 0) and n_k > 0
                    if LISTS:  # the row sees a key iff its interval is not empty (L8)
                        alive = lohis[sb, sh, row, 0] < lohis[sb, sh, row, 1]
                    for dn in range(DNV):
                        for e in range(2):
                            x = 8 * dn + 2 * t + e
                            if x < DV:
                                o[b, h, row, x] = output(acc[rb * DNV + dn, 2 * half + e], l_row, alive)
                    if t == 0:
                        lse[b, h, row] = log_sum_exp(ml[rb, 0] if half == 0 else ml[rb, 1], l_row, alive)

    return flash_v2_mma


class MmaV2Kernel(MmaKernel):
    """The tensor-core v2 kernel's launch: grid (T_r, B H)."""

    GRID_AXES = ("ceil(N_q / block_q)", "batch * heads")
    ORDER = "v2"

    def grid(self, batch, heads, n_q):
        return (-(-n_q // self.config.block_q), batch * heads)

    # (head dim, block_k) -> registers, for the causal 16-bit builds of 4 warps of one row block without a mod or
    # a block mask: at d = 64 the causal build takes 172 registers (2 blocks of 4 warps an SM); capped at 168 it
    # compiles without spills or stack and keeps 3 blocks (sm_90a, float16 and bfloat16; tests/test_profile.py).
    # d = 96 spills 4 bytes at 168 and d = 56 24: left to the compiler. A call at d = 64 takes two row blocks a
    # warp by default (engines.mma_tiles); this cap serves one row block (block_q 64, or row_blocks=1).
    REGISTER_CAPS = {(64, 64): 168}

    @classmethod
    def register_cap(cls, config):
        plain = (config.causal and config.mod is None and config.mask_form in ("none", "causal")
                 and config.d_v == config.head_dim)  # the api passes value_dim = d for d_v = d
        if not plain or config.float32 or config.warps != 4 or config.row_blocks != 1:
            return None
        return cls.REGISTER_CAPS.get((config.head_dim, config.block_k))

    @staticmethod
    def base_types(kind: str = "float16"):
        """q, k, v (bits), o, lse, scale: the arguments before the captured arrays (MmaKernel.argtypes), for inputs of `kind`."""
        bits, out, stat = MmaKernel.array_types(kind)
        return (bits, bits, bits, out, stat, float32)


@functools.lru_cache(maxsize=None)
def make_v2_mma(kind: str, warps: int, block_k: int, head_dim: int, causal: bool,
                async_copy: bool | None = None, mod=None, mask_form: str = "none",
                value_dim: int | None = None, pipelined: bool | None = None, row_blocks: int = 1) -> MmaV2Kernel:
    """The tensor-core v2 kernel for 16-bit inputs `kind` ("float16" or "bfloat16"), blocks of `warps` warps
    (block_q = 16 warps row_blocks query rows), block_k keys per tile, head dim d, causal or not; cached. async_copy
    (default: where d % 8 == 0) stages the tiles by cp.async; a launch on inputs not 16-byte aligned then
    takes the plain-load kernel. mod: a score_mod.KernelMod compiled in (with a mask_mod's fn for the
    "function" form), or None; mask_form: a block mask's list form (kernels.block_lists.LIST_FORMS), whose
    KernelMask each launch takes, or "none" / "causal"; value_dim: V's and O's head dim d_v (16-bit kinds; None:
    d), staged and accumulated at its own width; pipelined (cp.async staging only): K_j+1 and V_j copied while
    the products run, or False, one stage (K_j and V_j copied, waited for, then folded); default: pipelined up
    to d = d_v = 128 (MmaConfig.pipelines); row_blocks: the m16 row blocks a warp owns (1 or 2, 16-bit kinds),
    each K_j and V_j fragment read from shared memory feeding that many products."""
    if async_copy is None:
        async_copy = all(x % async_multiple(kind) == 0 for x in (head_dim, value_dim or head_dim))
    return MmaV2Kernel(MmaConfig(kind, warps, block_k, head_dim, bool(causal), bool(async_copy), mod, mask_form,
                                 value_dim or 0, None if pipelined is None else bool(pipelined), row_blocks),
                        kernel_source)


MmaV2Kernel.make = staticmethod(make_v2_mma)  # without_async goes back through the cache

__all__ = ["KINDS", "MAX_HEAD_DIM", "MmaConfig", "MmaV2Kernel", "kernel_source", "make_v2_mma"]
