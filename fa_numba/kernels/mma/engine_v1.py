"""FlashAttention's Algorithm 1 on tensor cores (K/V outer): one block of W warps per (batch, head); for
each key tile K_j, V_j (staged once) every query tile that sees it is visited, its (O, l, m) read back from
HBM, folded with the tile and written again, as the paper's loop order has it. The engine (mma.sync
products, online softmax on the fragments, staging, masking) is `kernels.mma.engine`; this file is the order.

The round trip (proofs/L4, L6 part 3): O is kept in HBM as acc / l, so a visit rebuilds acc = O l (two
roundings, the rule's v1 term; while a row has seen nothing, l = 0 and acc itself is kept); l and m are kept
as they are (m, and the quad's whole l: on the way back in
the lane t = 0 of the quad holds it, the others 0, so the quad's sum is l again). Each lane reads back the O
entries it wrote itself; m and l, written by every lane of the quad, are read after the block's barriers of
the next staging, so no other barrier is needed.
HBM traffic per (batch, head), in elements: K and V read once (N_k d each), Q, O, l and m once per visit,
O and m, l written once per visit, LSE N_q, and the first fill of O, l, m and LSE; close to
iomodel.traffic("v1", ...) but not equal to it: every lane of a quad reads the row's l and m (4 reads where
iomodel counts one) and LSE is written twice (its -inf fill, then the result), so compare reports v1-mma's
traffic as not counted (tests/test_registry_mma.py pins why). With a block mask the visits are the lists'
(row_idx[col_ptr[j]:col_ptr[j + 1]] for key tile j), and a key tile no query tile sees is never staged.
Launch: grid (B H,), 32 W threads: B H blocks, fewer than an H200's 132 SMs hold at small B H.
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from fa_numba.kernels.common import NEG_INF, ZERO, log_sum_exp, output
from fa_numba.kernels.mma import masking
from fa_numba.kernels.mma.engine import MmaConfig, async_multiple, make_ops
from fa_numba.kernels.mma.launch import MmaKernel
from fa_numba.tiling import PARTIAL


def kernel_source(config: MmaConfig):
    """The Python function of the kernel (cuda.jit compiles it for a launch, fa_numba.profile for sm_90a)."""
    E = make_ops(config)
    stage_q, stage_kv, fold, quad_sum = E.stage_q, E.stage_kv, E.fold, E.quad_sum
    Z = E.sizes
    BR, BC, KS, NT, Q_SIZE, KV_SIZE, V_SIZE = Z.BR, Z.BC, Z.KS, Z.NT, Z.Q_SIZE, Z.KV_SIZE, Z.V_SIZE
    D, DN = Z.DV, Z.DNV  # O's head dim (V's, d_v) and its accumulator blocks: every column this file names
    ELEMENT, FRAGMENT, QF = Z.ELEMENT, Z.FRAGMENT, Z.QF  # shared tiles' type; Q's fragments: type, per k-step
    CAUSAL, LISTS, PARTIAL_KIND = config.causal, config.lists, int(PARTIAL)
    slot = masking.slot

    @cuda.jit(device=True, inline=True)
    def read_state(o, l_hbm, m_hbm, acc, b, h, row, n_q, t, half):
        """acc's columns of `half` (a constant at each call) = O l of `row` from HBM; returns (m, this lane's
        part of l: the whole l in lane t = 0, else 0, so the quad's sum is l)."""
        m_row, l_row = NEG_INF, ZERO
        if row < n_q:
            m_row, l_row = m_hbm[b, h, row], l_hbm[b, h, row]
        for dn in range(DN):
            for e in range(2):
                x = 8 * dn + 2 * t + e
                acc[dn, 2 * half + e] = o[b, h, row, x] * l_row if (row < n_q and x < D) else ZERO
        return m_row, (l_row if t == 0 else ZERO)

    @cuda.jit(device=True, inline=True)
    def write_state(o, l_hbm, m_hbm, lse, acc, b, h, row, n_q, n_k, delta, t, final, m_row, l_row, lohis, sb, sh,
                    half):
        """The state of `row` to HBM from acc's columns of `half` (a constant at each call): O = acc / l (acc
        itself while l = 0: nothing seen yet, 0, or NaN), l and m; at the row's last visit the output and LSE
        (a row that sees no key by the mask: 0 and -inf)."""
        if row < n_q:
            alive = (not CAUSAL or row + delta >= 0) and n_k > 0
            if LISTS:  # the row sees a key iff its interval is not empty (L8)
                alive = lohis[sb, sh, row, 0] < lohis[sb, sh, row, 1]
            if t == 0:
                l_hbm[b, h, row] = l_row
                m_hbm[b, h, row] = m_row
                if final:
                    lse[b, h, row] = log_sum_exp(m_row, l_row, alive)
            for dn in range(DN):
                for e in range(2):
                    x = 8 * dn + 2 * t + e
                    if x < D:
                        a = acc[dn, 2 * half + e]
                        if final:
                            o[b, h, row, x] = output(a, l_row, alive)
                        else:
                            o[b, h, row, x] = a / l_row if l_row > ZERO else a

    def flash_v1_mma(q, k, v, o, lse, l_hbm, m_hbm, scale, row_ptrs, col_idxs, col_kinds, col_ptrs, row_idxs,
                     row_kinds, lohis, denses, captured):
        sq = cuda.shared.array(Q_SIZE, ELEMENT)  # 16-bit bits, or float32 (whose engine stages no Q)
        sk = cuda.shared.array(KV_SIZE, ELEMENT)
        sv = cuda.shared.array(V_SIZE, ELEMENT)
        qf = cuda.local.array((KS, QF), FRAGMENT)
        s = cuda.local.array((NT, 4), float32)
        acc = cuda.local.array((DN, 4), float32)
        bh = cuda.blockIdx.x
        lane = cuda.threadIdx.x & 31
        wid = cuda.threadIdx.x >> 5
        g, t = lane >> 2, lane & 3
        mrow, mat = lane & 7, lane >> 3
        heads, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
        b = bh // heads
        h = bh - b * heads
        h_kv = h // (heads // k.shape[1])
        delta = n_k - n_q
        n_row_tiles = (n_q + BR - 1) // BR
        n_key_tiles = (n_k + BC - 1) // BC
        sb, sh = slot(lohis, b, h)  # this block's slice of the block mask (kernels.mma.masking)
        # O = 0, l = 0, m = -inf, LSE = -inf for every row (a row no tile visits keeps them: it sees no key);
        # each lane initialises the entries it will own
        for i in range(n_row_tiles):
            for half in range(2):
                row = i * BR + 16 * wid + g + 8 * half
                if row < n_q:
                    for dn in range(DN):
                        for e in range(2):
                            x = 8 * dn + 2 * t + e
                            if x < D:
                                o[b, h, row, x] = ZERO
                    if t == 0:
                        l_hbm[b, h, row] = ZERO
                        m_hbm[b, h, row] = NEG_INF
                        lse[b, h, row] = NEG_INF
        for j in range(n_key_tiles):
            c0 = j * BC
            # the query tiles that visit key tile j: all (causal: those whose last row sees c0), or the listed
            # ones row_idx[col_ptr[j]:col_ptr[j + 1]] (L8)
            start, stop = 0, n_row_tiles
            if LISTS:
                start, stop = col_ptrs[sb, sh, j], col_ptrs[sb, sh, j + 1]
            cuda.syncthreads()  # the previous K_j, V_j, Q_i and the state writes are done: every thread comes
            if LISTS and stop == start:
                continue  # a key tile no query tile sees is never staged (the whole block skips it together)
            # PARTIAL for some tile: checked below
            guard_any = stage_kv(k, v, b, h_kv, c0, n_k, sk, sv, CAUSAL or LISTS)
            for idx in range(start, stop):
                i = row_idxs[sb, sh, idx] if LISTS else idx
                r0 = i * BR
                last = min(r0 + BR, n_q) - 1 + delta  # the last key the tile's last row sees
                if CAUSAL and c0 > last:
                    continue  # a SKIP tile: the whole block skips it together
                n_tiles = n_key_tiles if not CAUSAL else min(n_key_tiles, (last + BC) // BC)
                partial = row_kinds[sb, sh, idx] == PARTIAL_KIND if LISTS else CAUSAL and c0 + BC - 1 > r0 + delta
                if LISTS:  # tile j is the last one row tile i visits when it ends i's list
                    final = j == col_idxs[sb, sh, row_ptrs[sb, sh, i + 1] - 1]
                else:
                    final = j == n_tiles - 1
                guard = guard_any and partial
                masked = partial or c0 + BC > n_k
                row0 = r0 + 16 * wid + g
                cuda.syncthreads()  # the previous visit's Q_i is no longer read: every thread comes here
                stage_q(q, b, h, r0, n_q, sq, qf, wid, mrow, mat)
                # the state back from HBM: acc = O l, this quad's l in lane t = 0 (one call per half: the
                # accumulator's indices stay constants, so acc stays in registers)
                m0, l0 = read_state(o, l_hbm, m_hbm, acc, b, h, row0, n_q, t, 0)
                m1, l1 = read_state(o, l_hbm, m_hbm, acc, b, h, row0 + 8, n_q, t, 1)
                m0, m1, l0, l1 = fold(qf, s, acc, sq, sk, sv, m0, m1, l0, l1, row0, 16 * wid + g, c0, n_k, delta,
                                      scale, t, mrow, mat, guard, masked, b, h, n_q, captured, lohis, denses, sb, sh)
                l0, l1 = quad_sum(l0), quad_sum(l1)
                write_state(o, l_hbm, m_hbm, lse, acc, b, h, row0, n_q, n_k, delta, t, final, m0, l0, lohis, sb, sh, 0)
                write_state(o, l_hbm, m_hbm, lse, acc, b, h, row0 + 8, n_q, n_k, delta, t, final, m1, l1, lohis, sb,
                            sh, 1)

    return flash_v1_mma


class MmaV1Kernel(MmaKernel):
    """The tensor-core v1 kernel's launch: grid (B H,), the l and m workspaces allocated per call."""

    GRID_AXES = ("batch * heads",)
    ORDER = "v1"

    def grid(self, batch, heads, n_q):
        return (batch * heads,)

    def arguments(self, q, k, v, o, lse, scale):
        l_hbm = cuda.device_array(lse.shape, dtype="float32")
        m_hbm = cuda.device_array(lse.shape, dtype="float32")
        return (q, k, v, o, lse, l_hbm, m_hbm, scale)

    @staticmethod
    def base_types(kind: str = "float16"):
        """q, k, v (bits), o, lse, l, m, scale: the arguments before the captured arrays (MmaKernel.argtypes), for inputs of `kind`."""
        bits, out, stat = MmaKernel.array_types(kind)
        return (bits, bits, bits, out, stat, stat, stat, float32)


@functools.lru_cache(maxsize=None)
def make_v1_mma(kind: str, warps: int, block_k: int, head_dim: int, causal: bool,
                async_copy: bool | None = None, mod=None, mask_form: str = "none",
                value_dim: int | None = None, row_blocks: int = 1) -> MmaV1Kernel:
    """The tensor-core v1 kernel (arguments as make_v2_mma; row_blocks 1 only: a v1 block owns a K/V tile and
    walks its query tiles 16 rows a warp); cached."""
    if row_blocks != 1:
        raise ValueError(f"row_blocks must be 1 for v1-mma (one m16 row block a warp), got {row_blocks}")
    if async_copy is None:
        async_copy = all(x % async_multiple(kind) == 0 for x in (head_dim, value_dim or head_dim))
    return MmaV1Kernel(MmaConfig(kind, warps, block_k, head_dim, bool(causal), bool(async_copy), mod, mask_form,
                                 value_dim or 0), kernel_source)


MmaV1Kernel.make = staticmethod(make_v1_mma)  # without_async goes back through the cache

__all__ = ["MmaV1Kernel", "kernel_source", "make_v1_mma"]
