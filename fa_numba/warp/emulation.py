"""The warp operations of `fa_numba.warp.ptx`, emulated in pure Python for numba-cuda's CUDA simulator.

The simulator runs every CUDA thread of a block as a Python thread and has no warp collectives (numba-cuda
0.30's fake `cuda` module lacks syncwarp, shfl_*_sync and activemask) and cannot run PTX. Here a warp
operation is an exchange among the lanes of one warp: each lane deposits its operand, waits until all lanes
of its warp have deposited theirs, and computes its own result from all of them, following the PTX ISA's
fragment tables (proofs/L10_fragments.md gives them; tests/fragments.py is a second reading, written apart
from this one, that the tests check this one against).

The hardware requires every lane of the warp to execute a `.sync.aligned` operation together. A lane that
does not come (it exited, or it waits at `cuda.syncthreads()` while its warp mates wait here, or it called a
different warp operation) is reported at once as a `WarpDivergence` naming the operation and the lanes,
instead of a silent deadlock; a lane that is merely slow is waited for up to `TIMEOUT` seconds.

What is an assumption, not a reading of the ISA: mma returns A B + C computed exactly and rounded once to
float32 (the ISA leaves the accumulation's rounding to the implementation); ex2 returns 2^x correctly rounded
(ex2.approx's error is at most 2 ulp on the hardware, proofs/L6 charges that); cp.async copies land at the
latest moment the ISA allows, the wait_group that covers them, so a missing wait reads stale data here.
"""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np

TIMEOUT = 300.0  # seconds a lane waits for slow warp mates before giving up (the simulator can be slow)
_POLL = 0.05  # seconds between checks for a lane that will never come


class WarpDivergence(RuntimeError):
    """A warp operation that not every lane of its warp reached together."""


class _Warp:
    """The exchange area of one warp of one block."""

    def __init__(self, manager, warp: int, size: int):
        self.manager, self.warp, self.size = manager, warp, size
        self.cond = threading.Condition()
        self.op = None
        self.slots = [None] * size
        self.arrived = 0
        self.generation = 0
        self.result = None
        self.broken = ""  # why the warp diverged, once it has: every later exchange raises it

    def _absent_lanes(self) -> list[int]:
        return [lane for lane in range(self.size) if self.slots[lane] is None]

    def _check_absent(self, op: str, started: float) -> None:
        """Raise if a lane that has not arrived never will: it has finished its kernel, or it waits at a
        cuda.syncthreads() that this (waiting) lane has not reached, which cannot be released while this lane
        waits here. (A lane still flagged at a barrier this lane has passed is being released: the simulator
        clears the flags one thread at a time.)"""
        absent = set(self._absent_lanes())
        passed = getattr(threading.current_thread(), "_fa_numba_barriers", 0)
        for th in list(getattr(self.manager, "_fa_numba_threads", ())):
            tid = th.thread_id
            if tid // 32 != self.warp or tid % 32 not in absent:
                continue
            if getattr(th, "_fa_numba_done", False):
                why = "exited"
            elif th.syncthreads_blocked and getattr(th, "_fa_numba_barriers", 0) > passed:
                why = "waits at cuda.syncthreads()"
            else:
                continue
            raise WarpDivergence(f"{op}: lane {tid % 32} of warp {self.warp} {why} while lanes "
                                 f"{sorted(set(range(self.size)) - absent)} wait at {op}; a warp operation must "
                                 f"be reached by all lanes of the warp together")
        if time.monotonic() - started > TIMEOUT:
            raise WarpDivergence(f"{op}: lanes {sorted(absent)} of warp {self.warp} did not arrive within "
                                 f"{TIMEOUT:.0f} s")

    def exchange(self, lane: int, op: str, value, combine=None) -> list:
        """Deposit `value` for `lane`; once all lanes have, return every lane's value, or what
        combine(every lane's value) returns (computed once, by the lane that arrives last)."""
        with self.cond:
            if self.broken:
                raise WarpDivergence(self.broken)
            if self.arrived == 0:
                self.op = op
                self.slots = [None] * self.size
            elif op != self.op:
                self.broken = (f"lane {lane} of warp {self.warp} called {op} while lanes "
                               f"{[i for i in range(self.size) if self.slots[i] is not None]} wait at "
                               f"{self.op}: the lanes of a warp diverged")
                self.cond.notify_all()  # the waiting lanes raise the same error, not a later symptom of it
                raise WarpDivergence(self.broken)
            self.slots[lane] = value
            self.arrived += 1
            if self.arrived == self.size:
                try:
                    self.result = combine(self.slots) if combine is not None else list(self.slots)
                except Exception as error:  # the waiting lanes raise it too instead of waiting for TIMEOUT
                    self.broken = f"{op}: lane {lane} of warp {self.warp} failed computing it: {error!r}"
                    self.cond.notify_all()
                    raise
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
                return self.result
            generation, started = self.generation, time.monotonic()
            while self.generation == generation:
                self.cond.wait(_POLL)
                if self.broken:
                    raise WarpDivergence(self.broken)
                if self.generation == generation:
                    self._check_absent(op, started)
            return self.result  # not replaced yet: the next exchange needs this lane too


_lock = threading.Lock()
_warps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BlockManager -> {warp: _Warp}


def _lane_exchange(op: str, value, full: bool = False, combine=None):
    """(values of every lane of this thread's warp, or combine(them), this lane). `full`: the operation needs
    32 lanes."""
    th = threading.current_thread()
    manager = getattr(th, "_manager", None)
    if manager is None:
        raise RuntimeError(f"{op} is a warp operation: call it from a kernel running in the CUDA simulator")
    tid = th.thread_id
    warp, lane = divmod(tid, 32)
    with _lock:
        block = _warps.setdefault(manager, {})
        w = block.get(warp)
        if w is None:
            threads = int(np.prod(manager._block_dim))
            w = block[warp] = _Warp(manager, warp, min(32, threads - 32 * warp))
    if full and w.size != 32:
        raise WarpDivergence(f"{op} needs all 32 lanes of a warp; warp {warp} of this block has {w.size} "
                             f"threads (make the block a multiple of 32 threads)")
    return w.exchange(lane, op, value, combine), lane


# ---- warp collectives the simulator lacks --------------------------------------------------------------------
FULL_MASK = 0xFFFFFFFF


def _check_mask(op: str, mask, size: int) -> None:
    want = (1 << size) - 1
    if int(mask) & want != want:
        raise NotImplementedError(f"{op}: the emulation supports only masks that name every lane of the warp "
                                  f"(got {int(mask):#x}, the warp has {size} lanes)")


def syncwarp(mask=FULL_MASK):
    vals, _ = _lane_exchange("syncwarp", 0)
    _check_mask("syncwarp", mask, len(vals))


def _shuffle(op: str, mask, value, source):
    vals, lane = _lane_exchange(op, value)
    _check_mask(op, mask, len(vals))
    src = source(lane)
    if src is None:  # out of the lane range: the lane keeps its own value (PTX shfl's clamp rule)
        return value
    if src >= len(vals):
        raise WarpDivergence(f"{op}: lane {lane} reads lane {src}, which this warp of {len(vals)} lanes lacks")
    return vals[src]


def shfl_sync(mask, value, src_lane):
    return _shuffle("shfl_sync", mask, value, lambda lane: int(src_lane) % 32)


def shfl_xor_sync(mask, value, lane_mask):
    return _shuffle("shfl_xor_sync", mask, value, lambda lane: lane ^ (int(lane_mask) & 31))


def shfl_up_sync(mask, value, delta):
    return _shuffle("shfl_up_sync", mask, value, lambda lane: lane - int(delta) if lane >= int(delta) else None)


def shfl_down_sync(mask, value, delta):
    return _shuffle("shfl_down_sync", mask, value,
                    lambda lane: lane + int(delta) if lane + int(delta) < 32 else None)


def activemask():
    return FULL_MASK


COLLECTIVES = dict(syncwarp=syncwarp, shfl_sync=shfl_sync, shfl_xor_sync=shfl_xor_sync, shfl_up_sync=shfl_up_sync,
                   shfl_down_sync=shfl_down_sync, activemask=activemask)


def install() -> None:
    """Give the simulator's fake `cuda` module the collectives above it lacks (called by
    backend.patch_simulator, which also installs `fa_numba.simulator_threads`: the per-block list of threads,
    barriers entered and finished flags that the divergence check reads)."""
    from numba.cuda.simulator import kernelapi

    fake = kernelapi.FakeCUDAModule
    for name, fn in COLLECTIVES.items():
        if not hasattr(fake, name):
            setattr(fake, name, staticmethod(fn))
