"""Masks per batch and head, mask_mod, and strided inputs on a lent GPU (issues 24 and 27), in
benchmarks/run_on_device.sh after the score-mod script:

    python benchmarks/masks_gpu.py [--out DIR] [--smoke]

1. checked at B=2, H=4 (H_kv=2), N=256, d=64, float32: a document mask_mod (documents per batch entry, causal
   on even query heads) on every CUDA-core forward order and backward variant against the float64 reference
   with the derived rules and bit for bit against the 4-D from_dense of its answers; and strided inputs (the
   (B, H, N, d) view of a (B, N, H, d) array, read in place, or copied on the device where `api.reads_strided`
   says so) bit for bit against their contiguous copies, at d = 64 and 128 (v1's copy path), forward and
   backward; the same mask_mod on the tensor cores (engine="mma", float16: v1 and v2, the kv backward atomic
   and deterministic) against the reference with the P and dS rounding terms;
2. each that passed timed at B=4, H=16, N=4096, d=64, float16 (CUDA events, 3 warm-up calls, median of 10),
   v2 on each engine (simt: the CUDA cores; mma: the tensor cores): causal=True, the same causal mask as a
   mask_mod, as a 4-D from_dense (one slice per batch entry), and strided against contiguous inputs: what the
   function form, the per-slice lists and the strides cost, measured.

Writes masks_gpu.json and prints one line per row. --smoke: tiny shapes (runs in the simulator, so the script
itself is tested); no timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import fa_numba  # noqa: F401  (first: it chooses the backend before numba.cuda is imported)
from fa_numba import masks, timing, tolerance, tolerance_backward
from fa_numba.kernels import SIMT_VARIANTS, default_tiles


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _documents(b, h, i, j, ids):
    return ids[b, i] == ids[b, j] and (h % 2 == 1 or j <= i)


def _causal(b, h, i, j):
    return j <= i


def _inputs(batch, heads, heads_kv, n, d, seed=0):
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((batch, heads, n, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((batch, heads_kv, n, d)).astype(np.float32) for _ in range(2))
    return q, k, v, dout


def _row(rows, **row):
    rows.append(row)
    return row


def check_mask_mod(batch, heads, n, d, tile) -> list:
    rows = []
    q, k, v, dout = _inputs(batch, heads, heads // 2, n, d)
    ids = np.stack([np.arange(n) // max(1, n // 4), np.arange(n) // max(1, n // 3)])[:batch].astype(np.int32)
    mm = masks.mask_mod(_documents, ids)
    dense = masks.from_dense(mm.dense_slices(batch, heads, n, n))
    tiles = dict(block_q=tile, block_k=tile) if tile else {}
    for order in SIMT_VARIANTS:
        row = _row(rows, kind="forward", what="mask_mod", order=order)
        try:
            out, lse = fa_numba.attention(q, k, v, mask=mm, order=order, return_lse=True, **tiles)
            out4, lse4 = fa_numba.attention(q, k, v, mask=dense, order=order, return_lse=True, **tiles)
            bq, bk = (tile, tile) if tile else default_tiles(d)
            c = tolerance.check_attention(out, lse, q, k, v, mask=mm, order=order[:2], block_q=bq, block_k=bk)
            row.update(passed=bool(np.array_equal(out, out4) and np.array_equal(lse, lse4)), err=c.err_out,
                       atol=c.atol_out, bitwise_4d=bool(np.array_equal(out, out4)))
        except AssertionError as failure:
            row.update(passed=False, why=str(failure)[:300])
    out, lse = fa_numba.attention(q, k, v, mask=mm, return_lse=True, **tiles)
    for order, deterministic in (("kv", False), ("kv", True), ("q", False)):
        row = _row(rows, kind="backward", what="mask_mod", order=order + ("-det" if deterministic else ""))
        try:
            grads = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=mm, order=order,
                                                deterministic=deterministic, **({"block_q": tile} if tile else {}))
            c = tolerance_backward.check_attention_backward(*grads, q, k, v, dout, mask=mm)
            row.update(passed=True, err=[c.err_dq, c.err_dk, c.err_dv], atol=[c.atol_dq, c.atol_dk, c.atol_dv])
        except AssertionError as failure:
            row.update(passed=False, why=str(failure)[:300])
    return rows


def check_mask_mod_mma(batch, heads, n, d, tile) -> list:
    """The document mask_mod on the tensor cores, float16 (tile None: the engine's default tiles)."""
    rows = []
    q, k, v, dout = (x.astype(np.float16) for x in _inputs(batch, heads, heads // 2, n, d, seed=1))
    exact = [x.astype(np.float64) for x in (q, k, v, dout)]
    ids = np.stack([np.arange(n) // max(1, n // 4), np.arange(n) // max(1, n // 3)])[:batch].astype(np.int32)
    mm = masks.mask_mod(_documents, ids)
    tiles = dict(block_q=tile, block_k=tile) if tile else {}
    for order in ("v1", "v2"):
        row = _row(rows, kind="forward", what="mask_mod", order=f"{order}-mma")
        try:
            out, lse = fa_numba.attention(q, k, v, mask=mm, order=order, engine="mma", return_lse=True, **tiles)
            c = tolerance.check_attention(out, lse, *exact[:3], mask=mm, p_dtype="float16")
            row.update(passed=True, err=c.err_out, atol=c.atol_out)
        except AssertionError as failure:
            row.update(passed=False, why=str(failure)[:300])
    out, lse = fa_numba.attention(q, k, v, mask=mm, engine="mma", return_lse=True, **tiles)
    for deterministic in (False, True):
        row = _row(rows, kind="backward", what="mask_mod", order="kv-mma" + ("-det" if deterministic else ""))
        try:
            grads = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=mm, engine="mma",
                                                deterministic=deterministic, **tiles)
            c = tolerance_backward.check_attention_backward(*grads, *exact, mask=mm, p_dtype="float16")
            row.update(passed=True, err=[c.err_dq, c.err_dk, c.err_dv], atol=[c.atol_dq, c.atol_dk, c.atol_dv])
        except AssertionError as failure:
            row.update(passed=False, why=str(failure)[:300])
    return rows


def check_strided(batch, heads, n, dims, tile) -> list:
    from numba import cuda

    rows = []
    for d in dims:
        x = [np.random.default_rng(s).standard_normal((batch, n, heads, d)).astype(np.float32) for s in range(4)]
        views = [cuda.to_device(a).transpose((0, 2, 1, 3)) for a in x]
        flat = [np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in x]
        tiles = dict(block_q=tile, block_k=tile) if tile else {}
        for order in ("v2", "v1"):
            row = _row(rows, kind="forward", what=f"strided d={d}", order=order)
            got = fa_numba.attention(*views[:3], order=order, causal=True, **tiles).copy_to_host()
            want = fa_numba.attention(*flat[:3], order=order, causal=True, **tiles)
            row.update(passed=bool(np.array_equal(got, want)))
        row = _row(rows, kind="backward", what=f"strided d={d}", order="kv-det")
        out, lse = fa_numba.attention(*flat[:3], causal=True, return_lse=True, **tiles)
        got = fa_numba.attention_backward(*views[:3], cuda.to_device(out), cuda.to_device(lse), views[3], causal=True,
                                          deterministic=True, **({"block_q": tile} if tile else {}))
        want = fa_numba.attention_backward(*flat[:3], out, lse, flat[3], causal=True, deterministic=True,
                                           **({"block_q": tile} if tile else {}))
        row.update(passed=all(np.array_equal(g.copy_to_host(), w) for g, w in zip(got, want)))
    return rows


def time_rows(checked, batch, heads, n, d) -> list:
    from numba import cuda

    ok = {(r["what"].split()[0], r["order"]) for r in checked if r["passed"]}
    rows = []
    flops = timing.attention_flops(batch, heads, n, n, d) / 2  # causal: about half the pairs
    x = [np.random.default_rng(s).standard_normal((batch, n, heads, d)).astype(np.float16) for s in range(3)]
    flat = [cuda.to_device(np.ascontiguousarray(a.transpose(0, 2, 1, 3))) for a in x]
    views = [cuda.to_device(a).transpose((0, 2, 1, 3)) for a in x]
    causal_slices = masks.from_dense(np.broadcast_to(np.tri(n, dtype=bool), (batch, 1, n, n)).copy())  # per batch
    cases = [("causal=True", flat, {"causal": True}), ("mask_mod causal", flat, {"mask": masks.mask_mod(_causal)}),
             ("4-D from_dense causal", flat, {"mask": causal_slices})]
    if ("strided", "v2") in ok:
        cases.append(("strided causal=True", views, {"causal": True}))
    for engine in ("simt", "mma"):
        for name, arrays, kwargs in cases:
            if "mask" in kwargs and ("mask_mod", "v2" if engine == "simt" else "v2-mma") not in ok:
                continue  # each engine's masked rows are timed only where its check passed
            t = timing.time_call(lambda: fa_numba.attention(*arrays, engine=engine, **kwargs), repeats=10)
            rows.append(dict(case=f"{name} ({engine})", order="v2", engine=engine, dtype="float16", **t.as_dict(),
                             tflops=flops / (t.median_ms * 1e-3) / 1e12))
    for row in rows:
        log(f"time {row['case']:31} {row['median_ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s ({row['clock']})")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (default: off)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.smoke:
        checked = (check_mask_mod(2, 4, 24, 8, 8) + check_mask_mod_mma(1, 2, 24, 16, 16)
                   + check_strided(1, 2, 20, (8, 72), 8))
    else:
        checked = (check_mask_mod(2, 4, 256, 64, None) + check_mask_mod_mma(2, 4, 256, 64, None)
                   + check_strided(2, 4, 256, (64, 128), None))
    for row in checked:
        log(f"check {row['kind']:8} {row['what']:14} {row['order']:10} {'pass' if row['passed'] else 'FAIL'}")
    timed = [] if args.smoke else time_rows(checked, 4, 16, 4096, 64)
    report = {"device": fa_numba.backend.name(), "rows": checked, "timed": timed}
    with open(os.path.join(args.out, "masks_gpu.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=float)
    return 0 if all(r["passed"] for r in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
