"""Pieces shared by the v1 and v2 kernels: constants, the online-softmax device function, budgets.

Thread layout of both kernels: one thread per query row of the current tile (B_r threads per block).
A thread keeps its row of Q, its scores and its accumulator in per-thread local arrays; the block shares
the K_j and V_j tiles in shared memory (converted to float32 on load). Tile sizes and d are Python ints
closed over by the factories, so Numba compiles them as constants (they size the shared and local arrays).
Loop trip counts come from the arrays' runtime shapes (d = q.shape[3], the tile's column count), never from
the constants: that is the DESIGN habit, and it also stops LLVM from fully unrolling the d loops, which at
d = 128 ran out of registers and spilled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32

NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
SHARED_BYTES_LIMIT = 48 * 1024  # static shared memory per block
MAX_HEAD_DIM = 256
MAX_BLOCK_THREADS = 1024
INPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


@dataclass(frozen=True)
class Config:
    """One compiled specialisation: tile sizes, head dim and masking are compile-time constants."""

    order: str
    block_q: int
    block_k: int
    head_dim: int
    causal: bool

    @property
    def shared_bytes(self) -> int:
        """K_j and V_j tiles, float32: 2 B_c d 4 bytes."""
        return 2 * self.block_k * self.head_dim * 4

    def check(self) -> "Config":
        for name in ("block_q", "block_k", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head dim d must be <= {MAX_HEAD_DIM}, got {self.head_dim}")
        if self.block_q > MAX_BLOCK_THREADS:
            raise ValueError(f"block_q is the threads per block and must be <= {MAX_BLOCK_THREADS}, got {self.block_q}")
        if self.shared_bytes > SHARED_BYTES_LIMIT:
            raise ValueError(
                f"block_k = {self.block_k} with d = {self.head_dim} needs {self.shared_bytes} bytes of shared memory "
                f"for K_j and V_j (2 * block_k * d * 4), over the {SHARED_BYTES_LIMIT}-byte static limit; "
                f"use block_k <= {SHARED_BYTES_LIMIT // (8 * self.head_dim)}"
            )
        return self


class CompiledKernel:
    """One compiled specialisation of a loop order. Subclasses give `grid(q)` and `launch(...)`."""

    def __init__(self, config: Config, kernel_source):
        self.config = config
        self.source = kernel_source(config)  # the Python function, for compile_ptx in the compile check
        self.kernel = cuda.jit(self.source)

    def __call__(self, q, k, v, o, lse, scale, workspace=None, stream=0):
        """Launch on device arrays q, k, v (B, H, N, d), o (B, H, N_q, d) and lse (B, H, N_q), float32 outputs,
        queued on `stream` (a Numba stream; 0: the default stream)."""
        if q.shape[3] != self.config.head_dim:
            raise ValueError(f"q must have head dim {self.config.head_dim} for this kernel, got {q.shape[3]}")
        grid, block = self.grid(q)
        self.launch(self.kernel[grid, block, stream], q, k, v, o, lse, float32(scale), workspace)


@cuda.jit(device=True, inline=True)
def load_kv_tile(k, v, b, h_kv, c0, cols, d, k_tile, v_tile, tid, n_threads):
    """Cooperative load of K_j, V_j rows [c0, c0 + cols) into shared memory; rows past N_k are not read."""
    for idx in range(tid, cols * d, n_threads):
        c = idx // d
        x = idx - c * d
        k_tile[c, x] = float32(k[b, h_kv, c0 + c, x])
        v_tile[c, x] = float32(v[b, h_kv, c0 + c, x])


@cuda.jit(device=True, inline=True)
def score_row(q_row, k_tile, cols, d, scale, row, c0, delta, masked, s):
    """s[c] = scale * <q_row, K_j[c]>, and -inf where key c0 + c is in the future of query `row`."""
    for c in range(cols):
        dot = ZERO
        for x in range(d):
            dot += q_row[x] * k_tile[c, x]
        s[c] = scale * dot
        if masked and c0 + c > row + delta:
            s[c] = NEG_INF


@cuda.jit(device=True, inline=True)
def online_update(m, l, acc, s, cols, d, v_tile):
    """Fold one tile of scores into (m, l, acc); the twin of online_softmax.update, in the same order.

    Returns (m_new, l_new); acc is updated in place and s is overwritten with the weights p.
    Every exp argument is <= 0 (proofs/L2_online_softmax.md); shift = 0 while nothing is visible.
    """
    m_tile = NEG_INF
    for c in range(cols):
        m_tile = max(m_tile, s[c])
    m_new = max(m, m_tile)
    shift = m_new if m_new != NEG_INF else ZERO
    alpha = math.exp(m - shift)  # rescales the old state to the new max
    l_tile = ZERO
    for c in range(cols):
        p = math.exp(s[c] - shift)
        s[c] = p
        l_tile += p
    l_new = alpha * l + l_tile
    for x in range(d):
        pv = ZERO
        for c in range(cols):
            pv += s[c] * v_tile[c, x]
        acc[x] = alpha * acc[x] + pv
    return m_new, l_new


@cuda.jit(device=True, inline=True)
def log_sum_exp(m, l):
    """LSE = m + log l, or -inf for a row that saw no key (l = 0)."""
    if l > ZERO:
        return m + math.log(l)
    return NEG_INF
