"""How the CUDA simulator runs the threads of one block: woken by the threads, not by polling them.

numba-cuda's simulator runs every CUDA thread of a block as a Python thread, and its block manager finds out
that all of them wait at `cuda.syncthreads()` (or have finished) by checking every thread's flags in a loop
that never sleeps. That loop holds the interpreter lock for most of its time: the block's own threads run
only when it is made to give the lock up. A kernel whose lanes hand work to each other often, as the warp
emulation's exchanges do (every lane waits for its 31 warp mates at each emulated mma), then makes a few
exchanges a second instead of hundreds, depending on how the lock happens to be handed round.

`install()` (backend.patch_simulator) gives the simulator a block runner that waits on a condition variable
which every thread notifies when it reaches a barrier or leaves its kernel, so the main thread sleeps while
the block's threads work. The rules are the simulator's: a barrier opens once every thread still running
waits at one, and the first thread that raised aborts the others and its error is raised from the launch.
It also records, per block, what the warp emulation's divergence check reads (`fa_numba.warp.emulation`):
the block's threads, the barriers each has entered, and whether it has left its kernel.
"""

from __future__ import annotations

import threading

import numpy as np

BACKSTOP = 0.05  # seconds the block runner sleeps at most before it looks again without being woken


class BarrierAborted(RuntimeError):
    """A thread at (or reaching) `cuda.syncthreads()` after another thread of its block raised."""


def _notify(manager) -> None:
    cv = getattr(manager, "_fa_numba_cv", None)  # None: a block run by another runner, which polls
    if cv is not None:
        with cv:
            cv.notify_all()


def _syncthreads(self) -> None:
    """Wait at the block's barrier until the block runner opens it for every running thread."""
    if self.abort:
        raise BarrierAborted("another thread of this block raised before this one reached cuda.syncthreads()")
    self._fa_numba_barriers += 1
    self.syncthreads_blocked = True
    _notify(self._manager)
    self.syncthreads_event.wait()
    self.syncthreads_event.clear()
    if self.abort:
        raise BarrierAborted("another thread of this block raised while this one waited at cuda.syncthreads()")


def _run_block(self, grid_point, *args):
    """Run one block to its end: start its threads, open each barrier when every running thread waits at it,
    raise the first error a thread raised (after telling the others to stop)."""
    from numba.cuda.simulator.kernel import BlockThread

    self._fa_numba_cv = cv = threading.Condition()
    self._fa_numba_threads = []

    def target():
        self._f(*args)

    threads = [BlockThread(target, self, grid_point, point, self._debug) for point in np.ndindex(*self._block_dim)]
    for thread in threads:
        thread.start()
    with cv:
        while True:
            failed = next((t for t in threads if t.exception), None)
            if failed is not None:
                for other in threads:
                    other.abort = True
                    other.syncthreads_blocked = False
                    other.syncthreads_event.set()
                raise failed.exception[0].with_traceback(failed.exception[1])
            running = [t for t in threads if not t._fa_numba_done]
            if not running:
                break
            if all(t.syncthreads_blocked for t in running):
                for t in running:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
            cv.wait(BACKSTOP)
    for thread in threads:
        thread.join()


def install() -> None:
    """Replace the simulator's block runner and barrier with the ones above, and list each block's threads
    (idempotent)."""
    from numba.cuda.simulator import kernel

    thread, manager = kernel.BlockThread, kernel.BlockManager
    if getattr(manager.run, "_fa_numba_woken", False):
        return
    init, run = thread.__init__, thread.run

    def registering_init(self, f, block, *args, **kwargs):
        """The simulator's own, then the thread listed on its block."""
        init(self, f, block, *args, **kwargs)
        self._fa_numba_barriers = 0  # the cuda.syncthreads() calls it has entered
        self._fa_numba_done = False  # it has left its kernel
        block.__dict__.setdefault("_fa_numba_threads", []).append(self)

    def recording_run(self):
        try:
            run(self)  # the simulator's: an error is kept on the thread for the block runner to raise
        finally:
            self._fa_numba_done = True
            _notify(self._manager)

    _run_block._fa_numba_woken = True
    thread.__init__, thread.run, thread.syncthreads = registering_init, recording_run, _syncthreads
    manager.run = _run_block
