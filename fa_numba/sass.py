"""SASS text processing: instructions and their categories, the loops of a kernel, global-load round trips.

Pure functions of an `nvdisasm -c` listing (no GPU, no nvdisasm needed to test them). `profile` compiles and
disassembles a kernel and reads its innermost loops from here; `whole_kernel` reads the loop tree, the tile
loop and the round trips.

- `parse_sass`: the instructions, label addresses and backward/forward branches of a listing.
- Loops. ptxas lays a loop out contiguously, so a branch (BRA or JMP) to a label at an address before its own
  closes a loop over [target, branch]; the one-instruction `BRA` to itself that ends every kernel is not a
  loop. `innermost_loops` keeps the loops with no other loop inside (what `profile` counts per iteration),
  `hot_loops` the matrix-product ones among them, `loop_tree` every loop with its parent and children, and
  `enclosing_loop` the smallest loop around a set of loops (the tile loop around the matrix products).
- `global_load_waits`: how many times a straight-line run of instructions (a loop body's `own`) waits for a
  global load, under in-order completion.
- `float64_instructions`: any double-precision instruction (a stray float64 literal).

A loop's instructions are counted once each: one iteration that takes every path of its body.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\s*([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")

CATEGORIES = ("FFMA", "FMUL", "FADD", "HFMA2/HMMA", "LDS/STS", "LDL/STL", "LDG/STG", "MUFU", "integer", "branch",
              "other")
_BY_OPCODE = {
    "FFMA": "FFMA", "FFMA32I": "FFMA", "FMUL": "FMUL", "FMUL32I": "FMUL", "FADD": "FADD", "FADD32I": "FADD",
    "HFMA2": "HFMA2/HMMA", "HMMA": "HFMA2/HMMA", "HADD2": "HFMA2/HMMA", "HMUL2": "HFMA2/HMMA",
    "LDS": "LDS/STS", "STS": "LDS/STS", "LDSM": "LDS/STS", "ATOMS": "LDS/STS",
    "LDL": "LDL/STL", "STL": "LDL/STL",
    "LDG": "LDG/STG", "STG": "LDG/STG", "LDGSTS": "LDG/STG", "RED": "LDG/STG", "REDG": "LDG/STG", "ATOMG": "LDG/STG", "LD": "LDG/STG",
    "ST": "LDG/STG", "ATOM": "LDG/STG",
    "MUFU": "MUFU",
    "BRA": "branch", "BRX": "branch", "JMP": "branch", "JMX": "branch", "CALL": "branch", "RET": "branch",
    "EXIT": "branch", "BSSY": "branch", "BSYNC": "branch", "BREAK": "branch", "WARPSYNC": "branch",
}
# Integer and data-movement ALU work, uniform-datapath forms included (U prefix): address arithmetic, loop
# counters, index wraparound, moves and selects.
_INTEGER = {"IMAD", "IADD3", "IADD", "IADD32I", "LOP3", "LOP", "LOP32I", "SHF", "SHL", "SHR", "ISETP", "LEA",
            "IMNMX", "VIMNMX", "VIADD", "VIADDMNMX", "IABS", "POPC", "FLO", "BREV", "PRMT", "SEL", "ISCADD", "IMUL",
            "MOV", "MOV32I", "CS2R", "S2R", "S2UR", "R2UR", "UMOV", "IDP", "BMSK", "SGXT", "PLOP3", "P2R", "R2P"}
LSU_CATEGORIES = ("LDS/STS", "LDL/STL")


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # with its modifiers, e.g. "LDS.128"
    operands: str
    predicated: bool
    never: bool = False  # guarded by @!PT (a scheduling placeholder ptxas puts before LDGSTS): it never executes

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def category(self) -> str:
        base = self.base
        if base in _BY_OPCODE:
            return _BY_OPCODE[base]
        if base in _INTEGER or (base.startswith("U") and base[1:] in _INTEGER) or base in ("ULDC", "LDC"):
            return "integer" if base not in ("ULDC", "LDC") else "other"
        return "other"


@dataclass(frozen=True)
class Loop:
    start: int  # address of the first instruction (the back edge's target)
    end: int  # address of the branch that closes the loop
    depth: int  # loops enclosing it, itself included: 1 for a loop at the kernel's top level
    instructions: tuple[Instruction, ...]

    @property
    def mix(self) -> dict[str, int]:
        counts = Counter(i.category for i in self.instructions)
        return {c: counts.get(c, 0) for c in CATEGORIES}

    @property
    def opcodes(self) -> dict[str, int]:
        return dict(Counter(i.opcode for i in self.instructions).most_common())

    @property
    def ffma(self) -> int:
        return self.mix["FFMA"]

    @property
    def issued(self) -> int:
        return len(self.instructions)

    @property
    def issued_per_ffma(self) -> float:
        return self.issued / self.ffma if self.ffma else math.inf

    def as_dict(self) -> dict:
        return {"start": f"0x{self.start:04x}", "end": f"0x{self.end:04x}", "depth": self.depth, "issued": self.issued,
                "ffma": self.ffma, "issued_per_ffma": round(self.issued_per_ffma, 3) if self.ffma else None,
                "mix": self.mix, "opcodes": self.opcodes}


def parse_sass(text: str) -> tuple[list[Instruction], dict[str, int], list[tuple[int, str]]]:
    """Instructions, label addresses and (branch address, target label) pairs of an `nvdisasm -c` listing."""
    instructions, labels, branches = [], {}, []
    pending = []
    for line in text.splitlines():
        found = _LABEL.match(line)
        if found:
            pending.append(found.group(1))
            continue
        found = _INSTRUCTION.search(line)
        if not found:
            continue
        address = int(found.group(1), 16)
        guard = (found.group(2) or "").strip()
        inst = Instruction(address, found.group(3), found.group(4).strip(), bool(guard), guard == "@!PT")
        instructions.append(inst)
        for label in pending:
            labels[label] = address
        pending = []
        target = _TARGET.search(inst.operands)
        if target and inst.base in ("BRA", "JMP"):
            branches.append((address, target.group(1)))
    return instructions, labels, branches


def _loop_spans(text: str) -> tuple[list[Instruction], set[tuple[int, int]]]:
    """The instructions of a listing and the (start, end) span of each of its loops: a BRA or JMP to a label
    at an address before its own closes a loop over [target, branch]."""
    instructions, labels, branches = parse_sass(text)
    spans = set()
    for address, label in branches:
        start = labels.get(label)
        if start is not None and start < address:
            spans.add((start, address))
    return instructions, spans


def innermost_loops(text: str) -> list[Loop]:
    """The innermost loops of a kernel's SASS, in address order.

    A branch to a label at an address <= its own closes a loop over [target, branch] (ptxas lays a loop
    out contiguously); the one-instruction `BRA` to itself that ends every kernel is not a loop. A loop is
    innermost when no other loop lies strictly inside its range. Its mix counts each instruction once:
    the instructions issued by one iteration that takes every path.
    """
    instructions, spans = _loop_spans(text)
    inner = [(s, e) for s, e in spans
             if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in spans)]
    return [Loop(s, e, sum(1 for s2, e2 in spans if s2 <= s and e <= e2),
                 tuple(i for i in instructions if s <= i.address <= e)) for s, e in sorted(inner)]


def hot_loops(loops: list[Loop]) -> list[Loop]:
    """The matrix-product loops: innermost loops whose FFMAs multiply operands loaded from on-chip memory
    (the loop has LDS or LDL) and which evaluate no transcendental (no MUFU).

    The SASS does not say how often a loop runs; what marks the Q K^T and P V loops of an attention kernel is
    what they do. This keeps them however the compiler unrolled or nested them, and leaves out the exp
    loops (FFMAs around MUFU.EX2), the divisions of the epilogue and the tile loads. If no loop qualifies,
    every innermost loop with an FFMA is taken.
    """
    with_ffma = [loop for loop in loops if loop.ffma]
    matrix = [loop for loop in with_ffma
              if (loop.mix["LDS/STS"] or loop.mix["LDL/STL"]) and not loop.mix["MUFU"]]
    return matrix or with_ffma


def float64_instructions(text: str) -> list[str]:
    """Opcodes of double-precision arithmetic or conversions in a listing (a stray float64 literal)."""
    instructions, _, _ = parse_sass(text)
    return sorted({i.opcode for i in instructions
                   if i.base in ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DMMA") or ".F64" in i.opcode})


# ----------------------------------------------------------------------------------------------------
# The loop tree.

@dataclass(frozen=True)
class LoopNode(Loop):
    """One loop of `loop_tree`: a `Loop` over every instruction of its span (`instructions`, `mix`, ...), with
    its place in the tree (indices into the tree's list) and the instructions it issues itself (`own`: those
    of its span outside every child loop)."""

    parent: int | None
    children: tuple[int, ...]
    own: tuple[Instruction, ...]


def _inside(inner: tuple[int, int], outer: tuple[int, int]) -> bool:
    """Span `inner` lies strictly inside span `outer` (inside and not the same span)."""
    return inner != outer and outer[0] <= inner[0] and inner[1] <= outer[1]


def loop_tree(text: str) -> list[LoopNode]:
    """Every loop of a listing, by the rule of `innermost_loops`, ordered by start address, an outer loop before
    the loops it holds; `parent` and `children` index this list.

    A loop's parent is the smallest loop whose span strictly contains its own; depth counts it and its
    ancestors (1 at the kernel's top level), so the leaves are exactly `innermost_loops`, at the same depth.
    Two back edges to one header (a loop with a `continue`) give two spans with one start: the shorter is the
    inner loop, a child of the longer, whose `own` is then what lies after the first back edge. ptxas nests
    loops as intervals; two spans that overlap without one holding the other (irreducible control flow) are
    both kept, neither the other's parent, and the instructions they share count in the `own` of each.
    """
    instructions, spans = _loop_spans(text)
    order = sorted(spans, key=lambda span: (span[0], -span[1]))
    parents = []
    for span in order:
        around = [k for k, other in enumerate(order) if _inside(span, other)]
        parents.append(min(around, key=lambda k: order[k][1] - order[k][0]) if around else None)
    depths = []
    for parent in parents:  # a parent comes before its children: its depth is known
        depths.append(1 if parent is None else depths[parent] + 1)
    tree = []
    for k, (start, end) in enumerate(order):
        children = tuple(c for c, parent in enumerate(parents) if parent == k)
        body = tuple(i for i in instructions if start <= i.address <= end)
        own = tuple(i for i in body if not any(order[c][0] <= i.address <= order[c][1] for c in children))
        tree.append(LoopNode(start, end, depths[k], body, parents[k], children, own))
    return tree


def enclosing_loop(tree: list[LoopNode], loops: list[Loop]) -> LoopNode | None:
    """The smallest loop of `tree` that strictly contains every one of `loops` (the tile loop around the
    matrix-product loops of `hot_loops`); None if no loop holds them all, or if `loops` is empty."""
    spans = [(loop.start, loop.end) for loop in loops]
    around = [node for node in tree if spans and all(_inside(span, (node.start, node.end)) for span in spans)]
    return min(around, key=lambda node: node.end - node.start, default=None)


# ----------------------------------------------------------------------------------------------------
# Registers and global-load round trips.

# A general register: R0..R255, not RZ, nor the R of UR4 (uniform), SR_TID (special) or SRZ. Its suffixes:
# .reuse (operand cache), .H0_H0 (a half), .64 (in an address: the pair R, R+1).
_REGISTER = re.compile(r"(?<![\w.])R(\d+)((?:\.\w+)*)")
_NAME = re.compile(r"`\([^)]*\)")  # a branch target or a called function's name: no register in it
_WIDTH = {"64": 2, "128": 4, "256": 8}  # registers a load writes or a store reads, by its size modifier
GLOBAL_LOADS = ("LDG", "LD")  # LD: a generic load, which Numba's array accesses are
_STORES = ("STS", "STG", "ST", "STL", "RED", "REDG")  # no register destination; the value is as wide as the store


def _operands(text: str) -> list[str]:
    """An instruction's operands, split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in _NAME.sub("", text):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return parts + [current.strip()] if current.strip() else parts


def _width(opcode: str) -> int:
    """Registers of a load's destination or a store's value: 2 for .64, 4 for .128, else 1 (.U8, .S16 ...)."""
    return max([_WIDTH.get(m, 1) for m in opcode.split(".")[1:]], default=1)


def _registers(operand: str, width: int = 1) -> set[int]:
    """The general registers an operand names: an address register with .64 is the pair R, R+1; a value
    register (an operand that is one register) stands for `width` consecutive ones."""
    plain = not any(c in operand for c in "[]")
    found = set()
    for number, suffix in _REGISTER.findall(operand):
        count = 2 if "64" in suffix.split(".") else width if plain else 1
        found.update(range(int(number), int(number) + count))
    return found


def _is_register(operand: str) -> bool:
    return _REGISTER.fullmatch(operand) is not None


def load_destination(inst: Instruction) -> set[int]:
    """The registers a global load (`GLOBAL_LOADS`) writes: its first operand, as wide as the load (LDG.E.128 R4:
    R4..R7); empty for any other instruction (LDGSTS, the asynchronous copy, writes no register)."""
    if inst.base not in GLOBAL_LOADS:
        return set()
    operands = _operands(inst.operands)
    return _registers(operands[0], _width(inst.opcode)) if operands and _is_register(operands[0]) else set()


def touched_registers(inst: Instruction) -> set[int]:
    """Every general register an instruction reads or writes: a load's destination as wide as the load, a
    store's value as wide as the store (STS.128 [R2], R4: R2 and R4..R7), an address's .64 pair; other
    registers as named (the implicit high half of 64-bit arithmetic, DADD or IMAD.WIDE, is not added)."""
    wide = inst.base in GLOBAL_LOADS or inst.base in _STORES
    found = set()
    for k, operand in enumerate(_operands(inst.operands)):
        value = inst.base in _STORES or k == 0  # a store's value operand, or a load's destination
        found |= _registers(operand, _width(inst.opcode) if wide and value else 1)
    return found


def global_load_waits(instructions) -> int:
    """How many times a thread waits for a global load while issuing `instructions` in address order.

    Scan: a global load (`GLOBAL_LOADS`: LDG in any form, LD) puts its destination registers in flight. An
    instruction that reads or writes a register in flight waits: count 1 and empty the in-flight set. A read
    waits for the value; a write waits too (write after write: the load's late write-back must not land on the
    new value; the GPU's scoreboard makes both wait). The model:

    - in-order completion: once the oldest awaited load has arrived, the loads issued after it are taken as
      arrived too (issued a few cycles later, they travel alongside), so loads issued back to back before the
      first use cost one round trip, and a load whose address needs another load's value a second one;
    - straight-line code: a branchy body is scanned as if every path were taken once (as `Loop` counts), and a
      predicated instruction counts as issued;
    - one pass: loads still in flight at the end are not counted (a load prefetched for the next iteration of
      a loop costs no wait here);
    - only global loads: LDS and LDL are not waited for, LDGSTS and TMA copies write no register, and a store,
      RED or atomic without a destination never waits for memory.
    """
    waits, in_flight = 0, set()
    for inst in instructions:
        if touched_registers(inst) & in_flight:
            waits += 1
            in_flight = set()
        in_flight |= load_destination(inst)
    return waits


def _groups_left(inst: Instruction) -> int:
    """N of a DEPBAR that waits until at most N of this thread's copy groups are still in flight
    (cp.async.wait_group N: "DEPBAR.LE SB0, 0x1"); 0 for any other form of DEPBAR."""
    found = re.search(r"SB0\s*,\s*(0x[0-9a-fA-F]+|\d+)", inst.operands)
    return int(found.group(1), 0) if found else 0


def async_copy_covers(instructions) -> list[float]:
    """The waits for every group (cp.async.wait_group 0) of a loop body run over and over, and what covers
    each: for every such DEPBAR with copies in flight, the share of the body's instructions issued between the
    newest of those copies and the wait, counted around the loop's back edge (a copy issued late in one
    iteration and waited for early in the next, as FlashAttention-2's K_j+1 is, is covered by the rest of the
    iteration). One entry per wait, in address order: a copy committed and waited for at once is covered by
    about 0 (the instructions between, a fraction of the body), one issued before S and waited for after it
    by S's share. Straight-line code, the body scanned twice and the second pass counted (the steady state).
    `cycle_model` takes each wait as an L2 round trip of which this share of the iteration's own work hides
    a part. A DEPBAR with no copy in flight costs nothing here, and one that leaves groups in flight is
    `pipelined_copy_waits`'."""
    body = list(instructions)
    covers, newest = [], None
    for lap in (0, 1):
        for at, inst in enumerate(body, start=lap * len(body)):
            if inst.base == "LDGSTS":
                newest = at
            elif inst.base == "DEPBAR" and newest is not None and not _groups_left(inst):
                if lap:
                    covers.append((at - newest - 1) / len(body))
                newest = None
    return covers


def pipelined_copy_waits(instructions) -> float:
    """The waits of a software pipeline in a loop body that issues copies (LDGSTS): each DEPBAR that leaves N >=
    1 groups in flight (cp.async.wait_group N) waits for copies committed N groups earlier, which with one
    group per iteration (the pipelines of this project) were issued N iterations before. Returns the sum of
    1/N: the round trips the iteration must cover by itself (`cycle_model`: such a wait costs at least L / N
    per iteration, not L plus the iteration's work). 0 for a body without copies."""
    if not any(inst.base == "LDGSTS" for inst in instructions):
        return 0.0
    return sum(1.0 / n for n in (_groups_left(inst) for inst in instructions if inst.base == "DEPBAR") if n)
