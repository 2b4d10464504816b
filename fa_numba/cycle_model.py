"""The whole-kernel estimate: one tile-loop iteration's costs, priced on one SM, times the launch's waves.

**An estimate from a model, never a measurement.** `fa_numba.profile` fills `IterationCost` from the SASS
(every instruction of one iteration of the kernel's tile loop, inner loops times their trip counts) and
from the simulator (shared-memory wavefronts at the addresses the kernel really touches), and `Launch` from
the occupancy and the grid; `estimate` prices them with the constants of `fa_numba.machine`:

Per iteration, an SM holding `resident` blocks of the launch (whole blocks: the launch's blocks spread over
the SMs, at most the occupancy's blocks per SM) spends at least

    issue    resident x warp instructions / 4           (4 schedulers, one warp instruction per cycle each)
    shared   resident x wavefronts                     (one 128-byte wavefront per cycle)
    mufu     resident x MUFU warp instructions x 32 / 16  (16 MUFU results per cycle)
    tensor   resident x tensor-core cycles / min(resident warps, 4)  (one tensor core per sub-partition: an
             mma.sync m16n8k16 holds it `Device.mma_cycles` = 4 cycles at the dense peak; tensor-core kernels)
    latency  load round trips x L2 latency + one block's own work (its issue, or its tensor-core cycles if
             longer, on min(warps, 4) sub-partitions): a block cannot hide its own dependent loads, only other
             blocks' work can, except the share of its own work issued between a cp.async copy and its wait
             (`sass.async_copy_covers`: FlashAttention-2's order issues V_j before S and K_j+1 before the
             softmax and P V, so each wait costs max(0, L - its share x own)); or, if longer, the pipelined
             waits x L2 latency: a copy issued N iterations before its wait (cp.async.wait_group N,
             `sass.pipelined_copy_waits`) needs only L / N of each iteration, whatever the block does meanwhile

cycles, and the iteration takes the largest (the limiter). The call takes waves x iterations per block of
those (whole waves: a partial last wave costs a full one), or the HBM time of its bytes if that is longer.
What it leaves out: the prologue and epilogue of each block (loading Q, writing O), instruction-cache and
dependency stalls other than global loads, L2 bandwidth, and the tail of causal schedules whose blocks run
different iteration counts (`Launch.iterations_per_block` is the mean; the waves then overstate it less than
they would understate the slowest block). Each piece is tested on probes with known answers
(tests/test_cycle_model.py) before it judges a kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fa_numba.banks import BANK_BYTES, BANKS
from fa_numba.machine import H200, SM90, Device

WAVEFRONT_BYTES = BANKS * BANK_BYTES  # one wavefront moves one word from every bank
LIMITERS = ("issue", "shared", "mufu", "tensor", "latency", "hbm")


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


@dataclass(frozen=True)
class Launch:
    """The launch the iteration cost is repeated over."""

    blocks: int  # the grid's blocks
    warps_per_block: int
    blocks_per_sm: int  # the occupancy's limit
    iterations_per_block: float  # tile-loop iterations a block runs (the mean over blocks)
    hbm_bytes: float  # bytes the call moves to and from HBM


@dataclass(frozen=True)
class Estimate:
    seconds: float
    tflops: float
    limiter: str  # one of LIMITERS
    cycles: dict  # per iteration per SM, each limiter's cycles (hbm: the HBM time spread over the iterations)
    resident: int  # blocks per busy SM
    waves: int
    busy_sms: int

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "tflops": round(self.tflops, 2), "limiter": self.limiter,
                "cycles": {k: round(v, 1) for k, v in self.cycles.items()}, "resident": self.resident,
                "waves": self.waves, "busy_sms": self.busy_sms}


def resident_blocks(launch: Launch, device: Device = H200) -> int:
    """Blocks per busy SM: the occupancy's limit, or fewer when the grid has fewer blocks than SMs x limit
    (the scheduler spreads them, whole blocks, one SM after another)."""
    if launch.blocks < 1 or launch.blocks_per_sm < 1:
        raise ValueError(f"a launch needs blocks >= 1 and blocks_per_sm >= 1, got {launch.blocks} and "
                         f"{launch.blocks_per_sm}")
    return min(launch.blocks_per_sm, math.ceil(launch.blocks / device.sms))


def iteration_cycles(cost: IterationCost, launch: Launch, device: Device = H200) -> dict:
    """Each on-chip limiter's cycles for one iteration of every resident block of one SM (module docstring)."""
    resident = resident_blocks(launch, device)
    schedulers = SM90.schedulers_per_sm
    own = max(cost.warp_instructions, cost.tensor_cycles) / min(launch.warps_per_block, schedulers)
    return {
        "issue": resident * cost.warp_instructions / schedulers,
        "shared": resident * cost.wavefronts * WAVEFRONT_BYTES / device.shared_bytes_per_cycle,
        "mufu": resident * cost.mufu * SM90.warp_size / device.mufu_lanes_per_sm,
        "tensor": resident * cost.tensor_cycles / min(resident * launch.warps_per_block, schedulers),
        "latency": max(cost.load_round_trips * device.l2_latency_cycles + own
                       - sum(min(device.l2_latency_cycles, cover * own) for cover in cost.copy_covers),
                       cost.pipelined_waits * device.l2_latency_cycles),
    }


def estimate(cost: IterationCost, launch: Launch, device: Device = H200) -> Estimate:
    """The call's time and throughput, and what limits it (module docstring)."""
    resident = resident_blocks(launch, device)
    waves = math.ceil(launch.blocks / (device.sms * resident))
    cycles = iteration_cycles(cost, launch, device)
    iterations = waves * launch.iterations_per_block
    on_chip = max(cycles.values()) * iterations / device.cycles_per_s
    hbm = launch.hbm_bytes / device.hbm_bytes_per_s
    cycles["hbm"] = hbm * device.cycles_per_s / iterations if iterations else math.inf
    seconds = max(on_chip, hbm)
    limiter = max(cycles, key=cycles.get)
    flops = cost.flops * launch.iterations_per_block * launch.blocks
    return Estimate(seconds, flops / seconds / 1e12 if seconds else 0.0, limiter, cycles, resident, waves,
                    min(device.sms, math.ceil(launch.blocks / resident)))
