"""`fa_numba.kernels.smem_trace` on probe kernels of one or two warps whose shared-memory wavefronts are
worked out by hand from the bank rule (32 banks of 4 bytes; 64-bit accesses per half-warp, 128-bit per
quarter-warp). Simulator only: on a GPU the tracer has nothing to hook."""

import numpy as np
import pytest
from numba import cuda, float32, float64

from fa_numba import backend
from fa_numba.kernels import smem_trace
from fa_numba.kernels.smem_trace import DivergenceError, trace_shared

pytestmark = pytest.mark.skipif(backend.name() != "simulator", reason="the tracer hooks the CUDA simulator")

WARP = 32
N = 64  # elements of the 1-D probe arrays


def traced(kernel, widths="merged", grid=1, block=WARP):
    """Launch kernel[grid, block](out) under trace_shared and return the report."""
    out = np.zeros(2 * N, np.float32)
    with trace_shared() as trace:
        kernel[grid, block](out)
    return trace.report(widths)


def counts(report, kind, width=None):
    c = report.total("sh", kind, width)
    return c.accesses, c.wavefronts, c.ideal


@cuda.jit
def store_consecutive(out):
    sh = cuda.shared.array(N, float32)
    sh[cuda.threadIdx.x] = float32(1)


@cuda.jit
def load_stride_two(out):
    sh = cuda.shared.array(N, float32)
    t = cuda.threadIdx.x
    out[t] = sh[(2 * t) % N]


@cuda.jit
def load_broadcast(out):
    sh = cuda.shared.array(N, float32)
    out[cuda.threadIdx.x] = sh[0]


@cuda.jit
def store_column_of_32(out):
    sh = cuda.shared.array((WARP, WARP), float32)
    sh[cuda.threadIdx.x, 0] = float32(1)


@cuda.jit
def store_column_of_33(out):
    sh = cuda.shared.array((WARP, WARP + 1), float32)
    sh[cuda.threadIdx.x, 0] = float32(1)


@cuda.jit
def load_column_through_row_view_32(out):
    sh = cuda.shared.array((WARP, WARP), float32)
    row = sh[cuda.threadIdx.x]
    out[cuda.threadIdx.x] = row[0]


@cuda.jit
def load_column_through_row_view_33(out):
    sh = cuda.shared.array((WARP, WARP + 1), float32)
    row = sh[cuda.threadIdx.x]
    out[cuda.threadIdx.x] = row[0]


@cuda.jit
def load_four_adjacent(out):
    sh = cuda.shared.array(4 * WARP, float32)
    t = cuda.threadIdx.x
    out[t] = sh[4 * t] + sh[4 * t + 1] + sh[4 * t + 2] + sh[4 * t + 3]


@cuda.jit
def load_two_adjacent(out):
    sh = cuda.shared.array(2 * WARP, float32)
    t = cuda.threadIdx.x
    out[t] = sh[2 * t] + sh[2 * t + 1]


@cuda.jit
def load_four_adjacent_misaligned(out):
    sh = cuda.shared.array(4 * WARP + 4, float32)
    t = cuda.threadIdx.x
    out[t] = sh[4 * t + 1] + sh[4 * t + 2] + sh[4 * t + 3] + sh[4 * t + 4]


@cuda.jit
def store_float64_pairs(out):
    sh = cuda.shared.array(2 * WARP, float64)
    t = cuda.threadIdx.x
    sh[2 * t] = 1.0
    sh[2 * t + 1] = 2.0


@cuda.jit
def store_transposed_2d_block(out):
    sh = cuda.shared.array(N, float32)
    sh[cuda.threadIdx.x * 8 + cuda.threadIdx.y] = float32(1)


@cuda.jit
def guarded_store_then_barrier_then_load(out):
    sh = cuda.shared.array(N, float32)
    t = cuda.threadIdx.x
    if t < 16:
        sh[t] = float32(1)
    cuda.syncthreads()  # every thread reaches it: the guard closes before it
    out[t] = sh[t]


@cuda.jit
def quarter_warp_loads_four_adjacent(out):
    sh = cuda.shared.array(4 * WARP, float32)
    t = cuda.threadIdx.x
    if t < 8:
        out[t] = sh[4 * t] + sh[4 * t + 1] + sh[4 * t + 2] + sh[4 * t + 3]


@cuda.jit
def divergent_store_or_load(out):
    sh = cuda.shared.array(N, float32)
    t = cuda.threadIdx.x
    if t % 2 == 0:
        sh[t] = float32(1)
    else:
        out[t] = sh[t]


def test_consecutive_store_is_one_conflict_free_access():
    assert counts(traced(store_consecutive), "store") == (1, 1, 1)


def test_stride_two_load_is_a_two_way_conflict():
    assert counts(traced(load_stride_two), "load") == (1, 2, 1)


def test_broadcast_load_costs_one_wavefront():
    assert counts(traced(load_broadcast), "load") == (1, 1, 1)


def test_column_of_rows_of_32_is_a_32_way_conflict_and_33_is_free():
    assert counts(traced(store_column_of_32), "store") == (1, 32, 1)
    assert counts(traced(store_column_of_33), "store") == (1, 1, 1)


def test_a_row_view_logs_offsets_in_its_base_array():
    assert counts(traced(load_column_through_row_view_32), "load") == (1, 32, 1)
    assert counts(traced(load_column_through_row_view_33), "load") == (1, 1, 1)


def test_four_adjacent_loads_scalar_are_four_four_way_accesses():
    # word 4t + j: lanes t, t + 8, t + 16, t + 24 ask one bank for 4 words, at each j
    report = traced(load_four_adjacent, "scalar")
    assert counts(report, "load", 4) == (4, 16, 4)
    assert report.total().degree == 4.0


def test_four_adjacent_loads_merged_are_one_conflict_free_128_bit_access():
    report = traced(load_four_adjacent, "merged")
    assert counts(report, "load", 16) == (1, 4, 4)
    assert counts(report, "load") == (1, 4, 4)  # nothing left over as scalar accesses


def test_two_adjacent_loads_merged_are_one_conflict_free_64_bit_access():
    assert counts(traced(load_two_adjacent, "merged"), "load", 8) == (1, 2, 2)
    assert counts(traced(load_two_adjacent, "scalar"), "load", 4) == (2, 4, 2)  # word 2t + j: 2-way each


def test_merging_needs_alignment():
    # offsets 4t+1 | 4t+2, 4t+3 | 4t+4: a scalar (4-way: 4), a 64-bit pair (per half-warp lanes t, t+8
    # meet: 2 + 2), a scalar (4-way: 4)
    report = traced(load_four_adjacent_misaligned, "merged")
    assert counts(report, "load", 4) == (2, 8, 2)
    assert counts(report, "load", 8) == (1, 4, 2)
    assert counts(report, "load", 16) == (0, 0, 0)


def test_float64_elements_are_64_bit_accesses_and_pairs_merge_to_128_bit():
    # scalar: element 2t + j at byte 16t + 8j, per half-warp lanes t and t + 8 meet: 2 + 2, twice
    assert counts(traced(store_float64_pairs, "scalar"), "store", 8) == (2, 8, 4)
    assert counts(traced(store_float64_pairs, "merged"), "store", 16) == (1, 4, 4)


def test_linear_thread_id_is_x_plus_y_times_block_x():
    # block (8, 8): warp 0 holds y = 0..3 and x = 0..7; word 8x + y puts x and x + 4 in one bank (2-way);
    # numbering lanes by y first would give warp 0 words 8x + y, x < 4: 32 distinct banks
    report = traced(store_transposed_2d_block, "scalar", block=(8, 8))
    assert counts(report, "store") == (2, 4, 2)


def test_barriers_separate_a_guarded_store_from_the_loads_after_it():
    report = traced(guarded_store_then_barrier_then_load, "scalar")
    assert counts(report, "store") == (1, 1, 1)  # 16 lanes
    assert counts(report, "load") == (1, 1, 1)


def test_a_quarter_warp_merged_access_costs_one_phase():
    assert counts(traced(quarter_warp_loads_four_adjacent, "merged"), "load", 16) == (1, 1, 1)


def test_divergent_lanes_raise_rather_than_being_paired():
    with pytest.raises(DivergenceError) as err:
        traced(divergent_store_or_load)
    assert "block (0, 0, 0) warp 0" in str(err.value) and "access 0" in str(err.value)


def test_two_warps_and_two_blocks_are_counted_per_block():
    report = traced(store_consecutive, "scalar", grid=2, block=2 * WARP)
    assert counts(report, "store") == (4, 4, 4)
    assert {block: (c.accesses, c.wavefronts) for block, c in report.blocks.items()} == {
        (0, 0, 0): (2, 2), (1, 0, 0): (2, 2)}


def test_sites_are_named_by_variable_file_and_line():
    (site, kind, width), = traced(store_consecutive).rows
    assert site.startswith("sh@test_smem_trace.py:") and (kind, width) == ("store", 4)


def test_a_second_launch_in_one_trace_is_refused_and_the_simulator_is_restored():
    from numba.cuda.simulator import kernel, kernelapi
    before = (kernelapi.FakeCUDAShared.array, kernel.BlockThread.syncthreads)
    out = np.zeros(N, np.float32)
    with pytest.raises(RuntimeError, match="one kernel launch"):
        with trace_shared():
            store_consecutive[1, WARP](out)
            store_consecutive[1, WARP](out)
    assert (kernelapi.FakeCUDAShared.array, kernel.BlockThread.syncthreads) == before


def test_unknown_width_mode_is_an_error():
    with trace_shared() as trace:
        store_consecutive[1, WARP](np.zeros(N, np.float32))
    with pytest.raises(ValueError, match="widths must be one of"):
        trace.report("vector")
    assert smem_trace.WIDTH_MODES == ("scalar", "merged")
