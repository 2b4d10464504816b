"""From one compiled kernel to the whole-kernel estimate: what one tile-loop iteration issues, and the launch.

`profile` calls `estimate_configuration` with the kernel's SASS, its occupancy and the wavefronts one
iteration costs a block in shared memory (`kernels.smem_costs`, measured in the simulator); this module
turns them into `cycle_model.IterationCost` and `cycle_model.Launch`:

- The tile loop is the smallest SASS loop holding all the matrix-product loops (`sass.enclosing_loop` of
  `sass.hot_loops`): the loop over key tiles in v2, v2-rowwise and backward q, over query tiles in v1,
  v1-rowwise and backward kv. One iteration issues its own instructions once (every path of its body: an
  upper bound where branches skip code, e.g. ragged-edge guards) plus each inner loop's body times its trip
  count.
- Trip counts come from the compile-time layout, anchored on what the loop must do: a matrix-product loop
  does one product of B_r x B_c x D multiply-adds per iteration of the tile loop, spread over the block's
  threads (D: d padded as the engine pads it), so trips = B_r B_c D / threads / FFMA per trip; a load loop
  (global loads, no FFMA) moves one tile of the loop's operand, B x d elements, so trips = B d / threads /
  global accesses per trip. A loop that fits neither rule, or whose trips are not a whole number, is counted
  once and listed in `unattributed`, so the figure says where it is unsure.
- Global-load round trips: `sass.global_load_waits` of the body, each inner loop's times its trips.
- The dependence walk ("walk"): the same iteration as one sequence (the body in address order, every path,
  each inner loop's body repeated its trips; a loop without a trip-count rule left out, where the counts take
  it once: in a causal tensor-core build those are the PARTIAL tiles' exact path, which about one tile of a
  row runs), issued in order by the block's warps that share one SM sub-partition (`dependent_cycles`): the
  cycles its register dependences, pipes and barriers take without any other block, and each pipe's cycles.
- The launch: the grid of `launch_shape`, whole blocks per SM from the occupancy, the tile-loop iterations
  a block runs (visited tiles / blocks), and HBM bytes: `iomodel`'s counts, or only each tensor once when the
  re-read operands of the heads in flight fit in L2 (`hbm_bytes`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from fa_numba import iomodel, sass, tile_counts
from fa_numba.cycle_model import Estimate, IterationCost, Launch, estimate
from fa_numba.machine import H200, PIPES, SM90, Device
from fa_numba.timing import attention_flops

# Matrix products one tile-loop iteration computes, each B_r x B_c x d multiply-adds: S = Q K^T and P V
# forward; the backward recomputes S and forms dP = dO V^T, then dV, dK (kv side) and dQ as its flags say.
PRODUCTS = {"v1": 2, "v2": 2, "v1-rowwise": 2, "v2-rowwise": 2,
            "bwd-kv": 5, "bwd-kv-det": 4, "bwd-q-dq": 3, "bwd-q": 5, "v1-mma": 2, "v2-mma": 2,
            "bwd-kv-mma": 5, "bwd-kv-mma-det": 4, "bwd-dq-mma": 3}
# Of those, the products that run over V's head dim d_v (P V; the backward's dP = dO V^T and dV = P^T dO): with
# a value head dim of its own (cfg["value_dim"]) they are B_r x B_c x d_v, the others B_r x B_c x d.
VALUE_PRODUCTS = {"v1": 1, "v2": 1, "v1-rowwise": 1, "v2-rowwise": 1,
                  "bwd-kv": 2, "bwd-kv-det": 2, "bwd-q-dq": 1, "bwd-q": 2, "v1-mma": 1, "v2-mma": 1,
                  "bwd-kv-mma": 2, "bwd-kv-mma-det": 2, "bwd-dq-mma": 1}
# FFMAs outside the products (the softmax's scale and rescaling) may add a little; more than this means a loop
# was counted twice or missed (a remainder loop beside an unrolled one), so the counts are not trusted.
PRODUCT_SLACK = 0.5
KV_OUTER = ("v1", "v1-rowwise", "bwd-kv", "bwd-kv-det", "v1-mma", "bwd-kv-mma", "bwd-kv-mma-det")  # over query tiles
MMA_VARIANTS = ("v1-mma", "v2-mma")  # the tensor-core forwards: products on mma.sync m16n8k16, not FFMA
# the tensor-core backward's kernels (kernels.mma.backward): kv with atomic dQ, kv without dQ (deterministic),
# and the deterministic mode's Q-outer dQ pass
MMA_BACKWARD = ("bwd-kv-mma", "bwd-kv-mma-det", "bwd-dq-mma")
MMA_KERNELS = MMA_VARIANTS + MMA_BACKWARD
# the products' multiply-adds one HMMA does, by the kernel's kind: 16-bit m16n8k16; float32 by 3xTF32, three
# m16n8k8 per product, "tf32" (engine="mma-tf32") one (kernels.mma.tf32); and the instruction's shape
# (Device.mma_cycles)
USEFUL_MACS = {"float16": 16 * 8 * 16, "bfloat16": 16 * 8 * 16, "float32": 16 * 8 * 8 / 3, "tf32": 16 * 8 * 8}
MMA_SHAPE = {"float16": "m16n8k16", "bfloat16": "m16n8k16", "float32": "m16n8k8", "tf32": "m16n8k8"}
# the warps of a kernel's block own 16 rows each of the tile it keeps (query rows, or keys in the kv backward),
# 16 R where a warp holds R row blocks (cfg["row_blocks"]); one product of an iteration is then 16 R x (the other
# tile) x D multiply-adds per warp
_WARP_OWNS_KEYS = ("bwd-kv-mma", "bwd-kv-mma-det")


def value_dim(cfg: dict) -> int:
    """V's head dim d_v of a configuration: cfg["value_dim"] where it has one, else its head dim d."""
    return cfg.get("value_dim") or cfg["head_dim"]


def expected_products(cfg: dict, value_ratio: float = 1.0) -> float:
    """The kernel's products per tile-loop iteration in units of B_r B_c D (D: the padded head dim the counts
    divide by): PRODUCTS, with each of the VALUE_PRODUCTS weighted by value_ratio, the padded d_v over that D
    (1 where d_v = d, or where the kernel runs every product at one width: the tile engine's max(d, d_v))."""
    value = VALUE_PRODUCTS[cfg["variant"]]
    return PRODUCTS[cfg["variant"]] - value + value * value_ratio


def useful_flops(cfg: dict, launch: dict) -> float:
    """Useful flops of one call of the kernel, as flash-attn's benchmarks count them (timing.attention_flops: 4 B H
    N_q N_k d forward, halved for causal, so 2 B H N_q N_k per column of each product): the d-wide products at d
    and the VALUE_PRODUCTS at d_v, whatever width the kernel multiplies them at."""
    per_column = attention_flops(launch["batch"], launch["heads"], launch["n"], launch["n"], 1, cfg["causal"]) / 2
    value = VALUE_PRODUCTS[cfg["variant"]]
    return per_column * ((PRODUCTS[cfg["variant"]] - value) * cfg["head_dim"] + value * value_dim(cfg))


def _loop_axis_tile(cfg: dict) -> int:
    """The tile the tile loop steps over: B_r for the K/V-outer kernels, B_c for the Q-outer ones."""
    return cfg["block_q"] if cfg["variant"] in KV_OUTER else cfg["block_k"]


def _executions(loop, parent_executions: float, direct: bool, cfg: dict, threads: int, d_pad: int) -> float | None:
    """How often an inner loop's body runs per tile-loop iteration, by the module docstring's rule, or None if
    no rule gives a whole multiple of its parent's count. direct: the loop is a child of the tile loop itself."""
    mix = loop.mix
    if mix["FFMA"] and (mix["LDS/STS"] or mix["LDL/STL"]) and not loop.children:  # a matrix-product loop
        runs = cfg["block_q"] * cfg["block_k"] * d_pad / threads / mix["FFMA"]
    elif direct and not mix["FFMA"]:  # a load (or atomic) loop: one tile of the loop's operand
        accesses = sum(1 for i in loop.instructions if i.category == "LDG/STG")  # loads, stores, atomics
        if not accesses:
            return None
        runs = _loop_axis_tile(cfg) * cfg["head_dim"] / threads / accesses
    else:
        return None
    per_parent = runs / parent_executions
    return runs if per_parent >= 1 and abs(per_parent - round(per_parent)) < 1e-9 else None


def _access_bytes(opcode: str) -> int:
    """Bytes per lane of an LDS / STS form: .128 16, .64 8, .U8 / .S8 1, .U16 / .S16 2, else 4."""
    parts = opcode.split(".")[1:]
    for part, size in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if part in parts:
            return size
    return 4


def iteration_counts(text: str, cfg: dict, threads: int, d_pad: int | None = None) -> dict:
    """Per thread, what one tile-loop iteration issues: instructions (and by category), FFMA, MUFU, global-load
    round trips, the products its FFMAs amount to, and the inner loops no rule counts (run once per run of
    their parent: the figures are then lower bounds on the work, and `unattributed` lists them). d_pad: the
    head dim the products run over (the engine's `Layout.d_pad`; d itself, the default, elsewhere). "walk":
    the dependence walk of the iteration (`walk`)."""
    tree = sass.loop_tree(text)
    hot = sass.hot_loops(sass.innermost_loops(text))
    tile = sass.enclosing_loop(tree, hot)
    if tile is None:
        raise ValueError(f"{cfg['variant']}: no SASS loop holds all its matrix-product loops")
    d_pad = d_pad or cfg["head_dim"]
    counts = {"instructions": 0.0, "by_category": dict.fromkeys(sass.CATEGORIES, 0.0), "load_round_trips": 0.0,
              "unattributed": []}

    shared = counts["shared_accesses"] = {}  # (LDS or STS, bytes per lane): per-thread count, to check the tracer
    inner_runs = {}  # an inner loop's start: its runs per iteration, None where no rule counts it (the walk)

    def add(node, runs: float) -> None:
        for inst in node.own:
            counts["instructions"] += runs
            counts["by_category"][inst.category] += runs
            if inst.base in ("LDS", "STS") and not inst.never:
                key = f"{inst.base}.{_access_bytes(inst.opcode)}"
                shared[key] = shared.get(key, 0) + runs
        counts["load_round_trips"] += runs * sass.global_load_waits(node.own)
        for child in node.children:
            inner = tree[child]
            executions = _executions(inner, runs, node is tile, cfg, threads, d_pad)
            inner_runs[inner.start] = executions
            if executions is None:
                counts["unattributed"].append(f"0x{inner.start:04x}-0x{inner.end:04x}")
                executions = runs
            add(inner, executions)

    add(tile, 1)
    counts["walk"] = walk(text, tree, tile, inner_runs, threads)
    counts["ffma"] = counts["by_category"]["FFMA"]
    counts["mufu"] = counts["by_category"]["MUFU"]
    counts["products"] = counts["ffma"] / (cfg["block_q"] * cfg["block_k"] * d_pad / threads)
    return counts


def mma_iteration_counts(text: str, cfg: dict, d_pad: int, inner_trips: int | None = None,
                         copies: int | None = None, threads: int | None = None) -> dict:
    """Per thread, what one tile-loop iteration of a tensor-core kernel issues (the keys of `iteration_counts`,
    and "hmma"). The tile loop is the smallest SASS loop holding every HMMA; its body is counted once, every
    path (the engine unrolls its fragment loops, so a FULL tile has no inner loop). An inner loop runs
    `inner_trips` times if it holds HMMA and the kernel says how often its layout runs it (the kv backward's
    dQ column blocks, `MmaBackwardKernel.inner_trips`; only where it is the one inner loop of HMMA), else once,
    listed in `unattributed`; an inner loop of
    cp.async copies without HMMA (a tile's staging loop, where ptxas does not unroll it) runs `copies` / (its
    LDGSTS) times if the kernel says how many copies one thread issues per staged tile (`copies`), else once,
    listed in `unattributed`. Round trips: dependent global loads and the steady state's cp.async waits, each
    with the share of the body that covers it ("copy_covers", `sass.async_copy_covers`), and the pipelined
    waits (`sass.pipelined_copy_waits`, a key of their own). "products": the HMMAs as products of
    B_r B_c D, each warp owning 16 rows of its tile and one HMMA covering `USEFUL_MACS[dtype]` of the products'
    multiply-adds (m16n8k16: 16 x 8 x 16; 3xTF32's m16n8k8: 16 x 8 x 8 over its three products), so exactly 2
    for a forward that does S and P V once. "walk": the dependence walk of the iteration (`walk`) for blocks of
    `threads` (one warp if None)."""
    tree = sass.loop_tree(text)
    total = sum(1 for i in sass.parse_sass(text)[0] if i.base == "HMMA")
    holding = [node for node in tree if sum(i.base == "HMMA" for i in node.instructions) == total]
    if not total or not holding:
        raise ValueError(f"{cfg['variant']}: no SASS loop holds all its HMMA instructions")
    tile = min(holding, key=lambda node: len(node.instructions))
    counts = {"instructions": 0.0, "by_category": dict.fromkeys(sass.CATEGORIES, 0.0), "load_round_trips": 0.0,
              "unattributed": [], "hmma": 0.0, "shared_accesses": {}, "pipelined_waits": 0.0}
    inner_runs = {}  # an inner loop's start: its runs per iteration, None where no rule counts it (the walk)

    # the kernel's trip count names one loop of HMMA: with two or more such inner loops it could be any of
    # them, so none is counted by it (they are listed, and the estimate withheld)
    inner_hmma = [node for node in tree if node is not tile and tile.start <= node.start and node.end <= tile.end
                  and any(i.base == "HMMA" for i in node.instructions)]
    if len(inner_hmma) > 1:
        inner_trips = None

    def add(node, runs: int) -> None:
        for inst in node.own:
            counts["instructions"] += runs
            counts["by_category"][inst.category] += runs
            counts["hmma"] += runs * (inst.base == "HMMA")
            if inst.base in ("LDS", "STS", "LDSM", "LDGSTS") and not inst.never:  # not ptxas's @!PT placeholders
                counts["shared_accesses"][inst.base] = counts["shared_accesses"].get(inst.base, 0) + runs
        counts["load_round_trips"] += runs * sass.global_load_waits(node.own)
        for child in node.children:
            inner = tree[child]
            trips = None
            if inner_trips is not None and any(i.base == "HMMA" for i in inner.instructions):
                trips = inner_trips
            copying = sum(i.base == "LDGSTS" for i in inner.instructions)
            if copies is not None and copying and not any(i.base == "HMMA" for i in inner.instructions):
                if copies % copying:
                    raise ValueError(f"a staging loop of {copying} copies a trip cannot issue {copies} copies")
                trips = copies // copying
            if trips is None:
                counts["unattributed"].append(f"0x{inner.start:04x}-0x{inner.end:04x}")
            inner_runs[inner.start] = runs * trips if trips is not None else None
            add(inner, runs * (trips or 1))

    add(tile, 1)
    counts["walk"] = walk(text, tree, tile, inner_runs, threads)
    # cp.async waits over the whole body, the copies of its inner loops (a tile's staging loop) included
    covers = sass.async_copy_covers(tile.instructions)  # the steady state's waits, each with what covers it
    counts["load_round_trips"] += len(covers)
    counts["copy_covers"] = covers
    counts["pipelined_waits"] = sass.pipelined_copy_waits(tile.instructions)
    counts["ffma"] = counts["by_category"]["FFMA"]
    counts["mufu"] = counts["by_category"]["MUFU"]
    rows = cfg["block_q"] if cfg["variant"] in _WARP_OWNS_KEYS else cfg["block_k"]
    owned = 16 * cfg.get("row_blocks", 1)  # the rows a warp owns: 16 per m16 row block (MmaConfig.row_blocks)
    counts["products"] = counts["hmma"] * USEFUL_MACS[cfg["dtype"]] / (owned * rows * d_pad)
    return counts


# ----------------------------------------------------------------------------------------------------
# The dependence walk: one iteration issued in order by the warps of one SM sub-partition.

_GUARD = re.compile(r"/\*([0-9a-f]{4,})\*/\s+@!?(U?P\d)\s")  # a predicated instruction's guard
_REG = re.compile(r"(?<![\w.])(UR\d+|R\d+|UP\d|P\d)((?:\.\w+)*)")  # RZ, URZ, PT, UPT are constants: not matched
_FMA = {"FFMA", "FADD", "FMUL", "FFMA32I", "FADD32I", "FMUL32I", "HFMA2", "HADD2", "HMUL2"}
_XU = {"MUFU", "I2F", "F2I", "F2F", "I2I", "FRND"}
_LOADS = {"LDG", "LD", "LDL"}
_SHARED_LOADS = {"LDS", "LDSM"}
_NO_RESULT = {"STS", "STG", "ST", "STL", "RED", "REDG", "LDGSTS", "ATOMS", "ATOMG", "ATOM", "BAR", "BRA", "BSSY",
              "BSYNC", "EXIT", "CALL", "RET", "WARPSYNC", "NOP", "DEPBAR", "LDGDEPBAR", "JMP", "BREAK", "YIELD",
              "MEMBAR", "CCTL", "ERRBAR", "BPT"}
_CONTROL = {"BAR", "BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "WARPSYNC", "NOP", "DEPBAR", "LDGDEPBAR", "JMP",
            "BREAK", "YIELD", "MEMBAR", "CCTL", "ERRBAR", "BPT", "BMOV"}
# instructions whose first operands, the destination and the predicates right after it, are all written
_PREDICATE_WRITERS = {"ISETP", "FSETP", "DSETP", "HSETP2", "PLOP3", "IADD3", "LEA", "LOP3", "IMAD", "VIADD", "R2P",
                      "UISETP", "UPLOP3", "UIADD3", "ULEA", "ULOP3", "FCHK", "IMNMX"}


def _pipe(inst: sass.Instruction) -> str:
    """The machine.PIPES class of an instruction."""
    base = inst.base
    if base in _FMA:
        return "fma"
    if base in ("IMAD", "IMUL"):
        return "imad"
    if base == "HMMA":
        return "tensor"
    if base in _XU:
        return "xu"
    if base == "SHFL":
        return "shfl"
    if base in _SHARED_LOADS:
        return "lds"
    if base in _LOADS:
        return "ldg"
    if base in _NO_RESULT - _CONTROL:
        return "store"
    if base in _CONTROL:
        return "control"
    if base == "S2R":
        return "s2r"
    if base == "LDC":
        return "ldc"
    if (base.startswith("U") and base != "UMOV") or base in ("UMOV", "S2UR", "R2UR"):
        return "uniform"
    return "alu"


def _width(inst: sass.Instruction) -> int:
    """Registers an instruction's value operand spans: .64 2, .128 4, IMAD.WIDE and CS2R 2, LDSM .x2 / .x4 (its
    last modifier) 2 / 4, HMMA's float32 accumulator 4."""
    parts = inst.opcode.split(".")
    if inst.base == "LDSM" and parts[-1].isdigit():
        return int(parts[-1])
    if inst.base == "HMMA":
        return 4
    if "128" in parts:
        return 4
    if "64" in parts or "WIDE" in parts or inst.base == "CS2R":
        return 2
    return 1


def _registers(operand: str, width: int = 1) -> list[str]:
    """The registers (R, UR, P, UP) an operand names: an address's .64 register is a pair, a value register of a
    wide operation `width` consecutive ones."""
    out = []
    value = "[" not in operand
    for name, suffix in _REG.findall(operand):
        if name[0] in "RU" and not name.startswith("UP"):
            prefix = "UR" if name.startswith("UR") else "R"
            first = int(name[len(prefix):])
            count = 2 if "64" in suffix.split(".") else width if value else 1
            out += [f"{prefix}{first + k}" for k in range(count)]
        else:
            out.append(name)
    return out


def _effects(inst: sass.Instruction, guard: str | None) -> tuple[tuple, tuple]:
    """(registers written, registers read) of an instruction; its guard predicate is read."""
    parts = sass._operands(inst.operands)  # split at the commas outside brackets, names removed
    reads, writes = [guard] if guard else [], []
    width = _width(inst)
    if inst.base == "HMMA":  # D, A, B, C: 4, 4, 2, 4 registers (float32 accumulators, A and B fragments)
        for k, (operand, n) in enumerate(zip(parts, (4, 4, 2, 4))):
            (writes if k == 0 else reads).extend(_registers(operand, n))
        return tuple(writes), tuple(reads)
    if inst.base in _NO_RESULT:
        for operand in parts:
            reads += _registers(operand, width)
        return tuple(writes), tuple(reads)
    first = 0
    if inst.base == "SHFL" and len(parts) > 1:  # SHFL.BFLY PT, R71, R64, 0x1, 0x1f: a predicate, then the value
        writes += _registers(parts[0]) + _registers(parts[1])
        first = 2
    elif parts and "[" not in parts[0]:
        writes += _registers(parts[0], width)
        first = 1
        while (inst.base in _PREDICATE_WRITERS and first < len(parts)
               and re.fullmatch(r"U?P(\d|T)", parts[first])):  # carry-out and second predicate results
            writes += _registers(parts[first])
            first += 1
    for operand in parts[first:]:
        reads += _registers(operand)
    return tuple(writes), tuple(reads)


def _guards(text: str) -> dict[int, str]:
    """{address: guard predicate} of the predicated instructions of a listing."""
    return {int(m.group(1), 16): m.group(2) for m in _GUARD.finditer(text) if m.group(2) not in ("PT", "UPT")}


def _mma_shape(inst: sass.Instruction) -> str:
    return "m16n8k8" if ".1688" in inst.opcode or ".TF32" in inst.opcode else "m16n8k16"


def _decoded(sequence, guards: dict, device: Device) -> list[tuple]:
    """(pipe, pipe cycles, latency, writes, reads, barrier) of each instruction that executes."""
    out = []
    for inst in sequence:
        if inst.never:
            continue
        pipe = _pipe(inst)
        cost = PIPES[pipe]
        cycles = device.mma_cycles(_mma_shape(inst)) if pipe == "tensor" else cost.cycles
        writes, reads = _effects(inst, guards.get(inst.address))
        out.append((pipe, cycles, cost.latency, writes, reads, inst.base == "BAR"))
    return out


def pipe_cycles(sequence, device: Device = H200) -> dict:
    """Per warp, the cycles one iteration holds each pipe of its sub-partition: "issue" (one slot an
    instruction), "fma" (FFMA on either FMA pipe, one a cycle; IMAD two on the heavy one), "alu", "xu", "shfl",
    "tensor" (`machine.PIPES`, `Device.mma_cycles`)."""
    used = defaultdict(float)
    fma = imad = 0
    for inst in sequence:
        if inst.never:
            continue
        pipe = _pipe(inst)
        used["issue"] += 1
        if pipe == "fma":
            fma += 1
        elif pipe == "imad":
            imad += 1
        elif pipe in ("alu", "xu", "shfl"):
            used[pipe] += PIPES[pipe].cycles
        elif pipe == "tensor":
            used["tensor"] += device.mma_cycles(_mma_shape(inst))
    used["fma"] = max(fma + imad, PIPES["imad"].cycles * imad)  # two FMA pipes; IMAD on the heavy one only
    return {k: float(used[k]) for k in ("issue", "fma", "alu", "xu", "shfl", "tensor")}


def dependent_cycles(sequence, warps: int = 1, guards: dict | None = None, device: Device = H200,
                     laps: int = 3) -> float:
    """Cycles one SM sub-partition takes to issue one iteration of `sequence` on each of `warps` identical warps,
    alone (no other block): each cycle it issues one instruction of the first warp able to (the warp that
    issued last first, then the one furthest behind), in order per warp, when every register it reads or
    writes is ready (a result `machine.PIPES` latency after its producer issued), its pipe is free (the pipe's
    cycles after the last instruction on it) and, after a BAR, every warp has reached that BAR. The
    iteration is repeated (`laps`) and the last lap timed, so values carried from one iteration to the next
    wait as they do in the loop. A global load's value is ready at the fixed latency: its memory latency is the
    round trips' (`cycle_model`)."""
    guards = guards or {}
    decoded = _decoded(sequence, guards, device)
    n = len(decoded)
    if not n or warps < 1:
        return 0.0
    ready = [defaultdict(float) for _ in range(warps)]
    free = defaultdict(float)
    pc, lap = [0] * warps, [0] * warps
    at_barrier = [False] * warps
    released = [0.0] * warps
    arrived, last_arrival = defaultdict(int), defaultdict(float)
    barrier_seen = [0] * warps
    lap_ends = defaultdict(list)
    clock, last = -1.0, 0
    while min(lap) < laps:
        best = None
        for w in range(warps):
            if lap[w] >= laps or at_barrier[w]:
                continue
            pipe, _, _, writes, reads, _ = decoded[pc[w]]
            when = max(released[w], free[pipe] if pipe not in ("control", "store", "ldg") else 0.0,
                       max((ready[w][r] for r in reads + writes), default=0.0), clock + 1)
            key = (when, w != last, lap[w] * n + pc[w])
            if best is None or key < best[0]:
                best = (key, w)
        if best is None:  # every unfinished warp waits at a barrier no other warp will reach
            raise ValueError("the walk deadlocked at a barrier: the warps took different paths")
        (when, _, _), w = best
        pipe, cycles, latency, writes, reads, barrier = decoded[pc[w]]
        clock, last = when, w
        if pipe not in ("control", "store", "ldg"):
            free[pipe] = when + cycles
        for r in writes:
            ready[w][r] = when + latency
        if barrier:
            key = barrier_seen[w]
            barrier_seen[w] += 1
            arrived[key] += 1
            last_arrival[key] = max(last_arrival[key], when)
            at_barrier[w] = True
            if arrived[key] == warps:  # the last warp arrived: every warp goes on after it
                for other in range(warps):
                    if at_barrier[other] and barrier_seen[other] == key + 1:
                        at_barrier[other] = False
                        released[other] = last_arrival[key] + 1
        pc[w] += 1
        if pc[w] == n:
            pc[w] = 0
            lap[w] += 1
            lap_ends[lap[w]].append(when + 1)
    return float(max(lap_ends[laps]) - max(lap_ends[laps - 1]))


def _sequence(tree, node, runs: float, inner_runs: dict) -> list:
    """One run of `node` as issued: its instructions in address order, each inner loop's run inner_runs[start] /
    runs times where a rule counts it (inner_runs[start] is None: left out)."""
    out = []
    children = [tree[c] for c in node.children]
    for inst in node.instructions:
        inside = next((c for c in children if c.start <= inst.address <= c.end), None)
        if inside is None:
            out.append(inst)
        elif inst.address == inside.start and inner_runs.get(inside.start) is not None:
            child_runs = inner_runs[inside.start]
            out += _sequence(tree, inside, child_runs, inner_runs) * round(child_runs / runs)
    return out


def walk(text: str, tree, tile, inner_runs: dict, threads: int | None, device: Device = H200) -> dict:
    """The dependence walk of one tile-loop iteration (module docstring): its instructions (and its shared-memory
    ones: LDS, STS, LDSM, LDGSTS), the warps of one block on one sub-partition, the cycles they take alone
    (`dependent_cycles`) and each pipe's cycles per warp (`pipe_cycles`); "left_out": the inner loops without a
    trip-count rule."""
    sequence = _sequence(tree, tile, 1, inner_runs)
    block_warps = -(-(threads or SM90.warp_size) // SM90.warp_size)
    warps = -(-block_warps // SM90.schedulers_per_sm)  # of the block's, on one sub-partition
    shared = sum(1 for i in sequence if i.base in ("LDS", "STS", "LDSM", "LDGSTS") and not i.never)
    return {"instructions": float(sum(1 for i in sequence if not i.never)), "shared_accesses": float(shared),
            "warps": warps,
            "cycles": dependent_cycles(sequence, warps, _guards(text), device), "pipes": pipe_cycles(sequence, device),
            "left_out": [f"0x{start:04x}" for start, runs in inner_runs.items() if runs is None]}


def iterations_per_block(cfg: dict, blocks_per_head: int, n_q: int, n_k: int) -> float:
    """Tile-loop iterations a block runs, the mean over the blocks of one head: visited tiles / blocks."""
    tiles = tile_counts.count(n_q, n_k, cfg["block_q"], cfg["block_k"], cfg["causal"]).computed
    return tiles / blocks_per_head


def hbm_bytes(cfg: dict, launch: dict, concurrent_blocks: int, blocks_per_head: int, device: Device = H200) -> dict:
    """HBM bytes of one call: iomodel's element counts in bytes (`counted`), and the bytes if each tensor moves
    once (`once`); the call pays `once` when the operands its blocks re-read, for the heads in flight
    (concurrent blocks / blocks per head, plus one straddling), fit in L2, else `counted`."""
    n, batch, heads, d, d_v = launch["n"], launch["batch"], launch["heads"], cfg["head_dim"], value_dim(cfg)
    itemsize = 2 if cfg["dtype"] in ("float16", "bfloat16") else 4
    variant, block_q, block_k, causal = cfg["variant"], cfg["block_q"], cfg["block_k"], cfg["causal"]
    if variant.startswith("bwd"):  # the whole backward call of the kernel's order (det: its kv pass's atomics
        order = "kv" if variant in KV_OUTER else "q"  # included): an upper bound on one kernel's bytes
        ledger = iomodel.traffic_backward(order, n, n, d, block_q, block_k, causal, batch, heads, d_v=d_v)
        reread = (n * (d * itemsize + d_v * itemsize + 4 * d) + 8 * n if order == "kv"  # Q dO dQ LSE D
                  else n * (d + d_v) * itemsize)  # K V
    else:
        ledger = iomodel.traffic(variant[:2], n, n, d, block_q, block_k, causal, batch, heads, d_v=d_v)
        reread = (n * (d * itemsize + d_v * 4) + 8 * n if variant in KV_OUTER  # Q O l m
                  else n * (d + d_v) * itemsize)  # K V
    counted = iomodel.total_bytes(ledger, itemsize)
    once = _once_bytes(ledger, itemsize, batch * heads, n, d, d_v)
    in_flight = math.ceil(concurrent_blocks / blocks_per_head) + 1
    fits = in_flight * reread <= device.l2_bytes
    return {"counted": counted, "once": once, "fits_l2": fits, "paid": once if fits else counted}


def _once_bytes(ledger, itemsize: int, heads: int, n: int, d: int, d_v: int | None = None) -> int:
    """Every tensor the ledger touches, read and written at most once: N d per head for the (N, d) tensors
    (N d_v for V, O, dO, dV), N for the statistics."""
    sizes = iomodel.to_bytes(ledger, itemsize)
    total = 0
    for side in ("read", "write"):
        for tensor, nbytes in sizes[side].items():
            if nbytes:
                per_element = nbytes / max(1, (ledger.reads if side == "read" else ledger.writes)[tensor])
                width = (d_v or d) if tensor in ("V", "O", "dO", "dV") else d
                elements = heads * n * (1 if tensor in ("l", "m", "LSE", "D") else width)
                total += elements * per_element
    return int(total)


def kernel_counts(cfg: dict, text: str, built) -> dict:
    """`iteration_counts` of a built kernel (its block shape, and the engine's padded D from its layout)."""
    config = built.config
    _, block = built.launch_shape(1, 1, cfg["block_q"])
    if cfg["variant"] in MMA_KERNELS:
        counts = mma_iteration_counts(text, cfg, config.padded_dim, getattr(built, "inner_trips", None),
                                      getattr(built, "staged_copies", None), math.prod(block))
        # the tensor-core kernels multiply over d_v padded as d is (MmaConfig.padded_value_dim) where V has it
        counts["value_ratio"] = config.padded_value_dim / config.padded_dim
        return counts
    d_pad = config.layout.d_pad if getattr(config, "engine", False) else None  # max(d, d_v): every product
    return iteration_counts(text, cfg, math.prod(block), d_pad)


def estimate_configuration(cfg: dict, counts: dict, occupancy: dict, grid: tuple, block: tuple, wavefronts: float,
                           launch: dict, device: Device = H200,
                           global_lines: float = 0.0) -> tuple[Estimate | None, dict]:
    """The whole-kernel estimate of one configuration from its `kernel_counts`, the shared-memory wavefronts and
    the global accesses' 128-byte lines of one iteration (module docstring), and what it rests on; None, with
    the reason in "withheld", when the tile loop's FFMAs do not amount to the kernel's products, or when a
    tensor-core kernel's tile loop holds a loop without a trip-count rule (but a causal build's walk, which
    leaves its PARTIAL tiles' loops out)."""
    mma = cfg["variant"] in MMA_KERNELS
    expected = expected_products(cfg, counts.get("value_ratio", 1.0))
    if abs(counts["products"] - expected) > (1e-9 if mma else PRODUCT_SLACK):  # the loops are not the products
        return None, {"withheld": f"the SASS loops amount to {counts['products']:.2f} products of B_r B_c D, "
                                  f"not the kernel's {expected:g}"}
    walked = counts.get("walk")
    # a loop without a trip-count rule: the static count is not one iteration's, but in a causal build's walk
    # (which leaves out its PARTIAL tiles' exact path: `walk`)
    if mma and counts["unattributed"] and not (cfg["causal"] and walked):
        return None, {"withheld": f"loops inside the tile loop ({', '.join(counts['unattributed'])}) have no "
                                  f"trip-count rule for the tensor-core kernels"}
    threads = math.prod(block)
    warps = -(-threads // SM90.warp_size)
    blocks = math.prod(grid)
    blocks_per_head = blocks // (launch["batch"] * launch["heads"]) or 1
    iterations = iterations_per_block(cfg, blocks_per_head, launch["n"], launch["n"])
    # Useful flops as flash-attn's benchmarks count them (useful_flops), spread evenly over the iterations.
    useful = useful_flops(cfg, launch)
    tensor = counts.get("hmma", 0) * warps * (device.mma_cycles(MMA_SHAPE[cfg["dtype"]]) if mma else 0.0)
    walk_terms = {}
    if walked:  # the iteration as the walk issues it: its instructions, its warps' own cycles, its busiest pipe
        busiest = max(walked["pipes"], key=walked["pipes"].get)
        walk_terms = dict(own_cycles=walked["cycles"], pipe_cycles=walked["pipes"][busiest], pipe=busiest)
    instructions = walked["instructions"] if walked else counts["instructions"]
    cost = IterationCost(warp_instructions=instructions * warps, mufu=counts["mufu"] * warps,
                         wavefronts=wavefronts, load_round_trips=counts["load_round_trips"],
                         flops=useful / (iterations * blocks), tensor_cycles=tensor,
                         pipelined_waits=counts.get("pipelined_waits", 0.0),
                         copy_covers=tuple(counts.get("copy_covers", ())), global_lines=global_lines, **walk_terms)
    resident = min(occupancy["blocks_per_sm"], math.ceil(blocks / device.sms))
    traffic = hbm_bytes(cfg, launch, resident * device.sms, blocks_per_head, device)
    run = Launch(blocks=blocks, warps_per_block=warps, blocks_per_sm=occupancy["blocks_per_sm"],
                 iterations_per_block=iterations, hbm_bytes=traffic["paid"], l2_resident=traffic["fits_l2"])
    return estimate(cost, run, device), {"hbm": traffic, "wavefronts": wavefronts, "global_lines": global_lines,
                                         "iterations": iterations, "warp_instructions": cost.warp_instructions}
