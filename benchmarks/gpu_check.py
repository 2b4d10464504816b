"""One script for a lent GPU: test tier, correctness at size, timings, race check.

    python benchmarks/gpu_check.py [--out DIR] [--smoke]

1. runs the GPU test tier (the kernel, engine, backward, API and array-library tests, `gpu`-marked larger
   shapes and the stream-order tests included, and the PyTorch operator, torch.compile and drop-in tests
   where torch is installed);
2. checks every registered kernel, forward and backward, against the float64 reference (derived tolerance
   rules) at B=2, H=8, N in {1024, 4096}, d in {64, 128}, causal and not, float32 inputs, and the forward
   variants again on float16 inputs at N = 4096, where the tensor-core v1-mma and v2-mma run beside the
   CUDA-core ones (on float32 compare leaves them out, with a note);
3. times each variant that passed (CUDA events, 3 warm-up calls, median of 20) and prints ms, TFLOP/s
   (4 B H N_q N_k d, halved for causal) and the v2/v1 speed-up; a variant that failed is not timed;
4. runs `compute-sanitizer --tool racecheck` on one small launch of each kernel.

Writes gpu_check.md and gpu_check.json to --out (default: $OUT if set, else benchmarks/results).
--smoke uses tiny shapes and skips steps 1 and 4, so the script itself can be tried in the simulator.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


from fa_numba import compare as cmp

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


def run_tests() -> dict:
    start = time.perf_counter()
    # -m "": the slow marker's shipped layouts too (slow in the simulator, seconds on a GPU); the masked and
    # non-finite backward tests cover the guarded products of PARTIAL tiles (proofs/L7.8)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "", "tests/test_kernels.py",
                           "tests/test_engine.py", "tests/test_backward_kernels.py", "tests/test_backward_nonfinite.py",
                           "tests/test_mask_kernels.py", "tests/test_robustness.py", "tests/test_api.py",
                           "tests/test_arrays.py", "tests/test_torch_citizen.py", "tests/test_dropins.py"],
                          cwd=ROOT, capture_output=True, text=True)
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    log(f"[tests] {summary} ({time.perf_counter() - start:.0f} s)")
    if done.returncode:
        log(done.stdout[-6000:] + done.stderr[-2000:])
    return {"returncode": done.returncode, "summary": summary}


def check_and_time(batch, heads, n, d, causal, repeats, backward=False, dtype="float32") -> list[dict]:
    """compare.run (or run_backward) on one shape: check every variant that takes it, time those that pass;
    one flat row per variant (backward variants prefixed "bwd-", their err_out / atol_out the dQ ones)."""
    shape = cmp.Shape(batch=batch, heads=heads, n_q=n, head_dim=d, causal=causal, seed=n + d + causal,
                      dtype=dtype)
    result = (cmp.run_backward if backward else cmp.run)(shape, repeats=repeats, count=False)
    log((cmp.render_backward if backward else cmp.render)(result))
    rows = []
    for r in result["rows"]:
        err, atol = ("err_dq", "atol_dq") if backward else ("err_out", "atol_out")
        row = dict(variant=("bwd-" if backward else "") + r["variant"], batch=batch, heads=heads, n=n, d=d,
                   causal=causal, dtype=dtype, block_q=result["shape"]["block_q"], block_k=result["shape"]["block_k"],
                   passed=r.get("passed"), err_out=r.get(err), err_lse=r.get("err_lse"), atol_out=r.get(atol),
                   atol_lse=r.get("atol_lse"), tflops=r.get("tflops"), notes=result["notes"])
        row.update(r.get("time", {}))
        if "speedup_v2_over_v1" in result:
            row["v2_speedup_over_v1"] = result["speedup_v2_over_v1"]
        if r.get("failure"):
            row["failure"] = r["failure"][:500]
        rows.append(row)
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
    lines += ["| variant | N | d | causal | dtype | tiles | check | err O | atol O | median ms | p10-p90 ms | TFLOP/s | "
              "v2/v1 |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        timed = r.get("median_ms") is not None
        lines.append(
            f"| {r['variant']} | {r['n']} | {r['d']} | {r['causal']} | {r.get('dtype', 'float32')} | "
            f"{r['block_q']}x{r['block_k']} | "
            f"{'pass' if r['passed'] else 'FAIL'} | {r['err_out']:.2e} | {r['atol_out']:.2e} | "
            + (f"{r['median_ms']:.3f} | {r['p10_ms']:.3f}-{r['p90_ms']:.3f} | {r['tflops']:.2f} | "
               if timed and r.get("tflops") is not None else f"{'not timed' if not timed else r['clock']} | | | ")
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
    info = cmp.machine()
    log(f"[machine] {info}")
    if info["backend"] != "gpu" and not args.smoke:
        parser.error("no GPU: run with --smoke to try the script in the simulator")
    tests = None if args.smoke else run_tests()
    shapes = [(1, 1, 16, 8, c, "float32") for c in (False, True)] if args.smoke else [
        (2, 8, n, d, c, "float32") for n in (1024, 4096) for d in (64, 128) for c in (False, True)]
    # float16: the tensor-core variants beside the CUDA-core ones (forward only: no tensor-core backward yet)
    shapes += [(1, 1, 16, 16, False, "float16")] if args.smoke else [
        (2, 8, 4096, d, c, "float16") for d in (64, 128) for c in (False, True)]
    rows, race = [], None

    def save():  # after every step: a run stopped by the device's time limit keeps what it measured
        with open(os.path.join(args.out, "gpu_check.json"), "w") as fh:
            json.dump({"machine": info, "tests": tests, "rows": rows, "racecheck": race}, fh, indent=1)
        text = markdown(info, tests, rows, race)
        with open(os.path.join(args.out, "gpu_check.md"), "w") as fh:
            fh.write(text)
        return text

    save()
    for batch, heads, n, d, causal, dtype in shapes:
        rows += check_and_time(batch, heads, n, d, causal, repeats=3 if args.smoke else 20, dtype=dtype)
        if n <= 1024 and dtype == "float32":  # the backward's float64 reference holds S, P, dP and dS: to N = 1024
            rows += check_and_time(batch, heads, n, d, causal, repeats=3 if args.smoke else 10, backward=True)
        save()
    race = None if args.smoke else racecheck()
    print(save())
    ok = all(r["passed"] for r in rows) and (tests is None or tests["returncode"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
