"""The backward on tensor cores (proofs/L7, with the two 16-bit roundings of proofs/L7's tensor-core part):
dQ, dK, dV with mma.sync m16n8k16 from float16 or bfloat16 Q, K, V, dO, the forward's LSE and D = rowsum(dO o O).

Two kernels, both on the forward engine's staging and fragment conventions (kernels.mma.engine, proofs/L10), each
in a module of its own (kernels.mma.backward_kv, backward_dq); this one holds their configuration and launches:

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

float32 inputs (kind "float32"): both kernels' products by 3xTF32 (kernels.mma.backward_tf32: their fragments,
tiles staged raw and split where read, the same visits, masks, exact path and traffic), d_v = d (the API pads
V), tiles DEFAULTS_FLOAT32.

Limits: d, d_v <= 128; static shared memory <= 48 KB; tiles: kv B_c = 16 W, B_r a multiple of 16 up to 32 W with
B_r / 16 and W dividing one another; dq B_r = 16 W, B_c a multiple of 16. Defaults (DEFAULTS) by head dim.
Whole-kernel estimate: docs/profile.md (`profile --orders bwd-kv-mma,bwd-kv-mma-det,bwd-dq-mma`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from numba import cuda, float32

from fa_numba.kernels import disk_cache, sinks
from fa_numba.kernels.block_lists import LIST_FORMS, kernel_mask, mask_arrays, mask_types
from fa_numba.kernels.mma import masking
from fa_numba.kernels.mma.backward_dq import dq_products16, dq_source
from fa_numba.kernels.mma.backward_kv import kv_products16, kv_source
from fa_numba.kernels.mma.backward_tf32 import dq_products as dq_products_tf32
from fa_numba.kernels.mma.backward_tf32 import kv_products as kv_products_tf32
from fa_numba.kernels.score_mod import NO_CAPTURED, KernelMod, tuple_type

from fa_numba import backend
from fa_numba.kernels.common import ValueDim, check_grid, check_sequence
from fa_numba.kernels.mma.engine import (KINDS, MAX_HEAD_DIM, SHARED_LIMIT, MmaConfig, PaddedRows, async_multiple)

ROLES = ("kv", "dq")
# default (warps, block_q, block_k) per role and largest head dim: the largest tiles under 48 KB of static
# shared memory (kv: K, V, Q, dO staged, dS^T and LSE, D; dq: Q, dO, K, V staged)
# (the kv kernel's B_r is small because its registers hold dK, dV, P^T and dS^T: B_r = 32 at d = 64 compiles to
# 234 registers, 64 to 255 and spills; 16 at d = 128 to 254 without spills, sm_90a, 2026-12-02)
DEFAULTS = {"kv": ((64, (4, 32, 64)), (128, (4, 16, 64))), "dq": ((64, (4, 64, 64)), (128, (2, 32, 32)))}
# float32 inputs (3xTF32, kernels.mma.backward_tf32): four raw float32 tiles and dS^T under 48 KB (d = 64:
# 2 x 48 rows of 68 words and 32 x 20 of dS^T, 28.6 KB; d = 128: 2 x 32 rows of 132, 35 KB); registers: B_r = 32
# at d = 64 compiles to 255 registers and spills 100 bytes, B_r = 16 at d = 128 to 246 without (sm_90a, 2026-12-04)
# the dq pass: one warp, 16 x 32 at d = 64 (28.5 KB; 2 warps at 32 x 16 or 32 x 32 spilled 28 to 176 bytes
# in the causal build) and 16 x 16 above (35 KB): none spills or keeps local memory (2026-12-04)
DEFAULTS_FLOAT32 = {"kv": ((64, (2, 16, 32)), (128, (1, 16, 16))), "dq": ((64, (1, 16, 32)), (128, (1, 16, 16)))}
KINDS_BACKWARD = KINDS + ("float32",)  # the 16-bit kinds, and float32 inputs by 3xTF32


def default_tiles(role: str, head_dim: int, kind: str = "float16") -> tuple[int, int, int]:
    """(warps, block_q, block_k) of `role` for head dim d (DEFAULTS; DEFAULTS_FLOAT32 for float32 inputs)."""
    table = DEFAULTS_FLOAT32 if kind == "float32" else DEFAULTS
    if role not in table:
        raise ValueError(f"the {role} kernel of the tensor-core backward takes {KINDS} inputs, got {kind}")
    for bound, tiles in table[role]:
        if head_dim <= bound:
            warps, block_q, block_k = tiles
            slices = block_q // 16
            # d's 8-column blocks, as the kernel pads d (float32 to 8 columns, 16-bit to 16), must split evenly over
            # the warps sharing a dQ slice (the kv kernel's; the dq pass gives each warp its own slice): else fewer
            # warps, B_c = 16 W. d = 72 and 100 on 16-bit inputs took 4 warps over 10 and 14 blocks and raised, at
            # the defaults, in attention_backward(engine="mma") (found 2026-12-04; tests/test_default_tiles.py).
            blocks = MmaBackwardConfig(role, kind, warps, block_q, block_k, head_dim, False).padded_dim // 8
            while warps > slices and blocks % (warps // slices):
                warps //= 2
                block_k = 16 * warps
            return warps, block_q, block_k
    raise ValueError(f"head dim d must be <= {MAX_HEAD_DIM} for the tensor-core backward, got {head_dim}")


@dataclass(frozen=True)
class MmaBackwardConfig(ValueDim, PaddedRows):
    """A compile-time configuration of a tensor-core backward kernel. V, dO and dV have V's head dim d_v
    (value_dim; 0: d): staged, multiplied and written d_v wide, Q, K, dQ, dK d wide."""

    role: str  # "kv" (dK, dV on chip; dQ by atomics unless deterministic) or "dq" (the deterministic dQ pass)
    kind: str  # "float16" or "bfloat16", or "float32" (3xTF32: kernels.mma.backward_tf32)
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
    def float32(self) -> bool:
        """float32 inputs, multiplied by 3xTF32 (kernels.mma.backward_tf32)."""
        return self.kind == "float32"

    @property
    def padded_dim(self) -> int:
        """d padded to whole k-steps: 16 (m16n8k16), 8 for float32 inputs (m16n8k8)."""
        return self.staging().padded_dim

    @property
    def row_stride(self) -> int:
        """Elements between staged rows (the forward engine's rule: ldmatrix's 16 bytes of pad, 4 words for
        float32)."""
        return self.staging().row_stride

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
        """Elements between the rows of dS^T in shared memory: 16 bytes of pad (ldmatrix), 4 words for float32
        (the dQ product's reads of rows 2t on 32 distinct banks)."""
        return self.block_q + (4 if self.float32 else 8)

    @property
    def shared_bytes(self) -> int:
        item = 4 if self.float32 else 2
        staged = item * (self.row_stride + self.value_row_stride) * (self.block_q + self.block_k)  # Q, K; dO, V
        ds = (item * self.block_k * self.ds_stride if self.role == "kv"
              else item * self.block_q * (self.block_k + (4 if self.float32 else 8)))
        stats = 8 * self.block_q
        return staged + ds + stats

    def staging(self) -> MmaConfig:
        """The forward engine's configuration whose staging helpers this kernel uses (threads, d, kind)."""
        return MmaConfig(self.kind, self.warps, 16, self.head_dim, self.causal, self.async_copy,
                         value_dim=self.value_dim)

    def check(self) -> "MmaBackwardConfig":
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kind not in KINDS_BACKWARD:
            raise ValueError(f"dtype must be one of {KINDS_BACKWARD} for the tensor-core backward, got "
                             f"{self.kind!r}")
        if self.float32 and self.value_dim and self.value_dim != self.head_dim:
            raise ValueError(f"a value head dim of its own (d_v = {self.value_dim} != d = {self.head_dim}) is taken "
                             "by the 16-bit tensor-core backward; float32 inputs are padded to d "
                             "(fa_numba.value_dims)")
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


class MmaBackwardKernel:
    """A compiled tensor-core backward kernel (`role` "kv" or "dq"): its config, the Python `source` and its
    cuda.jit `kernel`, and the launch's grid."""

    def __init__(self, config: MmaBackwardConfig):
        self.config = config.check()
        if config.role == "dq":
            self.source = dq_source(config, (dq_products_tf32 if config.float32 else dq_products16)(config))
        else:
            self.source = kv_source(config, (kv_products_tf32 if config.float32 else kv_products16)(config))
        self.kernel = disk_cache.jit(self.source)
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
        bits = types.Array(types.float32 if self.config.float32 else types.uint16, 4, "C")
        grad, stat = types.Array(types.float32, 4, "C"), types.Array(types.float32, 3, "C")  # dV's d_v: a shape
        trailing = mask_types() + (tuple_type(self.config.mod),)
        if self.config.role == "kv":
            return (bits, bits, bits, bits, stat, stat, grad, grad, grad, float32) + trailing
        return (bits, bits, bits, bits, stat, stat, grad, float32) + trailing

    @property
    def staged_copies(self) -> int | None:
        """The cp.async copies (16 bytes) one thread issues per tile staged inside the tile loop (the kv kernel's
        Q_i or dO_i, B_r rows d wide; the dq pass's K_j or V_j, B_c rows) of the float32 kernels, whose small
        blocks stage a tile in a loop ptxas keeps rolled (whole_kernel.mma_iteration_counts counts it by this);
        None for the 16-bit kernels (their staging unrolls)."""
        c = self.config
        if not (c.float32 and c.async_copy):
            return None
        rows = c.block_q if c.role == "kv" else c.block_k
        return -(-rows * (c.padded_dim // 4) // (32 * c.warps))

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
    warps, bq, bk = default_tiles("kv", widest, kind)
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
        w, q_rows, k_cols = (bq // 16, bq, bk) if chosen else default_tiles("dq", widest, kind)
        kernels.append((make("dq", kind, w, q_rows, k_cols, head_dim, causal, mod=mod, mask_form=mask_form,
                             value_dim=value_dim), "q"))
    return kernels


def _aligned(*arrays) -> bool:
    from fa_numba.kernels.mma.staging import aligned16

    return all(aligned16(x) for x in arrays)


def run(q, k, v, out, lse, dout, dq, dk, dv, dvec, scale, *, kind, causal, deterministic=False, block_q=None,
        block_k=None, stream=0, mod: KernelMod | None = None, captured=NO_CAPTURED, mask=None,
        mask_form: str = "none", dlse=None) -> None:
    """The tensor-core backward of one call on (B, H, N, d) device arrays: q, k, v, dout float16 arrays or the uint16
    bits of `kind` (the preprocess reads dout as it is, the tensor-core kernels its bits), out as the forward gave
    it (any dtype the CUDA-core preprocess reads), lse float32 (B, H, N_q); v, out and dout with V's head dim d_v
    (which may differ from d); dq (B, H, N_q, d), dk (B, H_kv, N_k, d), dv (B, H_kv, N_k, d_v) float32 outputs,
    dvec (B, H, N_q) float32 workspace for D; mod and captured: a score mod's KernelMod and its device arrays
    (`score_mod.device_arrays`), the forward's; mask: a block mask (a fa_numba.masks mask fixed for these sizes,
    or a slice_masks mask) of kernel form mask_form, its lists built for each kernel's own tiles
    (kernels.block_lists.kernel_mask), or None; dlse: LSE's cotangent (B, H, N_q) float32 or None, taken from D
    after the preprocess (kernels.sinks.shift)."""
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
    if dlse is not None:
        sinks.shift(dvec, dlse, stream=stream)
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
