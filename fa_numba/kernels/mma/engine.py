"""The tensor-core engine: what both orders of the tensor-core forward are made of (mma.sync m16n8k16 on
float16 or bfloat16 inputs; m16n8k8 on float32 inputs by 3xTF32 or plain TF32, whose products are
`kernels.mma.tf32`'s). The orders themselves are thin: engine_v2 (Q outer) and engine_v1 (K/V outer).

Math (per query row i, proofs/L2 and L4), as on the CUDA cores: fold the visible key tiles j into
(m, l, acc) with the online softmax, then O_i = acc / l, LSE_i = m + log l; a row that sees no key (by the
mask) gets 0 and -inf. What is new is where the products happen and one rounding (proofs/L6, part 7):

- S = Q K_j^T and acc += P V_j are warp-wide mma.sync products (fa_numba.warp); a 16-bit product is exact in
  float32 and the accumulation is float32 (the tensor core's own order and rounding).
- P enters P V rounded to the input's 16-bit type (one rounding per weight: the term tolerance.p_rounding_term);
  l sums the float32 weights, as FlashAttention-2 does.
- each weight exp(s - m) is 2^(s log2(e) - m log2(e)) by ex2.approx.ftz (a multiply-add and one MUFU.EX2 instead
  of libdevice's eight-instruction exp: about 210 fewer instructions a key tile at d = 64): a relative
  error of u (2 |S| + 3 (m - S)) plus 2 ulps per weight (tolerance.exp2_terms, proofs/L6 part 10). The
  rescaling factors alpha and the exact path keep math.exp.

Layout (proofs/L10): a block of W warps owns B_r = 16 W R query rows, warp w the R m16 row blocks of rows
16 R w .. 16 R (w + 1) - 1 (R = `MmaConfig.row_blocks`, 1 or 2: v2's 128-row tiles on 16-bit inputs take
FlashAttention-2's two, so each K_j and V_j fragment read from shared memory feeds both row blocks' products). In
every fragment lane (g, t) = (lane >> 2, lane & 3) holds rows g and g + 8 of a row block and, per 8-column
block, columns 2t and 2t + 1, so a row's statistics live in the 4 lanes of a quad and its max and sum are two
shfl_xor each.
Q_i, K_j and V_j are staged in shared memory as 16-bit bits, rows DP + 8 elements apart (DP: d rounded up
to 16, zeros past d; the 16-byte pad puts the 8 rows of an ldmatrix on 8 distinct 4-bank groups); Q's A
fragments are read once per staging (ldmatrix x4; with two row blocks a warp, at every tile, as FlashAttention-2
does: kept in registers they spill), K's B fragments by ldmatrix x2, V's by ldmatrix x2 .trans,
and the S accumulator becomes P's A fragment in the lane that holds it (L10, claim 5): no data moves between
lanes. V_j and O may have a head dim of their own (`MmaConfig.value_dim`, 16-bit kinds): V_j's rows are then
DPV + 8 apart and O's accumulator holds DPV columns (DPV: d_v rounded up to 16).

Staging (kernels.mma.staging): where d and d_v are multiples of 8 (and the inputs' rows 16-byte aligned) each
tile is copied by cp.async, 16 bytes a copy with the rows past N zero-filled, so no element passes through a
register, rows found by the shape or, for a strided view, by its strides; otherwise by plain loads. The launch
both orders share is kernels.mma.launch.

Masking (kernels.mma.masking): causal (bottom-right) by SKIP / FULL / PARTIAL tiles in closed form, or a block
mask's lists (every form of kernels.block_lists, one mask or one per (batch, head)): the tiles a block visits and
their kinds come from the lists, and inside a PARTIAL tile each pair is tested (the row's interval, then the
dense byte or the mask_mod's fn). Keys past N_k are zero-filled and given weight 0. A masked key's value row
must never be multiplied (a NaN or inf there would turn 0 into NaN): in a PARTIAL tile whose V holds a
non-finite value the warp computes P V on the CUDA cores over the visible keys only (`exact_pv`), which the
tensor core cannot (it multiplies every key of the tile).

float32 inputs (kind "float32": 3xTF32, kind "tf32": one TF32 product) share all of the above but the products
(`make_ops` takes `kernels.mma.tf32.make_products` in place of `kernels.mma.products16`'s): Q's fragments come from HBM, not
from a staged Q tile, P stays float32 (split, not rounded), and shared rows are DP + 4 floats apart.

Pipeline (v2 by cp.async, engine_v2; since 2026-12-04): one buffer each for K and V, and FlashAttention-2's
order, so no copy is waited for right after it was issued: V_j's copies travel while S = Q K_j^T is computed,
K_j+1's (issued once every warp is past S) while the softmax and P V_j run. The pieces are `copy_k`, `copy_v`,
`split_k`, `scores`, `landed` and `weigh` (`fold` is scores then weigh, for v1 and decoding, which stage K_j and
V_j together: v1 reads each once per block, decoding double-buffers whole tiles). A PARTIAL tile that takes the
exact path reads K_j again after S, so there K_j+1 is issued after it.

Limits of this engine: v1 keeps one stage, and so does v2 above d = 128 (its causal d = 192 build would spill);
d <= 192 for 16-bit inputs (block_k 16 above 128: MAX_FORWARD_HEAD_DIM), 128 for float32 ones; the backward
(kernels.mma.backward) takes 16-bit inputs only, d <= 128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from numba import cuda, float32

from fa_numba import warp
from fa_numba.kernels.block_lists import LIST_FORMS
from fa_numba.kernels.common import NEG_INF, ZERO
from fa_numba.kernels.mma import masking, products16, tf32
from fa_numba.kernels.mma.staging import stagers
from fa_numba.kernels.mma.tf32 import FLOAT32_KINDS
from fa_numba.kernels.score_mod import KernelMod, apply_fn, has_scores

KINDS = ("float16", "bfloat16")  # 16-bit inputs (the backward takes these only)
FORWARD_KINDS = KINDS + FLOAT32_KINDS  # and float32 inputs by 3xTF32 ("float32") or plain TF32 ("tf32")
MAX_HEAD_DIM = 128  # the backward's, and the float32 (3xTF32) forward's: their tiles above it exceed 48 KB
# The 16-bit forward's: d = 192 (MLA's d_qk) at 64 x 16 tiles compiles to 224 registers (255 causal) without
# spills in both orders (sm_90a, 2026-12-03); d = 256 spills 136 bytes even at 32 x 16 tiles.
MAX_FORWARD_HEAD_DIM = 192
SHARED_LIMIT = 48 * 1024  # static shared memory per block (DESIGN.md)
ROW_BLOCKS = (1, 2)  # m16 row blocks a warp may own (MmaConfig.row_blocks)
# v2's pipelined copies by default up to this head dim: above it (64 x 16 tiles) the causal d = 192 build takes
# 254 registers in one stage and spills pipelined (8 bytes stored, 32 loaded; sm_90a, 2026-12-04)
PIPELINED_MAX_DIM = 128
LOG2E = float32(math.log2(math.e))  # log2(e) rounded to float32: the weights' ex2 form (fold)


class PaddedRows:
    """The staging layout every tensor-core kernel shares: d padded to whole k-steps of 16, rows 8 elements
    (16 bytes) longer, so the 8 rows of an ldmatrix start on 8 distinct 4-bank groups."""

    head_dim: int

    @property
    def padded_dim(self) -> int:
        return -(-self.head_dim // 16) * 16

    @property
    def row_stride(self) -> int:
        return self.padded_dim + 8


@dataclass(frozen=True)
class MmaConfig(PaddedRows):
    """A compile-time configuration of a tensor-core forward kernel (either order)."""

    kind: str  # "float16" / "bfloat16": how the 16-bit inputs are read; "float32" (3xTF32) / "tf32": float32 inputs
    warps: int  # W: the block has 32 W threads and B_r = 16 W R query rows (R = row_blocks)
    block_k: int  # B_c: keys per tile, a multiple of 16
    head_dim: int
    causal: bool
    async_copy: bool = False  # stage tiles by cp.async (16-byte rows: d % 8 == 0, float32 d % 4 == 0)
    mod: KernelMod | None = None  # a score mod compiled in (kernels.score_mod), applied to S on the fragments
    mask_form: str = "none"  # "none" / "causal" (closed forms, by `causal`) or a block mask's list form
    value_dim: int = 0  # d_v, V's and O's head dim (16-bit kinds); 0: head_dim
    # v2 by cp.async: overlap the copies with the products (engine_v2); False keeps one stage, the order before
    # 2026-12-04 (the device session's A / B); None: `pipelines`' default
    pipelined: bool | None = None
    # R: m16 row blocks per warp (v2 on 16-bit inputs): a warp owns 16 R query rows, and every K_j and V_j
    # fragment it reads from shared memory feeds R products (FlashAttention-2's 32 rows a warp at R = 2)
    row_blocks: int = 1

    @property
    def d_v(self) -> int:
        return self.value_dim or self.head_dim

    @property
    def pipelines(self) -> bool:
        """Whether v2's copies run ahead of its products (engine_v2): cp.async staging and `pipelined`, by
        default where d and d_v are at most PIPELINED_MAX_DIM."""
        if not self.async_copy:
            return False
        return self.pipelined if self.pipelined is not None else max(self.head_dim, self.d_v) <= PIPELINED_MAX_DIM

    @property
    def float32(self) -> bool:
        """float32 inputs, multiplied by tf32 products (kernels.mma.tf32) instead of 16-bit ones."""
        return self.kind in FLOAT32_KINDS

    @property
    def padded_dim(self) -> int:
        return tf32.padded_dim(self.head_dim) if self.float32 else PaddedRows.padded_dim.fget(self)

    @property
    def row_stride(self) -> int:
        """Elements between staged rows: 16 bytes of pad for ldmatrix's 16-bit rows, 4 floats for tf32's
        32-bit reads (kernels.mma.tf32: no bank conflicts)."""
        return self.padded_dim + (4 if self.float32 else 8)

    @property
    def padded_value_dim(self) -> int:
        """d_v padded as d is: V_j's staged columns and O's accumulator columns."""
        return tf32.padded_dim(self.d_v) if self.float32 else -(-self.d_v // 16) * 16

    @property
    def value_row_stride(self) -> int:
        """Elements between V_j's staged rows (row_stride's rule on d_v)."""
        return self.padded_value_dim + (4 if self.float32 else 8)

    @property
    def lists(self) -> bool:
        """Whether the kernel walks a block mask's lists (kernels.mma.masking)."""
        return self.mask_form in LIST_FORMS

    @property
    def block_q(self) -> int:
        return 16 * self.warps * self.row_blocks

    @property
    def shared_bytes(self) -> int:
        """K_j and V_j, and (16-bit) Q_i; the float32 engine reads Q's fragments from HBM and keeps K_j and V_j as
        tf32 high parts and residuals (kernels.mma.tf32)."""
        if self.float32:
            return 4 * self.row_stride * 2 * self.block_k * 2
        return 2 * (self.row_stride * (self.block_q + self.block_k) + self.value_row_stride * self.block_k)

    def check(self) -> "MmaConfig":
        if self.kind not in FORWARD_KINDS:
            raise ValueError(f"kind must be one of {FORWARD_KINDS} for the tensor-core kernel, got {self.kind!r}")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"warps must be 1, 2, 4 or 8, got {self.warps}")
        if self.row_blocks not in ROW_BLOCKS:
            raise ValueError(f"row_blocks must be one of {ROW_BLOCKS} (m16 row blocks a warp), got {self.row_blocks}")
        if self.row_blocks > 1 and self.float32:
            raise ValueError(f"row_blocks {self.row_blocks} is taken by the 16-bit kinds {KINDS}; the {self.kind} "
                             "engine's products hold one m16 row block a warp")
        if self.block_k <= 0 or self.block_k % 16:
            raise ValueError(f"block_k must be a positive multiple of 16 (the k of m16n8k16), got {self.block_k}")
        limit = MAX_HEAD_DIM if self.float32 else MAX_FORWARD_HEAD_DIM
        if not 1 <= self.head_dim <= limit:
            raise ValueError(f"head dim d must be in 1..{limit} for the {self.kind} tensor-core forward, got "
                             f"{self.head_dim}")
        if self.value_dim and self.value_dim != self.head_dim:
            if self.float32:
                raise ValueError(f"a value head dim of its own (d_v = {self.value_dim} != d = {self.head_dim}) is "
                                 f"taken by the 16-bit tensor-core kernels; the {self.kind} ones pad V to d "
                                 "(fa_numba.value_dims)")
            if not 1 <= self.value_dim <= limit:
                raise ValueError(f"value head dim d_v must be in 1..{limit} for the {self.kind} tensor-core forward, "
                                 f"got {self.value_dim}")
            if self.async_copy and self.value_dim % async_multiple(self.kind):
                raise ValueError(f"async_copy needs the value head dim d_v to be a multiple of "
                                 f"{async_multiple(self.kind)} (16-byte rows), got {self.value_dim}")
        if self.async_copy and self.head_dim % async_multiple(self.kind):
            raise ValueError(f"async_copy needs the head dim d to be a multiple of {async_multiple(self.kind)} "
                             f"(16-byte rows), got {self.head_dim}")
        if self.shared_bytes > SHARED_LIMIT:
            raise ValueError(f"block_q {self.block_q}, block_k {self.block_k}, d {self.head_dim}: "
                             f"{self.shared_bytes} bytes of shared memory, over the {SHARED_LIMIT} static limit")
        masking.make(self.causal, self.mask_form, self.mod)  # the form, and a mask_mod's fn where it needs one
        return self


ROW_BLOCKS_MAX_DIM = 64  # two row blocks a warp up to this head dim (engines.mma_tiles; above it they spill)


def row_blocks_for(order: str, kind: str, block_q: int, head_dim: int, plain: bool = True) -> int:
    """The m16 row blocks a warp owns in a block of block_q query rows: 2 (FlashAttention-2's 4 warps of 32
    rows) for v2's 128-row tiles on 16-bit inputs up to d = ROW_BLOCKS_MAX_DIM where the build is `plain` (no
    score mod, no block mask: those registers on top of two row blocks' spill), else 1 (16 rows a warp)."""
    wide = order == "v2" and kind in KINDS and plain and head_dim <= ROW_BLOCKS_MAX_DIM
    return 2 if wide and block_q == 128 else 1


def async_multiple(kind: str) -> int:
    """d must be a multiple of this for cp.async staging (16-byte chunks of whole rows)."""
    return 4 if kind in FLOAT32_KINDS else 8


def make_ops(config: MmaConfig) -> SimpleNamespace:
    """The device functions both orders are built from, bound to the configuration's compile-time sizes (a
    kernel can call only globals and closures: each order's kernel_source takes them from here). The products
    (Q's fragments, S = Q K^T, acc += P V, the exact path's dot products) are the 16-bit ones
    (`kernels.mma.products16`) or the float32 inputs' tf32 ones (`kernels.mma.tf32`); the rest is shared."""
    W, BR, BC, D, RB = config.warps, config.block_q, config.block_k, config.head_dim, config.row_blocks
    DP, SQ, CAUSAL = config.padded_dim, config.row_stride, config.causal
    # k-steps of Q K^T (16-bit: 16 wide, tf32: 8), key blocks, O blocks
    KS, NT, DN = DP // (8 if config.float32 else 16), BC // 8, DP // 8
    THREADS = 32 * W
    HALF = BC * SQ  # one staged K or V tile; the float32 engine keeps two (its tf32 high parts, then residuals)
    KV_SIZE = HALF * (2 if config.float32 else 1)  # shared array sizes: Python ints, so Numba sees constants
    # V_j and O: their own head dim d_v (16-bit kinds; the float32 ones have d_v = d), padded and strided alike
    DV, DPV, SV = config.d_v, config.padded_value_dim, config.value_row_stride
    DNV = DPV // 8  # O's accumulator blocks of 8 columns
    V_SIZE = KV_SIZE if (DPV, SV) == (DP, SQ) else BC * SV
    sizes = SimpleNamespace(W=W, RB=RB, BR=BR, BC=BC, D=D, DP=DP, SQ=SQ, KS=KS, NT=NT, DN=DN, KV_SIZE=KV_SIZE, HALF=HALF,
                            DV=DV, DPV=DPV, SV=SV, DNV=DNV, V_SIZE=V_SIZE)

    @cuda.jit(device=True, inline=True)
    def quad_max(x):
        for mask in (1, 2):
            x = max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, mask))
        return x

    @cuda.jit(device=True, inline=True)
    def quad_sum(x):
        for mask in (1, 2):
            x += cuda.shfl_xor_sync(0xFFFFFFFF, x, mask)
        return x

    X = tf32.make_products(config.kind, sizes, quad_sum) if config.float32 else products16.make_products(config, sizes)
    q_fragments, raw_scores, pv, key_dots = X.q_fragments, X.scores, X.pv, X.key_dots
    nonfinite, nonfinite_staged, to_f32, Q_SHARED = X.nonfinite, X.nonfinite_staged, X.to_f32, X.q_in_shared
    store, settle, value, SETTLE = X.store, X.settle, X.value, X.settles
    ZERO_ELEM = X.zero
    ASYNC, CH = config.async_copy, X.chunk  # cp.async staging, in chunks of CH elements (16 bytes) per row
    ITEM_SHIFT = (16 // CH).bit_length() - 1  # log2 of the element's bytes: a view's strides to elements
    sizes.Q_SIZE = BR * SQ if X.q_in_shared else 1  # the float32 engine keeps no Q tile
    sizes.ELEMENT, sizes.FRAGMENT, sizes.QF = X.element, X.fragment, X.fragment_width  # shared tiles' and Q's
    MOD = has_scores(config.mod)
    modded = apply_fn(config.mod)  # the score mod as a device function (the identity without one)
    M = masking.make(CAUSAL, config.mask_form, config.mod, rows=False)
    GUARDED, pair_visible = M.GUARDED, M.visible  # some tile hides a pair of data rows: the exact path compiled in

    stage, stage_async, any_bad = stagers(D, DP, SQ, THREADS, CH, ITEM_SHIFT, ZERO_ELEM, store, nonfinite,
                                           nonfinite_staged)
    stage_v, stage_v_async, any_bad_v = (stage, stage_async, any_bad) if (DV, DPV, SV) == (D, DP, SQ) else stagers(
        DV, DPV, SV, THREADS, CH, ITEM_SHIFT, ZERO_ELEM, store, nonfinite, nonfinite_staged)

    @cuda.jit(device=True, inline=True)
    def stage_two(x, y, b, h, r0, n, tile_x, tile_y, rows):
        """Stage two tiles of the same rows, x d wide (K_j or Q_i) and y d_v wide (V_j or dO_i: the value head
        dim's stagers), and wait for this thread's part: on the cp.async path one commit and one wait for
        both. The caller's barrier makes them visible."""
        if ASYNC:
            stage_async(x, b, h, r0, n, tile_x, rows)
            stage_v_async(y, b, h, r0, n, tile_y, rows)
            warp.cp_async_commit()
            warp.cp_async_wait_all()
        else:
            stage(x, b, h, r0, n, tile_x, rows)
            stage_v(y, b, h, r0, n, tile_y, rows)

    @cuda.jit(device=True, inline=True)
    def score(x, b, h, row, key, n_q, captured):
        """A visible pair's score as the softmax sees it: the score mod's, where the row is a real one."""
        if MOD and row < n_q:
            return modded(x, b, h, row, key, captured)
        return x

    @cuda.jit(device=True, inline=True)
    def exact_pv(qf, sq, sk, sv, acc, base, row0, qrow0, c0, n_k, delta, scale, shift0, shift1, t, b, h, n_q,
                 captured, lohis, denses, sb, sh):
        """acc[base + ...] += P V over the keys rows row0 and row0 + 8 may see, on the CUDA cores in float32, a
        masked key's value row never read (base: the row block's first accumulator block, R' DNV). Each lane
        recomputes its two rows' weights from Q_i and K_j (K_j is still
        staged; `key_dots`, which the whole warp calls for every key) rather than index its S fragment at a
        run-time key, which would move the whole fragment to local memory; the weights' own rounding differs
        from the mma's by a score perturbation, which the rule's score terms bound."""
        for c in range(BC):
            see0 = pair_visible(row0, c0 + c, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
            see1 = pair_visible(row0 + 8, c0 + c, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
            dot0, dot1 = key_dots(qf, sq, sk, c, qrow0, t)
            if see0 or see1:
                p0 = math.exp(score(scale * dot0, b, h, row0, c0 + c, n_q, captured) - shift0) if see0 else ZERO
                p1 = math.exp(score(scale * dot1, b, h, row0 + 8, c0 + c, n_q, captured) - shift1) if see1 else ZERO
                for dn in range(DNV):
                    for e in range(2):
                        vx = value(sv, c * SV + 8 * dn + 2 * t + e)
                        if see0:
                            acc[base + dn, e] += p0 * vx
                        if see1:
                            acc[base + dn, 2 + e] += p1 * vx

    @cuda.jit(device=True, inline=True)
    def stage_q(q, b, h, r0, n_q, sq, qf, wid, mrow, mat):
        """This lane's A fragments of Q_i: the 16-bit engine stages Q_i first (all threads, then a barrier every
        thread reaches), the float32 one reads its fragments from HBM."""
        if Q_SHARED:
            if ASYNC:
                stage_async(q, b, h, r0, n_q, sq, BR)
                warp.cp_async_commit()
                warp.cp_async_wait_all()  # this thread's copies of Q_i have landed
            else:
                stage(q, b, h, r0, n_q, sq, BR)
            cuda.syncthreads()  # Q_i staged: every thread reaches this barrier
        q_fragments(q, b, h, r0, n_q, sq, qf, wid, mrow, mat)

    @cuda.jit(device=True, inline=True)
    def stage_kv(k, v, b, h_kv, c0, n_k, sk, sv, partial):
        """Stage K_j and V_j (all threads, barriers every thread reaches); True where the tile is PARTIAL and
        its V holds an inf or NaN (then P V takes the exact path). K_j's and V_j's copies travel together: one
        commit, one wait. Without a mask no tile is PARTIAL, so the kernel has no exact path at all."""
        if ASYNC:
            stage_async(k, b, h_kv, c0, n_k, sk, BC)
            stage_v_async(v, b, h_kv, c0, n_k, sv, BC)
            warp.cp_async_commit()
            warp.cp_async_wait_all()  # this thread's copies of K_j and V_j have landed
            cuda.syncthreads()  # every thread's copies have landed: all threads reach this barrier
            if SETTLE:  # the float32 engine splits the staged tiles into tf32 parts, then a barrier
                settle(sk, BC)
                bad_v = settle(sv, BC)
                if not GUARDED:
                    cuda.syncthreads()  # the split tiles are complete: all threads reach this barrier
                    return False
                return cuda.syncthreads_or(1 if (partial and bad_v) else 0) != 0  # all threads
            if not GUARDED:
                return False
            bad_v = partial and any_bad_v(sv, BC)
        else:
            stage(k, b, h_kv, c0, n_k, sk, BC)
            bad_v = stage_v(v, b, h_kv, c0, n_k, sv, BC)
            if not GUARDED:
                cuda.syncthreads()  # K_j, V_j staged: all threads reach this barrier
                return False
        return cuda.syncthreads_or(1 if (partial and bad_v) else 0) != 0  # all threads: K_j, V_j staged

    @cuda.jit(device=True, inline=True)
    def copy_k(k, b, h, c0, n_k, sk):
        """Issue K_j's copies (cp.async) as a group of their own: the pipeline's wait for it comes later."""
        stage_async(k, b, h, c0, n_k, sk, BC)
        warp.cp_async_commit()

    @cuda.jit(device=True, inline=True)
    def copy_v(v, b, h, c0, n_k, sv):
        """Issue V_j's copies (cp.async) as a group of their own."""
        stage_v_async(v, b, h, c0, n_k, sv, BC)
        warp.cp_async_commit()

    @cuda.jit(device=True, inline=True)
    def split_k(sk):
        """The float32 engine splits the landed K_j into tf32 parts, then a barrier (all threads reach it);
        nothing for 16-bit inputs, whose staged K_j is read as it is."""
        if SETTLE:
            settle(sk, BC)
            cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def landed(sv, partial):
        """Wait for every group this thread committed, then the barrier that makes every thread's copies
        visible (all threads reach it; the float32 engine then splits V_j and meets a second one); returns
        whether the tile is PARTIAL and the staged V_j holds an inf or NaN (`stage_kv`'s guard; `partial` is
        the same in every thread, so the barrier it adds is too)."""
        warp.cp_async_wait_all()
        cuda.syncthreads()
        if SETTLE:
            bad_v = settle(sv, BC)
            if GUARDED and partial:
                return cuda.syncthreads_or(1 if bad_v else 0) != 0
            cuda.syncthreads()
            return False
        if GUARDED and partial:
            return cuda.syncthreads_or(1 if any_bad_v(sv, BC) else 0) != 0
        return False

    @cuda.jit(device=True, inline=True)
    def scores(qf, s, sq, sk, wid, row0, c0, n_k, delta, scale, t, mrow, mat, masked, b, h, n_q, captured, lohis,
               denses, sb, sh):
        """S = scale Q_i K_j^T on this lane's fragments (rows row0 + 16 R' and row0 + 16 R' + 8 of each row block
        R' < RB, in s[R' NT + nt]), the score mod applied and a hidden pair set to -inf; the whole warp calls it
        together. The only read of the staged K_j (but the
        exact path's): once every warp is past it, K_j's buffer may take the next tile (engine_v2's pipeline).
        masked: some pair of the tile may be hidden (a PARTIAL or tail tile), so each is tested (`masking`);
        lohis, denses, (sb, sh): the block mask's arrays and the block's slice of them (placeholders without)."""
        raw_scores(qf, s, sk, mrow, mat, sq, wid)
        for rb in range(RB):
            for nt in range(NT):
                for e in range(4):
                    x = rb * NT + nt
                    if masked or MOD:
                        key = c0 + 8 * nt + 2 * t + (e & 1)
                        row = row0 + 16 * rb + 8 * (e >> 1)
                        see = pair_visible(row, key, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured)
                        s[x, e] = score(scale * s[x, e], b, h, row, key, n_q, captured) if see else NEG_INF
                    else:
                        s[x, e] = scale * s[x, e]

    @cuda.jit(device=True, inline=True)
    def softmax(s, acc, rb, m0, m1, l0, l1):
        """Row block rb's part of a fold: its scores in s[rb NT + nt] become the weights exp(S - m_new), its
        accumulator blocks acc[rb DNV + dn] are rescaled by exp(m_old - m_new); returns its new (m0, m1, l0,
        l1) (l: the lane's part, the quad sums it at the end). The whole warp calls it together."""
        # the tile's row max over the quad (the max may drop a NaN score; its weight keeps the NaN)
        t0, t1 = NEG_INF, NEG_INF
        for nt in range(NT):
            x = rb * NT + nt
            t0 = max(t0, max(s[x, 0], s[x, 1]))
            t1 = max(t1, max(s[x, 2], s[x, 3]))
        n0, n1 = max(m0, quad_max(t0)), max(m1, quad_max(t1))
        shift0 = n0 if n0 != NEG_INF else ZERO  # nothing visible yet: exp(-inf - 0) = 0
        shift1 = n1 if n1 != NEG_INF else ZERO
        alpha0, alpha1 = math.exp(m0 - shift0), math.exp(m1 - shift1)
        # each weight exp(s - shift) as 2^(s log2(e) - shift log2(e)): one (fused) multiply-add and one ex2.approx
        # (MUFU.EX2) where the libdevice exp is eight instructions; the rule's exp2 term (proofs/L6 part 10)
        base0, base1 = shift0 * LOG2E, shift1 * LOG2E
        p0, p1 = ZERO, ZERO
        for nt in range(NT):
            x = rb * NT + nt
            for e in range(2):
                s[x, e] = warp.ex2(s[x, e] * LOG2E - base0)
                s[x, 2 + e] = warp.ex2(s[x, 2 + e] * LOG2E - base1)
                p0 += s[x, e]
                p1 += s[x, 2 + e]
        for dn in range(DNV):
            y = rb * DNV + dn
            acc[y, 0], acc[y, 1] = alpha0 * acc[y, 0], alpha0 * acc[y, 1]
            acc[y, 2], acc[y, 3] = alpha1 * acc[y, 2], alpha1 * acc[y, 3]
        return n0, n1, alpha0 * l0 + p0, alpha1 * l1 + p1

    @cuda.jit(device=True, inline=True)
    def shift(m):
        """The shift a row's weights were taken at: its running max, 0 while nothing is visible."""
        return m if m != NEG_INF else ZERO

    @cuda.jit(device=True, inline=True)
    def weigh(qf, s, acc, sq, sk, sv, m0, m1, l0, l1, row0, qrow0, c0, n_k, delta, scale, t, mrow, mat, guard, b,
              h, n_q, captured, lohis, denses, sb, sh):
        """Fold the scores S of K_j (`scores`) and the staged V_j into this lane's (m, l, acc) of rows row0 and
        row0 + 8 (one row block a warp); returns the new (m0, m1, l0, l1). The whole warp calls it together.
        guard: the exact path (`exact_pv`), which reads K_j again."""
        n0, n1, l0, l1 = softmax(s, acc, 0, m0, m1, l0, l1)
        if guard:
            exact_pv(qf, sq, sk, sv, acc, 0, row0, qrow0, c0, n_k, delta, scale, shift(n0), shift(n1), t, b, h, n_q,
                     captured, lohis, denses, sb, sh)
        else:
            pv(s, acc, sv, mrow, mat)
        return n0, n1, l0, l1

    @cuda.jit(device=True, inline=True)
    def weigh_blocks(qf, s, acc, sq, sk, sv, ml, row0, qrow0, c0, n_k, delta, scale, t, mrow, mat, guard, b, h, n_q,
                     captured, lohis, denses, sb, sh):
        """`weigh` for a warp of RB row blocks: row block R' (rows row0 + 16 R', + 8) keeps its (m0, m1, l0, l1)
        in ml[R'], updated in place; P V_j takes every row block's weights at once (`pv`: each V_j fragment read
        feeds RB products), or the exact path row block by row block."""
        for rb in range(RB):
            ml[rb, 0], ml[rb, 1], ml[rb, 2], ml[rb, 3] = softmax(s, acc, rb, ml[rb, 0], ml[rb, 1], ml[rb, 2],
                                                                 ml[rb, 3])
        if guard:
            for rb in range(RB):
                exact_pv(qf, sq, sk, sv, acc, rb * DNV, row0 + 16 * rb, qrow0 + 16 * rb, c0, n_k, delta, scale,
                         shift(ml[rb, 0]), shift(ml[rb, 1]), t, b, h, n_q, captured, lohis, denses, sb, sh)
        else:
            pv(s, acc, sv, mrow, mat)

    @cuda.jit(device=True, inline=True)
    def fold(qf, s, acc, sq, sk, sv, m0, m1, l0, l1, row0, qrow0, c0, n_k, delta, scale, t, mrow, mat, guard,
             masked, b, h, n_q, captured, lohis, denses, sb, sh):
        """`scores` then `weigh`: fold the staged K_j, V_j into (m, l, acc); returns the new (m0, m1, l0, l1)."""
        scores(qf, s, sq, sk, 0, row0, c0, n_k, delta, scale, t, mrow, mat, masked, b, h, n_q, captured, lohis,
               denses, sb, sh)  # one row block a warp (v1, decoding): Q's fragments are in qf, no warp index
        return weigh(qf, s, acc, sq, sk, sv, m0, m1, l0, l1, row0, qrow0, c0, n_k, delta, scale, t, mrow, mat, guard,
                     b, h, n_q, captured, lohis, denses, sb, sh)

    return SimpleNamespace(stage_q=stage_q, stage_kv=stage_kv, fold=fold, scores=scores, weigh=weigh,
                           weigh_blocks=weigh_blocks,
                           copy_k=copy_k, copy_v=copy_v, split_k=split_k, landed=landed, quad_sum=quad_sum,
                           visible=pair_visible, stage=stage, stage_async=stage_async,
                           stage_two=stage_two, any_bad=any_bad, stage_v_async=stage_v_async, any_bad_v=any_bad_v,
                           mma=getattr(X, "mma", None), pack=getattr(X, "pack", None), to_f32=to_f32, sizes=sizes)


