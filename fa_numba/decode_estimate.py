"""The whole-kernel estimate of split-KV decoding on an H200, read from the SASS, never a measurement:

    python -m fa_numba.decode_estimate [--engine simt,mma] [--batch 1,8] [--n-k 32768,131072] [--heads 32]
                                       [--heads-kv 8] [--d 128]

For each engine's split kernel (simt: kernels/decode.py, the CUDA-core one; mma: kernels/mma/decode.py, the
tensor-core one with its two-stage cp.async pipeline) and each shape, split by the heuristic and unsplit (one
split), this module

1. compiles the split kernel's FULL-tile code (`split_source(partial_tiles=False)`: a request's PARTIAL tiles
   are at most its first and last) for sm_90a as `fa_numba.profile` compiles the registry's kernels, and counts
   what one iteration of its loop over key tiles issues (`whole_kernel.iteration_counts`, or for the tensor-core
   kernel `mma_iteration_counts` with its staging loops' trips: the same rules, the products anchored at 2 per
   iteration), its dependent round trips and its pipelined waits;
2. takes the shared-memory wavefronts of one iteration from the registry kernel of the same tiles, traced in
   the simulator (`profile_estimate`): v2 on the CUDA cores, v2-mma on the tensor cores, whose tile loop is
   the split kernel's (the same device functions; the tensor-core one stages by the same cp.async copies), which
   the SASS's shared-memory instruction count checks (`agree`);
3. prices it with `cycle_model.estimate`: blocks (query tiles x splits x requests x K/V heads), the mean
   tile-loop iterations per block (one more for the tensor-core kernel: its pipeline's fill, the first tile and
   Q waited for before the loop, which the loop's cycles leave out), and the split kernel's HBM bytes from
   `iomodel.traffic_decode`;
4. adds the combine kernel at the HBM bound only (its bytes / 4.8 TB/s: it reads the partials once and does
   a few flops per byte; its launch and latency are not modelled, so the total is optimistic there).

The figure of merit is the share of HBM bandwidth: all bytes both kernels move / estimated time / 4.8 TB/s.
Assumption to calibrate first on a GPU: the latency term charges every wait an L2 round trip
(`Device.l2_latency_cycles`); decoding streams K and V from HBM, whose loads wait longer, so every row is
printed again with twice that latency (`--latency-factor`).
"""

from __future__ import annotations

import argparse
import json
import sys

from fa_numba import iomodel, split_kv, whole_kernel
from fa_numba.cycle_model import IterationCost, Launch, estimate
from fa_numba.machine import H200, SM90

ISSUE_SHAPES = dict(batch=(1, 8), n_k=(32768, 131072), heads=32, heads_kv=8, d=128, n_q=1, dtype="float16")


ENGINES = ("simt", "mma")


def argtypes(dtype: str):
    """Numba types of the CUDA-core split kernel's arguments (kernels.decode.split_source)."""
    from numba import types

    inp = types.Array(getattr(types, "uint16" if dtype == "bfloat16" else dtype), 4, "C")
    return (inp, inp, inp, types.Array(types.float32, 4, "C"), types.Array(types.float32, 3, "C"), types.float32,
            types.Array(types.int32, 1, "C"), types.Array(types.int32, 2, "C"), types.Array(types.int32, 3, "C"),
            types.int64)


def compiled_counts(rows: int, d: int, dtype: str, engine: str = "simt") -> dict:
    """Compile `engine`'s split kernel at the decode tiles of R rows and d; its profile, iteration counts and
    the wavefronts of one iteration."""
    from fa_numba import profile, profile_estimate

    if engine == "mma":
        from fa_numba.kernels.mma import decode as mma_decode

        layout = mma_decode.decode_split(dtype, rows, d)
        cfg = dict(variant="decode-mma", block_q=layout.block_q, block_k=layout.block_k, head_dim=d, dtype=dtype,
                   causal=False)
        traced_cfg = dict(cfg, variant="v2-mma")
        source, types = mma_decode.split_source(layout, partial_tiles=False), mma_decode.argtypes()
    else:
        from fa_numba.kernels import decode

        layout = decode.decode_layout(rows, d)
        cfg = dict(variant="decode", block_q=layout.block_q, block_k=layout.block_k, head_dim=d, dtype=dtype,
                   causal=False)
        traced_cfg = dict(cfg, variant="v2", micro=[layout.tm, layout.tn])
        source, types = decode.split_source(layout, partial_tiles=False), argtypes(dtype)
    started = profile_estimate.start_wavefronts([traced_cfg])
    prof = profile.profile_kernel(source, types, layout.threads, name=cfg["variant"])
    if engine == "mma":
        dp = layout.engine.padded_dim
        copies = -(-layout.block_k * dp // 8 // layout.threads)  # 16-byte copies per thread per staged tile
        counts = whole_kernel.mma_iteration_counts(prof.sass, dict(cfg, variant="v2-mma"), dp, copies=copies)
    else:
        counts = whole_kernel.iteration_counts(prof.sass, cfg, layout.threads, layout.d_pad)
    traced = profile_estimate.finish_wavefronts(started)[json.dumps(
        profile_estimate._traced_config(traced_cfg), sort_keys=True)]
    warps = -(-layout.threads // SM90.warp_size)
    in_sass = sum(counts["shared_accesses"].values()) * warps
    agree = abs(in_sass - traced["total"]["accesses"]) <= profile_estimate.WIDTH_AGREEMENT * in_sass
    return dict(cfg=cfg, engine=engine, layout=layout, occupancy=prof.occupancy, registers=prof.registers,
                counts=counts, wavefronts=traced["total"]["wavefronts"], agree=agree, spill=prof.spills)


def estimate_shape(compiled: dict, batch: int, n_k: int, heads: int, heads_kv: int, n_q: int, splits: int | None,
                   latency_factor: float = 1.0) -> dict:
    """The estimate of one call (splits=None: the heuristic's count; 1: unsplit)."""
    from fa_numba.kernels import decode

    cfg, layout, counts = compiled["cfg"], compiled["layout"], compiled["counts"]
    block_q, block_k, d = cfg["block_q"], cfg["block_k"], cfg["head_dim"]
    rows = n_q * heads // heads_kv
    query_tiles = -(-rows // block_q)
    key_tiles = -(-n_k // block_k)
    slots = H200.sms * compiled["occupancy"]["blocks_per_sm"]  # the API counts shared memory only (block_slots)
    count = splits or split_kv.heuristic_splits(batch * heads_kv * query_tiles, key_tiles, slots, decode.MAX_SPLITS)
    tiles = -(-key_tiles // count)
    count = -(-key_tiles // tiles)
    blocks = query_tiles * count * batch * heads_kv
    ledger = iomodel.traffic_decode([n_k] * batch, n_q, d, block_q, block_k, tiles, count, True, heads, heads_kv)
    sizes = iomodel.to_bytes(ledger, 2 if cfg["dtype"] in ("float16", "bfloat16") else 4)
    split_bytes = sum(sizes["read"][t] for t in ("Q", "K", "V")) + sizes["write"]["O_split"] + sizes["write"][
        "LSE_split"]
    combine_bytes = sizes["read"]["O_split"] + sizes["read"]["LSE_split"] + sizes["write"]["O"] + sizes["write"]["LSE"]
    warps = -(-layout.threads // SM90.warp_size)
    iterations = key_tiles * query_tiles * batch * heads_kv / blocks
    pipelined = compiled.get("engine") == "mma"
    if pipelined:
        iterations += 1  # the pipeline's fill: tile `start` and Q, waited for before the loop (module docstring)
    flops = 4 * batch * heads * n_q * n_k * d
    tensor = counts.get("hmma", 0.0) * warps * H200.mma_cycles(whole_kernel.MMA_SHAPE[cfg["dtype"]]) \
        if pipelined else 0.0
    cost = IterationCost(warp_instructions=counts["instructions"] * warps, mufu=counts["mufu"] * warps,
                         wavefronts=compiled["wavefronts"],
                         load_round_trips=counts["load_round_trips"] * latency_factor,
                         flops=flops / (iterations * blocks), tensor_cycles=tensor,
                         pipelined_waits=counts.get("pipelined_waits", 0.0) * latency_factor)
    run = Launch(blocks=blocks, warps_per_block=warps, blocks_per_sm=compiled["occupancy"]["blocks_per_sm"],
                 iterations_per_block=iterations, hbm_bytes=split_bytes)
    found = estimate(cost, run, H200)
    seconds = found.seconds + combine_bytes / H200.hbm_bytes_per_s
    moved = split_bytes + combine_bytes
    return dict(batch=batch, n_k=n_k, splits=count, blocks=blocks, seconds=seconds, split_seconds=found.seconds,
                limiter=found.limiter, bytes=moved, hbm_fraction=moved / seconds / H200.hbm_bytes_per_s,
                cycles={k: round(v, 1) for k, v in found.cycles.items()}, resident=found.resident, waves=found.waves)


def render(compiled: dict, rows: list[dict]) -> str:
    c = compiled["counts"]
    lines = [f"{compiled['engine']} split kernel: B_r x B_c = {compiled['cfg']['block_q']} x "
             f"{compiled['cfg']['block_k']}, d = "
             f"{compiled['cfg']['head_dim']}, {compiled['cfg']['dtype']}, {compiled['layout'].threads} threads, "
             f"{compiled['registers']} registers, {compiled['occupancy']['blocks_per_sm']} blocks/SM "
             f"({compiled['occupancy']['limiter']}); per iteration per thread: {c['instructions']:.0f} instructions, "
             + (f"{c['hmma']:.0f} HMMA" if compiled["engine"] == "mma" else f"{c['ffma']:.0f} FFMA")
             + f" ({c['products']:.2f} products), {c['load_round_trips']:.0f} load round trips, "
             f"{c.get('pipelined_waits', 0):.0f} pipelined waits; "
             f"{compiled['wavefronts']:.0f} wavefronts per block (SASS and trace agree: {compiled['agree']})"
             + (f"; unattributed loops {c['unattributed']}" if c["unattributed"] else ""),
             "", "cycles: per tile-loop iteration of the resident blocks of one SM, each term's (the model's queueing "
             "network combines them, fa_numba.cycle_model; hbm: the split kernel's bytes at 4.8 TB/s spread over "
             "the iterations)",
             f"{'B':>3} {'N_k':>7} {'splits':>6} {'blocks':>6} {'time (us)':>10} {'HBM share':>9} {'limiter':<8} "
             f"{'issue':>7} {'shared':>7} {'latency':>7} {'hbm':>7}  latency charged"]
    for r in rows:
        c = r["cycles"]
        lines.append(f"{r['batch']:>3} {r['n_k']:>7} {r['splits']:>6} {r['blocks']:>6} {r['seconds'] * 1e6:>10.1f} "
                     f"{r['hbm_fraction']:>9.0%} {r['limiter']:<8} {c['issue']:>7.0f} {c['shared']:>7.0f} "
                     f"{c['latency']:>7.0f} {c['hbm']:>7.0f}  x{r['latency_factor']:g} of L2's")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fa_numba.decode_estimate", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="simt,mma", help="the split kernels to estimate (simt, mma)")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--n-k", default="32768,131072")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dtype", default="float16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--latency-factor", type=float, default=2.0, help="the second latency the rows are priced at")
    args = p.parse_args(argv)
    from fa_numba import backend

    if backend.name() == "simulator":
        print("the estimate compiles for sm_90a and needs the real numba.cuda: run with NUMBA_ENABLE_CUDASIM=0 "
              "(no GPU needed)", file=sys.stderr)
        return 2
    engines = args.engine.split(",")
    if not engines or any(e not in ENGINES for e in engines):
        print(f"--engine must be a comma-separated list of {ENGINES}, got {args.engine!r}", file=sys.stderr)
        return 2
    for n, engine in enumerate(engines):
        try:
            compiled = compiled_counts(args.heads // args.heads_kv, args.d, args.dtype, engine)
        except ValueError as error:  # a dtype or head dim the engine's kernel does not take
            print(f"{engine}: {error}", file=sys.stderr)
            return 2
        rows = []
        for batch in (int(x) for x in args.batch.split(",")):
            for n_k in (int(x) for x in args.n_k.split(",")):
                for splits in (None, 1):
                    for factor in (1.0, args.latency_factor):
                        row = estimate_shape(compiled, batch, n_k, args.heads, args.heads_kv, 1, splits, factor)
                        rows.append({**row, "latency_factor": factor})
        print(("\n" if n else "") + render(compiled, rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
