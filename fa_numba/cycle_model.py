"""The whole-kernel estimate: one tile-loop iteration's costs, priced on one SM, times the launch's waves.

**An estimate from a model, never a measurement.** `fa_numba.profile` fills `IterationCost` from the SASS
(every instruction of one iteration of the kernel's tile loop, inner loops times their trip counts, and the
dependence walk of that iteration: `whole_kernel.walk`) and from the simulator (shared-memory wavefronts and
the 128-byte lines of the global accesses at the addresses the kernel really touches), and `Launch` from the
occupancy and the grid; `estimate` prices them with the constants of `fa_numba.machine`.

An SM holds `resident` blocks of the launch (whole blocks: the launch's blocks spread over the SMs, at most
the occupancy's blocks per SM). Each block's iteration visits, one after the other,

    smsp     its sub-partitions' busiest pipe: per warp the most of its issue slots (one an instruction), its
             ALU, FMA, MUFU / conversion, shuffle and tensor-core cycles (`whole_kernel.pipe_cycles`), times the
             block's warps over 4 sub-partitions (without a walk: its warp instructions / 4, its MUFU
             instructions x 32 / 16 lanes, or its tensor-core cycles over min(warps, 4) tensor cores)
    shared   its shared-memory wavefronts (one 128-byte wavefront per cycle per SM)
    l1       the 128-byte lines its global accesses touch (`Device.l1_lines_per_cycle`: a warp reading 32 rows
             of a row-major tile touches 32 lines, a coalesced read 1)
    latency  a delay no other block contends for: the cycles its own warps take alone beyond the smsp visit
             (the dependence walk: register dependences, pipe latencies, barriers; without a walk, none beyond
             its busiest pipe), and the global-load round trips it waits for (`Device.l2_latency_cycles`, or
             `hbm_latency_cycles` where the launch's re-read operands do not fit in L2), each cp.async wait less
             the share of the block's own work issued between its copies and it (`sass.async_copy_covers`), a
             copy issued N iterations ahead (cp.async.wait_group N) needing L / N of the iteration at least

and the resident blocks share the three queues: exact mean value analysis of that closed network (Reiser and
Lavenberg, 1980; Lazowska et al., "Quantitative System Performance", 1984, chapter 6) with the blocks as its
customers gives the cycles in which every resident block does one iteration. One block alone takes the sum
of its visits (its phases between barriers do not overlap: the walk says how long its own chains are); many
blocks approach the busiest queue's total (the old rule, `max(terms)`, was that limit, a lower bound that the
first GPU measurements exceeded 1.1-3x, the more so the fewer blocks were resident). Each term of `cycles` is
one queue's total for the resident blocks (issue, mufu, tensor: the smsp queue's three parts, as the old terms;
latency: one block's own iteration alone, its delay plus its smsp visit); `limiter` names the part of the
iteration that takes longest (a queue's residence, or the delay).

The call takes waves x iterations per block of those cycles (whole waves: a partial last wave costs a full
one), or the HBM time of its bytes if that is longer. What it leaves out: the prologue and epilogue of each
block (loading Q, writing O), instruction-cache stalls, L2 bandwidth, and the tail of causal schedules whose
blocks run different iteration counts (`Launch.iterations_per_block` is the mean). Each piece is tested on
probes with known answers (tests/test_cycle_model.py) and the whole on the GPU's measured rows
(tests/test_calibration.py) before it judges a kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fa_numba.banks import BANK_BYTES, BANKS
from fa_numba.machine import H200, SM90, Device

WAVEFRONT_BYTES = BANKS * BANK_BYTES  # one wavefront moves one word from every bank
LIMITERS = ("issue", "shared", "mufu", "tensor", "l1", "latency", "hbm")


@dataclass(frozen=True)
class IterationCost:
    """What one iteration of the tile loop costs one block."""

    warp_instructions: float  # issued per block: instructions per thread x warps per block
    mufu: float  # MUFU warp instructions per block
    wavefronts: float  # shared-memory wavefronts per block
    load_round_trips: float  # dependent global-load waits of one thread (each an L2 round trip)
    flops: float  # useful floating-point operations per block (2 per multiply-add of the products)
    tensor_cycles: float = 0.0  # cycles the block's mma.sync instructions hold a tensor core (Device.mma_cycles)
    pipelined_waits: float = 0.0  # waits for copies issued iterations ahead: the sum of 1/N over wait_group N >= 1
    # the copy waits among the round trips, each as the share of the iteration's own work issued between its
    # copies and it (sass.async_copy_covers): that much of its L2 latency is hidden by the block's own work
    copy_covers: tuple[float, ...] = ()
    # the dependence walk (whole_kernel.walk): the cycles the block's warps on one sub-partition take alone for
    # one iteration, and the busiest pipe's cycles per warp; 0: not walked (the busiest of issue, MUFU, tensor)
    own_cycles: float = 0.0
    pipe_cycles: float = 0.0
    pipe: str = "issue"  # which pipe pipe_cycles is: a key of whole_kernel.pipe_cycles
    global_lines: float = 0.0  # 128-byte lines the block's global accesses touch (traced; 0: not traced)


@dataclass(frozen=True)
class Launch:
    """The launch the iteration cost is repeated over."""

    blocks: int  # the grid's blocks
    warps_per_block: int
    blocks_per_sm: int  # the occupancy's limit
    iterations_per_block: float  # tile-loop iterations a block runs (the mean over blocks)
    hbm_bytes: float  # bytes the call moves to and from HBM
    l2_resident: bool = True  # whether the operands its blocks re-read stay in L2 (else round trips wait for HBM)


@dataclass(frozen=True)
class Estimate:
    seconds: float
    tflops: float
    limiter: str  # one of LIMITERS
    cycles: dict  # per iteration per SM, each limiter's cycles (hbm: the HBM time spread over the iterations)
    resident: int  # blocks per busy SM
    waves: int
    busy_sms: int
    iteration: float = 0.0  # cycles in which every resident block of an SM does one iteration (the network's)

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "tflops": round(self.tflops, 2), "limiter": self.limiter,
                "cycles": {k: round(v, 1) for k, v in self.cycles.items()}, "resident": self.resident,
                "waves": self.waves, "busy_sms": self.busy_sms, "iteration": round(self.iteration, 1)}


def resident_blocks(launch: Launch, device: Device = H200) -> int:
    """Blocks per busy SM: the occupancy's limit, or fewer when the grid has fewer blocks than SMs x limit
    (the scheduler spreads them, whole blocks, one SM after another)."""
    if launch.blocks < 1 or launch.blocks_per_sm < 1:
        raise ValueError(f"a launch needs blocks >= 1 and blocks_per_sm >= 1, got {launch.blocks} and "
                         f"{launch.blocks_per_sm}")
    return min(launch.blocks_per_sm, math.ceil(launch.blocks / device.sms))


def _visits(cost: IterationCost, launch: Launch, device: Device = H200) -> tuple[dict, float, str]:
    """({queue: one block's visit in cycles}, its delay, the smsp queue's busiest part): the module docstring's
    network for one block of the launch."""
    schedulers = SM90.schedulers_per_sm
    warps = launch.warps_per_block
    if cost.pipe_cycles:  # the walk's busiest pipe per warp, over the block's warps on 4 sub-partitions
        busiest = {"xu": "mufu", "tensor": "tensor"}.get(cost.pipe, "issue")
        smsp = cost.pipe_cycles * warps / schedulers
    else:
        parts = {"issue": cost.warp_instructions / schedulers,
                 "mufu": cost.mufu * SM90.warp_size / device.mufu_lanes_per_sm,
                 "tensor": cost.tensor_cycles / min(warps, schedulers)}
        busiest = max(parts, key=parts.get)
        smsp = parts[busiest]
    own = cost.own_cycles or max(smsp, max(cost.warp_instructions, cost.tensor_cycles) / min(warps, schedulers))
    latency = device.l2_latency_cycles if launch.l2_resident else device.hbm_latency_cycles
    plain = cost.load_round_trips - len(cost.copy_covers)
    waits = plain * latency + sum(max(0.0, latency - cover * own) for cover in cost.copy_covers)
    alone = max(own + waits, cost.pipelined_waits * latency)
    visits = {"smsp": smsp, "shared": cost.wavefronts * WAVEFRONT_BYTES / device.shared_bytes_per_cycle,
              "l1": cost.global_lines / device.l1_lines_per_cycle}
    return visits, max(0.0, alone - smsp), busiest


def mean_value_analysis(customers: int, delay: float, demands: dict) -> tuple[float, dict]:
    """Exact mean value analysis of a closed network: `customers` cycling through a delay (no queue) and the
    queues of `demands` (one visit of each, its service time). Returns (the cycle time with every customer
    in, each queue's residence time per visit): Reiser and Lavenberg's recursion, R_k(n) = D_k (1 + Q_k(n - 1)),
    X(n) = n / (Z + sum R_k(n)), Q_k(n) = X(n) R_k(n)."""
    if customers < 1:
        raise ValueError(f"a network needs customers >= 1, got {customers}")
    queued = dict.fromkeys(demands, 0.0)
    for n in range(1, customers + 1):
        residence = {k: d * (1 + queued[k]) for k, d in demands.items()}
        cycle = delay + sum(residence.values())
        queued = {k: n * r / cycle if cycle else 0.0 for k, r in residence.items()}
    return cycle, residence


def iteration_cycles(cost: IterationCost, launch: Launch, device: Device = H200) -> dict:
    """Each term of the module docstring for one iteration of every resident block of one SM: the queues'
    totals (issue, mufu and tensor as the smsp queue's parts), and latency, one block's iteration alone."""
    resident = resident_blocks(launch, device)
    schedulers = SM90.schedulers_per_sm
    visits, delay, busiest = _visits(cost, launch, device)
    parts = {"issue": resident * cost.warp_instructions / schedulers,
             "mufu": resident * cost.mufu * SM90.warp_size / device.mufu_lanes_per_sm,
             "tensor": resident * cost.tensor_cycles / min(resident * launch.warps_per_block, schedulers)}
    parts[busiest] = max(parts[busiest], resident * visits["smsp"])  # the walk's busiest pipe, where it is more
    return {**parts, "shared": resident * visits["shared"], "l1": resident * visits["l1"],
            "latency": delay + visits["smsp"]}


def estimate(cost: IterationCost, launch: Launch, device: Device = H200) -> Estimate:
    """The call's time and throughput, and what limits it (module docstring)."""
    resident = resident_blocks(launch, device)
    waves = math.ceil(launch.blocks / (device.sms * resident))
    cycles = iteration_cycles(cost, launch, device)
    visits, delay, busiest = _visits(cost, launch, device)
    iteration, residence = mean_value_analysis(resident, delay, visits)
    iterations = waves * launch.iterations_per_block
    on_chip = iteration * iterations / device.cycles_per_s
    hbm = launch.hbm_bytes / device.hbm_bytes_per_s
    cycles["hbm"] = hbm * device.cycles_per_s / iterations if iterations else math.inf
    seconds = max(on_chip, hbm)
    parts = {busiest: residence["smsp"], "shared": residence["shared"], "l1": residence["l1"], "latency": delay}
    limiter = "hbm" if hbm > on_chip else max(parts, key=parts.get)
    flops = cost.flops * launch.iterations_per_block * launch.blocks
    return Estimate(seconds, flops / seconds / 1e12 if seconds else 0.0, limiter, cycles, resident, waves,
                    min(device.sms, math.ceil(launch.blocks / resident)), iteration)
