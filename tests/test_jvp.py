"""Forward-mode AD on the host (fa_numba.jvp, proofs/L15): the float64 JVP against torch's own forward-mode AD of a
dense float64 implementation written here, the one-pass online form against it, and the extended merge as a
monoid. Bounds: first order in float64's unit roundoff over the terms' magnitudes (tests/bounds.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bounds import UNDERFLOW, factor
from fa_numba import jvp, masks

torch = pytest.importorskip("torch", reason="the oracle is torch's forward-mode AD (the torch extra)")


def _problem(seed, batch=1, heads=2, heads_kv=1, n_q=7, n_k=11, d=4):
    rng = np.random.default_rng(seed)
    shapes = ((batch, heads, n_q, d), (batch, heads_kv, n_k, d), (batch, heads_kv, n_k, d))
    primal = [rng.standard_normal(s) for s in shapes]
    tangent = [rng.standard_normal(s) for s in shapes]
    return primal, tangent


def _torch_attention(q, k, v, visible, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (scale * q @ k.transpose(-1, -2)).masked_fill(~torch.as_tensor(visible), -torch.inf)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def _bounds(primal, tangent, visible, scale, ops):
    """First-order bounds on |two float64 evaluations' difference| of O' and LSE': each weight P_ij within
    factor(2, ops, 4 |S|max) of exact, and each sum's terms' magnitudes sum_j P |S' - mu| |V| + P |V'| (O') and
    sum_j P |S'| (LSE'), twice (two evaluations)."""
    q, k, v = primal
    dq, dk, dv = tangent
    group = q.shape[1] // k.shape[1]
    k, v, dk, dv = (np.repeat(x, group, axis=1) for x in (k, v, dk, dv))
    s = np.where(visible, scale * q @ np.swapaxes(k, -1, -2), -np.inf)
    ds = np.where(visible, scale * (dq @ np.swapaxes(k, -1, -2) + q @ np.swapaxes(dk, -1, -2)), 0.0)
    top = np.max(s, axis=-1, keepdims=True)
    alive = np.isfinite(top)
    e = np.where(visible & alive, np.exp(s - np.where(alive, top, 0.0)), 0.0)
    p = e / np.maximum(e.sum(axis=-1, keepdims=True), 1e-300)
    mu = (p * ds).sum(axis=-1, keepdims=True)
    rel = factor(2, ops, 4 * (np.abs(s[np.isfinite(s)]).max() + 1))
    mag_out = (p * (np.abs(ds) + np.abs(mu))) @ np.abs(v) + p @ np.abs(dv) + np.abs(mu) * (p @ np.abs(v))
    mag_lse = (p * np.abs(ds)).sum(axis=-1)
    return 2 * rel * mag_out + UNDERFLOW, 2 * rel * mag_lse + UNDERFLOW


@pytest.mark.lemma("L15")
@pytest.mark.slow  # 6 s: torch's forward-mode AD sets itself up on its first call (the default tier's budget)
@pytest.mark.parametrize("causal, n_q, n_k", [(False, 7, 11), (True, 7, 11), (True, 11, 6)])  # 11 x 6: dead rows
def test_the_jvp_is_torch_forward_mode_ad_of_the_definition(causal, n_q, n_k):
    primal, tangent = _problem(1, n_q=n_q, n_k=n_k)
    visible = masks.causal().dense(n_q, n_k) if causal else np.ones((n_q, n_k), bool)
    scale = 0.5
    out, lse, dout, dlse = jvp.dense(*primal, *tangent, causal=causal, scale=scale)
    import torch.autograd.forward_ad as forward_ad  # torch.func.jvp's engine, without functorch's 9 s first call

    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(torch.tensor(x), torch.tensor(t)) for x, t in zip(primal, tangent)]
        do, dl = (forward_ad.unpack_dual(y).tangent for y in _torch_attention(*duals, visible, scale))
    bound_out, bound_lse = _bounds(primal, tangent, visible, scale, ops=2 * 4 + n_k + 8)
    alive = np.isfinite(lse)
    np.testing.assert_array_less(np.abs(dout - do.numpy())[alive], bound_out[alive])
    np.testing.assert_array_less(np.abs(dlse - dl.numpy())[alive], bound_lse[alive])
    assert np.all(dout[~alive] == 0) and np.all(dlse[~alive] == 0)  # a row without a key: zero tangents


@pytest.mark.lemma("L15")
@pytest.mark.parametrize("block_k, causal", [(1, False), (4, True), (16, True)])
def test_one_pass_over_key_tiles_gives_the_dense_jvp(block_k, causal):
    primal, tangent = _problem(2, heads=4, heads_kv=2, n_q=9, n_k=13)
    visible = masks.causal().dense(9, 13) if causal else np.ones((9, 13), bool)
    dense = jvp.dense(*primal, *tangent, causal=causal)
    online = jvp.online(*primal, *tangent, causal=causal, block_k=block_k)
    bound_out, bound_lse = _bounds(primal, tangent, visible, 0.5, ops=2 * 4 + 13 + 4 * 13 + 8)  # plus a fold's
    alive = np.isfinite(dense[1])                                                               # rescalings
    for got, want, bound in ((online[2], dense[2], bound_out), (online[3], dense[3], bound_lse)):
        np.testing.assert_array_less(np.abs(got - want)[alive], bound[alive])
    np.testing.assert_allclose(online[0], dense[0], rtol=0, atol=float(bound_out.max()))  # O itself: the same sums


@pytest.mark.lemma("L15")
@settings(deadline=None, max_examples=30)
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(0, 4), min_size=3, max_size=3))
def test_the_extended_merge_is_associative_and_the_identity_is_exact(seed, sizes):
    rng = np.random.default_rng(seed)
    d = 3
    parts = []
    for n in sizes:  # key blocks of 0 to 4 keys (0: the identity), two rows
        s = 3 * rng.standard_normal((2, n))
        parts.append(jvp.block(s, rng.standard_normal((2, n)), rng.standard_normal((n, d)),
                               rng.standard_normal((n, d))) if n else jvp.identity(2, d))
    x, y, z = parts
    left, right = jvp.merge(jvp.merge(x, y), z), jvp.merge(x, jvp.merge(y, z))
    assert np.array_equal(left.m, right.m)  # a max: exact in any order
    # Each block's sums reach the result through at most two rescalings (an exp of an argument <= 0 whose
    # subtraction is rounded too) and two additions, on either side: within factor(2, 4, gap) of their exact
    # contribution, gap the span of the blocks' maxima; the magnitude is the merge of the blocks' absolute sums.
    finite = [p.m[np.isfinite(p.m)] for p in parts]
    span = np.ptp(np.concatenate(finite)) if sum(f.size for f in finite) else 0.0
    absolute = [jvp.State(p.m, p.l, np.abs(p.acc), np.abs(p.a), np.abs(p.b), np.abs(p.c)) for p in parts]
    magnitude = jvp.merge(jvp.merge(absolute[0], absolute[1]), absolute[2])
    for field in ("l", "acc", "a", "b", "c"):
        bound = 2 * factor(2, 4, 2 * span) * getattr(magnitude, field) + UNDERFLOW
        np.testing.assert_array_less(np.abs(getattr(left, field) - getattr(right, field)), bound)
    same = jvp.merge(x, jvp.identity(2, d))
    assert all(np.array_equal(getattr(same, f), getattr(x, f)) for f in ("m", "l", "acc", "a", "b", "c"))
