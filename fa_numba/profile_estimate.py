"""The whole-kernel estimate's plumbing for `fa_numba.profile`: the shared-memory wavefronts of one tile-loop
iteration, traced in a simulator process (`kernels.smem_costs`) and cached per version of the code that
decides them, and the estimate attached to each compiled profile (`whole_kernel.estimate_configuration`).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from fa_numba import sources, whole_kernel
from fa_numba.machine import H200, SM90


def _traced_config(cfg: dict) -> dict:
    """The configuration whose wavefronts stand for cfg's: FULL tiles run the non-causal kernel's code."""
    micro = {"micro": list(cfg["micro"])} if cfg.get("micro") else {}  # a layout of its own (decode_estimate)
    own = {"value_dim": cfg["value_dim"]} if cfg.get("value_dim") else {}  # V's head dim: other tiles, accesses
    return ({k: cfg[k] for k in ("variant", "block_q", "block_k", "head_dim", "dtype")} | {"causal": False} | micro
            | own)


def wavefront_cache() -> pathlib.Path:
    """Where traced wavefronts are kept between runs: one file per version of the code that decides them (the
    kernels, mma/ included, the tracer, the warp emulation, the bank rule and every package module they
    import: `sources.closure`), so an edit to any of them traces again."""
    key = sources.digest(sources.closure(("fa_numba.kernels", "fa_numba.warp", "fa_numba.banks")))
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return root / "fa_numba" / f"wavefronts-{key}.json"


def start_wavefronts(configs: list[dict], jobs: int = 1):
    """Start kernels.smem_costs in simulator processes on the distinct traced configurations the cache lacks
    (tracing one block takes 20 s to 15 minutes of CPU, in one thread): up to `jobs` processes, the
    configurations dealt among them; returns (cached results, the processes)."""
    unique = {json.dumps(_traced_config(c), sort_keys=True): _traced_config(c) for c in configs}
    cache = wavefront_cache()
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    missing = [cfg for key, cfg in unique.items() if key not in known]
    if not missing:
        return known, []
    print(f"shared-memory wavefronts: tracing {len(missing)} kernels in the CUDA simulator (cached in {cache}) ...",
          file=sys.stderr, flush=True)
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    count = max(1, min(jobs, len(missing)))
    command = [sys.executable, "-m", "fa_numba.kernels.smem_costs"]
    return known, [subprocess.Popen([*command, json.dumps(missing[i::count])], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for i in range(count)]


def finish_wavefronts(started) -> dict:
    known, procs = started
    if not procs:
        return known
    done = [(proc, *proc.communicate()) for proc in procs]  # every process ends before any result is read
    for proc, out, err in done:
        if proc.returncode:
            raise RuntimeError(f"tracing shared memory in the simulator failed: {err[-2000:]}")
        known = {**known, **json.loads(out)}
    cache = wavefront_cache()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known))
    except OSError as err:  # an unwritable cache costs the next run time, never this one its result
        print(f"warning: wavefront cache not written ({err})", file=sys.stderr)
    return known


# The tracer's warp accesses per iteration (its "merged" widths: adjacent elements as LDS.64 / LDS.128) must
# be the SASS's LDS + STS per iteration times the warps, or the tracer priced other accesses than the
# compiler made (it merged what ptxas left scalar, or the reverse): the table then marks the estimate "?".
WIDTH_AGREEMENT = 0.05


def _full_tile_counts(profiles: list) -> dict:
    """{(variant, d, dtype, tiles, strided, mod): counts} of the non-causal tensor-core builds in this run whose
    counts price one iteration (no loop without a trip-count rule): what `attach_estimates` prices a causal
    build's iterations with."""
    found = {}
    for prof in profiles:
        c = prof.config
        if c["variant"] in whole_kernel.MMA_KERNELS and not c["causal"] and _prices_an_iteration(c, prof.counts):
            found[_sibling_key(c)] = prof.counts
    return found


def _prices_an_iteration(c: dict, counts: dict) -> bool:
    """Whether a tensor-core build's counts price one iteration: no loop without a trip-count rule inside the
    tile loop, and the products the kernel does (`whole_kernel.estimate_configuration`'s two checks)."""
    return ("error" not in counts and not counts.get("unattributed") and "products" in counts
            and abs(counts["products"] - whole_kernel.expected_products(c, counts.get("value_ratio", 1.0))) < 1e-9)


def _sibling_key(c: dict) -> tuple:
    return (c["variant"], c["head_dim"], c["dtype"], c["block_q"], c["block_k"], bool(c.get("strided")),
            c.get("score_mod"), c.get("value_dim") or 0)


def attach_estimates(profiles: list, wavefronts: dict, launch: dict) -> None:
    """Fill each profile's `estimate` from its counts and the traced wavefronts of one iteration.

    A causal tensor-core build carries its PARTIAL tiles' code (the masking and the exact path for non-finite
    values, whose loops have no trip-count rule), so its own counts price no iteration. Its FULL tiles, all
    but about one per row of query tiles, run the non-causal build's code, so where that build is in the same
    run its counts stand for every iteration (a PARTIAL tile's extra masking is not counted: an
    underestimate of about 1/(visited tiles per row) of the issue; the estimate says "counts_from"), while the
    occupancy is the causal build's own (its registers) and the iterations, flops and traffic the causal
    launch's."""
    siblings = _full_tile_counts(profiles)
    for prof in profiles:
        keys = ("variant", "block_q", "block_k", "head_dim", "dtype", "causal") + (
            ("value_dim",) if prof.config.get("value_dim") else ()) + (  # V's head dim, where it has one of its own
            ("micro",) if prof.config.get("micro") else ())  # a micro-tile of its own: traced at that layout
        cfg = {k: prof.config[k] for k in keys}
        traced = wavefronts.get(json.dumps(_traced_config(cfg), sort_keys=True))
        if "error" in prof.counts or traced is None:
            prof.estimate = {"withheld": prof.counts.get("error", "no wavefronts traced")}
            continue
        counts, borrowed = prof.counts, {}
        sibling = siblings.get(_sibling_key(prof.config)) if cfg["causal"] else None
        if sibling is not None and not _prices_an_iteration(prof.config, counts):
            counts = sibling
            borrowed = {"counts_from": "the non-causal build's FULL-tile iteration (PARTIAL tiles priced as FULL)"}
        grid, block = prof.config["launch"]["grid"], prof.config["launch"]["block"]
        found, details = whole_kernel.estimate_configuration(cfg, counts, prof.occupancy, tuple(grid),
                                                             tuple(block), traced["total"]["wavefronts"], launch)
        details = {**details, **borrowed}
        warps = -(-prof.threads // SM90.warp_size)
        in_sass = sum(counts["shared_accesses"].values()) * warps
        agree = abs(in_sass - traced["total"]["accesses"]) <= WIDTH_AGREEMENT * in_sass
        check = {"shared_accesses": {"sass": in_sass, "traced": traced["total"]["accesses"], "agree": agree}}
        peak = H200.peak_tensor_tflops if cfg["variant"] in whole_kernel.MMA_KERNELS else H200.peak_fp32_tflops
        prof.estimate = {**details, **check} if found is None else {
            **found.as_dict(), **details, **check, "fraction_of_peak": found.tflops / peak}
