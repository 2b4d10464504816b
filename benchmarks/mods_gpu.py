"""Score mods on a lent GPU (issue 27), in benchmarks/run_on_device.sh after the tensor-core script:

    python benchmarks/mods_gpu.py [--out DIR] [--smoke]

1. checked against the float64 reference with the derived rules at B=1, H=4, N=256, d=64: ALiBi and softcap
   (and a relative bias) on the CUDA-core v2 and v1 forwards (float32), the tensor-core v2 and v1 forwards
   (float16, with P's rounding term), the CUDA-core and tensor-core backwards (kv, atomic), and the captured
   gradients (kernels/captured_grad.py);
2. each that passed timed at B=4, H=16, N=4096, d=64 (CUDA events, 3 warm-up calls, median of 10) beside the
   same kernel without a mod and torch SDPA (float16, when torch has CUDA): what a mod costs, measured, to set
   against the whole-kernel model's estimate (docs/profile.md). The captured arrays are copied to the device
   at every call (the API's behaviour), inside the timing.

Writes mods_gpu.json and prints one line per row. --smoke: tiny shapes (runs in the simulator, so the script
itself is tested); no timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import fa_numba  # noqa: F401  (first: it chooses the backend before numba.cuda is imported)
from fa_numba import mods, timing, tolerance, tolerance_backward
from fa_numba.kernels import default_tiles


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _mods(heads: int, n: int) -> dict:
    rng = np.random.default_rng(0)
    return {"none": None, "alibi": mods.alibi(2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)),
            "softcap": mods.softcap(30.0), "relative_bias": mods.relative_bias(rng.standard_normal((heads, 2 * n - 1)))}


def _inputs(batch, heads, n, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, heads, n, d)).astype(dtype) for _ in range(4)]


def check_rows(batch, heads, n, d) -> list:
    """Every kernel family with each mod, against the rules; one row each."""
    rows = []
    table = _mods(heads, n)
    for engine, dtype, orders in (("simt", np.float32, ("v2", "v1")), ("mma", np.float16, ("v2", "v1"))):
        q, k, v, dout = _inputs(batch, heads, n, d, dtype)
        wide = [x.astype(np.float32) for x in (q, k, v, dout)]
        p_dtype = "float16" if engine == "mma" else None
        for name, mod in table.items():
            if mod is None:
                continue
            for order in orders:
                row = dict(kind="forward", engine=engine, order=order, mod=name)
                try:
                    out, lse = fa_numba.attention(q, k, v, engine=engine, order=order, return_lse=True, score_mod=mod,
                                                  **({"block_q": 16, "block_k": 16} if engine == "mma" else {}))
                    tiles = {}
                    if order == "v1":
                        bq, bk = (16, 16) if engine == "mma" else default_tiles(d)
                        tiles = dict(order="v1", block_q=bq, block_k=bk)
                    c = tolerance.check_attention(out, lse, *wide[:3], score_mod=mod, p_dtype=p_dtype, **tiles)
                    row.update(passed=True, err=c.err_out, atol=c.atol_out)
                except AssertionError as failure:
                    row.update(passed=False, why=str(failure)[:300])
                rows.append(row)
            row = dict(kind="backward", engine=engine, order="kv", mod=name)
            try:
                out, lse = fa_numba.attention(q, k, v, engine=engine, return_lse=True, score_mod=mod)
                grads = fa_numba.attention_backward(q, k, v, out, lse, dout, engine=engine, score_mod=mod,
                                                    captured_grads=engine == "simt")
                c = tolerance_backward.check_attention_backward(*grads[:3], *wide, score_mod=mod, p_dtype=p_dtype)
                row.update(passed=True, err=[c.err_dq, c.err_dk, c.err_dv], atol=[c.atol_dq, c.atol_dk, c.atol_dv])
                if engine == "simt":
                    errs = tolerance_backward.check_captured_gradients(grads[3], *wide, score_mod=mod)
                    row.update(captured_err=[e for e in errs if e is not None])
            except AssertionError as failure:
                row.update(passed=False, why=str(failure)[:300])
            rows.append(row)
    for row in rows:
        log(f"check {row['kind']:8} {row['engine']:4} {row['order']:2} {row['mod']:13} "
            f"{'pass' if row['passed'] else 'FAIL'}")
    return rows


def time_rows(checked, batch, heads, n, d) -> list:
    """The forwards that passed, timed with and without their mod, beside torch SDPA."""
    from numba import cuda

    rows = []
    table = _mods(heads, n)
    flops = timing.attention_flops(batch, heads, n, n, d)
    passed = {(r["engine"], r["order"], r["mod"]) for r in checked if r["kind"] == "forward" and r["passed"]}
    for engine, dtype in (("simt", np.float32), ("mma", np.float16)):
        q, k, v = (cuda.to_device(x) for x in _inputs(batch, heads, n, d, dtype)[:3])
        for name, mod in table.items():
            if mod is not None and (engine, "v2", name) not in passed:
                continue
            t = timing.time_call(lambda: fa_numba.attention(q, k, v, engine=engine, score_mod=mod), repeats=10)
            rows.append(dict(engine=engine, order="v2", mod=name, dtype=np.dtype(dtype).name, **t.as_dict(),
                             tflops=flops / (t.median_ms * 1e-3) / 1e12))
    try:
        import torch

        if torch.cuda.is_available():
            x = [torch.randn(batch, heads, n, d, device="cuda", dtype=torch.float16) for _ in range(3)]
            sdpa = torch.nn.functional.scaled_dot_product_attention
            t = timing.time_call(lambda: sdpa(*x), repeats=10)
            rows.append(dict(engine="torch", order="sdpa", mod="none", dtype="float16", **t.as_dict(),
                             tflops=flops / (t.median_ms * 1e-3) / 1e12))
    except ImportError:
        log("torch is not installed: no SDPA row")
    for row in rows:
        log(f"time {row['engine']:5} {row['order']:4} {row['mod']:13} {row['dtype']:8} {row['median_ms']:9.3f} ms "
            f"{row['tflops']:7.1f} TFLOP/s ({row['clock']})")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (default: off)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    check_shape = (1, 4, 32, 16) if args.smoke else (1, 4, 256, 64)
    checked = check_rows(*check_shape)
    timed = [] if args.smoke else time_rows(checked, 4, 16, 4096, 64)
    report = {"device": fa_numba.backend.name(), "check_shape": check_shape, "rows": checked, "timed": timed}
    with open(os.path.join(args.out, "mods_gpu.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=float)
    return 0 if all(r["passed"] for r in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
