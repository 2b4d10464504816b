"""The gradients' 3xTF32 term (tolerance_backward.grad_split_terms, proofs/L7's 3xTF32 part) in isolation.

An independent emulation of a backward whose every product is taken by tf32 parts, written here in float64
NumPy apart from the kernels and the rule: a value's tf32 high part is it rounded to 11 significant bits with
ties to even (cvt.rn; cvt.rna, ties away, until 2026-12-05), its residual the same rounding of what is left, and a b is
lo_a hi_b + hi_a lo_b + hi_a hi_b (3xTF32) or hi_a hi_b (plain TF32); everything else is exact float64 (the
float32 roundings are the 3x rule's, not this term's). The term must bound how far those products move each
gradient from the float64 reference, and must not be loose by orders of magnitude.
"""

import numpy as np
import pytest

from fa_numba import reference, tolerance_backward


def _tf32(x):
    """x rounded to 11 significant bits, ties to even (cvt.rn.tf32.f32's rounding, in float64)."""
    m, e = np.frexp(x)  # |m| in [0.5, 1)
    return np.ldexp(np.round(m * 2.0**11) / 2.0**11, e)  # np.round: half to even


def _product(a, b, three: bool):
    """a @ b with every product taken by tf32 parts: three (lo hi + hi lo + hi hi) or one (hi hi)."""
    ah, bh = _tf32(a), _tf32(b)
    if not three:
        return ah @ bh
    al, bl = _tf32(a - ah), _tf32(b - bh)
    return al @ bh + ah @ bl + ah @ bh


def _emulated_backward(q, k, v, dout, causal: bool, three: bool):
    """dq, dk, dv (B, H, N, d) with every product by tf32 parts, P from the exact LSE, D exact (no GQA)."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    out, lse = reference.attention(q, k, v, causal=causal)
    kt, vt = np.swapaxes(k, -1, -2), np.swapaxes(v, -1, -2)
    s = scale * _product(q, kt, three)
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        hidden = np.arange(n_k)[None, :] > np.arange(n_q)[:, None] + (n_k - n_q)
        s = np.where(hidden, -np.inf, s)
    p = np.exp(s - lse[..., None])
    dp = _product(dout, vt, three)
    d_row = (dout * out).sum(axis=-1)
    ds = p * (dp - d_row[..., None])
    dv = _product(np.swapaxes(p, -1, -2), dout, three)
    dk = scale * _product(np.swapaxes(ds, -1, -2), q, three)
    dq = scale * _product(ds, k, three)
    return dq, dk, dv


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("magnitude", [1.0, 30.0], ids=["unit", "large-scores"])
def test_the_split_term_bounds_what_tf32_parts_move_and_is_not_loose(causal, magnitude):
    rng = np.random.default_rng(11 + int(causal) + int(magnitude))
    q, k, v, dout = (rng.standard_normal((2, 2, 24, 16)) for _ in range(4))
    q = q * magnitude  # large scores: a sharp softmax, where P's relative error matters
    grads = reference.dense_backward(q, k, v, dout, causal=causal)
    terms = tolerance_backward.grad_split_terms(grads, "3xtf32")
    moved = [np.abs(e - r).max() for e, r in zip(_emulated_backward(q, k, v, dout, causal, True),
                                                   (grads.dq, grads.dk, grads.dv))]
    for name, m, term in zip(("dq", "dk", "dv"), moved, terms):
        assert 0 < m <= term, f"{name}: tf32 parts moved it by {m:.3g}, the term allows {term:.3g}"
        assert term <= 200 * m, f"{name}: the term {term:.3g} is over 200x what tf32 parts moved it ({m:.3g})"


@pytest.mark.lemma("L7")
def test_plain_tf32_moves_the_gradients_past_the_3xtf32_term_and_within_its_own():
    """The term depends on the products: one TF32 product per product (2^-10 relative) is far outside 3xTF32's
    term and inside the plain TF32 term (its SPLIT_ROUNDING)."""
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 2, 32, 16)) for _ in range(4))
    grads = reference.dense_backward(q, k, v, dout)
    moved = [np.abs(e - r).max() for e, r in zip(_emulated_backward(q, k, v, dout, False, False),
                                                   (grads.dq, grads.dk, grads.dv))]
    three, plain = (tolerance_backward.grad_split_terms(grads, p) for p in ("3xtf32", "tf32"))
    assert all(m > t for m, t in zip(moved, three))
    assert all(m <= t for m, t in zip(moved, plain))


def test_products_and_p_dtype_are_refused_together_and_bad_products_by_name():
    x = np.zeros((1, 1, 4, 4))
    with pytest.raises(ValueError, match="give one"):
        tolerance_backward.baseline_backward(x, x, x, x, p_dtype="float16", products="3xtf32")
    with pytest.raises(ValueError, match="products must be one of"):
        tolerance_backward.baseline_backward(x, x, x, x, products="2xtf32")
