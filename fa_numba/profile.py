"""The static profile of every kernel variant, read from the SASS a launch on an H100/H200 would run.

    python -m fa_numba profile [--orders v1,v2] [--head-dims 64,128,256] [--dtypes float32,float16,tf32]
                               [--causal off|on|both] [--arch sm_90a] [--json PATH] [--jobs N] [--no-estimate]

No GPU is needed. For each registered variant and configuration this module

1. compiles the kernel exactly as `cuda.jit` does before a launch: Numba's NVVM IR, compiled to LTO-IR for
   `compute_90a` and linked by nvJitLink with `-lto` for `sm_90a` (numba-cuda adds the "a" suffix for
   compute capability >= 9.0). The link adds `-verbose`, which prints ptxas's resource line and changes no
   instruction (a test compares the SASS with the cubin of Numba's own `get_cubin`);
2. reads registers, spill bytes, stack frame and static shared memory from that log;
3. disassembles the cubin with `nvdisasm` (the `profile` extra: `pip install "fa_numba[profile]"`, NVIDIA's
   CUDA 13 wheel `nvidia-cuda-nvdisasm`), finds the innermost loops of the control flow (`fa_numba.sass`: a
   branch back to an earlier address closes a loop spanning [target, branch]; a loop that contains no other
   is innermost) and counts each one's instruction mix per iteration;
4. computes the theoretical occupancy from the sm_90 limits in `SM90` and names the limiting resource;
5. derives a static FP32 throughput bound of the hot loops (`bound`, printed as "hot-loop"), and
6. unless --no-estimate, the whole-kernel estimate and its limiter (`fa_numba.profile_estimate`: one
   tile-loop iteration's counts from `fa_numba.whole_kernel`, its shared-memory wavefronts traced in the
   simulator, priced by `fa_numba.cycle_model`). Both are **read from the code, never a measurement**.

The hot-loop bound. An H200 SM issues at most one warp instruction per cycle on each of its 4 schedulers, and
its 128 FP32 lanes retire 4 warp-wide FFMAs (2 flops per lane each) per cycle: peak = SMs x 128 x 2 x
clock. In the hot loops (`hot_loops`: the innermost loops whose FFMAs multiply operands loaded from shared or
local memory, with no MUFU, each counted once per iteration), a fraction
FFMA / issued of the issue slots does useful work (`issue_fraction`), and the shared/local memory pipe
accepts at most one warp instruction per cycle per SM, so FFMA / (4 x (LDS + STS + LDL + STL)) is a second
cap (`lsu_fraction`; a wider or bank-conflicting access takes longer, so this is optimistic). Finally a
launch of B=4, H=16, N=4096 (by default) keeps each scheduler busy only if the SM holds at least 4 warps:
`fill` = min(1, resident warps per SM / 4), the resident warps being the launch's warps spread over the
SMs, capped by the occupancy. bound = peak x min(issue_fraction, lsu_fraction) x fill. It ignores latency,
exp/reduction work outside the hot loops, the tail of the last wave and global-memory bandwidth: a real
kernel runs below it, never above.

The SASS of a kernel is only visible through the real numba.cuda, so in a process where the CUDA simulator
is active `main` re-runs itself in a subprocess with NUMBA_ENABLE_CUDASIM=0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from fa_numba import arguments, sources, whole_kernel
from fa_numba.profile_estimate import LEGEND, attach_estimates, finish_wavefronts, start_wavefronts
from fa_numba.machine import H200, SM90, Device, Limits  # noqa: F401 - profile.Device etc.
from fa_numba.sass import (CATEGORIES, LSU_CATEGORIES, Instruction, Loop,  # noqa: F401 - profile.Loop etc.
                           float64_instructions, hot_loops, innermost_loops, parse_sass)

ARCH = "sm_90a"  # what numba-cuda compiles for on an H100/H200 (compute capability 9.0 + "a")

# The machine (sm_90 limits, the H200's size and rates) is fa_numba.machine's, imported here by name.
DEFAULT_LAUNCH = dict(batch=4, heads=16, n=4096)  # the shape the issue's targets are stated at
# The SASS table of every shipped configuration, committed with the digest of the sources it was compiled from
# (`sources.kernel_digest`); a default-tier test fails when they differ. Made by:
#     python -m fa_numba profile --no-estimate --json benchmarks/results/sass_table_sm90a.json
SHIPPED_TABLE = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "sass_table_sm90a.json"


# ----------------------------------------------------------------------------------------------------
# Resources, occupancy, bound.

def parse_ptxas(log: str) -> dict:
    """Registers, spill bytes, stack frame and static shared memory of the single kernel in a verbose link log."""

    def grab(pattern, default=None):
        found = re.search(pattern, log)
        return int(found.group(1)) if found else default

    return dict(
        registers=grab(r"[Uu]sed (\d+) registers"),
        spill_stores=grab(r"(\d+) bytes spill stores", 0),
        spill_loads=grab(r"(\d+) bytes spill loads", 0),
        stack=grab(r"(\d+) bytes stack frame", 0),
        smem=grab(r"(\d+) bytes smem", 0),
    )


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy(threads: int, registers: int, smem: int, limits: Limits = SM90) -> dict:
    """Theoretical resident blocks and warps per SM, and the resource that limits them."""
    warps = -(-threads // limits.warp_size)
    regs_per_warp = _round_up(max(registers, 1) * limits.warp_size, limits.register_alloc_unit)
    by = {
        "registers": (limits.registers_per_sm // regs_per_warp) // warps,
        "shared memory": limits.shared_per_sm // (_round_up(smem, limits.shared_alloc_unit)
                                                  + limits.shared_reserved_per_block),
        "warps": limits.max_warps_per_sm // warps,
        "blocks": limits.max_blocks_per_sm,
    }
    blocks = min(by.values())
    limiter = min(by, key=lambda k: (by[k], list(by).index(k)))
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps, "warps_per_block": warps, "limiter": limiter,
            "by_resource": by}


def bound(loops: list[Loop], occ: dict, launch_warps: int, device: Device = H200) -> dict:
    """The static FP32 bound (see the module docstring) from the hot loops, the occupancy and the launch."""
    hot = hot_loops(loops)
    ffma = sum(loop.ffma for loop in hot)
    issued = sum(loop.issued for loop in hot)
    lsu = sum(loop.mix[c] for loop in hot for c in LSU_CATEGORIES)
    issue_fraction = ffma / issued if issued else 0.0
    lsu_fraction = min(1.0, ffma / (SM90.schedulers_per_sm * lsu)) if lsu else 1.0
    resident = min(occ["warps_per_sm"], launch_warps / device.sms)
    fill = min(1.0, resident / SM90.schedulers_per_sm)
    fraction = min(issue_fraction, lsu_fraction) * fill
    return {"hot_loops": len(hot), "ffma_fraction": round(issue_fraction, 4), "lsu_fraction": round(lsu_fraction, 4),
            "fill": round(fill, 4), "fraction_of_peak": round(fraction, 4),
            "tflops": round(fraction * device.peak_fp32_tflops, 2), "peak_tflops": round(device.peak_fp32_tflops, 1)}


# ----------------------------------------------------------------------------------------------------
# Compiling through the launch path (needs the real numba.cuda, not the simulator).

def nvdisasm_path() -> str | None:
    """nvdisasm from NVIDIA's wheel (the `profile` extra), the CUDA toolkit, or PATH; None if absent."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("nvdisasm")
        if found:
            return str(found)
    except Exception:  # noqa: BLE001 - an older cuda-pathfinder, or none: fall back to PATH
        pass
    return shutil.which("nvdisasm")


MISSING_NVDISASM = ("nvdisasm was not found: install the profile extra (pip install 'fa_numba[profile]', "
                    "NVIDIA's nvidia-cuda-nvdisasm wheel) or put a CUDA toolkit's nvdisasm on PATH")


def compute_capability(arch: str) -> tuple:
    """(major, minor) or (major, minor, "a") of an architecture name such as sm_80, sm_90a or sm_120."""
    found = re.fullmatch(r"sm_(\d{1,2})(\d)(a?)", arch)
    if not found:
        raise ValueError(f"arch must look like sm_80, sm_90a or sm_120, got {arch!r}")
    major, minor, suffix = found.groups()
    return (int(major), int(minor), suffix) if suffix else (int(major), int(minor))


def _cc(arch: str) -> tuple:
    """compute_capability, for the profile's own use: its occupancy limits and bound are sm_90's."""
    cc = compute_capability(arch)
    if cc[:2] != (9, 0):
        raise ValueError(f"arch: the occupancy limits and the bound are known for sm_90 only, got {arch!r}")
    return cc


def compile_for_launch(pyfunc, argtypes, arch: str = ARCH, max_registers: int | None = None):
    """Compile a kernel as cuda.jit does for a launch (LTO through nvJitLink) and return (cubin, link log)."""
    from cuda.bindings import nvjitlink
    from numba.core import types
    from numba.cuda.compiler import compile_cuda, kernel_fixup

    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        raise RuntimeError("compiling SASS needs the real numba.cuda: run with NUMBA_ENABLE_CUDASIM=0")
    cc = compute_capability(arch)
    cres = compile_cuda(pyfunc, types.void, argtypes, debug=False, lineinfo=False, fastmath=False,
                        nvvm_options={"fastmath": False, "opt": 3}, cc=cc[:2], lto=True)
    library = cres.library
    kernel_fixup(library.get_function(cres.fndesc.llvm_func_name), False)
    ltoir = library.get_ltoir(cc=cc)
    options = [f"-arch={arch}", "-lto", "-verbose"]
    if max_registers:
        options.append(f"-maxrregcount={max_registers}")
    handle = nvjitlink.create(len(options), options)
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, ltoir, len(ltoir), "kernel.ltoir")
        try:
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as failure:
            error = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, error)
            raise RuntimeError(f"nvJitLink could not link the kernel for {arch}: {error.decode(errors='replace')}") \
                from failure
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin), log.decode(errors="replace"), library


def listing_digest(sass: str) -> str:
    """sha256 of a SASS listing (hex, 16 digits) with its symbols' names left out: Numba numbers each function
    it compiles in a process, so the same kernel's mangled name depends on what the process compiled before."""
    return hashlib.sha256(re.sub(r"_ZN[0-9A-Za-z_$]+", "_ZN", sass).encode()).hexdigest()[:16]


def disassemble(cubin: bytes, tool: str | None = None) -> str:
    tool = tool or nvdisasm_path()
    if tool is None:
        raise FileNotFoundError(MISSING_NVDISASM)
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        done = subprocess.run([tool, "-c", fh.name], capture_output=True, text=True, check=True)
    return done.stdout


@dataclass
class Profile:
    """Everything the profile says about one compiled kernel."""

    name: str
    threads: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    smem: int
    occupancy: dict
    loops: list[Loop]
    float64: list[str]
    bound: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    sass: str = field(default="", repr=False)  # the listing itself (not written to JSON)
    counts: dict = field(default_factory=dict)  # whole_kernel.kernel_counts of one tile-loop iteration
    estimate: dict = field(default_factory=dict)  # the whole-kernel estimate (main fills it), or why there is none

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)

    @property
    def hot_loops(self) -> list[Loop]:
        return hot_loops(self.loops)

    def as_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("loops", "sass")}
        out["loops"] = [{k: v for k, v in loop.as_dict().items() if k != "opcodes"} for loop in self.loops]
        out["hot_loops"] = [loop.as_dict() for loop in self.hot_loops]  # with every opcode and its count
        out["sass_sha256"] = listing_digest(self.sass)
        return out


def profile_kernel(pyfunc, argtypes, threads: int, *, name: str = "kernel", arch: str = ARCH,
                   launch_warps: int | None = None, max_registers: int | None = None) -> Profile:
    """Compile, disassemble and profile one kernel; launch_warps (default: one full SM's worth per SM) sets the fill."""
    cubin, log, _ = compile_for_launch(pyfunc, argtypes, arch, max_registers)
    sass = disassemble(cubin)
    res = parse_ptxas(log)
    occ = occupancy(threads, res["registers"] or 0, res["smem"])
    loops = innermost_loops(sass)
    warps = launch_warps if launch_warps is not None else occ["warps_per_sm"] * H200.sms
    return Profile(name, threads, res["registers"], res["spill_stores"], res["spill_loads"], res["stack"],
                   res["smem"], occ, loops, float64_instructions(sass), bound(loops, occ, warps), sass=sass)


# ----------------------------------------------------------------------------------------------------
# The shipped configurations.

SHIPPED_HEAD_DIMS = (64, 128, 256)
DTYPES = ("float32", "float16")
# Asked for by name only, never in the shipped table: "tf32", float32 inputs by one TF32 product per product
# (engine="mma-tf32", not float32-exact), for the tensor-core forwards, non-causal (as the table's float32 ones);
# "bfloat16", every tensor-core kernel on bfloat16 inputs (the float16 code with the bf16 mma and pack)
OPT_IN_DTYPES = ("tf32", "bfloat16")
OPT_IN_KERNELS = {"tf32": whole_kernel.MMA_VARIANTS, "bfloat16": whole_kernel.MMA_KERNELS}  # what each builds
FLOAT32_MMA = ("float32", "tf32")  # the tensor-core kernels' float32 modes: non-causal in the table, no d_v


def kernel_names() -> list[str]:
    """Every kernel: the CUDA-core forward variants (kernels.VARIANTS), the tensor-core forwards
    (whole_kernel.MMA_VARIANTS), then the backward ones (kernels.backward.VARIANTS), then the tensor-core
    backward's (whole_kernel.MMA_BACKWARD)."""
    from fa_numba.kernels import VARIANTS
    from fa_numba.kernels import backward

    forward = [name for name in VARIANTS if name not in whole_kernel.MMA_VARIANTS]
    return forward + list(whole_kernel.MMA_VARIANTS) + list(backward.VARIANTS) + list(whole_kernel.MMA_BACKWARD)


def _mma_tiles(head_dim: int, name: str = "v2-mma", dtype: str = "float16") -> tuple[int, int] | None:
    """(block_q, block_k) the tensor-core kernels launch with by default (engines.mma_tiles; the backward's
    kernels.mma.backward.default_tiles), or None for a head dim they do not take (kernels.mma.engine's limits:
    the 16-bit forwards to 192, the backward and float32 to 128)."""
    from fa_numba import engines
    from fa_numba.kernels.mma.engine import MAX_FORWARD_HEAD_DIM, MAX_HEAD_DIM

    sixteen_forward = name not in whole_kernel.MMA_BACKWARD and dtype in engines.MMA_KINDS
    if head_dim > (MAX_FORWARD_HEAD_DIM if sixteen_forward else MAX_HEAD_DIM):
        return None
    if name in whole_kernel.MMA_BACKWARD:
        from fa_numba.kernels.mma.backward import default_tiles

        return default_tiles("dq" if name == "bwd-dq-mma" else "kv", head_dim, dtype)[1:]
    warps, block_k, row_blocks = engines.mma_tiles(head_dim, None, None, dtype, name[:2])  # "v1" or "v2"
    return 16 * warps * row_blocks, block_k


def _with_mod(cfg: dict, mod: str) -> dict:
    """cfg with a built-in score mod compiled in, at the tiles a call with a mod takes: a 16-bit v2-mma of two
    row blocks a warp keeps one (engines.mma_tiles, `plain`), 64 rows by default."""
    cfg = dict(cfg, score_mod=mod)
    if cfg.pop("row_blocks", 1) != 1:
        from fa_numba import engines

        width = max(cfg["head_dim"], cfg.get("value_dim") or 0)
        warps, _, _ = engines.mma_tiles(width, None, cfg["block_k"], cfg["dtype"], "v2", plain=False)
        cfg["block_q"] = 16 * warps
    return cfg


def _row_blocks(name: str, head_dim: int, block_q: int, block_k: int, dtype: str) -> dict:
    """{"row_blocks": R} where a tensor-core forward at these tiles owns R > 1 row blocks a warp
    (engines.mma_tiles), else {}: what a configuration carries beside its tiles."""
    from fa_numba import engines

    if name not in whole_kernel.MMA_VARIANTS or dtype not in engines.MMA_KINDS:
        return {}
    rows = engines.mma_tiles(head_dim, block_q, block_k, dtype, name[:2])[2]
    return {"row_blocks": rows} if rows != 1 else {}


# The kernels that take a value head dim of its own natively (V, O, dO, dV d_v wide), the tensor-core ones at
# 16-bit dtypes only; the others (the rowwise forwards, 3xTF32) run at max(d, d_v) on padded operands
# (fa_numba.value_dims): profile that head dim for them.
NATIVE_VALUE_DIM = ("v1", "v2", "bwd-kv", "bwd-kv-det", "bwd-q-dq", "bwd-q") + whole_kernel.MMA_KERNELS


def takes_value_dim(name: str, dtype: str) -> bool:
    """Whether kernel `name` at `dtype` takes d_v != d natively (NATIVE_VALUE_DIM)."""
    return name in NATIVE_VALUE_DIM and not (name in whole_kernel.MMA_KERNELS and dtype in FLOAT32_MMA)


def configurations(orders=None, head_dims=SHIPPED_HEAD_DIMS, dtypes=DTYPES, causals=(False, True), value_dim=0):
    """The shipped configurations: every kernel at the default tiles of each head dim, each dtype (the
    backward kernels at float32 only: they read float16 through the same conversion; the tensor-core
    kernels at the head dims they take (16-bit forwards to 192, the rest to 128: none of the shipped 256),
    at their own default tiles, the forwards' float32 by 3xTF32 non-causal only (the
    causal ones spill a few bytes: docs/profile.md), the backward's at 16-bit dtypes only) and causal or not.
    value_dim: V's head dim d_v for every head dim other than it (cfg["value_dim"]), the kernels that take it
    natively only (`takes_value_dim`), at the tiles of the wider of d and d_v, as the call takes them."""
    from fa_numba.kernels import backward, default_tiles

    for name in orders or kernel_names():
        is_backward = name in backward.VARIANTS
        is_mma = name in whole_kernel.MMA_KERNELS
        for head_dim in head_dims:
            own = {"value_dim": value_dim} if value_dim and value_dim != head_dim else {}
            width = max(head_dim, value_dim)  # the tiles the call takes (api: by the wider head dim)
            block_q, block_k = (_mma_tiles(width, name) or (0, 0)) if is_mma else default_tiles(width)
            if is_backward:
                block_q = block_k = backward.default_backward_tiles(width)[0]
            if is_mma and not block_q:  # a head dim the tensor-core kernels refuse
                continue
            for dtype in dtypes:
                if own and not takes_value_dim(name, dtype):
                    continue  # padded to max(d, d_v) by the call: not a kernel of its own
                if dtype in OPT_IN_KERNELS and name not in OPT_IN_KERNELS[dtype]:
                    continue  # TF32 is a tensor-core forward's mode only, bfloat16 a tensor-core kernel's
                if is_backward and dtype != "float32" and "float32" in dtypes:
                    continue
                if name in whole_kernel.MMA_BACKWARD:  # 3xTF32: the atomic kv kernel, at its own tiles; its
                    if dtype == "float32" and name != "bwd-kv-mma":  # deterministic pair's causal d = 128 kv pass
                        continue  # spills 28 bytes, which the table's checks refuse (docs/profile.md)
                    block_q, block_k = _mma_tiles(width, name, dtype)  # each dtype its own (docs/profile.md)
                if name in whole_kernel.MMA_VARIANTS:  # float32's tiles hold two tf32 parts: smaller defaults
                    tiles = _mma_tiles(width, name, dtype)
                    if tiles is None:  # float32 above d = 128
                        continue
                    block_q, block_k = tiles
                for causal in causals:
                    if name in whole_kernel.MMA_VARIANTS and dtype in FLOAT32_MMA and causal:  # not in the
                        continue  # table: the causal 3xTF32 forwards spill 4 to 12 bytes (docs/profile.md)
                    yield dict(variant=name, block_q=block_q, block_k=block_k, head_dim=head_dim, dtype=dtype,
                               causal=causal, **own, **_row_blocks(name, width, block_q, block_k, dtype))


SCORE_MODS = ("alibi", "softcap", "relative_bias", "temperature")  # the built-ins a configuration may compile in


def kernel_mod(name: str | None):
    """The KernelMod of built-in score mod `name` (None: none), for cfg["score_mod"]: what a kernel compiles
    depends on the mod's functions and its arrays' kinds only, so any values do."""
    if name is None:
        return None
    from fa_numba import mods
    from fa_numba.kernels.score_mod import KernelMod

    made = {"alibi": lambda: mods.alibi([0.5]), "softcap": lambda: mods.softcap(30.0),
            "relative_bias": lambda: mods.relative_bias([[0.0, 0.0, 0.0]]), "temperature": lambda: mods.temperature(2.0)}
    if name not in made:
        raise ValueError(f"score_mod must be one of {SCORE_MODS} or None, got {name!r}")
    return KernelMod.of(made[name]())


def _build(cfg: dict):
    from fa_numba.kernels import VARIANTS, backward

    form = cfg.get("mask_form", "none")  # a block mask's "intervals" / "dense" path, when asked for
    mod = kernel_mod(cfg.get("score_mod"))  # a built-in score mod compiled in (the CUDA-core kernels only)
    own = {"value_dim": cfg["value_dim"]} if cfg.get("value_dim") else {}  # V's head dim d_v, where it has one
    if cfg["variant"] in whole_kernel.MMA_BACKWARD:
        from fa_numba.kernels.mma import backward as mma_backward

        if form != "none":
            raise ValueError(f"{cfg['variant']} has no block-mask path (mask_form {form!r})")
        role = "dq" if cfg["variant"] == "bwd-dq-mma" else "kv"
        warps = (cfg["block_k"] if role == "kv" else cfg["block_q"]) // 16
        return mma_backward.make(role, cfg["dtype"], warps, cfg["block_q"], cfg["block_k"], cfg["head_dim"],
                                 cfg["causal"], cfg["variant"] == "bwd-kv-mma-det", mod=mod, **own)
    if cfg["variant"] in whole_kernel.MMA_VARIANTS:
        from fa_numba.kernels.mma.engine_v1 import make_v1_mma
        from fa_numba.kernels.mma.engine_v2 import make_v2_mma

        if form != "none":
            raise ValueError(f"{cfg['variant']} has no block-mask path (mask_form {form!r})")
        make = make_v1_mma if cfg["variant"] == "v1-mma" else make_v2_mma
        rows = cfg.get("row_blocks", 1)  # m16 row blocks a warp (v2's MmaConfig.row_blocks)
        return make(cfg["dtype"], cfg["block_q"] // (16 * rows), cfg["block_k"], cfg["head_dim"], cfg["causal"],
                    mod=mod, row_blocks=rows, **own)
    if cfg["variant"] in backward.VARIANTS:
        kind, flag, _ = backward.VARIANTS[cfg["variant"]]
        return backward.make(kind, cfg["block_q"], cfg["head_dim"], cfg["causal"], flag, form, mod, **own)
    micro = {"micro": tuple(cfg["micro"])} if cfg.get("micro") else {}  # v2 at a decode layout (decode_estimate)
    return VARIANTS[cfg["variant"]].make(cfg["block_q"], cfg["block_k"], cfg["head_dim"], cfg["causal"], form,
                                         mod=mod, **micro, **own)


def _strided(argtypes: tuple, count: int) -> tuple:
    """argtypes with its first `count` arrays (q, k, v) of layout "A": what a kernel is compiled for when its
    inputs are strided views (api._prepare reads them where they are)."""
    from numba import types

    return tuple(types.Array(a.dtype, a.ndim, "A") if index < count else a for index, a in enumerate(argtypes))


def profile_configuration(cfg: dict, arch: str = ARCH, launch: dict = DEFAULT_LAUNCH) -> Profile:
    built = _build(cfg)
    grid, block = built.launch_shape(launch["batch"], launch["heads"], launch["n"])
    threads = math.prod(block)
    warps = math.prod(grid) * -(-threads // SM90.warp_size)
    start = time.perf_counter()
    argtypes = built.argtypes(cfg["dtype"])
    if cfg.get("strided"):  # the inputs as strided views (a (B, N, H, d) tensor's transpose): layout "A"
        argtypes = _strided(argtypes, 3)
    prof = profile_kernel(built.source, argtypes, threads, name=cfg["variant"], arch=arch, launch_warps=warps,
                          max_registers=None if cfg.get("strided") else getattr(built, "max_registers", None))
    # a kernel's register cap, as its launch applies it: C-contiguous inputs only (MmaKernel.kernel_for_views)
    prof.config = {**cfg, "arch": arch, "launch": dict(launch, grid=list(grid), block=list(block)),
                   "seconds": round(time.perf_counter() - start, 2)}
    try:
        prof.counts = whole_kernel.kernel_counts(cfg, prof.sass, built)
    except ValueError as err:  # no tile loop around the products: no estimate, and the reason why
        prof.counts = {"error": str(err)}
    return prof


def table(profiles: list[Profile]) -> str:
    """One aligned line per configuration: resources, occupancy, hot-loop mix, the hot-loop bound, and the
    whole-kernel estimate and its limiter ("n/a": withheld, the profile's JSON says why; "-": not asked)."""
    header = ["variant", "d", "dtype", "causal", "tiles", "thr", "regs", "spill", "stack", "smem", "warps/SM",
              "limiter", "hot loops", "issued/FFMA", "FFMA %", "LDS", "LDL", "hot-loop TFLOP/s", "estimate TFLOP/s",
              "model"]
    rows = [header]
    for p in profiles:
        c = p.config
        hot = p.hot_loops
        mixes = [loop.mix for loop in hot]
        issued = sum(loop.issued for loop in hot)
        ffma = sum(loop.ffma for loop in hot)
        name = p.name + (f"+{c['score_mod']}" if c.get("score_mod") else "") + (" strided" if c.get("strided") else "")
        dims = f"{c['head_dim']}/{c['value_dim']}" if c.get("value_dim") else str(c["head_dim"])  # d/d_v
        rows.append([name, dims, c["dtype"], "on" if c["causal"] else "off",
                     f"{c['block_q']}x{c['block_k']}", str(p.threads), str(p.registers),
                     f"{p.spill_stores}/{p.spill_loads}", str(p.stack), str(p.smem), str(p.occupancy["warps_per_sm"]),
                     p.occupancy["limiter"], str(len(hot)), f"{issued / ffma:.1f}" if ffma else "-",
                     f"{100 * ffma / issued:.0f}" if issued else "-", str(sum(m["LDS/STS"] for m in mixes)),
                     str(sum(m["LDL/STL"] for m in mixes)),
                     "-" if c["variant"] in whole_kernel.MMA_KERNELS else f"{p.bound['tflops']:.1f}",
                     (f"{p.estimate['tflops']:.1f}" + ("" if p.estimate["shared_accesses"]["agree"] else "?")
                      + ("~" if "counts_from" in p.estimate else ""))
                     if "tflops" in p.estimate else "-",
                     p.estimate.get("limiter", "n/a" if p.estimate else "-")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i < 4 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(r, widths))) for r in rows)


def _csv(text: str, kind=str) -> list:
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fa_numba profile", description=__doc__.splitlines()[0])
    p.add_argument("--orders", type=_csv, default=None,
                   help="kernels, e.g. v1,v2,bwd-kv (default: every registered forward and backward kernel)")
    p.add_argument("--head-dims", type=lambda t: _csv(t, int), default=list(SHIPPED_HEAD_DIMS),
                   help=f"comma list of head dims (default: the shipped ones, "
                        f"{','.join(map(str, SHIPPED_HEAD_DIMS))})")
    p.add_argument("--dtypes", type=_csv, default=list(DTYPES),
                   help=f"comma list of {','.join(DTYPES + OPT_IN_DTYPES)} (default: {','.join(DTYPES)}; tf32: "
                        f"the tensor-core forwards' engine='mma-tf32' build, non-causal; bfloat16: every "
                        f"tensor-core kernel)")
    p.add_argument("--causal", choices=["off", "on", "both"], default="both",
                   help="profile the unmasked kernels, the causal ones, or both (default: %(default)s)")
    p.add_argument("--arch", default=ARCH,
                   help="sm_90a (what a launch on an H100/H200 uses) or sm_90 (default: %(default)s)")
    p.add_argument("--json", metavar="PATH",
                   help="write every number (loops and opcodes included) as JSON (default: none)")
    p.add_argument("--batch", type=arguments.positive, default=DEFAULT_LAUNCH["batch"],
                   help="B of the launch shape of the bound (default: %(default)s)")
    p.add_argument("--heads", type=arguments.positive, default=DEFAULT_LAUNCH["heads"],
                   help="H of the launch shape of the bound (default: %(default)s)")
    p.add_argument("--n", type=arguments.positive, default=DEFAULT_LAUNCH["n"],
                   help="N_q of the launch shape of the bound (default: %(default)s)")
    p.add_argument("--jobs", type=arguments.positive, default=os.cpu_count() or 1,
                   help="compile in this many processes (default: the CPU count, %(default)s here)")
    p.add_argument("--score-mod", choices=SCORE_MODS, default=None,
                   help="compile this built-in score mod into every kernel profiled (default: none)")
    p.add_argument("--value-dim", type=arguments.positive, default=0, metavar="D_V",
                   help="V's head dim d_v (MLA: --head-dims 192 --value-dim 128), for the kernels that take it "
                        "natively; the table's d column reads d/d_v (default: d_v = d)")
    p.add_argument("--strided", action="store_true",
                   help="compile the kernels for strided q, k, v (layout 'A': a (B, N, H, d) tensor's "
                        "(B, H, N, d) view, read where it is) instead of C-contiguous ones (default: off)")
    p.add_argument("--no-estimate", action="store_true",
                   help="skip the whole-kernel estimate, which traces one block of each kernel in the simulator "
                        "(default: off, the estimate is computed; traced wavefronts are cached)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    names = kernel_names()
    bad = [o for o in (args.orders or []) if o not in names]
    if bad:
        parser().error(f"argument --orders: expected a comma list of {', '.join(names)}, got {bad}")
    bad = [d for d in args.dtypes if d not in DTYPES + OPT_IN_DTYPES]
    if bad:
        parser().error(f"argument --dtypes: expected a comma list of {', '.join(DTYPES + OPT_IN_DTYPES)}, got {bad}")
    try:
        _cc(args.arch)
    except ValueError as err:
        parser().error(f"argument --arch: {err}")
    problem = None if args.json is None else arguments.unwritable(args.json)
    if problem:  # checked before minutes of compiling, not after
        parser().error(f"argument --json: {problem}")
    if nvdisasm_path() is None:
        print(MISSING_NVDISASM, file=sys.stderr)
        return 2
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or _simulated():
        # The simulator cannot compile SASS: run this again in a process with the real numba.cuda.
        env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
        return subprocess.run([sys.executable, "-m", "fa_numba.profile", *argv], env=env).returncode
    causals = {"off": (False,), "on": (True,), "both": (False, True)}[args.causal]
    launch = dict(batch=args.batch, heads=args.heads, n=args.n)
    configs = list(configurations(args.orders, args.head_dims, args.dtypes, causals, args.value_dim))
    if args.value_dim:
        padded = [f"{name} {dtype}" for name in (args.orders or names) for dtype in args.dtypes
                  if not takes_value_dim(name, dtype)]
        if padded:
            print(f"--value-dim: not profiled at d_v of their own (a call runs them at max(d, d_v) on padded "
                  f"operands: profile that head dim): {', '.join(padded)}", file=sys.stderr)
    if not configs:
        parser().error("no configuration to profile: the orders, head dims, dtypes and d_v asked for select none")
    if args.score_mod:  # every kernel with the mod compiled in, at the tiles a call with it takes
        configs = [_with_mod(c, args.score_mod) for c in configs]
    if args.strided:  # every kernel's q, k, v as views (the tensor-core backward's dO and O stay C-contiguous)
        configs = [dict(c, strided=True) for c in configs]
    start = time.perf_counter()
    jobs = max(1, min(args.jobs, len(configs)))
    tracing = None if args.no_estimate else start_wavefronts(configs, jobs)  # in the simulator, while we compile
    with concurrent.futures.ProcessPoolExecutor(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        submit = pool.submit if pool else lambda fn, *a: _Done(fn(*a))
        futures = [submit(profile_configuration, cfg, args.arch, launch) for cfg in configs]
        profiles = []
        for index, (cfg, future) in enumerate(zip(configs, futures), 1):
            profiles.append(future.result())
            print(f"[{index}/{len(configs)}] {cfg['variant']} d={cfg['head_dim']} {cfg['dtype']} "
                  f"causal={cfg['causal']} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    if tracing is not None:
        attach_estimates(profiles, finish_wavefronts(tracing), launch)
    print(f"static profile, {args.arch} SASS compiled on the CPU through the launch path (LTO); "
          f"estimates at B={launch['batch']} H={launch['heads']} N={launch['n']} on an {H200.name} "
          f"({H200.sms} SMs, {H200.clock_ghz} GHz, FP32 peak {H200.peak_fp32_tflops:.1f} TFLOP/s, dense 16-bit "
          f"tensor peak {H200.peak_tensor_tflops:.0f} at this clock)")
    print(table(profiles))
    print(LEGEND)
    print(f"({len(profiles)} configurations in {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"note": "static profile from SASS compiled on a CPU through the launch path; the "
                               "hot-loop bound and the whole-kernel estimate are read from the code, not measured",
                       "date": time.strftime("%Y-%m-%d"), "arch": args.arch, "device_model": dataclasses.asdict(H200),
                       "limits": dataclasses.asdict(SM90), "numba_cuda": _numba_cuda_version(),
                       "sources": sources.kernel_digest(),
                       "profiles": [p.as_dict() for p in profiles]}, fh, indent=1)
    return 0


class _Done:
    """A computed result with the Future interface (the one-process path of `main`)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _simulated() -> bool:
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", False))


def _numba_cuda_version() -> str:
    try:
        from importlib.metadata import version

        return version("numba-cuda")
    except Exception:  # noqa: BLE001 - metadata lookups fail in many harmless ways
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
