"""The worked examples of the lecture notes (../shared/seeds/), as plain unit tests."""

import math

import numpy as np
import pytest

from bounds import EXP, U64, factor
from fa_numba import iomodel, online_softmax as osm, tiling


def _rel(ours, expected):
    """pytest.approx rel for two float64 evaluations of a sum of positive terms, each term passing through
    (exps, other roundings) as counted (tests/bounds.py): |a - b| <= (phi_a + phi_b) exact <= rel |b|."""
    phi_a, phi_b = factor(*ours, 0), factor(*expected, 0)
    return float((phi_a + phi_b) / (1 - phi_b))


def _state(scores):
    """State of one row with scalar values v_j = 1, so acc = l."""
    s = np.asarray([scores], dtype=np.float64)
    return osm.from_block(s, np.ones((s.shape[1], 1)))


@pytest.mark.lemma("L2")
def test_max_shift_of_1_2_3_5_is_minus4_minus3_minus2_0():
    x = np.array([1.0, 2.0, 3.0, 5.0])
    assert (x - x.max()).tolist() == [-4.0, -3.0, -2.0, 0.0]
    state = _state(x)
    assert state.m[0] == 5.0
    # from_block: exp(s - 5), up to 3 additions and the identity's + 0; math.exp (libm, 1 ulp) and 3 additions
    assert state.l[0] == pytest.approx(math.exp(-4) + math.exp(-3) + math.exp(-2) + 1.0, rel=_rel((1, 4), (1, 3)))


@pytest.mark.lemma("L2")
def test_blocks_1_2_and_3_5_merge_to_the_whole_row():
    left, right = _state([1.0, 2.0]), _state([3.0, 5.0])
    assert (left.m[0], right.m[0]) == (2.0, 5.0)
    # relative to its own max 2 (and 5): from_block's exps and up to 2 sums (+ 0) against math.exp and one sum
    assert left.l[0] == pytest.approx(math.exp(-1) + 1.0, rel=_rel((1, 2), (1, 1)))
    assert right.l[0] == pytest.approx(math.exp(-2) + 1.0, rel=_rel((1, 2), (1, 1)))
    merged = osm.merge(left, right)
    assert merged.m[0] == 5.0
    # The left block is rescaled by exp(2 - 5) before the sums are added (an exp, a product, a sum either way).
    assert merged.l[0] == pytest.approx(math.exp(2 - 5) * left.l[0] + right.l[0], rel=_rel((1, 2), (1, 2)))
    # Each key: its block's exp and sum (+ 0), then the merge's exp, product and sum; against one block.
    assert merged.l[0] == pytest.approx(_state([1.0, 2.0, 3.0, 5.0]).l[0], rel=_rel((2, 4), (1, 4)))


@pytest.mark.lemma("L2")
def test_row_1_2_then_3():
    """l' = e^{m - m'} l + e^{3 - m'} = e^{-1}(e^{-1} + 1) + 1 when 3 arrives after [1, 2]."""
    state = osm.update(_state([1.0, 2.0]), np.array([[3.0]]), np.ones((1, 1)))
    assert state.m[0] == 3.0
    rel = _rel((2, 4), (2, 4))  # each key: at most two exps, a product and three sums on either side
    assert state.l[0] == pytest.approx(math.exp(-1) * (math.exp(-1) + 1) + 1, rel=rel)
    out, lse = osm.finalize(state)
    # LSE = m + log l: the error of l (within rel), the log's 1 ulp of log l and the addition; against the log
    # (1 ulp) of a 3-term sum (within rel).
    expected = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    bound = rel + EXP * (abs(expected - state.m[0]) + expected) + U64 * expected
    assert lse[0] == pytest.approx(expected, abs=bound)
    # all values 1: acc and l are sums of the same weights, each within rel of it, so acc / l is within
    # rel + U64 (the division) of 1, to first order
    assert out[0, 0] == pytest.approx(1.0, rel=0, abs=rel + 2 * U64)


@pytest.mark.lemma("L3")
def test_future_tiles_are_skipped_and_the_diagonal_is_masked():
    """Q_1 against a late K_N is entirely in the future: skipped; diagonal tiles keep a mask."""
    kinds = tiling.classify(8, 8, 2, 2, causal=True)
    assert kinds[0, 3] == tiling.SKIP and kinds[3, 0] == tiling.FULL and kinds[1, 1] == tiling.PARTIAL


@pytest.mark.lemma("L5")
def test_score_matrix_sizes_of_the_notes():
    # N = 4096, FP16: one head's score table is 4096^2 * 2 bytes = 32 MiB.
    assert iomodel.materialized_scores_elements(4096, 4096) * 2 == 32 * 2**20
    # N = 10^4, d = 128: S has N / d = 78.125 times the elements of Q.
    assert iomodel.materialized_scores_elements(10**4, 10**4) / (10**4 * 128) == 78.125
    # N = 10^5, d = 128: 781.25 times one N x d tensor, about 195 times Q, K, V, O together.
    assert iomodel.materialized_scores_elements(10**5, 10**5) / (10**5 * 128) == 781.25
    # exact: 10^10 / 51200000 = 195.3125 = 3125 / 16, and Python's int / int is correctly rounded
    assert iomodel.materialized_scores_elements(10**5, 10**5) / (4 * 10**5 * 128) == 195.3125
