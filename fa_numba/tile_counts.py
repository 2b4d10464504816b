"""How many tiles of each kind a mask leaves, per query tile and per key tile, without a Python object per
tile: what `compare` and `iomodel` report for any N (proofs/L3_causal_tiles.md, proofs/L8_block_masks.md).

`tiling.classify` / `tiling.schedule` / `tiling.block_mask` are the readable definition: one
`classify_tile` per tile, T_r T_c of them, which at N = 10^6 with 64 x 32 tiles is 4.9e8 Python calls.
This module computes the same counts from the mask's row intervals in O(N_q log N_q) NumPy work:

    row r sees exactly the keys [lo_r, hi_r)        (mask.row_intervals; causal: [0, r + delta + 1) clipped;
                                                     no mask: [0, N_k))
    tile (i, j) is not SKIP  iff some row r of query tile i has lo_r < hi_r and touches key tile j, i.e.
                                 a_r <= j <= b_r with a_r = floor(lo_r / B_c), b_r = floor((hi_r - 1) / B_c)
    tile (i, j) is FULL      iff every row of query tile i sees all of [c0_j, c1_j): L_i <= c0_j and
                                 c1_j <= H_i with L_i = max_r lo_r, H_i = min_r hi_r over the tile's rows

So the non-SKIP key tiles of query tile i are the union of its rows' ranges [a_r, b_r] (merged with one
sort and a running maximum; no monotonicity of the mask is assumed), and its FULL key tiles are the
contiguous j with ceil(L_i / B_c) <= j and (j + 1) B_c <= H_i (j = T_c - 1 needs H_i = N_k): a count in
closed form. These are the definitions of SKIP and FULL (L8.1) read off the intervals, so they hold for
every mask that has row intervals; tests/test_analytic_scale.py checks them equal to `tiling.classify` on
many small cases. A mask without row intervals (from_function, from_dense) is classified tile by tile by
`tiling.classify`, and refused beyond MAX_CLASSIFIED_TILES tiles (minutes of host work).

`kinds` builds the whole (T_r, T_c) kinds array the same way (steps summed along each row), for
`tiling.block_mask`, the kernels' input. `count` caches its answers for masks that are their text (the
built-ins); a predicate may read state that changes, so it is counted afresh on every call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from fa_numba import shapes, tiling
from fa_numba.tiling import FULL, PARTIAL, SKIP, Grid

# Beyond this many tiles, a mask without row intervals (one predicate evaluation per tile, ~20 us each) would
# keep the host busy for minutes: refuse, and say what would work.
MAX_CLASSIFIED_TILES = 2**24


@dataclass(frozen=True, eq=False)
class TileCounts:
    """Per query tile and per key tile, how many tiles are visited (not SKIP), and how many are FULL.

    per_row       (T_r,) int64: n_i, the non-SKIP key tiles of query tile i (the length of its list)
    per_col       (T_c,) int64: m_j, the non-SKIP query tiles of key tile j
    full_per_row  (T_r,) int64: the FULL key tiles of query tile i
    Read-only arrays. `computed`, `skipped`, `masked` are those of `tiling.schedule(...)` (either order,
    skip=True): visits, SKIP tiles, PARTIAL visits."""

    grid: Grid
    per_row: np.ndarray
    per_col: np.ndarray
    full_per_row: np.ndarray

    @property
    def computed(self) -> int:
        return int(self.per_row.sum())

    @property
    def skipped(self) -> int:
        return self.grid.t_r * self.grid.t_c - self.computed

    @property
    def full(self) -> int:
        return int(self.full_per_row.sum())

    @property
    def masked(self) -> int:
        return self.computed - self.full


def count(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = False, mask=None) -> TileCounts:
    """The TileCounts of `tiling.classify(n_q, n_k, block_q, block_k, causal, mask=mask)`, from the row
    intervals (module docstring), or tile by tile for a mask without them. Arguments are validated as
    tiling validates them."""
    grid = Grid(n_q, n_k, block_q, block_k)
    causal, mask = shapes.check_mask(causal, mask)
    if mask is not None:
        mask.check(n_q, n_k)
    spec = getattr(mask, "spec", None)
    if mask is None or (callable(spec) and spec() is not None):
        return _cached(grid, causal, mask)
    # from_function / from_dense / duck-typed masks: never served from the cache, since a predicate may read
    # state that changed since the last call (kernels.block_lists.kernel_mask refuses them for the same reason)
    return _count(grid, causal, mask)


@functools.lru_cache(maxsize=16)
def _cached(grid: Grid, causal: bool, mask) -> TileCounts:
    # compare asks for the same counts once per variant and again through iomodel: compute them once. Only
    # masks that are their text (a spec: the built-ins) key it, so a cached answer is never stale.
    return _count(grid, causal, mask)


def kinds(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = False, mask=None) -> np.ndarray | None:
    """`tiling.classify`'s (T_r, T_c) int8 kinds built from the row intervals with whole-array operations
    (`tiling.block_mask` uses it: a kernel launch at N = 10^5 needs 4.9e6 tiles classified), or None for
    a mask without row intervals (classify it tile by tile)."""
    grid = Grid(n_q, n_k, block_q, block_k)
    causal, mask = shapes.check_mask(causal, mask)
    if mask is not None:
        mask.check(n_q, n_k)
    intervals = _row_intervals(grid, causal, mask)
    if intervals is None:
        return None
    (group, start, end), (first_full, last_full) = _ranges(grid, *intervals)
    # +1 over each visited range and +1 more over each FULL range, as steps summed along the row: 0 is SKIP,
    # 1 PARTIAL, 2 FULL (every FULL tile is visited)
    steps = np.zeros((grid.t_r, grid.t_c + 1), dtype=np.int8)
    np.add.at(steps, (group, start), 1)
    np.add.at(steps, (group, end + 1), -1)
    has_full = np.flatnonzero(last_full >= first_full)
    np.add.at(steps, (has_full, first_full[has_full]), 1)
    np.add.at(steps, (has_full, last_full[has_full] + 1), -1)
    level = np.cumsum(steps[:, :-1], axis=1, dtype=np.int8)
    return np.array([SKIP, PARTIAL, FULL], dtype=np.int8)[level]


def _count(grid: Grid, causal: bool, mask) -> TileCounts:
    intervals = _row_intervals(grid, causal, mask)
    if intervals is None:
        return _from_kinds(grid, causal, mask)
    return _from_intervals(grid, *intervals)


def _row_intervals(grid: Grid, causal: bool, mask):
    """(lo, hi) int64 (N_q,): row r sees [lo_r, hi_r); None for a mask that has no intervals."""
    n_q, n_k = grid.n_q, grid.n_k
    if mask is not None:
        intervals = mask.row_intervals(n_q, n_k)
        return None if intervals is None else tuple(np.asarray(x, dtype=np.int64) for x in intervals)
    lo = np.zeros(n_q, np.int64)
    if not causal:
        return lo, np.full(n_q, n_k, np.int64)
    # j <= r + delta (DESIGN.md's bottom-right causal), clipped to [0, N_k) as masks clips its intervals
    return lo, np.clip(np.arange(n_q, dtype=np.int64) + grid.delta + 1, 0, n_k)


def _frozen(array) -> np.ndarray:
    out = np.ascontiguousarray(array, dtype=np.int64)
    out.setflags(write=False)
    return out


def _from_kinds(grid: Grid, causal: bool, mask) -> TileCounts:
    """Counts of the per-tile classification: the only way for a mask known by its predicate alone."""
    tiles = grid.t_r * grid.t_c
    if tiles > MAX_CLASSIFIED_TILES:
        raise ValueError(
            f"mask {mask!r} has no row intervals, so its tiles are classified one by one on the host: "
            f"T_r x T_c = {grid.t_r} x {grid.t_c} = {tiles:,} tiles at N_q={grid.n_q}, N_k={grid.n_k}, "
            f"tiles {grid.block_q}x{grid.block_k} is beyond {MAX_CLASSIFIED_TILES:,} (minutes of work); use a "
            f"built-in mask (window, prefix, documents: counted from their intervals), larger tiles or smaller N")
    kinds = tiling.classify(grid.n_q, grid.n_k, grid.block_q, grid.block_k, causal, mask=mask)
    visited = kinds != SKIP
    return TileCounts(grid, _frozen(visited.sum(axis=1)), _frozen(visited.sum(axis=0)),
                      _frozen((kinds == FULL).sum(axis=1)))


def _from_intervals(grid: Grid, lo: np.ndarray, hi: np.ndarray) -> TileCounts:
    (group, start, end), (first_full, last_full) = _ranges(grid, lo, hi)
    t_r, t_c = grid.t_r, grid.t_c
    full = np.maximum(last_full - first_full + 1, 0)
    per_row = np.bincount(group, weights=end - start + 1, minlength=t_r)  # float64: exact below 2**53
    per_col = np.cumsum(np.bincount(start, minlength=t_c + 1) - np.bincount(end + 1, minlength=t_c + 1))[:t_c]
    return TileCounts(grid, _frozen(np.rint(per_row)), _frozen(per_col), _frozen(full))


def _ranges(grid: Grid, lo: np.ndarray, hi: np.ndarray):
    """The visited key tiles as disjoint ranges ((query tile, first, last) arrays) and, per query tile, its
    FULL key tiles first_full .. last_full (empty when last_full < first_full)."""
    n_k, b_r, b_c, t_c = grid.n_k, grid.block_q, grid.block_k, grid.t_c
    tile_of_row = np.arange(grid.n_q, dtype=np.int64) // b_r
    first_rows = np.arange(0, grid.n_q, b_r)
    # FULL: the keys every row of the tile sees are [L_i, H_i) (empty rows make it empty: lo = hi there)
    lowest, highest = np.maximum.reduceat(lo, first_rows), np.minimum.reduceat(hi, first_rows)
    first_full = -(-lowest // b_c)  # the first tile with c0 = j B_c >= L_i
    last_full = np.where(highest >= n_k, t_c - 1, highest // b_c - 1)  # the last with c1 <= H_i
    # not SKIP: the union over the tile's rows that see a key of the key tiles [a_r, b_r] they touch
    sees = lo < hi
    visited = _merge_ranges(tile_of_row[sees], lo[sees] // b_c, (hi[sees] - 1) // b_c, t_c)
    return visited, (first_full, last_full)


def _merge_ranges(group: np.ndarray, a: np.ndarray, b: np.ndarray, t_c: int):
    """The union, per group, of the integer ranges [a_k, b_k] (0 <= a_k <= b_k < t_c) as disjoint ranges:
    (group, start, end) arrays, one entry per merged range, increasing (group, start)."""
    span = t_c + 1  # shifting group g by g * span keeps its ranges apart from (and after) those of group g - 1
    lo, hi = a + group * span, b + group * span
    if lo.size and np.any(np.diff(lo) < 0):  # rows come in tile order; within a tile a generic mask may go back
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi) if hi.size else hi  # the furthest tile covered by the ranges so far
    begins = np.ones(lo.size, dtype=bool)
    begins[1:] = lo[1:] > reach[:-1]  # starts past everything covered so far: a new merged range
    first = np.flatnonzero(begins)
    last = np.append(first[1:] - 1, lo.size - 1) if first.size else first
    starts, ends = lo[first], reach[last]
    groups = starts // span
    return groups, starts - groups * span, ends - groups * span
