"""Warp-level operations for the kernels: tensor-core products (mma.sync f16, bf16, tf32), ldmatrix,
cp.async with its commit and waits, 16-bit and tf32 conversions, ex2, NaN-keeping min and max.

One name, two implementations, chosen once at import by the backend (`fa_numba.backend`):
- on a real numba.cuda (a GPU, or compiling SASS on a CPU), `ptx`: @intrinsics that emit inline PTX;
- in the CUDA simulator, `emulated_tc`: pure Python, the lanes of a warp exchanging their fragments
  (`emulation`, which also gives the simulator the syncwarp / shfl_*_sync / activemask it lacks; installed
  by `backend.patch_simulator`).
Kernels write `warp.mma_f16(c, a, b)` and `cuda.shfl_xor_sync(...)` the same way in both worlds.
proofs/L10_fragments.md says which lane holds which element of every fragment.
"""

from fa_numba import backend

if backend.name() == "simulator":
    from fa_numba.warp import emulated_tc as implementation
else:
    from fa_numba.warp import ptx as implementation

mma_f16 = implementation.mma_f16
mma_bf16 = implementation.mma_bf16
mma_tf32 = implementation.mma_tf32
ldmatrix_x4 = implementation.ldmatrix_x4
ldmatrix_x4_trans = implementation.ldmatrix_x4_trans
ldmatrix_x2 = implementation.ldmatrix_x2
ldmatrix_x2_trans = implementation.ldmatrix_x2_trans
cp_async16 = implementation.cp_async16
strided = implementation.strided
cp_async_commit = implementation.cp_async_commit
cp_async_wait_all = implementation.cp_async_wait_all
cp_async_wait_1 = implementation.cp_async_wait_1
pack_f16x2 = implementation.pack_f16x2
pack_bf16x2 = implementation.pack_bf16x2
to_tf32 = implementation.to_tf32
tf32_value = implementation.tf32_value
ex2 = implementation.ex2
min_nan = implementation.min_nan
max_nan = implementation.max_nan
