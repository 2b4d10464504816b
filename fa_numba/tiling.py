"""The tile grid, tile classification, block masks and the v1 / v2 schedules (proofs/L3_causal_tiles.md,
proofs/L8_block_masks.md).

Query tile i covers rows [r0, r1) = [i B_r, min((i+1) B_r, N_q)); key tile j covers columns
[c0, c1) = [j B_c, min((j+1) B_c, N_k)). With delta = N_k - N_q (bottom-right causal alignment):

    SKIP     c0 > r1 - 1 + delta        every key of the tile is in the future of every query: never touched
    FULL     c1 - 1 <= r0 + delta       every key is visible to every query: no mask needed
    PARTIAL  otherwise                  the mask j <= i + delta is applied inside the tile

Without `causal` every tile is FULL. Ragged tails (N not a multiple of the block) are a matter of bounds
guards, not of masking, and do not change a tile's kind.

Any other mask (`fa_numba.masks`: sliding window, documents, prefix-LM, a function, a dense array) is passed
as `mask=`; `causal=True` is the short form of `mask=masks.causal()` and gives the same kinds. A mask
classifies each tile itself (`mask.classify_tile`: SKIP iff no pair of the tile is visible, FULL iff every
pair is, PARTIAL otherwise; proofs/L8). This module reads masks through that method only and does not
import `masks` (which imports this module for `Kind`).

`block_mask` turns the kinds into what a kernel reads (FlexAttention's block mask): per query tile the
increasing list of its non-SKIP key tiles with their kinds, and the transposed lists per key tile, as
int32 / int8 CSR arrays; `BlockMask.row_lists(kind)` / `col_lists(kind)` split them into the FULL lists
and the PARTIAL lists.
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

    def kind(self, i: int, j: int, causal: bool = False, mask=None) -> Kind:
        """Kind of tile (i, j): the causal closed form (`causal_kind`), the mask's own classification, or FULL."""
        causal, mask = shapes.check_mask(causal, mask)
        r0, r1 = self.rows(i)
        c0, c1 = self.cols(j)
        if mask is not None:
            return Kind(mask.classify_tile(r0, r1, c0, c1, self.n_q, self.n_k))
        return causal_kind(r0, r1, c0, c1, self.delta) if causal else FULL

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


def causal_kind(r0: int, r1: int, c0: int, c1: int, delta: int) -> Kind:
    """The causal closed form (proofs/L3.1) for rows [r0, r1), columns [c0, c1), delta = N_k - N_q."""
    if c0 > r1 - 1 + delta:
        return SKIP
    if c1 - 1 <= r0 + delta:
        return FULL
    return PARTIAL


def classify(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = False, mask=None) -> np.ndarray:
    """(T_r, T_c) int8 array of `Kind` values: causal (closed form), any `fa_numba.masks` mask, or none (all FULL).

    A mask's sizes are checked once (e.g. documents need N_q = N_k = sum of the lengths); then every tile
    is classified by `mask.classify_tile` (O(1) per tile for the built-ins, one predicate evaluation per
    tile for from_function / from_dense).
    """
    grid = Grid(n_q, n_k, block_q, block_k)
    causal, mask = shapes.check_mask(causal, mask)
    if mask is not None:
        mask.check(n_q, n_k)
    kinds = np.empty((grid.t_r, grid.t_c), dtype=np.int8)
    for i in range(grid.t_r):
        r0, r1 = grid.rows(i)
        for j in range(grid.t_c):
            c0, c1 = grid.cols(j)
            if mask is not None:
                kinds[i, j] = mask.classify_tile(r0, r1, c0, c1, n_q, n_k)
            else:
                kinds[i, j] = causal_kind(r0, r1, c0, c1, grid.delta) if causal else FULL
    return kinds


@dataclass(frozen=True, eq=False)
class BlockMask:
    """The kernels' input: the tile kinds of one (N_q, N_k, B_r, B_c, mask) and their sparse lists.

    kinds      (T_r, T_c) int8 of `Kind`
    row_ptr    (T_r + 1,) int32: the key tiles of query tile i are col_idx[row_ptr[i]:row_ptr[i+1]],
               increasing j, SKIP tiles left out (v2's inner loop, and the backward's per-query-tile loop)
    col_idx    (nnz,) int32
    col_kind   (nnz,) int8: FULL or PARTIAL, the kind of tile (i, col_idx[p])
    col_ptr    (T_c + 1,) int32: the query tiles of key tile j are row_idx[col_ptr[j]:col_ptr[j+1]],
               increasing i, SKIP tiles left out (v1's inner loop, and the backward's per-key-tile loop)
    row_idx    (nnz,) int32
    row_kind   (nnz,) int8: the kind of tile (row_idx[p], j)

    nnz is the number of non-SKIP tiles. The arrays are read-only and C-contiguous. Compared and hashed
    by identity (they hold arrays); cache them by (sizes, mask): masks are hashable.
    """

    n_q: int
    n_k: int
    block_q: int
    block_k: int
    kinds: np.ndarray
    row_ptr: np.ndarray
    col_idx: np.ndarray
    col_kind: np.ndarray
    col_ptr: np.ndarray
    row_idx: np.ndarray
    row_kind: np.ndarray

    @property
    def grid(self) -> Grid:
        return Grid(self.n_q, self.n_k, self.block_q, self.block_k)

    @property
    def nnz(self) -> int:
        """Non-SKIP tiles: the tiles a kernel visits."""
        return int(self.col_idx.size)

    def count(self, kind: Kind) -> int:
        """Tiles of one kind."""
        return int((self.kinds == kind).sum())

    def row_lists(self, kind: Kind) -> tuple[np.ndarray, np.ndarray]:
        """(ptr, idx): the key tiles of query tile i that are `kind` (FULL or PARTIAL) are idx[ptr[i]:ptr[i+1]].

        FlexAttention's full_kv_num_blocks / full_kv_indices (kind=FULL) and kv_num_blocks / kv_indices
        (kind=PARTIAL), as CSR: ptr (T_r + 1,) int32, idx int32, increasing j within a query tile.
        """
        ptr, idx, _ = csr(_only(self.kinds, kind))
        return ptr, idx

    def col_lists(self, kind: Kind) -> tuple[np.ndarray, np.ndarray]:
        """(ptr, idx): the query tiles of key tile j that are `kind` are idx[ptr[j]:ptr[j+1]], increasing i."""
        ptr, idx, _ = csr(_only(self.kinds, kind).T)
        return ptr, idx


def _only(kinds: np.ndarray, kind) -> np.ndarray:
    """The kinds array with every tile that is not `kind` (FULL or PARTIAL) set to SKIP."""
    kind = Kind(kind)
    if kind == SKIP:
        raise ValueError("kind must be FULL or PARTIAL, got SKIP: SKIP tiles are not listed")
    return np.where(kinds == kind, kinds, np.int8(SKIP))


INT32_MAX = 2**31 - 1  # the largest CSR offset or tile index the kernels read (int32 arrays)


def _frozen(array, dtype=np.int32) -> np.ndarray:
    out = np.ascontiguousarray(array, dtype=dtype)
    out.setflags(write=False)
    return out


def csr(kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-major CSR of the non-SKIP entries of a kinds array: (ptr, column indices, kinds)."""
    rows, cols = np.nonzero(kinds != SKIP)  # row-major: increasing column within each row
    if rows.size > INT32_MAX:  # the kernels read the offsets as int32: a wrapped offset would read any tile
        raise ValueError(f"the block mask lists {rows.size} tiles, over the {INT32_MAX} int32 offsets the kernels "
                         f"read: use larger block_q, block_k")
    ptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=kinds.shape[0]))])
    return _frozen(ptr), _frozen(cols), _frozen(kinds[rows, cols], np.int8)


def block_mask(n_q: int, n_k: int, block_q: int, block_k: int, mask=None, *, causal: bool = False) -> BlockMask:
    """The `BlockMask` of a mask (or of causal=True, or of no mask: every tile FULL) on the B_r x B_c grid.

    The kinds are `classify`'s, built from the mask's row intervals with whole-array operations
    (`tile_counts.kinds`, tested equal to `classify`): one `classify_tile` call per tile would take
    minutes at N = 10^5 (4.9e6 tiles of 64 x 32). A mask without row intervals is classified tile by tile."""
    from fa_numba import tile_counts  # imported here: tile_counts builds on this module

    kinds = tile_counts.kinds(n_q, n_k, block_q, block_k, causal, mask=mask)
    if kinds is None:
        kinds = classify(n_q, n_k, block_q, block_k, causal, mask=mask)
    kinds = _frozen(kinds, np.int8)
    row_ptr, col_idx, col_kind = csr(kinds)
    col_ptr, row_idx, row_kind = csr(kinds.T)
    return BlockMask(int(n_q), int(n_k), int(block_q), int(block_k), kinds,
                     row_ptr, col_idx, col_kind, col_ptr, row_idx, row_kind)


@dataclass(frozen=True)
class Schedule:
    """The ordered tile visits of one loop order, SKIP tiles left out (unless skip=False)."""

    order: str
    grid: Grid
    visits: tuple[tuple[int, int, Kind], ...]
    kinds: np.ndarray  # (T_r, T_c) classification
    mask: object = None  # the fa_numba.masks mask the kinds come from (None: causal=True or no mask)

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


def schedule(order: str, n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = False, skip: bool = True,
             mask=None) -> Schedule:
    """Visits of v1 (j outer, i inner) or v2 (i outer, j inner), for causal=True, a mask, or neither.

    With skip=False the SKIP tiles are visited too (computed with a full -inf mask): only for tests and
    comparisons that show skipping changes nothing but the work done.
    """
    check_order(order)
    kinds = classify(n_q, n_k, block_q, block_k, causal, mask=mask)
    t_r, t_c = kinds.shape
    if order == "v1":
        pairs = ((i, j) for j in range(t_c) for i in range(t_r))
    else:
        pairs = ((i, j) for i in range(t_r) for j in range(t_c))
    visits = tuple((i, j, Kind(kinds[i, j])) for i, j in pairs if not (skip and kinds[i, j] == SKIP))
    return Schedule(order, Grid(n_q, n_k, block_q, block_k), visits, kinds, mask)
