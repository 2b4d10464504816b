"""The derived rule with a score mod (tolerance.baseline(score_mod=...), proofs/L13 claim 5): the reference
and the naive float32 evaluations apply the mod, and the score term carries its derivative,
W' = P u |S| |mod'(S)|. Judged here on a float32 online-softmax evaluation written in this file (tile by tile,
the mod at global positions, as a kernel would), so the rule is ready for the kernels that will take mods."""

import math

import numpy as np
import pytest

from fa_numba import mods, reference, tolerance

pytestmark = pytest.mark.lemma("L13")


def _inputs(seed=0, heads=2, n_q=24, n_k=40, d=8):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, heads, n, d)) for n in (n_q, n_k, n_k))


def _online_f32(q, k, v, mod, *, causal, block_q, block_k, local=False):
    """FlashAttention-2's order in float32: per query tile, key tiles folded by the online softmax; S = scale
    Q K^T rounded to float32, then the mod at each pair's global position (local=True: the tile's own
    positions, a deliberate mistake), -inf where causal hides the pair."""
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    _, heads, n_q, d = q.shape
    n_k = k.shape[2]
    scale = np.float32(1 / math.sqrt(d))
    out = np.zeros((1, heads, n_q, d), np.float32)
    lse = np.zeros((1, heads, n_q), np.float32)
    visible_all = reference.visible_mask(n_q, n_k, causal)
    for r0 in range(0, n_q, block_q):
        rows = slice(r0, min(r0 + block_q, n_q))
        m = np.full((1, heads, rows.stop - r0), -np.inf, np.float32)
        l = np.zeros_like(m)
        acc = np.zeros((1, heads, rows.stop - r0, d), np.float32)
        for c0 in range(0, n_k, block_k):
            cols = slice(c0, min(c0 + block_k, n_k))
            s = (q32[:, :, rows] @ np.swapaxes(k32[:, :, cols], -1, -2)) * scale
            visible = visible_all[rows, cols]
            origin = (0, 0) if local else (r0, c0)
            s = mods.scores(mod, s, visible, np.float32, origin=origin)
            m_new = np.maximum(m, s.max(axis=-1))
            shift = np.where(np.isfinite(m_new), m_new, np.float32(0))
            alpha = np.exp(m - shift)
            p = np.exp(s - shift[..., None])
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ v32[:, :, cols]
            m = m_new
        with np.errstate(invalid="ignore", divide="ignore"):
            out[:, :, rows] = np.where(l[..., None] > 0, acc / l[..., None], 0)
            lse[:, :, rows] = np.where(l > 0, m + np.log(l), -np.inf)
    return out, lse


MODS = {"alibi": lambda: mods.alibi([0.5, 0.125]), "softcap": lambda: mods.softcap(1.5),
        "temperature": lambda: mods.temperature(0.3)}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", sorted(MODS))
def test_an_online_float32_evaluation_with_a_mod_passes_the_rule(name, causal):
    q, k, v = _inputs()
    mod = MODS[name]()
    out, lse = _online_f32(q, k, v, mod, causal=causal, block_q=8, block_k=16)
    tolerance.check_attention(out, lse, q, k, v, causal=causal, order="v2", block_q=8, block_k=16, score_mod=mod,
                              name=f"online float32 with {name}")


def test_the_rule_fails_a_mod_evaluated_at_tile_local_positions():
    q, k, v = _inputs(seed=1)
    mod = mods.alibi([0.5, 0.125])
    out, lse = _online_f32(q, k, v, mod, causal=False, block_q=8, block_k=16, local=True)
    with pytest.raises(AssertionError):
        tolerance.check_attention(out, lse, q, k, v, order="v2", block_q=8, block_k=16, score_mod=mod)


def test_the_identity_mod_gives_the_rule_without_a_mod():
    """temperature(1): S' = S exactly (division by 1), mod' = 1: every tolerance the same bits as no mod."""
    q, k, v = _inputs(seed=2)
    plain = tolerance.baseline(q, k, v, causal=True, block_q=8, block_k=16)
    modded = tolerance.baseline(q, k, v, causal=True, block_q=8, block_k=16, score_mod=mods.temperature(1.0))
    assert modded.tolerances("v2") == plain.tolerances("v2") and modded.terms == plain.terms


def test_a_temperature_carries_its_derivative_into_the_score_term():
    """S / t is the problem at scale / t: W' = P u |S| / t must equal that problem's W = P u |S / t| (bit for bit
    with t a power of two). Without the derivative the term would be t times too small."""
    q, k, v = _inputs(seed=3)
    t = 0.25
    scale = 1 / math.sqrt(q.shape[-1])
    modded = tolerance.baseline(q, k, v, scale=scale, score_mod=mods.temperature(t)).terms
    scaled = tolerance.baseline(q, k, v, scale=scale / t).terms
    # Exact: t = 1/4 is a power of two, so S / t = 4 S, the scale scale / t and mod' = 1 / t = 4 all scale by 4
    # without a rounding (barring overflow): both compute the same P from the same S' and W' = P u (4 |S|) in
    # the same order, bit for bit.
    assert modded.score_out == scaled.score_out
    assert modded.score_lse == scaled.score_lse


def test_a_mod_without_its_derivative_is_refused_by_name():
    forward_only = mods.ScoreMod(lambda s, b, h, i, j: s + 1.0, name="shift")
    q, k, v = _inputs(seed=4)
    with pytest.raises(ValueError, match="score_mod shift has no grad"):
        tolerance.baseline(q, k, v, score_mod=forward_only)
