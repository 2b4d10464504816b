"""Numba CUDA kernels and their registry.

Every variant is listed in `VARIANTS` with a one-line verdict; tests, `compare` and the benchmarks iterate
it, so a new variant is validated and timed without new glue. A variant's `make(block_q, block_k,
head_dim, causal)` returns a cached, callable kernel: kernel(q, k, v, o, lse, scale, workspace=None, stream=0)
on device arrays of shape (B, H, N, d), o float32 (B, H, N_q, d), lse float32 (B, H, N_q).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fa_numba import backend
from fa_numba.kernels.common import MAX_HEAD_DIM, SHARED_BYTES_LIMIT, Config
from fa_numba.kernels.v1 import make_v1
from fa_numba.kernels.v2 import make_v2

backend.patch_simulator()  # thread-safe shared arrays in the simulator (see backend.patch_simulator)

DEFAULT_BLOCK_Q = 64  # threads per block: one per query row
KV_BLOCK_CHOICES = (64, 32, 16, 8, 4, 2, 1)


@dataclass(frozen=True)
class Variant:
    name: str
    order: str  # the loop order whose iomodel traffic it must match
    description: str
    make: Callable


VARIANTS = {
    "v1": Variant("v1", "v1", "FlashAttention Alg. 1: K/V outer, O/l/m round-trip HBM per visit; grid (B*H)", make_v1),
    "v2": Variant("v2", "v2", "FlashAttention-2: Q outer, (m, l, acc) on chip, O/LSE written once; grid (T_r, B*H)", make_v2),
}


def default_tiles(head_dim: int) -> tuple[int, int]:
    """(block_q, block_k) by head dim: 64 query rows, and the largest power-of-two key tile <= 64 whose
    K_j and V_j fit the 48 KB static shared-memory budget."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim d must be <= {MAX_HEAD_DIM}, got {head_dim}")
    for block_k in KV_BLOCK_CHOICES:
        if 2 * block_k * head_dim * 4 <= SHARED_BYTES_LIMIT:
            return DEFAULT_BLOCK_Q, block_k
    raise AssertionError("unreachable: block_k = 1 always fits for d <= MAX_HEAD_DIM")


def poisoned_outputs(q_shape):
    """Device arrays (out, lse, workspace) for a launch, filled with NaN so an unwritten element shows."""
    import numpy as np
    from numba import cuda

    stats = tuple(q_shape[:-1])
    return (cuda.to_device(np.full(tuple(q_shape), np.nan, np.float32)),
            cuda.to_device(np.full(stats, np.nan, np.float32)),
            (cuda.to_device(np.full(stats, np.nan, np.float32)), cuda.to_device(np.full(stats, np.nan, np.float32))))


__all__ = ["Config", "VARIANTS", "Variant", "default_tiles", "make_v1", "poisoned_outputs", "make_v2"]
