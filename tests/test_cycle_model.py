"""The whole-kernel model (fa_numba.cycle_model) on probes whose answers are worked out by hand from its
stated rule and the H200 constants (132 SMs, 1.98 GHz, 4 schedulers, 16 MUFU lanes, 128 bytes of shared
memory per cycle, 4.8 TB/s, an assumed 300-cycle L2 latency): each limiter wins once, whole blocks and
whole waves, a grid smaller than the SMs, and HBM."""

import dataclasses

import pytest

from fa_numba import machine
from fa_numba.cycle_model import IterationCost, Launch, estimate, iteration_cycles, resident_blocks

CLOCK = 1.98e9
BASE = IterationCost(warp_instructions=800, mufu=0, wavefronts=0, load_round_trips=0, flops=1e6)
FULL = Launch(blocks=264, warps_per_block=8, blocks_per_sm=2, iterations_per_block=10, hbm_bytes=0)


def test_the_constants_are_the_h200_s():
    h200 = machine.H200
    assert (h200.sms, h200.clock_ghz, h200.mufu_lanes_per_sm, h200.shared_bytes_per_cycle) == (132, 1.98, 16, 128)
    assert h200.peak_fp32_tflops == pytest.approx(66.9, abs=0.05)  # the whitepaper's FP32 peak


def test_an_issue_bound_iteration_is_its_warp_instructions_over_four_schedulers():
    # 2 resident blocks x 800 warp instructions / 4 schedulers = 400 cycles; one block alone: 800 / 4 = 200
    cycles = iteration_cycles(BASE, FULL)
    assert cycles == {"issue": 400, "shared": 0, "mufu": 0, "tensor": 0, "latency": 200}
    found = estimate(BASE, FULL)
    assert found.limiter == "issue" and found.waves == 1 and found.resident == 2 and found.busy_sms == 132
    assert found.seconds == pytest.approx(400 * 10 / CLOCK)
    assert found.tflops == pytest.approx(1e6 * 10 * 264 / (400 * 10 / CLOCK) / 1e12)


@pytest.mark.parametrize("change, limiter, cycles", [
    (dict(wavefronts=500), "shared", 2 * 500),  # one 128-byte wavefront per cycle
    (dict(mufu=300), "mufu", 2 * 300 * 32 / 16),  # 32 lanes through 16 MUFU lanes: 2 cycles each
    (dict(load_round_trips=16), "latency", 16 * 300 + 200),  # the block's own chain: trips x L2 + own issue
])
def test_each_on_chip_limiter_wins_when_it_is_the_largest(change, limiter, cycles):
    found = estimate(dataclasses.replace(BASE, **change), FULL)
    assert found.limiter == limiter
    assert found.cycles[limiter] == pytest.approx(cycles)
    assert found.seconds == pytest.approx(cycles * 10 / CLOCK)


def test_one_block_more_than_a_wave_costs_a_whole_second_wave():
    one = Launch(blocks=132, warps_per_block=8, blocks_per_sm=1, iterations_per_block=10, hbm_bytes=0)
    more = dataclasses.replace(one, blocks=133)
    assert estimate(BASE, one).waves == 1 and estimate(BASE, more).waves == 2
    assert estimate(BASE, more).seconds == pytest.approx(2 * estimate(BASE, one).seconds)


def test_a_grid_smaller_than_the_sms_leaves_them_idle_with_one_block_each():
    small = Launch(blocks=64, warps_per_block=8, blocks_per_sm=2, iterations_per_block=10, hbm_bytes=0)
    assert resident_blocks(small) == 1  # never half a block per SM: 64 SMs busy, 68 idle
    found = estimate(BASE, small)
    assert found.busy_sms == 64 and found.cycles["issue"] == 200  # 1 block x 800 / 4
    assert found.cycles["latency"] == 200 and found.seconds == pytest.approx(200 * 10 / CLOCK)


def test_hbm_bytes_bound_the_call_when_they_take_longer():
    slow = dataclasses.replace(FULL, hbm_bytes=4.8e9)  # 1 ms at 4.8 TB/s; on chip: 4000 cycles, 2 us
    found = estimate(BASE, slow)
    assert found.limiter == "hbm" and found.seconds == pytest.approx(1e-3)


def test_an_empty_grid_is_refused():
    with pytest.raises(ValueError, match="blocks >= 1"):
        resident_blocks(dataclasses.replace(FULL, blocks=0))


def test_the_tensor_core_rate_is_the_whitepapers_dense_16_bit_rate():
    h200 = machine.H200
    # 4096 flops per cycle per SM: the datasheet's 989.4 TFLOP/s is 132 SMs x 4096 x 1.83 GHz
    assert 132 * h200.tensor_flops_per_cycle["f16"] * 1.83e9 / 1e12 == pytest.approx(989.4, abs=0.2)
    # an m16n8k16 is 16 x 8 x 16 multiply-adds = 4096 flops on one sub-partition's 1024 per cycle: 4 cycles;
    # an m16n8k8 in tf32 is half the flops at half the rate: 4 cycles too
    assert h200.mma_cycles("m16n8k16") == 4 and h200.mma_cycles("m16n8k8") == 4
    with pytest.raises(ValueError, match="shape must be one of"):
        h200.mma_cycles("m16n8k32")


def test_a_loop_of_exactly_n_mma_is_tensor_bound_at_four_cycles_each():
    # 8 warps per block, each issuing 64 HMMA and nothing much else: 512 x 4 = 2048 tensor cycles per block,
    # 2 resident blocks on 4 tensor cores: 1024 cycles, over the 2 x 800 / 4 = 400 issue cycles
    cost = dataclasses.replace(BASE, tensor_cycles=8 * 64 * machine.H200.mma_cycles("m16n8k16"))
    found = estimate(cost, FULL)
    assert found.limiter == "tensor" and found.cycles["tensor"] == pytest.approx(1024)
    assert found.cycles["latency"] == pytest.approx(2048 / 4)  # the block's own chain: its tensor cycles
    assert found.seconds == pytest.approx(1024 * 10 / CLOCK)


def test_a_one_warp_block_alone_on_an_sm_uses_one_tensor_core():
    alone = Launch(blocks=132, warps_per_block=1, blocks_per_sm=1, iterations_per_block=10, hbm_bytes=0)
    cost = IterationCost(warp_instructions=100, mufu=0, wavefronts=0, load_round_trips=0, flops=1e6,
                         tensor_cycles=64 * 4)
    assert iteration_cycles(cost, alone)["tensor"] == 256  # not 256 / 4: three tensor cores idle


def test_a_pipelined_wait_costs_its_latency_over_the_iterations_ahead_not_latency_plus_work():
    # 200 cycles of one block's own issue (800 / 4), a 300-cycle L2 latency: a copy waited for in the iteration
    # that issued it costs 300 + 200; one issued an iteration ahead max(300, 200); two ahead max(150, 200)
    dependent = iteration_cycles(dataclasses.replace(BASE, load_round_trips=1), FULL)["latency"]
    one_ahead = iteration_cycles(dataclasses.replace(BASE, pipelined_waits=1.0), FULL)["latency"]
    two_ahead = iteration_cycles(dataclasses.replace(BASE, pipelined_waits=0.5), FULL)["latency"]
    assert (dependent, one_ahead, two_ahead) == (500, 300, 200)
    slow = iteration_cycles(dataclasses.replace(BASE, pipelined_waits=4.0), FULL)["latency"]
    assert slow == 1200  # four pipelined waits an iteration: 4 x 300 whatever the work


def test_a_copy_wait_is_hidden_by_the_share_of_the_block_s_own_work_issued_before_it():
    # own issue 200 cycles (800 / 4), L2 300: a wait covered by nothing costs 300 + 200; one covered by half the
    # iteration 300 - 100 + 200; by the whole of it max(300, 200), as a copy issued an iteration ahead; two
    # waits covered by 0.4 and 0.6 of it (FlashAttention-2's V_j and K_j+1) 2 x 300 + 200 - 80 - 120
    def latency(trips, covers):
        cost = dataclasses.replace(BASE, load_round_trips=trips, copy_covers=covers)
        return iteration_cycles(cost, FULL)["latency"]

    assert latency(1, ()) == latency(1, (0.0,)) == 500
    assert latency(1, (0.5,)) == 400 and latency(1, (1.0,)) == 300
    assert latency(2, (0.4, 0.6)) == pytest.approx(600)
    # a wait hides at most its own latency: work past L does not make the iteration shorter than its work
    slow = dataclasses.replace(BASE, warp_instructions=8000, load_round_trips=1, copy_covers=(1.0,))
    assert iteration_cycles(slow, FULL)["latency"] == 2000
