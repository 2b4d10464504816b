"""Shared-memory bank conflicts: how many wavefronts one warp-wide shared-memory access costs.

The rule, for NVIDIA compute capability 7.0 to 9.0 (V100 .. H100/H200):

- Shared memory is 32 banks of 4 bytes: the 4-byte word at byte address a lives in bank (a // 4) % 32.
- A warp access of 32-bit (or narrower) elements is served in one phase of all 32 lanes; a 64-bit access in
  two half-warp phases (lanes 0-15, 16-31); a 128-bit access in four quarter-warp phases (lanes 0-7, 8-15,
  16-23, 24-31). A lane's 64-bit access touches 2 consecutive words (2 banks), a 128-bit access 4.
- Paired 128-bit loads: when every active lane n reads the same address as lane n ^ 1 (and that lane is
  active), or every one the same as lane n ^ 2, an LDS.128 is served in two half-warp phases instead of four
  quarter-warp ones (the hardware packs the pairs' returns). A warp whose 16-lane halves each read one
  address (a row group's broadcast of one fragment) costs 2 wavefronts, not 4. Stores and 64-bit loads keep
  their phases (no measurement says otherwise).
- In each phase the cost, in wavefronts, is the largest number of DISTINCT words any one bank is asked for:
  lanes asking for the same word share it (a broadcast, counted once). A lane not in the access asks for
  nothing; a phase with no active lane costs 0. A warp access costs the sum over its phases.

Sources: the NVIDIA CUDA C++ Programming Guide, "Shared Memory" under Compute Capability 5.x (which 7.x, 8.x
and 9.0 refer back to): 32 banks, successive 32-bit words in successive banks, a conflict-free request
unless two threads ask for different words of one bank, the same word broadcast; and the widely used
reading of 64-bit and 128-bit requests as served per half-warp and per quarter-warp (a conflict-free warp-wide
LDS.64 / LDS.128 moves 256 / 512 bytes at 128 bytes per wavefront: 2 and 4 wavefronts). The paired-load rule
is public Nsight Compute evidence, not NVIDIA documentation: an LDS.128 whose lanes 0-15 read one address and
16-31 another costs 2 wavefronts on an H100 (CC 9.0) and an A10, and one whose lane t and t + 16 share an
address costs 8 (forums.developer.nvidia.com/t/373160: the measured counts are the probes of
tests/test_banks.py); the pairing condition is an NVIDIA engineer's answer for CC 7.x
(forums.developer.nvidia.com/t/77228: "requests per instruction reduce from 4 to 2"), assumed to hold on 9.0
since the measurement above agrees with it. A lane whose partner is not in the access breaks the pairing
(the conservative reading: more wavefronts, never fewer).
- ldmatrix (kind "matrix"): .x1/.x2/.x4 read 1, 2 or 4 8x8 matrices of 16-bit elements, lanes 8m .. 8m + 7
  giving the 16-byte rows of matrix m (lanes past the last matrix give none). Each matrix is one phase of 8
  rows (128 bytes if conflict-free): the 128-bit quarter-warp rule, never paired. So a conflict-free x4 costs
  4 wavefronts and x2 costs 2, and 8 rows 128 bytes apart (all in the same 4 banks) cost 8 per matrix. This
  is the layout reading of the PTX ISA ("ldmatrix": each of the 8 threads of a group gives one row address),
  priced like any 128-bit access; CUTLASS's padded and swizzled layouts are built on the same reading.

This is a model of the hardware, not a measurement: calibrate it on a GPU (Nsight Compute's
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld / _op_st on probe kernels) before trusting a figure built on it.
Pure Python: no numba, no GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

BANKS = 32  # shared-memory banks
BANK_BYTES = 4  # bytes per bank word
WARP = 32  # lanes per warp
WIDTHS = (1, 2, 4, 8, 16)  # bytes one lane can load or store in one shared-memory instruction
_LANES_PER_PHASE = {1: WARP, 2: WARP, 4: WARP, 8: WARP // 2, 16: WARP // 4}


KINDS = ("load", "store", "matrix")  # "matrix": ldmatrix (LDSM), 16-byte rows, one 8x8 matrix per phase
PAIRED_WIDTH = 16  # the access width the paired-load rule applies to (module docstring)


def phase_lanes(width_bytes: int, paired: bool = False) -> int:
    """Lanes served together in one phase of an access of width_bytes per lane: 32, 16 (64-bit) or 8 (128-bit);
    16 for a paired 128-bit load (module docstring)."""
    if width_bytes not in _LANES_PER_PHASE:
        raise ValueError(f"width_bytes must be one of {WIDTHS}, got {width_bytes!r}")
    if paired and width_bytes == PAIRED_WIDTH:
        return WARP // 2
    return _LANES_PER_PHASE[width_bytes]


def is_paired(byte_addresses_by_lane: Mapping[int, int] | Sequence[int | None], width_bytes: int,
           kind: str = "load") -> bool:
    """Whether the paired-load rule applies: a 128-bit load whose every active lane n has lane n ^ 1 active
    at the same address, or every one lane n ^ 2 (module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "matrix" and width_bytes != PAIRED_WIDTH:
        raise ValueError(f"an ldmatrix ('matrix') access reads 16-byte rows, got width_bytes={width_bytes}")
    if kind != "load" or width_bytes != PAIRED_WIDTH:
        return False
    active = _active_lanes(byte_addresses_by_lane, width_bytes)
    return bool(active) and any(all(active.get(lane ^ partner) == address for lane, address in active.items())
                                for partner in (1, 2))


def _active_lanes(byte_addresses_by_lane: Mapping[int, int] | Sequence[int | None],
                  width_bytes: int) -> dict[int, int]:
    """{lane: byte address} of the lanes in the access, checked: lanes 0..31, addresses >= 0 and aligned."""
    if isinstance(byte_addresses_by_lane, Mapping):
        items = byte_addresses_by_lane.items()
    else:
        items = enumerate(byte_addresses_by_lane)
    active = {}
    for lane, address in items:
        if address is None:
            continue
        if not 0 <= lane < WARP:
            raise ValueError(f"lane {lane} is outside the warp (0..{WARP - 1})")
        if address < 0 or address % width_bytes:
            raise ValueError(f"lane {lane}: byte address {address} is not a non-negative multiple of the "
                             f"access width {width_bytes} (a misaligned access faults on the GPU)")
        active[lane] = address
    return active


def wavefronts(byte_addresses_by_lane: Mapping[int, int] | Sequence[int | None], width_bytes: int,
               kind: str = "load") -> int:
    """Wavefronts of one warp access: byte_addresses_by_lane maps a lane to the byte address it accesses
    (a dict of the active lanes, or a sequence indexed by lane with None for an inactive one); width_bytes
    is what each lane loads or stores (1, 2, 4, 8 or 16); kind "load" or "store". See the module docstring."""
    per_phase = phase_lanes(width_bytes, is_paired(byte_addresses_by_lane, width_bytes, kind))
    active = _active_lanes(byte_addresses_by_lane, width_bytes)
    words_per_lane = max(1, width_bytes // BANK_BYTES)
    total = 0
    for first in range(0, WARP, per_phase):
        words_by_bank: dict[int, set[int]] = {}
        for lane in range(first, first + per_phase):
            if lane not in active:
                continue
            first_word = active[lane] // BANK_BYTES
            for word in range(first_word, first_word + words_per_lane):
                words_by_bank.setdefault(word % BANKS, set()).add(word)
        total += max((len(words) for words in words_by_bank.values()), default=0)
    return total


def ideal_wavefronts(active_lanes: int, width_bytes: int, paired: bool = False) -> int:
    """The fewest wavefronts an access of width_bytes by active_lanes lanes can cost (none conflicting, the
    lanes packed into as few phases as possible): ceil(active_lanes / phase_lanes). A measured count over
    this is the access's conflict degree."""
    if not 0 <= active_lanes <= WARP:
        raise ValueError(f"active_lanes must be in 0..{WARP}, got {active_lanes}")
    per_phase = phase_lanes(width_bytes, paired)
    return -(-active_lanes // per_phase)
