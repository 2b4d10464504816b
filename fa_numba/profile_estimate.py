"""The whole-kernel estimate's plumbing for `fa_numba.profile`: the shared-memory wavefronts of one tile-loop
iteration and the 128-byte lines its global accesses touch, traced in a simulator process (`kernels.smem_costs`,
with this module's global trace around each of its launches: `traced_per_iteration`) and cached per version of
the code that decides them, and the estimate attached to each compiled profile
(`whole_kernel.estimate_configuration`).

The global trace: every array a traced launch puts on the device (`cuda.to_device`) logs the byte offset of
each element a simulator thread reads or writes, each cp.async copy its 16 source bytes, each syncthreads a
mark; between two marks, the k-th access of each lane to one array (loads and stores apart) forms the warp's
k-th access, a run of adjacent elements every lane reads merged into one access of up to 16 bytes as the
compiler's wide loads do, and each warp access touches the 128-byte lines its lanes' bytes lie in
(`global_lines`). One iteration's: the launch of two tile-loop iterations minus the launch of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import threading
from collections import defaultdict

import numpy as np

from fa_numba import sources, whole_kernel
from fa_numba.machine import H200, SM90

LINE_BYTES = 128  # an L1 / L2 cache line
MERGED_BYTES = 16  # the widest global load a lane issues (LDG.128)
TRACE_VERSION = 2  # the traced results' form: 2 adds "global_lines" to the shared-memory wavefronts


def _traced_config(cfg: dict) -> dict:
    """The configuration whose wavefronts stand for cfg's: FULL tiles run the non-causal kernel's code."""
    micro = {"micro": list(cfg["micro"])} if cfg.get("micro") else {}  # a layout of its own (decode_estimate)
    own = {"value_dim": cfg["value_dim"]} if cfg.get("value_dim") else {}  # V's head dim: other tiles, accesses
    rows = {"row_blocks": cfg["row_blocks"]} if cfg.get("row_blocks", 1) != 1 else {}  # a warp's m16 row blocks
    return ({k: cfg[k] for k in ("variant", "block_q", "block_k", "head_dim", "dtype")} | {"causal": False} | micro
            | own | rows)


def wavefront_cache() -> pathlib.Path:
    """Where traced wavefronts are kept between runs: one file per version of the code that decides them (the
    kernels, mma/ included, the tracers, the warp emulation, the bank rule and every package module they
    import but the model's: `sources.closure`, and this module), so an edit to any of them traces again."""
    traced = sources.closure(("fa_numba.kernels", "fa_numba.warp", "fa_numba.banks"), stop=sources.MODEL)
    key = sources.digest([*traced, pathlib.Path(__file__).resolve()])  # this module holds the global tracer
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return root / "fa_numba" / f"wavefronts-{key}-v{TRACE_VERSION}.json"


def start_wavefronts(configs: list[dict], jobs: int = 1):
    """Start this module's tracer (`main`: kernels.smem_costs with the global trace) in simulator processes on
    the distinct traced configurations the cache lacks (tracing one block takes 20 s to 15 minutes of CPU, in
    one thread): up to `jobs` processes, the configurations dealt among them; returns (cached results, the
    processes)."""
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
    command = [sys.executable, "-m", "fa_numba.profile_estimate"]
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


# ----------------------------------------------------------------------------------------------------
# The global trace (module docstring).

class GlobalTrace:
    """Each simulator thread's log of global accesses, (array, kind, byte offset, bytes), and None at each
    syncthreads, by (launch, blockIdx, linear thread id)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._logs: dict[tuple, list] = {}

    def _log(self) -> list | None:
        thread = threading.current_thread()
        mine = getattr(thread, "_fa_numba_global_log", None)
        if mine is not None and mine[0] is self:
            return mine[1]
        if not hasattr(thread, "threadIdx"):  # host code: nothing to trace
            return None
        from numba.cuda.simulator.kernel import _get_kernel_context

        launch = _get_kernel_context()
        x, y, z = thread.threadIdx
        bx, by, _ = launch.blockDim
        log = []
        with self._lock:
            self._logs[(id(launch), tuple(thread.blockIdx), x + y * bx + z * bx * by)] = log
        thread._fa_numba_global_log = (self, log)
        return log

    def record(self, entry) -> None:
        log = self._log()
        if log is not None:
            log.append(entry)

    def lines(self) -> tuple[int, int]:
        """(128-byte lines, warp accesses) of every warp access the launches made (module docstring)."""
        warps = defaultdict(dict)
        for (launch, block, tid), log in self._logs.items():
            intervals = [[]]
            for entry in log:
                if entry is None:
                    intervals.append([])
                else:
                    intervals[-1].append(entry)
            warps[(launch, block, tid // SM90.warp_size)][tid % SM90.warp_size] = intervals
        lines = accesses = 0
        for lanes in warps.values():
            for interval in range(max(len(intervals) for intervals in lanes.values())):
                by_array = defaultdict(dict)  # (array, kind): {lane: [(offset, bytes), ...]}
                for lane, intervals in lanes.items():
                    for array, kind, offset, size in (intervals[interval] if interval < len(intervals) else ()):
                        by_array[(array, kind)].setdefault(lane, []).append((offset, size))
                for seqs in by_array.values():
                    k, length = 0, max(len(seq) for seq in seqs.values())
                    while k < length:
                        active = [seq for seq in seqs.values() if k < len(seq)]
                        run = next((r for r in (4, 2) if all(_adjacent(seq, k, r) for seq in active)), 1)
                        touched = set()
                        for seq in active:
                            first, last = seq[k][0], seq[k + run - 1][0] + seq[k + run - 1][1] - 1
                            touched.update(range(first // LINE_BYTES, last // LINE_BYTES + 1))
                        lines += len(touched)
                        accesses += 1
                        k += run
        return lines, accesses


def _adjacent(seq: list, k: int, run: int) -> bool:
    """Whether this lane's accesses k .. k+run-1 are adjacent elements forming one aligned access of <= 16 bytes."""
    if k + run > len(seq):
        return False
    offset, size = seq[k]
    return (run * size <= MERGED_BYTES and offset % (run * size) == 0
            and all(seq[k + j] == (offset + j * size, size) for j in range(1, run)))


def _traced_array(trace: GlobalTrace, host: np.ndarray, name: str):
    from fa_numba.kernels import smem_trace

    class GlobalArray(smem_trace.TracedArray):
        """A global array, or a view of one, that logs into the global trace."""

        def _log(self, kind, idx):
            if self._trace is not None:
                for offset in self._offsets(idx):
                    self._trace.record((self._site, kind, offset, self.itemsize))

    array = np.ascontiguousarray(host).view(GlobalArray)
    array._trace, array._site, array._offset = trace, name, 0
    array._base_address = array.__array_interface__["data"][0]
    return array


@contextlib.contextmanager
def trace_global():
    """Inside, every array `cuda.to_device` copies to the simulated device logs its accesses (module docstring),
    as does every cp.async copy from it; yields the GlobalTrace. Simulator only."""
    from numba import cuda
    from numba.cuda.simulator import kernel
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    from fa_numba import warp

    trace = GlobalTrace()
    names = iter(range(1 << 30))
    to_device, syncthreads, copy = cuda.to_device, kernel.BlockThread.syncthreads, warp.cp_async16

    def traced_to_device(ary, *args, **kwargs):
        if isinstance(ary, np.ndarray):
            return FakeCUDAArray(_traced_array(trace, ary, f"global{next(names)}"))
        return to_device(ary, *args, **kwargs)

    def traced_syncthreads(thread):
        trace.record(None)
        syncthreads(thread)

    def traced_copy(smem, sidx, gmem, gidx, nbytes):
        source = getattr(gmem, "_ary", gmem)
        if getattr(source, "_trace", None) is trace and int(nbytes):
            trace.record((source._site, "load", int(gidx) * source.itemsize, 16))
        return copy(smem, sidx, gmem, gidx, nbytes)

    cuda.to_device, kernel.BlockThread.syncthreads, warp.cp_async16 = (traced_to_device, traced_syncthreads,
                                                                        traced_copy)
    try:
        yield trace
    finally:
        cuda.to_device, kernel.BlockThread.syncthreads, warp.cp_async16 = to_device, syncthreads, copy


def traced_per_iteration(cfg: dict) -> dict:
    """kernels.smem_costs.per_iteration(cfg) (one FULL iteration's shared-memory wavefronts, "merged" widths),
    with "global_lines" and "global_accesses": the same launches' global accesses (module docstring), 2 tile
    iterations minus 1. Simulator only."""
    from fa_numba.kernels import smem_costs

    found, traced = {}, smem_costs.traced

    def with_global_trace(cfg_, tiles, built=None):
        with trace_global() as trace:
            out = traced(cfg_, tiles, built)
        found[tiles] = trace.lines()
        return out

    smem_costs.traced = with_global_trace
    try:
        result = smem_costs.per_iteration(cfg)
    finally:
        smem_costs.traced = traced
    (lines_2, accesses_2), (lines_1, accesses_1) = found[2], found[1]
    return {**result, "global_lines": lines_2 - lines_1, "global_accesses": accesses_2 - accesses_1}


def main(argv=None) -> int:
    """python -m fa_numba.profile_estimate CFGS: traced_per_iteration of each cfg of the JSON list CFGS, as one
    JSON object {cfg as sorted JSON: result} (run in the simulator, as start_wavefronts does)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    from fa_numba import backend

    if backend.name() != "simulator":
        env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
        return subprocess.run([sys.executable, "-m", "fa_numba.profile_estimate", *argv], env=env).returncode
    print(json.dumps({json.dumps(cfg, sort_keys=True): traced_per_iteration(cfg) for cfg in json.loads(argv[0])}))
    return 0


# The tracer's warp accesses per iteration (its "merged" widths: adjacent elements as LDS.64 / LDS.128) must
# be the SASS's LDS + STS per iteration times the warps, or the tracer priced other accesses than the
# compiler made (it merged what ptxas left scalar, or the reverse): the table then marks the estimate "?".
WIDTH_AGREEMENT = 0.05

# What the table's estimate columns mean (printed under `python -m fa_numba profile`'s table).
LEGEND = ("estimate = the whole-kernel model (fa_numba.cycle_model: one tile-loop iteration of the resident blocks "
          "as a closed queueing network over the sub-partitions' busiest pipe, shared-memory wavefronts and L1 "
          "lines, with each block's own dependence walk and load round trips as its delay; whole blocks and "
          "waves, HBM); model = its limiter. hot-loop = peak x min(FFMA/issued, FFMA/(4 x LDS+STS+LDL+STL)) in "
          "the matrix-product loops only x scheduler fill, which overstates (CUDA-core kernels only; '-' for the "
          "tensor-core ones, whose estimate prices each mma.sync at 6 cycles, about 2/3 of the dense peak). ?: "
          f"the traced shared-memory accesses differ from the SASS's by over {WIDTH_AGREEMENT:.0%} (their widths "
          "were guessed otherwise), so the shared term is uncertain. Read from the code, calibrated against the "
          "GPU's rows (tests/test_calibration.py), never a measurement.")


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
    tile loop (or a causal build's dependence walk, which leaves such loops out), and the products the kernel does
    (`whole_kernel.estimate_configuration`'s two checks)."""
    return ("error" not in counts and (not counts.get("unattributed") or (c["causal"] and "walk" in counts))
            and "products" in counts
            and abs(counts["products"] - whole_kernel.expected_products(c, counts.get("value_ratio", 1.0))) < 1e-9)


def _sibling_key(c: dict) -> tuple:
    return (c["variant"], c["head_dim"], c["dtype"], c["block_q"], c["block_k"], bool(c.get("strided")),
            c.get("score_mod"), c.get("value_dim") or 0, c.get("row_blocks", 1))


def attach_estimates(profiles: list, wavefronts: dict, launch: dict) -> None:
    """Fill each profile's `estimate` from its counts and the traced wavefronts and global lines of one iteration.

    A causal tensor-core build carries its PARTIAL tiles' code (the masking and the exact path for non-finite
    values, whose loops have no trip-count rule). Its dependence walk leaves those loops out (the PARTIAL
    tiles, about one per row of query tiles, run them), so its own counts price its iteration: its own code,
    which at its own register count may schedule the FULL tiles' products otherwise than the non-causal build
    (a causal build that serialised S's accumulators through one register took twice the cycles alone). Counts
    made before the walk priced no iteration: where the non-causal build is in the same run its counts stand
    for every iteration (a PARTIAL tile's extra masking is not counted; the estimate says "counts_from"),
    with the causal build's own occupancy and the causal launch's iterations, flops and traffic."""
    siblings = _full_tile_counts(profiles)
    for prof in profiles:
        keys = ("variant", "block_q", "block_k", "head_dim", "dtype", "causal") + (
            ("value_dim",) if prof.config.get("value_dim") else ()) + (  # V's head dim, where it has one of its own
            ("micro",) if prof.config.get("micro") else ()) + (  # a micro-tile of its own: traced at that layout
            ("row_blocks",) if prof.config.get("row_blocks", 1) != 1 else ())  # two m16 row blocks a warp
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
                                                             tuple(block), traced["total"]["wavefronts"], launch,
                                                             global_lines=traced.get("global_lines", 0.0))
        details = {**details, **borrowed}
        warps = -(-prof.threads // SM90.warp_size)
        walked = counts.get("walk")  # the accesses of the iteration the walk prices, where it left loops out
        in_sass = (walked["shared_accesses"] if walked else sum(counts["shared_accesses"].values())) * warps
        agree = abs(in_sass - traced["total"]["accesses"]) <= WIDTH_AGREEMENT * in_sass
        check = {"shared_accesses": {"sass": in_sass, "traced": traced["total"]["accesses"], "agree": agree}}
        peak = H200.peak_tensor_tflops if cfg["variant"] in whole_kernel.MMA_KERNELS else H200.peak_fp32_tflops
        prof.estimate = {**details, **check} if found is None else {
            **found.as_dict(), **details, **check, "fraction_of_peak": found.tflops / peak}


if __name__ == "__main__":
    sys.exit(main())
