"""The tensor-core kernels on a lent GPU, first in benchmarks/run_on_device.sh:

    python benchmarks/mma_gpu.py [--out DIR] [--smoke]

1. the warp-primitive and tensor-core tests with the simulator off (tests/test_warp.py, test_fragments.py,
   test_mma_forward.py, test_mma_tf32.py, test_mma_backward.py, test_mma_backward_tf32.py, the slow ones
   included): the hardware against the host-side reading of the PTX ISA;
2. v2-mma (float16, bfloat16, and float32 by 3xTF32) and v1-mma (float16) checked against the float64 reference
   with the derived rule (proofs/L6 parts 7 and 9) at B=1, H=2, N=1024, d in {64, 128}, causal and not;
3. each configuration that passed timed at B=4, H=16, N=4096 (CUDA events, 3 warm-up calls, median of 20)
   beside torch SDPA in the same dtype when torch has CUDA; TFLOP/s = 4 B H N^2 d, halved for causal;
4. the tensor-core backward (kernels/mma/backward.py, atomic dQ and deterministic, float16 and float32 by
   3xTF32) checked with the gradients' rule and its P and dS terms (3xTF32's split terms) at B=1, H=2,
   N=1024, then timed at B=4, H=16, N=4096 beside SDPA's backward in the same dtype (flash-attn's count: 2.5 x
   the forward's FLOPs);
5. v2-mma float16 at the widest head dims (d = 192 with d_v = 128, MLA's, native, and d_v = 192) and on a
   (B, N, H, d) tensor's strided (B, H, N, d) view at d = 128 (cp.async rows by the strides; checked bitwise
   against the contiguous call), each checked, then timed (TFLOP/s = 2 B H N^2 (d + d_v), halved for causal).

Writes mma_gpu.json and prints one line per configuration. --smoke: tiny shapes, no tests, no timing (runs
in the simulator, so the script itself is tested).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

import fa_numba  # noqa: F401  (first: it chooses the backend before numba.cuda is imported)
from fa_numba import engines, tolerance, tolerance_backward
from fa_numba.kernels.mma.engine_v1 import make_v1_mma
from fa_numba.kernels.mma.engine_v2 import make_v2_mma

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_WORKERS = min(8, os.cpu_count() or 1)  # pytest-xdist processes: compiling is most of a GPU test run
CONFIGS = [(64, 64), (128, 32)]  # (d, block_k) with 4 warps: block_q 64, under 48 KB of shared memory
MAKE = {"v2": make_v2_mma, "v1": make_v1_mma}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bits_of(x: np.ndarray, kind: str) -> np.ndarray:
    """What the kernel of `kind` reads: 16-bit bits, or float32 itself (3xTF32 "float32", plain "tf32")."""
    if kind in ("float32", "tf32"):
        return x.astype(np.float32)
    if kind == "float16":
        return x.astype(np.float16).view(np.uint16)
    u = x.astype(np.float32).view(np.uint32)  # bfloat16: round to nearest even
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def values_of(bits: np.ndarray, kind: str) -> np.ndarray:
    if kind in ("float32", "tf32"):
        return bits.astype(np.float64)
    if kind == "float16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def launch(kernel, bits, d):
    from numba import cuda

    q, k, v = (cuda.to_device(b) for b in bits)
    o = cuda.device_array(bits[0].shape, np.float32)
    lse = cuda.device_array(bits[0].shape[:-1], np.float32)
    return (lambda: kernel(q, k, v, o, lse, 1 / np.sqrt(d))), o, lse


def check(order, kind, d, block_k, causal, n, heads=2, warps=4) -> dict:
    rng = np.random.default_rng(0)
    bits = [bits_of(rng.standard_normal((1, heads, n, d)), kind) for _ in range(3)]
    kernel = MAKE[order](kind, warps, block_k, d, causal)
    run, o, lse = launch(kernel, bits, d)
    run()
    q, k, v = (values_of(b, kind) for b in bits)
    try:
        c = tolerance.check_attention(o.copy_to_host(), lse.copy_to_host(), q, k, v, causal=causal, order=order,
                                      block_q=kernel.config.block_q, block_k=block_k, contractions=("matmul",),
                                      p_dtype=kind if kind in ("float16", "bfloat16") else None,
                                      products={"float32": "3xtf32", "tf32": "tf32"}.get(kind))
        return {"passed": True, "err_out": c.err_out, "atol_out": c.atol_out}
    except AssertionError as err:
        return {"passed": False, "error": str(err)[:400]}


def time_it(fn, repeats=20) -> float:
    from numba import cuda

    for _ in range(3):
        fn()
    cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cuda.event(), cuda.event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop))
    return float(np.median(times))


def _cuda_torch():
    """torch, if it is installed with CUDA; else None (the SDPA columns stay empty)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_median(torch, timed, prepare=lambda: None, repeats=20, warm=3) -> float:
    """Median of `repeats` CUDA-event timings of timed(prepare()) after `warm` untimed calls; prepare runs
    outside the timed region (the forward before a backward)."""
    times = []
    for i in range(warm + repeats):
        state = prepare()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        timed(state)
        stop.record()
        stop.synchronize()
        if i >= warm:
            times.append(start.elapsed_time(stop))
    return float(np.median(times))


def sdpa_ms(kind, b, h, n, d, causal):
    torch = _cuda_torch()
    if torch is None:
        return None
    dtype = getattr(torch, "float32" if kind == "tf32" else kind)  # SDPA's float32 beside either float32 kernel
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return _torch_median(torch, lambda _: sdpa(q, k, v, is_causal=causal))


def sdpa_backward_ms(kind, b, h, n, d, causal):
    """torch SDPA's backward alone (the forward outside the timed region)."""
    torch = _cuda_torch()
    if torch is None:
        return None
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=getattr(torch, kind), requires_grad=True)
               for _ in range(3))

    def forward():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out, torch.randn_like(out)

    return _torch_median(torch, lambda state: torch.autograd.grad(state[0], (q, k, v), state[1]), forward)


def backward_row(d, causal, deterministic, n, shape, heads=2, kind="float16") -> dict:
    """The tensor-core backward checked on (1, heads, n, d) with the gradients' rule and its 16-bit terms (float32:
    3xTF32's split terms), then (shape (B, H, N) given, the check passed) timed, beside torch SDPA's backward in
    the same dtype."""
    from numba import cuda

    from fa_numba import reference
    from fa_numba.kernels.mma import backward as mma_backward

    row = {"order": "bwd-kv-mma", "kind": kind, "d": d, "causal": causal, "deterministic": deterministic}
    rng = np.random.default_rng(2)
    dtype = np.float32 if kind == "float32" else np.float16  # bfloat16 is not timed here
    values = [rng.standard_normal((1, heads, n, d)).astype(dtype) for _ in range(4)]
    exact = [x.astype(np.float64) for x in values]
    out, lse = reference.attention(*exact[:3], causal=causal)
    grads = fa_numba.attention_backward(*values[:3], out.astype(np.float32), lse.astype(np.float32), values[3],
                                        causal=causal, engine="mma", deterministic=deterministic)
    try:
        terms = {"products": "3xtf32"} if kind == "float32" else {"p_dtype": kind}
        c = tolerance_backward.check_attention_backward(*grads, *exact, causal=causal, contractions=("matmul",),
                                                        **terms)
        row.update(passed=True, err=[c.err_dq, c.err_dk, c.err_dv], atol=[c.atol_dq, c.atol_dk, c.atol_dv])
    except AssertionError as err:
        return {**row, "passed": False, "error": str(err)[:400]}
    if shape is None:
        return row
    b, h, n = shape
    q, k, v, do = (cuda.to_device(rng.standard_normal((b, h, n, d)).astype(dtype)) for _ in range(4))
    o = cuda.to_device(rng.standard_normal((b, h, n, d)).astype(np.float32))
    lse_d = cuda.to_device(np.full((b, h, n), 4.0, np.float32))
    dq, dk, dv = (cuda.device_array((b, h, n, d), np.float32) for _ in range(3))
    dvec = cuda.device_array((b, h, n), np.float32)
    ms = time_it(lambda: mma_backward.run(q, k, v, o, lse_d, do, dq, dk, dv, dvec, 1 / np.sqrt(d), kind=kind,
                                          causal=causal, deterministic=deterministic))
    flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
    row.update(ms=ms, tflops=flops / ms / 1e9, sdpa_ms=sdpa_backward_ms(kind, b, h, n, d, causal))
    return row


def wide_row(d, d_v, causal, n, shape, heads=2, strided=False) -> dict:
    """v2-mma float16 at (d, d_v) (64 x 16 tiles above d = 128, else the shipped ones), or (strided) on views:
    checked against the reference with the rule, then timed at `shape` (None: not timed)."""
    from numba import cuda

    block_k = engines.mma_tiles(max(d, d_v), None, None)[1]
    kernel = make_v2_mma("float16", 4, block_k, d, causal, value_dim=d_v)

    def operands(b, h, size):
        rng = np.random.default_rng(2)
        bits = [bits_of(rng.standard_normal((b, h, size, width)), "float16") for width in (d, d, d_v)]
        if not strided:
            return bits, [cuda.to_device(x) for x in bits]
        views = [cuda.to_device(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose((0, 2, 1, 3)) for x in bits]
        return bits, views

    def run_on(arrays, b, h, size):
        o = cuda.device_array((b, h, size, d_v), np.float32)
        lse = cuda.device_array((b, h, size), np.float32)
        return (lambda: kernel(*arrays, o, lse, 1 / np.sqrt(d))), o, lse

    row = {"order": "v2-wide" if not strided else "v2-strided", "kind": "float16", "d": d, "d_v": d_v,
           "block_k": block_k, "causal": causal}
    bits, arrays = operands(1, heads, n)
    run, o, lse = run_on(arrays, 1, heads, n)
    run()
    q, k, v = (values_of(b, "float16") for b in bits)
    try:
        c = tolerance.check_attention(o.copy_to_host(), lse.copy_to_host(), q, k, v, causal=causal, block_q=64,
                                      block_k=block_k, contractions=("matmul",), p_dtype="float16")
        row.update(passed=True, err_out=c.err_out, atol_out=c.atol_out)
        if strided:  # the same bits as the kernel on contiguous copies
            contiguous, o2, lse2 = run_on([cuda.to_device(b) for b in bits], 1, heads, n)
            contiguous()
            row["passed"] = bool(np.array_equal(o.copy_to_host(), o2.copy_to_host()))
    except AssertionError as err:
        row.update(passed=False, error=str(err)[:400])
    if row["passed"] and shape is not None:
        b, h, size = shape
        run, _, _ = run_on(operands(b, h, size)[1], b, h, size)
        ms = time_it(run)
        row.update(ms=ms, tflops=2 * b * h * size * size * (d + d_v) / (2 if causal else 1) / ms / 1e9)
    return row


def model_estimates() -> dict:
    """{(order, kind, d, causal): (TFLOP/s, limiter)} of the newest committed whole-kernel estimate of the
    tensor-core kernels (benchmarks/results/estimate_mma_sm90_*.json, B=4 H=16 N=4096; a model, not a timing),
    printed beside each timing so the first GPU run calibrates the model's tensor-core term."""
    import glob

    found = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "estimate_mma_sm90_*.json")))
    if not found:
        return {}
    with open(found[-1]) as fh:
        rows = json.load(fh)["rows"]
    return {(r["variant"][:2], r.get("dtype", "float16"), r["d"], r["causal"]): (r["estimate_tflops"], r["limiter"])
            for r in rows if r.get("estimate_tflops")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "benchmarks", "results")),
                    help="folder for mma_gpu.json (default: $OUT, else benchmarks/results)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no tests, no timing (default: off)")
    args = ap.parse_args(argv)
    results = {"date": time.strftime("%Y-%m-%d"), "backend": fa_numba.backend.name(), "rows": []}
    if not args.smoke:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", str(TEST_WORKERS), "-m", "", "-p",
                               "no:cacheprovider", "tests/test_warp.py", "tests/test_fragments.py", "tests/test_mma_forward.py",
                               "tests/test_mma_tf32.py", "tests/test_mma_backward.py",
                               "tests/test_mma_backward_tf32.py"],
                              cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"})
        results["tests"] = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        log(f"[tests] {results['tests']}")
        if done.returncode:
            log(done.stdout[-6000:] + done.stderr[-2000:])
    n_check, shape = (32, None) if args.smoke else (1024, (4, 16, 4096))
    models = model_estimates()
    for order, kind in (("v2", "float16"), ("v2", "bfloat16"), ("v1", "float16"), ("v2", "float32"), ("v1", "float32"),
                        ("v2", "tf32")):
        for d, block_k in ([(16, 16)] if args.smoke else CONFIGS):
            warps = 4
            if kind in ("float32", "tf32") and not args.smoke:  # the float32 kinds' own default tiles (engines)
                warps, own_k, _ = engines.mma_tiles(d, None, None, kind, order)
                block_k = min(block_k, own_k)
            for causal in (False, True):
                row = {"order": order, "kind": kind, "d": d, "block_k": block_k, "causal": causal,
                       **check(order, kind, d, block_k, causal, n_check, heads=1 if args.smoke else 2, warps=warps)}
                if row["passed"] and shape is not None:
                    b, h, n = shape
                    rng = np.random.default_rng(1)
                    bits = [bits_of(rng.standard_normal((b, h, n, d)), kind) for _ in range(3)]
                    run, _, _ = launch(MAKE[order](kind, warps, block_k, d, causal), bits, d)
                    ms = time_it(run)
                    flops = 4 * b * h * n * n * d / (2 if causal else 1)
                    row.update(ms=ms, tflops=flops / ms / 1e9, sdpa_ms=sdpa_ms(kind, b, h, n, d, causal))
                    model = models.get((order, kind, d, causal)) if shape == (4, 16, 4096) else None
                    if model:  # the estimate, beside the measurement: not a speed
                        row.update(model_tflops=model[0], model_limiter=model[1])
                log(json.dumps(row))
                results["rows"].append(row)
    for kind in ("float16", "float32"):  # float32: 3xTF32
        for d, causal, deterministic in ((d, c, m) for d in ((16,) if args.smoke else (64, 128))
                                         for c in (False, True) for m in (False, True)):
            row = backward_row(d, causal, deterministic, n_check, None if args.smoke else shape,
                               heads=1 if args.smoke else 2, kind=kind)
            log(json.dumps(row))
            results["rows"].append(row)
    for d, d_v, strided in (((16, 8, False), (16, 16, True)) if args.smoke else
                            ((192, 128, False), (192, 192, False), (128, 128, True))):
        for causal in (False, True):
            row = wide_row(d, d_v, causal, n_check, None if args.smoke else shape, heads=1 if args.smoke else 2,
                           strided=strided)
            log(json.dumps(row))
            results["rows"].append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mma_gpu.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    return 0 if all(r["passed"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
