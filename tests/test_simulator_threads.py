"""The simulator's block runner (fa_numba.simulator_threads): the simulator's barrier rules, and a main thread
that sleeps while a block's threads work."""

import threading
import time

import numpy as np
import pytest
from numba import cuda, int32

from fa_numba import backend, kernels  # noqa: F401  (kernels: installs the simulator patches)

pytestmark = pytest.mark.skipif(backend.name() != "simulator",
                                reason="tests the CUDA simulator's block runner, which a GPU does not use")


def _exchanges(out, rounds):
    lane = cuda.threadIdx.x
    value = lane
    for _ in range(rounds):
        value = cuda.shfl_xor_sync(0xFFFFFFFF, value, 1) + 1
    out[lane] = value


def test_the_main_thread_sleeps_while_the_lanes_exchange():
    """Two warps making 200 shuffles each: every shuffle waits for all 32 lanes, so the lanes hand the
    interpreter to each other thousands of times. A block runner that polls the threads in a loop holds the
    interpreter for most of the launch (its own CPU time near the launch's wall time); this one waits to be
    woken, so its CPU time is a small part of the launch."""
    rounds, out = 200, np.zeros(64, np.int32)
    kernel = cuda.jit(_exchanges)
    kernel[1, 64](out, 1)  # the first launch pays the simulator's setup
    wall, cpu = time.perf_counter(), time.thread_time()
    kernel[1, 64](out, rounds)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    # lane l ends with l + rounds when rounds is even (each round swaps partners' values and adds one)
    np.testing.assert_array_equal(out, np.arange(64) + rounds)
    assert cpu < 0.25 * wall, f"the launching thread used {cpu:.2f} s of CPU in {wall:.2f} s"


def _early_exit(out):
    tid = cuda.threadIdx.x
    if tid < 8:
        return
    tile = cuda.shared.array(32, int32)
    tile[tid] = tid
    cuda.syncthreads()
    out[tid] = tile[8 + (tid - 7) % 24]


def test_a_barrier_opens_for_the_threads_that_have_not_exited():
    """The simulator's rule, kept: a thread that has left its kernel does not hold a barrier closed."""
    out = np.full(32, -1, np.int32)
    cuda.jit(_early_exit)[1, 32](out)
    want = np.full(32, -1, np.int32)
    want[8:] = [8 + (tid - 7) % 24 for tid in range(8, 32)]
    np.testing.assert_array_equal(out, want)


def _counts(out):
    tid = cuda.threadIdx.x
    out[0] = cuda.syncthreads_count(tid % 3 == 0)
    out[1] = cuda.syncthreads_and(tid < 100)
    out[2] = cuda.syncthreads_or(tid == 17)
    out[3] = cuda.syncthreads_and(tid < 20)


def test_the_counting_barriers_count():
    out = np.zeros(4, np.int32)
    cuda.jit(_counts)[1, 48](out)
    np.testing.assert_array_equal(out, [16, 1, 1, 0])


def _fails_past_a_barrier(out):
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    if tid == 5:
        raise ValueError("thread five")
    cuda.syncthreads()
    out[tid] = 1


def test_an_error_in_one_thread_is_raised_and_releases_the_others():
    from numba.cuda.simulator.kernel import BlockThread

    with pytest.raises(ValueError, match=r"tid=\[5, 0, 0\].*thread five"):
        cuda.jit(_fails_past_a_barrier)[1, 32](np.zeros(32, np.int32))
    deadline = time.monotonic() + 10.0
    while any(isinstance(th, BlockThread) for th in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(isinstance(th, BlockThread) for th in threading.enumerate())
