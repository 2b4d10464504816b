"""The tensor-core forwards (`kernels.mma`: engine_v1, engine_v2) in the registry's call shape: v1-mma, v2-mma.

`make_v1_mma_variant` / `make_v2_mma_variant(block_q, block_k, head_dim, causal, mask_form="none",
dtype="float16")` take the arguments every registered variant's `make` takes, plus the 16-bit input type the
kernel is compiled for, and return an `MmaVariantKernel`: kernel(q, k, v, o, lse, scale, workspace=None,
stream=0, mask=None) on device arrays, like the CUDA-core kernels (common.CompiledKernel). What they take is
narrower, and each limit is a ValueError naming the argument (`check`):

- dtype float16 or bfloat16 (q, k, v as float16 arrays or the uint16 bits of `dtype`), or float32 (float32
  arrays, multiplied by 3xTF32: kernels.mma.tf32; tolerance's products="3xtf32" term, proofs/L6 part 9);
- block_q in {16, 32, 64, 128} (16 query rows per warp; v2's 128 on 16-bit inputs up to d = 64 without a
  block mask: 4 warps of two m16 row blocks, as `fa_numba.attention` takes it), block_k a positive multiple of
  16 (the k of m16n8k16), d <= 128, under 48 KB of static shared memory;
- mask_form any the registry takes: "none", "causal", or a block mask's list form ("intervals", "dense"),
  whose KernelMask (kernels.block_lists.kernel_mask on the kernel's tiles) each launch then takes as mask=;
  "function" (a mask_mod) needs its fn compiled in, which only `fa_numba.attention` does.

v1's workspace (l, m), when given, is the kernel's l and m in HBM (so `counting.run_counted` counts them);
otherwise the engine allocates it. The arithmetic is the engine's: 16-bit products accumulated in float32, P
rounded to `dtype` before P V (tolerance's p_dtype term, proofs/L6 part 7); for float32, 3xTF32 products.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import float32

from fa_numba import backend
from fa_numba.kernels.block_lists import LIST_FORMS, mask_arrays
from fa_numba.kernels.common import check_grid, check_mask_form, check_sequence
from fa_numba.kernels.mma.engine import MmaConfig, async_multiple, row_blocks_for
from fa_numba.kernels.mma.staging import aligned16
from fa_numba.kernels.mma.engine_v1 import make_v1_mma
from fa_numba.kernels.mma.engine_v2 import make_v2_mma

BLOCK_Q = (16, 32, 64, 128)  # 16 W query rows for W in 1, 2, 4, 8 warps
TILE_MULTIPLE = 16  # block_q and block_k: multiples of the mma's 16 rows and 16-key k-step
DTYPES = ("float16", "bfloat16", "float32")  # float32: the 3xTF32 kernels (kind "float32")
_MAKE = {"v1": make_v1_mma, "v2": make_v2_mma}


def check(order: str, block_q: int, block_k: int, head_dim: int, causal: bool, mask_form: str = "none",
          dtype: str = "float16") -> MmaConfig:
    """The checked MmaConfig of `order`-mma for these arguments, or a ValueError naming the one it cannot take."""
    name = f"{order}-mma"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} for {name} (tensor cores multiply 16-bit operands, or "
                         f"float32 by 3xTF32), got {dtype!r}")
    check_mask_form(mask_form, causal)
    if mask_form == "function":
        raise ValueError(f"mask_form 'function' (a mask_mod) needs its fn compiled into {name}: run it through "
                         f"fa_numba.attention(..., mask=masks.mask_mod(...), engine='mma')")
    if block_q not in BLOCK_Q:
        raise ValueError(f"block_q must be 16, 32, 64 or 128 for {name} (16 query rows per warp), got {block_q}")
    lists = mask_form if mask_form in LIST_FORMS else "none"
    rows = row_blocks_for(order, dtype, block_q, head_dim, plain=lists == "none")  # what fa_numba.attention takes
    return MmaConfig(dtype, block_q // (16 * rows), block_k, head_dim, bool(causal),
                     head_dim % async_multiple(dtype) == 0, mask_form=lists, row_blocks=rows).check()


class MmaVariantKernel:
    """A tensor-core forward kernel launched like a registered CUDA-core one. Attributes: `order` ("v1" or
    "v2"), `name` ("v1-mma" ...), `inner` (the engine's MmaV1Kernel / MmaV2Kernel), `config` (its MmaConfig:
    kind, warps, block_q, block_k, head_dim, causal, async_copy), `source` and `kernel` (the Python function
    and its cuda.jit), `GRID_AXES`; `launch_shape`, `check_grid` and `argtypes` as common.CompiledKernel."""

    def __init__(self, order: str, inner):
        self.order, self.name, self.inner = order, f"{order}-mma", inner
        self.config, self.source, self.kernel = inner.config, inner.source, inner.kernel
        self.GRID_AXES = inner.GRID_AXES

    def launch_shape(self, batch: int, heads: int, n_q: int) -> tuple[tuple, tuple]:
        """(grid, block) of a launch: the order's grid, 32 W threads."""
        return tuple(self.inner.grid(batch, heads, n_q)), (32 * self.config.warps,)

    def check_grid(self, batch: int, heads: int, n_rows: int) -> None:
        check_grid(self.launch_shape(batch, heads, n_rows)[0], self.GRID_AXES, self.name)

    def argtypes(self, dtype: str) -> tuple:
        """The Numba types of the kernel's arguments (q, k, v as uint16 bits) for inputs of `dtype`."""
        if dtype != self.config.kind:
            raise ValueError(f"dtype must be {self.config.kind!r} for this {self.name} kernel (compiled for it), "
                             f"got {dtype!r}")
        return self.inner.argtypes()

    def _bits(self, name: str, x):
        """x as the kernel reads it: float16 arrays viewed, uint16 / int16 bits of config.kind; float32 as it is
        for the 3xTF32 kernels."""
        dtype = np.dtype(x.dtype)
        if self.config.kind == "float32":
            if dtype != np.float32:
                raise TypeError(f"{name} must be float32 for this {self.name} kernel (3xTF32), got {dtype}")
            return x
        if dtype == np.float16 and self.config.kind == "float16":
            return x.view(np.uint16)
        if dtype in (np.dtype(np.uint16), np.dtype(np.int16)):
            return x if dtype == np.uint16 else x.view(np.uint16)
        raise TypeError(f"{name} must be float16 or the uint16 bits of {self.config.kind} for this {self.name} "
                        f"kernel, got {dtype}")

    def __call__(self, q, k, v, o, lse, scale, workspace=None, stream=0, mask=None):
        """Launch on device arrays q, k, v (B, H, N, d; float16 or bits), o float32 (B, H, N_q, d), lse float32
        (B, H, N_q). workspace: v1's (l, m), float32 (B, H, N_q) each (None: allocated; v2 takes none); mask: the
        KernelMask of a kernel compiled for a list form (None otherwise)."""
        q, k, v = (self._bits(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
        if workspace is None or self.order == "v2":
            self.inner(q, k, v, o, lse, scale, stream, mask=mask)
            return
        if (mask is not None) != self.config.lists:
            raise ValueError(f"mask must be a KernelMask of form {self.config.mask_form!r} for this kernel"
                             if self.config.lists else "mask must be None for a kernel without a block mask")
        # v1 with the caller's l and m: the engine's launch (MmaKernel.__call__) with them as its workspace
        if q.shape[3] != self.config.head_dim:
            raise ValueError(f"q must have head dim {self.config.head_dim} for this kernel, got {q.shape[3]}")
        check_sequence(q.shape[2], k.shape[2])
        self.check_grid(q.shape[0], q.shape[1], q.shape[2])
        inner = self.inner
        if self.config.async_copy and not all(aligned16(x) for x in (q, k, v)):  # cp.async needs 16-byte rows
            inner = inner.without_async()
        grid, block = self.launch_shape(q.shape[0], q.shape[1], q.shape[2])
        l_hbm, m_hbm = workspace
        with backend.serialised(block[0]):
            inner.kernel[grid, block, stream](q, k, v, o, lse, l_hbm, m_hbm, float32(scale), *mask_arrays(mask),
                                              ())  # no score mod


def _maker(order: str):
    @functools.lru_cache(maxsize=None)
    def make(block_q: int, block_k: int, head_dim: int, causal: bool, mask_form: str = "none",
             dtype: str = "float16") -> MmaVariantKernel:
        config = check(order, block_q, block_k, head_dim, causal, mask_form, dtype)
        return MmaVariantKernel(order, _MAKE[order](dtype, config.warps, block_k, head_dim, bool(causal),
                                                    mask_form=config.mask_form, row_blocks=config.row_blocks))

    make.__name__ = make.__qualname__ = f"make_{order}_mma_variant"
    make.__doc__ = (f"The tensor-core {order} kernel as a registry variant ({order}-mma): the registry's "
                    f"arguments plus dtype, the input type (float16, bfloat16, or float32 by 3xTF32); cached.")
    return make


make_v1_mma_variant = _maker("v1")
make_v2_mma_variant = _maker("v2")

__all__ = ["BLOCK_Q", "DTYPES", "MmaVariantKernel", "TILE_MULTIPLE", "check", "make_v1_mma_variant", "make_v2_mma_variant"]
