"""The whole-kernel model (fa_numba.cycle_model) on probes whose answers are worked out by hand from its
stated rule and the H200 constants (132 SMs, 1.98 GHz, 4 schedulers, 16 MUFU lanes, 128 bytes of shared
memory per cycle, 4.8 TB/s, an assumed 300-cycle L2 latency): each limiter wins once, whole blocks and
whole waves, a grid smaller than the SMs, and HBM; the resident blocks' network (mean value analysis) on
networks whose answer is known in closed form; and the dependence walk (whole_kernel.dependent_cycles) on
hand-written listings whose cycles follow from machine.PIPES: a chain, independent instructions, each pipe,
warps hiding each other's latency, a barrier."""

import dataclasses

import pytest

from fa_numba import machine, whole_kernel
from fa_numba.cycle_model import (IterationCost, Launch, estimate, iteration_cycles, mean_value_analysis,
                                  resident_blocks)
from sass_listing import listing

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
    assert cycles == {"issue": 400, "shared": 0, "mufu": 0, "tensor": 0, "l1": 0, "latency": 200}
    found = estimate(BASE, FULL)
    assert found.limiter == "issue" and found.waves == 1 and found.resident == 2 and found.busy_sms == 132
    assert found.seconds == pytest.approx(400 * 10 / CLOCK)
    assert found.tflops == pytest.approx(1e6 * 10 * 264 / (400 * 10 / CLOCK) / 1e12)


# Two resident blocks, each visiting its sub-partitions (800 / 4 = 200 cycles of issue) and the queue or delay
# the change adds; mean value analysis by hand: one block alone takes its visits' sum S; with two, the second
# finds the first at a queue with probability (its visit / S), so each queue's residence is its visit times
# (1 + that), and the iteration their sum plus the delay.
@pytest.mark.parametrize("change, limiter, cycles, iteration", [
    # shared 500 and issue 200: S = 700; 500 (1 + 5/7) + 200 (1 + 2/7) = 7800 / 7
    (dict(wavefronts=500), "shared", 2 * 500, 7800 / 7),
    # 32 lanes through 16 MUFU lanes: 600 a block, the sub-partitions' busiest part: one queue, 2 x 600
    (dict(mufu=300), "mufu", 2 * 300 * 32 / 16, 1200),
    # the block's own chain, trips x L2 + own issue, a delay of 4800 beside the issue queue: S = 5000,
    # 4800 + 200 (1 + 200 / 5000)
    (dict(load_round_trips=16), "latency", 16 * 300 + 200, 5008),
])
def test_each_on_chip_limiter_wins_when_it_is_the_largest(change, limiter, cycles, iteration):
    found = estimate(dataclasses.replace(BASE, **change), FULL)
    assert found.limiter == limiter
    assert found.cycles[limiter] == pytest.approx(cycles)
    assert found.iteration == pytest.approx(iteration)
    assert found.seconds == pytest.approx(iteration * 10 / CLOCK)


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


def test_the_tensor_core_rate_is_the_whitepapers_dense_16_bit_rate_at_mma_syncs_two_thirds():
    h200 = machine.H200
    # 4096 flops per cycle per SM: the datasheet's 989.4 TFLOP/s is 132 SMs x 4096 x 1.83 GHz
    assert 132 * h200.tensor_flops_per_cycle["f16"] * 1.83e9 / 1e12 == pytest.approx(989.4, abs=0.2)
    # an m16n8k16 is 16 x 8 x 16 multiply-adds = 4096 flops on one sub-partition's 1024 per cycle: 4 cycles at
    # the dense peak; an m16n8k8 in tf32 is half the flops at half the rate: 4 cycles too; mma.sync reaches 2/3
    # of that peak on Hopper (FlashAttention-3's measurement): 6 cycles each
    assert h200.mma_sync_fraction == pytest.approx(2 / 3)
    assert h200.mma_cycles("m16n8k16") == pytest.approx(6) and h200.mma_cycles("m16n8k8") == pytest.approx(6)
    with pytest.raises(ValueError, match="shape must be one of"):
        h200.mma_cycles("m16n8k32")


def test_a_loop_of_exactly_n_mma_is_tensor_bound_at_six_cycles_each():
    # 8 warps per block, each issuing 64 HMMA and nothing much else: 512 x 6 = 3072 tensor cycles per block,
    # 2 resident blocks on 4 tensor cores: 1536 cycles, over the 2 x 800 / 4 = 400 issue cycles
    cost = dataclasses.replace(BASE, tensor_cycles=8 * 64 * machine.H200.mma_cycles("m16n8k16"))
    found = estimate(cost, FULL)
    assert found.limiter == "tensor" and found.cycles["tensor"] == pytest.approx(1536)
    assert found.cycles["latency"] == pytest.approx(3072 / 4)  # the block's own chain: its tensor cycles
    assert found.seconds == pytest.approx(1536 * 10 / CLOCK)  # one queue, no delay: 2 x 768


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


def test_one_customer_visits_every_queue_once_and_waits_for_nobody():
    cycle, residence = mean_value_analysis(1, 300.0, {"a": 100.0, "b": 50.0})
    assert cycle == pytest.approx(450) and residence == {"a": 100, "b": 50}


@pytest.mark.parametrize("customers", [1, 2, 5, 12])
def test_balanced_queues_without_delay_cycle_in_their_closed_form(customers):
    # K queues of demand D each, no delay: X(N) = N / (D (N + K - 1)) (Lazowska et al., section 6.4's balanced
    # system), so a customer's cycle is D (N + K - 1)
    cycle, _ = mean_value_analysis(customers, 0.0, {"a": 100.0, "b": 100.0, "c": 100.0})
    assert cycle == pytest.approx(100 * (customers + 2))


def test_many_customers_approach_the_busiest_queue_and_a_few_pay_the_others():
    # with many blocks the iteration is the busiest queue's total (the old max rule); with two it is more
    few, _ = mean_value_analysis(2, 0.0, {"shared": 500.0, "issue": 200.0})
    many, _ = mean_value_analysis(64, 0.0, {"shared": 500.0, "issue": 200.0})
    assert few > 2 * 500 and many == pytest.approx(64 * 500, rel=0.01)
    with pytest.raises(ValueError, match="customers >= 1"):
        mean_value_analysis(0, 0.0, {"a": 1.0})


def test_global_lines_are_a_queue_of_their_own_at_one_line_a_cycle():
    # one block alone: its issue (200), its shared wavefronts (100) and its 32-line reads (64 x 32 lines) add up
    alone = Launch(blocks=132, warps_per_block=8, blocks_per_sm=1, iterations_per_block=10, hbm_bytes=0)
    cost = dataclasses.replace(BASE, wavefronts=100, global_lines=64 * 32)
    found = estimate(cost, alone)
    assert found.cycles["l1"] == 2048 and found.limiter == "l1"
    assert found.iteration == pytest.approx(200 + 100 + 2048)


def test_round_trips_wait_for_hbm_where_the_re_read_operands_do_not_fit_in_l2():
    cost = dataclasses.replace(BASE, load_round_trips=2)
    in_l2 = iteration_cycles(cost, FULL)["latency"]
    from_hbm = iteration_cycles(cost, dataclasses.replace(FULL, l2_resident=False))["latency"]
    h200 = machine.H200
    assert (in_l2, from_hbm) == (200 + 2 * h200.l2_latency_cycles, 200 + 2 * h200.hbm_latency_cycles)


def test_a_walked_block_prices_its_own_cycles_and_busiest_pipe():
    # the walk says the block's warps take 900 cycles alone and their busiest pipe (the ALU) 300 cycles a warp:
    # 8 warps over 4 sub-partitions visit that queue 600 cycles, the other 300 are a delay
    walked = dataclasses.replace(BASE, own_cycles=900.0, pipe_cycles=300.0, pipe="alu")
    alone = Launch(blocks=132, warps_per_block=8, blocks_per_sm=1, iterations_per_block=10, hbm_bytes=0)
    found = estimate(walked, alone)
    assert found.iteration == pytest.approx(900) and found.cycles["latency"] == pytest.approx(900)
    assert found.cycles["issue"] == pytest.approx(600)  # the ALU's 600, over the 800 / 4 issue slots
    two, _ = mean_value_analysis(2, 300.0, {"smsp": 600.0, "shared": 0.0, "l1": 0.0})
    assert estimate(walked, FULL).iteration == pytest.approx(two)


# The dependence walk: hand-written iterations (a loop body of one listing), their cycles from machine.PIPES.
def _walk(lines, warps=1):
    text = listing(*lines)
    instructions, _, _ = whole_kernel.sass.parse_sass(text)
    return whole_kernel.dependent_cycles(instructions, warps, whole_kernel._guards(text))


FFMA, ALU, MUFU, LDS, HMMA = (machine.PIPES[k] for k in ("fma", "alu", "xu", "lds", "tensor"))


def test_a_chain_of_dependent_ffma_waits_its_latency_at_each_step():
    assert _walk(["FFMA R1, R1, R2, R3"] * 8) == 8 * FFMA.latency  # carried around the loop too


def test_independent_instructions_issue_at_their_pipe_s_rate():
    n = 16
    assert _walk([f"FFMA R{10 + i}, R2, R3, R4" for i in range(n)]) == n * FFMA.cycles  # one a cycle
    assert _walk([f"IADD3 R{10 + i}, R2, R3, RZ" for i in range(n)]) == n * ALU.cycles  # 16 lanes: 2 cycles
    assert _walk([f"IMAD R{10 + i}, R2, R3, R4" for i in range(n)]) == n * machine.PIPES["imad"].cycles
    assert _walk([f"MUFU.EX2 R{10 + i}, R2" for i in range(n)]) == n * MUFU.cycles  # 16 MUFU lanes an SM
    assert _walk(["MUFU.EX2 R1, R1"] * 4) == 4 * MUFU.latency


def test_a_shared_load_s_value_is_ready_its_latency_after_the_load():
    # the load, its use 30 cycles later, and the next lap's load waiting for the register it rewrites
    assert _walk(["LDS R1, [R2]", "FADD R3, R1, R4"]) == LDS.latency + 1


def test_mma_chains_wait_their_latency_and_independent_ones_share_the_tensor_core():
    six = machine.H200.mma_cycles("m16n8k16")
    assert _walk(["HMMA.16816.F32 R4, R8, R12, R4"] * 4) == 4 * HMMA.latency  # one accumulator: a chain
    four = [f"HMMA.16816.F32 R{16 + 4 * i}, R8, R12, R{16 + 4 * i}" for i in range(4)]
    assert _walk(four) == max(HMMA.latency, 4 * six)  # four accumulators: 33, the chain's step
    eight = [f"HMMA.16816.F32 R{16 + 4 * i}, R8, R12, R{16 + 4 * i}" for i in range(8)]
    assert _walk(eight) == 8 * six  # eight: the tensor core's 48


def test_warps_of_a_sub_partition_hide_each_other_s_latency_until_issue_binds():
    chain = ["FFMA R1, R1, R2, R3"] * 8  # 32 cycles of latency, 8 issue slots a warp
    assert _walk(chain, warps=2) == _walk(chain, warps=4) == 8 * FFMA.latency  # hidden behind the chain
    assert _walk(chain, warps=8) == 8 * 8  # eight warps: 64 issue slots, more than the chain


def test_a_predicate_guard_is_read_and_a_compare_writes_its_predicates():
    # ISETP writes P0 and the guarded FADD reads it, 4 cycles later, so the next lap's ISETP issues a cycle after
    # that; unguarded, the FADD issues at once and the next ISETP waits only to rewrite P0
    assert _walk(["ISETP.GT.AND P0, PT, R2, R3, PT", "@P0 FADD R4, R5, R6"]) == ALU.latency + 1
    assert _walk(["ISETP.GT.AND P0, PT, R2, R3, PT", "FADD R4, R5, R6"]) == ALU.latency


def test_pipe_cycles_count_each_pipe_per_warp():
    instructions, _, _ = whole_kernel.sass.parse_sass(listing(
        "FFMA R1, R2, R3, R4", "IMAD R5, R6, R7, R8", "IADD3 R9, R1, R5, RZ", "MUFU.EX2 R10, R9",
        "HMMA.16816.F32 R12, R16, R20, R12", "SHFL.BFLY PT, R24, R10, 0x1, 0x1f", "BAR.SYNC.DEFER_BLOCKING 0x0"))
    used = whole_kernel.pipe_cycles(instructions)
    assert used == {"issue": 7, "fma": 2, "alu": 2, "xu": 8, "shfl": 4, "tensor": machine.H200.mma_cycles("m16n8k16")}
