"""The launch of a tensor-core forward kernel, shared by both orders (engine_v1, engine_v2 give the grid and the
arguments): the checks before a launch (the mask's form, head dims, CUDA's grid limits, 16-byte rows for
cp.async, else the same kernel with plain loads) and the Numba types `fa_numba.profile` compiles for.
"""

from __future__ import annotations

from numba import cuda, float32

from fa_numba import backend
from fa_numba.kernels import disk_cache
from fa_numba.kernels.block_lists import mask_arrays, mask_types
from fa_numba.kernels.mma.engine import MmaConfig
from fa_numba.kernels.mma.staging import aligned16
from fa_numba.kernels.mma.tf32 import FLOAT32_KINDS
from fa_numba.kernels.score_mod import NO_CAPTURED, tuple_type


class MmaKernel:
    """A compiled tensor-core forward kernel: kernel(q, k, v, o, lse, scale, mask=, captured=) on device arrays,
    q, k, v (B, H, N, d; v d_v) uint16 bits of float16 or bfloat16 values, or float32 (config.kind), o float32
    (B, H, N_q, d_v), lse float32 (B, H, N_q); mask: the block mask's kernels.block_lists.KernelMask on this kernel's tiles for a
    kernel compiled with a list form (config.mask_form), None otherwise. Subclasses give the order's grid and
    arguments."""

    GRID_AXES: tuple = ()
    ORDER = ""

    def __init__(self, config: MmaConfig, kernel_source):
        self.config = config.check()
        self.source = kernel_source(config)  # the Python function, compiled again by fa_numba.profile
        self.max_registers = self.register_cap(self.config)  # fa_numba.profile compiles with it too
        cap = {"max_registers": self.max_registers} if self.max_registers and backend.name() == "gpu" else {}
        self.kernel = disk_cache.jit(self.source, **cap)  # the simulator has no registers (nor the option)
        # strided views (layout "A") take a build of their own without the cap, since a dispatcher's cap holds for
        # all its builds: the causal d = 64 one spills 8 / 12 bytes capped at 168 and takes 168 without spills
        # uncapped (ptxas allocates otherwise under -maxrregcount; sm_90a, 2026-12-04)
        self.kernel_for_views = disk_cache.jit(self.source) if cap else self.kernel

    @staticmethod
    def register_cap(config: MmaConfig) -> int | None:
        """The registers a thread may take where a cap keeps one more block resident, or None (the compiler's
        choice). The orders list the configurations they cap, each compiled at the cap without spills."""
        return None

    def grid(self, batch: int, heads: int, n_q: int) -> tuple:
        raise NotImplementedError

    @staticmethod
    def make(kind, warps, block_k, head_dim, causal, async_copy=None, mod=None, mask_form="none",
             value_dim=None, row_blocks=1) -> "MmaKernel":
        """The order's cached factory (make_v1_mma / make_v2_mma)."""
        raise NotImplementedError

    def without_async(self) -> "MmaKernel":
        """The same kernel staging by plain loads (for inputs that are not 16-byte aligned); cached."""
        c = self.config
        return self.make(c.kind, c.warps, c.block_k, c.head_dim, c.causal, async_copy=False, mod=c.mod,
                         mask_form=c.mask_form, value_dim=c.value_dim or None, row_blocks=c.row_blocks)

    def launch_shape(self, batch: int, heads: int, n_q: int) -> tuple:
        """(grid, block) of a launch on (batch, heads, N_q): what fa_numba.profile and the tracer size by."""
        return self.grid(batch, heads, n_q), (32 * self.config.warps,)

    def check_grid(self, batch: int, heads: int, n_q: int) -> None:
        """A ValueError naming the axis where the launch's grid is past CUDA's limits (common.check_grid)."""
        from fa_numba.kernels.common import check_grid

        check_grid(self.grid(batch, heads, n_q), self.GRID_AXES, f"{self.ORDER}-mma")

    def arguments(self, q, k, v, o, lse, scale) -> tuple:
        return (q, k, v, o, lse, scale)

    def __call__(self, q, k, v, o, lse, scale, stream=0, captured=NO_CAPTURED, mask=None):
        """Launch; captured: the score mod's and the mask_mod's device arrays (`score_mod.device_arrays`) for a
        kernel compiled with them (config.mod), () otherwise; mask: the KernelMask (class docstring)."""
        from fa_numba.kernels.common import check_sequence

        mod = self.config.mod
        if len(captured) != (0 if mod is None else len(mod.captured) + len(mod.mask_captured)):
            raise ValueError(f"captured must hold the score mod's device arrays for this kernel, got {len(captured)}")
        if (mask is not None) != self.config.lists or (mask is not None and mask.form != self.config.mask_form):
            raise ValueError(f"mask must be a KernelMask of form {self.config.mask_form!r} for this kernel"
                             if self.config.lists else "mask must be None for a kernel without a block mask")
        if q.shape[3] != self.config.head_dim:
            raise ValueError(f"q must have head dim {self.config.head_dim} for this kernel, got {q.shape[3]}")
        if v.shape[3] != self.config.d_v or o.shape[3] != self.config.d_v:
            raise ValueError(f"v and o must have head dim d_v = {self.config.d_v} for this kernel, got "
                             f"{v.shape[3]} and {o.shape[3]}")
        check_sequence(q.shape[2], k.shape[2])
        self.check_grid(q.shape[0], q.shape[1], q.shape[2])
        grid = self.grid(q.shape[0], q.shape[1], q.shape[2])
        if self.config.async_copy and not all(aligned16(x) for x in (q, k, v)):  # cp.async needs 16-byte rows
            return self.without_async()(q, k, v, o, lse, scale, stream, captured, mask)
        threads = 32 * self.config.warps
        kernel = self.kernel if all(_c_contiguous(x) for x in (q, k, v)) else self.kernel_for_views
        with backend.serialised(threads):
            kernel[grid, threads, stream](*self.arguments(q, k, v, o, lse, float32(scale)), *mask_arrays(mask),
                                          tuple(captured))

    def argtypes(self, dtype=None) -> tuple:
        """The Numba types of the kernel's arguments (what fa_numba.profile compiles for sm_90a): the same for
        every 16-bit dtype (the inputs are their bits), float32 arrays for the float32 kinds; the order's
        `base_types`, the mask arrays, then the captured arrays'."""
        return self.base_types(self.config.kind) + mask_types() + (tuple_type(self.config.mod),)

    @staticmethod
    def array_types(kind: str = "float16"):
        """The Numba types of the inputs (uint16 bits, or float32 for the float32 kinds), the float32 output and
        the float32 statistics."""
        from numba import types

        inputs = types.float32 if kind in FLOAT32_KINDS else types.uint16
        return (types.Array(inputs, 4, "C"), types.Array(types.float32, 4, "C"), types.Array(types.float32, 3, "C"))


def _c_contiguous(x) -> bool:
    """Whether an input is C-contiguous: numba's device arrays (what the api passes) by their method, host arrays
    (a kernel called directly) by their flags."""
    return x.is_c_contiguous() if hasattr(x, "is_c_contiguous") else x.flags["C_CONTIGUOUS"]


__all__ = ["MmaKernel"]
