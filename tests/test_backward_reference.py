"""The float64 gradients of the definition and the gradients' tolerance rule (proofs/L7_backward.md)."""

import warnings

import numpy as np
import pytest
from hypothesis import example, given

from scipy.special import softmax

from bounds import assert_within, attention_bound, dense_counts, gamma, restated_bound
from fa_numba import masks, reference, tolerance, tolerance_backward
from float64_bounds import backward_bounds, finite_difference_bounds, float64_atols, magnitudes, recomputed_p_rel
from strategies import (BACKWARD_HARD_CASES, HARD_MASK_CASES, Case, MaskCase, cases, mask_cases,
                        with_backward_hard_cases, with_hard_mask_cases)
from test_masks import definition

STEP = 1e-6  # central-difference step; its error bound is derived per entry in float64_bounds


def _central_differences(case: Case, q, k, v, dout):
    """(f(x + h e) - f(x - h e)) / (x_plus - x_minus) for every input entry, f = <dout, O(q, k, v)>."""
    def f(q_, k_, v_):
        out, _ = reference.attention(q_, k_, v_, causal=case.causal)
        return float(np.sum(dout * out))

    grads = []
    for which in range(3):
        args = [q.copy(), k.copy(), v.copy()]
        x = args[which]
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            centre = x[idx]
            x[idx] = centre + STEP
            plus, x_plus = f(*args), x[idx]
            x[idx] = centre - STEP
            minus, x_minus = f(*args), x[idx]
            x[idx] = centre
            g[idx] = (plus - minus) / (x_plus - x_minus)  # the actual step: fl(x + h) - fl(x - h)
        grads.append(g)
    return grads


# Finite differences cannot check logits around 1e4: a step of 1e-6 in K moves S by 1e-6 |scale Q| ~ 1e-2
# there, and the truncation bound h^2 (scale |Q|)^3 is of the order of the gradient. Those cases are
# checked by the float32 rule and by the spec below, whose reference this test validates elsewhere.
FD_HARD_CASES = tuple(c for c in BACKWARD_HARD_CASES if c.logit < 1e4)


def _fd_examples(test):
    for case in FD_HARD_CASES:
        test = example(case=case)(test)
    return test


@pytest.mark.lemma("L7")
@given(case=cases(max_n=6, max_d=4, max_block=4, amplitudes=(1.0, 5.0), logits=(1.0, 30.0)).filter(
    lambda c: c.logit * c.amplitude**2 <= 30))  # |S| up to ~30: see the power assertion below
@_fd_examples
def test_gradients_match_central_finite_differences(case: Case):
    q, k, v = case.inputs()
    dout = case.grad_output()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dead rows must not warn
        grads = reference.attention_backward(q, k, v, dout, causal=case.causal)
    fd = _central_differences(case, q, k, v, dout)
    mag = magnitudes(q, k, v, dout, case.causal)
    bounds = finite_difference_bounds(mag, q, k, STEP)
    ref_err = float64_atols(mag)  # the reference's own float64 rounding (two-sided, so generous)
    for name, g, g_fd, bound, own in zip(("dq", "dk", "dv"), grads, fd, bounds, ref_err):
        assert g.shape == g_fd.shape, name
        excess = np.abs(g - g_fd) - (bound + own)
        assert (excess <= 0).all(), f"{name}: |analytic - central difference| exceeds its bound by {excess.max():.3e}"
    # The test's power: the bound stays below 1e-4 of the gradients' magnitude (measured: <= 5e-5 with
    # |S| up to ~30, logits 30 or inputs x5), so a gradient off by more than 0.01% of its scale fails; a
    # missing D, scale or mask is off by O(1). Its rounding term grows with |S| (f is evaluated to
    # u |S| f_abs): at logits 30 with inputs x5 (|S| ~ 750) finite differences lose that power.
    for g_mag, bound in zip(mag.g, bounds):
        assert bound.max() <= 1e-4 * float(g_mag.max())


def _dead_row_case():
    # delta = -7: rows 0..6 see no key; query tile 0 is all dead, tile 1 holds dead and live rows; GQA.
    return Case(n_q=11, n_k=4, d=3, block_q=4, block_k=3, causal=True, heads_kv=2, group=3, seed=7)


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("fn", [reference.attention_backward, reference.attention_backward_naive_f32],
                         ids=["float64", "naive_f32"])
def test_dead_rows_get_exactly_zero_gradient_and_touch_nothing(fn):
    case = _dead_row_case()
    q, k, v = case.inputs()
    dout = case.grad_output()
    dead = ~reference.visible_mask(case.n_q, case.n_k, True).any(axis=1)
    assert dead.sum() == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dq, dk, dv = fn(q, k, v, dout, causal=True)
    assert (dq[:, :, dead] == 0).all() and np.isfinite(dq).all()
    assert (dq[:, :, ~dead] != 0).any()
    # Whatever a dead row's query and upstream gradient hold, even NaN, dk and dv do not change, bit for bit.
    q2, dout2 = q.copy(), dout.copy()
    q2[:, :, dead], dout2[:, :, dead] = np.nan, np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dq2, dk2, dv2 = fn(q2, k, v, dout2, causal=True)
    np.testing.assert_array_equal(dk2, dk)
    np.testing.assert_array_equal(dv2, dv)
    np.testing.assert_array_equal(dq2, dq)


@pytest.mark.lemma("L7")
def test_gqa_gradients_sum_over_the_query_heads_of_a_group():
    case = Case(n_q=5, n_k=7, d=3, block_q=1, block_k=1, causal=True, batch=2, heads_kv=2, group=3, seed=8)
    q, k, v = case.inputs()
    dout = case.grad_output()
    dq, dk, dv = reference.attention_backward(q, k, v, dout, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    # Two float64 evaluations, each from its own forward (batched, head by head): within twice the per-entry
    # bound of one (tests/float64_bounds.py, backward_bounds), the group's sum of heads included in dK, dV's.
    err_dq, err_dk, err_dv = (2 * e for e in backward_bounds(q, k, v, dout, causal=True)[:3])
    for b in range(case.batch):
        for h_kv in range(case.heads_kv):
            heads = range(h_kv * case.group, (h_kv + 1) * case.group)  # query head h reads K/V head h // group
            solo = [reference.attention_backward(q[b, h], k[b, h_kv], v[b, h_kv], dout[b, h], causal=True)
                    for h in heads]
            for h, (dq_h, _, _) in zip(heads, solo):
                assert_within(dq[b, h], dq_h, err_dq[b, h], name="dq")
            assert_within(dk[b, h_kv], sum(s[1] for s in solo), err_dk[b, h_kv], name="dk")
            assert_within(dv[b, h_kv], sum(s[2] for s in solo), err_dv[b, h_kv], name="dv")


def test_layouts_agree():
    case = Case(n_q=5, n_k=6, d=3, block_q=1, block_k=1, causal=True, seed=9)
    q, k, v = case.inputs()
    dout = case.grad_output()
    four = reference.attention_backward(q, k, v, dout, causal=True)
    two = reference.attention_backward(q[0, 0], k[0, 0], v[0, 0], dout[0, 0], causal=True)
    for g4, g2 in zip(four, two):
        assert g2.ndim == 2
        np.testing.assert_array_equal(g4[0, 0], g2)


def test_dout_is_validated_by_name():
    q, k, v = Case(n_q=4, n_k=4, d=2, block_q=1, block_k=1, causal=False).inputs()
    with pytest.raises(ValueError, match=r"dout must have shape \(1, 1, 4, 2\) \(as q with v's head dim\), got \(1, 1, 4, 3\)"):
        reference.attention_backward(q, k, v, np.zeros((1, 1, 4, 3)))
    with pytest.raises(TypeError, match="dout must have dtype in"):
        reference.attention_backward(q, k, v, np.zeros(q.shape, dtype=np.int32))


def test_naive_f32_backward_computes_in_float32_and_its_orders_differ():
    case = Case(n_q=7, n_k=9, d=5, block_q=1, block_k=1, causal=True, logit=3.0, seed=10)
    q, k, v = case.inputs()
    dout = case.grad_output()
    ref = reference.attention_backward(q, k, v, dout, causal=True)
    naive = [reference.attention_backward_naive_f32(q, k, v, dout, causal=True, contraction=c)
             for c in reference.CONTRACTIONS]
    for n in naive:
        assert all(g.dtype == np.float32 for g in n)
        assert all(0 < tolerance.max_error(g, r) < 1e-4 for g, r in zip(n, ref))
    assert len({tolerance.max_error(n[0], ref[0]) for n in naive}) > 1
    with pytest.raises(ValueError, match="contraction must be one of"):
        reference.attention_backward_naive_f32(q, k, v, dout, contraction="blas")


@pytest.mark.lemma("L7")
def test_backward_tolerance_is_the_documented_rule():
    """atol = 3 max over orders of err(naive) + ulp32(max |ref| + 0.3) + the recomputation floor, restated."""
    case = Case(n_q=7, n_k=9, d=5, block_q=1, block_k=1, causal=True, logit=3.0, seed=6)
    q, k, v = case.inputs()
    dout = case.grad_output()
    base = tolerance_backward.baseline_backward(q, k, v, dout, causal=True)
    ref = reference.attention_backward(q, k, v, dout, causal=True)
    naive = [reference.attention_backward_naive_f32(q, k, v, dout, causal=True, contraction=c)
             for c in reference.CONTRACTIONS]
    # The recomputation floor, restated: one ulp32 (<= 2^-23 x) of each of dP_ij and D_i at the magnitude
    # of their terms, and of LSE_i (a relative error of P_ij, times |dP_ij - D_i|), times P_ij, carried
    # through scale dS K (dq) and scale dS^T Q (dk); dv gets the LSE's ulp times P_ij |dO_i|.
    mag = magnitudes(q, k, v, dout, True)
    out, lse = reference.attention(q, k, v, causal=True)
    ulp = 2.0**-23
    lse_ulp = np.where(np.isfinite(lse), ulp * np.abs(lse), 0.0)[..., None]  # (B, H, N_q, 1)
    a = np.abs(dout) @ np.swapaxes(np.abs(v), -1, -2)  # sum_x |dO_ix| |V_jx|
    b = (np.abs(dout) * np.abs(out)).sum(-1)[..., None]  # sum_x |dO_ix| |O_ix|
    d_row = (dout * out).sum(-1)[..., None]
    e = np.where(mag.visible, mag.p * (ulp * (a + b) + lse_ulp * np.abs(mag.w - d_row)), 0.0)
    scale = 1 / np.sqrt(case.d)
    recompute = (scale * (e @ np.abs(k)).max(), scale * (np.swapaxes(e, -1, -2) @ np.abs(q)).max(),
                 (np.swapaxes(mag.p * lse_ulp, -1, -2) @ np.abs(dout)).max())
    # The restatement rounds in another order, from its own P, O, dP and D: not an rtol but restated_bound
    # (tests/bounds.py) at the floor's magnitude, |O| -> sum_j P_j |V_j| and |dP - D| -> a + b_bar, with every
    # input within rel of its magnitude: P (recomputed_p_rel: the scores' and LSE's errors), O (attention_bound),
    # dP - D and b (their d products and sums, O's error through |dO|). The naive errors and ulp floors are the
    # same operations on the same arrays on both sides (exactly equal); the three-term sums round twice.
    out_err, lse_err = attention_bound(q, k, v, causal=True, counts=dense_counts(case.n_k))
    sigma = gamma(case.d + 1) * scale * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2))
    rho = np.where(mag.visible, recomputed_p_rel(mag.p, sigma, lse_err), 0.0).max()
    b_bar = (np.abs(dout) * (mag.p @ np.abs(v))).sum(-1)[..., None]
    input_err = gamma(case.d) * (a + b) + (np.abs(dout) * out_err).sum(-1)[..., None]  # of dP - D, and of b
    rel = max(float(rho), float((input_err / (a + b_bar)).max()))
    e_bar = np.where(mag.visible, mag.p * (ulp + lse_ulp) * (a + b_bar), 0.0)
    magnitude = (scale * (e_bar @ np.abs(k)).max(), scale * (np.swapaxes(e_bar, -1, -2) @ np.abs(q)).max(),
                 recompute[2])
    for t, atol in enumerate((base.atol_dq, base.atol_dk, base.atol_dv)):
        expected = (3 * max(np.abs(n[t] - ref[t]).max() for n in naive)
                    + np.spacing(np.float32(np.abs(ref[t]).max() + 0.3)) + recompute[t])
        bound = float(restated_bound(magnitude[t], rel, 2, max(case.n_k, case.n_q) + case.d + 8))
        assert atol == pytest.approx(expected, rel=0, abs=bound + 2 * float(gamma(2)) * expected)
        np.testing.assert_array_equal((base.dq, base.dk, base.dv)[t], ref[t])
    assert min(recompute) > 0


@pytest.mark.lemma("L7")
def test_cancellation_floor_covers_a_row_that_sees_one_key():
    """N_k = 1: P = 1 and dS = dP - D = 0 exactly. The naive evaluations round dP and D alike, so 3x their
    error is 0, while an implementation that orders the two dot products differently is a few ulps off."""
    case = Case(n_q=4, n_k=1, d=6, block_q=1, block_k=1, causal=False, seed=11)
    q, k, v = case.inputs(np.float32)
    dout = case.grad_output(np.float32)
    base = tolerance_backward.baseline_backward(q, k, v, dout)
    ref = reference.attention_backward(q, k, v, dout)
    naive_dq = [reference.attention_backward_naive_f32(q, k, v, dout, contraction=c)[0] for c in ("loop", "loop_reversed")]
    assert all(tolerance.max_error(n, ref[0]) == 0 for n in naive_dq)  # exact by luck
    # D summed in the reverse order of dP: the rounding noise any other implementation may have.
    out = np.broadcast_to(v, q.shape)  # one key: O_i = V_0
    d_rev = np.zeros(q.shape[:-1], np.float32)
    for x in reversed(range(case.d)):
        d_rev += dout[..., x] * out[..., x]
    dp = np.zeros(q.shape[:-1], np.float32)
    for x in range(case.d):
        dp += dout[..., x] * v[..., 0, x][..., None]
    dq = (np.float32(1 / np.sqrt(case.d)) * (dp - d_rev))[..., None] * k  # P = 1: dS = dP - D
    err = tolerance.max_error(dq, ref[0])
    assert err > tolerance.rounding_floor(ref[0])  # the floor of the forward alone would fail it
    assert err <= base.atol_dq


@pytest.mark.lemma("L7")
def test_check_attention_backward_rejects_a_wrong_answer():
    case = Case(n_q=6, n_k=6, d=4, block_q=1, block_k=1, causal=True, seed=12)
    q, k, v = case.inputs()
    dout = case.grad_output()
    grads = reference.attention_backward_naive_f32(q, k, v, dout, causal=True)
    check = tolerance_backward.check_attention_backward(*grads, q, k, v, dout, causal=True)
    assert check.err_dq <= check.atol_dq / 3 and check.err_dv <= check.atol_dv / 3  # naive passes with room
    unmasked = reference.attention_backward_naive_f32(q, k, v, dout, causal=False)  # forgot the mask
    for t, name in enumerate(("dq", "dk", "dv")):
        wrong = list(grads)
        wrong[t] = unmasked[t]
        with pytest.raises(AssertionError, match=f"kernel {name}"):
            tolerance_backward.check_attention_backward(*wrong, q, k, v, dout, causal=True)
    with pytest.raises(AssertionError, match="non-finite mismatch"):
        tolerance_backward.check_attention_backward(grads[0] * np.nan, *grads[1:], q, k, v, dout, causal=True)


# --- masks beyond causal (proofs/L8) -----------------------------------------------------------------


def _explicit_gradients(q, k, v, dout, visible):
    """The gradients row by row over an explicit visible matrix (L7's formulas on each row's visible keys,
    with scipy's softmax): no dense masking, no visible_matmul. A row with no visible key adds nothing."""
    b_, h_, n_q, d = q.shape
    group = h_ // k.shape[1]
    scale = 1 / np.sqrt(d)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(b_):
        for h in range(h_):
            kk, vv = k[b, h // group], v[b, h // group]
            for i in range(n_q):
                keys = np.flatnonzero(visible[i])
                if not keys.size:
                    continue
                p = softmax(scale * (kk[keys] @ q[b, h, i]))
                o = p @ vv[keys]
                ds = p * (vv[keys] @ dout[b, h, i] - dout[b, h, i] @ o)  # P (dP - D)
                dv[b, h // group, keys] += p[:, None] * dout[b, h, i]
                dk[b, h // group, keys] += scale * ds[:, None] * q[b, h, i]
                dq[b, h, i] = scale * ds @ kk[keys]
    return dq, dk, dv


@pytest.mark.lemma("L8")
@given(mc=mask_cases(max_n=10, max_d=5, amplitudes=(1.0, 5.0)))
@with_hard_mask_cases
def test_gradients_with_a_mask_match_explicit_per_row_loops(mc: MaskCase):
    """The dense gradients with any mask against L7's formulas looped over each row's visible keys, within the
    float64 bound of two evaluations (tests/float64_bounds.py); rows with no visible key exactly 0."""
    q, k, v = mc.case.inputs()
    dout = mc.case.grad_output()
    visible = definition(mc.mask, mc.n_q, mc.n_k)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dead rows and masked scores must not warn
        grads = reference.attention_backward(q, k, v, dout, mask=mc.mask)
        naive = reference.attention_backward_naive_f32(q, k, v, dout, mask=mc.mask)
    atols = float64_atols(magnitudes(q, k, v, dout, False, mask=mc.mask))
    dead = ~visible.any(axis=1)
    explicit = _explicit_gradients(q, k, v, dout, visible)
    for name, g, n, e, atol in zip(("dq", "dk", "dv"), grads, naive, explicit, atols):
        assert g.shape == e.shape and g.dtype == np.float64 and n.dtype == np.float32
        tolerance.assert_close(g, e, atol, name=name)
        assert np.isfinite(n).all()
    assert (grads[0][..., dead, :] == 0).all() and (naive[0][..., dead, :] == 0).all()
    unseen = ~visible.any(axis=0)  # keys no query sees: zero dK, dV
    for g in (*grads[1:], *naive[1:]):
        assert (g[..., unseen, :] == 0).all()


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("fn", [reference.attention_backward, reference.attention_backward_naive_f32],
                         ids=["float64", "naive_f32"])
@pytest.mark.parametrize("mc", [mc for mc in HARD_MASK_CASES
                                if not definition(mc.mask, mc.n_q, mc.n_k).any(axis=1).all()],
                         ids=lambda mc: repr(mc.mask))
def test_dead_rows_under_a_mask_get_exactly_zero_gradient_and_touch_nothing(fn, mc: MaskCase):
    q, k, v = mc.case.inputs()
    dout = mc.case.grad_output()
    dead = ~definition(mc.mask, mc.n_q, mc.n_k).any(axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dq, dk, dv = fn(q, k, v, dout, mask=mc.mask)
        q2, dout2 = q.copy(), dout.copy()
        q2[:, :, dead], dout2[:, :, dead] = np.nan, np.nan  # a dead row's query and upstream gradient reach nothing
        dq2, dk2, dv2 = fn(q2, k, v, dout2, mask=mc.mask)
    assert (dq[:, :, dead] == 0).all() and np.isfinite(dq).all()
    for a, b in ((dq2, dq), (dk2, dk), (dv2, dv)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.lemma("L8")
@given(case=cases(max_n=10, max_d=5))
@with_backward_hard_cases
def test_causal_flag_equals_the_causal_mask_in_the_backward_reference_bitwise(case: Case):
    q, k, v = case.inputs()
    dout = case.grad_output()
    for fn in (reference.attention_backward, reference.attention_backward_naive_f32):
        for a, b in zip(fn(q, k, v, dout, causal=True), fn(q, k, v, dout, mask=masks.causal())):
            np.testing.assert_array_equal(a, b)
    by_flag, by_mask = (vars(tolerance_backward.baseline_backward(q, k, v, dout, contractions=("matmul",),
                                                                  **kw)).values()
                        for kw in ({"causal": True}, {"mask": masks.causal()}))
    for a, b in zip(by_flag, by_mask):  # the gradients and their tolerances
        np.testing.assert_array_equal(a, b)


@pytest.mark.lemma("L8")
def test_check_attention_backward_with_a_mask_rejects_unmasked_gradients():
    mask = masks.sliding_window(2, 0)
    q, k, v = Case(n_q=7, n_k=7, d=4, block_q=1, block_k=1, causal=False, seed=13).inputs()
    dout = Case(n_q=7, n_k=7, d=4, block_q=1, block_k=1, causal=False, seed=13).grad_output()
    grads = reference.attention_backward_naive_f32(q, k, v, dout, mask=mask)
    check = tolerance_backward.check_attention_backward(*grads, q, k, v, dout, mask=mask)
    assert check.err_dq <= check.atol_dq and check.err_dk <= check.atol_dk
    for wrong in (reference.attention_backward_naive_f32(q, k, v, dout, causal=True),  # the window forgotten
                  reference.attention_backward_naive_f32(q, k, v, dout, mask=masks.sliding_window(1, 0))):
        for t, name in enumerate(("dq", "dk", "dv")):
            given_grads = list(grads)
            given_grads[t] = wrong[t]
            with pytest.raises(AssertionError, match=f"kernel {name}"):
                tolerance_backward.check_attention_backward(*given_grads, q, k, v, dout, mask=mask)
    with pytest.raises(ValueError, match=r"pass causal=True or mask=\.\.\., not both"):
        reference.attention_backward(q, k, v, dout, causal=True, mask=mask)
