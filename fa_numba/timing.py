"""Kernel timing shared by `compare`, the sweep and the benchmark scripts.

On a GPU: CUDA events around each call, after warm-up calls (the first compiles the kernel), reported as
the median and the 10th / 90th percentiles in milliseconds. In the simulator there is no GPU clock: the
same numbers are taken with a wall clock and labelled as such, and mean nothing about a GPU.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from fa_numba import backend, shapes


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    repeats: int
    clock: str  # "cuda-events" or "wall-clock (simulator)"

    def as_dict(self) -> dict:
        return asdict(self)


def _timed_ms(fn, on_gpu: bool) -> float:
    from numba import cuda

    if on_gpu:
        start, stop = cuda.event(timing=True), cuda.event(timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return cuda.event_elapsed_time(start, stop)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_call(fn, *, warmup: int = 3, repeats: int = 20, slow_ms: float | None = None,
              slow_repeats: int = 5) -> Timing:
    """Time `fn()` (which launches kernels) `repeats` times after `warmup` untimed calls (at least one).

    With slow_ms, a call whose last warm-up took longer is timed `slow_repeats` times instead; the
    Timing records how many repeats were taken.
    """
    if repeats < 1 or warmup < 1 or slow_repeats < 1:
        raise ValueError(f"repeats, warmup and slow_repeats must be >= 1, got {repeats}, {warmup}, {slow_repeats}")
    from numba import cuda

    on_gpu = backend.name() == "gpu"
    for _ in range(warmup - 1):
        fn()
    last_warmup_ms = _timed_ms(fn, on_gpu)  # also the last warm-up call
    cuda.synchronize()
    if slow_ms is not None and last_warmup_ms > slow_ms:
        repeats = slow_repeats
    samples = [_timed_ms(fn, on_gpu) for _ in range(repeats)]
    p10, median, p90 = np.percentile(samples, [10, 50, 90])
    return Timing(float(median), float(p10), float(p90), repeats, "cuda-events" if on_gpu else "wall-clock (simulator)")


def attention_flops(batch: int, heads: int, n_q: int, n_k: int, d: int, causal: bool = False, mask=None) -> float:
    """4 B H d times the (query, key) pairs computed (two matmuls of 2 flops per multiply-add).

    Without a mask every N_q N_k pair counts; causal=True halves that (the convention of flash-attn's
    benchmarks, not the exact triangle). A `fa_numba.masks` mask counts its visible pairs exactly: the sum of
    its row intervals' lengths, or of its dense form where it has no intervals (from_function / from_dense).
    causal=True and a mask together are refused, as everywhere (shapes.check_mask)."""
    causal, mask = shapes.check_mask(causal, mask)
    per_pair = 4.0 * batch * heads * d
    if mask is not None:
        return per_pair * _visible_pairs(mask, n_q, n_k)
    flops = per_pair * n_q * n_k
    return flops / 2 if causal else flops


def _visible_pairs(mask, n_q: int, n_k: int) -> int:
    """The (query, key) pairs a mask shows: from its row intervals (O(N_q)), else its dense form."""
    intervals = mask.row_intervals(n_q, n_k)
    if intervals is None:
        return int(mask.dense(n_q, n_k).sum())
    lo, hi = intervals
    return int((hi.astype(np.int64) - lo).sum())
