"""The device session's jobs: what each one checks and times, the GPU lock they share, and the plan of them all.

Each job runs in a process of its own (`device_session.py --job SPEC`): it compiles its kernel outside the lock,
then, holding the GPU alone, checks it against the float64 reference with its rule at B=1, H=2, N=1024 and times
it at B=4, H=16, N=4096 (`time_ms`). benchmarks/device_session.py schedules them and renders the table
(device_table.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
LOCK = os.environ.get("FA_NUMBA_GPU_LOCK", "/tmp/fa_numba_gpu.lock")
SHAPE = (4, 16, 4096)  # B, H, N of the timings (the whole-kernel model's launch shape)
CHECK_N = 1024
SLOW_MS, SLOW_REPEATS = 30.0, 5  # a call over SLOW_MS is timed SLOW_REPEATS times after one warm-up



@contextlib.contextmanager
def gpu_lock():
    """Hold the GPU alone while timing (an exclusive lock on a file every job opens)."""
    with open(LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def locked(fn):
    def run(*args, **kwargs):
        with gpu_lock():
            return fn(*args, **kwargs)
    return run


def time_ms(fn, repeats: int = 20, warm: int = 3, torch=None) -> float:
    """Median ms of fn() over `repeats` calls after `warm` untimed ones: CUDA events around each call, all of them
    enqueued before one synchronize, so the host's launch overhead (Python, a CPU busy with other jobs' compiles)
    hides behind the previous call's kernels whenever a call takes longer to run than to launch. torch: time
    torch's stream with its events instead of numba's."""
    import numpy as np

    if torch is None:
        from numba import cuda

        new_event, sync, elapsed = cuda.event, cuda.synchronize, cuda.event_elapsed_time
    else:
        new_event, sync = (lambda: torch.cuda.Event(enable_timing=True)), torch.cuda.synchronize
        elapsed = lambda start, stop: start.elapsed_time(stop)  # noqa: E731
    first = new_event(), new_event()
    first[0].record()
    fn()
    first[1].record()
    sync()
    if elapsed(*first) > SLOW_MS:  # a slow call: fewer calls, each well past any launch overhead
        warm, repeats = 1, SLOW_REPEATS
    for _ in range(warm - 1):
        fn()
    sync()
    events = [(new_event(), new_event()) for _ in range(repeats)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    sync()
    return float(np.median([elapsed(start, stop) for start, stop in events]))


def _mma_gpu(smoke: bool):
    """benchmarks/mma_gpu.py, its timings made to take the GPU lock (and the queued events of time_ms)."""
    sys.path.insert(0, HERE)
    import mma_gpu

    mma_gpu.time_it = locked(time_ms)
    mma_gpu._torch_median = locked(mma_gpu._torch_median)
    return mma_gpu


def job_mma_fwd(spec: dict, smoke: bool) -> dict:
    from fa_numba import engines

    mg = _mma_gpu(smoke)
    if spec.get("uncapped"):  # the A / B of a register cap: this process builds every kernel at the compiler's choice
        from fa_numba.kernels.mma.engine_v2 import MmaV2Kernel

        MmaV2Kernel.REGISTER_CAPS = {}
    if spec.get("one_stage"):  # the A / B of the pipeline: v2 as before 2026-12-04, K_j and V_j waited for together
        import functools

        from fa_numba.kernels.mma.engine_v2 import make_v2_mma

        mg.MAKE = {**mg.MAKE, "v2": functools.partial(make_v2_mma, pipelined=False)}
    order, kind, d, causal = spec["order"], spec["dtype"], 16 if smoke else spec["d"], spec["causal"]
    two = order == "v2" and kind in engines.MMA_KINDS  # smoke: v2's two row blocks a warp on 1 warp
    warps, block_k, rows = (1, 16, 2 if two else 1) if smoke else engines.mma_tiles(d, None, None, kind, order)
    if spec.get("one_row_block") and rows != 1:  # the A / B of v2's 128-row tiles: 64 rows, one row block a warp
        warps, rows = 4 if not smoke else 1, 1
    if rows != 1:
        import functools

        mg.MAKE = {**mg.MAKE, "v2": functools.partial(mg.MAKE["v2"], row_blocks=rows)}
    mg.check(order, kind, d, block_k, causal, 32, heads=1, warps=warps)  # compiles: outside the lock
    if smoke:
        return {"block_q": 16 * warps * rows, "block_k": block_k,
                **mg.check(order, kind, d, block_k, causal, 32, heads=1, warps=warps)}
    import numpy as np

    b, h, n = SHAPE
    rng = np.random.default_rng(1)
    bits = [mg.bits_of(rng.standard_normal((b, h, n, d), dtype=np.float32), kind) for _ in range(3)]
    with gpu_lock():  # every launch of the check shape and the timing shape alone on the GPU
        row = {"block_q": 16 * warps * rows, "block_k": block_k,
               **mg.check(order, kind, d, block_k, causal, CHECK_N, heads=2, warps=warps)}
        if row["passed"]:
            run, _, _ = mg.launch(mg.MAKE[order](kind, warps, block_k, d, causal), bits, d)
            row["ms"] = time_ms(run)
    return row


def job_mma_bwd(spec: dict, smoke: bool) -> dict:
    mg = _mma_gpu(smoke)
    mg.sdpa_backward_ms = lambda *shape: None  # SDPA's backward is a job of its own
    d = 16 if smoke else spec["d"]
    mg.backward_row(d, spec["causal"], spec["deterministic"], 32, None, heads=1, kind=spec["dtype"])  # compiles
    mg.time_it = time_ms  # the lock is held below
    with gpu_lock() if not smoke else contextlib.nullcontext():
        row = mg.backward_row(d, spec["causal"], spec["deterministic"], 32 if smoke else CHECK_N,
                              None if smoke else SHAPE, heads=1 if smoke else 2, kind=spec["dtype"])
    row.pop("sdpa_ms", None)
    return {k: v for k, v in row.items() if k not in ("order", "kind", "d", "causal", "deterministic")}


# the CUDA-core backward jobs: profile's name -> compare's backward variant (its order and deterministic flag)
SIMT_BACKWARD = {"bwd-kv": "kv", "bwd-q": "q", "bwd-kv-det": "kv-deterministic"}


def job_simt(spec: dict, smoke: bool) -> dict:
    """The CUDA-core kernels (float32): checked by compare.run / run_backward at the check shape, with the tiles
    the timed launch takes, then timed on their own at the timing shape."""
    import math

    import numpy as np
    from numba import cuda

    from fa_numba import compare as cmp
    from fa_numba.kernels import VARIANTS, poisoned_outputs
    from fa_numba.kernels import backward as simt_backward

    if spec.get("micro"):  # the A / B of v2's micro-tile: this process builds v2 at the given (TM, TN) only
        import dataclasses
        import functools

        from fa_numba.kernels import engine_v2

        VARIANTS["v2"] = dataclasses.replace(VARIANTS["v2"], make=functools.partial(engine_v2.make_v2_engine,
                                                                                      micro=tuple(spec["micro"])))
    variant, d, causal = spec["variant"], 16 if smoke else spec["d"], spec["causal"]
    b, h, n = (1, 1, 16) if smoke else SHAPE
    n_check = 32 if smoke else CHECK_N
    big = cmp.Shape(batch=b, heads=h, n_q=n, head_dim=d, causal=causal).resolved()
    small = cmp.Shape(batch=1, heads=1 if smoke else 2, n_q=n_check, head_dim=d, causal=causal,
                      block_q=big.block_q, block_k=big.block_k, tiles="chosen")
    tiny = replace(small, heads=1, n_q=32)  # compiles (outside the lock), then the check with the GPU alone
    lock = gpu_lock() if not smoke else contextlib.nullcontext()
    if variant in SIMT_BACKWARD:
        block = cmp.backward_block(big)[0]
        small = cmp.Shape(batch=1, heads=1 if smoke else 2, n_q=n_check, head_dim=d, causal=causal, block_q=block,
                          block_k=block, tiles="chosen")
        order, deterministic, _ = cmp.BACKWARD_VARIANTS[SIMT_BACKWARD[variant]]
        cmp.run_backward(replace(small, heads=1, n_q=32), [SIMT_BACKWARD[variant]], repeats=0, count=False)
        with lock:
            result = cmp.run_backward(small, [SIMT_BACKWARD[variant]], repeats=0, count=False)
        r = result["rows"][0]
        row = {"block_q": block, "block_k": block, "passed": bool(r.get("passed")),
               "err": [r.get("err_dq"), r.get("err_dk"), r.get("err_dv")],
               "atol": [r.get("atol_dq"), r.get("atol_dk"), r.get("atol_dv")]}
    else:
        cmp.run(tiny, [variant], repeats=0, count=False)
        with lock:
            result = cmp.run(small, [variant], repeats=0, count=False)
        r = result["rows"][0]
        row = {"block_q": big.block_q, "block_k": big.block_k, "passed": bool(r.get("passed")),
               "err_out": r.get("err_out"), "atol_out": r.get("atol_out")}
    if not row["passed"]:
        return {**row, "error": (r.get("failure") or "")[:400]}
    if smoke:
        return row
    rng = np.random.default_rng(1)
    q, k, v, dout = (cuda.to_device(rng.standard_normal((b, h, n, d), dtype=np.float32)) for _ in range(4))
    scale = 1 / math.sqrt(d)
    if variant in SIMT_BACKWARD:
        o = cuda.to_device(rng.standard_normal((b, h, n, d), dtype=np.float32))
        lse = cuda.to_device(np.full((b, h, n), 4.0, np.float32))
        grads = [cuda.device_array((b, h, n, d), np.float32) for _ in range(3)] + [cuda.device_array((b, h, n),
                                                                                                     np.float32)]

        def call():
            simt_backward.run(q, k, v, o, lse, dout, *grads, scale, causal=causal, order=order,
                              deterministic=deterministic, block=row["block_q"])
    else:
        kernel = VARIANTS[variant].build(big.block_q, big.block_k, d, causal)
        out, lse, workspace = poisoned_outputs((b, h, n, d))

        def call():
            kernel(q, k, v, out, lse, scale, workspace, mask=None)
    with gpu_lock():
        row["ms"] = time_ms(call)
    return row


def job_sdpa(spec: dict, smoke: bool) -> dict:
    """torch SDPA on random inputs of the timing shape: the first backend that runs (flash, efficient, cuDNN,
    math), forward alone or backward alone (the forward outside the timed region)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n = SHAPE
    dtype, d, causal, backward = getattr(torch, spec["dtype"]), spec["d"], spec["causal"], spec["backward"]
    mg = _mma_gpu(smoke)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=backward) for _ in range(3))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                if backward:
                    def forward():
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        return out, torch.randn_like(out)
                    ms = mg._torch_median(torch, lambda s: torch.autograd.grad(s[0], (q, k, v), s[1]), forward)
                else:
                    with gpu_lock():
                        ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), torch=torch)
            return {"passed": True, "ms": ms, "backend": backend.name, "torch": torch.__version__,
                    "allow_tf32": torch.backends.cuda.matmul.allow_tf32}
        except RuntimeError as err:
            last = str(err)[:200]
    return {"passed": False, "error": f"no SDPA backend ran: {last}"}


def job_wide(spec: dict, smoke: bool) -> dict:
    mg = _mma_gpu(smoke)
    d, d_v = (16, 8 if not spec["strided"] else 16) if smoke else (spec["d"], spec["d_v"])
    row = mg.wide_row(d, d_v, spec["causal"], 32 if smoke else CHECK_N, None if smoke else SHAPE,
                      heads=1 if smoke else 2, strided=spec["strided"])
    return {k: v for k, v in row.items() if k not in ("order", "kind", "d", "causal")}


def job_decode(spec: dict, smoke: bool) -> dict:
    from fa_numba import compare_decode

    shape = (compare_decode.Shape(1, 4, 2, 1, 48, 8, "float16", block_k=16) if smoke else
             compare_decode.Shape(spec["batch"], 32, 8, 1, spec["n_k"], 128, "float16"))
    result = compare_decode.run(shape, repeats=0 if smoke else 20, count=False)
    rows = [{"variant": r.get("variant"), "passed": r.get("passed"), "ms": (r.get("time") or {}).get("median_ms"),
             "gbps": r.get("gbps")} for r in result["rows"]]
    return {"passed": compare_decode.all_passed(result), "rows": rows, "table": compare_decode.render(result)}


JOBS = {"mma-fwd": job_mma_fwd, "mma-bwd": job_mma_bwd, "simt": job_simt, "sdpa": job_sdpa, "wide": job_wide,
        "decode": job_decode}


A_B_FLAGS = ("uncapped", "one_stage", "micro", "one_row_block")  # a job timing a kernel as it was before a change, beside it


def plan(smoke: bool) -> list[dict]:
    """Every job, slowest compile first (the float32 tensor-core kernels), SDPA and decoding last."""
    jobs = []
    for dtype in ("float32", "float16"):  # 3xTF32's backward compiles slowest
        for d in (64, 128):
            for causal in (False, True):
                for det in (False, True):
                    jobs.append({"job": "mma-bwd", "dtype": dtype, "d": d, "causal": causal, "deterministic": det})
    for order, kind in (("v2", "float32"), ("v1", "float32"), ("v2", "tf32"), ("v2", "float16"), ("v2", "bfloat16"),
                        ("v1", "float16")):
        for d in (64, 128):
            for causal in (False, True):
                jobs.append({"job": "mma-fwd", "order": order, "dtype": kind, "d": d, "causal": causal})
    # the 16-bit backward at a head dim whose default tiles were refused before 2026-12-04 (2 warps, 16 x 32 now)
    jobs.append({"job": "mma-bwd", "dtype": "float16", "d": 72, "causal": True, "deterministic": False})
    # the causal build's register cap (MmaV2Kernel.REGISTER_CAPS), timed against the same kernel without it
    jobs.append({"job": "mma-fwd", "order": "v2", "dtype": "float16", "d": 64, "causal": True, "uncapped": True})
    # FlashAttention-2's copy order (V_j beside S, K_j+1 beside the softmax and P V), timed against one stage
    for d, causal in ((64, False), (128, False), (64, True)):
        jobs.append({"job": "mma-fwd", "order": "v2", "dtype": "float16", "d": d, "causal": causal, "one_stage": True})
    # v2's 128-row tiles of two row blocks a warp (16-bit, d <= 64), timed against 64 rows of one row block a warp
    for kind in ("float16", "bfloat16"):
        for causal in (False, True):
            jobs.append({"job": "mma-fwd", "order": "v2", "dtype": kind, "d": 64, "causal": causal,
                         "one_row_block": True})
    # the other backward orders (their layout, loads and adds since 2026-12-05), first: --smoke runs these two
    for variant in ("bwd-q", "bwd-kv-det"):
        jobs.append({"job": "simt", "variant": variant, "dtype": "float32", "d": 64, "causal": False})
    for variant in ("bwd-kv", "v2", "v1"):
        for d in (64, 128):
            for causal in (False, True):
                jobs.append({"job": "simt", "variant": variant, "dtype": "float32", "d": d, "causal": causal})
    # v2's micro-tiles before 2026-12-04 (256 threads of 4 x 2 and 4 x 1), timed against layout.V2_MICRO's 128
    for d, micro in ((64, (4, 2)), (128, (4, 1))):
        jobs.append({"job": "simt", "variant": "v2", "dtype": "float32", "d": d, "causal": False, "micro": micro})
    for dtype in ("float16", "bfloat16", "float32"):
        for d in (64, 128):
            for causal in (False, True):
                for backward in (False, True):
                    if not (backward and dtype == "bfloat16"):
                        jobs.append({"job": "sdpa", "dtype": dtype, "d": d, "causal": causal, "backward": backward})
    for d, d_v, strided in ((192, 128, False), (192, 192, False), (128, 128, True)):
        for causal in (False, True):
            jobs.append({"job": "wide", "dtype": "float16", "d": d, "d_v": d_v, "strided": strided, "causal": causal})
    for batch, n_k in ((1, 32768), (8, 32768), (1, 131072), (8, 131072)):
        jobs.append({"job": "decode", "dtype": "float16", "batch": batch, "n_k": n_k, "exclusive": True})
    if smoke:  # one of each kind and of each A / B, small (the script end to end: the kernels have their own tests)
        seen, kept = set(), []
        for j in jobs:
            kind = (j["job"], *(flag for flag in A_B_FLAGS if j.get(flag)))
            if j["job"] != "sdpa" and kind not in seen and j.get("d", 64) <= 128:
                seen.add(kind)
                kept.append(j)
        jobs = kept
    for i, j in enumerate(jobs):
        j["id"] = i
    return jobs


def name_of(j: dict) -> str:
    what = {"mma-fwd": lambda: f"{j['order']}-mma" + (" uncapped" if j.get("uncapped") else "")
            + (" one-stage" if j.get("one_stage") else "") + (" 64-row" if j.get("one_row_block") else ""),
            "mma-bwd": lambda: "bwd-kv-mma" + ("-det" if j["deterministic"] else ""),
            "simt": lambda: j["variant"] + (" {}x{}".format(*j["micro"]) if j.get("micro") else ""),
            "sdpa": lambda: "sdpa-bwd" if j["backward"] else "sdpa",
            "wide": lambda: "v2-mma-strided" if j["strided"] else f"v2-mma d_v={j['d_v']}",
            "decode": lambda: f"decode B={j['batch']} N_k={j['n_k']}"}[j["job"]]()
    return what

