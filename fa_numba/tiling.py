"""The tile grid, causal tile classification and the v1 / v2 schedules (proofs/L3_causal_tiles.md).

Query tile i covers rows [r0, r1) = [i B_r, min((i+1) B_r, N_q)); key tile j covers columns
[c0, c1) = [j B_c, min((j+1) B_c, N_k)). With delta = N_k - N_q (bottom-right causal alignment):

    SKIP     c0 > r1 - 1 + delta        every key of the tile is in the future of every query: never touched
    FULL     c1 - 1 <= r0 + delta       every key is visible to every query: no mask needed
    PARTIAL  otherwise                  the mask j <= i + delta is applied inside the tile

Without `causal` every tile is FULL. Ragged tails (N not a multiple of the block) are a matter of bounds
guards, not of masking, and do not change a tile's kind.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from fa_numba import shapes


class Kind(enum.IntEnum):
    SKIP = 0
    FULL = 1
    PARTIAL = 2


SKIP, FULL, PARTIAL = Kind.SKIP, Kind.FULL, Kind.PARTIAL
ORDERS = ("v1", "v2")
# The backward's loop orders (proofs/L7): "kv" walks the tiles as v1 does (key tile j outer, FlashAttention-2's
# backward), "q" as v2 does (query tile i outer).
BACKWARD_ORDERS = ("kv", "q")
BACKWARD_VISIT_ORDER = {"kv": "v1", "q": "v2"}


@dataclass(frozen=True)
class Grid:
    """T_r x T_c tiles of B_r query rows by B_c key columns."""

    n_q: int
    n_k: int
    block_q: int
    block_k: int

    def __post_init__(self):
        for name in ("n_q", "n_k", "block_q", "block_k"):
            shapes.check_block(name, getattr(self, name))

    @property
    def t_r(self) -> int:
        return -(-self.n_q // self.block_q)

    @property
    def t_c(self) -> int:
        return -(-self.n_k // self.block_k)

    @property
    def delta(self) -> int:
        return self.n_k - self.n_q

    def rows(self, i: int) -> tuple[int, int]:
        """[r0, r1) of query tile i."""
        return i * self.block_q, min((i + 1) * self.block_q, self.n_q)

    def cols(self, j: int) -> tuple[int, int]:
        """[c0, c1) of key tile j."""
        return j * self.block_k, min((j + 1) * self.block_k, self.n_k)

    def kind(self, i: int, j: int, causal: bool) -> Kind:
        if not causal:
            return FULL
        r0, r1 = self.rows(i)
        c0, c1 = self.cols(j)
        if c0 > r1 - 1 + self.delta:
            return SKIP
        if c1 - 1 <= r0 + self.delta:
            return FULL
        return PARTIAL

    def last_visible_tile(self, i: int, causal: bool) -> int:
        """The largest j with tile (i, j) not SKIP, or -1 if the whole query tile sees no key.

        Closed form of the causal rule: floor((r1 - 1 + delta) / B_c), clipped to [-1, T_c - 1].
        """
        if not causal:
            return self.t_c - 1
        _, r1 = self.rows(i)
        last_key = r1 - 1 + self.delta
        if last_key < 0:
            return -1
        return min(self.t_c - 1, last_key // self.block_k)


def classify(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool) -> np.ndarray:
    """(T_r, T_c) int8 array of `Kind` values."""
    grid = Grid(n_q, n_k, block_q, block_k)
    causal = shapes.check_causal(causal)
    kinds = np.empty((grid.t_r, grid.t_c), dtype=np.int8)
    for i in range(grid.t_r):
        for j in range(grid.t_c):
            kinds[i, j] = grid.kind(i, j, causal)
    return kinds


@dataclass(frozen=True)
class Schedule:
    """The ordered tile visits of one loop order, SKIP tiles left out (unless skip=False)."""

    order: str
    grid: Grid
    visits: tuple[tuple[int, int, Kind], ...]
    kinds: np.ndarray  # (T_r, T_c) classification

    @property
    def computed(self) -> int:
        """Tiles whose scores are computed (visited)."""
        return len(self.visits)

    @property
    def skipped(self) -> int:
        """SKIP tiles not visited."""
        return int((self.kinds == SKIP).sum()) - sum(1 for *_, kind in self.visits if kind == SKIP)

    @property
    def masked(self) -> int:
        """Visited tiles that need the mask inside the tile (PARTIAL)."""
        return sum(1 for *_, kind in self.visits if kind == PARTIAL)


def check_order(order) -> str:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return order


def check_backward_order(order, deterministic) -> tuple[str, bool]:
    """Validate the backward's order and deterministic flag: deterministic=True exists for "kv" only
    (its dQ pass replaces the atomic adds into dQ; "q" would need atomic adds into dK, dV instead)."""
    if order not in BACKWARD_ORDERS:
        raise ValueError(f"order must be one of {BACKWARD_ORDERS} for the backward, got {order!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if deterministic and order != "kv":
        raise ValueError(f"deterministic=True is only available with order='kv' (its separate dQ pass); "
                         f"order={order!r} accumulates dK, dV with atomic adds")
    return order, bool(deterministic)


def schedule(order: str, n_q: int, n_k: int, block_q: int, block_k: int, causal: bool, skip: bool = True) -> Schedule:
    """Visits of v1 (j outer, i inner) or v2 (i outer, j inner).

    With skip=False the SKIP tiles are visited too (computed with a full -inf mask): only for tests and
    comparisons that show skipping changes nothing but the work done.
    """
    check_order(order)
    kinds = classify(n_q, n_k, block_q, block_k, causal)
    t_r, t_c = kinds.shape
    if order == "v1":
        pairs = ((i, j) for j in range(t_c) for i in range(t_r))
    else:
        pairs = ((i, j) for i in range(t_r) for j in range(t_c))
    visits = tuple((i, j, Kind(kinds[i, j])) for i, j in pairs if not (skip and kinds[i, j] == SKIP))
    return Schedule(order, Grid(n_q, n_k, block_q, block_k), visits, kinds)
