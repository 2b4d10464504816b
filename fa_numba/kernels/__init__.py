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
from fa_numba.kernels.common import MAX_HEAD_DIM, Config
from fa_numba.kernels.layout import default_config
from fa_numba.kernels.engine_v1 import make_v1_engine
from fa_numba.kernels.engine_v2 import make_v2_engine
from fa_numba.kernels.rowwise_v1 import make_v1
from fa_numba.kernels.rowwise_v2 import make_v2

backend.patch_simulator()  # thread-safe shared arrays in the simulator (see backend.patch_simulator)


@dataclass(frozen=True)
class Variant:
    name: str
    order: str  # the loop order whose iomodel traffic it must match
    description: str
    make: Callable
    engine: bool  # a register-tiled kernel of the tile engine (else one thread per query row)

    def config(self, block_q: int, block_k: int, head_dim: int, causal: bool, mask_form: str = "none") -> Config:
        """The checked compile-time configuration of a launch, without compiling anything (errors name the tile)."""
        return Config(self.order, block_q, block_k, head_dim, bool(causal), engine=self.engine,
                      mask_form=mask_form).check()


VARIANTS = {
    "v1": Variant("v1", "v1", "FlashAttention Alg. 1 on the tile engine: K/V outer, O/l/m round-trip HBM per visit; "
                  "grid (B*H), register micro-tiles", make_v1_engine, True),
    "v2": Variant("v2", "v2", "FlashAttention-2 on the tile engine: Q outer, (m, l, acc) in registers; grid (T_r, B*H), "
                  "register micro-tiles", make_v2_engine, True),
    "v1-rowwise": Variant("v1-rowwise", "v1", "Alg. 1 line by line: one thread per query row, its row of Q, S and O "
                          "in local memory", make_v1, False),
    "v2-rowwise": Variant("v2-rowwise", "v2", "FlashAttention-2 line by line: one thread per query row, its row of Q, "
                          "S and O in local memory", make_v2, False),
}


def default_tiles(head_dim: int) -> tuple[int, int]:
    """(block_q, block_k) by head dim: the tile engine's shipped tiles (layout.DEFAULTS), which fit the 48 KB
    static shared-memory budget of every variant (the one-thread-per-row kernels need only 2 B_c d 4 bytes)."""
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


__all__ = ["Config", "VARIANTS", "Variant", "default_tiles", "poisoned_outputs"]
