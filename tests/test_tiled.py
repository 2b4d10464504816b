"""The executable spec: both loop orders reproduce the reference (proofs/L4_loop_interchange.md)."""

import numpy as np
import pytest
from hypothesis import given

from fa_numba import reference, tiled
from strategies import Case, cases, with_hard_cases


def _run(case: Case, order: str, dtype=np.float64, inputs=None):
    q, k, v = case.inputs() if inputs is None else inputs
    return tiled.attention(q, k, v, order=order, block_q=case.block_q, block_k=case.block_k,
                           causal=case.causal, dtype=dtype)


def _assert_float64_agrees(out, lse, ref_out, ref_lse):
    """float64 spec vs float64 reference: only reordering of float64 sums, so ~1e-12 relative."""
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    assert np.isfinite(out).all()
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(out, ref_out, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-12, atol=1e-12)


@pytest.mark.lemma("L4")
@given(case=cases())
@with_hard_cases
def test_float64_spec_of_both_orders_equals_the_reference(case: Case):
    q, k, v = inputs = case.inputs()
    ref_out, ref_lse = reference.attention(q, k, v, causal=case.causal)
    for order in ("v1", "v2"):
        out, lse, _ = _run(case, order, inputs=inputs)
        _assert_float64_agrees(out, lse, ref_out, ref_lse)


@pytest.mark.lemma("L6")
@given(case=cases())
@with_hard_cases
def test_float32_spec_of_both_orders_passes_the_tolerance_rule(case: Case):
    q, k, v = inputs = case.inputs(np.float32)
    for order in ("v1", "v2"):
        out, lse, _ = _run(case, order, np.float32, inputs=inputs)
        assert out.dtype == np.float32
        reference.check_attention(out, lse, q, k, v, causal=case.causal, name=f"tiled {order} float32")


@pytest.mark.lemma("L4")
@given(case=cases())
@with_hard_cases
def test_v1_equals_v2(case: Case):
    inputs = case.inputs()
    out1, lse1, _ = _run(case, "v1", inputs=inputs)
    out2, lse2, _ = _run(case, "v2", inputs=inputs)
    _assert_float64_agrees(out1, lse1, out2, lse2)


@pytest.mark.lemma("L6")
def test_float16_inputs_are_checked_against_the_reference_of_the_same_inputs():
    case = Case(n_q=9, n_k=13, d=8, block_q=4, block_k=4, causal=True, seed=5)
    q, k, v = case.inputs(np.float16)
    for order in ("v1", "v2"):
        out, lse, _ = tiled.attention(q, k, v, order=order, block_q=4, block_k=4, causal=True, dtype=np.float32)
        reference.check_attention(out, lse, q, k, v, causal=True, name=f"tiled {order} from float16")


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
    with pytest.raises(AssertionError):
        _assert_float64_agrees(out, lse, ref_out, ref_lse)
