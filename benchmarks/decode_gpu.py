"""Decoding on a lent GPU: the split-KV kernels checked, then timed beside the unsplit call, the v2 kernel and
torch SDPA, at the decode issue's shapes.

    python benchmarks/decode_gpu.py [--out DIR] [--budget-s 150] [--smoke]

Shapes: H=32, H_kv=8, N_q=1, d=128, float16, B in {1, 8}, N_k in {32768, 131072} (--smoke: a tiny shape in the
simulator, the same code paths). Each shape runs `fa_numba.compare_decode.run` (every variant checked against
the float64 reference, then timed: CUDA events, median after warm-up) and, where torch is importable with CUDA,
SDPA on the same q, k, v (GQA through enable_gqa) with its backend named. The HBM share is bytes (iomodel) /
median time / 4.8 TB/s. Shapes run smallest first; when --budget-s is spent the rest are listed as not run.
Writes decode_gpu.md and decode_gpu.json to --out (default $OUT, else benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing it (as on a lent GPU machine)

import fa_numba  # noqa: E402,F401 - selects the backend before numba is imported
from fa_numba import compare_decode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_gpu import torch_median_ms  # noqa: E402 - the same CUDA-event timing as the SDPA rows there

SHAPES = [(1, 32768), (8, 32768), (1, 131072), (8, 131072)]


def sdpa(shape: compare_decode.Shape, repeats: int) -> dict:
    """torch SDPA on compare_decode's inputs (the same seed): its backend and median ms, or why not."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as err:
        return {"available": False, "why": f"torch not importable: {err}"}
    if not torch.cuda.is_available():
        return {"available": False, "why": "torch has no CUDA device"}
    q, k, v = (torch.from_numpy(np.ascontiguousarray(x).astype(np.float16)).cuda()
               for x in compare_decode.inputs(shape))
    call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731 - N_q = 1 sees every key
    median = torch_median_ms(call, repeats)
    return {"available": True, "median_ms": median, "torch": torch.__version__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="a tiny shape in the simulator (the code paths only)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    shapes = ([compare_decode.Shape(1, 4, 2, 1, 48, 8, "float16", block_k=16)] if args.smoke else
              [compare_decode.Shape(b, 32, 8, 1, n, 128, "float16") for b, n in SHAPES])
    start, results, skipped = time.time(), [], []
    for shape in shapes:
        if time.time() - start > args.budget_s:
            skipped.append(shape)
            continue
        print(f"decode B={shape.batch} N_k={shape.n_k} ...", file=sys.stderr, flush=True)
        result = compare_decode.run(shape, repeats=args.repeats, count=False)
        result["sdpa"] = sdpa(shape, args.repeats) if not args.smoke else {"available": False, "why": "--smoke"}
        results.append(result)
        print(compare_decode.render(result), flush=True)
    lines = ["# Decoding (split-KV) on the device", ""]
    for r in results:
        t = r["sdpa"]
        lines += ["```", compare_decode.render(r), "```",
                  f"torch SDPA: {t['median_ms']:.3f} ms (torch {t['torch']})" if t["available"]
                  else f"torch SDPA: not run ({t['why']})", ""]
    lines += [f"not run (budget): B={s.batch} N_k={s.n_k}" for s in skipped]
    with open(os.path.join(args.out, "decode_gpu.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    rows = [{**row, "shape": r["shape"]} for r in results for row in r["rows"]]
    with open(os.path.join(args.out, "decode_gpu.json"), "w") as fh:
        json.dump({"rows": rows, "sdpa": [r["sdpa"] for r in results]}, fh, indent=1, default=str)
    return 0 if all(compare_decode.all_passed(r) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
