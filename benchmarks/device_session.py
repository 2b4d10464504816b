"""The device session as one parallel run: every kernel checked, then timed, beside torch SDPA and the model.

    python benchmarks/device_session.py [--out DIR] [--workers 12] [--budget-s 360] [--only PREFIX,...]
                                        [--tests / --no-tests] [--list] [--smoke]

A lent GPU comes with about 15 minutes of device time, and compiling the kernels (5 to 90 s each on one CPU
core) is most of a serial session. So every job runs in a process of its own, up to --workers at once: the
compile and the check (against the float64 reference with the derived rule, at B=1, H=2, N=1024) run in
parallel, and only the timing (at B=4, H=16, N=4096: 3 warm-up calls, then CUDA events around each of 20 calls,
all enqueued before one synchronize so that a CPU busy compiling does not delay the launches; the median) holds
a file lock on the GPU, so no two timings overlap. A check's small launch (about 50 us) may land inside another job's
timed window; the median of 20 is what guards against that. Jobs marked exclusive (decoding, whose kernels
take microseconds) run alone after the others. A job that crashes takes only its own process down.

Jobs, in the order they start (the slowest compiles first):
- mma-fwd: v2-mma and v1-mma on float16, bfloat16, float32 (3xTF32) and plain TF32, d in {64, 128}, causal
  and not, at the tiles `engines.mma_tiles` gives (what `fa_numba.attention` launches);
- mma-bwd: the tensor-core backward, atomic dQ and deterministic, float16 and float32 (3xTF32);
- simt: the CUDA-core v2, v1 (float32) and bwd-kv, d in {64, 128}, causal and not;
- sdpa: torch SDPA forward (float16, bfloat16, float32) and backward (float16, float32), backend named;
- wide: v2-mma float16 at d = 192 (d_v = 128 and 192) and on strided views;
- decode (exclusive): split-KV decoding, benchmarks/decode_gpu.py's shapes.
With --tests, the warp-primitive and tensor-core tests run first with the simulator off, beside the jobs
(pytest -n 3, the default tier of those files): the hardware against the host-side reading of the PTX ISA.

Each finished job appends one JSON line to session.jsonl under --out and rewrites session.md (the table:
check, ms, TFLOP/s, SDPA ms and backend, the whole-kernel model's estimate from the newest committed
benchmarks/results/estimate_sm90_*.json and measured / model time). What a killed run finished stays.
TFLOP/s: forward 4 B H N^2 d, backward 2.5 x that (flash-attn's count), halved for causal.
--smoke: the simulator, tiny shapes, no timing, two jobs of each kind (the script's own test).
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import replace
import fcntl
import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
LOCK = os.environ.get("FA_NUMBA_GPU_LOCK", "/tmp/fa_numba_gpu.lock")
SHAPE = (4, 16, 4096)  # B, H, N of the timings (the whole-kernel model's launch shape)
CHECK_N = 1024
SLOW_MS, SLOW_REPEATS = 30.0, 5  # a call over SLOW_MS is timed SLOW_REPEATS times after one warm-up


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the jobs (each runs in a process of its own: `--job SPEC`) -------------------------------------------------

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
    order, kind, d, causal = spec["order"], spec["dtype"], 16 if smoke else spec["d"], spec["causal"]
    warps, block_k = (1, 16) if smoke else engines.mma_tiles(d, None, None, kind, order)
    mg.check(order, kind, d, block_k, causal, 32, heads=1, warps=warps)  # compiles: outside the lock
    if smoke:
        return {"block_q": 16 * warps, "block_k": block_k, **mg.check(order, kind, d, block_k, causal, 32, heads=1,
                                                                       warps=warps)}
    import numpy as np

    b, h, n = SHAPE
    rng = np.random.default_rng(1)
    bits = [mg.bits_of(rng.standard_normal((b, h, n, d), dtype=np.float32), kind) for _ in range(3)]
    with gpu_lock():  # every launch of the check shape and the timing shape alone on the GPU
        row = {"block_q": 16 * warps, "block_k": block_k,
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


def job_simt(spec: dict, smoke: bool) -> dict:
    """The CUDA-core kernels (float32): checked by compare.run / run_backward at the check shape, with the tiles
    the timed launch takes, then timed on their own at the timing shape."""
    import math

    import numpy as np
    from numba import cuda

    from fa_numba import compare as cmp
    from fa_numba.kernels import VARIANTS, poisoned_outputs
    from fa_numba.kernels import backward as simt_backward

    variant, d, causal = spec["variant"], 16 if smoke else spec["d"], spec["causal"]
    b, h, n = (1, 1, 16) if smoke else SHAPE
    n_check = 32 if smoke else CHECK_N
    big = cmp.Shape(batch=b, heads=h, n_q=n, head_dim=d, causal=causal).resolved()
    small = cmp.Shape(batch=1, heads=1 if smoke else 2, n_q=n_check, head_dim=d, causal=causal,
                      block_q=big.block_q, block_k=big.block_k, tiles="chosen")
    tiny = replace(small, heads=1, n_q=32)  # compiles (outside the lock), then the check with the GPU alone
    lock = gpu_lock() if not smoke else contextlib.nullcontext()
    if variant == "bwd-kv":
        block = cmp.backward_block(big)[0]
        small = cmp.Shape(batch=1, heads=1 if smoke else 2, n_q=n_check, head_dim=d, causal=causal, block_q=block,
                          block_k=block, tiles="chosen")
        cmp.run_backward(replace(small, heads=1, n_q=32), ["kv"], repeats=0, count=False)
        with lock:
            result = cmp.run_backward(small, ["kv"], repeats=0, count=False)
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
    if variant == "bwd-kv":
        o = cuda.to_device(rng.standard_normal((b, h, n, d), dtype=np.float32))
        lse = cuda.to_device(np.full((b, h, n), 4.0, np.float32))
        grads = [cuda.device_array((b, h, n, d), np.float32) for _ in range(3)] + [cuda.device_array((b, h, n),
                                                                                                     np.float32)]

        def call():
            simt_backward.run(q, k, v, o, lse, dout, *grads, scale, causal=causal, order="kv", block=row["block_q"])
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
    for variant in ("bwd-kv", "v2", "v1"):
        for d in (64, 128):
            for causal in (False, True):
                jobs.append({"job": "simt", "variant": variant, "dtype": "float32", "d": d, "causal": causal})
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
    if smoke:  # two of each kind, small
        seen, kept = {}, []
        for j in jobs:
            if j["job"] != "sdpa" and seen.get(j["job"], 0) < 2 and j.get("d", 64) <= 128:
                seen[j["job"]] = seen.get(j["job"], 0) + 1
                kept.append(j)
        jobs = kept
    for i, j in enumerate(jobs):
        j["id"] = i
    return jobs


def name_of(j: dict) -> str:
    what = {"mma-fwd": lambda: f"{j['order']}-mma", "mma-bwd": lambda: "bwd-kv-mma" + ("-det" if j["deterministic"]
                                                                                       else ""),
            "simt": lambda: j["variant"], "sdpa": lambda: "sdpa-bwd" if j["backward"] else "sdpa",
            "wide": lambda: "v2-mma-strided" if j["strided"] else f"v2-mma d_v={j['d_v']}",
            "decode": lambda: f"decode B={j['batch']} N_k={j['n_k']}"}[j["job"]]()
    return what


# ---- the model, for the table ----------------------------------------------------------------------------------

def model_seconds() -> dict:
    """{(profile variant, dtype, d, causal): (seconds, TFLOP/s, limiter)} from the newest committed whole-kernel
    estimate of every configuration (a model of the H200, never a measurement)."""
    found = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "estimate_sm90_*.json")))
    if not found:
        return {}
    with open(found[-1]) as fh:
        profiles = json.load(fh)["profiles"]
    out = {}
    for p in profiles:
        c, est = p["config"], p.get("estimate") or {}
        if est.get("seconds") and (c["launch"]["batch"], c["launch"]["heads"], c["launch"]["n"]) == SHAPE:
            out[(c["variant"], c["dtype"], c["head_dim"], c["causal"])] = (est["seconds"], est.get("tflops"),
                                                                          est.get("limiter"))
    return out


def model_for(j: dict, models: dict):
    """(seconds, limiter) of the job's kernel in the model: the deterministic tensor-core backward is its two
    passes' sum; None where the model has no estimate."""
    key = lambda v: (v, j["dtype"], j.get("d"), j.get("causal"))  # noqa: E731
    if j["job"] == "mma-fwd":
        parts = [f"{j['order']}-mma"]
    elif j["job"] == "mma-bwd":
        parts = ["bwd-kv-mma-det", "bwd-dq-mma"] if j["deterministic"] else ["bwd-kv-mma"]
    elif j["job"] == "simt":
        parts = [j["variant"]]
    else:
        return None
    found = [models.get(key(p)) for p in parts]
    if not all(found):
        return None
    return sum(f[0] for f in found), "+".join(f[2] or "?" for f in found)


def flops(j: dict) -> float | None:
    b, h, n = SHAPE
    if j["job"] in ("mma-fwd", "simt", "sdpa", "mma-bwd"):
        f = 4.0 * b * h * n * n * j["d"] / (2 if j["causal"] else 1)
        backward = j["job"] == "mma-bwd" or j.get("backward") or j.get("variant") == "bwd-kv"
        return f * (2.5 if backward else 1)
    if j["job"] == "wide":
        return 2.0 * b * h * n * n * (j["d"] + j["d_v"]) / (2 if j["causal"] else 1)
    return None


def render(rows: list[dict], header: dict, tests: str | None) -> str:
    models = model_seconds()
    sdpa = {(r["dtype"], r["d"], r["causal"], r["backward"]): r for r in rows if r["job"] == "sdpa" and r.get("ms")}
    lines = [f"# device session: {header.get('device')}, {header.get('date')}", "",
             ", ".join(f"{k} {v}" for k, v in header.items()), "",
             f"Timing shape B, H, N = {SHAPE}; check shape B=1, H=2, N={CHECK_N}. TFLOP/s: forward 4 B H N^2 d, "
             "backward 2.5 x that, halved for causal. model: the whole-kernel estimate (committed "
             "estimate_sm90_*.json), a model, not a measurement; meas/model: measured ms over the model's.", ""]
    if tests:
        lines += [f"Primitive and tensor-core tests, simulator off: `{tests}`", ""]
    lines += ["| kernel | dtype | d | causal | tiles | check | err / atol | ms | TFLOP/s | SDPA ms (backend) | "
              "SDPA / ours | model TFLOP/s (limiter) | meas/model |", "|" + "---|" * 13]
    for r in sorted(rows, key=lambda r: r["id"]):
        if r["job"] in ("sdpa", "decode"):
            continue
        ms, f = r.get("ms"), flops(r)
        err = r.get("err_out", r.get("err"))
        atol = r.get("atol_out", r.get("atol"))
        ratio = lambda e, a: max(x / y for x, y in zip(e, a)) if isinstance(e, list) else e / a  # noqa: E731
        check = ("pass" if r.get("passed") else "FAIL" if r.get("passed") is False else "-") + (
            f" ({r['error'][:60]})" if r.get("error") else "")
        if r.get("suspect"):  # a timing taken while something else may have held the GPU: not calibration data
            check += " (time suspect)"
        ref = sdpa.get((r["dtype"] if r["dtype"] != "tf32" else "float32", r.get("d"), r.get("causal"),
                        r["job"] == "mma-bwd" or r.get("variant") == "bwd-kv"))
        model = model_for(r, models)
        lines.append(
            f"| {name_of(r)} | {r['dtype']} | {r.get('d')} | {r.get('causal')} | "
            f"{'-' if r.get('block_q') is None else str(r['block_q']) + 'x' + str(r['block_k'])}"
            f" | {check} | {'-' if err is None or atol is None else format(ratio(err, atol), '.2f')} | "
            f"{'-' if ms is None else format(ms, '.3f')} | {'-' if not (ms and f) else format(f / ms / 1e9, '.1f')} | "
            f"{'-' if not ref else format(ref['ms'], '.3f') + ' (' + ref['backend'] + ')'} | "
            f"{'-' if not (ref and ms) else format(ref['ms'] / ms, '.2f')} | "
            f"{'-' if not model else format(f / model[0] / 1e12, '.1f') + ' (' + model[1] + ')'} | "
            f"{'-' if not (model and ms) or r.get('suspect') else format(ms * 1e-3 / model[0], '.2f')} |")
    lines += ["", "| SDPA | dtype | d | causal | ms | TFLOP/s | backend |", "|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["job"] == "sdpa"), key=lambda r: r["id"]):
        ms, f = r.get("ms"), flops(r)
        lines.append(f"| {name_of(r)} | {r['dtype']} | {r['d']} | {r['causal']} | "
                     f"{'-' if ms is None else format(ms, '.3f')} | {'-' if not ms else format(f / ms / 1e9, '.1f')} | "
                     f"{r.get('backend', r.get('error', '-'))} |")
    for r in rows:
        if r["job"] == "decode":
            lines += ["", f"## {name_of(r)}: {'pass' if r.get('passed') else 'FAIL'}", "```",
                      r.get("table", r.get("error", "")), "```"]
    return "\n".join(lines) + "\n"


# ---- the scheduler -----------------------------------------------------------------------------------------------

def python_path() -> str:
    """The checkout first, then whatever PYTHONPATH already holds (packages carried to a device machine)."""
    return os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def header() -> dict:
    probe = ("import json, numba, numpy, fa_numba; from fa_numba import compare; m = compare.machine(); "
             "print(json.dumps(m))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": python_path()})
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"device": "unknown", "probe_error": (done.stderr or "")[-500:]}


def start_tests(out: str, smoke: bool):
    if smoke:
        return None
    files = ["tests/test_warp.py", "tests/test_fragments.py", "tests/test_mma_forward.py", "tests/test_mma_tf32.py",
             "tests/test_mma_backward.py", "tests/test_mma_backward_tf32.py"]
    log_file = open(os.path.join(out, "tests_gpu.log"), "w")
    return subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-n", "6", "--tb=short", "-rf", "-p",
                             "no:cacheprovider", *files],
                            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "PYTHONPATH": python_path()})


def stop(proc) -> None:
    """Kill a process and its group: pytest's xdist workers outlive their controller (on 2026-12-04 they kept
    launching kernels after it was killed, and the timings of the next 25 s read up to 8x slow)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"),
                    help="folder for session.jsonl, session.md, tests_gpu.log (default: $OUT, else "
                         "benchmarks/results)")
    ap.add_argument("--workers", type=int, default=12, help="jobs at once (default: 12)")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="no job starts after this many seconds; running ones are stopped 60 s later (default 360)")
    ap.add_argument("--only", default="", help="comma list of job kinds to run (default: all): " + ",".join(JOBS))
    ap.add_argument("--tests", action=argparse.BooleanOptionalAction, default=True,
                    help="run the primitive and tensor-core tests with the simulator off (default: on)")
    ap.add_argument("--tests-s", type=float, default=150.0,
                    help="stop the tests after this many seconds (they hold the GPU meanwhile; default 150)")
    ap.add_argument("--list", action="store_true", help="print the jobs and stop")
    ap.add_argument("--smoke", action="store_true", help="in the simulator: tiny shapes, no timing")
    ap.add_argument("--render", nargs="+", metavar="JSONL",
                    help="print the table of earlier runs' session.jsonl files (rows marked 'suspect' flagged) "
                         "beside the newest committed estimate, and stop")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        rows = [json.loads(line) for path in args.render for line in open(path) if line.strip()]
        print(render(rows, {"device": "NVIDIA H200", "runs": " ".join(os.path.basename(p) for p in args.render)},
                     None))
        return 0
    if args.job:  # a worker: run one job, print its row last
        import fa_numba  # noqa: F401 - first: it chooses the backend before numba.cuda is imported

        spec = json.loads(args.job)
        start = time.time()
        row = {**spec, **JOBS[spec["job"]](spec, args.smoke), "seconds": round(time.time() - start, 1)}
        print("RESULT " + json.dumps(row, default=float), flush=True)
        return 0
    jobs = plan(args.smoke)
    if args.only:
        unknown = set(args.only.split(",")) - set(JOBS)
        if unknown:
            ap.error(f"--only takes job kinds among {sorted(JOBS)}, got {sorted(unknown)}")
        jobs = [j for j in jobs if j["job"] in args.only.split(",")]
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    if args.list:
        for j in jobs:
            print(name_of(j), json.dumps(j))
        return 0
    os.makedirs(args.out, exist_ok=True)
    threads = {name: "2" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env = {**os.environ, **threads, "PYTHONPATH": python_path(), "FA_NUMBA_GPU_LOCK": LOCK, "PYTHONUNBUFFERED": "1"}
    start, rows, running = time.time(), [], {}
    info = header() if not args.smoke else {"device": "CUDA simulator (smoke)"}
    log(f"[session] {len(jobs)} jobs, {args.workers} at once, budget {args.budget_s:.0f} s; {info}")
    holder = open(LOCK, "a")  # the tests launch kernels too: they hold the GPU until they end (or --tests-s)
    if args.tests and not args.smoke:
        fcntl.flock(holder, fcntl.LOCK_EX)
    tests = start_tests(args.out, args.smoke) if args.tests else None
    tests_line = None
    pending = [j for j in jobs if not j.get("exclusive")] + [j for j in jobs if j.get("exclusive")]
    jsonl = open(os.path.join(args.out, "session.jsonl"), "a")

    def finish(j, proc, text):
        result = next((line[7:] for line in reversed(text.splitlines()) if line.startswith("RESULT ")), None)
        row = json.loads(result) if result else {**j, "passed": False, "error": f"exit {proc.returncode}: "
                                                 + text[-600:].replace("\n", " | ")}
        rows.append(row)
        jsonl.write(json.dumps(row, default=float) + "\n")
        jsonl.flush()
        log(f"[{time.time() - start:4.0f} s] {name_of(j)} {j.get('dtype')} d={j.get('d')} causal={j.get('causal')}: "
            f"{'pass' if row.get('passed') else 'FAIL'} ms={row.get('ms')} ({row.get('seconds', '-')} s)")
        with open(os.path.join(args.out, "session.md"), "w") as fh:
            fh.write(render(rows, info, tests_line))

    while pending or running:
        now = time.time() - start
        for pid, (j, proc, fh) in list(running.items()):
            if proc.poll() is not None or now > args.budget_s + 60:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                fh.seek(0)
                finish(j, proc, fh.read())
                fh.close()
                del running[pid]
        if tests is not None and tests.poll() is None and now > args.tests_s:
            stop(tests)
        if tests is not None and tests.poll() is not None and tests_line is None:
            fcntl.flock(holder, fcntl.LOCK_UN)
            with open(os.path.join(args.out, "tests_gpu.log")) as fh:
                tests_line = (fh.read().strip().splitlines() or ["(no output)"])[-1] + f" (exit {tests.returncode})"
            log(f"[{now:4.0f} s] tests: {tests_line}")
        while pending and now <= args.budget_s:
            exclusive = pending[0].get("exclusive")
            if len(running) >= args.workers or (exclusive and running):
                break
            j = pending.pop(0)
            fh = open(os.path.join("/tmp", f"fa_numba_job_{os.getpid()}_{j['id']}.log"), "w+")
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--job", json.dumps(j)]
                                    + (["--smoke"] if args.smoke else []), cwd=ROOT, stdout=fh,
                                    stderr=subprocess.STDOUT, env=env)
            running[proc.pid] = (j, proc, fh)
            if exclusive:
                break
        if pending and now > args.budget_s:
            for j in pending:
                rows.append({**j, "passed": None, "error": "not run: budget spent"})
            pending = []
        time.sleep(0.5)
    if tests is not None:
        try:
            tests.wait(timeout=max(1.0, args.budget_s + 60 - (time.time() - start)))
        except subprocess.TimeoutExpired:
            stop(tests)
        with open(os.path.join(args.out, "tests_gpu.log")) as fh:
            tests_line = (fh.read().strip().splitlines() or ["(no output)"])[-1] + f" (exit {tests.returncode})"
    text = render(rows, info, tests_line)
    with open(os.path.join(args.out, "session.md"), "w") as fh:
        fh.write(text)
    print(text)
    failed = [r for r in rows if r.get("passed") is False]
    return 1 if failed or (tests is not None and tests.returncode) else 0


if __name__ == "__main__":
    sys.exit(main())
