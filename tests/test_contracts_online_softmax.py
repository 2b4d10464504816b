"""Contracts of the online-softmax state (fa_numba.online_softmax) beyond the monoid laws: what `finalize`
does with a state when the caller does not pass the mask's `alive`."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fa_numba import online_softmax as osm

M = (-np.inf, 0.0, 1.5, np.nan)
L = (0.0, 1.0, 2.5, np.nan)
ACC = (0.0, 1.0, np.nan)


@given(rows=st.lists(st.tuples(st.sampled_from(M), st.sampled_from(L), st.sampled_from(ACC), st.sampled_from(ACC)),
                     min_size=1, max_size=8))
def test_without_alive_a_row_is_empty_iff_its_state_is_the_identity(rows):
    """finalize(state) with alive=None: O = 0, LSE = -inf exactly on the rows whose state is the identity's,
    (-inf, 0, 0); every other row is finalised by IEEE arithmetic, O = acc / l and LSE = m + log l, so a NaN
    anywhere in the state is never taken for an empty row, and a row whose values are all zero keeps its LSE."""
    m = np.array([r[0] for r in rows])
    l = np.array([r[1] for r in rows])
    acc = np.array([[r[2], r[3]] for r in rows])
    out, lse = osm.finalize(osm.State(m, l, acc))
    empty = (m == -np.inf) & (l == 0) & (acc == 0).all(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        expected_out = np.where(empty[:, None], 0.0, acc / l[:, None])
        expected_lse = np.where(empty, -np.inf, m + np.log(l))
    np.testing.assert_array_equal(out, expected_out)  # NaN == NaN here
    np.testing.assert_array_equal(lse, expected_lse)


def test_a_row_that_sees_keys_with_zero_values_is_not_empty():
    """Values all zero make acc = 0 but the row saw its keys: its LSE is the log-sum-exp, not -inf."""
    scores = np.array([[0.0, np.log(3.0)]])
    state = osm.from_block(scores, np.zeros((2, 3)))
    out, lse = osm.finalize(state)
    assert (out == 0).all() and lse[0] == np.log(4.0)


def test_keys_whose_scores_are_all_minus_inf_with_a_nan_value_finalise_to_nan():
    """The state of visible keys with score -inf is (-inf, 0, acc) and a NaN value makes acc NaN (0 * NaN):
    that is not the empty set's state, so the row is NaN (the dense formula's 0/0), never 0."""
    state = osm.from_block(np.array([[-np.inf, -np.inf]]), np.array([[np.nan, 1.0], [2.0, 3.0]]))
    assert state.m[0] == -np.inf and state.l[0] == 0 and np.isnan(state.acc[0, 0])
    out, lse = osm.finalize(state)
    assert np.isnan(out[0]).all() and lse[0] == -np.inf
