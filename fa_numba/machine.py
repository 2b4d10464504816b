"""The machine the static profile and the whole-kernel model reason about: sm_90 limits and the H200's size.

Every constant is named once, here, with where it comes from. Two kinds:

- architectural facts (NVIDIA documentation): occupancy limits, SM count, lanes, schedulers, banks, peak
  rates; a model built on them is only as good as its counts, but the constants themselves are not guesses;
- assumed latencies and rates (published microbenchmarks, not NVIDIA figures): the exposed latency of dependent
  loads, the dependence walk's result latencies (`PIPES`), HBM's latency, the L1 tag rate and mma.sync's share
  of the tensor peak; each says where it comes from, none is fitted to a measured kernel, and they are the
  first constants to check when a GPU is lent (`benchmarks/run_on_device.sh`; the calibration rows,
  `benchmarks/results/calibration_h200_2026-12-04.json`, are predicted with them).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limits:
    """sm_90 occupancy limits: the CUDA Occupancy Calculator and the CUDA C++ Programming Guide, "Features and
    Technical Specifications", compute capability 9.0."""

    registers_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    shared_per_sm: int = 228 * 1024  # bytes, the largest carveout
    shared_reserved_per_block: int = 1024  # bytes the runtime reserves in every block's shared memory
    shared_alloc_unit: int = 128  # bytes
    register_alloc_unit: int = 256  # registers, allocated per warp
    max_registers_per_thread: int = 255
    warp_size: int = 32
    schedulers_per_sm: int = 4  # four SM sub-partitions, each issuing one warp instruction per cycle
    fp32_lanes_per_sm: int = 128  # 32 FP32 lanes per sub-partition: one warp-wide FFMA per cycle each


SM90 = Limits()


@dataclass(frozen=True)
class Pipe:
    """What one SASS instruction of a class costs one SM sub-partition: the cycles it holds its pipe (a warp
    instruction over the pipe's lanes: 32 / (results per clock per SM / 4)) and the cycles until a dependent
    instruction may issue (its result latency)."""

    cycles: float
    latency: float


# The SM sub-partition's pipes, for the dependence walk (`whole_kernel.dependent_cycles`). Throughputs: the CUDA
# C++ Programming Guide's "Arithmetic Instructions" table, compute capability 9.0, in results per clock per SM:
# 32-bit floating-point add / multiply / multiply-add 128 (one warp instruction a cycle a sub-partition; Nsight
# Compute's pipelines put FFMA on either FMA pipe, IMAD on the heavy one only: 2 cycles), 32-bit integer add /
# compare / min / max / logic / shift 64 (the ALU: 2 cycles a warp instruction), type conversions and the MUFU
# functions 16 (8 cycles), warp shuffle 32 (4 cycles); tensor cores: `Device.mma_cycles`. Result latencies
# (assumed, not NVIDIA figures, not fitted): 4 cycles for the fixed-latency FP32 and integer pipes (Jia et al.,
# "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018, and their Turing report, 2019,
# measure 4 to 6 for the common arithmetic), 18 for MUFU and conversions and 24 for shuffles (of the order
# those reports measure), 30 for a shared-memory load or ldmatrix (the microbenchmark papers find 19 to 33
# cycles from Volta to Hopper), 33 for mma.sync m16n8k16 / m16n8k8 (of the order Sun et al., "Dissecting Tensor
# Cores via Microbenchmarks", 2022, measure on A100; taken unchanged on Hopper), 20 for special-register reads,
# 8 for constant loads, 2 for the uniform datapath. A global load's memory latency is not a result latency
# here: the round trips charge it (`Device.l2_latency_cycles`, `hbm_latency_cycles`).
PIPES = {
    "fma": Pipe(1, 4),  # FFMA, FADD, FMUL, HFMA2: either FMA pipe
    "imad": Pipe(2, 4),  # IMAD, IMUL: the heavy FMA pipe
    "alu": Pipe(2, 4),  # integer, logic, compare, select, FMNMX, FSETP, F2FP, moves
    "xu": Pipe(8, 18),  # MUFU, I2F, F2I, F2F
    "shfl": Pipe(4, 24),
    "tensor": Pipe(0, 33),  # its pipe cycles: Device.mma_cycles of the instruction's shape
    "lds": Pipe(1, 30),  # LDS, LDSM: the shared-memory wavefronts are the SM-wide term
    "ldg": Pipe(1, 4),  # LDG, LD, LDL: the memory latency is the round trips'
    "store": Pipe(1, 0),  # STS, STG, RED, LDGSTS, atomics: no register result
    "uniform": Pipe(1, 2),  # U* instructions, S2UR
    "s2r": Pipe(1, 20),
    "ldc": Pipe(1, 8),
    "control": Pipe(1, 0),  # branches, barriers, NOP, DEPBAR
}


@dataclass(frozen=True)
class Device:
    """One GPU: its size, clock and the rates of the pipes the model charges.

    Sources: NVIDIA H100 Tensor Core GPU Architecture whitepaper (GH100: 132 SMs in the SXM part, 50 MB L2,
    FP32 peak 66.9 TFLOP/s = 132 x 128 x 2 x 1.98 GHz) and the H200 datasheet (same GH100 SMs; 4.8 TB/s of
    HBM3e); the CUDA C++ Programming Guide's throughput table ("Arithmetic Instructions"), compute capability
    9.0: 16 results per cycle per SM for the MUFU functions (exp2, log2, reciprocal, rsqrt, sin, cos); and its
    "Shared Memory" section: 32 banks of 4 bytes, one 128-byte wavefront per cycle per SM.
    """

    name: str = "H200 SXM"
    sms: int = 132
    clock_ghz: float = 1.98  # the boost clock the peak figures use
    mufu_lanes_per_sm: int = 16  # MUFU.EX2 / MUFU.RCP results per cycle per SM
    shared_bytes_per_cycle: int = 128  # per SM: one wavefront (32 banks x 4 bytes) per cycle
    hbm_bytes_per_s: float = 4.8e12
    l2_bytes: int = 50 * 1024 * 1024
    # Assumed, not documented: load-to-use latency of a global load that hits in L2, in cycles. Published
    # microbenchmarks of Hopper (Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture",
    # 2024) measure roughly 260-300 cycles; the model takes 300 and says so. Calibrate on a GPU.
    l2_latency_cycles: int = 300
    # Assumed: load-to-use latency of a global load that misses L2 and waits for HBM, in cycles (about 300 ns at
    # the model's clock; the figures quoted for H100-class HBM run from 400 to 800 cycles, and the cycle-level
    # reference simulation of 2026-12-01 took 600). A round trip pays it where the call's re-read operands do
    # not fit in L2 (`whole_kernel.hbm_bytes`: v1's O, l, m and Q of every head in flight). Fitted on the
    # calibration rows it would be about 1000 (tests/test_calibration.py's leave-one-out): it is not fitted.
    hbm_latency_cycles: int = 600
    # Assumed: 128-byte cache lines the L1 resolves per cycle for global accesses (Nsight Compute's L1TEX model
    # processes a warp's global request in its tag stage, line by line; one line a cycle, as the cycle-level
    # reference simulation took). A warp whose 32 lanes read 32 rows of a row-major tile touches 32 lines where
    # a coalesced read touches 1; shared memory's wavefronts do not pass the tag stage.
    l1_lines_per_cycle: float = 1.0
    # mma.sync (HMMA) on Hopper reaches about 2/3 of the tensor cores' dense peak: the FlashAttention-3 paper
    # (Shah et al., 2024, section 2.2, citing Luo et al.'s microbenchmarks) says the warp-level mma.sync "can
    # only reach about 2/3 the peak throughput of the Hopper Tensor Cores", the full rate being the warpgroup
    # wgmma's. So an HMMA holds its sub-partition's tensor core 3/2 x its dense-peak cycles (`mma_cycles`).
    mma_sync_fraction: float = 2 / 3
    # Tensor cores, dense, 16-bit operands (float16 / bfloat16) with float32 accumulation: 4096 flops (2048
    # multiply-adds) per cycle per SM, 1024 on each sub-partition's tensor core. The H100 whitepaper gives the
    # GH100 SM twice the A100's 1024 dense FP16 FMA per cycle; the datasheet's 989.4 TFLOP/s (SXM) is
    # 132 x 4096 x 1.83 GHz, a lower clock than the FP32 figure's, so at this model's one clock the tensor
    # peak reads 1070 (8% optimistic). TF32 runs at half the 16-bit rate. Assumed, not documented: that the
    # warp-level mma.sync (HMMA) this project emits reaches that rate at all. Hopper's full rate is quoted for
    # the warpgroup wgmma, and public FlashAttention-2 (mma.sync) runs reach about 35-40% of it; so the model's
    # tensor term is a floor on the time the products take (`mma_sync_fraction` says how far from it).
    tensor_flops_per_cycle: dict = field(default_factory=lambda: {"f16": 4096, "tf32": 2048})

    @property
    def peak_fp32_tflops(self) -> float:
        """FFMA counts 2 flops per lane: SMs x 128 lanes x 2 x clock."""
        return self.sms * SM90.fp32_lanes_per_sm * 2 * self.clock_ghz / 1e3

    @property
    def peak_tensor_tflops(self) -> float:
        """Dense 16-bit tensor-core peak at the model's clock: SMs x 4096 x clock (1070 on the H200 model)."""
        return self.sms * self.tensor_flops_per_cycle["f16"] * self.clock_ghz / 1e3

    def mma_cycles(self, shape: str) -> float:
        """Cycles one warp's mma.sync of `shape` ("m16n8k16" 16-bit, "m16n8k8" tf32) holds its sub-partition's
        tensor core: 2 m n k flops over a quarter of the SM's dense rate (4 cycles for both), at mma.sync's
        share of that rate (`mma_sync_fraction`: 6 cycles)."""
        dims = {"m16n8k16": (16, 8, 16, "f16"), "m16n8k8": (16, 8, 8, "tf32")}
        if shape not in dims:
            raise ValueError(f"shape must be one of {tuple(dims)}, got {shape!r}")
        m, n, k, kind = dims[shape]
        dense = 2 * m * n * k / (self.tensor_flops_per_cycle[kind] / SM90.schedulers_per_sm)
        return dense / self.mma_sync_fraction

    @property
    def cycles_per_s(self) -> float:
        return self.clock_ghz * 1e9


H200 = Device()
