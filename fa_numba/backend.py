"""Which CUDA backend fa_numba runs on: a real GPU, or Numba's CUDA simulator.

The simulator must be chosen before numba.cuda is first imported, so `select()` runs when fa_numba is
imported: if NUMBA_ENABLE_CUDASIM is unset and no NVIDIA driver is visible on this machine, it sets
NUMBA_ENABLE_CUDASIM=1 so `import fa_numba` works on a laptop. Set NUMBA_ENABLE_CUDASIM=0 or 1 yourself to
choose. FA_NUMBA_SIM=1 forces the simulator even where a GPU is present.

If numba.cuda was imported before fa_numba (`from numba import cuda` first in a notebook) on a machine
without an NVIDIA driver, numba is bound to the real driver and no launch can work: `select()` warns with
IMPORT_ORDER_FIX, and `explain_driver_errors()` turns the first launch's driver error into a RuntimeError
with the same sentence.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import warnings


SIM_MAX_WORK = 2**20  # B H N_q N_k d multiply-adds the simulator runs in about 20 s per kernel (2 cores)


def gpu_driver_visible() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


IMPORT_ORDER_FIX = (
    "numba.cuda was imported before fa_numba on a machine without an NVIDIA driver, so numba is bound to the "
    "real CUDA driver and every launch fails: import fa_numba before numba (or anything that imports "
    "numba.cuda), or set NUMBA_ENABLE_CUDASIM=1 before numba is imported"
)

_numba_cuda_came_first = False  # numba.cuda was already imported when select() ran


def select() -> str:
    global _numba_cuda_came_first
    if "numba.cuda" in sys.modules:  # too late to choose: numba.cuda is real or simulated for good
        _numba_cuda_came_first = True
        if stranded():
            warnings.warn(IMPORT_ORDER_FIX, RuntimeWarning, stacklevel=3)  # at the `import fa_numba` line
    elif "NUMBA_ENABLE_CUDASIM" not in os.environ:
        if os.environ.get("FA_NUMBA_SIM") == "1" or not gpu_driver_visible():
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    return name()


def name() -> str:
    """'simulator' or 'gpu': what numba.cuda uses once imported (read from numba itself), else will use."""
    if "numba.cuda" in sys.modules:
        return "simulator" if "numba.cuda.simulator_init" in sys.modules else "gpu"
    return "simulator" if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else "gpu"


def stranded() -> bool:
    """numba.cuda was imported before fa_numba, it is the real one, and no NVIDIA driver is visible."""
    return _numba_cuda_came_first and name() == "gpu" and not gpu_driver_visible()


INSTALL_FIX = ('pip install "fa_numba[cu13]" (NVIDIA driver 580 or newer) or pip install "fa_numba[cu12]" '
               "(drivers 525 to 575): numba-cuda's CUDA wheels of that major, or CUDA_HOME set to a CUDA toolkit")
# What a driver, a toolkit or a compiler says when the toolkit is newer than the driver, or missing.
TOO_NEW = ("UNSUPPORTED_PTX_VERSION", "unsupported toolchain", "INSUFFICIENT_DRIVER", "driver version is insufficient",
           "CUDA_ERROR_UNSUPPORTED_PTX")
MISSING = ("libNVVM cannot be found", "NVVM cannot be found", "libdevice", "nvrtc", "CUDA toolkit")


def versions() -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(driver, toolkit) CUDA versions as (major, minor), each None where it cannot be read (the simulator, no
    driver, no runtime): the driver's from cuDriverGetVersion, the toolkit's from the runtime numba-cuda loads."""
    from numba import cuda

    found = []
    for read in (lambda: cuda.cudadrv.driver.driver.get_version(), lambda: cuda.runtime.get_version()):
        try:
            found.append(tuple(int(x) for x in read())[:2])
        except Exception:  # noqa: BLE001 - no driver, no runtime, the simulator: each says it differently
            found.append(None)
    return found[0], found[1]


def driver_advice(err: BaseException, driver=None, toolkit=None) -> str | None:
    """The sentence for a launch's error that says the toolkit is newer than the driver or missing, with the
    versions where known and the command that fixes it (INSTALL_FIX); None for any other error."""
    if not type(err).__module__.startswith(("numba", "cuda")):  # a CUDA error: an argument's ValueError is not one
        return None
    text = f"{type(err).__name__}: {err}"
    have = "" if driver is None else f" (the driver runs CUDA {driver[0]}.{driver[1]}"
    have += "" if toolkit is None else (", " if have else " (") + f"the toolkit is CUDA {toolkit[0]}.{toolkit[1]}"
    have += ")" if have else ""
    if any(word.lower() in text.lower() for word in TOO_NEW) or (driver and toolkit and driver[0] < toolkit[0]):
        return f"the CUDA toolkit is newer than the NVIDIA driver{have}: {INSTALL_FIX} ({text})"
    if type(err).__name__ in ("NvvmSupportError", "CudaSupportError", "NvrtcSupportError") and any(
            word.lower() in text.lower() for word in MISSING):
        return f"no CUDA toolkit for compiling kernels was found{have}: {INSTALL_FIX} ({text})"
    return None


@contextlib.contextmanager
def explain_driver_errors():
    """Around a launch: when stranded(), numba's driver error becomes a RuntimeError saying what to do; on a GPU,
    a toolkit newer than the driver, or none, becomes one naming the versions and the install that fixes it
    (`driver_advice`)."""
    try:
        yield
    except Exception as err:
        if stranded() and type(err).__name__ == "CudaSupportError":
            raise RuntimeError(IMPORT_ORDER_FIX) from err
        advice = driver_advice(err, *versions()) if name() == "gpu" else None
        if advice is not None:
            raise RuntimeError(advice) from err
        raise


def shared_allocator(original, make):
    """A FakeCUDAShared.array method: the array of its caller's call site (file, line), made by
    make(site, shape, dtype) on the first call from that site, under a lock; `original` serves what it does
    not handle (an alignment, dynamic shared memory). patch_simulator installs it with np.empty, the shared-
    memory tracer (kernels.smem_trace) with its traced arrays."""
    from numba.core import types
    from numba.np import numpy_support

    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # errors and dynamic shared memory: unchanged
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            found = self._allocations.get(site)
            if found is None:
                found = self._allocations[site] = make(site, shape, dtype)
        return found

    array._fa_numba_locked = True  # a later patch_simulator leaves it in place
    return array


def patch_simulator() -> None:
    """Make the simulator's shared-array allocation thread-safe (a workaround for a simulator race), its
    atomic add read its element once, its block runner sleep until woken (fa_numba.simulator_threads), give it
    the warp collectives (fa_numba.warp.emulation) and the device's
    two-float max and min (fa_numba.simulator_builtins).

    numba-cuda's FakeCUDAShared.array looks up the array for its call site and creates it if missing,
    without a lock. The simulator runs every CUDA thread of a block as a Python thread, so two threads can
    both miss, each create an array, and one of them then reads a private "shared" tile that the others
    never fill. We saw it as rare wrong results (2 in 1500 random launches) that did not reproduce. This
    replaces the method with the same lookup, keyed by the caller's file and line, under a lock.
    """
    if name() != "simulator":
        return
    import threading

    import numpy as np
    from numba.cuda.simulator import kernelapi

    from fa_numba import simulator_threads
    from fa_numba.warp import emulation

    simulator_threads.install()  # a block's threads wake its runner at barriers and exits (no busy loop)
    emulation.install()  # syncwarp, shfl_*_sync, activemask: the warp collectives the simulator lacks
    from fa_numba import simulator_builtins

    simulator_builtins.install()  # two-float max / min as the device computes them (a NaN dropped)
    if getattr(kernelapi.FakeCUDAShared.array, "_fa_numba_locked", False):
        return
    kernelapi.FakeCUDAShared.array = shared_allocator(kernelapi.FakeCUDAShared.array,
                                                      lambda site, shape, dtype: np.empty(shape, dtype))

    def atomic_add(self, array, index, val, _lock=threading.Lock()):
        """One read and one write, like the hardware's read-modify-write (the simulator's own reads the
        element twice, which the traffic counts of kernels.counting would see)."""
        with _lock:
            old = array[index]
            array[index] = old + val
        return old

    kernelapi.FakeCUDAAtomic.add = atomic_add


SIM_SECONDS_PER_MAX_WORK = 20  # seconds the simulator takes for SIM_MAX_WORK (2 cores, measured)
SIM_REFUSE_SECONDS = 3600  # a simulator launch estimated longer than this is refused, not started


def check_simulator_work(batch: int, heads: int, n_q: int, n_k: int, d: int, passes: int = 1) -> None:
    """Before a launch in the simulator: refuse one it would take over an hour for (ValueError with the
    sizes that are feasible), warn before one it will take minutes over. `passes`: matrix products per
    pair relative to the forward's (the backward's is 3). Nothing happens on a GPU."""
    if name() != "simulator":
        return
    work = passes * batch * heads * n_q * n_k * d
    seconds = SIM_SECONDS_PER_MAX_WORK * work / SIM_MAX_WORK
    if seconds > SIM_REFUSE_SECONDS:
        hour = SIM_REFUSE_SECONDS * SIM_MAX_WORK // SIM_SECONDS_PER_MAX_WORK
        n_hour = int((hour / (passes * batch * heads * d)) ** 0.5)
        n_fast = int((SIM_MAX_WORK / (passes * batch * heads * d)) ** 0.5)
        raise ValueError(
            f"too large for the CUDA simulator (no GPU): {passes} x B*H*N_q*N_k*d = {work:,} would take about "
            f"{seconds:,.0f} s; feasible here: N_q = N_k <= {n_hour} at B={batch} H={heads} d={d} within "
            f"an hour, <= {n_fast} in about {SIM_SECONDS_PER_MAX_WORK} s")
    if work > SIM_MAX_WORK:
        warnings.warn(f"running in the CUDA simulator (no GPU): B*H*N_q*N_k*d = {work:,} will take about "
                      f"{seconds:,.0f} s; shapes up to {SIM_MAX_WORK:,} take seconds", stacklevel=3)


_LAUNCH_LOCK = threading.RLock()


# The simulator runs every CUDA thread of a block as a Python thread. A block of many threads spends its
# time switching between them: with 256 threads, a 2 ms switch interval ran the engine's shipped layouts
# 2.3x faster than 0.1 ms (11.8 s against 27.5 s, 2 cores, 2026-12-01), while blocks of a few threads that
# meet at barriers often run faster with frequent switches (the test suite sets 0.1 ms for them).
WIDE_BLOCK_THREADS = 128
WIDE_BLOCK_SWITCH_SECONDS = 2e-3


@contextlib.contextmanager
def serialised(threads: int = 0):
    """Around a launch: in the simulator, one launch at a time. Its launch is not re-entrant (a second
    thread's launch replaces the first's thread-to-block bookkeeping, and the first then fails with
    "'Thread' object has no attribute 'blockIdx'"), so callers on several threads queue here. Re-entrant,
    so nested launch paths are fine. A launch of blocks of `threads` >= WIDE_BLOCK_THREADS raises the
    interpreter's switch interval to at least WIDE_BLOCK_SWITCH_SECONDS for its duration (restored after).
    On a GPU it does nothing: launches stay concurrent."""
    if name() != "simulator":
        yield
        return
    with _LAUNCH_LOCK:
        before = sys.getswitchinterval()
        if threads >= WIDE_BLOCK_THREADS:
            sys.setswitchinterval(max(before, WIDE_BLOCK_SWITCH_SECONDS))
        try:
            yield
        finally:
            sys.setswitchinterval(before)
