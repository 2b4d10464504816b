"""The float64 definition and the derived tolerance rule."""

import warnings

import numpy as np
import pytest
from hypothesis import given
from scipy.special import softmax

from bounds import U64, assert_within, attention_bound, dense_counts, gamma, input_rel, restated_bound
from fa_numba import reference, tiling, tolerance
from strategies import Case, cases, with_hard_cases
from test_masks import explicit_attention


def _explicit(q, k, v, causal, scale=None):
    """Per-row loops over an explicitly built causal mask with scipy's softmax: an independent definition,
    evaluated densely (one exp per key, a normalising division, a dot product); tests/test_masks.py's
    `explicit_attention` for any visible matrix."""
    n_q, n_k = q.shape[2], k.shape[2]
    visible = np.array([[not causal or j <= i + n_k - n_q for j in range(n_k)] for i in range(n_q)], dtype=bool)
    return explicit_attention(q, k, v, visible, scale)


@pytest.mark.lemma("L3")
@given(case=cases(max_n=10, max_d=5))
@with_hard_cases
def test_reference_matches_explicit_mask_and_scipy(case: Case):
    q, k, v = case.inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fully masked rows must not warn
        out, lse = reference.attention(q, k, v, causal=case.causal)
    exp_out, exp_lse = _explicit(q, k, v, case.causal)
    assert np.isfinite(out).all()
    # Both are dense float64 evaluations: each within its derived bound (tests/bounds.py) of the exact value.
    bound_out, bound_lse = (2 * b for b in attention_bound(q, k, v, causal=case.causal, counts=dense_counts(case.n_k)))
    assert_within(out, exp_out, bound_out, name="out")
    assert_within(lse, exp_lse, bound_lse, name="lse")


def test_causal_is_bottom_right_aligned():
    mask = reference.causal_mask(2, 4)
    # delta = 2: query 0 sees keys 0..2, query 1 sees all four.
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    mask = reference.causal_mask(4, 2)
    # delta = -2: queries 0 and 1 see nothing, query 2 sees key 0, query 3 sees keys 0 and 1.
    assert mask.tolist() == [[False, False], [False, False], [True, False], [True, True]]
    assert (reference.causal_mask(5, 5) == np.tril(np.ones((5, 5), dtype=bool))).all()


@pytest.mark.lemma("L3")
def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = Case(n_q=6, n_k=2, d=3, block_q=1, block_k=1, causal=True).inputs()
    out, lse = reference.attention(q, k, v, causal=True)
    assert (out[0, 0, :4] == 0).all() and np.isneginf(lse[0, 0, :4]).all()
    assert np.isfinite(lse[0, 0, 4:]).all()


def test_layouts_agree():
    q, k, v = Case(n_q=5, n_k=7, d=3, block_q=1, block_k=1, causal=True).inputs()
    out4, lse4 = reference.attention(q, k, v, causal=True)
    out3, lse3 = reference.attention(q[0], k[0], v[0], causal=True)
    out2, lse2 = reference.attention(q[0, 0], k[0, 0], v[0, 0], causal=True)
    assert out3.shape == (1, 5, 3) and lse3.shape == (1, 5)
    assert out2.shape == (5, 3) and lse2.shape == (5,)
    np.testing.assert_array_equal(out4[0], out3)
    np.testing.assert_array_equal(out4[0, 0], out2)
    np.testing.assert_array_equal(lse4[0, 0], lse2)


def test_gqa_equals_repeated_heads():
    q, k, v = Case(n_q=4, n_k=6, d=2, block_q=1, block_k=1, causal=False, heads_kv=2, group=3).inputs()
    out, lse = reference.attention(q, k, v)
    out_rep, lse_rep = reference.attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))
    np.testing.assert_array_equal(out, out_rep)
    np.testing.assert_array_equal(lse, lse_rep)
    # Query head 4 reads K/V head 4 // 3 = 1, not head 0.
    solo, _ = reference.attention(q[:, 4], k[:, 1], v[:, 1])
    np.testing.assert_array_equal(out[:, 4], solo)


def test_scale_is_applied_and_defaults_to_inverse_sqrt_d():
    q, k, v = Case(n_q=3, n_k=4, d=4, block_q=1, block_k=1, causal=False).inputs()
    default, _ = reference.attention(q, k, v)
    explicit, _ = reference.attention(q, k, v, scale=0.5)
    np.testing.assert_array_equal(default, explicit)  # 1/sqrt(4) = 0.5 exactly
    _, lse = reference.attention(q, k, v, scale=0.0)
    # uniform weights over 4 keys, exactly: S = 0, m = 0, l = 1 + 1 + 1 + 1 = 4, LSE = 0 + log(4)
    np.testing.assert_array_equal(lse, np.log(4.0))


def test_huge_logits_stay_finite():
    q, k, v = Case(n_q=4, n_k=4, d=2, block_q=1, block_k=1, causal=False, logit=1e6).inputs()
    for fn in (reference.attention, reference.attention_naive_f32):
        out, lse = fn(q, k, v)
        assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_naive_f32_computes_in_float32():
    q, k, v = Case(n_q=5, n_k=5, d=3, block_q=1, block_k=1, causal=False).inputs()
    out, lse = reference.attention_naive_f32(q, k, v)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    ref, _ = reference.attention(q, k, v)
    err = tolerance.max_error(out, ref)
    assert 0 < err < 1e-5  # rounded, but only at float32 precision


# --- the tolerance rule and assert_close ------------------------------------------------------------


@pytest.mark.lemma("L6")
def test_rounding_floor_is_float32_step_at_the_data_magnitude():
    assert tolerance.rounding_floor(np.array([0.0])) == float(np.spacing(np.float32(0.3)))
    # The bound is never below the DESIGN.md sample formula 2 max |fl32(ref + 0.3) - 0.3 - ref|.
    sample = np.random.default_rng(0).standard_normal(1000)
    realised = 2 * np.max(np.abs((sample + 0.3).astype(np.float32).astype(np.float64) - 0.3 - sample))
    assert realised <= tolerance.rounding_floor(sample) <= 2.5 * realised  # top values sit one binade up
    big = tolerance.rounding_floor(np.array([1e4]))
    assert 1e-4 < big < 2e-3  # float32 spacing near 1e4 is 2**-10 ~ 1e-3
    assert tolerance.rounding_floor(np.array([-np.inf])) == 0.0


def test_assert_close_accepts_within_and_rejects_beyond_atol():
    expected = np.array([1.0, 2.0, -np.inf])
    # the error is fl(1 + 1e-7) - 1, exact (Sterbenz), and fl(1 + 1e-7) is within half an ulp of [1, 2), U64
    assert tolerance.assert_close(np.array([1.0 + 1e-7, 2.0, -np.inf]), expected, 1e-6) == pytest.approx(
        1e-7, rel=0, abs=U64)
    with pytest.raises(AssertionError, match=r"1 entries beyond atol \(first: \(1,\)"):
        tolerance.assert_close(np.array([1.0, 2.1, -np.inf]), expected, 1e-6, name="x")


@pytest.mark.lemma("L6")
@pytest.mark.parametrize(
    "actual, what",
    [
        ([np.nan, 2.0, -np.inf], "non-finite mismatch"),  # NaN where the reference is finite
        ([1.0, 2.0, np.nan], "non-finite mismatch"),  # NaN where the reference is -inf
        ([1.0, 2.0, 0.0], "non-finite mismatch"),  # a finite value on an empty row
        ([1.0, np.inf, -np.inf], "non-finite mismatch"),
        ([1.0, 3.5, -np.inf], "beyond atol"),
    ],
)
def test_assert_close_never_lets_nonfinite_pass(actual, what):
    with pytest.raises(AssertionError, match=what):
        tolerance.assert_close(np.array(actual), np.array([1.0, 2.0, -np.inf]), atol=1.0)


def test_assert_close_rejects_shape_mismatch():
    with pytest.raises(AssertionError, match="shape"):
        tolerance.assert_close(np.zeros(3), np.zeros(4), 1.0)


def _rows(q, k, v, causal):
    """Per (b, h, row): (scores, P, V, O) of the visible keys, by explicit loops (float64). The scores are the
    reference's own S (the rule's terms are functions of S, P and O, and S is checked against scipy above), so
    that both sides decide alike which tiles may raise the row max; P (scipy) and O are this loop's."""
    b_, h_, n_q, d = q.shape
    n_k, group = k.shape[2], h_ // k.shape[1]
    scores = reference.dense(q, k, v, causal=causal).s
    for b in range(b_):
        for h in range(h_):
            for i in range(n_q):
                keys = [j for j in range(n_k) if not causal or j <= i + n_k - n_q]
                s = scores[b, h, i, keys]
                p = softmax(s) if keys else s
                yield (b, h, i), keys, s, p, v[b, h // group][keys], p @ v[b, h // group][keys]


def _rows_rel(q, k, v, causal):
    """input_rel over every row (tests/bounds.py): how far this file's P and O and the rule's may each be from
    the exact ones of the reference's S, relative to their magnitudes."""
    return max((input_rel(s, v_rows) for _, keys, s, _, v_rows, _ in _rows(q, k, v, causal) if keys), default=0.0)


@pytest.mark.lemma("L6")
def test_tolerance_is_the_documented_rule():
    """atol = 2 * max over contraction orders of max |naive - ref| + ulp32(max |ref| + 0.3) + score floor, for
    both tiled orders the rescaling terms, and for v1 also the round-trip term, each restated here by explicit
    loops (proofs/L6, parts 2 to 4 and 6)."""
    case = Case(n_q=7, n_k=9, d=5, block_q=3, block_k=2, causal=True, logit=3.0, seed=6, group=2)
    q, k, v = case.inputs()
    ref_out, ref_lse = reference.attention(q, k, v, causal=True)
    naive = [reference.attention_naive_f32(q, k, v, causal=True, contraction=c) for c in reference.CONTRACTIONS]
    # Score floor: W_j = P_j u |S_j| per row; what one float32 rounding of every score moves O and LSE by.
    # Beside each restated term its magnitude (|O| -> sum_j P_j |V_j|, |a partial sum| -> the sum of its terms'
    # absolute values): the two float64 evaluations of a term (the rule's, this one) differ by at most
    # restated_bound(magnitude) (tests/bounds.py: P and O within rel of their magnitudes, own roundings), and the
    # naive errors and ulp floors are the same operations on the same arrays on both sides (exactly equal).
    rel = _rows_rel(q, k, v, causal=True)
    n_k, t_c = case.n_k, -(-case.n_k // case.block_k)
    score_out = score_lse = score_bar = 0.0
    for _, keys, s_row, p, v_rows, o in _rows(q, k, v, causal=True):
        w = p * 2.0**-24 * np.abs(s_row)
        score_out = max(score_out, float((w @ np.abs(v_rows) + np.abs(o) * w.sum()).max(initial=0)))
        score_lse = max(score_lse, float(w.sum()))
        score_bar = max(score_bar, float((w @ np.abs(v_rows) + (p @ np.abs(v_rows)) * w.sum()).max(initial=0)))
    expected_out = (2 * max(np.abs(n[0] - ref_out).max() for n in naive)
                    + np.spacing(np.float32(np.abs(ref_out).max() + 0.3)) + score_out)
    finite = np.isfinite(ref_lse)
    expected_lse = (2 * max(np.abs(n[1][finite] - ref_lse[finite]).max() for n in naive)
                    + np.spacing(np.float32(np.abs(ref_lse[finite]).max() + 0.3)) + score_lse)
    # the score terms (P |S| |V| + |O| P |S|: degree 2, n_k + 3 roundings a term) and the three-term sums' two
    abs_out = float(restated_bound(score_bar, rel, 2, n_k + 3)) + 2 * float(gamma(2)) * expected_out
    abs_lse = float(restated_bound(score_lse, rel, 1, n_k + 3)) + 2 * float(gamma(2)) * expected_lse
    check = tolerance.check_attention(*naive[0], q, k, v, causal=True)
    assert check.atol_out == pytest.approx(expected_out, rel=0, abs=abs_out)
    assert check.atol_lse == pytest.approx(expected_lse, rel=0, abs=abs_lse)
    assert len({float(np.abs(n[0] - ref_out).max()) for n in naive}) > 1  # the orders really differ
    assert score_out > 0 and score_lse > 0
    # v1: a round trip after every visited key tile but the last, each perturbing the partial output so far by
    # at most gamma_2 relative; the visits are read off the v1 schedule itself.
    sched = tiling.schedule("v1", case.n_q, case.n_k, case.block_q, case.block_k, True)
    visited = {i: sorted(j for i_, j, _ in sched.visits if i_ == i) for i in range(sched.grid.t_r)}
    sums, trips, sums_bar = 0.0, 0, 0.0
    for (b, h, i), keys, _, p, v_rows, _ in _rows(q, k, v, causal=True):
        tiles = visited[i // case.block_q]
        trips = max(trips, len(tiles) - 1)
        total = sum(np.abs(sum((p[n] * v_rows[n] for n, j in enumerate(keys) if j < sched.grid.cols(t)[1]),
                               np.zeros(case.d))) for t in tiles[:-1])
        sums = max(sums, float(np.max(total, initial=0)))
        bar = sum(sum((p[n] * np.abs(v_rows[n]) for n, j in enumerate(keys) if j < sched.grid.cols(t)[1]),
                      np.zeros(case.d)) for t in tiles[:-1])
        sums_bar = max(sums_bar, float(np.max(bar, initial=0)))
    # Both orders: a rescaling of (acc, l) by alpha = exp(m_old - m_new) when a visited tile may raise the row
    # max (its max within 2u (|m_old| + |tile max|) of m_old or above), off by e = 3 ulps of exp + u (the
    # product) + u |m_new - m_old| (the difference): O moves by e (|Pi| + |O| mass), LSE by e mass.
    u, exp_rel = 2.0**-24, 3 * 2.0**-23
    online_out = online_lse = max_shift = online_bar = 0.0
    rescales = 0
    for (b, h, i), keys, s_row, p, v_rows, o in _rows(q, k, v, causal=True):
        m, mass, partial, r_out, r_mass, r_lse, count = -np.inf, 0.0, np.zeros(case.d), np.zeros(case.d), 0.0, 0.0, 0
        partial_bar, r_bar = np.zeros(case.d), np.zeros(case.d)
        for t in visited[i // case.block_q]:
            c0, c1 = sched.grid.cols(t)
            in_tile = [n for n, j in enumerate(keys) if c0 <= j < c1]
            tile_max = max((s_row[n] for n in in_tile), default=-np.inf)
            near = 2 * u * ((abs(m) if np.isfinite(m) else 0) + (abs(tile_max) if np.isfinite(tile_max) else 0))
            if mass > 0 and tile_max >= m - near:
                shift = max(tile_max - m, 0.0)
                e = exp_rel + u + u * shift
                r_out, r_mass, r_lse, count = r_out + e * np.abs(partial), r_mass + e * mass, r_lse + e * mass, count + 1
                r_bar = r_bar + e * partial_bar
                max_shift = max(max_shift, shift)
            partial = partial + sum((p[n] * v_rows[n] for n in in_tile), np.zeros(case.d))
            partial_bar = partial_bar + sum((p[n] * np.abs(v_rows[n]) for n in in_tile), np.zeros(case.d))
            mass += sum(p[n] for n in in_tile)
            m = max(m, tile_max)
        online_out = max(online_out, float((r_out + np.abs(o) * r_mass).max()))
        online_bar = max(online_bar, float((r_bar + (p @ np.abs(v_rows)) * r_mass).max()))
        online_lse = max(online_lse, r_lse)
        rescales = max(rescales, count)
    compound = (1 + exp_rel + 2 * u + u * max_shift) ** (rescales - 1)
    round_trip = 2 * 2.0**-24 / (1 - 2 * 2.0**-24)
    v1 = tolerance.check_attention(*naive[0], q, k, v, causal=True, order="v1", block_q=case.block_q,
                                   block_k=case.block_k)
    assert trips == 4 and sums > 0 and rescales >= 2 and online_out > 0 and online_lse > 0
    # The tiled terms: |partial sums| of up to n_k terms over up to t_c tiles (degree 1), e (3 roundings) times
    # them and |O| times the masses (degree 2), the compound factor and the round trip's power (a few more), and
    # the terms' sum with the dense ones (2 more roundings of the total on each side).
    ops = n_k + t_c + 8
    trip_term = round_trip * (1 + round_trip) ** (trips - 1)
    abs_trips = trip_term * float(restated_bound(sums_bar, rel, 1, ops))
    abs_online = compound * float(restated_bound(online_bar, rel, 2, ops))
    abs_online_lse = compound * float(restated_bound(online_lse, rel, 1, ops))
    want_v1_out = expected_out + trip_term * sums + compound * online_out
    assert v1.atol_out == pytest.approx(want_v1_out, rel=0,
                                        abs=abs_out + abs_trips + abs_online + 2 * float(gamma(2)) * want_v1_out)
    want_lse = expected_lse + compound * online_lse
    assert v1.atol_lse == pytest.approx(want_lse, rel=0, abs=abs_lse + abs_online_lse
                                        + 2 * float(gamma(2)) * want_lse)  # no round trip
    v2 = tolerance.check_attention(*naive[0], q, k, v, causal=True, order="v2", block_q=case.block_q,
                                   block_k=case.block_k)
    want_v2_out = expected_out + compound * online_out
    assert v2.atol_out == pytest.approx(want_v2_out, rel=0,
                                        abs=abs_out + abs_online + 2 * float(gamma(2)) * want_v2_out)
    assert v2.atol_lse == v1.atol_lse
    for order in ("v1", "v2"):
        with pytest.raises(ValueError, match="needs the tiles"):
            tolerance.check_attention(*naive[0], q, k, v, causal=True, order=order)


@pytest.mark.lemma("L6")
@pytest.mark.parametrize("causal", [False, True])
def test_visits_are_the_v1_schedule(causal):
    """tolerance.visits (what the round-trip term counts) equals the key tiles the v1 schedule visits per row."""
    for n_q, n_k, block_q, block_k in [(7, 9, 3, 2), (12, 5, 4, 2), (5, 13, 2, 4), (1, 1, 1, 1), (9, 9, 4, 4)]:
        sched = tiling.schedule("v1", n_q, n_k, block_q, block_k, causal)
        per_tile = [sum(1 for i, _, _ in sched.visits if i == t) for t in range(sched.grid.t_r)]
        expected = [per_tile[row // block_q] for row in range(n_q)]
        assert tolerance.visits(n_q, n_k, block_q, block_k, causal).tolist() == expected


@pytest.mark.lemma("L6")
@pytest.mark.parametrize("spec", ["causal", "window:3,1", "documents:4,5", "prefix:3"])
def test_round_trip_term_follows_any_mask(spec):
    """With a mask, v1 visits the non-SKIP tiles of each query tile's row of the block mask (and no others);
    the round-trip term restated by explicit loops over those tiles (proofs/L6 part 3, L8) matches."""
    from fa_numba import masks

    mask = masks.parse(spec)
    n, d, block_q, block_k = 9, 4, 2, 3
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1, n, d)) for _ in range(3))
    visible = mask.dense(n, n)
    kinds = tiling.classify(n, n, block_q, block_k, mask=mask)
    p = np.where(visible, np.exp(q[0, 0] @ k[0, 0].T / np.sqrt(d)), 0.0)  # softmax by hand, normalised below
    p = np.divide(p, p.sum(axis=1, keepdims=True), where=visible.any(axis=1, keepdims=True), out=np.zeros_like(p))
    sums, trips, sums_bar = 0.0, 0, 0.0
    for i in range(n):
        tiles = [t for t in range(kinds.shape[1]) if kinds[i // block_q, t] != tiling.Kind.SKIP]
        trips = max(trips, len(tiles) - 1)
        total = sum((np.abs(p[i, :(t + 1) * block_k] @ v[0, 0, :(t + 1) * block_k]) for t in tiles[:-1]), np.zeros(d))
        sums = max(sums, float(total.max()))
        bar = sum((p[i, :(t + 1) * block_k] @ np.abs(v[0, 0, :(t + 1) * block_k]) for t in tiles[:-1]), np.zeros(d))
        sums_bar = max(sums_bar, float(bar.max()))
    base = tolerance.baseline(q, k, v, mask=mask, block_q=block_q, block_k=block_k)
    round_trip = 2 * 2.0**-24 / (1 - 2 * 2.0**-24)
    assert trips >= 1 and sums > 0
    # Two float64 evaluations of the term (the rule's from the reference's P, this one's): P and the partial
    # sums within restated_bound (tests/bounds.py) of their magnitudes, the scores' rounding (q . k / sqrt(d):
    # d + 2 roundings) included; n-term partial sums over the tiles, the power: n + T_c + 4 roundings a term.
    scores = np.where(visible, q[0, 0] @ k[0, 0].T / np.sqrt(d), -np.inf)
    sigma = gamma(d + 2) * (np.abs(q[0, 0]) @ np.abs(k[0, 0]).T) / np.sqrt(d)
    rel = input_rel(scores, v[0, 0], sigma)
    term = round_trip * (1 + round_trip) ** (trips - 1)
    abs_sums = term * float(restated_bound(sums_bar, rel, 1, n + kinds.shape[1] + 4))
    assert base.terms.v1_out == pytest.approx(term * sums, rel=0, abs=abs_sums)
    if spec == "causal":
        causal = tolerance.baseline(q, k, v, causal=True, block_q=block_q, block_k=block_k)
        assert causal.terms == base.terms


@pytest.mark.lemma("L6")
def test_check_attention_rejects_a_wrong_answer():
    q, k, v = Case(n_q=6, n_k=6, d=4, block_q=1, block_k=1, causal=True).inputs()
    out, lse = reference.attention_naive_f32(q, k, v, causal=True)
    check = tolerance.check_attention(out, lse, q, k, v, causal=True)
    assert check.err_out <= check.atol_out / 2  # naive itself passes with room
    wrong, _ = reference.attention_naive_f32(q, k, v, causal=False)  # forgot the mask
    with pytest.raises(AssertionError, match="kernel out"):
        tolerance.check_attention(wrong, lse, q, k, v, causal=True)
    with pytest.raises(AssertionError, match="kernel lse"):
        tolerance.check_attention(out, lse + 1e-3, q, k, v, causal=True)
