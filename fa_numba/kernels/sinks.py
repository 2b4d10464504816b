"""Learnable sinks on the device: the sink merged into a row's (O, LSE) once, its gradient, and LSE's cotangent.

A sink logit s_h is the online-softmax state (m = s_h, l = 1, acc = 0) of a column with no value (proofs/L14).
Merging it into a finished row's state (m = LSE, l = 1, acc = O) is the combine of proofs/L11 with two
parts, so every kernel family gets its sink the same way, after its own result and once per row (never per
tile, split or ring step):

- `merge(out, lse, sinks)`: in place on a kernel's float32 O (B, H', R, d_v) and LSE (B, H', R). In the plain
  layout H' = H and every row of slice (b, h) is query head h's; the decoding kernels pack a K/V head's
  group into its rows (H' = H_kv, R = g N_q: row r is query head h_kv g + r // N_q), so `rows_per_head` says
  how many rows of a slice one query head has. The arithmetic is the combine kernel's (kernels/decode.py)
  for two parts, so its rule bounds it (split_kv.combine_terms).
- `gradients(lse, dvec, sinks, dsinks)`: dsinks_h = -sum_{b, i} exp(s_h - LSE_bhi) D_bhi, one block per
  head summing in a fixed order (a tree over the block's threads): deterministic, no atomics.
- `shift(dvec, dlse)`: D_i -= dLSE_i between the backward's preprocess and its main kernels, which is
  all a cotangent of LSE changes in the gradients (dS = P (dP - D + dLSE)).
"""

from __future__ import annotations

import math

from numba import cuda, float32

from fa_numba import backend
from fa_numba.kernels import disk_cache
from fa_numba.kernels.common import NEG_INF, ZERO, check_grid

ROW_THREADS = 128  # threads a block of the row-wise kernels (merge, shift)
SUM_THREADS = 128  # threads of a sink-gradient block: its tree sums in shared memory take a power of two


@disk_cache.jit
def merge_kernel(out, lse, sinks, rows_per_head):
    """Thread per row: (O, LSE) <- merge((LSE, 1, O), (s, 1, 0)), the combine of kernels/decode.py for two
    parts; an empty part (LSE or s = -inf) is the identity, skipped rather than multiplied."""
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    heads, n_rows, d = out.shape[1], out.shape[2], out.shape[3]
    if row >= out.shape[0] * heads * n_rows:
        return
    r = row % n_rows
    bh = row // n_rows
    h = bh % heads
    b = bh // heads
    s = sinks[(h * n_rows + r) // rows_per_head]
    a = lse[b, h, r]
    if s == NEG_INF:  # no sink: the identity
        return
    if a == NEG_INF:  # no visible key (or only -inf scores): the sink alone, O = 0 and LSE = s
        for x in range(d):
            out[b, h, r, x] = ZERO
        lse[b, h, r] = s
        return
    m = a if a >= s else s  # NaN in s gives m = NaN, NaN in a gives exp(NaN): both rows NaN
    alpha = math.exp(a - m)
    beta = math.exp(s - m)
    l = alpha + beta
    for x in range(d):
        out[b, h, r, x] = alpha * out[b, h, r, x] / l
    lse[b, h, r] = m + math.log(l)


@disk_cache.jit
def shift_kernel(dvec, dlse):
    """Thread per row: D_i <- D_i - dLSE_i."""
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    heads, n_rows = dvec.shape[1], dvec.shape[2]
    if row < dvec.shape[0] * heads * n_rows:
        r = row % n_rows
        bh = row // n_rows
        dvec[bh // heads, bh % heads, r] -= dlse[bh // heads, bh % heads, r]


@disk_cache.jit
def gradient_kernel(lse, dvec, sinks, dsinks):
    """Block per query head h: each thread sums exp(s_h - LSE_i) D_i over the rows t, t + T, ... of every batch
    entry in order, then a tree over the threads; dsinks[h] = -(the sum). Rows with LSE = -inf add nothing."""
    h = cuda.blockIdx.x
    t = cuda.threadIdx.x
    batch, n_rows = lse.shape[0], lse.shape[2]
    s = sinks[h]
    total = ZERO
    for i in range(t, batch * n_rows, SUM_THREADS):
        b = i // n_rows
        r = i - b * n_rows
        a = lse[b, h, r]
        if a != NEG_INF:
            total += math.exp(s - a) * dvec[b, h, r]
    partial = cuda.shared.array(SUM_THREADS, float32)
    partial[t] = total
    cuda.syncthreads()
    width = SUM_THREADS // 2
    while width > 0:
        if t < width:
            partial[t] += partial[t + width]
        cuda.syncthreads()
        width //= 2
    if t == 0:
        dsinks[h] = -partial[0]


def _rows_launch(count: int, what: str):
    threads = min(ROW_THREADS, 8) if backend.name() == "simulator" else ROW_THREADS  # each simulated thread costs
    grid = (max(1, -(-count // threads)),)
    check_grid(grid, ("rows",), what)
    return grid, (threads,)


def merge(out, lse, sinks, rows_per_head: int = 0, stream=0) -> None:
    """Merge the sinks (H,) float32 into out (B, H', R, d_v) and lse (B, H', R) float32 device arrays, in place.
    rows_per_head: the rows of one query head in a (b, h') slice; 0: R (the plain layout, H' = H)."""
    batch, heads, n_rows = lse.shape
    if batch * heads * n_rows == 0:
        return
    grid, threads = _rows_launch(batch * heads * n_rows, "sink merge")
    with backend.serialised(threads[0]):
        merge_kernel[grid, threads, stream](out, lse, sinks, rows_per_head or n_rows)


def shift(dvec, dlse, stream=0) -> None:
    """dvec -= dlse on (B, H, N_q) float32 device arrays: the backward's D with LSE's cotangent (proofs/L14)."""
    batch, heads, n_rows = dvec.shape
    if batch * heads * n_rows == 0:
        return
    grid, threads = _rows_launch(batch * heads * n_rows, "LSE cotangent")
    with backend.serialised(threads[0]):
        shift_kernel[grid, threads, stream](dvec, dlse)


def gradients(lse, dvec, sinks, dsinks, stream=0) -> None:
    """dsinks (H,) float32 <- -sum_{b, i} exp(s_h - LSE_bhi) D_bhi from (B, H, N_q) lse and dvec (D, less LSE's
    cotangent where the loss reads LSE): one block of SUM_THREADS per head (`gradient_kernel`)."""
    heads = lse.shape[1]
    grid = (heads,)
    check_grid(grid, ("heads",), "sink gradient")
    with backend.serialised(SUM_THREADS):
        gradient_kernel[grid, (SUM_THREADS,), stream](lse, dvec, sinks, dsinks)
