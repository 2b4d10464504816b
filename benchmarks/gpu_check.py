"""One script for a lent GPU: test tier, correctness at size, timings, race check.

    python benchmarks/gpu_check.py [--out DIR] [--smoke]

1. runs the GPU test tier (tests/test_kernels.py and tests/test_api.py, `gpu`-marked larger shapes included);
2. checks every registered kernel against the float64 reference (derived tolerance rule) at B=2, H=8,
   N in {1024, 4096}, d in {64, 128}, causal and not, float32 inputs;
3. times each variant that passed (CUDA events, 3 warm-up calls, median of 20) and prints ms, TFLOP/s
   (4 B H N_q N_k d, halved for causal) and the v2/v1 speed-up; a variant that failed is not timed;
4. runs `compute-sanitizer --tool racecheck` on one small launch of each kernel.

Writes gpu_check.md and gpu_check.json to --out (default: $OUT if set, else benchmarks/results).
--smoke uses tiny shapes and skips steps 1 and 4, so the script itself can be tried in the simulator.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import numpy as np

import fa_numba
from fa_numba import reference
from fa_numba.kernels import VARIANTS, default_tiles
from fa_numba.timing import attention_flops, time_call

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SANITIZER_SNIPPET = """
import numpy as np, fa_numba
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 2, 100, 64)).astype(np.float32)
for order in ("v1", "v2"):
    for causal in (False, True):
        fa_numba.attention(q, q, q, order=order, causal=causal)
print("sanitized launches done")
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict:
    from numba import cuda
    import numba

    info = {"date": datetime.date.today().isoformat(), "backend": fa_numba.backend.name(),
            "python": platform.python_version(), "numba": numba.__version__, "numpy": np.__version__}
    try:
        import numba_cuda

        info["numba_cuda"] = numba_cuda.__version__
    except (ImportError, AttributeError):
        pass
    if info["backend"] == "gpu":
        dev = cuda.get_current_device()
        info["device"] = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        info["compute_capability"] = ".".join(map(str, dev.compute_capability))
        info["driver"] = ".".join(map(str, cuda.cudadrv.driver.driver.get_version()))
    else:
        info["device"] = "CUDA simulator (no GPU)"
    return info


def run_tests() -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_kernels.py", "tests/test_api.py"],
                          cwd=ROOT, capture_output=True, text=True)
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    log(f"[tests] {summary} ({time.perf_counter() - start:.0f} s)")
    if done.returncode:
        log(done.stdout[-6000:] + done.stderr[-2000:])
    return {"returncode": done.returncode, "summary": summary}


def check_and_time(batch, heads, n, d, causal, repeats) -> list[dict]:
    from numba import cuda

    rng = np.random.default_rng(n + d + causal)
    q, k, v = (rng.standard_normal((batch, heads, n, d)).astype(np.float32) for _ in range(3))
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    block_q, block_k = default_tiles(d)
    t0 = time.perf_counter()
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal)
    naive_out, naive_lse = reference.attention_naive_f32(q, k, v, causal=causal)
    atol_out, atol_lse = reference.tolerance(ref_out, naive_out), reference.tolerance(ref_lse, naive_lse)
    log(f"[ref] B={batch} H={heads} N={n} d={d} causal={causal}: reference in {time.perf_counter() - t0:.1f} s")
    rows = []
    for name, variant in VARIANTS.items():
        kernel = variant.make(block_q, block_k, d, causal)
        out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
        lse = cuda.to_device(np.full(q.shape[:-1], np.nan, np.float32))
        workspace = (cuda.device_array(q.shape[:-1], np.float32), cuda.device_array(q.shape[:-1], np.float32))
        launch = lambda: kernel(dq, dk, dv, out, lse, 1 / np.sqrt(d), workspace)  # noqa: E731
        launch()
        cuda.synchronize()
        row = dict(variant=name, batch=batch, heads=heads, n=n, d=d, causal=causal, block_q=block_q,
                   block_k=block_k, atol_out=atol_out, atol_lse=atol_lse)
        host_out, host_lse = out.copy_to_host(), lse.copy_to_host()
        row["err_out"] = reference.max_error(host_out, ref_out)
        row["err_lse"] = reference.max_error(host_lse, ref_lse)
        try:
            reference.assert_close(host_out, ref_out, atol_out, name=f"{name} out")
            reference.assert_close(host_lse, ref_lse, atol_lse, name=f"{name} lse")
            row["passed"] = True
        except AssertionError as failure:
            row["passed"], row["failure"] = False, str(failure)[:500]
            log(f"[check] {name} FAILED, not timed: {row['failure']}")
            rows.append(row)
            continue
        timing = time_call(launch, warmup=3, repeats=repeats)
        row.update(timing.as_dict())
        row["tflops"] = attention_flops(batch, heads, n, n, d, causal) / (timing.median_ms * 1e-3) / 1e12
        log(f"[time] {name} N={n} d={d} causal={causal}: {timing.median_ms:.3f} ms "
            f"(p10 {timing.p10_ms:.3f}, p90 {timing.p90_ms:.3f}), {row['tflops']:.2f} TFLOP/s, "
            f"err O {row['err_out']:.2e} <= {atol_out:.2e}")
        rows.append(row)
    timed = {r["variant"]: r for r in rows if r.get("median_ms")}
    if "v1" in timed and "v2" in timed:
        for r in rows:
            r["v2_speedup_over_v1"] = timed["v1"]["median_ms"] / timed["v2"]["median_ms"]
    return rows


def racecheck() -> dict:
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(tool):
        log("[racecheck] compute-sanitizer not found")
        return {"available": False}
    done = subprocess.run([tool, "--tool", "racecheck", "--racecheck-report", "hazard", sys.executable, "-c",
                           SANITIZER_SNIPPET], cwd=ROOT, capture_output=True, text=True, timeout=400)
    summary = [line for line in (done.stdout + done.stderr).splitlines() if "SUMMARY" in line or "hazard" in line]
    log(f"[racecheck] rc={done.returncode}: " + " | ".join(summary[-3:]))
    return {"available": True, "returncode": done.returncode, "summary": summary[-5:],
            "tail": (done.stdout + done.stderr)[-1500:]}


def markdown(info, tests, rows, race) -> str:
    lines = [f"# gpu_check: {info['device']}, {info['date']}", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), ""]
    if tests:
        lines += [f"GPU test tier: `{tests['summary']}` (exit {tests['returncode']})", ""]
    lines += ["| variant | N | d | causal | tiles | check | err O | atol O | median ms | p10-p90 ms | TFLOP/s | v2/v1 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        timed = r.get("median_ms") is not None
        lines.append(
            f"| {r['variant']} | {r['n']} | {r['d']} | {r['causal']} | {r['block_q']}x{r['block_k']} | "
            f"{'pass' if r['passed'] else 'FAIL'} | {r['err_out']:.2e} | {r['atol_out']:.2e} | "
            + (f"{r['median_ms']:.3f} | {r['p10_ms']:.3f}-{r['p90_ms']:.3f} | {r['tflops']:.2f} | "
               if timed else "not timed | | | ")
            + (f"{r['v2_speedup_over_v1']:.1f}x |" if "v2_speedup_over_v1" in r else " |"))
    if race:
        lines += ["", f"racecheck: {race}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no tests, no sanitizer")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    info = machine()
    log(f"[machine] {info}")
    if info["backend"] != "gpu" and not args.smoke:
        parser.error("no GPU: run with --smoke to try the script in the simulator")
    tests = None if args.smoke else run_tests()
    shapes = [(1, 1, 16, 8, c) for c in (False, True)] if args.smoke else [
        (2, 8, n, d, c) for n in (1024, 4096) for d in (64, 128) for c in (False, True)]
    rows = []
    for batch, heads, n, d, causal in shapes:
        rows += check_and_time(batch, heads, n, d, causal, repeats=3 if args.smoke else 20)
    race = None if args.smoke else racecheck()
    with open(os.path.join(args.out, "gpu_check.json"), "w") as fh:
        json.dump({"machine": info, "tests": tests, "rows": rows, "racecheck": race}, fh, indent=1)
    text = markdown(info, tests, rows, race)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as fh:
        fh.write(text)
    print(text)
    ok = all(r["passed"] for r in rows) and (tests is None or tests["returncode"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
