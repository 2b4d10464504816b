"""The GPU architectures the kernels are built for, and a check that each kernel family compiles for each.

Every kernel uses only sm_80 instructions (mma.sync, ldmatrix, cp.async, ex2.approx) and static shared memory
(at most 48 KB a block, which every architecture here grants without opting in), so one source serves
Ampere to Blackwell. What can still differ per architecture is the compiler's register allocation (a spill
on one and not another) and how many blocks an SM holds. `check(cfg, arch)` compiles one configuration
through the launch path (`profile.compile_for_launch`: NVVM, then nvJitLink with LTO, as a launch on that
GPU would) and reads registers, spills and shared memory from the link log; it needs no GPU.

    NUMBA_ENABLE_CUDASIM=0 python -m fa_numba.architectures [--arch sm_80 ...] [--variant v2-mma ...] [--all]
                                                            [--jobs N] [--json PATH]

prints one line per configuration and architecture: registers, spill bytes, shared memory, resident blocks
and warps per SM (the architecture's limits below), and fails (exit 1) on a spill, a link error, shared
memory over the limit or a block that fits no SM. Without `--all` it checks `representatives()`: each kernel family at its largest
shipped head dim (non-causal where that head dim ships so); `--all` checks every family and dtype.

The limits per architecture are the CUDA C++ Programming Guide's "Technical Specifications per Compute
Capability" (the same figures as CCCL's `cuda::arch_traits`): shared memory per SM, resident blocks and
threads per SM; 64K registers per SM and 255 per thread everywhere; 1 KB of each block's shared memory
reserved by the runtime.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

from fa_numba.machine import SM90, Limits

STATIC_SHARED_LIMIT = 48 * 1024  # bytes of static shared memory a block may declare, on every architecture

# name -> (the GPUs, occupancy limits). sm_90a and sm_100a: numba-cuda compiles for the "a" variant on those.
ARCHITECTURES: dict[str, tuple[str, Limits]] = {
    "sm_80": ("A100, A30", replace(SM90, shared_per_sm=164 * 1024)),
    "sm_86": ("A10, A40, RTX 30", replace(SM90, shared_per_sm=100 * 1024, max_blocks_per_sm=16,
                                          max_warps_per_sm=48)),
    "sm_89": ("L4, L40S, RTX 40", replace(SM90, shared_per_sm=100 * 1024, max_blocks_per_sm=24,
                                          max_warps_per_sm=48)),
    "sm_90a": ("H100, H200", SM90),
    "sm_100a": ("B200, GB200", SM90),
    "sm_120": ("RTX 50, RTX PRO 6000 Blackwell", replace(SM90, shared_per_sm=100 * 1024, max_blocks_per_sm=24,
                                                         max_warps_per_sm=48)),
}


def _largest_head_dims(cfgs, dtype_of):
    """Each variant (at the dtype dtype_of gives it; every dtype where that is None) at its largest shipped
    head dim, non-causal where that head dim ships non-causal."""
    best = {}  # (variant, dtype) -> (rank, configuration)
    for cfg in cfgs:
        want = dtype_of(cfg["variant"])
        if want is not None and cfg["dtype"] != want:
            continue
        key, rank = (cfg["variant"], cfg["dtype"]), (cfg["head_dim"], not cfg["causal"])
        if key not in best or rank > best[key][0]:
            best[key] = (rank, cfg)
    return [best[key][1] for key in sorted(best)]


def representatives() -> list[dict]:
    """Each kernel family once, at its largest shipped head dim: the tensor-core ones at float16
    (their 16-bit path; the 3xTF32 path compiles for a minute or more and is checked by `--all`), the
    CUDA-core ones at float32."""
    from fa_numba import profile, whole_kernel

    mma = set(whole_kernel.MMA_KERNELS) | set(whole_kernel.MMA_BACKWARD)
    return _largest_head_dims(profile.configurations(), lambda v: "float16" if v in mma else "float32")


def every_family_and_dtype() -> list[dict]:
    """Every shipped kernel family and dtype at its largest head dim."""
    from fa_numba import profile

    return _largest_head_dims(profile.configurations(), lambda v: None)


def check(cfg: dict, arch: str) -> dict:
    """Compile one configuration for one architecture; its resources, occupancy and what is wrong (`problems`,
    empty when it builds without a spill and within the shared-memory limits)."""
    from fa_numba import profile

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    limits = ARCHITECTURES[arch][1]
    built = profile._build(cfg)
    _, block = built.launch_shape(1, 1, 128)
    threads = math.prod(block)
    start = time.perf_counter()
    try:
        _, log, _ = profile.compile_for_launch(built.source, built.argtypes(cfg["dtype"]), arch,
                                               getattr(built, "max_registers", None))
    except RuntimeError as err:
        return {"config": cfg, "arch": arch, "problems": [f"does not build: {err}"]}
    res = profile.parse_ptxas(log)
    occ = profile.occupancy(threads, res["registers"] or 0, res["smem"], limits)
    problems = []
    if res["spill_stores"] or res["spill_loads"]:
        problems.append(f"spills {res['spill_stores']} / {res['spill_loads']} bytes (stores / loads)")
    if res["smem"] > STATIC_SHARED_LIMIT:
        problems.append(f"{res['smem']} bytes of static shared memory, over {STATIC_SHARED_LIMIT}")
    if occ["blocks_per_sm"] < 1:
        problems.append(f"no block fits an SM ({occ['limiter']})")
    return {"config": cfg, "arch": arch, **res, "threads": threads, "blocks_per_sm": occ["blocks_per_sm"],
            "warps_per_sm": occ["warps_per_sm"], "limiter": occ["limiter"],
            "seconds": round(time.perf_counter() - start, 1), "problems": problems}


def check_all(pairs, jobs: int = 1) -> list[dict]:
    """check() of every (configuration, architecture) pair, `jobs` processes at a time, each line printed as its
    build ends; the results in the order of `pairs`."""
    if jobs <= 1:
        results = []
        for cfg, arch in pairs:
            results.append(check(cfg, arch))
            print(line(results[-1]), flush=True)
        return results
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(jobs) as pool:
        futures = {pool.submit(check, cfg, arch): index for index, (cfg, arch) in enumerate(pairs)}
        results = [None] * len(pairs)
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            print(line(results[futures[future]]), flush=True)
    return results


def line(result: dict) -> str:
    cfg = result["config"]
    head = f"{result['arch']:8s} {cfg['variant']:15s} {cfg['dtype']:8s} d={cfg['head_dim']:3d}"
    if "registers" not in result:
        return f"{head}  {'; '.join(result['problems'])}"
    spills = result["spill_stores"] + result["spill_loads"]
    verdict = "; ".join(result["problems"]) or "ok"
    return (f"{head} {result['registers']:4d} regs {spills:4d} B spilled {result['smem']:6d} B smem "
            f"{result['blocks_per_sm']:2d} blocks / {result['warps_per_sm']:2d} warps per SM "
            f"({result['limiter']})  {verdict}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa_numba.architectures", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", action="append", choices=list(ARCHITECTURES),
                        help="an architecture to check (repeat it; default: every one)")
    parser.add_argument("--all", action="store_true", help="every kernel family and dtype, not one dtype each")
    parser.add_argument("--variant", action="append", metavar="NAME",
                        help="only this kernel family (repeat it; default: every one)")
    parser.add_argument("--json", metavar="PATH", help="write every result to PATH")
    parser.add_argument("--jobs", type=int, default=1, help="builds at a time, each in its own process")
    args = parser.parse_args(argv)
    from fa_numba import backend

    if backend.name() == "simulator":
        parser.error("compiling for a GPU needs the real numba.cuda: run with NUMBA_ENABLE_CUDASIM=0")
    cfgs = every_family_and_dtype() if args.all else representatives()
    if args.variant:
        unknown = sorted(set(args.variant) - {cfg["variant"] for cfg in cfgs})
        if unknown:
            parser.error(f"argument --variant: {', '.join(unknown)} is not a shipped kernel family (one of "
                         f"{', '.join(sorted({cfg['variant'] for cfg in cfgs}))})")
        cfgs = [cfg for cfg in cfgs if cfg["variant"] in args.variant]
    arches = args.arch or list(ARCHITECTURES)
    pairs = [(cfg, arch) for arch in arches for cfg in cfgs]
    results = check_all(pairs, args.jobs)
    failed = sum(bool(result["problems"]) for result in results)
    print(f"{len(results)} builds, {failed} with a problem", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"architectures": {a: ARCHITECTURES[a][0] for a in arches}, "results": results}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
