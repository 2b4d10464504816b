"""The backward on tensor cores (proofs/L7, with the two 16-bit roundings of proofs/L7's tensor-core part):
dQ, dK, dV with mma.sync m16n8k16 from float16 or bfloat16 Q, K, V, dO, the forward's LSE and D = rowsum(dO o O).

Two kernels, both on the forward engine's staging and fragment conventions (kernels.mma.engine, proofs/L10):

- `kv` (K/V outer, FlashAttention-2's backward): one block of W warps per (key tile j of B_c = 16 W keys, batch,
  K/V head); warp w owns keys 16 w .. 16 w + 15 and keeps their dK, dV accumulators in registers while the
  block walks the query heads of its group and their query tiles i (B_r rows) that see tile j. Per visit, in
  the transposed frame (a lane holds keys g, g + 8 and query columns 2t, 2t + 1 of each 8-column block):
      S^T  = K_j Q_i^T        A: K_j rows by ldmatrix.x4 (row-major K, as the forward's Q), read once per
                               k-step for two 8-query blocks
                               B: Q_i^T by ldmatrix.x4, two 8-query blocks a load (row-major Q, as the
                               forward's K)
      dP^T = V_j dO_i^T       A: V_j rows by ldmatrix.x4, B: dO_i^T by ldmatrix.x4, as S^T's
      P^T  = exp(scale S^T - LSE), dS^T = P^T o (dP^T - D)  on the fragments (0 at masked pairs; P^T by
                               ex2.approx of (scale S^T) log2(e) - LSE log2(e): proofs/L7, the ex2 weights)
      dV  += P^T dO_i         A: P^T's own fragments, rounded to 16 bits (no data moves: L10 claim 5)
                               B: dO_i by ldmatrix.x4.trans, two 8-column blocks a load (as the forward's V)
      dK  += dS^T Q_i         A: dS^T's fragments rounded to 16 bits, B: Q_i by ldmatrix.x4.trans
      dQ_i += scale dS K_j    the reduction runs over the block's keys, which all W warps hold: dS^T goes
                               through shared memory (16-bit, rows B_r + 8 apart), A: dS by ldmatrix.x4.trans
                               of it, B: K_j by ldmatrix.x2.trans; each warp takes whole 16-row slices of dQ_i
                               and adds its fragments into the float32 dQ in HBM with atomic adds.
  With `deterministic`, the dQ part is left out (no shared dS, no atomics) and the `dq` kernel computes dQ.
- `dq` (Q outer, the deterministic mode's second pass): one block of W warps per (query tile i of 16 W rows,
  batch, query head), as the forward's v2: S = Q_i K_j^T and dP = dO_i V_j^T (A: Q_i's and dO_i's fragments,
  read once; B: K_j, V_j by ldmatrix.x2), dS on the fragments, dQ += dS K_j (A: dS's fragments rounded to 16
  bits, B: K_j by ldmatrix.x4.trans, two 8-column blocks a load); dQ written once, no atomics: bitwise
  repeatable.

D and the zeroing of dQ come from the CUDA-core backward's `preprocess` kernel (kernels.backward): it reads O and
dO once, whatever their dtype.

HBM traffic per (batch, head), in elements, that of the CUDA-core backward's orders (iomodel.traffic_backward,
"kv"): K_j, V_j read once per block; Q_i, dO_i, LSE_i, D_i once per visit; dQ_i read and written per visit by
the atomic adds (or, deterministic, the `dq` pass: Q_i, dO_i, LSE_i, D_i once, K_j, V_j per visible tile, dQ
written once); dK, dV written once.

Non-finite inputs (proofs/L7.8): a masked pair is never multiplied. S and dP are pair-local (an entry reads one
row of each operand), so their masked entries are overwritten with 0; the three reductions are not: the tensor
core would multiply a masked pair's 0 by the other operand, and 0 x inf is NaN. So a tile that masks some pair
and holds an inf or NaN among its staged Q_i, dO_i, K_j, V_j takes an exact path on the CUDA cores for those
reductions over the visible pairs only (`exact_*`: the warp's P and dS go through shared memory, rounded to 16
bits as the mma path reads them, and each lane sums its entries over the visible pairs). Only a causal or block
mask hides a key from a row when both hold data: without one, the masked pairs involve a padded row or key,
staged as zeros, so their products are 0 whatever the data holds, and the unmasked kernels have no exact path. A
NaN then reaches exactly the gradients the dense formula puts it in; the other entries of such a tile are
computed in another order than the mma path's (within the rule, not bitwise the NaN-free run's).

Masks (kernels.mma.masking): causal in closed form, or a block mask's lists (every list form, one mask or one per
(batch, head)): the kv kernel walks the query tiles of key tile j in its slice's column lists, per query head
under GQA; the dq pass the key tiles of query tile i in the row lists, each built for the kernel's own tiles.

A value head dim of its own (d_v != d, `MmaBackwardConfig.value_dim`): V_j and dO_i are staged d_v wide (the
engine's value stagers), dP^T = V_j dO_i^T runs over d_v's k-steps and S^T over d's (one loop, each product
where its k-step exists), dV is accumulated and written d_v wide; Q, K, dQ, dK keep d. The traffic above then
counts V, O, dO and dV d_v wide (iomodel.traffic_backward's d_v).

Limits: float16 and bfloat16 (float32 on tensor cores, 3xTF32, is not built); d, d_v <= 128; static shared memory
<= 48 KB; tiles: kv B_c = 16 W, B_r a multiple of 16 up to 32 W with B_r / 16 and W dividing one another;
dq B_r = 16 W, B_c a multiple of 16. Defaults (DEFAULTS) by head dim.
Whole-kernel estimate: docs/profile.md (`profile --orders bwd-kv-mma,bwd-kv-mma-det,bwd-dq-mma`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from numba import cuda, float32, uint16, uint32

from fa_numba.kernels.block_lists import LIST_FORMS, kernel_mask, mask_arrays, mask_types
from fa_numba.kernels.mma import masking
from fa_numba.kernels.mma.products16 import fragments_times_staged
from fa_numba.kernels.score_mod import NO_CAPTURED, KernelMod, apply_fn, apply_grad, has_scores, tuple_type
from fa_numba.tiling import PARTIAL

from fa_numba import backend, warp
from fa_numba.kernels.common import ZERO, ValueDim, check_grid, check_sequence
from fa_numba.kernels.mma.engine import (KINDS, LOG2E, MAX_HEAD_DIM, SHARED_LIMIT, MmaConfig, PaddedRows,
                                         async_multiple, make_ops)

ROLES = ("kv", "dq")
# default (warps, block_q, block_k) per role and largest head dim: the largest tiles under 48 KB of static
# shared memory (kv: K, V, Q, dO staged, dS^T and LSE, D; dq: Q, dO, K, V staged)
# (the kv kernel's B_r is small because its registers hold dK, dV, P^T and dS^T: B_r = 32 at d = 64 compiles to
# 234 registers, 64 to 255 and spills; 16 at d = 128 to 254 without spills, sm_90a, 2026-12-02)
DEFAULTS = {"kv": ((64, (4, 32, 64)), (128, (4, 16, 64))), "dq": ((64, (4, 64, 64)), (128, (2, 32, 32)))}


def default_tiles(role: str, head_dim: int) -> tuple[int, int, int]:
    """(warps, block_q, block_k) of `role` for head dim d (DEFAULTS)."""
    for bound, tiles in DEFAULTS[role]:
        if head_dim <= bound:
            return tiles
    raise ValueError(f"head dim d must be <= {MAX_HEAD_DIM} for the tensor-core backward, got {head_dim}")


@dataclass(frozen=True)
class MmaBackwardConfig(ValueDim, PaddedRows):
    """A compile-time configuration of a tensor-core backward kernel. V, dO and dV have V's head dim d_v
    (value_dim; 0: d): staged, multiplied and written d_v wide, Q, K, dQ, dK d wide."""

    role: str  # "kv" (dK, dV on chip; dQ by atomics unless deterministic) or "dq" (the deterministic dQ pass)
    kind: str  # "float16" or "bfloat16"
    warps: int
    block_q: int
    block_k: int
    head_dim: int
    causal: bool
    deterministic: bool = False  # kv only: leave dQ to the dq kernel
    async_copy: bool = False
    mod: KernelMod | None = None  # a score mod with its grad (kernels.score_mod), on the S and dS fragments
    mask_form: str = "none"  # "none" / "causal" (by `causal`) or a block mask's list form (kernels.mma.masking)
    value_dim: int = 0  # d_v, V's, dO's and dV's head dim where it differs from d; 0: head_dim

    @property
    def lists(self) -> bool:
        return self.mask_form in LIST_FORMS

    @property
    def padded_value_dim(self) -> int:
        """d_v padded as d is: V_j's and dO_i's staged columns, dV's accumulator columns."""
        return self.staging().padded_value_dim

    @property
    def value_row_stride(self) -> int:
        """Elements between V_j's and dO_i's staged rows (row_stride's rule on d_v)."""
        return self.staging().value_row_stride

    @property
    def ds_stride(self) -> int:
        return self.block_q + 8

    @property
    def shared_bytes(self) -> int:
        staged = 2 * (self.row_stride + self.value_row_stride) * (self.block_q + self.block_k)  # Q, K; dO, V
        ds = 2 * self.block_k * self.ds_stride if self.role == "kv" else 2 * self.block_q * (self.block_k + 8)
        stats = 8 * self.block_q
        return staged + ds + stats

    def staging(self) -> MmaConfig:
        """The forward engine's configuration whose staging helpers this kernel uses (threads, d, kind)."""
        return MmaConfig(self.kind, self.warps, 16, self.head_dim, self.causal, self.async_copy,
                         value_dim=self.value_dim)

    def check(self) -> "MmaBackwardConfig":
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kind not in KINDS:
            raise ValueError(f"dtype must be one of {KINDS} for the tensor-core backward (float32 by 3xTF32 is not "
                             f"built yet), got {self.kind!r}")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"warps must be 1, 2, 4 or 8, got {self.warps}")
        for name, size in (("head dim d", self.head_dim), ("value head dim d_v", self.d_v)):
            if not 1 <= size <= MAX_HEAD_DIM:
                raise ValueError(f"{name} must be in 1..{MAX_HEAD_DIM} for the tensor-core backward, got {size}")
        for name, size in (("block_q", self.block_q), ("block_k", self.block_k)):
            if size <= 0 or size % 16:
                raise ValueError(f"{name} must be a positive multiple of 16 (the mma's 16 rows and k-step), got "
                                 f"{size}")
        owned, name = (self.block_k, "block_k") if self.role == "kv" else (self.block_q, "block_q")
        if owned != 16 * self.warps:
            raise ValueError(f"{name} must be 16 x warps = {16 * self.warps} for the {self.role} kernel (16 rows "
                             f"per warp), got {owned}")
        slices = self.block_q // 16
        if self.role == "kv" and self.block_q > 32 * self.warps:
            raise ValueError(f"block_q must be at most 32 x warps = {32 * self.warps} for the kv kernel (a thread "
                             f"stages each row's LSE and D), got {self.block_q}")
        if self.role == "kv" and slices % self.warps and self.warps % slices:
            raise ValueError(f"block_q / 16 = {slices} and warps = {self.warps} must divide one another (the "
                             f"warps share dQ_i's 16-row slices)")
        if self.role == "kv" and self.warps > slices and (self.padded_dim // 8) % (self.warps // slices):
            raise ValueError(f"head dim {self.head_dim}: its {self.padded_dim // 8} 8-column blocks do not split "
                             f"over {self.warps // slices} warps per dQ slice")
        for name, size in (("head dim d", self.head_dim), ("value head dim d_v", self.d_v)):
            if self.async_copy and size % async_multiple(self.kind):
                raise ValueError(f"async_copy needs the {name} to be a multiple of {async_multiple(self.kind)} "
                                 f"(16-byte rows), got {size}")
        if self.shared_bytes > SHARED_LIMIT:
            dims = f"d {self.head_dim}" + (f", d_v {self.value_dim}" if self.value_dim else "")
            raise ValueError(f"block_q {self.block_q}, block_k {self.block_k}, {dims}: "
                             f"{self.shared_bytes} bytes of shared memory, over the {SHARED_LIMIT} static limit")
        masking.make(self.causal, self.mask_form, self.mod)
        return self


@cuda.jit(device=True, inline=True)
def store_pair(tile, index, bits):
    """Two 16-bit values packed in `bits` (lower index in the low half) at tile[index], tile[index + 1]."""
    tile[index] = uint16(bits & 0xFFFF)
    tile[index + 1] = uint16(bits >> 16)


def _row_writer(D: int, DN: int):
    """write_rows(dst, b, h, row0, n, acc, factor, t): this lane's accumulator fragments (rows row0, row0 + 8
    of the C layout, columns 8 dn + 2t, 8 dn + 2t + 1) times factor into dst[b, h], rows < n and columns < d."""

    @cuda.jit(device=True, inline=True)
    def write_rows(dst, b, h, row0, n, acc, factor, t):
        for half in range(2):
            row = row0 + 8 * half
            if row < n:
                for dn in range(DN):
                    for e in range(2):
                        x = 8 * dn + 2 * t + e
                        if x < D:
                            dst[b, h, row, x] = factor * acc[dn, 2 * half + e]

    return write_rows


def _exact_product(count: int, stride: int, DN: int, SQ: int, to_f32, visible, lane_owns_keys: bool):
    """The exact path's product, acc += X src over the visible pairs only, on the CUDA cores in float32 (module
    docstring, non-finite inputs): X is the warp's two rows local0, local0 + 8 of a 16-bit buffer (`stride`
    apart; P^T, dS^T or dS as the mma path reads them, rounded), src a staged tile (rows SQ apart), and the
    reduction runs over `count` entries r, src's rows. The lane's two rows are keys own0, own0 + 8 against
    queries other0 + r (lane_owns_keys: dV, dK in the kv kernel) or queries own0, own0 + 8 against keys
    other0 + r (dQ in the dq pass)."""

    @cuda.jit(device=True, inline=True)
    def exact(acc, buf, src, own0, local0, other0, n_q, n_k, delta, t, lohis, denses, sb, sh, b, h, captured):
        for r in range(count):
            if lane_owns_keys:
                see0 = visible(other0 + r, own0, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
                see1 = visible(other0 + r, own0 + 8, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
            else:
                see0 = visible(own0, other0 + r, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
                see1 = visible(own0 + 8, other0 + r, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
            if see0 or see1:
                x0, x1 = to_f32(buf[local0 * stride + r]), to_f32(buf[(local0 + 8) * stride + r])
                for dn in range(DN):
                    for e in range(2):
                        y = to_f32(src[r * SQ + 8 * dn + 2 * t + e])
                        if see0:
                            acc[dn, e] += x0 * y
                        if see1:
                            acc[dn, 2 + e] += x1 * y

    return exact


def kv_source(config: MmaBackwardConfig):
    """The Python function of the K/V-outer kernel (cuda.jit compiles it for a launch, fa_numba.profile for
    sm_90a): bwd_kv_mma(q, k, v, do, lse, dvec, dq, dk, dv, scale)."""
    E = make_ops(config.staging())
    stage_two, any_bad, any_bad_v, mma, pack, to_f32 = E.stage_two, E.any_bad, E.any_bad_v, E.mma, E.pack, E.to_f32
    W, BR, BC, D, DP, SQ, SDS = (config.warps, config.block_q, config.block_k, config.head_dim, config.padded_dim,
                                 config.row_stride, config.ds_stride)
    KS, NQ, DN, KQ, KK = DP // 16, BR // 8, DP // 8, BR // 16, BC // 16
    # V_j, dO_i and dV at d_v: their k-steps (dP^T = V_j dO_i^T), column blocks (dV) and row stride
    DV, SV = E.sizes.DV, E.sizes.SV
    KSV, DNV, KSM = E.sizes.DPV // 16, E.sizes.DNV, max(DP, E.sizes.DPV) // 16
    SLICES = BR // 16
    SPLIT = W // SLICES if W > SLICES else 1  # warps sharing one 16-row slice of dQ_i, each DN / SPLIT blocks
    DNS, UNITS = DN // SPLIT, SLICES * SPLIT
    CAUSAL, ATOMIC_DQ = config.causal, not config.deterministic
    HOLD = max(DP, E.sizes.DPV) <= 64  # K_j's and V_j's A fragments held in registers for the block's life
    # Only a causal visit or a block mask can mask a pair between two rows that hold data: without them the
    # masked pairs are those of padded rows or keys (staged as zeros), whose products are 0 whatever the data
    # holds, so the exact path is compiled in for masked kernels only (the module docstring, non-finite inputs)
    M = masking.make(CAUSAL, config.mask_form, config.mod)
    GUARDED, LISTS, PARTIAL_KIND, slot = M.GUARDED, M.LISTS, int(PARTIAL), masking.slot
    PER_WARP = UNITS // W if UNITS >= W else 1  # dQ units per warp, a constant: the loop unrolls
    Q_SIZE, KV_SIZE, DS_SIZE, HELD, HELDV = BR * SQ, BC * SQ, BC * SDS, (KS if HOLD else 1), (KSV if HOLD else 1)
    DO_SIZE, V_SIZE = BR * SV, BC * SV
    visible = M.visible
    exact_reduce = _exact_product(BR, SDS, DN, SQ, to_f32, visible, lane_owns_keys=True)  # dK: over Q_i
    exact_reduce_v = _exact_product(BR, SDS, DNV, SV, to_f32, visible, lane_owns_keys=True)  # dV: over dO_i
    write_rows, write_rows_v = _row_writer(D, DN), _row_writer(DV, DNV)
    MOD = has_scores(config.mod)
    modded, slope = apply_fn(config.mod), apply_grad(config.mod)  # fn and d fn / d score (identity, 1 without)

    @cuda.jit(device=True, inline=True)
    def store_rows(sds, x, wid, g, t):
        """This warp's 16 rows of x^T (P^T or dS^T, 16 keys x B_r queries) into sds, rounded to 16 bits: the
        values its A fragments hold, at rows 16 w + g (+ 8), queries 8 nt + 2t."""
        for nt in range(NQ):
            base = (16 * wid + g) * SDS + 8 * nt + 2 * t
            store_pair(sds, base, pack(x[nt, 0], x[nt, 1]))
            store_pair(sds, base + 8 * SDS, pack(x[nt, 2], x[nt, 3]))

    # acc += X^T src: X^T's A fragments the warp's own (x: 16 keys x B_r queries in the C layout, rounded to 16
    # bits), src (Q_i or dO_i, B_r x DP) B fragments by ldmatrix x4 .trans, two column blocks a load
    product = fragments_times_staged(KQ, DN, SQ, mma, pack)
    product_v = fragments_times_staged(KQ, DNV, SV, mma, pack)  # dV += P^T dO_i, d_v wide

    @cuda.jit(device=True, inline=True)
    def exact_dq(sds, sk, dq, b, h, row0, local0, c0, part, scale, n_q, n_k, delta, t, lohis, denses, sb, sh,
                 captured):
        """dQ_i += scale dS K_j over the visible pairs only, on the CUDA cores in float32, for this lane's entries
        of the slice's column blocks `part` (dS from shared memory, 16-bit as the mma path reads it)."""
        for dd in range(DNS):
            dn = part * DNS + dd
            for e in range(4):
                row, local = row0 + 8 * (e >> 1), local0 + 8 * (e >> 1)
                x = 8 * dn + 2 * t + (e & 1)
                total = ZERO
                for c in range(BC):
                    if visible(row, c0 + c, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured):
                        total += to_f32(sds[c * SDS + local]) * to_f32(sk[c * SQ + x])
                if row < n_q and x < D:
                    cuda.atomic.add(dq, (b, h, row, x), scale * total)

    @cuda.jit(device=True, inline=True)
    def add_dq(dq, b, h, row0, dn, d4, scale, n_q, t):
        """Atomically add scale x this lane's dQ fragment (rows row0, row0 + 8; 8-column block dn) into dQ."""
        for e in range(4):
            row = row0 + 8 * (e >> 1)
            x = 8 * dn + 2 * t + (e & 1)
            if row < n_q and x < D:
                cuda.atomic.add(dq, (b, h, row, x), scale * d4[e])

    def bwd_kv_mma(q, k, v, do, lse, dvec, dq, dk, dv, scale, row_ptrs, col_idxs, col_kinds, col_ptrs, row_idxs,
                   row_kinds, lohis, denses, captured):
        sk = cuda.shared.array(KV_SIZE, uint16)
        sv = cuda.shared.array(V_SIZE, uint16)
        sq = cuda.shared.array(Q_SIZE, uint16)
        sdo = cuda.shared.array(DO_SIZE, uint16)
        sds = cuda.shared.array(DS_SIZE, uint16)  # P^T or dS^T of the block's keys, 16-bit, [key][query]
        slse = cuda.shared.array(BR, float32)
        sd = cuda.shared.array(BR, float32)
        kf = cuda.local.array((HELD, 4), uint32)  # K_j's and V_j's A fragments (HOLD)
        vf = cuda.local.array((HELDV, 4), uint32)
        s = cuda.local.array((NQ, 4), float32)  # P^T: the warp's 16 keys x B_r queries
        dp = cuda.local.array((NQ, 4), float32)  # dS^T
        dka = cuda.local.array((DN, 4), float32)  # dK's accumulator (without the scale): 16 keys x DP
        dva = cuda.local.array((DNV, 4), float32)  # dV's: 16 keys x d_v padded
        af = cuda.local.array((KK, 4), uint32)  # dS's A fragments of one dQ slice
        j, bh = cuda.blockIdx.x, cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane, wid = tid & 31, tid >> 5
        g, t = lane >> 2, lane & 3
        mrow, mat = lane & 7, lane >> 3
        heads, heads_kv, n_q, n_k = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
        group = heads // heads_kv
        b = bh // heads_kv
        hk = bh - b * heads_kv
        delta = n_k - n_q
        c0 = j * BC
        key0 = c0 + 16 * wid + g  # this lane's keys: key0 and key0 + 8
        n_row_tiles = (n_q + BR - 1) // BR
        first = 0
        if CAUSAL:  # the first row that sees key c0 is c0 - delta
            first = max(c0 - delta, 0) // BR
        for dn in range(max(DN, DNV)):
            for e in range(4):
                if dn < DN:
                    dka[dn, e] = ZERO
                if dn < DNV:
                    dva[dn, e] = ZERO
        visited = first < n_row_tiles  # some query tile (of some query head of the group) sees key tile j
        if LISTS:
            visited = False
            for hh in range(group):
                sb, sh = slot(lohis, b, hk * group + hh)
                visited = visited or col_ptrs[sb, sh, j + 1] > col_ptrs[sb, sh, j]
        if not visited:  # a key tile no query tile sees is never read: dK_j = dV_j = 0 (the whole block returns)
            write_rows(dk, b, hk, key0, n_k, dka, scale, t)
            write_rows_v(dv, b, hk, key0, n_k, dva, float32(1), t)
            return

        stage_two(k, v, b, hk, c0, n_k, sk, sv, BC)
        cuda.syncthreads()  # K_j, V_j staged: every thread reaches this barrier
        kv_bad = False
        if GUARDED:
            kv_bad = cuda.syncthreads_or(1 if (any_bad(sk, BC) or any_bad_v(sv, BC)) else 0) != 0
        if HOLD:
            for ks in range(KSM):
                if ks < KS:
                    a = warp.ldmatrix_x4(sk, (16 * wid + mrow + 8 * (mat & 1)) * SQ + 16 * ks + 8 * (mat >> 1))
                    for e in range(4):
                        kf[ks, e] = a[e]
                if ks < KSV:
                    c = warp.ldmatrix_x4(sv, (16 * wid + mrow + 8 * (mat & 1)) * SV + 16 * ks + 8 * (mat >> 1))
                    for e in range(4):
                        vf[ks, e] = c[e]

        for hh in range(group):
            h = hk * group + hh
            # the query tiles that see key tile j: from `first` on (causal) or all, or the listed ones
            # row_idx[col_ptr[j]:col_ptr[j + 1]] of this query head's slice (L8; under GQA the query heads of
            # one K/V head may have different lists)
            sb, sh = slot(lohis, b, h)
            start, stop = first, n_row_tiles
            if LISTS:
                start, stop = col_ptrs[sb, sh, j], col_ptrs[sb, sh, j + 1]
            for idx in range(start, stop):
                i = row_idxs[sb, sh, idx] if LISTS else idx
                r0 = i * BR
                cuda.syncthreads()  # the previous visit's Q, dO and sds are no longer read
                if tid < BR:  # B_r <= 32 W threads (DEFAULTS): one row each, no loop in the visit
                    row = r0 + tid
                    slse[tid] = lse[b, h, row] * LOG2E if row < n_q else ZERO  # LSE_i log2(e): P by ex2
                    sd[tid] = dvec[b, h, row] if row < n_q else ZERO
                stage_two(q, do, b, h, r0, n_q, sq, sdo, BR)
                cuda.syncthreads()  # Q_i, dO_i, LSE_i, D_i staged
                # some pair of the visit is masked: causal (key c0 + BC - 1 hidden from row r0) or a PARTIAL tile
                # of the lists, or a tail
                hidden = row_kinds[sb, sh, idx] == PARTIAL_KIND if LISTS else CAUSAL and c0 + BC - 1 > r0 + delta
                masked = hidden or c0 + BC > n_k or r0 + BR > n_q
                guard = False
                if GUARDED and masked:  # the same for the whole block: every thread reaches this barrier
                    bad = kv_bad or any_bad(sq, BR) or any_bad_v(sdo, BR)
                    guard = cuda.syncthreads_or(1 if bad else 0) != 0

                # S^T and dP^T in s and dp, two 8-query blocks at a time: K_j's and V_j's A fragments read once per
                # k-step for both (at d = 128, B_r = 16, once per visit), Q_i's and dO_i's B fragments of the two
                # blocks by one ldmatrix x4 each (NQ = B_r / 8 is even); each block's sum runs over the k-steps in
                # order, as before
                for np_ in range(NQ // 2):
                    d4, d5 = (ZERO, ZERO, ZERO, ZERO), (ZERO, ZERO, ZERO, ZERO)  # S^T: blocks 2 np_, 2 np_ + 1
                    e4, e5 = (ZERO, ZERO, ZERO, ZERO), (ZERO, ZERO, ZERO, ZERO)  # dP^T
                    for ks in range(KSM):  # S^T's k-steps run over d, dP^T's over d_v
                        if HOLD:
                            if ks < KS:
                                ak = (kf[ks, 0], kf[ks, 1], kf[ks, 2], kf[ks, 3])
                            if ks < KSV:
                                av = (vf[ks, 0], vf[ks, 1], vf[ks, 2], vf[ks, 3])
                        else:
                            if ks < KS:
                                ak = warp.ldmatrix_x4(sk, (16 * wid + mrow + 8 * (mat & 1)) * SQ + 16 * ks
                                                      + 8 * (mat >> 1))
                            if ks < KSV:
                                av = warp.ldmatrix_x4(sv, (16 * wid + mrow + 8 * (mat & 1)) * SV + 16 * ks
                                                      + 8 * (mat >> 1))
                        if ks < KS:
                            bq = warp.ldmatrix_x4(sq, (16 * np_ + 8 * (mat >> 1) + mrow) * SQ + 16 * ks
                                                  + 8 * (mat & 1))
                        if ks < KSV:
                            bo = warp.ldmatrix_x4(sdo, (16 * np_ + 8 * (mat >> 1) + mrow) * SV + 16 * ks
                                                  + 8 * (mat & 1))
                        if ks < KS:
                            d4 = mma(d4, ak, (bq[0], bq[1]))
                            d5 = mma(d5, ak, (bq[2], bq[3]))
                        if ks < KSV:
                            e4 = mma(e4, av, (bo[0], bo[1]))
                            e5 = mma(e5, av, (bo[2], bo[3]))
                    for e in range(4):
                        s[2 * np_, e], s[2 * np_ + 1, e] = d4[e], d5[e]
                        dp[2 * np_, e], dp[2 * np_ + 1, e] = e4[e], e5[e]
                for nt in range(NQ):  # P^T and dS^T in place, 0 at masked pairs
                    for e in range(4):
                        d4e, e4e = s[nt, e], dp[nt, e]
                        col = 8 * nt + 2 * t + (e & 1)
                        p, ds = ZERO, ZERO
                        if not masked or visible(r0 + col, key0 + 8 * (e >> 1), n_q, n_k, delta, lohis, denses, sb, sh,
                                                 b, h, captured):
                            x = scale * d4e
                            if MOD:  # P = exp(mod(S) - LSE), dS = P (dP - D) mod'(S) (proofs/L13)
                                p = warp.ex2(modded(x, b, h, r0 + col, key0 + 8 * (e >> 1), captured) * LOG2E
                                             - slse[col])
                                ds = p * (e4e - sd[col]) * slope(x, b, h, r0 + col, key0 + 8 * (e >> 1), captured)
                            else:
                                p = warp.ex2(x * LOG2E - slse[col])  # exp(x - LSE): proofs/L7, the ex2 weights
                                ds = p * (e4e - sd[col])
                        s[nt, e] = p
                        dp[nt, e] = ds

                if guard:  # the warp's own rows of sds: P^T for dV, then dS^T for dK (and dQ)
                    store_rows(sds, s, wid, g, t)
                    cuda.syncwarp()
                    exact_reduce_v(dva, sds, sdo, key0, 16 * wid + g, r0, n_q, n_k, delta, t, lohis, denses, sb, sh, b,
                                   h, captured)
                    cuda.syncwarp()
                    store_rows(sds, dp, wid, g, t)
                    cuda.syncwarp()
                    exact_reduce(dka, sds, sq, key0, 16 * wid + g, r0, n_q, n_k, delta, t, lohis, denses, sb, sh, b, h,
                                 captured)
                else:
                    product_v(dva, s, sdo, mrow, mat)
                    product(dka, dp, sq, mrow, mat)
                    if ATOMIC_DQ:
                        store_rows(sds, dp, wid, g, t)

                if ATOMIC_DQ:
                    cuda.syncthreads()  # dS^T of every warp's keys is in shared memory
                    for u in range(PER_WARP):  # dQ_i's 16-row slice mi, its column blocks `part`
                        unit = wid + u * W
                        mi = unit // SPLIT
                        part = unit - mi * SPLIT
                        row0 = r0 + 16 * mi + g
                        if guard:
                            exact_dq(sds, sk, dq, b, h, row0, 16 * mi + g, c0, part, scale, n_q, n_k, delta, t, lohis,
                                     denses, sb, sh, captured)
                        else:
                            for kk in range(KK):
                                a = warp.ldmatrix_x4_trans(sds, (16 * kk + mrow + 8 * (mat >> 1)) * SDS + 16 * mi
                                                           + 8 * (mat & 1))
                                for e in range(4):
                                    af[kk, e] = a[e]
                            for dd in range(DNS):
                                dn = part * DNS + dd
                                d4 = (ZERO, ZERO, ZERO, ZERO)
                                for kk in range(KK):
                                    bk = warp.ldmatrix_x2_trans(sk, (16 * kk + mrow + 8 * (mat & 1)) * SQ + 8 * dn)
                                    d4 = mma(d4, (af[kk, 0], af[kk, 1], af[kk, 2], af[kk, 3]), bk)
                                add_dq(dq, b, h, row0, dn, d4, scale, n_q, t)

        write_rows(dk, b, hk, key0, n_k, dka, scale, t)
        write_rows_v(dv, b, hk, key0, n_k, dva, float32(1), t)

    return bwd_kv_mma


def dq_source(config: MmaBackwardConfig):
    """The Python function of the deterministic dQ pass: bwd_dq_mma(q, k, v, do, lse, dvec, dq, scale)."""
    E = make_ops(config.staging())
    stage_two, any_bad, any_bad_v, mma, pack, to_f32 = E.stage_two, E.any_bad, E.any_bad_v, E.mma, E.pack, E.to_f32
    BR, BC, D, DP, SQ = config.block_q, config.block_k, config.head_dim, config.padded_dim, config.row_stride
    KS, NT, DN, PK = DP // 16, BC // 8, DP // 8, BC // 16
    SV, KSV, KSM = E.sizes.SV, E.sizes.DPV // 16, max(DP, E.sizes.DPV) // 16  # dP = dO_i V_j^T runs over d_v
    CAUSAL = config.causal
    SDK = BC + 8  # the exact path's dS rows, 16-bit, B_c + 8 apart
    M = masking.make(CAUSAL, config.mask_form, config.mod)  # as in the kv kernel
    GUARDED, LISTS, PARTIAL_KIND, slot, visible = M.GUARDED, M.LISTS, int(PARTIAL), masking.slot, M.visible
    exact_dq = _exact_product(BC, SDK, DN, SQ, to_f32, visible, lane_owns_keys=False)
    write_rows = _row_writer(D, DN)
    Q_SIZE, KV_SIZE, DS_SIZE, DO_SIZE, V_SIZE = BR * SQ, BC * SQ, BR * SDK, BR * SV, BC * SV
    MOD = has_scores(config.mod)
    modded, slope = apply_fn(config.mod), apply_grad(config.mod)

    def bwd_dq_mma(q, k, v, do, lse, dvec, dq, scale, row_ptrs, col_idxs, col_kinds, col_ptrs, row_idxs, row_kinds,
                   lohis, denses, captured):
        sq = cuda.shared.array(Q_SIZE, uint16)
        sdo = cuda.shared.array(DO_SIZE, uint16)
        sk = cuda.shared.array(KV_SIZE, uint16)
        sv = cuda.shared.array(V_SIZE, uint16)
        sds = cuda.shared.array(DS_SIZE, uint16)  # the exact path's dS, each warp its own 16 rows
        slse = cuda.shared.array(BR, float32)  # LSE_i and D_i, read once per row (not once per lane of a quad)
        sd = cuda.shared.array(BR, float32)
        qf = cuda.local.array((KS, 4), uint32)  # this lane's A fragments of Q_i and dO_i
        of = cuda.local.array((KSV, 4), uint32)
        dp = cuda.local.array((NT, 4), float32)  # dS of the warp's 16 rows x B_c keys
        acc = cuda.local.array((DN, 4), float32)  # dQ without the scale
        i, bh = cuda.blockIdx.x, cuda.blockIdx.y
        lane, wid = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
        g, t = lane >> 2, lane & 3
        mrow, mat = lane & 7, lane >> 3
        heads, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
        b = bh // heads
        h = bh - b * heads
        h_kv = h // (heads // k.shape[1])
        delta = n_k - n_q
        r0 = i * BR
        row0 = r0 + 16 * wid + g
        last = min(r0 + BR, n_q) - 1 + delta
        sb, sh = slot(lohis, b, h)
        start, stop = 0, (n_k + BC - 1) // BC  # the key tiles as the forward's v2 walks them
        if CAUSAL:
            stop = min(stop, (last + BC) // BC) if last >= 0 else 0
        if LISTS:
            start, stop = row_ptrs[sb, sh, i], row_ptrs[sb, sh, i + 1]

        stage_two(q, do, b, h, r0, n_q, sq, sdo, BR)
        tid = cuda.threadIdx.x
        if tid < BR:  # B_r = 16 W rows for 32 W threads: one row each
            slse[tid] = lse[b, h, r0 + tid] * LOG2E if r0 + tid < n_q else ZERO  # LSE_i log2(e): P by ex2
            sd[tid] = dvec[b, h, r0 + tid] if r0 + tid < n_q else ZERO
        cuda.syncthreads()
        q_bad = False
        if GUARDED:
            q_bad = cuda.syncthreads_or(1 if (any_bad(sq, BR) or any_bad_v(sdo, BR)) else 0) != 0
        for ks in range(KSM):
            if ks < KS:
                a = warp.ldmatrix_x4(sq, (16 * wid + mrow + 8 * (mat & 1)) * SQ + 16 * ks + 8 * (mat >> 1))
                for e in range(4):
                    qf[ks, e] = a[e]
            if ks < KSV:
                o = warp.ldmatrix_x4(sdo, (16 * wid + mrow + 8 * (mat & 1)) * SV + 16 * ks + 8 * (mat >> 1))
                for e in range(4):
                    of[ks, e] = o[e]
        local = 16 * wid + g
        lse0, lse1, d0, d1 = slse[local], slse[local + 8], sd[local], sd[local + 8]
        for dn in range(DN):
            for e in range(4):
                acc[dn, e] = ZERO
        for idx in range(start, stop):
            j = col_idxs[sb, sh, idx] if LISTS else idx
            c0 = j * BC
            cuda.syncthreads()  # the previous K_j, V_j are no longer read
            stage_two(k, v, b, h_kv, c0, n_k, sk, sv, BC)
            cuda.syncthreads()
            hidden = col_kinds[sb, sh, idx] == PARTIAL_KIND if LISTS else CAUSAL and c0 + BC - 1 > r0 + delta
            masked = hidden or c0 + BC > n_k or r0 + BR > n_q
            guard = False
            if GUARDED and masked:
                bad = q_bad or any_bad(sk, BC) or any_bad_v(sv, BC)
                guard = cuda.syncthreads_or(1 if bad else 0) != 0
            for nt in range(NT):
                d4 = (ZERO, ZERO, ZERO, ZERO)
                e4 = (ZERO, ZERO, ZERO, ZERO)
                for ks in range(KSM):  # S's k-steps run over d, dP's over d_v
                    if ks < KS:
                        d4 = mma(d4, (qf[ks, 0], qf[ks, 1], qf[ks, 2], qf[ks, 3]),
                                 warp.ldmatrix_x2(sk, (8 * nt + mrow) * SQ + 16 * ks + 8 * (mat & 1)))
                    if ks < KSV:
                        e4 = mma(e4, (of[ks, 0], of[ks, 1], of[ks, 2], of[ks, 3]),
                                 warp.ldmatrix_x2(sv, (8 * nt + mrow) * SV + 16 * ks + 8 * (mat & 1)))
                for e in range(4):
                    row = row0 + 8 * (e >> 1)
                    ds = ZERO
                    if not masked or visible(row, c0 + 8 * nt + 2 * t + (e & 1), n_q, n_k, delta, lohis, denses, sb, sh,
                                             b, h, captured):
                        x = scale * d4[e]
                        if MOD:  # as in the kv kernel (proofs/L13)
                            key = c0 + 8 * nt + 2 * t + (e & 1)
                            p = warp.ex2(modded(x, b, h, row, key, captured) * LOG2E - (lse0 if e < 2 else lse1))
                            ds = p * (e4[e] - (d0 if e < 2 else d1)) * slope(x, b, h, row, key, captured)
                        else:
                            p = warp.ex2(x * LOG2E - (lse0 if e < 2 else lse1))
                            ds = p * (e4[e] - (d0 if e < 2 else d1))
                    dp[nt, e] = ds
            if guard:  # the warp's own rows of sds
                for nt in range(NT):
                    base = (16 * wid + g) * SDK + 8 * nt + 2 * t
                    store_pair(sds, base, pack(dp[nt, 0], dp[nt, 1]))
                    store_pair(sds, base + 8 * SDK, pack(dp[nt, 2], dp[nt, 3]))
                cuda.syncwarp()
                exact_dq(acc, sds, sk, row0, 16 * wid + g, c0, n_q, n_k, delta, t, lohis, denses, sb, sh, b, h,
                         captured)
                cuda.syncwarp()
            else:
                for kk in range(PK):
                    da = (pack(dp[2 * kk, 0], dp[2 * kk, 1]), pack(dp[2 * kk, 2], dp[2 * kk, 3]),
                          pack(dp[2 * kk + 1, 0], dp[2 * kk + 1, 1]), pack(dp[2 * kk + 1, 2], dp[2 * kk + 1, 3]))
                    for dp_ in range(DN // 2):  # two 8-column blocks of K_j per ldmatrix x4 .trans (DN is even)
                        index = (16 * kk + mrow + 8 * (mat & 1)) * SQ + 8 * (2 * dp_ + (mat >> 1))
                        bk = warp.ldmatrix_x4_trans(sk, index)
                        for half in range(2):
                            dn = 2 * dp_ + half
                            d4 = mma((acc[dn, 0], acc[dn, 1], acc[dn, 2], acc[dn, 3]), da,
                                     (bk[2 * half], bk[2 * half + 1]))
                            for e in range(4):
                                acc[dn, e] = d4[e]
        write_rows(dq, b, h, row0, n_q, acc, scale, t)

    return bwd_dq_mma


class MmaBackwardKernel:
    """A compiled tensor-core backward kernel (`role` "kv" or "dq"): its config, the Python `source` and its
    cuda.jit `kernel`, and the launch's grid."""

    def __init__(self, config: MmaBackwardConfig):
        self.config = config.check()
        self.source = (kv_source if config.role == "kv" else dq_source)(config)
        self.kernel = cuda.jit(self.source)
        self.GRID_AXES = (("ceil(N_k / block_k)", "batch * heads_kv") if config.role == "kv"
                          else ("ceil(N_q / block_q)", "batch * heads"))

    def launch_shape(self, batch: int, heads: int, rows: int) -> tuple[tuple, tuple]:
        """(grid, block) on (batch, heads, rows): kv blocks over (key tiles, B H_kv), dq over (query tiles, B H)."""
        tile = self.config.block_k if self.config.role == "kv" else self.config.block_q
        return (-(-rows // tile), batch * heads), (32 * self.config.warps,)

    def check_grid(self, batch: int, heads: int, rows: int) -> None:
        check_grid(self.launch_shape(batch, heads, rows)[0], self.GRID_AXES, f"bwd-{self.config.role}-mma")

    def argtypes(self, dtype: str | None = None) -> tuple:
        """The Numba types of the kernel's arguments (what fa_numba.profile compiles for sm_90a): the same for
        both 16-bit dtypes (the inputs are their bits)."""
        from numba import types

        if dtype is not None and dtype != self.config.kind:
            raise ValueError(f"dtype must be {self.config.kind!r} for this kernel (compiled for it), got {dtype!r}")
        bits = types.Array(types.uint16, 4, "C")
        grad, stat = types.Array(types.float32, 4, "C"), types.Array(types.float32, 3, "C")  # dV's d_v: a shape
        trailing = mask_types() + (tuple_type(self.config.mod),)
        if self.config.role == "kv":
            return (bits, bits, bits, bits, stat, stat, grad, grad, grad, float32) + trailing
        return (bits, bits, bits, bits, stat, stat, grad, float32) + trailing

    @property
    def inner_trips(self) -> int | None:
        """How often the loop left inside a visit runs (whole_kernel.mma_iteration_counts): the kv kernel's dQ
        unit loops over its DN / SPLIT column blocks, which the compiler keeps rolled; None for the others."""
        c = self.config
        if c.role != "kv" or c.deterministic:
            return None
        slices, warps, blocks = c.block_q // 16, c.warps, c.padded_dim // 8
        return blocks // (warps // slices if warps > slices else 1)


@functools.lru_cache(maxsize=None)
def make(role: str, kind: str, warps: int, block_q: int, block_k: int, head_dim: int, causal: bool,
         deterministic: bool = False, async_copy: bool | None = None, mod: KernelMod | None = None,
         mask_form: str = "none", value_dim: int = 0) -> MmaBackwardKernel:
    """One tensor-core backward kernel, built once per configuration. async_copy (default: where d and d_v are
    multiples of 8) stages tiles by cp.async; `run` takes the plain-load kernel for inputs not 16-byte aligned.
    mod: a score mod with its grad (and a mask_mod's fn for the "function" form), or None; mask_form: a block
    mask's list form, or "none" / "causal"; value_dim: V's head dim d_v (0: d)."""
    if async_copy is None:
        async_copy = head_dim % 8 == 0 and (value_dim or head_dim) % 8 == 0
    return MmaBackwardKernel(MmaBackwardConfig(role, kind, warps, block_q, block_k, head_dim, bool(causal),
                                               bool(deterministic) and role == "kv", bool(async_copy), mod,
                                               mask_form, value_dim))


def plan(kind: str, head_dim: int, causal: bool, deterministic: bool, block_q=None, block_k=None,
         mod: KernelMod | None = None, mask_form: str = "none", value_dim: int = 0) -> list:
    """The tensor-core kernels one backward call launches after `preprocess`, each with the side its grid
    spans: [kv] or, deterministic, [kv without dQ, dq]. Tiles: both None, each kernel's DEFAULTS (by the wider
    of d and d_v); otherwise (the missing one from kv's defaults) kv takes B_r = block_q, B_c = block_k
    (block_k / 16 warps) and the dq pass the same tiles (block_q / 16 warps), so that both passes visit the
    pairs iomodel counts."""
    widest = max(head_dim, value_dim)
    warps, bq, bk = default_tiles("kv", widest)
    chosen = block_q is not None or block_k is not None
    for name, size in (("block_k", block_k), ("block_q", block_q if deterministic else None)):
        if size is not None and (size <= 0 or size % 16 or size // 16 not in (1, 2, 4, 8)):
            raise ValueError(f"{name} must be 16, 32, 64 or 128 for the tensor-core backward (16 rows per warp), "
                             f"got {size}")
    bk = bk if block_k is None else block_k
    bq = bq if block_q is None else block_q
    kernels = [(make("kv", kind, bk // 16, bq, bk, head_dim, causal, deterministic, mod=mod, mask_form=mask_form,
                     value_dim=value_dim), "kv")]
    if deterministic:
        w, q_rows, k_cols = (bq // 16, bq, bk) if chosen else default_tiles("dq", widest)
        kernels.append((make("dq", kind, w, q_rows, k_cols, head_dim, causal, mod=mod, mask_form=mask_form,
                             value_dim=value_dim), "q"))
    return kernels


def _aligned(*arrays) -> bool:
    from fa_numba.kernels.mma.staging import aligned16

    return all(aligned16(x) for x in arrays)


def run(q, k, v, out, lse, dout, dq, dk, dv, dvec, scale, *, kind, causal, deterministic=False, block_q=None,
        block_k=None, stream=0, mod: KernelMod | None = None, captured=NO_CAPTURED, mask=None,
        mask_form: str = "none") -> None:
    """The tensor-core backward of one call on (B, H, N, d) device arrays: q, k, v, dout float16 arrays or the uint16
    bits of `kind` (the preprocess reads dout as it is, the tensor-core kernels its bits), out as the forward gave
    it (any dtype the CUDA-core preprocess reads), lse float32 (B, H, N_q); v, out and dout with V's head dim d_v
    (which may differ from d); dq (B, H, N_q, d), dk (B, H_kv, N_k, d), dv (B, H_kv, N_k, d_v) float32 outputs,
    dvec (B, H, N_q) float32 workspace for D; mod and captured: a score mod's KernelMod and its device arrays
    (`score_mod.device_arrays`), the forward's; mask: a block mask (a fa_numba.masks mask fixed for these sizes,
    or a slice_masks mask) of kernel form mask_form, its lists built for each kernel's own tiles
    (kernels.block_lists.kernel_mask), or None."""
    from fa_numba.kernels import backward as simt

    batch, heads, n_q, d = q.shape
    heads_kv, n_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    value_dim = d_v if d_v != d else 0
    check_sequence(n_q, n_k)
    if (mask is None) != (mask_form not in LIST_FORMS):
        raise ValueError(f"mask and mask_form disagree: a block mask needs a list form {LIST_FORMS}, got "
                         f"{mask_form!r}")
    kernels = plan(kind, d, causal, deterministic, block_q, block_k, mod, mask_form, value_dim)
    for kernel, side in kernels:
        kernel.check_grid(batch, *((heads, n_q) if side == "q" else (heads_kv, n_k)))
    bits = [x.view(np.uint16) if np.dtype(x.dtype) == np.float16 else x for x in (q, k, v, dout)]
    aligned = _aligned(*bits)
    scale = float32(scale)
    pre = simt.make("preprocess", simt.default_backward_tiles(d)[0], d, False, not deterministic, value_dim=value_dim)
    grid, threads = pre.launch_shape(batch, heads, n_q)
    with backend.serialised(threads[0]):
        pre.kernel[grid, threads, stream](out, dout, dvec, dq)  # D = rowsum(dO o O), and dQ = 0 for the atomics
    for kernel, side in kernels:
        c = kernel.config
        if c.async_copy and not aligned:  # cp.async needs 16-byte rows
            kernel = make(c.role, c.kind, c.warps, c.block_q, c.block_k, c.head_dim, c.causal, c.deterministic,
                          async_copy=False, mod=c.mod, mask_form=c.mask_form, value_dim=c.value_dim)
        grid, block = kernel.launch_shape(batch, *((heads, n_q) if side == "q" else (heads_kv, n_k)))
        args = (*bits, lse, dvec, dq, dk, dv, scale) if c.role == "kv" else (*bits, lse, dvec, dq, scale)
        blocks = kernel_mask(mask, n_q, n_k, c.block_q, c.block_k, batch, heads) if mask is not None else None
        with backend.serialised(block[0]):
            kernel.kernel[grid, block, stream](*args, *mask_arrays(blocks), tuple(captured))


__all__ = ["DEFAULTS", "MmaBackwardConfig", "MmaBackwardKernel", "default_tiles", "dq_source", "kv_source", "make",
           "plan", "run"]
