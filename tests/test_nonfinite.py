"""NaN and infinity in the inputs propagate as the dense formula says, and never pass for a masked row.

The rule (reference.py, proofs/L2.6 and L3.5): whether a row sees a key is decided by the mask. A NaN in a
query row, or in a key that row sees, makes the whole O row and the LSE NaN; a NaN in column x of a value
that row sees makes O[:, x] NaN; nothing else changes, bit for bit. Infinities follow IEEE arithmetic in
the dense formula with max shift, and every layer reproduces the reference's non-finite entries exactly.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fa_numba import online_softmax as osm
from fa_numba import reference, tiled, tolerance
from fa_numba.kernels import VARIANTS
from strategies import Case, cases, kernel_cases
from test_kernels import run_kernel

NAMES = sorted(name for name, v in VARIANTS.items() if "float32" in v.dtypes and v.tile_multiple == 1)
# (what these cases draw: float32, any tiles; the tensor-core variants' non-finite cases: test_mma_forward.py)


@st.composite
def poisons(draw, case_strategy):
    """A case and one input entry to poison: (case, tensor name, index in (B, H, N, d))."""
    case = draw(case_strategy)
    tensor = draw(st.sampled_from(["q", "k", "v"]))
    heads, n = (case.heads, case.n_q) if tensor == "q" else (case.heads_kv, case.n_k)
    index = tuple(draw(st.integers(0, size - 1)) for size in (case.batch, heads, n, case.d))
    return case, tensor, index


def _poison(case: Case, tensor: str, index, value, dtype=np.float64):
    q, k, v = case.inputs(dtype)
    arrays = {"q": q, "k": k, "v": v}
    arrays[tensor][index] = value
    return q, k, v


def _predicted_nan(case: Case, tensor: str, index):
    """Which O entries and LSE entries a NaN at `index` of `tensor` makes NaN, from the mask alone."""
    visible = reference.visible_mask(case.n_q, case.n_k, case.causal)
    alive = visible.any(axis=1)
    out = np.zeros((case.batch, case.heads, case.n_q, case.d), dtype=bool)
    lse = np.zeros((case.batch, case.heads, case.n_q), dtype=bool)
    b, h, n, x = index
    if tensor == "q":
        out[b, h, n, :] = alive[n]
        lse[b, h, n] = alive[n]
        return out, lse
    for head in range(h * case.group, (h + 1) * case.group):  # the query heads that read K/V head h
        if tensor == "k":
            out[b, head] |= visible[:, n][:, None]
            lse[b, head] |= visible[:, n]
        else:
            out[b, head, :, x] |= visible[:, n]
    return out, lse


DEAD_ROW_WITH_NAN_QUERY = (Case(n_q=6, n_k=3, d=2, block_q=2, block_k=2, causal=True, seed=1), "q", (0, 0, 1, 0))
NAN_IN_A_MASKED_VALUE = (Case(n_q=5, n_k=5, d=3, block_q=4, block_k=4, causal=True, seed=2), "v", (0, 0, 4, 1))
NAN_IN_A_FUTURE_KEY = (Case(n_q=8, n_k=8, d=2, block_q=4, block_k=4, causal=True, seed=3), "k", (0, 0, 6, 1))
NAN_IN_A_SHARED_KV_HEAD = (Case(n_q=4, n_k=6, d=2, block_q=2, block_k=4, causal=False, heads_kv=2, group=2, seed=4),
                           "v", (0, 1, 2, 0))


def _check_nan_pattern(out, lse, case, tensor, index, clean_out, clean_lse, name):
    want_out, want_lse = _predicted_nan(case, tensor, index)
    np.testing.assert_array_equal(np.isnan(out), want_out, err_msg=f"{name}: O entries that are NaN")
    np.testing.assert_array_equal(np.isnan(lse), want_lse, err_msg=f"{name}: LSE entries that are NaN")
    if clean_out is not None:  # everything else is untouched, bit for bit
        np.testing.assert_array_equal(out[~want_out], clean_out[~want_out], err_msg=f"{name}: other O entries")
        np.testing.assert_array_equal(lse[~want_lse], clean_lse[~want_lse], err_msg=f"{name}: other LSE entries")


@pytest.mark.lemma("L3")
@given(poison=poisons(cases(max_n=12, max_d=5)))
@example(poison=DEAD_ROW_WITH_NAN_QUERY)
@example(poison=NAN_IN_A_MASKED_VALUE)
@example(poison=NAN_IN_A_FUTURE_KEY)
@example(poison=NAN_IN_A_SHARED_KV_HEAD)
def test_a_nan_poisons_exactly_the_rows_that_see_it_in_the_reference_and_the_spec(poison):
    case, tensor, index = poison
    clean = case.inputs()
    q, k, v = _poison(case, tensor, index, np.nan)
    ref = reference.attention(*clean, causal=case.causal)
    _check_nan_pattern(*reference.attention(q, k, v, causal=case.causal), case, tensor, index, *ref, "reference")
    for order in ("v1", "v2"):
        spec = tiled.attention(*clean, order=order, block_q=case.block_q, block_k=case.block_k, causal=case.causal)
        out, lse, _ = tiled.attention(q, k, v, order=order, block_q=case.block_q, block_k=case.block_k,
                                      causal=case.causal)
        _check_nan_pattern(out, lse, case, tensor, index, spec[0], spec[1], f"tiled {order}")


@pytest.mark.lemma("L3")
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=12)
@given(poison=poisons(kernel_cases()))
@example(poison=DEAD_ROW_WITH_NAN_QUERY)
@example(poison=NAN_IN_A_MASKED_VALUE)
@example(poison=NAN_IN_A_FUTURE_KEY)
@example(poison=NAN_IN_A_SHARED_KV_HEAD)
def test_a_nan_poisons_exactly_the_rows_that_see_it_in_every_kernel(name, poison):
    case, tensor, index = poison
    q, k, v = _poison(case, tensor, index, np.nan, np.float32)
    out, lse = run_kernel(name, case, inputs=(q, k, v))
    _check_nan_pattern(out, lse, case, tensor, index, None, None, f"{name} kernel")
    tolerance.check_attention(out, lse, q, k, v, causal=case.causal, name=f"{name} kernel",  # the rest, by the rule
                              order=VARIANTS[name].order, block_q=case.block_q, block_k=case.block_k)


@pytest.mark.lemma("L3")
@pytest.mark.parametrize("name", ["tiled v1", "tiled v2", *NAMES])
@settings(max_examples=10)
@given(poison=poisons(kernel_cases()), value=st.sampled_from([np.inf, -np.inf]))
@example(poison=NAN_IN_A_MASKED_VALUE, value=np.inf)
@example(poison=NAN_IN_A_FUTURE_KEY, value=-np.inf)
@example(poison=(Case(n_q=3, n_k=3, d=1, block_q=2, block_k=2, causal=True), "k", (0, 0, 0, 0)), value=-np.inf)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the simulator's NumPy scalars
def test_an_infinity_gives_the_reference_non_finite_entries_in_every_layer(name, poison, value):
    """With logits of order 1 no weight underflows, so 0 * inf never differs between precisions."""
    case, tensor, index = poison
    if case.logit != 1.0:
        case = dataclasses.replace(case, logit=1.0)
    q, k, v = _poison(case, tensor, index, value, np.float32)
    if name.startswith("tiled"):
        out, lse, _ = tiled.attention(q, k, v, order=name[-2:], block_q=case.block_q, block_k=case.block_k,
                                      causal=case.causal, dtype=np.float32)
    else:
        out, lse = run_kernel(name, case, inputs=(q, k, v))
    ref_out, ref_lse = reference.attention(q, k, v, causal=case.causal)
    assert np.array_equal(np.isfinite(out), np.isfinite(ref_out)) and np.array_equal(np.isfinite(lse),
                                                                                      np.isfinite(ref_lse))
    order = name[-2:] if name.startswith("tiled") else VARIANTS[name].order
    tolerance.check_attention(out, lse, q, k, v, causal=case.causal, name=name, order=order, block_q=case.block_q,
                              block_k=case.block_k)


def test_the_reference_follows_the_dense_formula_on_infinite_scores():
    """The worked cases of the rule, against a hand evaluation of softmax with max shift."""
    q = np.array([[1.0], [1.0], [1.0]])
    v = np.array([[1.0], [2.0], [3.0]])
    # key 2 has score +inf for every query: exp(inf - inf) = NaN, so every row that sees it is NaN
    out, lse = reference.attention(q, np.array([[0.0], [1.0], [np.inf]]), v, scale=1.0)
    assert np.isnan(out).all() and np.isnan(lse).all()
    # key 0 has score -inf: it gets weight exactly 0 and the row is the softmax of the others
    out, lse = reference.attention(q, np.array([[-np.inf], [0.0], [0.0]]), v, scale=1.0)
    np.testing.assert_array_equal(out[:, 0], [2.5, 2.5, 2.5])
    np.testing.assert_array_equal(lse, np.log(2.0))  # exact: m = 0, l = 0 + 1 + 1 = 2, LSE = 0 + log(2)
    # causal, query 0 sees only key 0 whose score is -inf: O = 0/0 = NaN, LSE = log 0 = -inf
    out, lse = reference.attention(q, np.array([[-np.inf], [0.0], [0.0]]), v, scale=1.0, causal=True)
    assert np.isnan(out[0]).all() and lse[0] == -np.inf
    assert np.isfinite(out[1:]).all() and np.isfinite(lse[1:]).all()


@pytest.mark.lemma("L2")
def test_the_state_algebra_carries_nan_and_keeps_masked_values_out():
    scores = np.array([[0.5, np.nan, 1.0], [0.5, 0.2, 1.0]])
    values = np.array([[1.0, 2.0], [3.0, np.nan], [5.0, 6.0]])
    visible = np.array([[True, True, True], [True, False, True]])  # row 1 does not see key 1
    state = osm.from_block(scores, values, visible)
    out, lse = osm.finalize(state, alive=np.array([True, True]))
    assert np.isnan(out[0]).all() and np.isnan(lse[0])  # a NaN score reaches l and acc through its weight
    assert np.isfinite(out[1]).all() and np.isfinite(lse[1])  # the NaN value of a masked key stays out
    # merging with a NaN state poisons the merge, in either order
    nan_state = osm.State(np.array([np.nan, 0.0]), np.array([np.nan, 1.0]), np.array([[np.nan, np.nan], [1.0, 1.0]]))
    for merged in (osm.merge(state, nan_state), osm.merge(nan_state, state)):
        assert np.isnan(merged.l[0]) and np.isfinite(merged.l[1])
    # alive decides, not the state: (-inf, 0, 0) is 0/-inf for a row that sees nothing, NaN/-inf for one
    # whose visible scores are all -inf, and a NaN state is never taken for empty without the mask
    empty = osm.identity(2, 2)
    out, lse = osm.finalize(empty, alive=np.array([False, True]))
    assert (out[0] == 0).all() and lse[0] == -np.inf and np.isnan(out[1]).all() and lse[1] == -np.inf
    out, lse = osm.finalize(osm.State(np.array([1.0]), np.array([np.nan]), np.array([[np.nan, 0.0]])))
    assert np.isnan(out).all() and np.isnan(lse).all()
