"""Contracts of the executable spec (fa_numba.tiled) that no other test states: a row whose visible scores
are all -inf, in both orders, and what v1's ledger counts for it."""

import numpy as np
import pytest

from bounds import assert_within, attention_bound, dense_counts, tiled_counts
from fa_numba import iomodel, reference, tiled


@pytest.mark.parametrize("order", ["v1", "v2"])
def test_a_query_whose_scores_are_all_minus_inf_is_nan_in_both_orders(order):
    """q_2 = -inf against positive keys: every score of row 2 is -inf, so l = 0 and the dense formula gives
    O = 0/0 = NaN and LSE = log 0 = -inf. Both orders reproduce it (v1 stores O = acc between visits and
    divides in its last pass), and every other row is the reference's. v1's ledger counts that last-pass
    write of O_2: the closed form's O writes plus one row of d; nothing else changes."""
    rng = np.random.default_rng(1)
    d = 2
    q, k, v = rng.standard_normal((5, d)), np.abs(rng.standard_normal((6, d))) + 0.5, rng.standard_normal((6, d))
    q[2] = -np.inf
    ref_out, ref_lse = reference.attention(q, k, v)
    out, lse, ledger = tiled.attention(q, k, v, order=order, block_q=2, block_k=4)
    assert np.isnan(out[2]).all() and lse[2] == -np.inf
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    # The other rows: two float64 evaluations (the tiled fold over 2 key tiles of 4, the dense reference), each
    # within its derived bound of the exact value (tests/bounds.py); row 2 takes no part in theirs.
    rows = [0, 1, 3, 4]
    bounds = (attention_bound(q[None, None, rows], k[None, None], v[None, None], causal=False, counts=c)[0][0, 0]
              for c in (tiled_counts(6, 4), dense_counts(6)))
    assert_within(out[rows], ref_out[rows], sum(bounds), name="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    model = iomodel.traffic(order, 5, 6, d, 2, 4, causal=False)
    assert ledger.reads == model.reads
    assert ledger.writes == {**model.writes, "O": model.writes["O"] + (d if order == "v1" else 0)}
