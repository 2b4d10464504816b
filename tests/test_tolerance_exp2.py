"""The ex2 weights' term of the rule (proofs/L6 part 10), in isolation: each weight's error, then what the
weights' errors can do to O and LSE. The expected values are computed here in float64, apart from
`tolerance.exp2_terms` and from the simulator's ex2 (fa_numba.warp.emulated_tc)."""

import functools
import math

import numpy as np
import pytest

from bounds import U64, assert_within, attention_bound, dense_counts, dot_bound, gamma, restated_bound
from fa_numba import reference, tolerance

U = tolerance.U32
L = np.float32(math.log2(math.e))  # the kernels' LOG2E (kernels.mma.engine)


def _ex2(x: np.ndarray) -> np.ndarray:
    """ex2.approx.ftz.f32 read independently: 2^x in float64 rounded once to float32, subnormals flushed."""
    x = np.where(np.abs(x) < 2.0**-126, 0.0, x.astype(np.float64))
    y = np.exp2(x).astype(np.float32)
    return np.where(np.abs(y) < 2.0**-126, np.float32(0), y)


def _kernel_weights(s: np.ndarray, m: np.ndarray, fused: bool) -> np.ndarray:
    """The fold's weights 2^(fl(s L) - fl(m L)) of float32 scores s under their row's running max m: the product
    rounded on its own (the simulator) or fused with the subtraction (one FFMA, as sm_90a compiles it)."""
    base = (m * L).astype(np.float32)
    if fused:  # s L is exact in float64 (24 + 24 bits); the difference rounded once more to float32
        x = (s.astype(np.float64) * np.float64(L) - base).astype(np.float32)
    else:
        x = ((s * L).astype(np.float32) - base).astype(np.float32)
    return _ex2(x)


@pytest.mark.lemma("L6")
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_an_ex2_weight_errs_by_at_most_phi_relative_and_the_flush(fused):
    """|w - exp(s - m)| <= phi exp(s - m) + 2^-126, phi = u (2 |s| + 3 (m - s)) + EXP_REL, on scores from 1e-3 to
    1e4 in size, m at or above s (the running max, at most the final one), and the bound is nearly reached."""
    rng = np.random.default_rng(20261203)
    size = 200_000
    magnitude = 10.0 ** rng.uniform(-3, 4, size)
    s = (rng.choice([-1.0, 1.0], size) * magnitude).astype(np.float32)
    gap = np.where(rng.random(size) < 0.5, rng.exponential(2.0, size), 10.0 ** rng.uniform(-6, 2.2, size))
    m = np.maximum((s + gap).astype(np.float32), s)
    w = _kernel_weights(s, m, fused).astype(np.float64)
    exact = np.exp(s.astype(np.float64) - m.astype(np.float64))
    phi = U * (2 * np.abs(s.astype(np.float64)) + 3 * (m.astype(np.float64) - s)) + tolerance.EXP_REL
    bound = phi * exact + tolerance.FLUSH
    ratio = np.abs(w - exact) / bound
    assert ratio.max() <= 1.0, f"worst weight at {ratio.max():.3f} of its bound"
    # the argument's roundings dominate for large scores: the bound is within a factor 4 of the worst case
    assert ratio.max() >= 0.25, f"the bound is loose: worst weight at {ratio.max():.3f} of it"
    # and the flush: a weight below 2^-126 comes back 0
    tiny = _kernel_weights(np.float32([-200.0]), np.float32([0.0]), fused)
    assert tiny[0] == 0.0 and math.exp(-200.0) < tolerance.FLUSH


def _perturbed(dense: reference.Dense, factor: float):
    """O and LSE of the float64 reference with every weight moved by factor x phi_ij relative, each towards the
    side that moves O_ix (for one column x at a time) the most: up where V_jx > O_ix, down elsewhere."""
    p, s, v = dense.p, dense.s, dense.v
    m = s.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        phi = np.where(p == 0, 0.0, U * (2 * np.abs(s) + 3 * (m - s)) + tolerance.EXP_REL)
    outs = []
    for x in range(v.shape[-1]):
        up = np.where(v[..., None, :, x] > dense.out[..., :, None, x], 1.0, -1.0)
        w = p * (1 + factor * phi * up)
        outs.append((w @ v[..., x:x + 1])[..., 0] / w.sum(axis=-1))
    w = p * (1 + factor * phi)  # LSE: every weight up
    return np.stack(outs, axis=-1), dense.lse + np.log(w.sum(axis=-1))


@pytest.mark.lemma("L6")
@pytest.mark.parametrize("causal", [False, True])
def test_the_exp2_term_bounds_weights_moved_by_phi_and_not_by_three_phi(causal):
    """Every weight moved by phi_ij, adversarially per output column, moves O and LSE by at most the term
    `exp2_terms` gives (first order, plus the float64 rounding of this check); moved by 3 phi_ij it exceeds the
    term somewhere, so the term is not loose by more than that here (O reaches 0.57 of it, 0.40 causal, where
    the first rows see one key; LSE 1.00: every weight up is its worst case). On peaked rows O ~ V of the top key
    and its weight's error moves O little: the (|V| + |O|) form, the score floor's, is looser there."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 3, 48, 16)) for _ in range(3))
    dense = reference.dense(q, k, v, causal=causal)
    out_term, lse_term = tolerance.exp2_terms(dense)
    slack = 1e-12  # the float64 rounding of the perturbed sums, far below the terms (about 1e-5 here)
    for factor, within in ((1.0, True), (3.0, False)):
        out, lse = _perturbed(dense, factor)
        err_out, err_lse = np.abs(out - dense.out).max(), np.abs(lse - dense.lse).max()
        assert bool(err_out <= out_term + slack) is within, (factor, err_out, out_term)
        assert bool(err_lse <= lse_term + slack) is within, (factor, err_lse, lse_term)


@pytest.mark.lemma("L6")
def test_a_tensor_core_baseline_adds_the_exp2_term_and_a_float32_one_does_not():
    """p_dtype= and products= name a tensor-core forward: both add exp2_terms to the tolerances; neither given,
    the rule is the float32 one."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 24, 8)).astype(np.float16) for _ in range(3))
    plain = tolerance.baseline(q, k, v, contractions=("matmul",))
    assert (plain.terms.exp2_out, plain.terms.exp2_lse) == (0.0, 0.0)
    expected = tolerance.exp2_terms(reference.dense(q, k, v))
    for kwargs in ({"p_dtype": "float16"}, {"products": "3xtf32"}):
        base = tolerance.baseline(q, k, v, contractions=("matmul",), **kwargs)
        assert (base.terms.exp2_out, base.terms.exp2_lse) == expected
        atol_out, atol_lse = base.tolerances()
        assert atol_out == base.atol_out + base.terms.p_out + base.terms.split_out + expected[0]
        assert atol_lse == base.atol_lse + base.terms.split_lse + expected[1]


def _moved_gradients(q, k, v, dout, causal: bool, factor: float):
    """Largest change of dq, dk, dv (float64, one query head per K/V head) when every recomputed P_ij moves by
    factor x phi_ij relative, phi_ij = u (2 |S_ij| + 3 (LSE_i - S_ij)) + EXP_REL from the forward's own S and LSE,
    each entry's signs chosen to move it the most (the gradients are linear in P)."""
    dense = reference.dense(q, k, v, causal=causal)
    scale = 1 / math.sqrt(q.shape[-1])
    s, p, lse = dense.s, dense.p, dense.lse[..., None]
    with np.errstate(invalid="ignore"):
        phi = np.where(p > 0, U * (2 * np.abs(s) + 3 * (lse - s)) + tolerance.EXP_REL, 0.0)
    dp = dout @ np.swapaxes(v, -1, -2)
    spread = dp - (dout * dense.out).sum(axis=-1, keepdims=True)  # dP - D
    moved = factor * phi * p  # |the change of P_ij|
    # dV_jx = sum_i P_ij dO_ix: each (j, x) moved by sum_i moved_ij |dO_ix|
    dv = np.einsum("bhij,bhix->bhjx", moved, np.abs(dout))
    # dQ_ix = scale sum_j P_ij (dP - D)_ij K_jx, dK_jx = scale sum_i P_ij (dP - D)_ij Q_ix
    dq = scale * np.einsum("bhij,bhjx->bhix", moved * np.abs(spread), np.abs(k))
    dk = scale * np.einsum("bhij,bhix->bhjx", moved * np.abs(spread), np.abs(q))
    # the same changes through the gradients' own formulas, with P moved entry by entry (signs per output column)
    def through(p_moved, a, b):  # (a (P_moved - P) b): the change of a gradient whose formula is a P b
        return a(p_moved) @ b - a(p) @ b

    transpose = functools.partial(np.swapaxes, axis1=-1, axis2=-2)
    n_q, n_k = p.shape[-2:]
    # The two float64 evaluations differ by derived bounds (tests/bounds.py), not an rtol: the through side forms
    # P (1 + f phi up) (3 roundings: at most gamma(3) P (1 + f phi) off P + f phi P up), multiplies by spread
    # (dq, dk: one rounding of |P spread|), takes two sums of N terms (dot_bound of each) and their difference
    # (one rounding), then scale (one more); its cancellation leaves u |a(P)| |b|, not u |result|. The closed
    # form sums non-negative terms: moved (2 roundings), |spread| and scale (2 more), N terms: gamma(N + 4) of itself.
    moved_in = gamma(3) * p * (1 + factor * phi)

    def through_bound(p_moved, weight, b, n, orient, scaled):  # weight: |spread| or 1, as a(.) applies it
        a_moved, a_p, a_in = (orient(m * weight) for m in (np.abs(p_moved), p, moved_in))
        err = a_in @ b + dot_bound(a_moved @ b, n) + dot_bound(a_p @ b, n)
        if scaled:  # the product by spread, the one by scale
            err = scale * (err + U64 * (a_moved + a_p) @ b)
        return err[..., 0]

    def same(x):
        return x

    for x in range(q.shape[-1]):
        up = np.sign(dout[..., :, None, x])  # dV_jx: up where dO_ix > 0
        p_moved = p * (1 + factor * phi * up)
        got = through(p_moved, transpose, dout[..., x, None])[..., 0]
        err = through_bound(p_moved, 1.0, np.abs(dout[..., x, None]), n_q, transpose, False)
        assert_within(np.abs(got), dv[..., x], err + U64 * np.abs(got) + gamma(n_q + 4) * dv[..., x], name="dv")
        up = np.sign(spread * k[..., None, :, x])  # dQ_ix: up where (dP - D)_ij K_jx > 0
        p_moved = p * (1 + factor * phi * up)
        got = scale * through(p_moved, lambda m: m * spread, k[..., x, None])[..., 0]
        err = through_bound(p_moved, np.abs(spread), np.abs(k[..., x, None]), n_k, same, True)
        assert_within(np.abs(got), dq[..., x], err + 2 * U64 * np.abs(got) + gamma(n_k + 4) * dq[..., x], name="dq")
        up = np.sign(spread * q[..., :, None, x])  # dK_jx: up where (dP - D)_ij Q_ix > 0
        p_moved = p * (1 + factor * phi * up)
        got = scale * through(p_moved, lambda m: transpose(m * spread), q[..., x, None])[..., 0]
        err = through_bound(p_moved, np.abs(spread), np.abs(q[..., x, None]), n_q, transpose, True)
        assert_within(np.abs(got), dk[..., x], err + 2 * U64 * np.abs(got) + gamma(n_q + 4) * dk[..., x], name="dk")
    return dq.max(), dk.max(), dv.max()


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("causal", [False, True])
def test_the_backward_exp2_terms_bound_weights_moved_by_phi_and_not_by_three_phi(causal):
    """The tensor-core backward's ex2 term (proofs/L7, the ex2 weights): P moved by phi_ij relative, entry by entry
    with the signs that move each gradient entry the most, moves dq, dk, dv by at most `grad_exp2_terms` (they are
    linear in P: reached to first order, the term's flush part above it); moved by 3 phi_ij, beyond it."""
    from fa_numba import tolerance_backward

    rng = np.random.default_rng(11)
    q, k, v, dout = (rng.standard_normal((1, 2, 24, 8)) for _ in range(4))
    grads = reference.dense_backward(q, k, v, dout, causal=causal)
    terms = tolerance_backward.grad_exp2_terms(grads)
    slack = _restated_slack(q, k, v, dout, causal)
    for factor, within in ((1.0, True), (3.0, False)):
        moved = _moved_gradients(q, k, v, dout, causal, factor)
        for name, got, term, extra in zip(("dq", "dk", "dv"), moved, terms, slack):
            assert bool(got <= term + factor * extra) is within, (name, factor, got, term, extra)


def _restated_slack(q, k, v, dout, causal):
    """How far the moved gradients (this file's P, phi, dP - D) may be from the rule's term at phi (the
    backward's P from its LSE, its own phi and dP - D) by float64 rounding alone, per unit factor: restated_bound
    (tests/bounds.py) at the term's magnitude, |dP - D| -> a + b_bar (sum_x |dO_ix| (|V_jx| + (P |V|)_ix)), with
    P within rho of the exact softmax (recomputed_p_rel and its (N_k + 2) u for e / l), dP - D within
    gamma(d) (a + b) + |dO| omega, and phi = u32 (2 |S| + 3 (LSE - S)) + EXP_REL (>= EXP_REL) within
    u32 (10 sigma + 6 lambda) / EXP_REL of itself plus its 6 roundings; each term's own sums N + d + 8 roundings."""
    from float64_bounds import recomputed_p_rel

    dense = reference.dense(q, k, v, causal=causal)
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(d)
    p, s, lse = dense.p, dense.s, dense.lse[..., None]
    visible = p > 0
    sigma = gamma(d + 1) * scale * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2))
    out_err, lse_err = attention_bound(q, k, v, causal=causal, counts=dense_counts(n_k))
    rho = np.where(visible, recomputed_p_rel(p, sigma, lse_err), 0.0).max() + (n_k + 2) * U64
    a = np.abs(dout) @ np.swapaxes(np.abs(v), -1, -2)
    b = (np.abs(dout) * np.abs(dense.out)).sum(-1)[..., None]
    b_bar = (np.abs(dout) * (p @ np.abs(v))).sum(-1)[..., None]
    spread_rel = ((gamma(d) * (a + b) + (np.abs(dout) * out_err).sum(-1)[..., None]) / (a + b_bar)).max()
    phi_err = U * (10 * sigma + 6 * lse_err[..., None]) / tolerance.EXP_REL
    phi_rel = phi_err[np.broadcast_to(visible, sigma.shape)].max()
    rel = float(rho + spread_rel + phi_rel + gamma(6))
    with np.errstate(invalid="ignore"):
        phi = np.where(visible, U * (2 * np.abs(s) + 3 * (lse - s)) + tolerance.EXP_REL, 0.0)
    e_bar = phi * p * (a + b_bar)
    magnitudes = (scale * (e_bar @ np.abs(k)).max(), scale * (np.swapaxes(e_bar, -1, -2) @ np.abs(q)).max(),
                  (np.swapaxes(phi * p, -1, -2) @ np.abs(dout)).max())
    return [float(restated_bound(m, rel, 1, max(n_q, n_k) + d + 8)) for m in magnitudes]
