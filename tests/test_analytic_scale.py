"""The analytic counts at any N (fa_numba/tile_counts.py, iomodel.visits, compare's analytic rows) equal the
per-tile definition: `tiling.classify` / `tiling.schedule` / `tiling.block_mask`, one tile at a time.

Not marked with lemmas: test_proofs requires every marked test to be listed by its proofs/ file, and L3, L5
and L8 do not list these yet."""

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fa_numba import compare as cmp
from fa_numba import iomodel, masks, tile_counts, tiling
from fa_numba.tiling import FULL, PARTIAL, SKIP
from strategies import Case, MaskCase, cases, mask_cases, with_hard_cases, with_hard_mask_cases

INTERVAL_KINDS = ("causal", "window", "prefix", "documents", "documents-causal")


def _per_tile(n_q, n_k, block_q, block_k, causal=False, mask=None):
    """(n_i, m_j, FULL per query tile, computed, skipped, masked) read off the per-tile classification and
    the v1 and v2 schedules (which must agree on the counts)."""
    kinds = tiling.classify(n_q, n_k, block_q, block_k, causal, mask=mask)
    counts = {(s.computed, s.skipped, s.masked)
              for s in (tiling.schedule(order, n_q, n_k, block_q, block_k, causal, mask=mask) for order in tiling.ORDERS)}
    assert len(counts) == 1, counts
    return ((kinds != SKIP).sum(axis=1), (kinds != SKIP).sum(axis=0), (kinds == FULL).sum(axis=1), *counts.pop())


def _assert_counts_match(n_q, n_k, block_q, block_k, causal=False, mask=None):
    """tile_counts' counts, and its kinds (what tiling.block_mask uses), equal the per-tile classification."""
    kinds = tile_counts.kinds(n_q, n_k, block_q, block_k, causal, mask=mask)
    if mask is not None and mask.row_intervals(n_q, n_k) is None:
        assert kinds is None  # from_function / from_dense: classified tile by tile
    else:
        np.testing.assert_array_equal(kinds, tiling.classify(n_q, n_k, block_q, block_k, causal, mask=mask))
        assert kinds.dtype == np.int8
    per_row, per_col, full, computed, skipped, masked = _per_tile(n_q, n_k, block_q, block_k, causal, mask)
    got = tile_counts.count(n_q, n_k, block_q, block_k, causal, mask=mask)
    np.testing.assert_array_equal(got.per_row, per_row)
    np.testing.assert_array_equal(got.per_col, per_col)
    np.testing.assert_array_equal(got.full_per_row, full)
    assert (got.computed, got.skipped, got.masked) == (computed, skipped, masked)


@given(mc=mask_cases(max_n=40, max_block=12))
@with_hard_mask_cases
def test_mask_counts_equal_the_per_tile_classification(mc: MaskCase):
    """Every mask kind (the built-ins from their row intervals, from_function / from_dense tile by tile)."""
    _assert_counts_match(*mc.tiles, mask=mc.mask)


@given(mc=mask_cases(max_n=150, max_block=24, kinds=INTERVAL_KINDS))
@example(mc=MaskCase(Case(97, 97, 3, 16, 8, False), masks.documents([1, 40, 1, 1, 54], causal=True)))
@example(mc=MaskCase(Case(130, 7, 3, 5, 3, False), masks.sliding_window(2, 60)))  # N_q >> N_k: dead tiles
def test_interval_counts_equal_the_per_tile_classification_on_larger_grids(mc: MaskCase):
    """More tiles per row and column (up to 150 x 150 tiles) for the masks counted from their intervals."""
    _assert_counts_match(*mc.tiles, mask=mc.mask)


@dataclass(frozen=True, repr=False)
class Scattered(masks.Mask):
    """Any row intervals, not monotone (unlike every built-in): row i sees [lo[i], hi[i]). Classified by the
    base class's predicate per tile, counted from the intervals by tile_counts' sort-and-merge."""

    lo: tuple
    hi: tuple

    def visible(self, i, j, n_q, n_k):
        return (np.asarray(self.lo)[i] <= j) & (j < np.asarray(self.hi)[i])

    def check(self, n_q, n_k):
        super().check(n_q, n_k)
        if n_q != len(self.lo):
            raise ValueError(f"n_q must be {len(self.lo)} (one interval per row), got {n_q}")

    def row_intervals(self, n_q, n_k):
        return np.array(self.lo, dtype=np.int32), np.array(self.hi, dtype=np.int32)

    def describe(self):
        return f"scattered({self.lo}, {self.hi})"


@st.composite
def scattered(draw):
    n_q, n_k = draw(st.integers(1, 30)), draw(st.integers(1, 30))
    ends = [sorted(draw(st.lists(st.integers(0, n_k), min_size=2, max_size=2))) for _ in range(n_q)]
    return n_q, n_k, draw(st.integers(1, 8)), draw(st.integers(1, 8)), Scattered(*map(tuple, zip(*ends)))


@given(problem=scattered())
@example(problem=(4, 9, 4, 2, Scattered((6, 0, 3, 8), (7, 1, 3, 9))))  # one tile row: ranges out of order, a gap
def test_counts_of_any_row_intervals_equal_the_per_tile_classification(problem):
    """tile_counts assumes no monotonicity: rows of one query tile may see ranges in any order, with gaps."""
    n_q, n_k, block_q, block_k, mask = problem
    _assert_counts_match(n_q, n_k, block_q, block_k, mask=mask)


@given(case=cases(max_n=120, max_block=20))
@with_hard_cases
def test_causal_and_unmasked_counts_equal_the_per_tile_classification(case: Case):
    _assert_counts_match(case.n_q, case.n_k, case.block_q, case.block_k, causal=case.causal)
    _assert_counts_match(case.n_q, case.n_k, case.block_q, case.block_k, causal=not case.causal)


@given(mc=mask_cases(max_n=40, max_block=12))
@with_hard_mask_cases
def test_counts_equal_the_block_mask_list_lengths(mc: MaskCase):
    """n_i and m_j are the lengths of the kernels' lists (row_ptr, col_ptr), and FULL per row the length of
    the FULL list, as `iomodel` summed them before counting from the intervals."""
    blocks = tiling.block_mask(*mc.tiles, mc.mask)
    got = tile_counts.count(*mc.tiles, mask=mc.mask)
    np.testing.assert_array_equal(got.per_row, np.diff(blocks.row_ptr))
    np.testing.assert_array_equal(got.per_col, np.diff(blocks.col_ptr))
    np.testing.assert_array_equal(got.full_per_row, np.diff(blocks.row_lists(FULL)[0]))
    assert got.masked == blocks.count(PARTIAL) and got.skipped == blocks.count(SKIP)


def _visits_by_definition(n_q, n_k, block_q, block_k, causal=False, mask=None, skip=True) -> iomodel.Visits:
    """iomodel's four sums straight from its docstring's definition, over the schedule's visits:
    R = sum r_i, K = sum c_j, Q_vis = rows of query tiles with a visit, K_vis = columns of key tiles with one."""
    sched = tiling.schedule("v2", n_q, n_k, block_q, block_k, causal, skip=skip, mask=mask)
    grid = sched.grid
    r = {i: r1 - r0 for i, (r0, r1) in ((i, grid.rows(i)) for i in range(grid.t_r))}
    c = {j: c1 - c0 for j, (c0, c1) in ((j, grid.cols(j)) for j in range(grid.t_c))}
    pairs = [(i, j) for i, j, _ in sched.visits]
    return iomodel.Visits(sum(r[i] for i, _ in pairs), sum(c[j] for _, j in pairs),
                          sum(r[i] for i in {i for i, _ in pairs}), sum(c[j] for j in {j for _, j in pairs}))


@given(case=cases(max_n=60, max_block=12), skip=st.booleans())
@with_hard_cases(skip=True)
def test_causal_visits_equal_the_sums_over_the_schedule(case: Case, skip: bool):
    """The vectorised L5 closed forms (and the unmasked ones) equal the sums over the visits."""
    tiles = (case.n_q, case.n_k, case.block_q, case.block_k)
    for causal in (False, True):
        assert iomodel.visits(*tiles, causal=causal, skip=skip) == _visits_by_definition(*tiles, causal, skip=skip)


@given(mc=mask_cases(max_n=40, max_block=12), skip=st.booleans())
@with_hard_mask_cases(skip=True)
def test_mask_visits_equal_the_sums_over_the_schedule(mc: MaskCase, skip: bool):
    assert iomodel.visits(*mc.tiles, mask=mc.mask, skip=skip) == _visits_by_definition(*mc.tiles, mask=mc.mask,
                                                                                         skip=skip)


def _shape(n, mask=None, causal=False, block_q=64, block_k=32):
    return cmp.Shape(batch=1, heads=2, n_q=n, head_dim=64, causal=causal, mask=mask, block_q=block_q,
                     block_k=block_k).resolved()


@given(n=st.integers(1, 200), block_q=st.sampled_from([1, 3, 16, 64]), block_k=st.sampled_from([1, 5, 32]),
       spec=st.sampled_from([None, "causal", "window:16,0", "window:3,7", "prefix:20", "documents:50,1,30,19",
                             "documents-causal:7,93"]))
def test_compare_analytic_rows_equal_the_schedule(n, block_q, block_k, spec):
    """compare's tiles computed / skipped / masked are those of tiling.schedule, times B H."""
    if spec is not None and spec.startswith("documents"):
        n = sum(map(int, spec.partition(":")[2].split(",")))
    s = _shape(n, spec, block_q=block_q, block_k=block_k)
    causal, mask, _ = cmp.masking(s)
    for order in tiling.ORDERS:
        sched = tiling.schedule(order, n, n, block_q, block_k, causal, mask=mask)
        row = cmp.analytic(s, order)
        assert (row["tiles_computed"], row["tiles_skipped"], row["tiles_masked"]) == (
            2 * sched.computed, 2 * sched.skipped, 2 * sched.masked)


MILLION = 10**6
T_R, T_C = MILLION // 64, MILLION // 32  # 15625 query tiles of 64 rows, 31250 key tiles of 32 keys


def test_a_million_tokens_causal_by_hand():
    """N = 10^6, 64 x 32 tiles: query tile i (rows 64 i .. 64 i + 63) sees key tiles 0 .. 2 i + 1, the last
    two PARTIAL (32 (j + 1) - 1 <= 64 i iff j <= 2 i - 1): 2 i + 2 visits, 2 of them masked."""
    row = cmp.analytic(_shape(MILLION, causal=True), "v2")
    visits = sum(2 * i + 2 for i in range(T_R))
    assert row["tiles_computed"] == 2 * visits and row["tiles_masked"] == 2 * 2 * T_R
    assert row["tiles_skipped"] == 2 * (T_R * T_C - visits)
    assert row["bytes_model"]["read"]["K"] == 2 * visits * 32 * 64 * 4  # v2 reads K_j once per visit


def test_a_million_tokens_window_by_hand():
    """window(128, 0), N = 10^6, 64 x 32 tiles: row r sees [r - 128, r]. Query tile i >= 2 covers keys
    64 i - 128 .. 64 i + 63, key tiles 2 i - 4 .. 2 i + 1 (6 visits); tile 0 sees key tiles 0, 1 and tile 1
    key tiles 0 .. 3. Every row of tile i sees [64 i - 65, 64 i + 1), so key tiles 2 i - 2 and 2 i - 1 are
    FULL for i >= 1 (tile 1's rows see [0, 65) at least); tile 0's first row sees key 0 only: none FULL."""
    s = _shape(MILLION, "window:128,0")
    visits, full = 2 + 4 + 6 * (T_R - 2), 2 * (T_R - 1)
    for order in tiling.ORDERS:
        row = cmp.analytic(s, order)
        assert (row["tiles_computed"], row["tiles_masked"]) == (2 * visits, 2 * (visits - full)), order
        assert row["tiles_skipped"] == 2 * (T_R * T_C - visits)
    assert cmp.analytic(s, "v2")["bytes_model"]["read"]["K"] == 2 * visits * 32 * 64 * 4
    assert cmp.analytic(s, "v1")["bytes_model"]["read"]["Q"] == 2 * visits * 64 * 64 * 4  # v1 reads Q_i per visit


def test_a_million_tokens_of_documents_by_hand():
    """1000 documents of 1000 tokens, 100 x 100 tiles (10 per document): every tile inside a document is
    FULL, the others SKIP: 1000 * 10 * 10 visits, none masked."""
    spec = "documents:" + ",".join(["1000"] * 1000)
    counts = tile_counts.count(MILLION, MILLION, 100, 100, mask=masks.parse(spec))
    assert (counts.computed, counts.masked, counts.skipped) == (100_000, 0, 10**8 - 100_000)
    assert (counts.per_row == 10).all() and (counts.per_col == 10).all()


def test_a_predicate_mask_beyond_the_limit_is_refused_by_name(monkeypatch):
    """A mask without row intervals is classified tile by tile: past MAX_CLASSIFIED_TILES it is refused with
    the tile count and what would work, rather than running for minutes."""
    monkeypatch.setattr(tile_counts, "MAX_CLASSIFIED_TILES", 100)
    mask = masks.from_function(lambda i, j: j <= i)
    assert tile_counts.count(10, 10, 1, 1, mask=mask).computed == 55  # 100 tiles of one pair: the lower triangle
    with pytest.raises(ValueError, match=r"no row intervals.*10 x 11 = 110 tiles.*built-in mask"):
        tile_counts.count(10, 11, 1, 1, mask=masks.from_function(lambda i, j: j <= i))
    with pytest.raises(ValueError, match="no row intervals"):
        iomodel.visits(10, 11, 1, 1, mask=masks.from_function(lambda i, j: j <= i))


def test_a_predicate_that_changed_is_counted_afresh():
    """Counts are cached for the built-ins (their text is their value) but never for a predicate, which may
    read state that changed: causal 6 x 6 in 2 x 2 tiles is 1 + 2 + 3 visits; shifted by -10, none."""
    state = {"shift": 0}
    mask = masks.from_function(lambda i, j: j <= i + state["shift"])
    assert tile_counts.count(6, 6, 2, 2, mask=mask).computed == 6
    state["shift"] = -10
    assert tile_counts.count(6, 6, 2, 2, mask=mask).computed == 0


def test_block_mask_of_an_interval_mask_equals_the_per_tile_lists():
    """tiling.block_mask builds its kinds with tile_counts.kinds: the same lists as classify_tile per tile."""
    mask = masks.documents([5, 1, 9, 3], causal=True)
    blocks = tiling.block_mask(18, 18, 4, 3, mask)
    expected = np.array([[mask.classify_tile(r0, min(r0 + 4, 18), c0, min(c0 + 3, 18), 18, 18)
                          for c0 in range(0, 18, 3)] for r0 in range(0, 18, 4)], dtype=np.int8)
    np.testing.assert_array_equal(blocks.kinds, expected)
    rows, cols = np.nonzero(expected)
    np.testing.assert_array_equal(blocks.col_idx, cols)
    np.testing.assert_array_equal(blocks.col_kind, expected[rows, cols])


def test_counts_are_read_only_and_validate_their_arguments():
    counts = tile_counts.count(9, 7, 2, 3, causal=True)
    for array in (counts.per_row, counts.per_col, counts.full_per_row):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0
    with pytest.raises(ValueError, match="block_k"):
        tile_counts.count(9, 7, 2, 0)
    with pytest.raises(ValueError, match="not both"):
        tile_counts.count(9, 7, 2, 3, causal=True, mask=masks.causal())
    with pytest.raises(ValueError, match="sum"):
        tile_counts.count(9, 9, 2, 3, mask=masks.documents([4, 4]))
