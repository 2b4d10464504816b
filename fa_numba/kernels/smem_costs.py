"""The shared-memory wavefronts one iteration of a kernel's tile loop costs one block, measured in the simulator.

    per_iteration(cfg, widths="merged") -> {"total": {accesses, wavefronts, ideal, degree}, "regions", "rows", ...}
    python -m fa_numba.kernels.smem_costs '<json list of cfgs>' [--widths merged|scalar|both]

cfg is a dict as `fa_numba.profile.configurations()` yields (variant, block_q, block_k, head_dim, dtype,
causal). The tile loop is the loop over key tiles in v2, v2-rowwise and backward q (bwd-q, bwd-q-dq), over
query tiles in v1, v1-rowwise and backward kv (bwd-kv, bwd-kv-det). One block (batch = heads = 1, one tile
along the other axis) is launched under `smem_trace.trace_shared` with 1 and with 2 tiles along the loop's
axis, on random finite inputs (float16 inputs for a float16 cfg, float32 otherwise); the cost of one
iteration is report(2 tiles) - report(1 tile), per row (region or site, kind, width in bytes) and in total:
warp accesses, wavefronts, and the wavefronts without a conflict (ideal). Everything outside the loop (Q_i
or K_j, V_j loaded once, the final row sums, ...) is the same in both launches and cancels. The tiles are
FULL (no mask, no ragged edge): a causal cfg is measured on its non-causal kernel, since a FULL tile runs
the same code in both (the causal kernel differs only in PARTIAL tiles, its mask and guarded products, and
in which tiles it visits). `difference_is_per_iteration` checks the premise: 3 tiles - 2 == 2 - 1.

Regions. The engine kernels (v1, v2) and the backward kernels keep one flat float32 shared array, so the
tracer sees one site; each access is attributed to the region of the layout it touches (element offset =
byte offset // 4 against `layout.Layout.offsets`: Q^T, K^T, V, P^T, red, stat; `backward.BackwardConfig.offsets`:
Q, dO, K, V, P, dS, sigma(LSE), D). Where the engine aliases (P^T, red, stat inside the operand the order no
longer needs: K^T in v2, Q^T in v1, at d >= 128) an offset alone is ambiguous; the function making the access
decides: the tile loaders and `scores` touch Q^T, K^T, V, every other function P^T, red, stat (and V). The
rowwise kernels keep their sites (k_tile, v_tile). The label goes into the site of each logged access (the
trace's `record` is wrapped for the launch), so a row's name is "region@site" ("K^T@smem@engine_v2.py:72")
and an access spanning two regions, or lanes of one access in two, would be a DivergenceError, not a guess.

Divergence. The tracer pairs the k-th access of every lane of a warp and refuses (DivergenceError) where
lanes disagree on (site, kind). With the regions as sites, v1 does: its `if tx == 0` stores of m_i, l_i into
stat, which only some lanes make, before every lane's red stores (on the one undivided site the tracer would
have paired them silently). Then `report_per_site` prices each region on its own, pairing the k-th access to
that region (a branch confined to one region is then the separate warp access with fewer lanes it is), and
the result says so under "divergence". Where no warp diverges, both pairings agree (tested).

Launching. Forward kernels are called as every caller does (kernel(q, k, v, o, lse, scale)). The backward's
main kernel (kv for bwd-kv / bwd-kv-det, q for bwd-q / bwd-q-dq) is launched alone under the trace, on what
the launches before it in `backward.run` leave (they have no shared memory and no tile loop): D = rowsum(dO
o O), preprocess's result, computed in NumPy instead (its 128-thread launch costs the simulator more than the
kernel traced), and zeroed dQ (bwd-kv) or dK, dV (bwd-q). O and LSE come from a float64 reference forward.

Limits: what the tracer models and misses (smem_trace's docstring: merged widths model the LDS.64/128 that
ptxas may or may not make; the bank rule itself is uncalibrated); one block of a full tile only (a ragged or
masked tile costs other wavefronts); simulator only (NUMBA_ENABLE_CUDASIM=1). Time grows with the traced
accesses (threads x tile work, three tiles' worth): about a second for a one-warp tile, 10 s to 2.5 minutes
for a shipped configuration (each result carries its "seconds").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from fa_numba import backend, banks
from fa_numba.kernels import smem_trace

ENGINE_VARIANTS = ("v1", "v2")
ROWWISE_VARIANTS = ("v1-rowwise", "v2-rowwise")
MMA_VARIANTS = ("v1-mma", "v2-mma", "bwd-kv-mma", "bwd-kv-mma-det", "bwd-dq-mma")  # tensor-core kernels: each
# operand staged in an array of its own (their sites)
# the axis of the tile loop: "k" (key tiles: N_k grows) or "q" (query tiles: N_q grows)
LOOP_AXIS = {"v2": "k", "v2-rowwise": "k", "bwd-q": "k", "bwd-q-dq": "k",
             "v1": "q", "v1-rowwise": "q", "bwd-kv": "q", "bwd-kv-det": "q", "v2-mma": "k", "v1-mma": "q",
             "bwd-kv-mma": "q", "bwd-kv-mma-det": "q", "bwd-dq-mma": "k"}
ENGINE_REGIONS = {"q": "Q^T", "k": "K^T", "v": "V", "p": "P^T", "red": "red", "stat": "stat"}
BACKWARD_REGIONS = {"q": "Q", "do": "dO", "k": "K", "v": "V", "p": "P", "ds": "dS", "lse": "sigma(LSE)", "dd": "D"}
_BACKWARD_KINDS = {"bwd-kv": "kv", "bwd-kv-det": "kv", "bwd-q-dq": "q", "bwd-q": "q",  # the main kernel's kind
                   "bwd-kv-mma": "kv", "bwd-kv-mma-det": "kv", "bwd-dq-mma": "q"}
OPERANDS = ("q", "k", "v")  # the engine regions its loaders and `scores` touch
OPERAND_FUNCTIONS = ("put", "scores")  # tile_loads.tile_loader's `put` (the stores of Q^T, K^T, V) and engine.scores
CAUSAL_NOTE = ("causal cfg measured on its non-causal kernel: a FULL tile runs the same code (the causal kernel "
               "differs only in PARTIAL tiles and in the tiles it visits)")
SEED = 0
TRACE_SWITCH_SECONDS = (2e-3, 1e-2)  # sys.setswitchinterval for traced blocks of <= 32 threads, and wider (measured)
_TRACER_FILE = smem_trace.__file__


def _require_simulator() -> None:
    if backend.name() != "simulator":
        raise RuntimeError("smem_costs traces shared memory in the CUDA simulator: set NUMBA_ENABLE_CUDASIM=1 "
                           "before numba is imported (or run `python -m fa_numba.kernels.smem_costs`, which does)")


def _build(cfg: dict):
    from fa_numba import profile

    return profile._build({**cfg, "causal": False})  # FULL tiles: the non-causal kernel's code (CAUSAL_NOTE)


def _sizes(cfg: dict, tiles: int) -> tuple[int, int]:
    """(N_q, N_k) of one block whose tile loop runs `tiles` iterations."""
    if cfg["variant"] not in LOOP_AXIS:
        raise ValueError(f"unknown variant {cfg['variant']!r}: one of {sorted(LOOP_AXIS)}")
    n_q, n_k = cfg["block_q"], cfg["block_k"]
    return (n_q, tiles * n_k) if LOOP_AXIS[cfg["variant"]] == "k" else (tiles * n_q, n_k)


def _inputs(cfg: dict, n_q: int, n_k: int):
    """Random finite q, k, v (B = H = 1) in the cfg's dtype (float16 stays float16, anything else float32; the
    tensor-core kernels take the bits of float16 or bfloat16 values as uint16)."""
    rng = np.random.default_rng(SEED)
    dtype = np.float16 if cfg.get("dtype") == "float16" else np.float32
    d = cfg["head_dim"]
    widths = (d, d, cfg.get("value_dim") or d)  # v with V's head dim d_v where the cfg has one
    drawn = tuple(rng.standard_normal((1, 1, n, w)).astype(dtype) for n, w in zip((n_q, n_k, n_k), widths))
    if cfg["variant"] in MMA_VARIANTS and cfg.get("dtype") not in ("float32", "tf32"):  # bfloat16: top 16 bits
        drawn = tuple(x.view(np.uint16) if cfg["dtype"] == "float16" else
                      (x.view(np.uint32) >> 16).astype(np.uint16) for x in drawn)
    return drawn, 1.0 / math.sqrt(d)


def _region_owner(offsets: dict, sizes: dict, names: dict) -> tuple[list, list]:
    """(owner in operand functions, owner elsewhere): per float element of the flat array, its region's name."""
    total = offsets["_total"]
    owners = ([None] * total, [None] * total)
    for region, size in sizes.items():
        start = offsets[region]
        for cls, owner in enumerate(owners):  # 0: operand functions, 1: the others
            wanted = (region in OPERANDS) if cls == 0 else (region not in OPERANDS or region == "v")
            for e in range(start, start + size):
                if owner[e] is None or wanted:
                    owner[e] = names[region]
    return owners


def _labelled(trace, owners, by_function: bool):
    """Replace trace.record (the one entry point of the tracer's logs) with one that prefixes each access's
    site with the region it touches; by_function: the caller's function decides between aliased regions."""
    record = trace.record

    def labelled(entry):
        if entry is smem_trace.BARRIER:
            return record(entry)
        site, kind, offset, itemsize = entry
        cls = 1
        if by_function:
            frame = sys._getframe(1)
            while frame.f_code.co_filename == _TRACER_FILE:  # up to the kernel code making the access
                frame = frame.f_back
            cls = 0 if frame.f_code.co_name in OPERAND_FUNCTIONS else 1
        element = offset // 4
        owner = owners[cls]
        if element >= len(owner) or owner[element] is None:
            raise ValueError(f"shared access at element {element} of {site} is outside every region of the layout")
        return record((f"{owner[element]}@{site}", kind, offset, itemsize))

    trace.record = labelled


def _regions(cfg: dict, built):
    """(owners, by_function) for a flat-array kernel, None for the rowwise ones (their sites are their arrays)."""
    variant = cfg["variant"]
    if variant in ENGINE_VARIANTS:
        layout = built.config.layout
        return _region_owner(layout.offsets, layout._sizes(), ENGINE_REGIONS), layout.aliased
    if variant in ROWWISE_VARIANTS or variant in MMA_VARIANTS:
        return None
    config = built.config
    offsets = config.offsets
    sizes = {name: (offsets[nxt] if nxt else offsets["_total"]) - offsets[name]
             for name, nxt in zip(BACKWARD_REGIONS, list(BACKWARD_REGIONS)[1:] + [None])}
    return _region_owner(offsets, sizes, BACKWARD_REGIONS), False


def traced(cfg: dict, tiles: int, built=None):
    """The SharedTrace of one block of cfg whose tile loop runs `tiles` FULL iterations (launch under trace)."""
    _require_simulator()
    from numba import cuda

    built = built or _build(cfg)
    n_q, n_k = _sizes(cfg, tiles)
    (q, k, v), scale = _inputs(cfg, n_q, n_k)
    regions = _regions(cfg, built)
    rows = n_k if _BACKWARD_KINDS.get(cfg["variant"]) == "kv" else n_q
    with _fast_simulator(math.prod(built.launch_shape(1, 1, rows)[1])):
        if cfg["variant"] in _BACKWARD_KINDS:
            return _traced_backward(cfg, built, q, k, v, scale, regions)
        args = [cuda.to_device(x) for x in (q, k, v)]
        o = cuda.to_device(np.zeros((1, 1, n_q, v.shape[3]), np.float32))  # O has V's head dim
        lse = cuda.to_device(np.zeros((1, 1, n_q), np.float32))
        with smem_trace.trace_shared() as trace:
            if regions:
                _labelled(trace, *regions)
            built(*args, o, lse, scale)
        return trace


@contextlib.contextmanager
def _fast_simulator(threads: int):
    """Around a traced launch of blocks of `threads`: the simulator tuned for tracing, restored after; holds
    the launch lock (backend.serialised) so that no other launch runs meanwhile.

    - The interpreter's switch interval. The simulator runs a CUDA thread per Python thread and the tracer
      adds Python work to every shared access, so forced switches between them dominate: measured on 2
      cores (2026-12-01, one launch of one tile), 1e-2 s ran 64- and 256-thread blocks 2-8x faster than
      1e-4 s (v2-rowwise d = 64: 16 s -> 3 s; v2 d = 64: 19 s -> 4 s; bwd-kv d = 64: 10 s -> 2.3 s),
      while a one-warp block ran fastest at 2e-3 s (0.27 s against 0.47 s at 1e-2 s).
    - An atomic add without backend.patch_simulator's lock (the same one read and one write of the element,
      so a shared-memory atomic is traced alike). With the lock, a thread switched out while holding it
      stalls every thread behind it for whole switch intervals: bwd-q at d = 128 took 2-12 s per tile,
      erratically, against 1.7-2 s without. The atomics of these kernels add into dQ, dK, dV in global
      memory, which nobody reads here: an update lost to a switch changes no shared-memory access."""
    from numba.cuda.simulator import kernelapi

    def atomic_add(self, array, index, val):
        old = array[index]
        array[index] = old + val
        return old

    with backend.serialised():
        before, locked = sys.getswitchinterval(), kernelapi.FakeCUDAAtomic.add
        sys.setswitchinterval(TRACE_SWITCH_SECONDS[0] if threads <= banks.WARP else TRACE_SWITCH_SECONDS[1])
        kernelapi.FakeCUDAAtomic.add = atomic_add
        try:
            yield
        finally:
            kernelapi.FakeCUDAAtomic.add = locked
            sys.setswitchinterval(before)


def _traced_backward(cfg, built, q, k, v, scale, regions):
    from numba import cuda

    from fa_numba.kernels.block_lists import mask_arrays
    from fa_numba.kernels.score_mod import NO_CAPTURED

    d, d_v = cfg["head_dim"], v.shape[3]
    n_q, n_k = q.shape[2], k.shape[2]
    rng = np.random.default_rng(SEED + 1)
    dout = rng.standard_normal(q.shape[:3] + (d_v,)).astype(q.dtype)
    s = scale * np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64))
    m = s.max(axis=-1, keepdims=True)
    w = np.exp(s - m)
    lse = (m[..., 0] + np.log(w.sum(axis=-1))).astype(np.float32)
    out = (np.einsum("bhqk,bhkd->bhqd", w / w.sum(axis=-1, keepdims=True), v.astype(np.float64))).astype(np.float32)
    # what backward.run's launches before the main kernel leave (they have no shared memory): preprocess's
    # D = rowsum(dO o O), here from NumPy (its 128-thread launch costs the simulator more than this kernel's),
    # and dQ (bwd-kv) or dK, dV (bwd-q) zeroed
    dvec = np.einsum("bhqd,bhqd->bhq", dout.astype(np.float64), out.astype(np.float64)).astype(np.float32)
    dev = {name: cuda.to_device(x) for name, x in dict(
        q=q, k=k, v=v, dout=dout, lse=lse, dvec=dvec, dq=np.zeros((1, 1, n_q, d), np.float32),
        dk=np.zeros((1, 1, n_k, d), np.float32), dv=np.zeros((1, 1, n_k, d_v), np.float32)).items()}
    side = _BACKWARD_KINDS[cfg["variant"]]
    grid, threads = built.launch_shape(1, 1, n_q if side == "q" else n_k)
    grads = (dev["q"], dev["k"], dev["v"], dev["dout"], dev["lse"], dev["dvec"], dev["dq"], dev["dk"], dev["dv"],
             np.float32(scale))
    if cfg["variant"] == "bwd-dq-mma":  # the dq pass takes no dK, dV
        grads = grads[:7] + grads[9:]
    grads += tuple(mask_arrays(None))  # every kernel takes the block-mask arrays (none here)
    grads += (NO_CAPTURED,)  # every kernel ends with a score mod's captured arrays (none here)
    with backend.serialised(math.prod(threads)):
        with smem_trace.trace_shared() as trace:
            if regions:
                _labelled(trace, *regions)
            built.kernel[grid, threads](*grads)
    return trace


def _rows(report) -> dict:
    return {key: (c.accesses, c.wavefronts, c.ideal) for key, c in report.rows.items()}


def report_per_site(trace, widths: str) -> dict:
    """{(site, kind, width): Counts} pairing the lanes of a warp by ordinal within each site (here: region)
    separately: trace.report of each site's accesses alone (barriers kept). It equals trace.report where no
    run of adjacent accesses to one site is interrupted by another site's (so on every kernel here without
    divergence: tested), and it prices a branch that only some lanes take, when that branch touches a
    region of its own (v1's `if tx == 0` stores of m_i, l_i into stat), as the separate warp access it is."""
    sites = {entry[0] for log in trace._logs.values() for entry in log if entry is not smem_trace.BARRIER}
    rows = {}
    for site in sorted(sites):
        alone = smem_trace.SharedTrace()
        alone._logs = {key: [e for e in log if e is smem_trace.BARRIER or e[0] == site]
                       for key, log in trace._logs.items()}
        for key, counts in alone.report(widths).rows.items():
            rows.setdefault(key, smem_trace.Counts()).add(counts)
    return rows


def _priced(trace, widths: str) -> tuple[dict, str | None]:
    """(rows of trace.report, None), or where a warp diverges (DivergenceError) the rows of report_per_site
    and the error's message."""
    try:
        return _rows(trace.report(widths)), None
    except smem_trace.DivergenceError as err:
        rows = report_per_site(trace, widths)
        return {key: (c.accesses, c.wavefronts, c.ideal) for key, c in rows.items()}, str(err)


def _counts(values) -> dict:
    accesses, wavefronts, ideal = values
    return {"accesses": accesses, "wavefronts": wavefronts, "ideal": ideal,
            "degree": round(wavefronts / ideal, 4) if ideal else 0.0}


def difference(more: dict, fewer: dict) -> dict:
    """{(site, kind, width): (accesses, wavefronts, ideal)} of more - fewer, rows of zeros left out; a negative
    difference (the launch with fewer tiles costing more somewhere) is a ValueError."""
    out = {}
    for key in sorted(set(more) | set(fewer)):
        diff = tuple(a - b for a, b in zip(more.get(key, (0, 0, 0)), fewer.get(key, (0, 0, 0))))
        if any(x < 0 for x in diff):
            raise ValueError(f"{key}: {more.get(key)} with more tiles, {fewer.get(key)} with fewer: not a per-"
                             f"iteration cost")
        if any(diff):
            out[key] = diff
    return out


def summarise(cfg: dict, diff: dict, widths: str) -> dict:
    """The JSON-able result of per_iteration from a difference of rows."""
    rows, regions, total = [], {}, [0, 0, 0]
    for (site, kind, width), values in sorted(diff.items()):
        region = site.split("@")[0]
        rows.append({"region": region, "site": site, "kind": kind, "width": width, **_counts(values)})
        acc = regions.setdefault(region, [0, 0, 0])
        for i, x in enumerate(values):
            acc[i] += x
            total[i] += x
    out = {"variant": cfg["variant"], "widths": widths, "loop": "key tiles" if LOOP_AXIS[cfg["variant"]] == "k"
           else "query tiles", "total": _counts(total),
           "regions": {r: _counts(v) for r, v in sorted(regions.items(), key=lambda kv: -kv[1][1])}, "rows": rows}
    if cfg.get("causal"):
        out["note"] = CAUSAL_NOTE
    return out


def reports(cfg: dict, tiles=(1, 2), widths=smem_trace.WIDTH_MODES, traces: dict | None = None
            ) -> tuple[dict, str | None]:
    """({width mode: {tiles: rows}}, the first divergence message or None) for one block of cfg with each
    number of tile-loop iterations (`_priced`: a diverging warp is paired per region). traces: a dict to
    keep each SharedTrace in, by tiles."""
    built = _build(cfg)
    out, divergence = {mode: {} for mode in widths}, None
    for n in tiles:
        trace = traced(cfg, n, built)
        if traces is not None:
            traces[n] = trace
        for mode in widths:
            out[mode][n], message = _priced(trace, mode)
            divergence = divergence or message
    return out, divergence


def per_iteration_modes(cfg: dict, widths=smem_trace.WIDTH_MODES) -> dict:
    """{width mode: per_iteration result} from one pair of launches (1 and 2 tiles) traced once each."""
    start = time.perf_counter()
    got, divergence = reports(cfg, (1, 2), widths)
    seconds = round(time.perf_counter() - start, 2)
    return {mode: result(cfg, got[mode], mode, divergence, seconds) for mode in widths}


def result(cfg: dict, rows: dict, widths: str, divergence: str | None = None, seconds: float | None = None) -> dict:
    """per_iteration's result from rows {tiles: rows} of `reports` (tiles 1 and 2 among them)."""
    out = {**summarise(cfg, difference(rows[2], rows[1]), widths), "seconds": seconds}
    if divergence:
        out["divergence"] = "paired per region (report_per_site): " + divergence
    return out


def per_iteration(cfg: dict, widths: str = "merged") -> dict:
    """The shared-memory cost of one FULL iteration of cfg's tile loop for one block (see the module docstring):
    {"total": {accesses, wavefronts, ideal, degree}, "regions": {region: counts}, "rows": [per (region, site,
    kind, width)], "variant", "widths", "loop", "seconds" (and "note" for a causal cfg, "divergence" where a warp
    diverged and was paired per region)}."""
    if widths not in smem_trace.WIDTH_MODES:
        raise ValueError(f"widths must be one of {smem_trace.WIDTH_MODES}, got {widths!r}")
    return per_iteration_modes(cfg, (widths,))[widths]


def difference_is_per_iteration(cfg: dict, widths: str = "merged") -> tuple[dict, dict]:
    """(3 tiles - 2, 2 tiles - 1): equal when the cost is per iteration, not an artefact of the prologue."""
    got = reports(cfg, (1, 2, 3), (widths,))[0][widths]
    return difference(got[3], got[2]), difference(got[2], got[1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m fa_numba.kernels.smem_costs", description=__doc__.splitlines()[0])
    p.add_argument("cfgs", help="a JSON list of cfg dicts (variant, block_q, block_k, head_dim, dtype, causal)")
    p.add_argument("--widths", choices=list(smem_trace.WIDTH_MODES) + ["both"], default="merged",
                   help="merged (LDS.64/128 from adjacent accesses) or scalar; both: {mode: result} per cfg")
    args = p.parse_args(argv)
    if backend.name() != "simulator":  # numba.cuda is already bound to the GPU: run again in the simulator
        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            raise RuntimeError("NUMBA_ENABLE_CUDASIM=1 is set but numba.cuda is not the simulator")
        env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
        return subprocess.run([sys.executable, "-m", "fa_numba.kernels.smem_costs", *argv], env=env).returncode
    modes = smem_trace.WIDTH_MODES if args.widths == "both" else (args.widths,)
    out = {}
    for cfg in json.loads(args.cfgs):
        got = per_iteration_modes(cfg, modes)
        out[json.dumps(cfg, sort_keys=True)] = got if args.widths == "both" else got[args.widths]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
