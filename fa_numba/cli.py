"""`python -m fa_numba compare | sweep | profile | cache` (also installed as `fa-numba`).

compare: every registered kernel on the same random inputs, side by side (see fa_numba.compare), with no
         mask, --causal, or any block mask (--mask window:128,0, documents:100,300,...; masks.parse).
sweep:   compare over a list of sizes (and head dims, causal on/off, or one --mask), with progress on
         stderr, CSV/JSON, and optional plots (matplotlib, the `plot` extra): HBM bytes vs N and the tile
         map of the mask swept (causal without one).
profile: the static profile of every kernel from its sm_90 SASS, compiled on the CPU (fa_numba.profile).
cache:   where compiled kernels are kept on disk and how much (kernels.disk_cache); --clear removes them.
Exit codes: 0 all checks passed, 1 a variant failed its check, 2 bad arguments (with usage, one line naming
the option, no traceback; output paths are checked before anything runs).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import sys

import numpy as np

from fa_numba import arguments, backend, iomodel, masks, tiling
from fa_numba import compare as cmp
from fa_numba import compare_decode
from fa_numba.kernels import VARIANTS
from fa_numba.kernels.common import MAX_HEAD_DIM

GPU_DEFAULTS = dict(batch=4, heads=16, n_q=1024, head_dim=64, block_q=None, block_k=None, decode_n_k=32768)
SIM_DEFAULTS = dict(batch=1, heads=2, n_q=64, head_dim=16, block_q=None, block_k=None,  # tiles: compare.Shape
                    decode_n_k=256)
INT32_MAX = arguments.INT32_MAX
DTYPES = ["float32", "float16", "bfloat16"]  # bfloat16: ml_dtypes arrays (compare.input_dtype)
# The sweep table's S MiB column, explained under the table and in `sweep --help`
SCORES_NOTE = ("S MiB: the B H N_q N_k float32 scores S = scale Q K^T that a dense (unfused) attention writes to "
               "HBM, and P as much again; these kernels never store them")


_positive = arguments.positive


def _positive_list(text: str) -> list[int]:
    return [_positive(part) for part in text.split(",") if part.strip()] or [_positive("")]


def _head_dim_list(text: str) -> list[int]:
    return [arguments.head_dim(part) for part in text.split(",") if part.strip()] or [_positive("")]


def _variants(text: str) -> list[str]:
    """Kernel variants: forward (kernels.VARIANTS) or, with --backward, backward (compare.BACKWARD_VARIANTS)."""
    names = [o.strip() for o in text.split(",") if o.strip()]
    known = list(VARIANTS) + list(cmp.BACKWARD_VARIANTS)
    bad = [o for o in names if o not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(sorted(VARIANTS))} (or with --backward "
                                         f"{', '.join(cmp.BACKWARD_VARIANTS)}), got {text!r}")
    return names


def _seed(text: str) -> int:
    """A seed numpy's default_rng takes (an int >= 0), refused here rather than after the tables are drawn."""
    try:
        value = int(text)
        np.random.default_rng(value)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"expected a non-negative integer (a numpy default_rng seed), got {text!r}") \
            from None
    return value


def _mask_spec(text: str) -> str:
    """A mask as masks.parse reads it, returned as its spec (one spelling: "window:inf,0" is "causal")."""
    # masks.parse refuses bad syntax and integers the kernels' int32 positions cannot hold (ValueError); the
    # others are caught too, so that no mask text ever ends in a traceback
    try:
        return masks.parse(text).spec()
    except (ValueError, TypeError, OverflowError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


MASK_HELP = (f"a block mask, one of {masks.SYNTAX}; its SKIP tiles are never loaded. Documents are "
             "self-attention over packed sequences: N_q = N_k must equal the sum of the lengths")


def _shape_arguments(p: argparse.ArgumentParser, sweep: bool) -> None:
    # every help states its default: %(default)s where the value reads well, in words where None means "derived"
    defaults = GPU_DEFAULTS if backend.name() == "gpu" else SIM_DEFAULTS
    where = "on a GPU" if backend.name() == "gpu" else "in the simulator"
    p.add_argument("--batch", type=_positive, default=defaults["batch"],
                   help=f"batch size B (default {where}: %(default)s)")
    p.add_argument("--heads", type=_positive, default=defaults["heads"],
                   help=f"query heads H (default {where}: %(default)s)")
    p.add_argument("--heads-kv", type=_positive, default=None,
                   help="K/V heads (GQA), dividing --heads (default: --heads)")
    if not sweep:
        p.add_argument("--n-q", type=_positive, default=None,
                       help=f"queries N_q (default {where}: {defaults['n_q']}; with --decode 1)")
        p.add_argument("--n-k", type=_positive, default=None,
                       help=f"keys N_k (default: --n-q; with --decode {defaults['decode_n_k']})")
        p.add_argument("--head-dim", type=arguments.head_dim, default=defaults["head_dim"],
                       help=f"head dim d, at most {MAX_HEAD_DIM} (default {where}: %(default)s)")
        p.add_argument("--causal", action="store_true",
                       help="bottom-right causal, the same as --mask causal (default: off)")
    p.add_argument("--mask", type=_mask_spec, metavar="SPEC",
                   help=MASK_HELP + (" (so one N per documents mask)" if sweep else "") + "; not with --causal"
                   + (" on/both" if sweep else "") + " (default: none)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="input dtype; bfloat16 needs ml_dtypes (default: %(default)s)")
    tiles_help = ("(default: by head dim, as fa_numba.attention picks them, kernels.default_tiles; in the "
                  "simulator 16 for a shape it can run)")
    p.add_argument("--block-q", type=_positive, default=defaults["block_q"], help="query tile B_r " + tiles_help)
    p.add_argument("--block-k", type=_positive, default=defaults["block_k"], help="key tile B_c " + tiles_help)
    p.add_argument("--orders", type=_variants, default=sorted(VARIANTS),
                   help=f"kernel variants, e.g. v1,v2 (default: all, {','.join(sorted(VARIANTS))}; a variant that "
                        "cannot take the shape, v1-mma and v2-mma on float32, is left out with a note)")
    p.add_argument("--repeats", type=_positive, default=20,
                   help="timed calls on a GPU, median reported (default: %(default)s)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs, >= 0 (default: %(default)s)")
    p.add_argument("--no-count", action="store_true",
                   help="simulator: skip counting the kernels' HBM accesses (default: off, they are counted)")



def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="fa_numba", description="Exact FlashAttention: v1 vs v2 loop orders.")
    sub = top.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="every kernel variant on the same inputs, side by side")
    _shape_arguments(c, sweep=False)
    c.add_argument("--json", metavar="PATH", help="also write every number as JSON (default: none)")
    c.add_argument("--backward", action="store_true",
                   help="the backward variants (kv, kv-deterministic, q) instead of the forward ones (default: off)")
    c.add_argument("--decode", action="store_true",
                   help="decoding: attention_with_kvcache split and unsplit beside the v2 kernel on one cache, with "
                        "HBM bytes and the HBM bound (fa_numba.compare_decode; causal; default: off)")
    c.add_argument("--ring", type=_positive, metavar="W", default=None,
                   help="ring attention over W ranks: the communication model per step (fa_numba.ring_model: bytes "
                        "per rank, compute at the v2 estimate, NVLink 450 GB/s each way; zigzag; an interval --mask "
                        "counts each chunk pair's visible share; "
                        "no kernel runs; default: off)")
    c.add_argument("--varlen", type=_positive_list, metavar="L1,L2,...", default=None,
                   help="a packed batch of sequences of these lengths (self-attention, causal with --causal) beside "
                        "the same sequences padded to the longest: tiles, visible pairs, HBM bytes of the v2 forward "
                        "(the model: no kernel runs; default: off)")
    c.add_argument("--split-size", type=_positive, default=None,
                   help="with --decode: keys per split, a multiple of the key tile (default: the heuristic)")
    s = sub.add_parser("sweep", help="compare over a list of sizes; CSV/JSON and plots",
                       description="compare over a list of sizes: one table row per size and variant. HBM MiB: the "
                                   "bytes the variant moves (iomodel). " + SCORES_NOTE + ".")
    _shape_arguments(s, sweep=True)
    s.add_argument("--n", type=_positive_list, required=True,
                   help="sequence lengths N_q = N_k, e.g. 256,512,1024 (required: no default)")
    s.add_argument("--head-dims", type=_head_dim_list, default=None,
                   help="head dims (default: 16 in the simulator, 64 on a GPU)")
    s.add_argument("--causal", choices=["off", "on", "both"], default="off",
                   help="unmasked, causal, or both (default: %(default)s)")
    s.add_argument("--csv", metavar="PATH", help="also write the table's rows as CSV (default: none)")
    s.add_argument("--json", metavar="PATH", help="also write every number as JSON (default: none)")
    s.add_argument("--plot", metavar="PATH",
                   help="HBM bytes vs N (and time vs N on a GPU), PNG or PDF (default: none)")
    s.add_argument("--tile-map", metavar="PATH",
                   help="the SKIP/FULL/PARTIAL tile grid of the first N with >= 8 query tiles (else the largest): "
                        "of --mask, else causal (also with --causal off, whose every tile is FULL: the title says "
                        "so), PNG or PDF (default: none)")
    sub.add_parser("profile", add_help=False,  # listed here; main() hands its arguments to fa_numba.profile
                   help="static profile of every kernel from its sm_90 SASS (no GPU needed; see fa_numba.profile)")
    k = sub.add_parser("cache", help="where compiled kernels are kept on disk, and their size",
                       description="Compiled kernels are kept on disk (on a GPU) so that a new process launches what "
                                   "an earlier one compiled; FA_NUMBA_CACHE_DIR moves the folder, FA_NUMBA_CACHE=0 "
                                   "turns the cache off.")
    k.add_argument("--clear", action="store_true", help="remove every cached kernel (default: only report)")
    top.set_defaults(usage_of={"compare": c, "sweep": s})  # errors found after parsing show the subcommand's usage
    return top


def _shape(args, n_q, n_k, head_dim, causal) -> cmp.Shape:
    return cmp.Shape(batch=args.batch, heads=args.heads, heads_kv=args.heads_kv, n_q=n_q, n_k=n_k,
                     head_dim=head_dim, causal=causal, mask=args.mask, dtype=args.dtype, block_q=args.block_q,
                     block_k=args.block_k, seed=args.seed)


def _check_mask_fits(args, top, sizes) -> None:
    """--mask against every (N_q, N_k) to run, before anything runs: a usage error naming --mask (e.g.
    documents whose lengths do not add up to N)."""
    for n_q, n_k in sizes:
        try:
            cmp.check_mask(args.mask, False, n_q, n_k)
        except ValueError as err:
            top.error(f"argument --mask: {err}")


# compare options that --decode and --ring do not use, and why: each is refused by name rather than ignored
WHY_DECODE = "decoding is causal, its row tile is derived"
NOT_WITH_DECODE = {"backward": WHY_DECODE, "mask": WHY_DECODE, "causal": WHY_DECODE, "block_q": WHY_DECODE,
                   "orders": f"decoding compares its own variants, {', '.join(compare_decode.VARIANTS)}"}
NO_KERNEL = "the ring model runs no kernel"
NOT_WITH_RING = {"decode": "the ring model is not a decoding comparison: pass one of them",
                 "backward": "the ring model's table has the forward and the backward already",
                 "split_size": "only with --decode", "block_q": NO_KERNEL, "block_k": NO_KERNEL, "orders": NO_KERNEL,
                 "repeats": NO_KERNEL, "seed": NO_KERNEL, "no_count": NO_KERNEL,
                 "json": "the ring model prints its table only"}


def _given(argv: list[str]) -> set[str]:
    """The dests of the options argv names, whatever their values (argparse fills in defaults and keeps no
    record of what was typed): argv parsed again with every subcommand's defaults suppressed."""
    top = parser()
    for sub in top.get_default("usage_of").values():
        for action in sub._actions:
            action.default = argparse.SUPPRESS
    return set(vars(top.parse_args(argv))) - {"command", "usage_of"}


def _refuse_unused(top, option: str, given: set[str], unused: dict[str, str]) -> None:
    """A usage error naming `option` and the first given option it does not use."""
    for dest, why in unused.items():
        if dest in given:
            top.error(f"argument {option}: not allowed with {_option(dest)} ({why})")


def _run_decode(args, top, given: set[str]) -> int:
    _refuse_unused(top, "--decode", given, NOT_WITH_DECODE)
    defaults = GPU_DEFAULTS if backend.name() == "gpu" else SIM_DEFAULTS
    shape = compare_decode.Shape(args.batch, args.heads, args.heads_kv or args.heads, args.n_q or 1,
                                 args.n_k or defaults["decode_n_k"], args.head_dim, args.dtype, args.split_size,
                                 args.block_k, args.seed)
    if backend.name() != "gpu":
        print("no GPU found: running the kernels in the CUDA simulator (checks and HBM counts, no timings)")
    try:
        result = compare_decode.run(shape, repeats=args.repeats, count=False if args.no_count else None)
    except ValueError as err:
        top.error(str(err))
    print(compare_decode.render(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0 if compare_decode.all_passed(result) else 1


def _run_ring(args, top, given: set[str]) -> int:
    from fa_numba import ring_model

    _refuse_unused(top, "--ring", given, NOT_WITH_RING)
    defaults = GPU_DEFAULTS if backend.name() == "gpu" else SIM_DEFAULTS
    n = args.n_q or defaults["n_q"]
    if args.n_k not in (None, n):
        top.error("argument --ring: self-attention over one sharded sequence: no --n-k other than --n-q")
    if args.mask and args.causal:
        top.error(f"argument --mask: not allowed with --causal (--causal is --mask causal), got --mask {args.mask}")
    try:
        steps = ring_model.ring_steps(args.ring, n, args.head_dim, batch=args.batch, heads=args.heads,
                                      heads_kv=args.heads_kv, itemsize=4 if args.dtype == "float32" else 2,
                                      causal=args.causal, mask=masks.parse(args.mask) if args.mask else None)
    except ValueError as err:
        top.error(f"argument --ring: {err}")
    masking = ", causal" if args.causal else f", mask {args.mask}" if args.mask else ""
    print(ring_model.render(steps, f"ring attention, W={args.ring}, zigzag: B={args.batch} H={args.heads} N={n} "
                                   f"d={args.head_dim} {args.dtype}{masking}"))
    return 0


NOT_WITH_VARLEN = {"decode": "a packed batch is not a decoding comparison", "ring": "pass one of them",
                   "batch": "the lengths give B",
                   "backward": "the packed comparison is the forward's", "mask": "the offsets are the mask",
                   "n_q": "the lengths give N", "n_k": "the lengths give N", "orders": "no kernel runs",
                   "repeats": "no kernel runs", "seed": "no kernel runs", "no_count": "no kernel runs",
                   "split_size": "only with --decode", "json": "the packed comparison prints its table only"}


def _run_varlen(args, top, given: set[str]) -> int:
    _refuse_unused(top, "--varlen", given, NOT_WITH_VARLEN)
    default_q, default_k = cmp.default_tiles(args.head_dim)
    block_q, block_k = args.block_q or default_q, args.block_k or default_k
    rows = cmp.varlen_rows(args.varlen, args.head_dim, block_q, block_k, causal=args.causal, heads=args.heads,
                           itemsize=4 if args.dtype == "float32" else 2)
    print(cmp.render_varlen(rows, f"packed vs padded: {len(args.varlen)} sequences of {','.join(map(str, args.varlen))}"
                                  f" H={args.heads} d={args.head_dim} {args.dtype}{', causal' if args.causal else ''}, "
                                  f"tiles {block_q} x {block_k}"))
    return 0


def _run_compare(args, top, given: set[str]) -> int:
    if args.varlen:
        return _run_varlen(args, top, given)
    if args.ring:
        return _run_ring(args, top, given)
    if args.decode:
        return _run_decode(args, top, given)
    if args.split_size is not None:
        top.error("argument --split-size: only with --decode")
    defaults = GPU_DEFAULTS if backend.name() == "gpu" else SIM_DEFAULTS
    args.n_q = args.n_q or defaults["n_q"]
    if args.mask and args.causal:
        top.error(f"argument --mask: not allowed with --causal (--causal is --mask causal): pass one of them, "
                  f"got --causal and --mask {args.mask}")
    _check_mask_fits(args, top, [(args.n_q, args.n_k or args.n_q)])
    try:
        shape = _shape(args, args.n_q, args.n_k, args.head_dim, args.causal).resolved()  # tiles picked here
    except ValueError as err:
        top.error(str(err))
    if backend.name() != "gpu":
        print("no GPU found: running the kernels in the CUDA simulator (checks and HBM counts, no timings)")
    if args.backward:
        orders = args.orders if args.orders != sorted(VARIANTS) else None  # --orders names backward variants here
        bad = [o for o in (orders or []) if o not in cmp.BACKWARD_VARIANTS]
        if bad:
            top.error(f"argument --orders: with --backward, expected a comma list of "
                      f"{', '.join(cmp.BACKWARD_VARIANTS)}, got {','.join(bad)}")
        try:
            result = cmp.run_backward(shape, orders, repeats=args.repeats, count=False if args.no_count else None)
        except ValueError as err:
            top.error(str(err))
        print(cmp.render_backward(result))
    else:
        bad = [o for o in args.orders if o not in VARIANTS]
        if bad:
            top.error(f"argument --orders: expected a comma list of {', '.join(sorted(VARIANTS))}, got {','.join(bad)} "
                      "(backward variants need --backward)")
        try:  # every variant asked for refuses the shape (v2-mma on float32 inputs): say why, no traceback
            result = cmp.run(shape, args.orders, repeats=args.repeats, count=False if args.no_count else None)
        except ValueError as err:
            top.error(f"argument --orders: {err}")
        print(cmp.render(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if cmp.all_passed(result) else 1


CSV_FIELDS = ["n", "head_dim", "causal", "mask", "tile_size", "variant", "ran", "passed", "err_out", "err_lse",
              "tiles_computed", "tiles_skipped", "tiles_masked", "bytes_total", "scores_bytes", "dense_bytes", "median_ms",
              "tflops", "gbps"]


def _run_sweep(args, top) -> int:
    head_dims = args.head_dims or ([64] if backend.name() == "gpu" else [16])
    if args.mask and args.causal != "off":
        top.error(f"argument --mask: not allowed with --causal {args.causal} (a mask replaces causal; --mask causal "
                  f"is --causal on): pass one of them")
    _check_mask_fits(args, top, [(n, n) for n in args.n])
    causals = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    configs = [(n, d, c) for d in head_dims for c in causals for n in args.n]
    results, flat, ok = [], [], True
    if backend.name() != "gpu":
        print("no GPU found: kernels run in the CUDA simulator where feasible (no timings)", file=sys.stderr)
    try:
        picked = [_shape(args, n, n, d, causal).resolved() for n, d, causal in configs]
    except ValueError as err:
        top.error(str(err))
    if len({(s.head_dim, s.block_q, s.block_k) for s in picked}) > len(set(head_dims)):
        # the simulator would run the small sizes with its small tiles and not the large ones: keep one tile
        # size per d, the launch defaults, so that bytes vs N compare like with like
        picked = [_shape(args, n, n, d, causal).resolved(simulator_tiles=False) for n, d, causal in configs]
    for index, ((n, d, causal), shape) in enumerate(zip(configs, picked), 1):
        masking = f"mask={args.mask}" if args.mask else f"causal={causal}"
        print(f"[{index}/{len(configs)}] N={n} d={d} {masking} ...", file=sys.stderr, flush=True)
        try:
            result = cmp.run(shape, args.orders, repeats=args.repeats, count=False if args.no_count else None)
        except ValueError as err:  # no variant asked for takes the shape (v2-mma on float32 inputs)
            top.error(f"argument --orders: {err}")
        for note in result["notes"]:
            if note != cmp.NO_GPU_NOTE:
                print(f"    {note}", file=sys.stderr, flush=True)
        ok &= cmp.all_passed(result)
        results.append(result)
        for r in result["rows"]:
            flat.append({"n": n, "head_dim": d, "causal": causal, "mask": shape.mask,
                         "tile_size": f"{shape.block_q}x{shape.block_k}",
                         "variant": r["variant"], "ran": result["ran"],
                         "passed": r.get("passed"), "err_out": r.get("err_out"), "err_lse": r.get("err_lse"),
                         "tiles_computed": r["tiles_computed"], "tiles_skipped": r["tiles_skipped"],
                         "tiles_masked": r["tiles_masked"], "bytes_total": r["bytes_total"],
                         "scores_bytes": iomodel.materialized_scores_elements(n, n, args.batch, args.heads) * 4,
                         "dense_bytes": iomodel.dense_traffic_elements(n, n, d, args.batch, args.heads) * 4,
                         "median_ms": r.get("time", {}).get("median_ms"), "tflops": r.get("tflops"),
                         "gbps": r.get("gbps")})
    _print_sweep(flat)
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
            writer.writeheader()
            writer.writerows(flat)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results, "rows": flat}, fh, indent=1)
    if args.plot:
        from fa_numba import plots

        plots.traffic_vs_n(flat, args.plot)
    if args.tile_map:
        from fa_numba import plots

        n, block_q, block_k = _tile_map_shape([s for s in picked if s.head_dim == head_dims[0]])
        mask, label = _tile_map_mask(args)
        plots.tile_map(tiling.classify(n, n, block_q, block_k, mask=mask), n, n, block_q, block_k, args.tile_map,
                       label=label)
    return 0 if ok else 1


def _tile_map_mask(args) -> tuple[masks.Mask, str]:
    """The mask whose tiles --tile-map draws, and its title: --mask when given, else causal. An unmasked sweep
    (--causal off) still gets the causal map, as before masks existed (its own grid is all FULL and shows
    nothing); the title says that the sweep ran unmasked."""
    if args.mask:
        mask = masks.parse(args.mask)
        return mask, f"mask {mask.describe()}"
    if args.causal == "off":
        return masks.causal(), "causal (for reference: this sweep ran unmasked, every tile FULL)"
    return masks.causal(), "causal"


def _tile_map_shape(swept: list) -> tuple[int, int, int]:
    """The first N of the sweep (with its tiles) with >= 8 query tiles, else the largest: a readable grid."""
    swept = sorted(swept, key=lambda s: s.n_q)
    s = next((s for s in swept if -(-s.n_q // s.block_q) >= 8), swept[-1])
    return s.n_q, s.block_q, s.block_k


def _print_sweep(flat: list[dict]) -> None:
    header = ["N", "d", "causal", "mask", "tile size", "variant", "check", "err O", "tiles", "skipped", "HBM MiB", "S MiB",
              "median ms"]
    table = [header]
    for r in flat:
        check = "-" if r["passed"] is None else ("pass" if r["passed"] else "FAIL")
        table.append([str(r["n"]), str(r["head_dim"]), str(r["causal"]), r["mask"] or "-", r["tile_size"],
                      r["variant"], check,
                      "-" if r["err_out"] is None else f"{r['err_out']:.2e}", str(r["tiles_computed"]),
                      str(r["tiles_skipped"]), f"{r['bytes_total'] / 2**20:.2f}", f"{r['scores_bytes'] / 2**20:.2f}",
                      "-" if r["median_ms"] is None else f"{r['median_ms']:.3f}"])
    print("\n".join(cmp.align(table)))
    print(SCORES_NOTE)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["profile"]:  # its own parser: fa_numba.profile.parser
        from fa_numba import profile

        return profile.main(argv[1:])
    args = parser().parse_args(argv)
    if args.command == "cache":
        return _run_cache(args)
    top = args.usage_of[args.command]  # its .error prints the subcommand's usage line and exits with 2
    if args.heads_kv and args.heads % args.heads_kv:
        top.error(f"argument --heads-kv: {args.heads_kv} must divide --heads ({args.heads})")
    if args.dtype == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
        top.error("argument --dtype: bfloat16 needs ml_dtypes (NumPy has no bfloat16): pip install ml_dtypes")
    figures = [] if args.command == "compare" else [name for name in ("plot", "tile_map") if getattr(args, name)]
    if figures and importlib.util.find_spec("matplotlib") is None:
        top.error(f"argument {_option(figures[0])}: --plot and --tile-map need matplotlib: "
                  "pip install 'fa_numba[plot]'")
    for name in ["json"] if args.command == "compare" else ["csv", "json", "plot", "tile_map"]:
        # before the run: a long sweep must never run and then fail to write
        _check_output(top, _option(name), getattr(args, name), figure=name in figures)
    if args.command == "compare":
        return _run_compare(args, top, _given(argv))
    return _run_sweep(args, top)


def _run_cache(args) -> int:
    from fa_numba.kernels import disk_cache

    root = disk_cache.cache_root()
    if args.clear:
        print(f"removed {disk_cache.clear()} files from {root}")
        return 0
    files, size = disk_cache.size()
    off = disk_cache.why_off()
    print(f"kernel cache: {root} ({files} files, {size / 2**20:.1f} MiB)")
    print(f"this code's folder: {disk_cache.generation()}")
    print("caching: on" if off is None else f"caching: off here ({off})")
    return 0


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_output(top, option: str, path: str | None, figure: bool) -> None:
    """A usage error naming option unless path can be written (fa_numba.arguments.unwritable)."""
    problem = None if path is None else arguments.unwritable(path, figure)
    if problem:
        top.error(f"argument {option}: {problem}")


if __name__ == "__main__":
    sys.exit(main())
