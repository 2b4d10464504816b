"""The gradients of a score mod's captured arrays, without atomics (issue 27, proofs/L13 claim 4):

    dC[e] = sum over the visible pairs p = (b, h, i, j) with index(p) = e of dS'_p * d mod / d C[e],
    dS'_p = P_p (dP_p - D_i),  P_p = exp(mod(S_p) - LSE_i),  dP_p = dO_i . V_j,  D_i = dO_i . O_i,

for each captured array C that has a captured_grad (index(p) and the derivative are what it returns).

How, and why so: the entry a pair adds into is whatever the user's function returns, so no two pairs can be
assumed to touch different entries; atomic float adds would make the sum's order, and its bits, vary from
run to run. Instead every query row r = (b, h, i) owns a private dense copy of dC in a float64 workspace
(`accumulate`: one thread per row walks its keys j in increasing order, recomputing S, P and dP from Q, K,
V, O and dO in float32 as the backward does), and a second kernel (`reduce`: one thread per entry) adds the
rows' copies in increasing row order. Every sum has a fixed order: the result is bitwise repeatable, on any
GPU and in the simulator. The rows are taken in chunks so that the workspace stays under WORKSPACE_BYTES.

Cost, plainly: a research path, not a fast one. O(B H N_q N_k d) multiply-adds for the recomputation, one
thread per row with K and V read from global memory (L2), and O(rows x size(C)) for zeroing and reducing
the copies (size(C) = H (N_q + N_k - 1) for relative_bias: H times the pairs' count per row). The dense
float64 accumulation keeps the sums' own rounding far below the float32 rounding of each dS'.

A captured_grad must return (index, derivative) with the index a tuple of as many ints as its array has axes
(at most MAX_AXES); an index outside the array sets an error flag, the pair is skipped, and the launch raises
a ModError naming the mod and the array (the reference raises on the same index).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64

from fa_numba import backend
from fa_numba.kernels import disk_cache
from fa_numba.kernels.block_lists import PAIR_FORMS
from fa_numba.kernels.common import NEG_INF, ZERO, to_f32
from fa_numba.kernels.mask_mod import mask_slice, pair_visible
from fa_numba.kernels.score_mod import KernelMod, _caller, apply_fn

THREADS = 128
MAX_AXES = 4
WORKSPACE_BYTES = 64 * 2**20  # the rows' private copies of dC, per chunk


def _flattener(ndim: int):
    """flat(index, shape) -> (flat offset, inside): the row-major offset of an ndim-tuple index and whether
    every component is within the shape (static indices: the tuple may mix int types)."""
    if ndim == 1:
        def flat(idx, shape):
            return idx[0], 0 <= idx[0] < shape[0]
    elif ndim == 2:
        def flat(idx, shape):
            return idx[0] * shape[1] + idx[1], 0 <= idx[0] < shape[0] and 0 <= idx[1] < shape[1]
    elif ndim == 3:
        def flat(idx, shape):
            inside = 0 <= idx[0] < shape[0] and 0 <= idx[1] < shape[1] and 0 <= idx[2] < shape[2]
            return (idx[0] * shape[1] + idx[1]) * shape[2] + idx[2], inside
    else:
        def flat(idx, shape):
            inside = (0 <= idx[0] < shape[0] and 0 <= idx[1] < shape[1] and 0 <= idx[2] < shape[2]
                      and 0 <= idx[3] < shape[3])
            return ((idx[0] * shape[1] + idx[1]) * shape[2] + idx[2]) * shape[3] + idx[3], inside
    return cuda.jit(device=True, inline=True)(flat)


@functools.lru_cache(maxsize=None)
def make_accumulate(kmod: KernelMod, which: int, cg, head_dim: int, causal: bool, lists: bool, pair_form: bool):
    """The per-row kernel for captured array `which` (its captured_grad `cg`): rows [r_start, r_start + R) of
    the flattened (b, h, i), each into its own row of the float64 workspace."""
    modded = apply_fn(kmod)
    pair = pair_visible(kmod)  # a dense byte mask's or a mask_mod's pair test
    grad = _caller(cg, len(kmod.captured), cast=False)  # (index, derivative) as cg returns them
    flat = _flattener(kmod.captured[which][1])
    D, WHICH = head_dim, which

    def accumulate(q, k, v, out, dout, lse, scale, lohis, denses, captured, work, r_start, error):
        r = r_start + cuda.grid(1)
        heads, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
        rows = q.shape[0] * heads * n_q
        local = r - r_start
        if local >= work.shape[0] or r >= rows:
            return
        mine = work[local]
        for e in range(mine.shape[0]):
            mine[e] = 0.0
        bh = r // n_q
        i = r - bh * n_q
        b = bh // heads
        h = bh - b * heads
        h_kv = h // (heads // k.shape[1])
        lohi, dense = mask_slice(lohis, b, h), mask_slice(denses, b, h)  # this (batch, head)'s mask
        delta = n_k - n_q
        value = lse[b, h, i]
        shift = value if value != NEG_INF else ZERO
        d_row = ZERO
        for x in range(D):
            d_row += to_f32(dout[b, h, i, x]) * out[b, h, i, x]
        lo, hi = 0, n_k
        if causal:
            hi = min(n_k, i + delta + 1)
        if lists:
            lo, hi = lohi[i, 0], lohi[i, 1]
        table = captured[WHICH]
        for j in range(lo, hi):
            if pair_form and not pair(dense, b, h, i, j, captured):
                continue
            dot = ZERO
            dp = ZERO
            for x in range(D):
                dot += to_f32(q[b, h, i, x]) * to_f32(k[b, h_kv, j, x])
                dp += to_f32(dout[b, h, i, x]) * to_f32(v[b, h_kv, j, x])
            s = scale * dot
            p = math.exp(modded(s, b, h, i, j, captured) - shift)
            ds = p * (dp - d_row)
            idx, derivative = grad(s, b, h, i, j, captured)
            offset, inside = flat(idx, table.shape)
            if inside:
                mine[offset] += float64(ds) * derivative
            else:
                error[0] = 1

    return disk_cache.jit(accumulate)


@disk_cache.jit
def reduce_rows(work, rows, total):
    """total[e] += work[0, e] + ... + work[rows - 1, e], in that order (one thread per entry e)."""
    e = cuda.grid(1)
    if e < total.shape[0]:
        acc = total[e]
        for r in range(rows):
            acc += work[r, e]
        total[e] = acc


def run(q, k, v, out, dout, lse, scale, mod, captured, *, causal: bool, mask=None, stream=0, mask_mod=None) -> tuple:
    """The captured arrays' gradients of one backward call: device arrays q, k, v (B, H, N, d), out, dout like
    q, lse (B, H, N_q) float32; mod the ScoreMod, captured its arrays on the device (score_mod.device_arrays);
    mask a KernelMask (None for none or causal), mask_mod the slice_masks.MaskMod it was made from, if one
    (its arrays follow the mod's in captured). Returns one entry per captured array: a float64 NumPy array
    of its shape, or None where it has no captured_grad. Raises ModError where a captured_grad's index falls
    outside its array."""
    from fa_numba.kernels.block_lists import mask_arrays
    from fa_numba.mods import ModError

    kmod = KernelMod.of(mod, mask_mod)
    batch, heads, n_q, d = q.shape
    rows = batch * heads * n_q
    lists = mask is not None
    arrays = mask_arrays(mask)
    lohi, dense = arrays[6], arrays[7]
    grads = []
    for which, cg in enumerate(mod.captured_grad):
        if cg is None:
            grads.append(None)
            continue
        if kmod.captured[which][1] > MAX_AXES:
            raise ValueError(f"score_mod {mod.name}: captured[{which}] has {kmod.captured[which][1]} axes; the "
                             f"kernels' captured gradients take at most {MAX_AXES}")
        size = int(np.prod(mod.captured[which].shape))
        chunk = max(1, min(rows, WORKSPACE_BYTES // (8 * size)))
        kernel = make_accumulate(kmod, which, cg, d, bool(causal), lists, lists and mask.form in PAIR_FORMS)
        work = cuda.device_array((chunk, size), dtype=np.float64, stream=stream)
        total = cuda.to_device(np.zeros(size, np.float64), stream=stream)
        error = cuda.to_device(np.zeros(1, np.int32), stream=stream)
        for start in range(0, rows, chunk):
            count = min(chunk, rows - start)
            with backend.serialised(THREADS):
                kernel[-(-count // THREADS), THREADS, stream](q, k, v, out, dout, lse, float32(scale), lohi, dense,
                                                               tuple(captured), work, start, error)
            with backend.serialised(THREADS):
                reduce_rows[-(-size // THREADS), THREADS, stream](work, count, total)
        if error.copy_to_host(stream=stream)[0]:
            raise ModError(f"score_mod {mod.name}: captured_grad[{which}]{mod._named(which)} returned an index "
                           f"outside shape {mod.captured[which].shape} for some pair")
        grads.append(total.copy_to_host(stream=stream).reshape(mod.captured[which].shape))
    return tuple(grads)


__all__ = ["MAX_AXES", "WORKSPACE_BYTES", "make_accumulate", "reduce_rows", "run"]
