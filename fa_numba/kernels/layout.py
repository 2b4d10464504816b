"""The tile engine's compile-time layout: tiles, micro-tiles, which thread owns what, and the shared-memory regions.

Pure Python (no Numba): `engine.make_engine` compiles device functions for one `Layout`, and the profile,
the tracer's region labels and the tests read the same object. The engine's docstring
(fa_numba/kernels/engine.py) says what each region holds and how the threads use them; the choices made here
(`Layout.owner`, `Layout.column`, `Layout.p_stride`, `in_flight`) are priced by the bank rule
(fa_numba/banks.py) and the whole-kernel model (docs/profile.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fa_numba.kernels.common import SHARED_BYTES_LIMIT, ValueDim

FLOAT_BYTES = 4
MICRO_CHOICES = (4, 2, 1)
# Global loads a thread keeps in flight while loading a tile (registers held until they are stored), by order.
# v2's 256-thread blocks: 16 cover a whole K_j and V_j at d <= 128 (d = 256 would hold 64 and halve its
# occupancy). v1 runs one block per (batch, head), typically one per SM, so registers cost it no occupancy
# until a block no longer fits, and its Q_i^T at d = 128 (32 loads per thread) goes in one round trip.
IN_FLIGHT = {"v1": 32, "v2": 16}
# Blocks under 256 threads keep 16 (v1's at d = 256 spill at 32: 255 registers, 108 bytes; v2's 88 bytes),
# except v2's up to d = 64, which take 32: its shipped 128-thread layout there (V2_MICRO) then loads its 32
# elements of K_j and V_j in one round trip, not two (2026-12-05, the whole-kernel model, float32: 96 -> 127
# registers, 5 -> 4 blocks an SM, 38.1 -> 41.6 TFLOP/s, most of it whole waves: docs/profile.md), as do the
# decode layouts up to d = 64 (v2's too). At d = 128 32 took 168 registers against 16's 128 (3 blocks an SM
# against 4) and the estimate fell, 42.1 -> 41.2.
IN_FLIGHT_SMALL_BLOCKS = 16
IN_FLIGHT_V2_SMALL_BLOCKS = 32  # v2's blocks under 256 threads at d_pad <= V2_SMALL_BLOCKS_MAX_D
V2_SMALL_BLOCKS_MAX_D = 64

def in_flight(layout: "Layout") -> int:
    """Global loads a thread of this layout keeps in flight while it loads a tile (IN_FLIGHT and the two
    constants after it)."""
    if layout.threads >= 256:
        return IN_FLIGHT[layout.order]
    if layout.order == "v2" and layout.d_pad <= V2_SMALL_BLOCKS_MAX_D:
        return IN_FLIGHT_V2_SMALL_BLOCKS
    return IN_FLIGHT_SMALL_BLOCKS


@dataclass(frozen=True)
class Layout(ValueDim):
    """Compile-time shape of one engine kernel: tiles, micro-tiles, threads and shared-memory regions."""

    order: str
    block_q: int  # B_r
    block_k: int  # B_c
    head_dim: int  # d
    tm: int  # rows of S (and O) per thread
    tn: int  # key columns of S per thread
    budget: int = SHARED_BYTES_LIMIT  # bytes of static shared memory (tests lower it to exercise aliasing)
    value_dim: int = 0  # d_v, V's and O's head dim; 0: head_dim (the split decode kernel takes its own)

    @property
    def ry(self) -> int:
        return self.block_q // self.tm

    @property
    def cx(self) -> int:
        return self.block_k // self.tn

    @property
    def threads(self) -> int:
        return self.ry * self.cx

    @property
    def d_pad(self) -> int:
        """D: max(d, d_v) rounded up to a multiple of CX, so that every thread owns TD = D / CX columns of O.
        Q_i^T, K_j^T and V_j are all staged D wide, zero past their own head dim: with d_v != d the narrower
        operand's zero columns cost products, never a read from HBM."""
        return -(-max(self.head_dim, self.d_v) // self.cx) * self.cx

    @property
    def td(self) -> int:
        return self.d_pad // self.cx

    @property
    def pairs_rows(self) -> bool:
        """Whether `owner` interleaves row groups: CX a power of two with 2 CX <= 32 and RY even."""
        cx = self.cx
        return cx & (cx - 1) == 0 and 2 * cx <= 32 and self.ry % 2 == 0

    def owner(self, tid: int) -> tuple[int, int]:
        """(ty, tx) of the block's thread tid (threadIdx.y CX + threadIdx.x, as the hardware numbers lanes).

        Where `pairs_rows`, groups of 2 CX consecutive threads hold two row groups, the lowest bit of tid
        choosing between them: ty = 2 (tid // 2 CX) + tid % 2, tx = (tid % 2 CX) // 2. Then lanes n and n ^ 1
        share tx (their V and K^T fragments) and lanes n and n ^ 2 share ty (their P^T and Q^T fragments),
        so every 128-bit fragment load is a paired load (banks' rule: 2 wavefronts, not 4), and a quarter
        warp's P^T stores spread over 8 bank groups. Otherwise ty = tid // CX, tx = tid % CX."""
        if self.pairs_rows:
            group, within = divmod(tid, 2 * self.cx)
            return 2 * group + within % 2, within // 2
        return divmod(tid, self.cx)

    @property
    def vw(self) -> int:
        """Columns of O a thread owns side by side (a vector of V): the largest of 4, 2, 1 dividing TD."""
        return next(w for w in (4, 2, 1) if self.td % w == 0)

    def column(self, tx: int, e: int) -> int:
        """The head-dim column of a thread's e-th O column: chunks of VW adjacent columns, the CX threads' chunks
        side by side, so that a warp's V fragment loads are consecutive 16-byte vectors (no bank conflict):
        column = (e // VW) CX VW + tx VW + e % VW, a bijection of (tx < CX, e < TD) onto 0..D-1."""
        return (e // self.vw) * self.cx * self.vw + tx * self.vw + e % self.vw

    def _store_p_wavefronts(self, stride: int) -> int:
        """Wavefronts (banks' rule) of `store_p`'s stores for the first warp, with P^T rows `stride` floats
        apart: lane t = (ty, tx) (`owner`) writes TM adjacent words at (tx TN + c) stride + ty TM, one store per c."""
        from fa_numba import banks

        width = 4 * next(w for w in (4, 2, 1) if self.tm % w == 0)
        lanes = [self.owner(t) for t in range(min(banks.WARP, self.threads))]
        total = 0
        for c in range(self.tn):
            for a in range(0, self.tm, width // 4):
                addresses = [4 * ((tx * self.tn + c) * stride + ty * self.tm + a) for ty, tx in lanes]
                total += banks.wavefronts(addresses, width, "store")
        return total

    @functools.cached_property
    def p_stride(self) -> int:
        """Floats between rows of P^T: B_r, or B_r padded (by multiples of the store's vector, so that the
        vector stores stay aligned) to the stride whose `store_p` costs the fewest wavefronts, if the padded
        layout still fits the budget without aliasing more. At the shipped tiles the tx stride TN B_r is a
        multiple of 32 banks; with `owner`'s lanes B_r + 4 makes the d = 64 stores conflict-free."""
        step = next(w for w in (4, 2, 1) if self.tm % w == 0)
        candidates = [self.block_q + step * i for i in range(32 // step)]
        best = min(candidates, key=self._store_p_wavefronts)  # min keeps the first (the least padding) of ties
        padded, plain = self._offsets(best), self._offsets(self.block_q)
        if padded["_total"] * FLOAT_BYTES > self.budget or padded["_aliased"] > plain["_aliased"]:
            return self.block_q  # no room, or only by aliasing (one more barrier per tile): unpadded
        return best

    def _sizes(self, p_stride: int | None = None) -> dict[str, int]:
        d, br, bc = self.d_pad, self.block_q, self.block_k
        stride = self.p_stride if p_stride is None else p_stride
        sizes = {"q": d * br, "k": d * bc, "v": bc * d, "p": bc * stride, "red": br * self.cx}
        if self.order == "v1":
            sizes["stat"] = 2 * br  # m_i and l_i of the visit, read from HBM once per row
        return sizes

    @functools.cached_property
    def offsets(self) -> dict[str, int]:
        """Float offset of each region in the flat shared array, "_total" floats in all and "_aliased" (0/1):
        every region on its own if that fits the budget, else P^T, red (and stat) inside the dead operand."""
        return self._offsets(self.p_stride)

    def _offsets(self, p_stride: int) -> dict[str, int]:
        sizes = self._sizes(p_stride)
        offsets, end = {}, 0
        for name, size in sizes.items():
            offsets[name] = end
            end += size
        if end * FLOAT_BYTES <= self.budget:
            return {**offsets, "_total": end, "_aliased": 0}
        dead = "k" if self.order == "v2" else "q"  # the operand of S this order reloads before it is needed again
        offsets, end = {}, 0
        for name in ("q", "k", "v"):
            offsets[name] = end
            end += sizes[name]
        inside, room = offsets[dead], sizes[dead]
        for name in [n for n in sizes if n not in ("q", "k", "v")]:  # fill the dead operand first, then append
            if sizes[name] <= room:
                offsets[name], inside, room = inside, inside + sizes[name], room - sizes[name]
            else:
                offsets[name], end = end, end + sizes[name]
        return {**offsets, "_total": end, "_aliased": 1}

    @property
    def aliased(self) -> bool:
        return bool(self.offsets["_aliased"])

    @property
    def shared_bytes(self) -> int:
        return self.offsets["_total"] * FLOAT_BYTES

    def check(self) -> "Layout":
        for name in ("block_q", "block_k", "head_dim", "tm", "tn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.value_dim, bool) or not isinstance(self.value_dim, int) or self.value_dim < 0:
            raise ValueError(f"value_dim must be an int >= 0 (0: head_dim), got {self.value_dim!r}")
        if self.block_q % self.tm or self.block_k % self.tn:
            raise ValueError(f"block_q = {self.block_q} must be a multiple of tm = {self.tm} and block_k = "
                             f"{self.block_k} of tn = {self.tn}")
        if self.threads > 1024:
            raise ValueError(f"block_q x block_k / (tm x tn) = {self.threads} threads per block, over 1024: "
                             f"use smaller tiles (block_q = {self.block_q}, block_k = {self.block_k})")
        if self.shared_bytes > self.budget:
            raise ValueError(
                f"block_q = {self.block_q}, block_k = {self.block_k} with d = {self.head_dim} need {self.shared_bytes} "
                f"bytes of shared memory for Q^T, K^T, V, P^T and the row partials, over the {self.budget}-byte "
                f"static limit even with P^T aliased: use smaller tiles (e.g. kernels.default_tiles({self.head_dim}))")
        return self


# The shipped configurations by head dim: (B_r, B_c, TM, TN), each within 48 KB of static shared memory.
# 256 threads per block (v1 runs one block per (batch, head): it needs many warps per block to fill an SM)
# except at d > 128, where Q^T alone is 16 B_r KB. v2 takes the same tiles with wider micro-tiles where
# V2_MICRO says: 128 threads, each reading fewer shared-memory operands per FFMA.
DEFAULTS = ((32, (64, 64, 4, 4)), (64, (64, 32, 4, 2)), (128, (64, 16, 4, 1)), (256, (16, 16, 2, 1)))

# v2's (TM, TN) at the DEFAULTS row of this head-dim bound (2026-12-04, the whole-kernel model, float32,
# B=4 H=16 N=4096 on the H200's constants): d <= 64 4 x 4 (156 registers, 3 blocks of 4 warps an SM) 38.9
# TFLOP/s against 4 x 2's 34.6; d <= 128 4 x 2 (168 registers, 3 blocks) 38.0 against 4 x 1's 28.4. Both were
# shared-memory bound (4 x 1 reads a Q^T value per FFMA of S) and are now issue bound. v1 keeps 256 threads.
V2_MICRO = {64: (4, 4), 128: (4, 2)}


def default_config(head_dim: int, order: str = "v1") -> tuple[int, int, int, int]:
    """(B_r, B_c, TM, TN) of the first DEFAULTS row whose head dim bound holds d (v2: its V2_MICRO there)."""
    for bound, config in DEFAULTS:
        if head_dim <= bound:
            micro = V2_MICRO.get(bound) if order == "v2" else None
            return config if micro is None else (*config[:2], *micro)
    raise ValueError(f"head dim d must be <= {DEFAULTS[-1][0]}, got {head_dim}")


def micro_for(block_q: int, block_k: int, head_dim: int, order: str = "v1") -> tuple[int, int]:
    """(TM, TN): the shipped micro-tile of `order` for the default tiles of d, otherwise the largest of 4, 2, 1
    that divides each tile side."""
    if head_dim <= DEFAULTS[-1][0]:
        br, bc, tm, tn = default_config(head_dim, order)
        if (br, bc) == (block_q, block_k):
            return tm, tn
    return (next(t for t in MICRO_CHOICES if block_q % t == 0), next(t for t in MICRO_CHOICES if block_k % t == 0))
