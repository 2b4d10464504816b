"""Numba CUDA kernels and their registry.

Every variant is listed in `VARIANTS` with a one-line verdict; tests, `compare` and the benchmarks iterate
it, so a new variant is validated and timed without new glue. A variant's `make(block_q, block_k,
head_dim, causal, mask_form="none")` returns a cached, callable kernel: kernel(q, k, v, o, lse, scale,
workspace=None, stream=0, mask=None) on device arrays of shape (B, H, N, d), o float32 (B, H, N_q, d), lse
float32 (B, H, N_q).

Variants differ in what they take, and say so: `unit` ("simt": the CUDA-core kernels, float32 arithmetic;
"mma": the tensor-core kernels of `kernels.mma`, whose `make` also takes dtype="float16", "bfloat16" or
"float32", the last multiplied by 3xTF32),
`dtypes` (input dtypes), `tile_multiple` (block_q and block_k multiples of it), `block_masks` (block-mask
lists, mask_form "intervals" / "dense"), `not_counted` (why the simulator's counted traffic is not its HBM
traffic, for a variant where it is not: v1-mma). `Variant.refusal(...)` says why a variant cannot take a
configuration (None if it can); `config(...)` raises that reason as a ValueError naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fa_numba import backend
from fa_numba.kernels.common import MAX_HEAD_DIM, Config
from fa_numba.kernels.layout import default_config
from fa_numba.kernels.engine_v1 import make_v1_engine
from fa_numba.kernels.engine_v2 import make_v2_engine
from fa_numba.kernels import inliner, mma_variant
from fa_numba.kernels.rowwise_v1 import make_v1
from fa_numba.kernels.rowwise_v2 import make_v2

backend.patch_simulator()  # thread-safe shared arrays in the simulator (see backend.patch_simulator)
inliner.install()  # each inlined callee's IR copied in one pass, not once per block (kernels.inliner)


ALL_DTYPES = ("float32", "float16", "bfloat16")
MMA_DTYPES = mma_variant.DTYPES  # float16, bfloat16, and float32 by 3xTF32


@dataclass(frozen=True)
class Variant:
    name: str
    order: str  # the loop order whose iomodel traffic it must match
    description: str
    make: Callable
    engine: bool  # register-tiled (the tile engine or the tensor-core engine); else one thread per query row
    unit: str = "simt"  # "simt": CUDA cores, float32 arithmetic; "mma": tensor cores (mma.sync, 16-bit operands)
    dtypes: tuple = ALL_DTYPES  # the input dtypes it takes
    tile_multiple: int = 1  # block_q and block_k must be multiples of this
    block_masks: bool = True  # takes block-mask lists (mask_form "intervals" or "dense")
    not_counted: str | None = None  # why counting.run_counted's element counts are not its HBM traffic (None: they are)

    def config(self, block_q: int, block_k: int, head_dim: int, causal: bool, mask_form: str = "none",
               dtype: str | None = None, value_dim: int = 0):
        """The checked compile-time configuration of a launch, without compiling anything (errors name the
        argument): a Config for a CUDA-core variant, an MmaConfig for a tensor-core one (dtype None: its first
        dtype). A dtype the variant does not take is a ValueError. value_dim: V's and O's head dim where it
        differs from d (the tile engine's variants; 0: d)."""
        if self.unit == "mma":  # its own messages: why 16-bit only, why tiles of 16
            return mma_variant.check(self.order, block_q, block_k, head_dim, causal, mask_form,
                                     dtype or self.dtypes[0])
        if dtype is not None and dtype not in self.dtypes:
            raise ValueError(f"dtype must be one of {self.dtypes} for {self.name}, got {dtype!r}")
        return Config(self.order, block_q, block_k, head_dim, bool(causal), engine=self.engine,
                      mask_form=mask_form, value_dim=value_dim).check()

    def refusal(self, block_q: int, block_k: int, head_dim: int, causal: bool, mask_form: str = "none",
                dtype: str = "float32") -> str | None:
        """Why this variant cannot take the configuration (the ValueError `config` raises), or None if it can."""
        try:
            self.config(block_q, block_k, head_dim, causal, mask_form, dtype)
        except ValueError as err:
            return str(err)
        return None

    def build(self, block_q: int, block_k: int, head_dim: int, causal: bool, mask_form: str = "none",
              dtype: str = "float32"):
        """`make` for inputs of `dtype`: the tensor-core variants are compiled for their 16-bit type."""
        extra = {"dtype": dtype} if self.unit == "mma" else {}
        return self.make(block_q, block_k, head_dim, causal, mask_form, **extra)


# what the tensor-core kernels take: 16-bit or float32 (3xTF32) inputs, tiles of 16, every mask form
_MMA = dict(unit="mma", dtypes=MMA_DTYPES, tile_multiple=mma_variant.TILE_MULTIPLE, block_masks=True)
# v1-mma's element counts differ from iomodel's v1 (tests/test_registry_mma.py pins by how much): the 4 lanes of
# a quad each read the row's l and m (one address: one HBM read on a GPU, 4 counted reads here), and LSE is filled
# with -inf before the visits and written again at the last one
_V1_MMA_NOT_COUNTED = ("the simulator counts each lane's reads, and the 4 lanes of a quad read the same l and m "
                       "(one HBM read on a GPU); its LSE is also written twice (filled with -inf, then at the last "
                       "visit), so iomodel's v1 columns are its traffic only approximately")
VARIANTS = {
    "v1": Variant("v1", "v1", "FlashAttention Alg. 1 on the tile engine: K/V outer, O/l/m round-trip HBM per visit; "
                  "grid (B*H), register micro-tiles", make_v1_engine, True),
    "v2": Variant("v2", "v2", "FlashAttention-2 on the tile engine: Q outer, (m, l, acc) in registers; grid (T_r, B*H), "
                  "register micro-tiles", make_v2_engine, True),
    "v1-rowwise": Variant("v1-rowwise", "v1", "Alg. 1 line by line: one thread per query row, its row of Q, S and O "
                          "in local memory", make_v1, False),
    "v2-rowwise": Variant("v2-rowwise", "v2", "FlashAttention-2 line by line: one thread per query row, its row of Q, "
                          "S and O in local memory", make_v2, False),
    "v1-mma": Variant("v1-mma", "v1", "Alg. 1 on tensor cores: mma.sync m16n8k16 on 16-bit Q, K, V, P (float32: "
                      "3xTF32 m16n8k8), float32 accumulators; O/l/m round-trip HBM; grid (B*H), 16 query rows per warp",
                      mma_variant.make_v1_mma_variant, True, **_MMA, not_counted=_V1_MMA_NOT_COUNTED),
    "v2-mma": Variant("v2-mma", "v2", "FlashAttention-2 on tensor cores: mma.sync m16n8k16 on 16-bit Q, K, V, P "
                      "(float32: 3xTF32 m16n8k8), (m, l, acc) in registers; grid (T_r, B*H), 16 query rows per warp "
                      "(32 at 128-row tiles, d <= 64)",
                      mma_variant.make_v2_mma_variant, True, **_MMA),
}
# the CUDA-core variants: fa_numba.attention's orders (engine="mma" picks v1-mma / v2-mma by order "v1" / "v2")
SIMT_VARIANTS = tuple(name for name, variant in VARIANTS.items() if variant.unit == "simt")


def default_tiles(head_dim: int) -> tuple[int, int]:
    """(block_q, block_k) by head dim: the tile engine's shipped tiles (layout.DEFAULTS), which fit the 48 KB
    static shared-memory budget of every CUDA-core variant (the one-thread-per-row kernels need only 2 B_c d 4
    bytes); the tensor-core variants take them for d <= 128 (`Variant.refusal` says where not)."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim d must be <= {MAX_HEAD_DIM}, got {head_dim}")
    block_q, block_k, _, _ = default_config(head_dim)
    return block_q, block_k


def poisoned_outputs(q_shape):
    """Device arrays (out, lse, workspace) for a launch, filled with NaN so an unwritten element shows."""
    import numpy as np
    from numba import cuda

    stats = tuple(q_shape[:-1])
    return (cuda.to_device(np.full(tuple(q_shape), np.nan, np.float32)),
            cuda.to_device(np.full(stats, np.nan, np.float32)),
            (cuda.to_device(np.full(stats, np.nan, np.float32)), cuda.to_device(np.full(stats, np.nan, np.float32))))


__all__ = ["Config", "MMA_DTYPES", "SIMT_VARIANTS", "VARIANTS", "Variant", "default_tiles",
           "poisoned_outputs"]
