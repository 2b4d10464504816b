"""Contracts of the masks (fa_numba.masks) that no other test states: the predicate `visible` on any pairs,
the tiles `classify_tile` accepts, and the mask classes' own checks when constructed directly."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fa_numba import masks
from strategies import MaskCase, mask_cases, with_hard_mask_cases


@given(mc=mask_cases(max_n=24, multihead=False), data=st.data())
@with_hard_mask_cases(data=None)
def test_the_predicate_on_any_pairs_is_the_dense_form(mc: MaskCase, data):
    """mask.visible(i, j, N_q, N_k) is the predicate the dense form tabulates: on a grid of broadcast index
    arrays it is dense(N_q, N_k), and on any list of (i, j) pairs it is their entries."""
    dense = mc.mask.dense(mc.n_q, mc.n_k)
    i, j = np.arange(mc.n_q)[:, None], np.arange(mc.n_k)[None, :]
    grid = np.broadcast_to(mc.mask.visible(i, j, mc.n_q, mc.n_k), dense.shape)
    np.testing.assert_array_equal(grid, dense)
    if data is None:
        pairs_i, pairs_j = np.arange(mc.n_q) % mc.n_q, np.arange(mc.n_q) % mc.n_k
    else:
        size = data.draw(st.integers(1, 12))
        pairs_i = np.array(data.draw(st.lists(st.integers(0, mc.n_q - 1), min_size=size, max_size=size)))
        pairs_j = np.array(data.draw(st.lists(st.integers(0, mc.n_k - 1), min_size=size, max_size=size)))
    np.testing.assert_array_equal(mc.mask.visible(pairs_i, pairs_j, mc.n_q, mc.n_k), dense[pairs_i, pairs_j])


@pytest.mark.parametrize("mask", [masks.causal(), masks.sliding_window(2, 1), masks.prefix_lm(3),
                                  masks.documents([2, 4]), masks.from_dense(np.eye(6, dtype=bool))], ids=repr)
@pytest.mark.parametrize("tile", [(-1, 2, 0, 2), (2, 2, 0, 2), (4, 7, 0, 2), (0, 2, -1, 2), (0, 2, 3, 3),
                                  (0, 2, 4, 7)], ids=["r0 < 0", "no rows", "r1 > n_q", "c0 < 0", "no keys", "c1 > n_k"])
def test_classify_tile_needs_at_least_one_row_and_one_key_inside_the_sizes(mask, tile):
    with pytest.raises(ValueError, match=r"a tile needs 0 <= r0 < r1 <= n_q and 0 <= c0 < c1 <= n_k"):
        mask.classify_tile(*tile, 6, 6)


@pytest.mark.parametrize("shape, data", [
    ([2, 3], bytes(6)),  # a list is not hashable
    ((2, 3, 1), bytes(6)),
    ((2, 0), b""),
    ((2, 3.0), bytes(6)),
    ((2, 3), bytes(5)),
    ((2, 3), bytearray(6)),  # not hashable
], ids=["list", "3-D", "empty", "float size", "short data", "bytearray"])
def test_a_dense_mask_made_directly_must_hold_one_byte_per_pair_of_its_shape(shape, data):
    with pytest.raises(ValueError, match=r"^(shape must be \(N_q, N_k\) with ints >= 1|data must be \d+ bytes)"):
        masks.FromDense(shape, data)


def test_documents_made_directly_are_not_causal_unless_asked():
    assert masks.Documents((2, 3)) == masks.documents([2, 3]) != masks.documents([2, 3], causal=True)
    assert masks.Documents((2, 3)).dense(5, 5)[0, 1]  # query 0 sees the later key 1 of its document
