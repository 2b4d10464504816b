"""The machine the static profile and the whole-kernel model reason about: sm_90 limits and the H200's size.

Every constant is named once, here, with where it comes from. Two kinds:

- architectural facts (NVIDIA documentation): occupancy limits, SM count, lanes, schedulers, banks, peak
  rates; a model built on them is only as good as its counts, but the constants themselves are not guesses;
- assumed latencies (published microbenchmarks, not NVIDIA figures): used only for the exposed latency of
  dependent loads, and the first constants to calibrate when a GPU is lent (`benchmarks/run_on_device.sh`).
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
    # Tensor cores, dense, 16-bit operands (float16 / bfloat16) with float32 accumulation: 4096 flops (2048
    # multiply-adds) per cycle per SM, 1024 on each sub-partition's tensor core. The H100 whitepaper gives the
    # GH100 SM twice the A100's 1024 dense FP16 FMA per cycle; the datasheet's 989.4 TFLOP/s (SXM) is
    # 132 x 4096 x 1.83 GHz, a lower clock than the FP32 figure's, so at this model's one clock the tensor
    # peak reads 1070 (8% optimistic). TF32 runs at half the 16-bit rate. Assumed, not documented: that the
    # warp-level mma.sync (HMMA) this project emits reaches that rate at all. Hopper's full rate is quoted for
    # the warpgroup wgmma, and public FlashAttention-2 (mma.sync) runs reach about 35-40% of it; so the model's
    # tensor term is a floor on the time the products take, the first constant to calibrate on a GPU.
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
        tensor core at the full dense rate: 2 m n k flops over a quarter of the SM's rate (4 for both)."""
        dims = {"m16n8k16": (16, 8, 16, "f16"), "m16n8k8": (16, 8, 8, "tf32")}
        if shape not in dims:
            raise ValueError(f"shape must be one of {tuple(dims)}, got {shape!r}")
        m, n, k, kind = dims[shape]
        return 2 * m * n * k / (self.tensor_flops_per_cycle[kind] / SM90.schedulers_per_sm)

    @property
    def cycles_per_s(self) -> float:
        return self.clock_ghz * 1e9


H200 = Device()
