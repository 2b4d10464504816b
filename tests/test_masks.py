"""Masks beyond causal (fa_numba.masks), their tile classification and block masks, and the reference with a
mask (proofs/L8_block_masks.md).

Every mask is checked against `definition`: explicit loops over (i, j) that read the mask's parameters and
restate the predicate in this file's own words, independent of the code in fa_numba.masks.
"""

import warnings

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from scipy.special import logsumexp, softmax

from bounds import assert_within, attention_bound, dense_counts, tiled_counts
from fa_numba import iomodel, masks, online_softmax as osm, reference, tiled, tiling, tolerance, tolerance_backward
from fa_numba.tiling import FULL, PARTIAL, SKIP
from strategies import (HARD_MASK_CASES, Case, MaskCase, Stripes, cases, mask_cases, with_hard_cases,
                        with_hard_mask_cases)

BUILT_INS = (masks.Causal, masks.SlidingWindow, masks.PrefixLM, masks.Documents)


def _visible(mask, i: int, j: int, n_q: int, n_k: int) -> bool:
    """visible(i, j) restated from the definitions (README of the issue, masks' docstring), one pair."""
    delta = n_k - n_q
    if isinstance(mask, masks.Causal):
        return j <= i + delta
    if isinstance(mask, masks.SlidingWindow):
        return (mask.left is None or j >= i + delta - mask.left) and (mask.right is None or j <= i + delta + mask.right)
    if isinstance(mask, masks.PrefixLM):
        return j < mask.prefix or j <= i + delta
    if isinstance(mask, masks.Documents):
        owner = [t for t, length in enumerate(mask.lengths) for _ in range(length)]  # document of each position
        return owner[i] == owner[j] and (not mask.causal or j <= i)
    if isinstance(mask, masks.FromFunction):
        return bool(np.asarray(mask.fn(np.array([i]), np.array([j])))[0])
    if isinstance(mask, masks.FromDense):
        return bool(mask.array[i, j])
    raise AssertionError(f"unknown mask {mask!r}")


def definition(mask, n_q: int, n_k: int) -> np.ndarray:
    """The (N_q, N_k) bool mask by brute force over every pair."""
    return np.array([[_visible(mask, i, j, n_q, n_k) for j in range(n_k)] for i in range(n_q)], dtype=bool).reshape(n_q, n_k)


def _brute_kinds(visible: np.ndarray, grid: tiling.Grid) -> np.ndarray:
    kinds = np.empty((grid.t_r, grid.t_c), dtype=np.int8)
    for i in range(grid.t_r):
        for j in range(grid.t_c):
            tile = visible[slice(*grid.rows(i)), slice(*grid.cols(j))]
            kinds[i, j] = SKIP if not tile.any() else FULL if tile.all() else PARTIAL
    return kinds


def _as_function(visible: np.ndarray):
    """from_function of a dense definition: fn(i, j) = visible[i, j] on broadcast integer arrays."""
    return masks.from_function(lambda i, j: visible[i, j])


TILE_CASES = mask_cases(max_n=40, max_block=12, multihead=False)


# --- the predicate, the classification, the intervals ------------------------------------------------


@pytest.mark.lemma("L8")
@given(mc=TILE_CASES)
@with_hard_mask_cases
def test_dense_is_the_definition(mc: MaskCase):
    expected = definition(mc.mask, mc.n_q, mc.n_k)
    dense = mc.mask.dense(mc.n_q, mc.n_k)
    assert dense.dtype == np.bool_ and dense.shape == (mc.n_q, mc.n_k)
    np.testing.assert_array_equal(dense, expected)
    np.testing.assert_array_equal(reference.visible_mask(mc.n_q, mc.n_k, mask=mc.mask), expected)
    np.testing.assert_array_equal(masks.from_dense(expected).dense(mc.n_q, mc.n_k), expected)
    np.testing.assert_array_equal(_as_function(expected).dense(mc.n_q, mc.n_k), expected)


@pytest.mark.lemma("L8")
@given(mc=TILE_CASES)
@with_hard_mask_cases
def test_classify_tile_is_sound_and_complete(mc: MaskCase):
    """SKIP iff no pair of the tile is visible, FULL iff all are, PARTIAL otherwise (L8.1, L8.4)."""
    grid = tiling.Grid(*mc.tiles)
    expected = _brute_kinds(definition(mc.mask, mc.n_q, mc.n_k), grid)
    kinds = tiling.classify(*mc.tiles, mask=mc.mask)
    assert kinds.dtype == np.int8 and kinds.shape == (grid.t_r, grid.t_c)
    np.testing.assert_array_equal(kinds, expected)
    for i in range(grid.t_r):
        for j in range(grid.t_c):
            assert grid.kind(i, j, mask=mc.mask) == expected[i, j]
            assert mc.mask.classify_tile(*grid.rows(i), *grid.cols(j), mc.n_q, mc.n_k) == expected[i, j]


@pytest.mark.lemma("L8")
@given(mc=TILE_CASES)
@with_hard_mask_cases
def test_builtins_agree_with_from_dense_and_from_function(mc: MaskCase):
    expected = definition(mc.mask, mc.n_q, mc.n_k)
    kinds = tiling.classify(*mc.tiles, mask=mc.mask)
    np.testing.assert_array_equal(tiling.classify(*mc.tiles, mask=masks.from_dense(expected)), kinds)
    np.testing.assert_array_equal(tiling.classify(*mc.tiles, mask=_as_function(expected)), kinds)


@pytest.mark.lemma("L8")
@given(mc=TILE_CASES)
@with_hard_mask_cases
def test_row_intervals_equal_the_dense_rows(mc: MaskCase):
    intervals = mc.mask.row_intervals(mc.n_q, mc.n_k)
    if not isinstance(mc.mask, BUILT_INS):
        assert intervals is None and mc.mask.kernel_form() == "dense"
        return
    lo, hi = intervals
    assert lo.dtype == hi.dtype == np.int32 and lo.shape == hi.shape == (mc.n_q,)
    assert ((0 <= lo) & (lo <= hi) & (hi <= mc.n_k)).all()
    expected = definition(mc.mask, mc.n_q, mc.n_k)
    j = np.arange(mc.n_k)
    np.testing.assert_array_equal((lo[:, None] <= j) & (j < hi[:, None]), expected)
    np.testing.assert_array_equal(lo == hi, ~expected.any(axis=1))  # lo_i = hi_i iff row i sees no key


@pytest.mark.lemma("L8")
@given(mc=TILE_CASES)
@with_hard_mask_cases
def test_the_kernel_form_reproduces_the_mask_inside_partial_tiles(mc: MaskCase):
    """What a kernel reads inside a PARTIAL tile (the causal closed form, 2 int32 per row, or the tile's
    bytes of the dense uint8 mask) gives exactly the tile's visible pairs (L8.7)."""
    expected = definition(mc.mask, mc.n_q, mc.n_k)
    form, arrays = mc.mask.kernel_form(), mc.mask.kernel_arrays(mc.n_q, mc.n_k)
    assert form in masks.KERNEL_FORMS
    assert all(a.flags.c_contiguous for a in arrays)
    grid = tiling.Grid(*mc.tiles)
    kinds = tiling.classify(*mc.tiles, mask=mc.mask)
    for i, j in zip(*np.nonzero(kinds == PARTIAL)):
        (r0, r1), (c0, c1) = grid.rows(i), grid.cols(j)
        rows, cols = np.arange(r0, r1)[:, None], np.arange(c0, c1)[None, :]
        if form == "causal":
            assert arrays == ()
            tile = cols <= rows + grid.delta
        elif form == "intervals":
            lo, hi = arrays
            assert lo.dtype == hi.dtype == np.int32 and lo.shape == hi.shape == (mc.n_q,)
            tile = (lo[r0:r1, None] <= cols) & (cols < hi[r0:r1, None])
        else:
            (dense,) = arrays
            assert dense.dtype == np.uint8 and dense.shape == (mc.n_q, mc.n_k)
            tile = dense[r0:r1, c0:c1] != 0
        np.testing.assert_array_equal(tile, expected[r0:r1, c0:c1])


def test_kernel_forms_of_each_mask():
    assert masks.causal().kernel_form() == "causal"
    for mask in (masks.sliding_window(4, 0), masks.prefix_lm(3), masks.documents([2, 3]), masks.documents([5], True)):
        assert mask.kernel_form() == "intervals"
        lo, hi = mask.kernel_arrays(5, 5)
        expected_lo, expected_hi = mask.row_intervals(5, 5)
        np.testing.assert_array_equal(lo, expected_lo)
        np.testing.assert_array_equal(hi, expected_hi)
    for mask in (masks.from_function(lambda i, j: i == j), masks.from_dense(np.eye(5, dtype=bool))):
        assert mask.kernel_form() == "dense"
        (dense,) = mask.kernel_arrays(5, 5)
        assert dense.dtype == np.uint8
        np.testing.assert_array_equal(dense, np.eye(5, dtype=np.uint8))


def test_from_function_is_evaluated_once_per_tile():
    calls = []

    def fn(i, j):
        calls.append((i.ravel().tolist(), j.ravel().tolist()))
        return j <= i

    kinds = tiling.classify(7, 5, 3, 2, mask=masks.from_function(fn))
    assert len(calls) == kinds.size == 3 * 3
    assert calls[0] == ([0, 1, 2], [0, 1])  # the first tile's rows and keys, as integer arrays
    assert calls[-1] == ([6], [4])  # the ragged corner tile


# --- block masks ------------------------------------------------------------------------------------


def _ordered(ptr, idx, kind_of, n_lists, kinds_rows, name):
    """One CSR list set against the kinds (rows of `kinds_rows` are the lists)."""
    assert ptr.dtype == idx.dtype == np.int32 and kind_of.dtype == np.int8
    assert ptr.shape == (n_lists + 1,) and ptr[0] == 0 and (np.diff(ptr) >= 0).all(), name
    for a in range(n_lists):
        listed = idx[ptr[a]:ptr[a + 1]]
        np.testing.assert_array_equal(listed, np.flatnonzero(kinds_rows[a] != SKIP), err_msg=name)  # increasing
        np.testing.assert_array_equal(kind_of[ptr[a]:ptr[a + 1]], kinds_rows[a][listed], err_msg=name)


@pytest.mark.lemma("L8")
@given(mc=TILE_CASES)
@with_hard_mask_cases
def test_block_mask_lists_are_consistent_with_the_kinds(mc: MaskCase):
    bm = tiling.block_mask(*mc.tiles, mc.mask)
    kinds = tiling.classify(*mc.tiles, mask=mc.mask)
    t_r, t_c = kinds.shape
    np.testing.assert_array_equal(bm.kinds, kinds)
    assert bm.kinds.dtype == np.int8 and (bm.n_q, bm.n_k, bm.block_q, bm.block_k) == mc.tiles
    nnz = int((kinds != SKIP).sum())
    assert bm.nnz == nnz == bm.row_ptr[-1] == bm.col_ptr[-1] == bm.col_idx.size == bm.row_idx.size
    _ordered(bm.row_ptr, bm.col_idx, bm.col_kind, t_r, kinds, "by query tile")
    _ordered(bm.col_ptr, bm.row_idx, bm.row_kind, t_c, kinds.T, "by key tile")
    assert set(bm.col_kind.tolist()) <= {FULL, PARTIAL} and set(bm.row_kind.tolist()) <= {FULL, PARTIAL}
    for array in (bm.kinds, bm.row_ptr, bm.col_idx, bm.col_kind, bm.col_ptr, bm.row_idx, bm.row_kind):
        assert array.flags.c_contiguous and not array.flags.writeable
    # The FULL and PARTIAL lists (FlexAttention's full_kv / kv lists and their transposes) split the lists.
    for kind in (FULL, PARTIAL):
        only = np.where(kinds == kind, kinds, SKIP)
        ptr, idx = bm.row_lists(kind)
        _ordered(ptr, idx, np.full(idx.size, kind, np.int8), t_r, only, f"{kind.name} by query tile")
        ptr, idx = bm.col_lists(kind)
        _ordered(ptr, idx, np.full(idx.size, kind, np.int8), t_c, only.T, f"{kind.name} by key tile")
    assert bm.count(FULL) + bm.count(PARTIAL) == nnz and bm.count(SKIP) == kinds.size - nnz
    # The schedules visit exactly the listed tiles, in their loop order.
    v2 = tiling.schedule("v2", *mc.tiles, mask=mc.mask)
    v1 = tiling.schedule("v1", *mc.tiles, mask=mc.mask)
    listed = [(i, int(bm.col_idx[p]), bm.col_kind[p]) for i in range(t_r) for p in range(bm.row_ptr[i], bm.row_ptr[i + 1])]
    assert [(i, j, int(k)) for i, j, k in v2.visits] == [(i, j, int(k)) for i, j, k in listed]
    transposed = [(int(bm.row_idx[p]), j, bm.row_kind[p]) for j in range(t_c) for p in range(bm.col_ptr[j], bm.col_ptr[j + 1])]
    assert [(i, j, int(k)) for i, j, k in v1.visits] == [(i, j, int(k)) for i, j, k in transposed]
    assert v1.masked == bm.count(PARTIAL) and v1.skipped == bm.count(SKIP) and v1.mask == mc.mask


def test_block_mask_of_a_small_window():
    # N = 8, window(2, 0), 2 x 2 tiles: a band of PARTIAL diagonal tiles with PARTIAL tiles below them.
    bm = tiling.block_mask(8, 8, 2, 2, masks.sliding_window(2, 0))
    assert bm.kinds.tolist() == [[2, 0, 0, 0], [2, 2, 0, 0], [0, 2, 2, 0], [0, 0, 2, 2]]
    assert bm.row_ptr.tolist() == [0, 1, 3, 5, 7] and bm.col_idx.tolist() == [0, 0, 1, 1, 2, 2, 3]
    assert bm.col_ptr.tolist() == [0, 2, 4, 6, 7] and bm.row_idx.tolist() == [0, 1, 1, 2, 2, 3, 3]
    assert bm.row_lists(FULL)[0].tolist() == [0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="kind must be FULL or PARTIAL"):
        bm.row_lists(SKIP)
    # No mask: every tile FULL; causal=True is the same as mask=causal().
    assert (tiling.block_mask(5, 7, 2, 3).kinds == FULL).all()
    np.testing.assert_array_equal(tiling.block_mask(9, 6, 2, 4, causal=True).col_idx,
                                  tiling.block_mask(9, 6, 2, 4, masks.causal()).col_idx)


# --- exactness: the block-mask loop, skipping, and the reference --------------------------------------


def _run_lists(q, k, v, bm, visible, order):
    """The kernels' loops over a block mask (one head, float64): FULL tiles without a mask, PARTIAL tiles
    with theirs, SKIP tiles never touched; v2 walks the per-query-tile lists, v1 the per-key-tile lists.
    alive (the rows that see a key) comes from the mask."""
    grid = bm.grid
    scale = 1 / np.sqrt(q.shape[1])
    states = {i: osm.identity(len(range(*grid.rows(i))), q.shape[1]) for i in range(grid.t_r)}
    if order == "v2":
        visits = [(i, int(bm.col_idx[p]), bm.col_kind[p]) for i in range(grid.t_r) for p in range(bm.row_ptr[i], bm.row_ptr[i + 1])]
    else:
        visits = [(int(bm.row_idx[p]), j, bm.row_kind[p]) for j in range(grid.t_c) for p in range(bm.col_ptr[j], bm.col_ptr[j + 1])]
    for i, j, kind in visits:
        (r0, r1), (c0, c1) = grid.rows(i), grid.cols(j)
        s = scale * (q[r0:r1] @ k[c0:c1].T)
        states[i] = osm.update(states[i], s, v[c0:c1], None if kind == FULL else visible[r0:r1, c0:c1])
    outs = [osm.finalize(states[i], visible[slice(*grid.rows(i))].any(axis=1)) for i in range(grid.t_r)]
    return np.concatenate([o for o, _ in outs]), np.concatenate([l for _, l in outs])


def _run_every_tile(q, k, v, block_q, block_k, visible):
    """Every tile folded with its mask, SKIP tiles included (what skipping leaves out)."""
    grid = tiling.Grid(q.shape[0], k.shape[0], block_q, block_k)
    scale = 1 / np.sqrt(q.shape[1])
    outs = []
    for i in range(grid.t_r):
        r0, r1 = grid.rows(i)
        state = osm.identity(r1 - r0, q.shape[1])
        for j in range(grid.t_c):
            c0, c1 = grid.cols(j)
            state = osm.update(state, scale * (q[r0:r1] @ k[c0:c1].T), v[c0:c1], visible[r0:r1, c0:c1])
        outs.append(osm.finalize(state, visible[r0:r1].any(axis=1)))
    return np.concatenate([o for o, _ in outs]), np.concatenate([l for _, l in outs])


@pytest.mark.lemma("L8")
@given(mc=mask_cases(max_n=24, max_block=7, multihead=False))
@with_hard_mask_cases
def test_skipping_is_exact_for_any_mask(mc: MaskCase):
    """Leaving SKIP tiles out and FULL tiles unmasked changes nothing (L8.5): bitwise against folding every
    tile with its mask; v1's and v2's lists give the same bits; both equal the reference."""
    q, k, v = (x[0, 0] for x in mc.case.inputs())
    visible = definition(mc.mask, mc.n_q, mc.n_k)
    bm = tiling.block_mask(*mc.tiles, mc.mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out2, lse2 = _run_lists(q, k, v, bm, visible, "v2")
        out1, lse1 = _run_lists(q, k, v, bm, visible, "v1")
        every_out, every_lse = _run_every_tile(q, k, v, mc.case.block_q, mc.case.block_k, visible)
        ref_out, ref_lse = reference.attention(q, k, v, mask=mc.mask)
    for out, lse in ((out1, lse1), (every_out, every_lse)):
        np.testing.assert_array_equal(out2, out)  # same visible keys folded in the same j order per row
        np.testing.assert_array_equal(lse2, lse)
    empty = ~visible.any(axis=1)
    assert (out2[empty] == 0).all() and np.isneginf(lse2[empty]).all()
    assert np.isfinite(out2).all() and np.isfinite(lse2[~empty]).all()
    # Two float64 evaluations in other orders (the lists' online fold over T_c tiles at most, the dense
    # reference): each within its derived bound (tests/bounds.py) of the exact value, scores' rounding included.
    # A fixed rtol is no bound: at logits 1e4 each exp carries ~1e4 u of its argument's rounding (issue 60).
    inputs = mc.case.inputs()
    bound_out, bound_lse = (a + b for a, b in zip(
        attention_bound(*inputs, causal=False, counts=tiled_counts(mc.n_k, mc.case.block_k), mask=mc.mask),
        attention_bound(*inputs, causal=False, counts=dense_counts(mc.n_k), mask=mc.mask)))
    assert_within(out2, ref_out, bound_out[0, 0], name="out")
    assert_within(lse2, ref_lse, bound_lse[0, 0], name="lse")


def explicit_attention(q, k, v, visible, scale=None):
    """Per (b, h, row) loops over an explicit (N_q, N_k) visible matrix with scipy's softmax and logsumexp:
    the dense definition, independent of `reference` (rows with no visible key: O = 0, LSE = -inf)."""
    b_, h_, n_q, d = q.shape
    group = h_ // k.shape[1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    out = np.zeros((b_, h_, n_q, d))
    lse = np.full((b_, h_, n_q), -np.inf)
    for b in range(b_):
        for h in range(h_):
            kk, vv = k[b, h // group], v[b, h // group]
            for i in range(n_q):
                keys = [j for j in range(k.shape[2]) if visible[i, j]]
                if not keys:
                    continue
                s = scale * (kk[keys] @ q[b, h, i])
                lse[b, h, i] = logsumexp(s)
                out[b, h, i] = softmax(s) @ vv[keys]
    return out, lse


@pytest.mark.lemma("L8")
@given(mc=mask_cases(max_n=10, max_d=5))
@with_hard_mask_cases
def test_reference_with_a_mask_matches_explicit_masked_scores(mc: MaskCase):
    q, k, v = mc.case.inputs()
    visible = definition(mc.mask, mc.n_q, mc.n_k)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rows with no visible key must not warn
        out, lse = reference.attention(q, k, v, mask=mc.mask)
        out32, lse32 = reference.attention_naive_f32(q, k, v, mask=mc.mask)
    exp_out, exp_lse = explicit_attention(q, k, v, visible)
    assert np.isfinite(out).all() and np.isfinite(out32).all()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(exp_lse))
    np.testing.assert_array_equal(np.isneginf(lse32), np.isneginf(exp_lse))
    # Both dense float64 evaluations (reference's, scipy's): each within its derived bound of the exact value.
    bound_out, bound_lse = (2 * b for b in attention_bound(q, k, v, causal=False, counts=dense_counts(mc.n_k),
                                                            mask=mc.mask))
    assert_within(out, exp_out, bound_out, name="out")
    assert_within(lse, exp_lse, bound_lse, name="lse")
    empty = ~visible.any(axis=1)
    assert (out[..., empty, :] == 0).all() and (out32[..., empty, :] == 0).all()
    # The float32 baseline passes its own rule with the mask passed through.
    check = tolerance.check_attention(out32, lse32, q, k, v, mask=mc.mask, contractions=("matmul",))
    assert check.err_out <= check.atol_out


@pytest.mark.lemma("L8")
def test_rows_without_visible_keys_under_a_mask_give_zero_and_minus_inf():
    # window(1, 0) with N_q = 6 > N_k = 3 (delta = -3): rows 0..2 see nothing, row 3 sees key 0 only.
    q, k, v = Case(n_q=6, n_k=3, d=2, block_q=2, block_k=2, causal=False, seed=5).inputs()
    q[0, 0, 1] = np.nan  # a dead row's query is never read: still 0 and -inf
    out, lse = reference.attention(q, k, v, mask=masks.sliding_window(1, 0))
    assert (out[0, 0, :3] == 0).all() and np.isneginf(lse[0, 0, :3]).all()
    # Exact: one visible key, so P = exp(0) / exp(0) = 1 and 0 on the masked keys, P V = 1 v + 0 + ... = v.
    np.testing.assert_array_equal(out[0, 0, 3], v[0, 0, 0])
    assert np.isfinite(lse[0, 0, 3:]).all()
    # A dense mask with an empty middle row.
    visible = np.ones((4, 4), dtype=bool)
    visible[2] = False
    out, lse = reference.attention(*Case(4, 4, 3, 1, 1, False).inputs(), mask=masks.from_dense(visible))
    assert (out[0, 0, 2] == 0).all() and np.isneginf(lse[0, 0, 2]) and np.isfinite(lse[0, 0, [0, 1, 3]]).all()


@pytest.mark.lemma("L8")
@given(mc=mask_cases(max_n=10, max_d=4, multihead=False), tensor=st.sampled_from(["k", "v"]), data=st.data())
@with_hard_mask_cases(tensor="k", data=None)
def test_a_nan_reaches_exactly_the_rows_that_see_it_under_a_mask(mc: MaskCase, tensor, data):
    """A NaN in key n (or in value n, column x) makes NaN exactly the rows whose mask shows them key n; every
    other entry is bit for bit that of the clean inputs (L8.5: masked keys never meet a row's arithmetic)."""
    n = data.draw(st.integers(0, mc.n_k - 1)) if data is not None else mc.n_k - 1
    x = data.draw(st.integers(0, mc.case.d - 1)) if data is not None else 0
    q, k, v = mc.case.inputs()
    clean_out, clean_lse = reference.attention(q, k, v, mask=mc.mask)
    (k if tensor == "k" else v)[0, 0, n, x] = np.nan
    out, lse = reference.attention(q, k, v, mask=mc.mask)
    sees = definition(mc.mask, mc.n_q, mc.n_k)[:, n]
    bad_out = np.zeros(out.shape, dtype=bool)
    if tensor == "k":
        bad_out[0, 0, sees, :] = True
        np.testing.assert_array_equal(np.isnan(lse[0, 0]), sees)
    else:
        bad_out[0, 0, sees, x] = True
        np.testing.assert_array_equal(lse, clean_lse)
    np.testing.assert_array_equal(np.isnan(out), bad_out)
    np.testing.assert_array_equal(out[~bad_out], clean_out[~bad_out])
    np.testing.assert_array_equal(lse[~np.isnan(lse)], clean_lse[~np.isnan(lse)])


# --- causal=True is mask=causal() ---------------------------------------------------------------------


@pytest.mark.lemma("L8")
@given(sizes=st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(1, 12), st.integers(1, 12)))
@example(sizes=(12, 5, 4, 2))
@example(sizes=(1, 1, 1, 1))
def test_causal_flag_equals_the_causal_mask_in_tiling(sizes):
    mask = masks.causal()
    np.testing.assert_array_equal(tiling.classify(*sizes, causal=True), tiling.classify(*sizes, mask=mask))
    for order in tiling.ORDERS:
        assert tiling.schedule(order, *sizes, True).visits == tiling.schedule(order, *sizes, mask=mask).visits
    grid = tiling.Grid(*sizes)
    assert all(grid.kind(i, j, True) == grid.kind(i, j, mask=mask) for i in range(grid.t_r) for j in range(grid.t_c))
    for bm_mask, bm_causal in zip(*(vars(tiling.block_mask(*sizes, **kw)).values()
                                    for kw in ({"mask": mask}, {"causal": True}))):
        np.testing.assert_array_equal(bm_mask, bm_causal)
    # The window and prefix built-ins with their causal parameters (constructed directly, not normalised).
    for same in (masks.SlidingWindow(None, 0), masks.PrefixLM(0)):
        np.testing.assert_array_equal(tiling.classify(*sizes, mask=same), tiling.classify(*sizes, causal=True))
        np.testing.assert_array_equal(same.row_intervals(*sizes[:2]), mask.row_intervals(*sizes[:2]))


@given(case=cases(max_n=10, max_d=5))
@with_hard_cases
def test_causal_flag_equals_the_causal_mask_in_the_reference_bitwise(case: Case):
    q, k, v = case.inputs()
    for fn in (reference.attention, reference.attention_naive_f32):
        by_flag = fn(q, k, v, causal=True)
        by_mask = fn(q, k, v, mask=masks.causal())
        for a, b in zip(by_flag, by_mask):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(reference.visible_mask(case.n_q, case.n_k, True),
                                  reference.visible_mask(case.n_q, case.n_k, mask=masks.causal()))


def test_degenerate_parameters_are_causal():
    assert masks.sliding_window(None, 0) == masks.causal() and masks.prefix_lm(0) == masks.causal()
    assert repr(masks.sliding_window(None, 0)) == "causal()"


def test_edge_masks_by_hand():
    # window(0, 0): the diagonal alone (bottom-right: with N_k > N_q it is shifted by delta).
    assert masks.sliding_window(0, 0).dense(3, 5).astype(int).tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 0],
                                                                             [0, 0, 0, 0, 1]]
    # A window wider than N is full attention: every tile FULL.
    assert (tiling.classify(7, 5, 2, 2, mask=masks.sliding_window(50, 50)) == FULL).all()
    # Documents of length 1: only the diagonal; documents-causal: lower triangles within each document.
    assert (masks.documents([1] * 4).dense(4, 4) == np.eye(4, dtype=bool)).all()
    assert masks.documents([2, 2], causal=True).dense(4, 4).astype(int).tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    # prefix_lm: keys before the prefix are visible to every query, also past the diagonal.
    assert masks.prefix_lm(2).dense(3, 3).astype(int).tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1]]


# --- names, hashing, parsing ------------------------------------------------------------------------------


def test_masks_are_hashable_values_with_readable_names():
    window = masks.sliding_window(128, 0)
    assert window == masks.sliding_window(128, 0) and hash(window) == hash(masks.sliding_window(128, 0))
    assert window != masks.sliding_window(0, 128)
    cache = {window: 1, masks.documents([3, 4]): 2, masks.from_dense(np.eye(3, dtype=bool)): 3}
    assert cache[masks.documents((3, 4))] == 2 and cache[masks.from_dense(np.eye(3, dtype=bool))] == 3
    assert masks.documents([3, 4]) != masks.documents([3, 4], causal=True)
    names = {
        masks.causal(): ("causal()", "causal"),
        window: ("sliding_window(128, 0)", "window(128, 0)"),
        masks.sliding_window(None, 3): ("sliding_window(None, 3)", "window(inf, 3)"),
        masks.prefix_lm(64): ("prefix_lm(64)", "prefix_lm(64)"),
        masks.documents([100, 300, 50]): ("documents([100, 300, 50])", "documents(100, 300, 50)"),
        masks.documents([2] * 8, causal=True): ("documents([2, 2, 2, 2, 2, 2, 2, 2], causal=True)",
                                                "documents-causal(2, 2, 2, 2, 2, 2, ... (8 documents, N = 16))"),
        masks.from_function(Stripes(1, 2, 0, 3, 1)): ("from_function(Stripes(a=1, b=2, c=0, m=3, t=1))",
                                                      "function(Stripes(a=1, b=2, c=0, m=3, t=1))"),
        masks.from_dense(np.eye(3, dtype=bool)): ("from_dense(<3x3 bool, 3 visible>)", "dense(3x3, 3 visible)"),
    }
    for mask, (rep, text) in names.items():
        assert (repr(mask), mask.describe()) == (rep, text)


@pytest.mark.parametrize("text, expected", [
    ("causal", masks.causal()),
    ("window:128,0", masks.sliding_window(128, 0)),
    ("window:inf,0", masks.causal()),
    ("window: 4 , inf", masks.sliding_window(4, None)),
    ("documents:100,300,50", masks.documents([100, 300, 50])),
    ("documents-causal:1,2", masks.documents([1, 2], causal=True)),
    ("prefix:64", masks.prefix_lm(64)),
    ("Prefix:0", masks.causal()),
])
def test_parse(text, expected):
    assert masks.parse(text) == expected


@pytest.mark.parametrize("mask", [masks.causal(), masks.sliding_window(3, None), masks.sliding_window(None, None),
                                  masks.prefix_lm(5), masks.documents([4, 1]), masks.documents([2], causal=True)])
def test_spec_round_trips_through_parse(mask):
    assert masks.parse(mask.spec()) == mask


@pytest.mark.parametrize("text, message", [
    ("", "expected one of"),
    ("sliding:4,0", "expected one of"),
    ("causal:3", "expected one of"),
    ("window:4", "window needs two values LEFT,RIGHT"),
    ("window:4,x", "RIGHT must be an int >= 0 or 'inf'"),
    ("window:-1,0", r"LEFT must be an int >= 0 or 'inf' \(unbounded\), got -1 \(write 'inf'"),
    ("prefix:", "P must be an int"),
    ("prefix:1,2", "prefix needs one value P"),
    ("prefix:-3", "prefix must be an int >= 0, got -3"),
    ("documents:3,0", r"lengths\[1\] must be an int >= 1 \(a document length\), got 0"),
    ("documents:3,,4", "each document length must be an int"),
])
def test_parse_rejects_with_what_it_expected(text, message):
    with pytest.raises(ValueError, match=message) as info:
        masks.parse(text)
    assert repr(text) in str(info.value)


# --- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, error, message", [
    (lambda: masks.sliding_window(-1, 0), ValueError, r"left must be an int >= 0 or None \(unbounded\), got -1"),
    (lambda: masks.sliding_window(0, 2.5), TypeError, "right must be an int >= 0 or None"),
    (lambda: masks.sliding_window(True, 0), TypeError, "left must be an int"),
    (lambda: masks.prefix_lm(None), TypeError, "prefix must be an int >= 0"),
    (lambda: masks.prefix_lm(-2), ValueError, "prefix must be an int >= 0, got -2"),
    (lambda: masks.documents([]), ValueError, "lengths must hold at least one document length"),
    (lambda: masks.documents(5), TypeError, "lengths must be a sequence of ints >= 1"),
    (lambda: masks.documents([3, 0]), ValueError, r"lengths\[1\] must be an int >= 1"),
    (lambda: masks.documents([3], causal="yes"), TypeError, "causal must be a bool"),
    (lambda: masks.from_function(3), TypeError, "fn must be a callable"),
    (lambda: masks.from_dense(np.ones((2, 2), dtype=np.int8)), TypeError, "array must be a bool array"),
    (lambda: masks.from_dense(np.ones(4, dtype=bool)), ValueError, r"array must be a 2-D \(N_q, N_k\) bool array"),
    (lambda: masks.from_dense(np.ones((0, 3), dtype=bool)), ValueError, "N_q, N_k >= 1"),
])
def test_bad_parameters_are_named(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_mask_that_does_not_fit_the_sizes_is_named():
    with pytest.raises(ValueError, match=r"documents\(2, 3\) is a self-attention mask: it needs n_q = n_k = "
                                         r"sum\(lengths\) = 5, got n_q=5, n_k=6"):
        tiling.classify(5, 6, 2, 2, mask=masks.documents([2, 3]))
    with pytest.raises(ValueError, match="n_q = n_k = sum"):
        reference.attention(*Case(4, 4, 2, 1, 1, False).inputs(), mask=masks.documents([2, 3]))
    with pytest.raises(ValueError, match="n_q = n_k = sum"):
        tiled.attention(*Case(4, 4, 2, 1, 1, False).inputs(), order="v1", block_q=2, block_k=2,
                        mask=masks.documents([2, 3]))
    with pytest.raises(ValueError, match=r"from_dense mask of shape 3x3 \(N_q x N_k\) does not fit n_q=3, n_k=4"):
        iomodel.traffic_backward("kv", 3, 4, 2, 2, 2, mask=masks.from_dense(np.eye(3, dtype=bool)))
    with pytest.raises(ValueError, match=r"from_dense mask of shape 3x3 \(N_q x N_k\) does not fit n_q=3, n_k=4"):
        masks.from_dense(np.eye(3, dtype=bool)).dense(3, 4)
    with pytest.raises(TypeError, match="fn.i, j. must return a bool array, got dtype int64"):
        masks.from_function(lambda i, j: i - j).dense(3, 3)
    with pytest.raises(ValueError, match=r"must return an array of the broadcast shape of i and j, \(3, 3\)"):
        masks.from_function(lambda i, j: np.ones(7, dtype=bool)).dense(3, 3)
    with pytest.raises(ValueError, match=r"0 <= r0 < r1 <= n_q and 0 <= c0 < c1 <= n_k, got rows \[2, 2\)"):
        masks.causal().classify_tile(2, 2, 0, 1, 4, 4)
    with pytest.raises(ValueError, match="n_q must be a positive int, got 0"):
        masks.sliding_window(1, 1).row_intervals(0, 4)


def test_causal_and_a_mask_together_is_an_error_naming_both():
    mask = masks.sliding_window(4, 0)
    q, k, v = Case(4, 4, 2, 1, 1, False).inputs()
    calls = [
        lambda: tiling.classify(4, 4, 2, 2, causal=True, mask=mask),
        lambda: tiling.schedule("v2", 4, 4, 2, 2, True, mask=mask),
        lambda: tiling.Grid(4, 4, 2, 2).kind(0, 0, True, mask=mask),
        lambda: tiling.block_mask(4, 4, 2, 2, mask, causal=True),
        lambda: reference.visible_mask(4, 4, True, mask),
        lambda: reference.attention(q, k, v, causal=True, mask=mask),
        lambda: reference.attention_naive_f32(q, k, v, causal=True, mask=mask),
        lambda: tolerance.check_attention(q, q[..., 0], q, k, v, causal=True, mask=mask),
        lambda: reference.attention_backward(q, k, v, q, causal=True, mask=mask),
        lambda: tolerance_backward.check_attention_backward(q, k, v, q, k, v, q, causal=True, mask=mask),
        lambda: tiled.attention(q, k, v, order="v2", block_q=2, block_k=2, causal=True, mask=mask),
        lambda: tiled.attention_backward(q, k, v, q, q[..., 0], q, order="kv", block_q=2, block_k=2, causal=True,
                                         mask=mask),
        lambda: iomodel.traffic("v1", 4, 4, 2, 2, 2, True, mask=mask),
        lambda: iomodel.traffic_backward("q", 4, 4, 2, 2, 2, True, mask=mask),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"pass causal=True or mask=\.\.\., not both \(got causal=True and "
                                             r"mask=sliding_window\(4, 0\)\)"):
            call()
    with pytest.raises(TypeError, match="mask must be a fa_numba.masks mask .* got ndarray without check, dense"):
        tiling.classify(4, 4, 2, 2, mask=np.eye(4, dtype=bool))
    with pytest.raises(TypeError, match="mask must be a fa_numba.masks mask"):
        reference.attention(q, k, v, mask="window:4,0")


def test_hard_mask_cases_cover_what_they_claim():
    """The pinned cases really hold the hard situations (so the @examples test what they say)."""
    seen = set()
    for mc in HARD_MASK_CASES:
        visible = definition(mc.mask, mc.n_q, mc.n_k)
        if not visible.any(axis=1).all():
            seen.add("row without keys")
        if mc.n_q != mc.n_k:
            seen.add("N_q != N_k")
        if isinstance(mc.mask, masks.Documents) and 1 in mc.mask.lengths:
            seen.add("document of length 1")
        if isinstance(mc.mask, masks.SlidingWindow) and (mc.mask.left, mc.mask.right) == (0, 0):
            seen.add("empty window")
        if isinstance(mc.mask, masks.SlidingWindow) and min(x if x is not None else 10**9 for x in
                                                             (mc.mask.left, mc.mask.right)) >= max(mc.n_q, mc.n_k):
            seen.add("window wider than N")
    assert seen == {"row without keys", "N_q != N_k", "document of length 1", "empty window", "window wider than N"}
