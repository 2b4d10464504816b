"""Block concatenation of Q K^T, the causal tile classification, and the two schedules."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bounds import U64, gamma
from fa_numba import reference, tiled, tiling
from fa_numba.tiling import FULL, PARTIAL, SKIP
from strategies import Case, cases, with_hard_cases


def _tile_products(q, k, grid):
    """{(i, j): Q_i K_j^T} for every tile."""
    return {
        (i, j): q[slice(*grid.rows(i))] @ k[slice(*grid.cols(j))].T
        for i in range(grid.t_r)
        for j in range(grid.t_c)
    }


@pytest.mark.lemma("L1")
@given(case=cases(multihead=False), integer=st.booleans())
@with_hard_cases(integer=True)
def test_tiles_concatenate_to_the_full_product(case: Case, integer: bool):
    q, k, _ = (x[0, 0] for x in case.inputs())
    if integer:
        # Small integers: every product and partial sum is exact, so any summation order (BLAS picks
        # one per shape) gives the same bits and the equality of L1 can be asserted exactly.
        q, k = np.round(4 * q), np.round(4 * k)
    grid = tiling.Grid(case.n_q, case.n_k, case.block_q, case.block_k)
    full = q @ k.T
    tiles = _tile_products(q, k, grid)
    both = np.block([[tiles[i, j] for j in range(grid.t_c)] for i in range(grid.t_r)])
    # Only rows split: each row block against all of K, stacked along the query axis.
    rows = np.concatenate([q[slice(*grid.rows(i))] @ k.T for i in range(grid.t_r)], axis=0)
    # Only columns split: all of Q against each key block, joined along the key axis.
    cols = np.concatenate([q @ k[slice(*grid.cols(j))].T for j in range(grid.t_c)], axis=1)
    # Otherwise each entry is a dot product of d terms, off by at most gamma_d sum_x |q_x k_x| in any summation
    # order (with or without FMA), whichever order BLAS picks for each shape: two evaluations, twice that.
    tol = 0 if integer else 2 * gamma(case.d) * (np.abs(q) @ np.abs(k).T)
    for tiled_product in (both, rows, cols):
        assert tiled_product.shape == full.shape
        assert (np.abs(tiled_product - full) <= tol).all()


@pytest.mark.lemma("L1")
def test_concatenating_along_the_wrong_axis_does_not_give_the_product():
    q, k, _ = (x[0, 0] for x in Case(n_q=4, n_k=4, d=4, block_q=2, block_k=2, causal=False).inputs())
    full = q @ k.T
    row_blocks = [q[:2] @ k.T, q[2:] @ k.T]  # split along queries ...
    wrong = np.concatenate(row_blocks, axis=1)  # ... but joined along keys
    assert wrong.shape != full.shape
    square = np.concatenate([q[:2] @ k[:2].T, q[2:] @ k[2:].T], axis=1)  # (2, 4): shapes can even fit
    assert not np.array_equal(np.concatenate([square, square]), full)


@pytest.mark.lemma("L1")
def test_splitting_the_head_dim_needs_a_sum():
    q, k, _ = (x[0, 0] for x in Case(n_q=3, n_k=5, d=6, block_q=1, block_k=1, causal=False).inputs())
    parts = [q[:, :3] @ k[:, :3].T, q[:, 3:] @ k[:, 3:].T]
    # Two sums of 3 products and one addition (gamma_4) against one sum of 6 (gamma_6), entry by entry.
    assert (np.abs(parts[0] + parts[1] - q @ k.T) <= (gamma(4) + gamma(6)) * (np.abs(q) @ np.abs(k).T)).all()
    # one part alone (the first 3 of 6 products) is no rounding of the whole: beyond both sums' gamma_6 bounds
    wrong = np.concatenate(parts, axis=0)[:3]
    assert (np.abs(wrong - q @ k.T) > 2 * gamma(6) * (np.abs(q) @ np.abs(k).T)).any()


@st.composite
def grids(draw):
    return (draw(st.integers(1, 40)), draw(st.integers(1, 40)), draw(st.integers(1, 12)), draw(st.integers(1, 12)))


@pytest.mark.lemma("L3")
@given(sizes=grids())
def test_classification_is_sound_and_complete(sizes):
    n_q, n_k, block_q, block_k = sizes
    kinds = tiling.classify(n_q, n_k, block_q, block_k, causal=True)
    grid = tiling.Grid(n_q, n_k, block_q, block_k)
    mask = reference.causal_mask(n_q, n_k)  # the explicit definition
    assert kinds.shape == (grid.t_r, grid.t_c)
    assert set(np.unique(kinds)) <= {SKIP, FULL, PARTIAL}  # the three kinds partition the grid
    for i in range(grid.t_r):
        for j in range(grid.t_c):
            tile = mask[slice(*grid.rows(i)), slice(*grid.cols(j))]
            expected = SKIP if not tile.any() else FULL if tile.all() else PARTIAL
            assert kinds[i, j] == expected, (i, j, tile)


@pytest.mark.lemma("L3")
@given(sizes=grids())
def test_last_visible_tile_closed_form(sizes):
    grid = tiling.Grid(*sizes)
    kinds = tiling.classify(*sizes, causal=True)
    for i in range(grid.t_r):
        visible = np.flatnonzero(kinds[i] != SKIP)
        assert grid.last_visible_tile(i, causal=True) == (visible.max() if visible.size else -1)
        # Visible tiles form a prefix: skipping is a truncation of the inner loop.
        assert (visible == np.arange(visible.size)).all()


def test_non_causal_tiles_are_all_full():
    assert (tiling.classify(7, 5, 2, 3, causal=False) == FULL).all()


def test_square_causal_grid_is_lower_triangular():
    kinds = tiling.classify(8, 8, 2, 2, causal=True)
    assert (np.diag(kinds) == PARTIAL).all()
    assert (kinds[np.tril_indices(4, -1)] == FULL).all()
    assert (kinds[np.triu_indices(4, 1)] == SKIP).all()


def test_more_queries_than_keys_skips_whole_query_tiles():
    # delta = 4 - 12 = -8: queries 0..7 see no key, so query tiles 0 and 1 (rows 0..7) are all SKIP.
    kinds = tiling.classify(12, 4, 4, 4, causal=True)
    assert (kinds[:2] == SKIP).all()
    assert kinds[2, 0] == PARTIAL


@pytest.mark.lemma("L4")
@given(sizes=grids(), causal=st.booleans())
def test_v1_and_v2_visit_the_same_tiles_in_their_loop_order(sizes, causal):
    v1 = tiling.schedule("v1", *sizes, causal)
    v2 = tiling.schedule("v2", *sizes, causal)
    assert sorted(v1.visits) == sorted(v2.visits)
    assert [(j, i) for i, j, _ in v1.visits] == sorted((j, i) for i, j, _ in v1.visits)  # j outer
    assert [(i, j) for i, j, _ in v2.visits] == sorted((i, j) for i, j, _ in v2.visits)  # i outer
    grid = v1.grid
    assert v1.computed + v1.skipped == grid.t_r * grid.t_c
    assert v1.skipped == int((v1.kinds == SKIP).sum()) and SKIP not in {kind for *_, kind in v1.visits}
    assert v1.masked == int((v1.kinds == PARTIAL).sum())
    everything = tiling.schedule("v2", *sizes, causal, skip=False)
    assert everything.computed == grid.t_r * grid.t_c and everything.skipped == 0


@pytest.mark.lemma("L3")
@given(case=cases(max_n=16))
@with_hard_cases
def test_skipping_skip_tiles_is_exact(case: Case):
    case = dataclasses.replace(case, causal=True)
    q, k, v = case.inputs()
    tiles = dict(block_q=case.block_q, block_k=case.block_k, causal=True)
    skipped, lse_s, led_s = tiled.attention(q, k, v, order="v2", **tiles)
    computed, lse_c, led_c = tiled.attention(q, k, v, order="v2", skip=False, **tiles)
    # v2: a fully masked tile contributes exp(-inf) = 0 and leaves the max alone: bitwise the same state.
    np.testing.assert_array_equal(skipped, computed)
    np.testing.assert_array_equal(lse_s, lse_c)
    # v1 stores O normalised between visits, so an extra visit re-rounds O (acc = O l, then acc / l): the SKIP
    # tiles come after a row's last visible one (L3) and fold in exactly nothing (alpha = 1, p = 0), so each
    # of the at most T_c - 1 extra visits multiplies the finished O by (1 + d1)(1 + d2): relative to O itself.
    skipped_1, lse_1, _ = tiled.attention(q, k, v, order="v1", **tiles)
    computed_1, lse_c1, _ = tiled.attention(q, k, v, order="v1", skip=False, **tiles)
    t_c = -(-case.n_k // case.block_k)
    assert (np.abs(computed_1 - skipped_1) <= gamma(2 * (t_c - 1), U64) * np.abs(skipped_1)).all()
    np.testing.assert_array_equal(lse_1, lse_c1)
    n_skip = int((tiling.classify(case.n_q, case.n_k, case.block_q, case.block_k, True) == SKIP).sum())
    assert (led_s.reads["K"] < led_c.reads["K"]) == (n_skip > 0)
