"""Learnable sinks and packed batches on a lent GPU (issue 55), in benchmarks/run_on_device.sh stage 2:

    python benchmarks/sinks_gpu.py [--out DIR] [--smoke]

1. checked against the float64 reference with the derived rules (float16 on the tensor cores, float32 on the CUDA
   cores): the forward with sinks (the sink merge kernel after v2 and v2-mma), the backward with sinks and a dLSE
   (the shift and sink-gradient kernels, kv order on both engines), decoding with sinks after the combine, and a
   packed batch (`cu_seqlens`) whose offsets are whole tiles bit for bit against each sequence run alone;
2. each that passed timed (CUDA events, 3 warm-up calls, median of 10), float16 on the tensor cores: v2-mma at
   B=4, H=16, N=4096, d=64 causal with and without sinks (what the merge costs), and a packed batch of 512, 1024,
   2048, 512 causal against the same sequences padded to 2048 (what packing saves).

Writes sinks_gpu.json and prints one line per row. --smoke: tiny shapes (runs in the simulator, so the script
itself is tested); no timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import fa_numba  # noqa: F401  (first: it chooses the backend before numba.cuda is imported)
from fa_numba import packed, reference, sinks, split_kv, timing, tolerance, tolerance_backward


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _row(rows, **row):
    rows.append(row)
    return row


def _checked(rows, what, engine, check):
    """Run check() into a row: passed with its (err, atol), or failed with the rule's message."""
    row = _row(rows, what=what, engine=engine)
    try:
        err, atol = check()
        row.update(passed=True, err=err, atol=atol)
    except AssertionError as failure:
        row.update(passed=False, why=str(failure)[:300])
    return row


def check(batch, heads, n, d, tile) -> list:
    rows = []
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, heads, n, d)).astype(np.float32) for _ in range(3))
    s = (2 * rng.standard_normal(heads)).astype(np.float32)
    tiles = dict(block_q=tile, block_k=tile) if tile else {}
    for engine, dtype, p_dtype in (("simt", np.float32, None), ("mma", np.float16, "float16")):
        x = [a.astype(dtype) for a in (q, k, v)]
        exact = [a.astype(np.float64) for a in x]

        def forward():
            out, lse = fa_numba.attention(*x, causal=True, sinks=s, engine=engine, return_lse=True, **tiles)
            c = tolerance.judge(out, lse, sinks.baseline(*exact, s, causal=True, p_dtype=p_dtype,
                                                         contractions=("matmul",)), name=f"sinks {engine}")
            return c.err_out, c.atol_out

        def backward():
            out, lse = reference.attention(*exact, causal=True, sinks=s)
            dout = rng.standard_normal(out.shape).astype(dtype)
            dlse = rng.standard_normal(lse.shape).astype(np.float32)
            grads = fa_numba.attention_backward(*x, out.astype(np.float32), lse.astype(np.float32), dout, causal=True,
                                                sinks=s, dlse=dlse, engine=engine, **tiles)
            base = tolerance_backward.baseline_backward(*exact, dout.astype(np.float64), causal=True, sinks=s,
                                                        dlse=dlse, p_dtype=p_dtype, contractions=("matmul",))
            c = tolerance_backward.judge_backward(*grads[:3], base, dsinks=grads[3], name=f"sinks {engine}")
            return [c.err_dq, c.err_dk, c.err_dv], [c.atol_dq, c.atol_dk, c.atol_dv]

        _checked(rows, "forward with sinks", engine, forward)
        _checked(rows, "backward with sinks and dLSE", engine, backward)

    def decode():
        cache = rng.standard_normal((batch, heads, n, d)).astype(np.float32)
        query = rng.standard_normal((batch, heads, 1, d)).astype(np.float32)
        out, lse = fa_numba.attention_with_kvcache(query, cache, cache, [n] * batch, return_lse=True, sinks=s,
                                                   num_splits=1, block_k=16)  # the tiles and split the check takes
        c = split_kv.check(out[0], lse[0], query[0], cache[0], cache[0], causal=True, scale=d**-0.5,
                           block_k=16, splits=None, sinks=s, contractions=("matmul",))
        return c.err_out, c.atol_out

    def varlen():
        block = tile or 64
        lengths = [block, 2 * block, block]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        x = [rng.standard_normal((heads, int(cu[-1]), d)).astype(np.float16) for _ in range(3)]
        out = fa_numba.attention(*x, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, engine="mma", **tiles)
        for t in range(len(lengths)):
            rows_t = slice(int(cu[t]), int(cu[t + 1]))
            alone = fa_numba.attention(*(a[:, rows_t] for a in x), causal=True, engine="mma", **tiles)
            assert np.array_equal(out[:, rows_t], alone), f"packed sequence {t} differs from its run alone"
        return 0.0, 0.0

    _checked(rows, "decode with sinks", "auto", decode)
    _checked(rows, "packed = each alone (whole tiles)", "mma", varlen)
    return rows


def time_rows(checked) -> list:
    from numba import cuda

    ok = {(r["what"], r["engine"]) for r in checked if r["passed"]}
    rows = []
    rng = np.random.default_rng(1)
    b, h, n, d = 4, 16, 4096, 64
    x = [cuda.to_device(rng.standard_normal((b, h, n, d)).astype(np.float16)) for _ in range(3)]
    s = cuda.to_device((2 * rng.standard_normal(h)).astype(np.float32))
    flops = timing.attention_flops(b, h, n, n, d, causal=True)
    if ("forward with sinks", "mma") in ok:
        for name, more in (("v2-mma causal", {}), ("v2-mma causal + sinks", {"sinks": s})):
            t = timing.time_call(lambda: fa_numba.attention(*x, causal=True, engine="mma", **more), repeats=10)
            rows.append(dict(case=name, **t.as_dict(), tflops=flops / (t.median_ms * 1e-3) / 1e12))
    if ("packed = each alone (whole tiles)", "mma") in ok:
        lengths = [512, 1024, 2048, 512]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        xp = [cuda.to_device(rng.standard_normal((1, h, int(cu[-1]), d)).astype(np.float16)) for _ in range(3)]
        xs = [cuda.to_device(rng.standard_normal((len(lengths), h, max(lengths), d)).astype(np.float16))
              for _ in range(3)]
        mask = packed.varlen(cu, cu, causal=True)
        for name, call in (("packed 512,1024,2048,512 causal",
                            lambda: fa_numba.attention(*xp, mask=mask, engine="mma")),
                           ("padded to 2048, causal", lambda: fa_numba.attention(*xs, causal=True, engine="mma"))):
            t = timing.time_call(call, repeats=10)
            rows.append(dict(case=name, **t.as_dict()))
    for row in rows:
        log(f"time {row['case']:34} {row['median_ms']:9.3f} ms ({row['clock']})")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (default: off)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    checked = check(1, 2, 32, 16, 16) if args.smoke else check(2, 4, 256, 64, None)
    for row in checked:
        log(f"check {row['what']:34} {row['engine']:5} {'pass' if row['passed'] else 'FAIL ' + row.get('why', '')}")
    timed = [] if args.smoke else time_rows(checked)
    report = {"device": fa_numba.backend.name(), "rows": checked, "timed": timed}
    with open(os.path.join(args.out, "sinks_gpu.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=float)
    return 0 if all(r["passed"] for r in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
