"""Trace one launch's shared-memory accesses in the CUDA simulator and count their wavefronts (bank conflicts).

Inside `with trace_shared() as trace:` each `cuda.shared.array` a kernel allocates is a `TracedArray`, an
ndarray subclass that logs, per simulator thread, each element read or written: (allocation site, load or
store, byte offset in the base array, itemsize; a view such as a row logs offsets in its base), plus a mark
at each syncthreads. After the launch `trace.report(widths)` groups the logs into warp accesses and prices
each with `fa_numba.banks.wavefronts`.

Grouping: linear thread id t = x + y*bx + z*bx*by (threadIdx from the simulator's thread, blockDim from its
kernel context), warp t // 32, lane t % 32. Between two barriers the k-th access of each lane of a warp
forms the warp's k-th access (lanes in lockstep make the same accesses in the same order); a lane with fewer
accesses there is inactive in the last ordinals (a guarded tail, `for i in range(t, n, 32)`). Where the
lanes of one ordinal disagree on (array, kind), control flow diverged and ordinals no longer line up:
`report` raises DivergenceError (block, warp, interval, ordinal, which lanes did what) rather than guess.
Divergence that keeps (array, kind) equal at every ordinal is not seen: it pairs accesses the hardware
issues separately.

widths="scalar": each access is one element (itemsize bytes). widths="merged" models the LDS.64/LDS.128
(STS) the compiler makes of adjacent accesses: a run of w in (4, 2) consecutive ordinals where every active
lane accesses one array and kind at elements e, e+1, .., e+w-1, with e*itemsize a multiple of w*itemsize
<= 16 bytes, is one access of w*itemsize bytes (greedy, 4 before 2). Whether ptxas merges them is the SASS's
to say.

Assumptions: each shared array starts 128-byte aligned (byte offset b is in bank (b // 4) % 32, an aligned
offset is an aligned address); one warp access never spans two arrays, so their real placement does not
matter. Limitations: one launch per trace; dynamic shared memory (shape 0) is not traced; numpy operations
on whole arrays (copies, ufuncs, sums) are not seen; a slice assignment is one store per element in C
order; an atomic is a load and a store (the GPU issues one ATOMS). Simulator only.

Warp operations. The emulated ldmatrix and cp.async (`fa_numba.warp.emulated_tc`) read and write the whole
array at once, which the element logs would not see; instead each lane records its own access through
`emulated_tc._record` before the warp exchanges: ldmatrix a "matrix" access of its 16-byte row (a lane past
the last matrix records an address of None: in the warp op, reading nothing, so ordinals stay aligned),
cp.async a 16-byte store of its destination. `banks` prices them (a "matrix" access: one phase per matrix).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from fa_numba import backend, banks

LOAD, STORE = "load", "store"
BARRIER = None  # a syncthreads in a thread's log
WIDTH_MODES = ("scalar", "merged")
MERGE_RUNS = (4, 2)  # elements per merged access, tried in this order
MAX_ACCESS_BYTES = max(banks.WIDTHS)


class DivergenceError(ValueError):
    """The lanes of a warp made different shared-memory accesses at one ordinal: no warp access to price."""


class TracedArray(np.ndarray):
    """A shared array, or a view of one, that logs each element a simulator thread reads or writes."""

    def __array_finalize__(self, obj):
        self._trace = getattr(obj, "_trace", None)
        self._site = getattr(obj, "_site", None)
        self._base_address = getattr(obj, "_base_address", 0)
        self._offset = getattr(obj, "_offset", 0)  # byte offset of this view's first element in the base

    def _scalar_offset(self, idx):
        """Byte offset in the base array of the element idx names, or None if idx is not one element."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != self.ndim:
            return None
        offset = self._offset
        for i, n, stride in zip(idx, self.shape, self.strides):
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                return None
            offset += (int(i) + n if i < 0 else int(i)) * stride
        return offset

    def _offsets(self, idx) -> list[int]:
        """Byte offsets in the base array of the elements idx touches, in C order."""
        offset = self._scalar_offset(idx)
        if offset is not None:
            return [offset]
        offsets = np.full(self.shape, self._offset, np.int64)
        for axis, (n, stride) in enumerate(zip(self.shape, self.strides)):
            offsets += (np.arange(n) * stride).reshape((n,) + (1,) * (self.ndim - axis - 1))
        return [int(o) for o in np.ravel(offsets[idx])]

    def _log(self, kind, idx):
        for offset in self._offsets(idx):
            self._trace.record((self._site, kind, offset, self.itemsize))

    def __getitem__(self, idx):
        value = np.ndarray.__getitem__(self, idx)
        if isinstance(value, np.ndarray) and np.may_share_memory(value, self):  # a view: logs when accessed
            value._offset = value.__array_interface__["data"][0] - self._base_address
            return value
        self._log(LOAD, idx)
        return value.view(np.ndarray) if isinstance(value, np.ndarray) else value

    def __setitem__(self, idx, value):
        np.ndarray.__setitem__(self, idx, value)
        self._log(STORE, idx)


@dataclass
class Counts:
    """Warp accesses, their wavefronts, and the wavefronts they would cost without a conflict."""
    accesses: int = 0
    wavefronts: int = 0
    ideal: int = 0

    def add(self, other: Counts) -> None:
        self.accesses += other.accesses
        self.wavefronts += other.wavefronts
        self.ideal += other.ideal

    @property
    def degree(self) -> float:
        """Conflict degree: wavefronts / ideal (1.0 conflict-free, 32.0 a 32-way conflict)."""
        return self.wavefronts / self.ideal if self.ideal else 0.0


@dataclass
class SharedReport:
    """One traced launch: Counts per (site, kind, width in bytes) and per block (blockIdx)."""
    widths: str
    rows: dict[tuple[str, str, int], Counts] = field(default_factory=dict)
    blocks: dict[tuple[int, int, int], Counts] = field(default_factory=dict)

    def total(self, name: str | None = None, kind: str | None = None, width: int | None = None) -> Counts:
        """Counts summed over the rows that match: name is a site's variable name or its whole label."""
        out = Counts()
        for (site, row_kind, row_width), counts in self.rows.items():
            if (name in (None, site, site.split("@")[0]) and kind in (None, row_kind)
                    and width in (None, row_width)):
                out.add(counts)
        return out


def _site_label(filename: str, line: int) -> str:
    """'name@file.py:line' for `name = cuda.shared.array(...)` at that line ('shared@...' if unnamed)."""
    match = re.match(r"\s*(\w+)\s*=", linecache.getline(filename, line))
    return f"{match.group(1) if match else 'shared'}@{os.path.basename(filename)}:{line}"


class SharedTrace:
    """The per-thread logs of one launch (filled by trace_shared) and their analysis (`report`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._logs: dict[tuple[tuple[int, int, int], int], list] = {}  # (blockIdx, linear tid) -> log
        self._launch = None  # the simulator's kernel context (FakeCUDAModule) of the traced launch

    def _thread_log(self):
        """This simulator thread's log, made on its first access (None for a thread outside a launch)."""
        thread = threading.current_thread()
        mine = getattr(thread, "_fa_numba_smem_log", None)
        if mine is not None and mine[0] is self:
            return mine[1]
        if not hasattr(thread, "threadIdx"):  # not a simulator thread (host code): nothing to trace
            return None
        from numba.cuda.simulator.kernel import _get_kernel_context
        launch = _get_kernel_context()
        x, y, z = thread.threadIdx
        bx, by, _ = launch.blockDim
        log = []
        with self._lock:
            if self._launch is None:
                self._launch = launch
            elif launch is not self._launch:
                raise RuntimeError("trace_shared traces one kernel launch: open one `with trace_shared()` per launch")
            self._logs[(tuple(thread.blockIdx), x + y * bx + z * bx * by)] = log
        thread._fa_numba_smem_log = (self, log)
        return log

    def record(self, entry) -> None:
        """Append (site, kind, byte offset, itemsize), or BARRIER, to the calling simulator thread's log."""
        log = self._thread_log()
        if log is not None:
            log.append(entry)

    def allocate(self, site, shape, dtype) -> TracedArray:
        """A new traced array for the allocation at site (file, line)."""
        array = np.empty(shape, dtype).view(TracedArray)
        array._trace, array._site = self, _site_label(*site)
        array._base_address = array.__array_interface__["data"][0]
        return array

    def report(self, widths: str = "merged") -> SharedReport:
        """Price every warp access of the launch (see the module docstring for widths and divergence)."""
        if widths not in WIDTH_MODES:
            raise ValueError(f"widths must be one of {WIDTH_MODES}, got {widths!r}")
        warps = defaultdict(dict)  # (blockIdx, warp) -> {lane: [accesses between barriers, ...]}
        for (block, tid), log in self._logs.items():
            intervals = [[]]
            for access in log:
                if access is BARRIER:
                    intervals.append([])
                else:
                    intervals[-1].append(access)
            warps[(block, tid // banks.WARP)][tid % banks.WARP] = intervals
        report = SharedReport(widths)
        for (block, warp), lanes in sorted(warps.items()):
            for interval in range(max(len(intervals) for intervals in lanes.values())):
                seqs = {lane: ivs[interval] for lane, ivs in lanes.items() if interval < len(ivs) and ivs[interval]}
                where = f"block {block} warp {warp}, after barrier {interval}"
                for site, kind, width, addresses in _warp_accesses(seqs, widths == "merged", where):
                    addresses = {lane: a for lane, a in addresses.items() if a is not None}  # lanes reading nothing
                    paired = banks.is_paired(addresses, width, kind)
                    per_phase = banks.phase_lanes(width, paired)
                    phases = Counter(lane // per_phase for lane in addresses).values()
                    counts = Counts(1, banks.wavefronts(addresses, width, kind),
                                    sum(banks.ideal_wavefronts(n, width, paired) for n in phases))
                    report.rows.setdefault((site, kind, width), Counts()).add(counts)
                    report.blocks.setdefault(block, Counts()).add(counts)
        return report


def _merges(seq, k: int, run: int) -> bool:
    """Whether this lane's accesses k .. k+run-1 are run adjacent elements forming one aligned access."""
    site, kind, offset, itemsize = seq[k]
    nbytes = run * itemsize
    return (k + run <= len(seq) and nbytes <= MAX_ACCESS_BYTES and offset % nbytes == 0
            and all(seq[k + j] == (site, kind, offset + j * itemsize, itemsize) for j in range(1, run)))


def _warp_accesses(seqs: dict[int, list], merge: bool, where: str):
    """Yield (site, kind, width_bytes, {lane: byte offset}) for each warp access of one barrier interval."""
    k, length = 0, max((len(seq) for seq in seqs.values()), default=0)
    while k < length:
        active = {lane: seq for lane, seq in seqs.items() if k < len(seq)}
        doing = defaultdict(list)
        for lane, seq in active.items():
            doing[seq[k][:2]].append(lane)
        if len(doing) > 1:
            raise DivergenceError(f"{where}, access {k}: lanes disagree on (array, kind): {dict(doing)}; the warp "
                                  f"diverged, so its accesses cannot be paired by ordinal")
        runs = MERGE_RUNS if merge else ()
        run = next((r for r in runs if all(_merges(seq, k, r) for seq in active.values())), 1)
        site, kind, _, itemsize = next(iter(active.values()))[k]
        yield site, kind, run * itemsize, {lane: seq[k][2] for lane, seq in active.items()}
        k += run


@contextlib.contextmanager
def trace_shared():
    """Trace the shared-memory accesses of the one kernel launch made inside the block; yields a SharedTrace.

    Installs backend.patch_simulator, then replaces its shared-array allocator with backend.shared_allocator's
    same locked lookup keyed by the kernel's call site, handing out TracedArrays (wrapping the previous one
    would key by the wrapper's line instead), and marks each syncthreads; both are restored on exit. Holds
    the simulator's launch lock throughout, so no other thread's launch is traced."""
    if backend.name() != "simulator":
        raise RuntimeError("tracing shared memory needs the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    backend.patch_simulator()
    from numba.cuda.simulator import kernel, kernelapi

    trace = SharedTrace()
    previous_array = kernelapi.FakeCUDAShared.array
    previous_syncthreads = kernel.BlockThread.syncthreads

    array = backend.shared_allocator(previous_array, trace.allocate)  # keyed by the kernel's call site

    def syncthreads(thread):
        trace.record(BARRIER)
        previous_syncthreads(thread)

    with backend.serialised():
        kernelapi.FakeCUDAShared.array = array
        kernel.BlockThread.syncthreads = syncthreads
        try:
            yield trace
        finally:
            kernelapi.FakeCUDAShared.array = previous_array
            kernel.BlockThread.syncthreads = previous_syncthreads
