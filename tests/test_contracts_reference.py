"""Contracts of the definition and the tolerance rule (fa_numba.reference) that no other test states: its
public helpers (visible_matmul and its contraction orders, max_error, assert_close), what it does with a
mask object that breaks the mask protocol, a problem with no finite reference entry, and the agreement
of the backward definition with the spec on infinite inputs."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bounds import assert_within, dot_bound, input_rel, restated_bound
from float64_bounds import float64_atols, magnitudes
from fa_numba import reference, tiled, tolerance, tolerance_backward
from strategies import Case

# --- visible_matmul: sum_j p_ij v_j over the visible pairs, non-finite values included ----------------


def _loop_sum(p, v, visible):
    """The sum entry by entry in Python floats (IEEE: 0 * inf = NaN, inf - inf = NaN), visible pairs only."""
    out = np.zeros(p.shape[:-1] + v.shape[-1:])
    for idx in np.ndindex(out.shape):
        *lead, i, x = idx
        lead = tuple(lead)
        total = 0.0
        for j in range(p.shape[-1]):
            if visible[i, j]:
                total += float(p[lead + (i, j)]) * float(v[lead + (j, x)])
        out[idx] = total
    return out


# visible_matmul computes p_ij * v_jx on masked pairs too before discarding them, so 0 * inf warns there
# (the result is right; the warning is noise, reported with the mutation run of issue 14).
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@given(seed=st.integers(0, 2**32 - 1), poison=st.sampled_from([np.nan, np.inf, -np.inf]),
       masked=st.booleans(), contraction=st.sampled_from(reference.CONTRACTIONS))
def test_visible_matmul_sums_over_the_visible_pairs_with_nonfinite_values(seed, poison, masked, contraction):
    """Batched (B, H, rows, keys) x (B, H, keys, d): a NaN or +-inf value entry reaches exactly the rows that
    see its key, with its sign (p > 0), and no masked row; visible=None means every pair is visible.
    p is 0 on masked pairs, as every caller's is (the mask zeroes P and dS first)."""
    rng = np.random.default_rng(seed)
    b, h, rows, keys, d = 2, 2, 3, 4, 2
    visible = rng.random((rows, keys)) < 0.6 if masked else np.ones((rows, keys), dtype=bool)
    p = np.where(visible, rng.random((b, h, rows, keys)) + 0.1, 0.0)
    v = rng.standard_normal((b, h, keys, d))
    for _ in range(2):
        v[tuple(rng.integers(0, n) for n in v.shape)] = poison
    got = reference.visible_matmul(p, v, visible if masked else None, contraction)
    expected = _loop_sum(p, v, visible)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(expected))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    # Two float64 sums of `keys` products in other orders (the contraction's, Python's loop): each within
    # gamma(keys) sum_j |p_ij v_jx| of the exact sum (tests/bounds.py); a finite entry sees no poisoned value.
    magnitude = np.abs(p) @ np.abs(np.where(np.isfinite(v), v, 0.0))
    assert_within(got[finite], expected[finite], 2 * dot_bound(magnitude, keys)[finite], name="sum")


def test_each_contraction_is_the_summation_order_it_names():
    """"matmul" is BLAS (np.matmul), "loop" adds one rounded product per key in index order, "loop_reversed"
    in the reverse order, "pairwise" in a balanced tree, "fma" rounds once per step (product and sum fused):
    bit for bit, so the tolerance rule's baselines are five real orders."""
    rng = np.random.default_rng(3)
    p = rng.random((2, 5, 40)).astype(np.float32)
    v = rng.standard_normal((2, 40, 3)).astype(np.float32)

    def ordered(keys):
        total = np.zeros((2, 5, 3), dtype=np.float32)
        for j in keys:
            total += p[..., j, None] * v[..., j, None, :]
        return total

    def tree(lo, hi):
        if hi - lo == 1:
            return p[..., lo, None] * v[..., lo, None, :]
        mid = (lo + hi) // 2
        return tree(lo, mid) + tree(mid, hi)

    def fused():
        total = np.zeros((2, 5, 3), dtype=np.float32)
        for j in range(40):  # the float64 product of two float32 numbers is exact: one rounding per step
            total = (p[..., j, None].astype(np.float64) * v[..., j, None, :] + total).astype(np.float32)
        return total

    expected = {"matmul": np.matmul(p, v), "loop": ordered(range(40)), "loop_reversed": ordered(reversed(range(40))),
                "pairwise": tree(0, 40), "fma": fused()}
    assert set(expected) == set(reference.CONTRACTIONS)
    for c in reference.CONTRACTIONS:
        np.testing.assert_array_equal(reference.visible_matmul(p, v, contraction=c), expected[c], err_msg=c)
    orders = ("loop", "loop_reversed", "pairwise", "fma")
    distinct = {expected[c].tobytes() for c in orders}
    assert len(distinct) == len(orders)  # the orders really differ here
    assert not np.array_equal(expected["loop"], expected["matmul"])


# --- a mask object that breaks the protocol -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _BadDense:
    """A mask with every method of the protocol whose dense() gives the wrong dtype or the wrong shape."""

    dtype: str
    shape_offset: int = 0

    def check(self, n_q, n_k):
        pass

    def dense(self, n_q, n_k):
        return np.ones((n_q, n_k + self.shape_offset), dtype=self.dtype)

    def classify_tile(self, *args):
        return 1

    def row_intervals(self, n_q, n_k):
        return None

    def kernel_form(self):
        return "dense"


@pytest.mark.parametrize("mask, got", [(_BadDense("uint8"), r"got uint8 \(3, 4\)"),
                                       (_BadDense("bool", 1), r"got bool \(3, 5\)")], ids=["uint8", "wrong shape"])
def test_a_mask_whose_dense_form_is_not_a_bool_array_of_the_sizes_is_refused(mask, got):
    q, k, v = Case(3, 4, 2, 1, 1, False).inputs()
    with pytest.raises(TypeError, match=r"dense\(3, 4\) must give an \(3, 4\) bool array, " + got):
        reference.attention(q, k, v, mask=mask)


# --- max_error, assert_close, the baselines ---------------------------------------------------------------


def test_max_error_reads_finite_reference_entries_and_a_nan_there_is_an_infinite_error():
    assert tolerance.max_error(np.array([5.0, np.nan]), np.array([-np.inf, np.nan])) == 0.0  # nothing finite
    assert tolerance.max_error(np.array([1.5, 7.0]), np.array([1.0, -np.inf])) == 0.5
    # A NaN or inf where the reference is finite is an infinite error (never NaN, which no `<=` rejects).
    assert tolerance.max_error(np.array([1.0, np.nan]), np.array([1.0, 2.0])) == np.inf
    assert tolerance.max_error(np.array([np.inf, 2.5]), np.array([1.0, 2.0])) == np.inf


def test_a_problem_with_no_finite_reference_entry_is_allowed_no_error():
    """All-NaN inputs: the reference is NaN everywhere, so the rules allow nothing (every atol is 0) and
    only the same NaNs pass."""
    q, k, v = Case(3, 4, 2, 1, 1, True).inputs()
    q = np.full_like(q, np.nan)
    base = tolerance.baseline(q, k, v)
    assert (base.atol_out, base.atol_lse) == (0.0, 0.0) and np.isnan(base.out).all()
    tolerance.judge(base.out.copy(), base.lse.copy(), base)
    with pytest.raises(AssertionError, match="non-finite mismatch"):
        tolerance.judge(np.zeros_like(base.out), base.lse, base)
    dout = np.ones_like(q)
    back = tolerance_backward.baseline_backward(q, k, v, dout)
    assert (back.atol_dq, back.atol_dk, back.atol_dv) == (0.0, 0.0, 0.0)


def test_assert_close_sits_on_its_bound_and_counts_each_entry_once():
    # |actual - expected| <= atol: an error of exactly atol passes (0.5 is exact in binary).
    assert tolerance.assert_close(np.array([1.5, 2.0]), np.array([1.0, 2.0]), 0.5) == 0.5
    with pytest.raises(AssertionError, match="1 entries beyond atol"):
        tolerance.assert_close(np.array([1.5, 2.0]), np.array([1.0, 2.0]), 0.25)
    # A finite value where the reference is -inf is a non-finite mismatch, and only that.
    with pytest.raises(AssertionError) as info:
        tolerance.assert_close(np.array([1.0, 0.0]), np.array([1.0, -np.inf]), 1e9)
    assert "1 entries non-finite mismatch" in str(info.value) and "beyond atol" not in str(info.value)


def test_assert_close_reports_how_many_fail_and_shows_only_the_first_five():
    """A failure on a large tensor stays readable: the count of bad entries and five of them."""
    expected = np.zeros(100)
    actual = np.where(np.arange(100) % 10 == 3, 1.0, 0.0)  # entries 3, 13, ..., 93 are off by 1
    with pytest.raises(AssertionError) as info:
        tolerance.assert_close(actual, expected, 0.5, name="big")
    message = str(info.value)
    assert message.startswith("big: max error 1.000e+00 vs atol 5.000e-01; 10 entries beyond atol (first: (3,)")
    assert message.count("got ") == 5 and "(43,)" in message and "(53,)" not in message


@pytest.mark.parametrize("make", [
    lambda q, k, v, dout: tolerance.baseline(q, k, v),
    lambda q, k, v, dout: tolerance.baseline(q, k, v, block_q=1, block_k=1).terms,
    lambda q, k, v, dout: tolerance.check_attention(*reference.attention(q, k, v), q, k, v),
    lambda q, k, v, dout: tolerance_backward.baseline_backward(q, k, v, dout),
    lambda q, k, v, dout: tolerance_backward.check_attention_backward(*reference.attention_backward(q, k, v, dout),
                                                                      q, k, v, dout),
    lambda q, k, v, dout: reference.dense(q, k, v),
    lambda q, k, v, dout: reference.dense_backward(q, k, v, dout),
], ids=["Baseline", "Terms", "Check", "BaselineBackward", "CheckBackward", "Dense", "DenseBackward"])
def test_baselines_and_checks_are_immutable(make):
    """A baseline is computed once and shared by every implementation judged against it: none can change it
    (nor the reference's records of what it materialises, which the baselines are built from)."""
    case = Case(3, 4, 2, 1, 1, True)
    result = make(*case.inputs(), case.grad_output())
    name = dataclasses.fields(result)[-1].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(result, name, 1.0)


# --- the backward definition and the spec on infinite inputs ------------------------------------------------


def test_a_query_whose_scores_are_all_minus_inf_gets_the_same_gradients_from_the_definition_and_the_spec():
    """q_2 = -inf against positive keys: S_2j = -inf for every key, so O_2 = 0/0 = NaN and LSE_2 = -inf.
    Its P = exp(S - sigma(LSE)) is exactly 0 (sigma(-inf) = 0), so it adds nothing to dV; its D = dO . O is
    NaN, so dQ_2 and (through dS) dK are NaN. The spec in every order gives the same entries, NaN included."""
    rng = np.random.default_rng(1)
    q, k, v, dout = rng.standard_normal((4, 1)), np.abs(rng.standard_normal((5, 1))) + 0.5, \
        rng.standard_normal((5, 1)), rng.standard_normal((4, 1))
    q[2, 0] = -np.inf
    out, lse = reference.attention(q, k, v)
    assert np.isnan(out[2]).all() and lse[2] == -np.inf and np.isfinite(lse[[0, 1, 3]]).all()
    dq, dk, dv = reference.attention_backward(q, k, v, dout)
    assert np.isnan(dq[2]).all() and np.isfinite(dq[[0, 1, 3]]).all()
    assert np.isnan(dk).all() and np.isfinite(dv).all()
    # The finite entries (dq of rows 0, 1, 3 and dv; row 2's P is exactly 0, so its terms are exact zeros) are
    # those of the problem without row 2: two float64 evaluations from the same O and LSE, within the
    # first-order bound 2 u kappa max G of that problem (tests/float64_bounds.py, proofs/L7).
    rows = [0, 1, 3]
    atols = float64_atols(magnitudes(q[rows], k, v, dout[rows], False))
    for order, deterministic in (("kv", False), ("kv", True), ("q", False)):
        grads = tiled.attention_backward(q, k, v, out, lse, dout, order=order, block_q=2, block_k=2,
                                         deterministic=deterministic)[:3]
        for g, r, atol in zip(grads, (dq, dk, dv), atols):
            np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
            assert_within(g[~np.isnan(g)], r[~np.isnan(r)], atol, name=f"{order} {deterministic}")


# --- the derived terms' building blocks ---------------------------------------------------------------


def test_gamma_is_highams_bound_and_refuses_n_u_of_one_or_more():
    """gamma_n = n u / (1 - n u) bounds |prod_{k<=n} (1 + d_k) - 1| for |d_k| <= u (Higham, Lemma 3.1); it is
    defined for 0 <= n u < 1 and refuses anything else by name."""
    from fractions import Fraction

    assert tolerance.gamma(0) == 0.0
    assert tolerance.gamma(1, 0.25) == 0.25 / 0.75 and tolerance.gamma(3, 0.25) == 3.0
    assert tolerance.gamma(2) == 2 * tolerance.U32 / (1 - 2 * tolerance.U32) == tolerance.ROUND_TRIP
    u = Fraction(1, 2**10)
    for n in (1, 2, 7, 100, 1000):
        worst = max(abs((1 + u) ** n - 1), abs((1 - u) ** n - 1))  # the extreme products, exactly
        assert worst <= tolerance.gamma(n, float(u))
    for n, unit in ((-1, tolerance.U32), (4, 0.25), (5, 0.25), (2**24, tolerance.U32)):
        with pytest.raises(ValueError, match="gamma needs 0 <= n u < 1"):
            tolerance.gamma(n, unit)


def _one_row(scores, values):
    """One query row, d = 1, scale 1, one key per tile: S_j = scores[j] exactly (float32 inputs, exact)."""
    q = np.ones((1, 1), dtype=np.float32)
    k = np.asarray(scores, dtype=np.float32)[:, None]
    v = np.asarray(values, dtype=np.float32)[:, None]
    assert (k[:, 0].astype(np.float64) == np.asarray(scores)).all()
    base = tolerance.baseline(q, k, v, scale=1.0, block_q=1, block_k=1)
    s = np.asarray(scores, dtype=np.float64)
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    return base.terms, p, float(p @ np.asarray(values, dtype=np.float64))


def _restated_abs(magnitude, scores, values, degree):
    """pytest.approx abs for a rescaling term against its restatement (tests/bounds.py, restated_bound): both
    from the exact scores, each side's P and O within input_rel; e = EXP_REL + u + u shift (two roundings), its
    products with the partial sums and masses and their sums, the compound factor: at most 10 roundings a term."""
    values = np.asarray(values, dtype=np.float64)[:, None]
    return float(restated_bound(magnitude, input_rel(np.asarray(scores, dtype=np.float64), values), degree, 10))


U = tolerance.U32


@pytest.mark.parametrize("first, second, counted", [
    (1.0, 1.0, True),  # a tie: the float32 max may be either score
    (0.0, 0.0, True),  # a tie where the allowance for the scores' rounding is 0: counted by the tie alone
    (1.0, 1 - 3 * U, True),  # within 2u (|m| + |tile max|) ~ 4u of the running max: float32 may order them either way
    (1.0, 1 - 5 * U, False),  # beyond it: the float32 max cannot rise
    (1.0, 0.5, False),
    (1.0, 1 + 2.0**-10, True),  # a real rise, shift 2^-10
])
def test_the_rescaling_term_counts_a_tile_that_may_raise_the_float32_max(first, second, counted):
    """Proofs/L6, part 6, on one row of two one-key tiles: the first tile starts the state (mass 0, nothing
    to rescale); the second rescales acc and l iff its score may be the new float32 max, by alpha with a
    relative error e = EXP_REL + u + u |shift|, moving O by e (|Pi| + |O| mass) and LSE by e mass."""
    terms, p, o = _one_row([first, second], [1.0, -2.0])
    if not counted:
        assert terms.online_out == 0.0 and terms.online_lse == 0.0
        return
    e = tolerance.EXP_REL + U + U * max(second - first, 0.0)
    values = np.array([1.0, -2.0])
    o_abs = float(p @ np.abs(values))  # the magnitude of O
    assert terms.online_out == pytest.approx(e * p[0] * (1.0 + abs(o)), rel=0,
                                             abs=_restated_abs(e * p[0] * (1.0 + o_abs), [first, second], values, 2))
    assert terms.online_lse == pytest.approx(e * p[0], rel=0, abs=_restated_abs(e * p[0], [first, second], values, 1))


def test_the_tolerance_adds_no_score_floor_unless_given():
    """tolerance(expected, naive) = 2 err(naive) + rounding_floor(expected), the score floor only when passed."""
    expected = np.array([1.0, -2.0, 0.5])
    naive = [expected + np.array([2.0**-20, 0.0, 0.0]), expected - np.array([0.0, 2.0**-18, 0.0])]  # exact errors
    atol = tolerance.tolerance(expected, naive)
    assert atol == 2 * 2.0**-18 + tolerance.rounding_floor(expected)
    assert tolerance.tolerance(expected, naive, 2.0**-10) == atol + 2.0**-10


def test_rescalings_compound_with_the_largest_shift_a_row_makes():
    """Two rises of 2^-10 each: the terms add over the rescalings, and the second-order factor
    (1 + EXP_REL + 2u + u max shift)^(rescalings - 1) uses the largest shift actually made."""
    shift = 2.0**-10
    values = [1.0, -2.0, 0.5]
    terms, p, o = _one_row([1.0, 1.0 + shift, 1.0 + 2 * shift], values)
    e = tolerance.EXP_REL + U + U * shift
    partial_1, partial_2 = p[0] * values[0], p[0] * values[0] + p[1] * values[1]
    mass_1, mass_2 = p[0], p[0] + p[1]
    compound = 1 + tolerance.EXP_REL + 2 * U + U * shift
    # magnitudes: |partial| -> the sum of its terms' |P_j V_j|, |O| -> sum_j P_j |V_j| (partial_1 has one term)
    bar_2, o_abs = p[0] * abs(values[0]) + p[1] * abs(values[1]), float(p @ np.abs(values))
    magnitude = compound * (e * (abs(partial_1) + bar_2) + o_abs * e * (mass_1 + mass_2))
    scores = [1.0, 1.0 + shift, 1.0 + 2 * shift]
    assert terms.online_out == pytest.approx(
        compound * (e * (abs(partial_1) + abs(partial_2)) + abs(o) * e * (mass_1 + mass_2)), rel=0,
        abs=_restated_abs(magnitude, scores, values, 2))
    assert terms.online_lse == pytest.approx(compound * e * (mass_1 + mass_2), rel=0,
                                             abs=_restated_abs(compound * e * (mass_1 + mass_2), scores, values, 1))
