"""Contracts of the tile grid and schedules (fa_numba.tiling) that no other test states: the last visible
tile without causal masking, the validators' return values, and the value semantics of Grid, Schedule
and BlockMask (kernels and caches key on them)."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fa_numba import masks, tiling
from fa_numba.tiling import SKIP


@given(sizes=st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(1, 12), st.integers(1, 12)),
       causal=st.booleans())
def test_last_visible_tile_is_the_last_non_skip_tile_with_or_without_causal(sizes, causal):
    """The inner loop of v2 runs j = 0 .. last_visible_tile(i): without causal masking that is every key
    tile, T_c - 1, for every query tile."""
    grid = tiling.Grid(*sizes)
    kinds = tiling.classify(*sizes, causal=causal)
    for i in range(grid.t_r):
        visible = np.flatnonzero(kinds[i] != SKIP)
        assert grid.last_visible_tile(i, causal) == (visible.max() if visible.size else -1)
    if not causal:
        assert {grid.last_visible_tile(i, False) for i in range(grid.t_r)} == {grid.t_c - 1}


def test_validators_return_what_they_accept():
    assert tiling.check_order("v1") == "v1" and tiling.check_order("v2") == "v2"
    assert tiling.check_backward_order("kv", np.bool_(True)) == ("kv", True)
    assert tiling.check_backward_order("q", False) == ("q", False)


def test_grid_and_schedule_are_immutable_values():
    """Equal sizes give equal, equally hashed grids (a kernel cache key); neither a grid nor a schedule can
    be changed once made."""
    grid = tiling.Grid(9, 7, 4, 2)
    assert grid == tiling.Grid(9, 7, 4, 2) and hash(grid) == hash(tiling.Grid(9, 7, 4, 2))
    assert grid != tiling.Grid(9, 7, 2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        grid.block_q = 8
    sched = tiling.schedule("v2", 9, 7, 4, 2, causal=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sched.visits = ()


def test_a_block_mask_is_compared_and_hashed_by_identity_and_cannot_be_changed():
    """BlockMask holds arrays: it is its own identity (two block masks of the same mask are different
    objects, each usable as a dict key), and its fields cannot be reassigned."""
    a = tiling.block_mask(9, 9, 2, 2, masks.sliding_window(3, 0))
    b = tiling.block_mask(9, 9, 2, 2, masks.sliding_window(3, 0))
    assert a == a and a != b and {a: 1, b: 2}[a] == 1
    assert hash(a) == hash(a) and hash(a) != hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.kinds = b.kinds
