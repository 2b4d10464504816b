"""The compare sweep for a lent GPU, with PyTorch SDPA as the outside reference point.

    python benchmarks/compare_gpu.py [--out DIR] [--budget-s 480] [--n 1024,2048,4096,8192] [--smoke]

For B=4, H=16, N in --n, d in {64, 128}, causal and not, float32 and float16: `fa_numba.compare.run` (check
every registered variant that takes the shape against the float64 reference, the tensor-core v1-mma and v2-mma
on float16 only, then time every variant that passed: CUDA events, 3 warm-up calls, median of
--repeats) and, when torch is importable, torch.nn.functional.scaled_dot_product_attention on the same
inputs (backend reported, same timing), with the ratio of each kernel to it. Sizes are run smallest first;
when --budget-s runs out the remaining ones are listed as not run. A variant whose single call takes over
--slow-s seconds is timed with --slow-repeats calls instead (said in the table). Beside each measurement at
the whole-kernel model's launch shape, the model's estimate and limiter from the newest committed
benchmarks/results/estimate_sm90_*.json, so the first GPU run calibrates the model.
Writes compare_gpu.md, compare_gpu.json and compare_gpu.png to --out (default $OUT, else benchmarks/results).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing it (as on a lent GPU machine)

import fa_numba  # noqa: E402
from fa_numba import compare as cmp  # noqa: E402
from fa_numba import plots  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def torch_median_ms(call, repeats: int) -> float:
    """Median ms of `call` (a torch CUDA call) over `repeats` timed calls, CUDA events, after 4 warm-up calls."""
    import torch

    call()
    torch.cuda.synchronize()
    start, stop, samples = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
    for _ in range(3):
        call()
    for _ in range(repeats):
        start.record()
        call()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop))
    return float(np.median(samples))


def sdpa(shape: cmp.Shape, repeats: int) -> dict:
    """Time torch SDPA on the inputs compare.run used (same seed). Returns backend, ms, or why not."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as err:
        return {"available": False, "why": f"torch not importable: {err}"}
    q, k, v = (torch.from_numpy(x).cuda() for x in cmp.inputs(shape))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)  # noqa: E731
                median = torch_median_ms(call, repeats)
            return {"available": True, "backend": backend.name, "median_ms": median,
                    "torch": torch.__version__}
        except RuntimeError:
            continue
    return {"available": False, "why": "no SDPA backend ran"}


def targets_summary(flat: list[dict], n: int, d: int, dtype: str) -> list[str]:
    """The fast-kernel issue's GPU targets at N, d, dtype: v2 TFLOP/s (>= 25 at N=4096, d=64, float32),
    causal / non-causal time (<= 0.6), and v2/v1 for both kernel families."""
    def ms(variant, causal):
        return next((r["median_ms"] for r in flat if (r["n"], r["head_dim"], r["dtype"], r["variant"], r["causal"])
                     == (n, d, dtype, variant, causal) and r["median_ms"]), None)

    def tflops(variant, causal):
        return next((r["tflops"] for r in flat if (r["n"], r["head_dim"], r["dtype"], r["variant"], r["causal"])
                     == (n, d, dtype, variant, causal) and r["tflops"]), None)

    lines = [f"Targets at N={n}, d={d}, {dtype}:"]
    for causal in (False, True):
        lines.append(f"- v2 {'causal' if causal else 'non-causal'}: {tflops('v2', causal)} TFLOP/s (target >= 25 non-causal)")
    if ms("v2", True) and ms("v2", False):
        lines.append(f"- v2 causal / non-causal time: {ms('v2', True) / ms('v2', False):.2f} (target <= 0.6)")
    for fam, (a, b) in (("tile engine", ("v1", "v2")), ("one thread per row", ("v1-rowwise", "v2-rowwise"))):
        for causal in (False, True):
            if ms(a, causal) and ms(b, causal):
                lines.append(f"- v2/v1 speed-up, {fam}, {'causal' if causal else 'non-causal'}: "
                             f"{ms(a, causal) / ms(b, causal):.2f}x")
    return lines


def model_estimates(batch: int, heads: int, upto: str | None = None) -> dict:
    """{(variant, d, causal, dtype, N): estimate TFLOP/s and limiter} from the committed profiles with the
    whole-kernel estimate (benchmarks/results/estimate_sm90_*.json), at its launch shape only: the model,
    printed beside the measurement so each GPU run calibrates it. Each configuration's newest estimate counts
    (the files in name order, a later one's configurations replacing an earlier one's), so a file that
    re-estimates a few kernels after a change leaves the others' estimates standing; a file named "before"
    (the code before a change, kept to compare with) is not the current code's and is skipped. upto: the
    name of the last file to read (the model of the code an earlier run timed), or None for all."""
    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "estimate_sm90_*.json"))):
        name = os.path.basename(path)
        if upto is not None and name > upto:
            break
        if "before" in name:
            continue
        with open(path) as fh:
            profiles = json.load(fh)["profiles"]
        for p in profiles:
            c, est = p["config"], p.get("estimate", {})
            if "tflops" in est and (c["launch"]["batch"], c["launch"]["heads"]) == (batch, heads):
                out[(c["variant"], c["head_dim"], c["causal"], c["dtype"], c["launch"]["n"])] = est
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--n", default="1024,2048,4096,8192")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--slow-s", type=float, default=0.5)
    parser.add_argument("--slow-repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the simulator, no SDPA")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    on_gpu = fa_numba.backend.name() == "gpu"
    if not on_gpu and not args.smoke:
        parser.error("no GPU: use --smoke to try the script in the simulator")
    batch, heads = (4, 16) if not args.smoke else (1, 2)
    sizes = [int(n) for n in args.n.split(",")] if not args.smoke else [16, 32]
    configs = [(n, d, causal, dtype) for n in sorted(sizes) for d in ((64, 128) if not args.smoke else (8,))
               for causal in (False, True) for dtype in ("float32", "float16")]
    # The fast-kernel issue's targets first (B=4, H=16, N=4096, d=64, float32, causal and not), then the rest.
    target = (max(sizes) if args.smoke else 4096, 8 if args.smoke else 64, "float32")
    configs.sort(key=lambda c: (c[0], c[1], c[3]) != target)
    start, results, flat, not_run = time.perf_counter(), [], [], []
    model = model_estimates(batch, heads)
    for index, (n, d, causal, dtype) in enumerate(configs, 1):
        if time.perf_counter() - start > args.budget_s:
            not_run.append(dict(n=n, d=d, causal=causal, dtype=dtype))
            continue
        shape = cmp.Shape(batch=batch, heads=heads, n_q=n, head_dim=d, causal=causal, dtype=dtype,
                          block_q=16 if args.smoke else None, block_k=16 if args.smoke else None)  # 16: v*-mma too
        log(f"[{index}/{len(configs)}] N={n} d={d} causal={causal} {dtype} (elapsed {time.perf_counter() - start:.0f} s)")
        result = cmp.run(shape, repeats=args.repeats, count=False, slow_ms=args.slow_s * 1e3,
                         slow_repeats=args.slow_repeats)
        result["sdpa"] = sdpa(shape.resolved(), args.repeats) if on_gpu else {"available": False, "why": "no GPU"}
        log(cmp.render(result))
        log(f"    sdpa: {result['sdpa']}")
        results.append(result)
        for r in result["rows"]:
            ms = r.get("time", {}).get("median_ms")
            ref = result["sdpa"].get("median_ms")
            flat.append(dict(n=n, head_dim=d, causal=causal, dtype=dtype, variant=r["variant"], passed=r.get("passed"),
                             err_out=r.get("err_out"), median_ms=ms, tflops=r.get("tflops"), gbps=r.get("gbps"),
                             repeats=r.get("time", {}).get("repeats"), bytes_total=r["bytes_total"], tiles_computed=r["tiles_computed"],
                             tiles_skipped=r["tiles_skipped"], sdpa_backend=result["sdpa"].get("backend"),
                             sdpa_ms=ref, ratio_to_sdpa=(ms / ref) if ms and ref else None,
                             scores_bytes=fa_numba.iomodel.materialized_scores_elements(n, n, batch, heads) * 4,
                             dense_bytes=fa_numba.iomodel.dense_traffic_elements(n, n, d, batch, heads) * 4,
                             model=model.get((r["variant"], d, causal, dtype, n))))
    machine = cmp.machine()
    with open(os.path.join(args.out, "compare_gpu.json"), "w") as fh:
        json.dump({"machine": machine, "results": results, "rows": flat, "not_run": not_run}, fh, indent=1)
    lines = [f"# compare_gpu: {machine['device']}, {machine['date']}", "",
             f"B={batch}, H={heads}; numba {machine['numba']}, numba-cuda {machine['numba_cuda']}", "",
             "| N | d | causal | dtype | variant | check | err O | median ms | repeats | TFLOP/s | model TFLOP/s (limiter) | GB/s | SDPA (backend) ms | kernel/SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in flat:
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        lines.append(f"| {r['n']} | {r['head_dim']} | {r['causal']} | {r['dtype']} | {r['variant']} | "
                     f"{'-' if r['passed'] is None else ('pass' if r['passed'] else 'FAIL')} | {fmt(r['err_out'], '.2e')} | "
                     f"{fmt(r['median_ms'], '.3f')} | {r['repeats']} | {fmt(r['tflops'], '.2f')} | "
                     f"{'-' if not r['model'] else format(r['model']['tflops'], '.1f') + ' (' + r['model']['limiter'] + ')'} | "
                     f"{fmt(r['gbps'], '.0f')} | "
                     f"{fmt(r['sdpa_ms'], '.3f')} ({r['sdpa_backend']}) | {fmt(r['ratio_to_sdpa'], '.1f')} |")
    lines += [""] + targets_summary(flat, *target)
    if not_run:
        lines += ["", f"Not run (budget of {args.budget_s:.0f} s spent): {not_run}"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "compare_gpu.md"), "w") as fh:
        fh.write(text)
    print(text)
    try:
        plots.traffic_vs_n([r for r in flat if r["dtype"] == "float32"], os.path.join(args.out, "compare_gpu.png"))
    except ImportError:
        log("matplotlib not importable: no plot")
    return 0 if all(r["passed"] is not False for r in flat) else 1


if __name__ == "__main__":
    sys.exit(main())
