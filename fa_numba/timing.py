"""Kernel timing shared by `compare`, the sweep and the benchmark scripts.

On a GPU: CUDA events around each call, after warm-up calls (the first compiles the kernel), reported as
the median and the 10th / 90th percentiles in milliseconds. In the simulator there is no GPU clock: the
same numbers are taken with a wall clock and labelled as such, and mean nothing about a GPU.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from fa_numba import backend


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    repeats: int
    clock: str  # "cuda-events" or "wall-clock (simulator)"

    def as_dict(self) -> dict:
        return asdict(self)


def time_call(fn, *, warmup: int = 3, repeats: int = 20) -> Timing:
    """Time `fn()` (which launches kernels) `repeats` times after `warmup` untimed calls."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    from numba import cuda

    for _ in range(warmup):
        fn()
    cuda.synchronize()
    samples = []
    on_gpu = backend.name() == "gpu"
    for _ in range(repeats):
        if on_gpu:
            start, stop = cuda.event(timing=True), cuda.event(timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(cuda.event_elapsed_time(start, stop))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    p10, median, p90 = np.percentile(samples, [10, 50, 90])
    return Timing(float(median), float(p10), float(p90), repeats, "cuda-events" if on_gpu else "wall-clock (simulator)")


def attention_flops(batch: int, heads: int, n_q: int, n_k: int, d: int, causal: bool) -> float:
    """4 B H N_q N_k d (two matmuls of 2 flops per multiply-add), halved for causal masking."""
    flops = 4.0 * batch * heads * n_q * n_k * d
    return flops / 2 if causal else flops
