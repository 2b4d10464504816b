"""The executable spec: both loop orders reproduce the reference (proofs/L4_loop_interchange.md)."""

import warnings

import numpy as np
import pytest
from hypothesis import example, given

from bounds import assert_within, attention_bound, dense_counts, tiled_counts
from fa_numba import masks, reference, tiled, tiling, tolerance
from strategies import Case, MaskCase, cases, mask_cases, with_hard_cases, with_hard_mask_cases
from test_masks import definition


def _run(case: Case, order: str, dtype=np.float64, inputs=None):
    q, k, v = case.inputs() if inputs is None else inputs
    return tiled.attention(q, k, v, order=order, block_q=case.block_q, block_k=case.block_k,
                           causal=case.causal, dtype=dtype)


def _assert_float64_agrees(case: Case, inputs, out, lse, ref_out, ref_lse, counts, ref_counts, mask=None):
    """Two float64 evaluations of the same attention differ only in rounding: each is within its derived bound
    (tests/bounds.py: score rounding, exps and sums, for its per-term operation counts) of the exact value."""
    assert np.isfinite(out).all()
    bounds = (attention_bound(*inputs, causal=case.causal, counts=c, mask=mask) for c in (counts, ref_counts))
    bound_out, bound_lse = (a + b for a, b in zip(*bounds))
    assert_within(out, ref_out, bound_out, name="out")
    assert_within(lse, ref_lse, bound_lse, name="lse")


@pytest.mark.lemma("L6")
@given(case=cases())
@with_hard_cases
def test_rescaling_terms_bound_an_inexact_alpha(case: Case):
    """Isolate the rescalings (L6 part 6): run both orders in float64 with every rescaling factor alpha =
    exp(m_old - m_new) < 1 off by the most a float32 exp may err, 3 ulps, always upwards: the keys seen before
    each rescaling gain weight against the later ones. O and LSE then stay within the rescaling terms, plus
    float64 rounding."""
    q, k, v = inputs = case.inputs()
    base = tolerance.baseline(q, k, v, causal=case.causal, block_q=case.block_q, block_k=case.block_k,
                              contractions=("matmul",))
    real_exp = tiled.osm._exp_nonpositive

    def inexact_alpha(x):  # update's exps: alpha of a vector of rows, the weights p of a (rows, cols) tile
        y = real_exp(x)
        return np.where(x < 0, y * (1 + tolerance.EXP_REL), y) if x.ndim == 1 else y

    bounds = [attention_bound(*inputs, causal=case.causal, counts=c)
              for c in (tiled_counts(case.n_k, case.block_k), dense_counts(case.n_k))]
    float64_out, float64_lse = bounds[0][0] + bounds[1][0], bounds[0][1] + bounds[1][1]
    for order in ("v1", "v2"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tiled.osm, "_exp_nonpositive", inexact_alpha)
            out, lse, _ = _run(case, order, inputs=inputs)
        assert_within(out, base.out, base.terms.online_out + float64_out, name=f"{order} out")
        assert_within(lse, base.lse, base.terms.online_lse + float64_lse, name=f"{order} lse")


@pytest.mark.lemma("L4")
@given(case=cases())
@with_hard_cases
def test_float64_spec_of_both_orders_equals_the_reference(case: Case):
    q, k, v = inputs = case.inputs()
    ref_out, ref_lse = reference.attention(q, k, v, causal=case.causal)
    for order in ("v1", "v2"):
        out, lse, _ = _run(case, order, inputs=inputs)
        _assert_float64_agrees(case, inputs, out, lse, ref_out, ref_lse, tiled_counts(case.n_k, case.block_k),
                               dense_counts(case.n_k))


@pytest.mark.lemma("L6")
@given(case=cases())
@with_hard_cases
# Found by random seeds before the rule had its score floor (v2, logits near 30: a near tie between two keys
# whose scores the tile's matmul rounds differently from the naive one) and its v1 term (many key tiles).
@example(case=Case(n_q=6, n_k=13, d=8, block_q=1, block_k=2, causal=False, group=2, logit=30.0, seed=107253))
@example(case=Case(n_q=9, n_k=8, d=8, block_q=2, block_k=6, causal=True, logit=30.0, seed=815162581))
@example(case=Case(n_q=3, n_k=4, d=1, block_q=1, block_k=1, causal=False, seed=0))
def test_float32_spec_of_both_orders_passes_the_tolerance_rule(case: Case):
    q, k, v = inputs = case.inputs(np.float32)
    base = tolerance.baseline(q, k, v, causal=case.causal, block_q=case.block_q, block_k=case.block_k)
    lses = {}
    for order in ("v1", "v2"):
        out, lses[order], _ = _run(case, order, np.float32, inputs=inputs)
        assert out.dtype == np.float32
        tolerance.judge(out, lses[order], base, name=f"tiled {order} float32", order=order)
    # The premise of v1's term: only O makes the round trip; l and m, hence LSE, are v2's to the bit.
    np.testing.assert_array_equal(lses["v1"], lses["v2"])


@pytest.mark.lemma("L6")
@given(case=cases())
@with_hard_cases
def test_v1_round_trip_term_bounds_float32_stores_of_o(case: Case):
    """Isolate the round trips: run v1 in float64 but store O in float32 between visits (as its HBM does).
    The error is then within v1's round-trip term, plus the final store's u |O|, plus float64 rounding
    (tests/bounds.py). Measured: the round trips use at most a quarter of their term (signs vary)."""
    q, k, v = inputs = case.inputs()
    base = tolerance.baseline(q, k, v, causal=case.causal, block_q=case.block_q, block_k=case.block_k,
                              contractions=("matmul",))
    real_encode = tiled._encode  # v1's HBM form of O, written after every visit

    def stores_o_in_float32(state):
        return real_encode(state).astype(np.float32).astype(np.float64)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiled, "_encode", stores_o_in_float32)
        out, _, _ = _run(case, "v1", inputs=inputs)
    float64 = sum(attention_bound(*inputs, causal=case.causal, counts=c)[0]
                  for c in (tiled_counts(case.n_k, case.block_k), dense_counts(case.n_k)))
    trips = base.terms.v1_out
    assert trips is not None
    # the final store rounds the computed O, which the round trips and float64 rounding moved off the exact one
    assert_within(out, base.out, trips + tolerance.U32 * (np.abs(base.out) + float64 + trips) + float64, name="out")


@pytest.mark.lemma("L4")
@given(case=cases())
@with_hard_cases
def test_v1_equals_v2(case: Case):
    inputs = case.inputs()
    out1, lse1, _ = _run(case, "v1", inputs=inputs)
    out2, lse2, _ = _run(case, "v2", inputs=inputs)
    counts = tiled_counts(case.n_k, case.block_k)
    _assert_float64_agrees(case, inputs, out1, lse1, out2, lse2, counts, counts)


@pytest.mark.lemma("L6")
def test_float16_inputs_are_checked_against_the_reference_of_the_same_inputs():
    case = Case(n_q=9, n_k=13, d=8, block_q=4, block_k=4, causal=True, seed=5)
    q, k, v = case.inputs(np.float16)
    for order in ("v1", "v2"):
        out, lse, _ = tiled.attention(q, k, v, order=order, block_q=4, block_k=4, causal=True, dtype=np.float32)
        tolerance.check_attention(out, lse, q, k, v, causal=True, name=f"tiled {order} from float16",
                                  order=order, block_q=4, block_k=4)


@pytest.mark.lemma("L4")
def test_a_broken_update_is_caught(monkeypatch):
    """The spec test can fail: forget to rescale the old accumulator and v2 no longer matches."""
    from fa_numba import online_softmax as osm

    def forgets_rescale(state, scores, values, visible=None):
        new = osm.State(*_correct_update(state, scores, values, visible))
        p = np.exp(scores - new.m[:, None])
        return osm.State(new.m, new.l, state.acc + p @ values)  # should be alpha * state.acc + p @ values

    _correct_update = osm.update
    case = Case(n_q=8, n_k=16, d=4, block_q=4, block_k=4, causal=False, seed=9, logit=5.0)
    q, k, v = inputs = case.inputs()
    ref_out, ref_lse = reference.attention(q, k, v)
    monkeypatch.setattr(osm, "update", forgets_rescale)
    out, lse, _ = _run(case, "v2", inputs=inputs)
    with pytest.raises(AssertionError, match="out: .* beyond the derived bound"):
        _assert_float64_agrees(case, inputs, out, lse, ref_out, ref_lse, tiled_counts(case.n_k, case.block_k),
                               dense_counts(case.n_k))


# --- masks beyond causal (proofs/L8) -----------------------------------------------------------------


def _run_mask(mc: MaskCase, order: str, dtype=np.float64, inputs=None, mask=None, skip=True):
    q, k, v = mc.case.inputs() if inputs is None else inputs
    return tiled.attention(q, k, v, order=order, block_q=mc.case.block_q, block_k=mc.case.block_k,
                           mask=mc.mask if mask is None else mask, dtype=dtype, skip=skip)


@pytest.mark.lemma("L8")
@given(mc=mask_cases())
@with_hard_mask_cases
def test_float64_spec_with_a_mask_equals_the_reference(mc: MaskCase):
    q, k, v = inputs = mc.case.inputs()
    ref_out, ref_lse = reference.attention(q, k, v, mask=mc.mask)
    dead = ~definition(mc.mask, mc.n_q, mc.n_k).any(axis=1)
    for order in ("v1", "v2"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # dead rows and masked scores must not warn
            out, lse, _ = _run_mask(mc, order, inputs=inputs)
        _assert_float64_agrees(mc.case, inputs, out, lse, ref_out, ref_lse, tiled_counts(mc.n_k, mc.case.block_k),
                               dense_counts(mc.n_k), mask=mc.mask)
        assert (out[..., dead, :] == 0).all() and np.isneginf(lse[..., dead]).all()  # decided by the mask


@pytest.mark.lemma("L8")
@given(mc=mask_cases())
@with_hard_mask_cases
def test_float32_spec_with_a_mask_passes_the_tolerance_rule(mc: MaskCase):
    """Logits up to 1e4 included: a mask changes which pairs are summed, not how a score rounds, and the score
    floor covers the near ties that made the 2x rule fail a correct spec on a few dozen entries (L6 part 4).
    Measured on 1500 random mask cases: the worst error was 0.51 of its tolerance."""
    q, k, v = inputs = mc.case.inputs(np.float32)
    base = tolerance.baseline(q, k, v, mask=mc.mask, block_q=mc.case.block_q, block_k=mc.case.block_k)
    for order in ("v1", "v2"):
        out, lse, _ = _run_mask(mc, order, np.float32, inputs=inputs)
        assert out.dtype == np.float32
        tolerance.judge(out, lse, base, name=f"tiled {order} float32", order=order)


@pytest.mark.lemma("L8")
@given(mc=mask_cases(max_n=14))
@with_hard_mask_cases
def test_builtins_equal_from_dense_in_the_spec_bitwise(mc: MaskCase):
    """A mask and from_dense of its definition classify alike and mask alike: the same bits and the same ledger."""
    dense = masks.from_dense(definition(mc.mask, mc.n_q, mc.n_k))
    inputs = mc.case.inputs()
    for order in ("v1", "v2"):
        for dtype in (np.float64, np.float32):
            *by_mask, ledger = _run_mask(mc, order, dtype, inputs=inputs)
            *by_dense, ledger_dense = _run_mask(mc, order, dtype, inputs=inputs, mask=dense)
            for a, b in zip(by_mask, by_dense):
                np.testing.assert_array_equal(a, b)
            assert ledger == ledger_dense


@pytest.mark.lemma("L8")
@given(case=cases())
@with_hard_cases
def test_causal_flag_equals_the_causal_mask_in_the_spec_bitwise(case: Case):
    inputs = case.inputs()
    for order in ("v1", "v2"):
        for dtype in (np.float64, np.float32):
            *by_flag, ledger_flag = tiled.attention(*inputs, order=order, block_q=case.block_q, block_k=case.block_k,
                                                    causal=True, dtype=dtype)
            *by_mask, ledger_mask = tiled.attention(*inputs, order=order, block_q=case.block_q, block_k=case.block_k,
                                                    mask=masks.causal(), dtype=dtype)
            for a, b in zip(by_flag, by_mask):
                np.testing.assert_array_equal(a, b)
            assert ledger_flag == ledger_mask


@pytest.mark.lemma("L8")
@given(mc=mask_cases(max_n=14))
@with_hard_mask_cases
def test_visiting_the_skip_tiles_of_a_mask_changes_only_the_ledger(mc: MaskCase):
    """skip=False folds the SKIP tiles with their all-false mask: v2's bits do not move (L8.5); v1 re-encodes
    O on each extra visit (O = acc / l, then acc = O l), exact in real arithmetic only (L3.3)."""
    inputs = mc.case.inputs()
    for order in ("v1", "v2"):
        out, lse, ledger = _run_mask(mc, order, inputs=inputs)
        out_all, lse_all, ledger_all = _run_mask(mc, order, inputs=inputs, skip=False)
        if order == "v2":
            np.testing.assert_array_equal(out, out_all)
            np.testing.assert_array_equal(lse, lse_all)
        else:
            counts = tiled_counts(mc.n_k, mc.case.block_k)
            _assert_float64_agrees(mc.case, inputs, out_all, lse_all, out, lse, counts, counts, mask=mc.mask)
        if (tiling.classify(*mc.tiles, mask=mc.mask) == tiling.SKIP).any():
            assert ledger != ledger_all


@pytest.mark.lemma("L8")
def test_the_spec_visits_exactly_the_listed_tiles(monkeypatch):
    """Every Q_i K_j^T the spec forms is a non-SKIP tile of the block mask, each once per head, and PARTIAL
    tiles alone get a mask (FULL tiles are folded with visible=None)."""
    from fa_numba import online_softmax as osm

    mask = masks.documents([3, 1, 4, 1, 5], causal=True)
    case = Case(n_q=14, n_k=14, d=3, block_q=4, block_k=3, causal=False, seed=1)
    bm = tiling.block_mask(14, 14, 4, 3, mask)
    folded = []
    real_update = osm.update

    def recording(state, scores, values, visible=None):
        folded.append((scores.shape, visible is None))
        return real_update(state, scores, values, visible)

    monkeypatch.setattr(osm, "update", recording)
    grid = bm.grid
    for order in ("v1", "v2"):
        folded.clear()
        _run_mask(MaskCase(case, mask), order)
        sched = tiling.schedule(order, 14, 14, 4, 3, mask=mask)
        expected = [((len(range(*grid.rows(i))), len(range(*grid.cols(j)))), kind == tiling.FULL)
                    for i, j, kind in sched.visits]
        assert folded == expected and len(folded) == bm.nnz
        assert sum(not full for _, full in folded) == bm.count(tiling.PARTIAL)
