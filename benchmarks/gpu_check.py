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
TEST_WORKERS = min(8, os.cpu_count() or 1)  # pytest-xdist processes: compiling is most of a GPU test run
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
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", str(TEST_WORKERS), "-m", "",
                           "tests/test_kernels.py", "tests/test_engine.py", "tests/test_backward_kernels.py", "tests/test_backward_nonfinite.py",
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


def value_dim_checks(smoke: bool) -> list[dict]:
    """The paths that take a value head dim of their own natively (MLA's d = 192, d_v = 128; in smoke mode
    d = 16, d_v = 8), each checked against the float64 reference with its rule on this device: the tile engine's
    v1 and v2 forwards and the CUDA-core backward (float32), v2-mma (float16), the tensor-core backward and
    decoding on both split kernels (float16; there d = 128, d_v = 64: those kernels take d <= 128). Checked, not timed:
    one row per path, with the error and the tolerance."""
    import math

    import numpy as np

    import fa_numba
    from fa_numba import split_kv, tolerance, tolerance_backward

    d, d_v, n, n_k = (16, 8, 16, 40) if smoke else (192, 128, 512, 4096)
    rng = np.random.default_rng(192)
    q, k = (rng.standard_normal((1, 4, n, d)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 4, n, d_v)).astype(np.float32)
    dout = rng.standard_normal((1, 4, n, d_v)).astype(np.float32)
    from fa_numba.kernels import default_tiles

    block_q, block_k = (8, 8) if smoke else default_tiles(max(d, d_v))
    tiles = dict(block_q=block_q, block_k=block_k)  # what the rule of each order is built with, too
    rows = []

    def record(path, run, dims=(d, d_v)):
        try:
            err, atol = run()
            rows.append(dict(path=path, d=dims[0], d_v=dims[1], passed=True, err=err, atol=atol))
        except Exception as error:  # a failed check names what failed; the others still run
            rows.append(dict(path=path, d=dims[0], d_v=dims[1], passed=False, failure=str(error)[:500]))
        log(f"[d_v] {rows[-1]}")

    for order in ("v1", "v2"):
        def forward(order=order):
            out, lse = fa_numba.attention(q, k, v, causal=True, order=order, return_lse=True, **tiles)
            c = tolerance.check_attention(out, lse, q, k, v, causal=True, order=order, contractions=("matmul",),
                                          **tiles)
            return c.err_out, c.atol_out
        record(f"{order} forward (float32)", forward)

    def backward():
        out, lse = fa_numba.attention(q, k, v, causal=True, return_lse=True, **tiles)
        grads = fa_numba.attention_backward(q, k, v, out, lse, dout, causal=True, deterministic=True,
                                            block_q=8 if smoke else None)
        c = tolerance_backward.check_attention_backward(*grads, q, k, v, dout, causal=True, contractions=("matmul",))
        return c.err_dv, c.atol_dv
    record("CUDA-core backward, deterministic (float32)", backward)

    half = [x.astype(np.float16) for x in (q, k, v)]

    def mma_forward():
        out, lse = fa_numba.attention(*half, causal=True, engine="mma", return_lse=True)
        c = tolerance.check_attention(out, lse, *half, causal=True, p_dtype="float16", contractions=("matmul",))
        return c.err_out, c.atol_out
    record("v2-mma forward (float16)", mma_forward)

    dd, dd_v = (d, d_v) if smoke else (128, 64)  # the tensor-core backward and decoding take d <= 128

    def mma_backward():
        qb, kb = (rng.standard_normal((1, 4, n, dd)).astype(np.float16) for _ in range(2))
        vb, ob = (rng.standard_normal((1, 4, n, dd_v)).astype(np.float16) for _ in range(2))
        small = dict(block_q=16, block_k=16) if smoke else {}  # one warp a block in the simulator
        out, lse = fa_numba.attention(qb, kb, vb, causal=True, engine="mma", return_lse=True, **small)
        grads = fa_numba.attention_backward(qb, kb, vb, out, lse, ob, causal=True, engine="mma", **small)
        c = tolerance_backward.check_attention_backward(*grads, qb, kb, vb, ob, causal=True, p_dtype="float16",
                                                        contractions=("matmul",))
        return c.err_dv, c.atol_dv
    record("tensor-core backward, atomic dQ (float16)", mma_backward, (dd, dd_v))

    k_cache = rng.standard_normal((1, 2, n_k, dd)).astype(np.float16)
    v_cache = rng.standard_normal((1, 2, n_k, dd_v)).astype(np.float16)
    qd = rng.standard_normal((1, 8, 1, dd)).astype(np.float16)
    length = n_k - 3
    for engine in ("simt", "mma"):
        def decode(engine=engine):
            out, lse = fa_numba.attention_with_kvcache(qd, k_cache, v_cache, [length], engine=engine, block_k=16,
                                                       split_size=16 * max(1, length // 16 // 4), return_lse=True)
            splits = split_kv.Splits(-(-length // (16 * max(1, length // 16 // 4))), max(1, length // 16 // 4), 16)
            c = split_kv.check(out[0], lse[0], qd[0].astype(np.float32), k_cache[0, :, :length].astype(np.float32),
                               v_cache[0, :, :length].astype(np.float32), causal=True, scale=1 / math.sqrt(dd),
                               block_k=16, splits=splits, p_dtype="float16" if engine == "mma" else None,
                               contractions=("matmul",))
            return c.err_out, c.atol_out
        record(f"decode {engine} (float16)", decode, (dd, dd_v))
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


def markdown(info, tests, rows, race, value_dims=()) -> str:
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
    if value_dims:
        lines += ["", "| d_v path | d | d_v | check | err | atol |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['path']} | {r['d']} | {r['d_v']} | "
                  + (f"pass | {r['err']:.2e} | {r['atol']:.2e} |" if r["passed"] else f"FAIL: {r['failure']} | | |")
                  for r in value_dims]
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
    rows, race, value_dims = [], None, []

    def save():  # after every step: a run stopped by the device's time limit keeps what it measured
        with open(os.path.join(args.out, "gpu_check.json"), "w") as fh:
            json.dump({"machine": info, "tests": tests, "rows": rows, "racecheck": race, "value_dims": value_dims},
                      fh, indent=1)
        text = markdown(info, tests, rows, race, value_dims)
        with open(os.path.join(args.out, "gpu_check.md"), "w") as fh:
            fh.write(text)
        return text

    value_dims = value_dim_checks(args.smoke)  # checked before the timings: seconds on a GPU
    save()
    for batch, heads, n, d, causal, dtype in shapes:
        rows += check_and_time(batch, heads, n, d, causal, repeats=3 if args.smoke else 20, dtype=dtype)
        if n <= 1024 and dtype == "float32":  # the backward's float64 reference holds S, P, dP and dS: to N = 1024
            rows += check_and_time(batch, heads, n, d, causal, repeats=3 if args.smoke else 10, backward=True)
        save()
    race = None if args.smoke else racecheck()
    print(save())
    ok = all(r["passed"] for r in rows + value_dims) and (tests is None or tests["returncode"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
