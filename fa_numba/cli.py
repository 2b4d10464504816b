"""`python -m fa_numba compare`: v1 vs v2 side by side.

For now the variants are the tiled NumPy spec of each order computed in float32 (the arithmetic the
kernels use); each is checked against the float64 reference with the derived tolerance rule, and its
tiles and HBM traffic are shown, counted by the spec's ledger and predicted by `iomodel`.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from fa_numba import iomodel, reference, tiled, tiling

DTYPES = {"float32": np.float32, "float16": np.float16}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _orders(text: str) -> list[str]:
    orders = [o.strip() for o in text.split(",") if o.strip()]
    bad = [o for o in orders if o not in tiling.ORDERS]
    if bad or not orders:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(tiling.ORDERS)}, got {text!r}")
    return orders


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="fa_numba", description="Exact FlashAttention: v1 vs v2 loop orders.")
    sub = top.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser("compare", help="run both loop orders on the same inputs and compare them")
    cmp.add_argument("--batch", type=_positive, default=1)
    cmp.add_argument("--heads", type=_positive, default=2)
    cmp.add_argument("--heads-kv", type=_positive, default=None, help="K/V heads (GQA); default: --heads")
    cmp.add_argument("--n-q", type=_positive, default=256)
    cmp.add_argument("--n-k", type=_positive, default=None, help="default: --n-q")
    cmp.add_argument("--head-dim", type=_positive, default=64)
    cmp.add_argument("--causal", action="store_true")
    cmp.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    cmp.add_argument("--block-q", type=_positive, default=64)
    cmp.add_argument("--block-k", type=_positive, default=64)
    cmp.add_argument("--orders", type=_orders, default=list(tiling.ORDERS))
    cmp.add_argument("--seed", type=int, default=0)
    cmp.add_argument("--json", metavar="PATH", help="also write every number as JSON")
    return top


def compare(args) -> dict:
    heads_kv = args.heads_kv or args.heads
    n_k = args.n_k or args.n_q
    rng = np.random.default_rng(args.seed)
    dtype = DTYPES[args.dtype]
    q = rng.standard_normal((args.batch, args.heads, args.n_q, args.head_dim)).astype(dtype)
    k = rng.standard_normal((args.batch, heads_kv, n_k, args.head_dim)).astype(dtype)
    v = rng.standard_normal((args.batch, heads_kv, n_k, args.head_dim)).astype(dtype)
    rows = []
    for order in args.orders:
        out, lse, ledger = tiled.attention(q, k, v, order=order, block_q=args.block_q, block_k=args.block_k,
                                           causal=args.causal, dtype=np.float32)
        try:
            check = reference.check_attention(out, lse, q, k, v, causal=args.causal, name=order)
            passed, err_out, err_lse, note = True, check.err_out, check.err_lse, ""
        except AssertionError as failure:
            ref_out, ref_lse = reference.attention(q, k, v, causal=args.causal)
            passed, note = False, str(failure)
            err_out, err_lse = reference.max_error(out, ref_out), reference.max_error(lse, ref_lse)
        model = iomodel.traffic(order, args.n_q, n_k, args.head_dim, args.block_q, args.block_k, args.causal,
                                batch=args.batch, heads=args.heads, heads_kv=heads_kv)
        sched = tiling.schedule(order, args.n_q, n_k, args.block_q, args.block_k, args.causal)
        itemsize = np.dtype(dtype).itemsize
        rows.append({
            "variant": f"tiled-{order}",
            "order": order,
            "passed": passed,
            "err_out": err_out,
            "err_lse": err_lse,
            "tiles_computed": sched.computed * args.batch * args.heads,
            "tiles_skipped": sched.skipped * args.batch * args.heads,
            "tiles_masked": sched.masked * args.batch * args.heads,
            "bytes_model": iomodel.to_bytes(model, itemsize),
            "bytes_counted": iomodel.to_bytes(ledger, itemsize),
            "bytes_total": iomodel.total_bytes(model, itemsize),
            "failure": note,
        })
    return {
        "shape": {"batch": args.batch, "heads": args.heads, "heads_kv": heads_kv, "n_q": args.n_q, "n_k": n_k,
                  "head_dim": args.head_dim, "causal": args.causal, "dtype": args.dtype,
                  "block_q": args.block_q, "block_k": args.block_k, "seed": args.seed},
        "engine": "tiled NumPy spec (float32 arithmetic); kernels: not yet built",
        "rows": rows,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def render(result: dict) -> str:
    s = result["shape"]
    lines = [
        f"shape B={s['batch']} H={s['heads']} H_kv={s['heads_kv']} N_q={s['n_q']} N_k={s['n_k']} d={s['head_dim']} "
        f"causal={s['causal']} dtype={s['dtype']} tiles {s['block_q']}x{s['block_k']}",
        f"engine: {result['engine']}",
    ]
    header = ("variant", "check", "err O", "err LSE", "tiles", "skipped", "masked",
              "Q+O MiB", "K+V MiB", "total MiB", "ledger==model")
    table = [header]
    for r in result["rows"]:
        b = r["bytes_model"]
        qo = b["read"]["Q"] + b["read"]["O"] + b["write"]["O"]
        kv = b["read"]["K"] + b["read"]["V"]
        table.append((r["variant"], "pass" if r["passed"] else "FAIL", f"{r['err_out']:.2e}", f"{r['err_lse']:.2e}",
                      str(r["tiles_computed"]), str(r["tiles_skipped"]), str(r["tiles_masked"]),
                      _mib(qo), _mib(kv), _mib(r["bytes_total"]), str(r["bytes_model"] == r["bytes_counted"])))
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    for row in table:
        lines.append("  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))))
    for r in result["rows"]:
        if not r["passed"]:
            lines.append(f"{r['variant']} failed its check: {r['failure']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.heads_kv and args.heads % args.heads_kv:
        top.error(f"argument --heads-kv: {args.heads_kv} must divide --heads ({args.heads})")
    result = compare(args)
    print(render(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0 if all(r["passed"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
