"""The ex2 weights' term of the rule (proofs/L6 part 10), in isolation: each weight's error, then what the
weights' errors can do to O and LSE. The expected values are computed here in float64, apart from
`tolerance.exp2_terms` and from the simulator's ex2 (fa_numba.warp.emulated_tc)."""

import functools
import math

import numpy as np
import pytest

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
    for x in range(q.shape[-1]):
        up = np.sign(dout[..., :, None, x])  # dV_jx: up where dO_ix > 0
        got = through(p * (1 + factor * phi * up), transpose, dout[..., x, None])[..., 0]
        assert np.allclose(np.abs(got), dv[..., x], rtol=1e-9, atol=1e-15)
        up = np.sign(spread * k[..., None, :, x])  # dQ_ix: up where (dP - D)_ij K_jx > 0
        got = scale * through(p * (1 + factor * phi * up), lambda m: m * spread, k[..., x, None])[..., 0]
        assert np.allclose(np.abs(got), dq[..., x], rtol=1e-9, atol=1e-15)
        up = np.sign(spread * q[..., :, None, x])  # dK_jx: up where (dP - D)_ij Q_ix > 0
        got = scale * through(p * (1 + factor * phi * up), lambda m: transpose(m * spread), q[..., x, None])[..., 0]
        assert np.allclose(np.abs(got), dk[..., x], rtol=1e-9, atol=1e-15)
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
    for factor, within in ((1.0, True), (3.0, False)):
        moved = _moved_gradients(q, k, v, dout, causal, factor)
        for name, got, term in zip(("dq", "dk", "dv"), moved, terms):
            assert bool(got <= term * (1 + 1e-9)) is within, (name, factor, got, term)
