"""Score mods on the reference side (fa_numba.mods, reference's score_mod=; proofs/L13_score_mods.md).

Every built-in and two mods written here (one with a captured (H, N_k) bias table and its gradient) forward
against torch's flex_attention run eagerly in float64 on CPU, and forward and backward (captured arrays'
gradients included) against torch autograd through a dense float64 implementation written here, not through
reference.py. Float64 comparisons use first-order bounds derived from the operations (`_bounds`), never an rtol.
"""

import doctest
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from bounds import U64, assert_within, dense_counts, online_counts, softmax_bound
from fa_numba import masks, mods, reference, shapes, tolerance
from fa_numba import online_softmax as osm

NO_TORCH = "needs PyTorch (pip install torch==2.13.0, the CPU build, or the 'torch' extra)"


# ----------------------------------------------------------------------------------------------------
# The mods under test: each with its torch twin (the same function on tensors, as flex_attention's
# score_mod takes it) and the Lipschitz constants of its two derivatives in the score (for the bounds).


def _key_bias(score, b, h, i, j, bias):
    return score + bias[h, j]


def _key_bias_grad(score, b, h, i, j, bias):
    return 1.0


def _key_bias_table_grad(score, b, h, i, j, bias):
    return (h, j), 1.0


def key_bias(table) -> mods.ScoreMod:
    """A user-written mod with a captured array: a learned bias per (query head, key), (H, N_k)."""
    return mods.ScoreMod(_key_bias, _key_bias_grad, (_key_bias_table_grad,), "key_bias", (np.asarray(table),),
                         ("bias",))


def _decay(score, b, h, i, j):
    return score * math.exp(-0.25 * abs(i - j))


def _decay_grad(score, b, h, i, j):
    return math.exp(-0.25 * abs(i - j))


DECAY = mods.ScoreMod(_decay, _decay_grad, name="decay")  # a user-written mod without captured arrays


@dataclass(frozen=True)
class Spec:
    name: str
    make: Callable  # (heads, n_q, n_k, rng) -> ScoreMod
    torch_fn: Callable  # (torch, captured tensors) -> score_mod(score, b, h, i, j) on tensors
    lip_grad: Callable = lambda mod: 0.0  # |d grad / d score| <= this
    lip_captured: Callable = lambda mod: 0.0  # |d captured derivative / d score| <= this


def _alibi_slopes(heads):
    return 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)


SPECS = [
    Spec("alibi", lambda h, n_q, n_k, rng: mods.alibi(_alibi_slopes(h)),
         lambda torch, c: lambda s, b, h, i, j: s + c[0][h] * (j - i)),
    Spec("softcap", lambda h, n_q, n_k, rng: mods.softcap(1.5),
         lambda torch, c: lambda s, b, h, i, j: c[0][0] * torch.tanh(s / c[0][0]),
         lambda mod: 0.77 / mod.captured[0][0], lambda mod: 1.0 / mod.captured[0][0]),
    Spec("relative_bias", lambda h, n_q, n_k, rng: mods.relative_bias(rng.standard_normal((h, n_q + n_k - 1)), n_k=n_k),
         lambda torch, c: lambda s, b, h, i, j: s + c[0][h, i - j + int(c[1][0])]),
    Spec("temperature", lambda h, n_q, n_k, rng: mods.temperature(0.6),
         lambda torch, c: lambda s, b, h, i, j: s / c[0][0],
         lip_captured=lambda mod: 1.0 / mod.captured[0][0] ** 2),
    Spec("key_bias", lambda h, n_q, n_k, rng: key_bias(rng.standard_normal((h, n_k))),
         lambda torch, c: lambda s, b, h, i, j: s + c[0][h, j]),
    Spec("decay", lambda h, n_q, n_k, rng: DECAY,
         lambda torch, c: lambda s, b, h, i, j: s * torch.exp(-0.25 * (i - j).abs().to(torch.float64))),
]
BUILT_INS = ("alibi", "softcap", "relative_bias", "temperature")


@dataclass(frozen=True)
class Problem:
    batch: int
    heads: int
    heads_kv: int
    n_q: int
    n_k: int
    d: int
    mask: object = None
    scale: float | None = None
    amplitude: float = 1.0

    def inputs(self, seed):
        rng = np.random.default_rng(seed)
        q = self.amplitude * rng.standard_normal((self.batch, self.heads, self.n_q, self.d))
        k = self.amplitude * rng.standard_normal((self.batch, self.heads_kv, self.n_k, self.d))
        v = rng.standard_normal((self.batch, self.heads_kv, self.n_k, self.d))
        dout = rng.standard_normal(q.shape)
        return rng, q, k, v, dout


PROBLEMS = {
    "gqa-batch2": Problem(2, 4, 2, 5, 7, 4, amplitude=1.5),  # no mask, GQA, N_q < N_k
    "causal": Problem(1, 2, 2, 8, 8, 3, mask=masks.causal(), amplitude=2.0),
    "window-scale": Problem(1, 2, 1, 9, 6, 5, mask=masks.sliding_window(2, 3), scale=0.9),  # N_q > N_k, no dead row
}


def _visible(problem: Problem) -> np.ndarray:
    return reference.visible_mask(problem.n_q, problem.n_k, mask=problem.mask)


# ----------------------------------------------------------------------------------------------------
# torch: flex_attention eagerly, and a dense float64 implementation through autograd.


def _torch():
    return pytest.importorskip("torch", reason=NO_TORCH)


def _flex(torch, q, k, v, score_mod, visible, scale, gqa):
    """torch's flex_attention, eagerly on CPU in float64: (out, lse). A skip with the reason if it cannot."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    except ImportError as exc:
        pytest.skip(f"torch {torch.__version__} has no flex_attention with AuxRequest: {exc}")
    vis = torch.from_numpy(visible)
    n_q, n_k = visible.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": eager on purpose
        try:
            block_mask = create_block_mask(lambda b, h, i, j: vis[i, j], None, None, n_q, n_k, device="cpu")
            out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                      enable_gqa=gqa, return_aux=AuxRequest(lse=True))
        except (NotImplementedError, RuntimeError) as exc:
            pytest.skip(f"flex_attention does not run eagerly on CPU in float64 in torch {torch.__version__}: {exc}")
    return out.numpy(), aux.lse.numpy()


def _torch_dense(torch, q, k, v, score_mod, visible, scale, group):
    """softmax(where(visible, mod(scale Q K^T), -inf)) V and its LSE, in torch ops (autograd differentiates)."""
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = scale * (q @ k.transpose(-1, -2))
    batch, heads, n_q, n_k = s.shape
    b = torch.arange(batch).view(batch, 1, 1, 1)
    h = torch.arange(heads).view(1, heads, 1, 1)
    i = torch.arange(n_q).view(1, 1, n_q, 1)
    j = torch.arange(n_k).view(1, 1, 1, n_k)
    s = torch.where(torch.from_numpy(visible), score_mod(s, b, h, i, j), -torch.inf)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


# ----------------------------------------------------------------------------------------------------
# First-order float64 bounds for comparing two evaluations (each within the bound of the exact value).


def _captured_terms(mod, s_raw, visible):
    """Per captured array with a gradient: [(entry, (b, h, i, j), derivative)] over the visible pairs."""
    out = []
    for k, cg in enumerate(mod.captured_grad):
        if cg is None:
            out.append(None)
            continue
        terms = []
        for _, (b, h, i, j) in mods.core._pairs(s_raw.shape, visible):
            index, value = cg(np.float64(s_raw[b, h, i, j]), b, h, i, j, *mod.captured)
            terms.append((tuple(int(x) for x in np.atleast_1d(index)), (b, h, i, j), float(value)))
        out.append(terms)
    return out


@dataclass(frozen=True)
class Bounds:
    out: np.ndarray  # (B, H, N_q, d)
    lse: np.ndarray  # (B, H, N_q)
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dcaptured: tuple
    grads: reference.DenseBackward


def _bounds(q, k, v, dout, *, mask, scale, mod, lip_grad=0.0, lip_captured=0.0) -> Bounds:
    """Bounds on |computed - exact| of one float64 evaluation of out, lse, dq, dk, dv and the captured
    gradients, to first order in u = 2^-53, from the reference's own S, S', P and magnitudes:

    S' is off by at most u sigma, sigma = (d + 2) |g| S_abs + 8 M, S_abs = |scale| |Q| |K|^T, g = mod'(S), and
    M = |g S| + |S'| + |S' - S| the size of what the mod adds (its own roundings: at most 8 of them, each of
    at most that size); each weight exp(S' - m) is then off by eps = u (sigma + |S'| + max|S'| + 3) relative
    (the subtraction, exp's 3 u); l by sum P eps + N_k u. O moves by sum P (|V| + |O|) eps + u (2 N_k + 2) P|V|,
    LSE by sum P eps + u (|LSE| + 3 log N_k + N_k + 2). The backward: P off by P (eps + err(LSE) + (N_k + 4) u)
    (recomputed or kept), dP by d u A, A = |dO| |V|^T, D by what its two forms (rowsum dO O, sum_j P dP) lose,
    dS' = P (dP - D) by the product rule, g by u (8 (1 + |g|)) + lip_grad (d + 2) u S_abs, dS = g dS' by both;
    then each sum of N terms adds (N + 2) u of its terms' magnitude. A captured derivative c is off by
    u (8 (1 + |c|)) + lip_captured (d + 2) u S_abs."""
    grads = reference.dense_backward(q, k, v, dout, mask=mask, scale=scale, score_mod=mod)
    forward = reference.dense(q, k, v, mask=mask, scale=scale, score_mod=mod)
    prob = grads.problem
    visible = grads.visible
    u = U64
    q4, k4, v4, do4, out4 = grads.q, grads.k, grads.v, grads.dout, grads.out
    p = grads.p
    sc = abs(float(grads.scale))
    s_raw = np.where(visible, grads.s_raw, 0.0)
    s_mod = np.where(visible, forward.s, 0.0)
    g = grads.mod_grad
    s_abs = np.where(visible, sc * np.abs(q4) @ np.swapaxes(np.abs(k4), -1, -2), 0.0)
    size = np.abs(g * s_raw) + np.abs(s_mod) + np.abs(s_mod - s_raw)
    sigma = (prob.d + 2) * np.abs(g) * s_abs + 8 * size
    row_max = np.abs(s_mod).max(axis=-1, keepdims=True)
    eps = u * (sigma + np.abs(s_mod) + row_max + 3)
    peps = (p * eps).sum(axis=-1)  # (B, H, N_q)
    lse = forward.lse
    lse_b = peps + u * (np.where(np.isfinite(lse), np.abs(lse), 0) + 3 * math.log(prob.n_k) + prob.n_k + 2)
    pv = p @ np.abs(v4)
    out_b = (p * eps) @ np.abs(v4) + np.abs(out4) * peps[..., None] + u * (2 * prob.n_k + 2) * pv
    # backward
    dp_err = p * (eps + lse_b[..., None] + (prob.n_k + 4) * u)  # error of P
    a = np.abs(do4) @ np.swapaxes(np.abs(v4), -1, -2)  # A_ij
    b_row = (np.abs(do4) * np.abs(out4)).sum(axis=-1) + (p * a).sum(axis=-1)  # >= |D_i|, both forms
    d_err = (u * (prob.d + prob.n_k) * b_row + (np.abs(do4) * out_b).sum(axis=-1) + (dp_err * a).sum(axis=-1))
    ds_mod = grads.ds_mod
    ds_mod_err = (dp_err * (a + b_row[..., None]) + p * (prob.d * u * a + d_err[..., None])
                  + 2 * u * p * (a + b_row[..., None]))
    g_err = np.where(visible, u * 8 * (1 + np.abs(g)) + lip_grad * (prob.d + 2) * u * s_abs, 0.0)
    ds = ds_mod * g
    ds_err = np.abs(g) * ds_mod_err + np.abs(ds_mod) * g_err + u * np.abs(ds)
    dq_b = sc * (ds_err + u * (prob.n_k + 2) * np.abs(ds)) @ np.abs(k4)
    n_sum = prob.n_q * prob.group
    grouped = (prob.batch, prob.heads_kv, prob.group, prob.n_k, prob.d)
    dk_b = (sc * np.swapaxes(ds_err + u * (n_sum + 2) * np.abs(ds), -1, -2) @ np.abs(q4)).reshape(grouped).sum(2)
    dv_b = (np.swapaxes(dp_err + u * (n_sum + 2) * p, -1, -2) @ np.abs(do4)).reshape(grouped).sum(2)
    dcap_b = []
    n_pairs = prob.batch * prob.heads * int(visible.sum())
    for k_, terms in enumerate(_captured_terms(mod, grads.s_raw, visible)):
        if terms is None:
            dcap_b.append(None)
            continue
        bound = np.zeros(mod.captured[k_].shape)
        for entry, (b, h, i, j), c in terms:
            c_err = u * 8 * (1 + abs(c)) + lip_captured * (prob.d + 2) * u * s_abs[b, h, i, j]
            bound[entry] += (ds_mod_err[b, h, i, j] * abs(c) + abs(ds_mod[b, h, i, j]) * c_err
                             + u * (n_pairs + 2) * abs(ds_mod[b, h, i, j] * c))
        dcap_b.append(bound)
    return Bounds(out_b, lse_b, dq_b, dk_b, dv_b, tuple(dcap_b), grads)


def _assert_within(name, ours, theirs, bound, *, power=True):
    """|ours - theirs| <= 2 bound entry by entry (two evaluations), no NaN; and the bound has power: below
    1e-9 of the values' scale, so any real mistake (a missing factor, a wrong sign) fails."""
    ours, theirs = np.asarray(ours, float), np.asarray(theirs, float)
    assert ours.shape == theirs.shape, f"{name}: shape {ours.shape} vs {theirs.shape}"
    assert np.isfinite(ours).all() and np.isfinite(theirs).all(), f"{name}: not finite"
    excess = np.abs(ours - theirs) - 2 * np.broadcast_to(bound, ours.shape)
    assert (excess <= 0).all(), (f"{name}: |ours - torch| exceeds its float64 bound by {excess.max():.3e} "
                                 f"(at {np.unravel_index(excess.argmax(), excess.shape)})")
    if power:
        assert 2 * np.max(bound) <= 1e-9 * max(float(np.abs(theirs).max()), 1.0), f"{name}: bound too loose"


def _seed(spec, problem):
    return 10 * SPECS.index(spec) + list(PROBLEMS).index(problem)


def _spec(name):
    return next(s for s in SPECS if s.name == name)


# ----------------------------------------------------------------------------------------------------
# Forward against flex_attention, forward and backward against torch autograd.


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("problem", list(PROBLEMS), ids=list(PROBLEMS))
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_forward_matches_flex_attention_in_float64(spec, problem):
    torch = _torch()
    prob = PROBLEMS[problem]
    rng, q, k, v, _ = prob.inputs(seed=_seed(spec, problem))
    mod = spec.make(prob.heads, prob.n_q, prob.n_k, rng)
    visible = _visible(prob)
    out, lse = reference.attention(q, k, v, mask=prob.mask, scale=prob.scale, score_mod=mod)
    captured = [torch.from_numpy(np.array(c)) for c in mod.captured]
    scale = shapes.resolve_scale(prob.scale, prob.d)
    flex_out, flex_lse = _flex(torch, *(torch.from_numpy(x) for x in (q, k, v)), spec.torch_fn(torch, captured),
                               visible, scale, prob.heads != prob.heads_kv)
    b = _bounds(q, k, v, np.zeros_like(q), mask=prob.mask, scale=prob.scale, mod=mod,
                lip_grad=spec.lip_grad(mod), lip_captured=spec.lip_captured(mod))
    _assert_within("out", out, flex_out, b.out)
    _assert_within("lse", lse, flex_lse, b.lse)
    # and the mod changes the result (the comparison has power against a mod left out)
    plain, _ = reference.attention(q, k, v, mask=prob.mask, scale=prob.scale)
    assert np.abs(plain - out).max() > 1e-3


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("problem", list(PROBLEMS), ids=list(PROBLEMS))
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_gradients_match_torch_autograd_through_a_dense_float64_implementation(spec, problem):
    torch = _torch()
    prob = PROBLEMS[problem]
    rng, q, k, v, dout = prob.inputs(seed=_seed(spec, problem) + 1000)
    mod = spec.make(prob.heads, prob.n_q, prob.n_k, rng)
    visible = _visible(prob)
    dq, dk, dv, dcaptured = reference.attention_backward_mod(q, k, v, dout, mask=prob.mask, scale=prob.scale,
                                                             score_mod=mod)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    captured = [torch.from_numpy(np.array(c)).requires_grad_(diff)
                for c, diff in zip(mod.captured, mod.differentiable)]
    scale = shapes.resolve_scale(prob.scale, prob.d)
    out, lse = _torch_dense(torch, tq, tk, tv, spec.torch_fn(torch, captured), visible, scale,
                            prob.heads // prob.heads_kv)
    out.backward(torch.from_numpy(dout))
    b = _bounds(q, k, v, dout, mask=prob.mask, scale=prob.scale, mod=mod,
                lip_grad=spec.lip_grad(mod), lip_captured=spec.lip_captured(mod))
    ref_out, ref_lse = reference.attention(q, k, v, mask=prob.mask, scale=prob.scale, score_mod=mod)
    _assert_within("out", ref_out, out.detach().numpy(), b.out)
    _assert_within("lse", ref_lse, lse.detach().numpy(), b.lse)
    for name, ours, theirs, bound in (("dq", dq, tq.grad, b.dq), ("dk", dk, tk.grad, b.dk), ("dv", dv, tv.grad, b.dv)):
        _assert_within(name, ours, theirs.numpy(), bound)
    assert len(dcaptured) == len(mod.captured)
    for name, ours, theirs, bound in zip(mod.captured_names, dcaptured, captured, b.dcaptured):
        if ours is None:
            assert theirs.grad is None, name
            continue
        assert ours.shape == theirs.shape and ours.dtype == np.float64
        _assert_within(f"d{name}", ours, theirs.grad.numpy(), bound, power=False)
        assert 2 * bound.max() <= 1e-9 * max(float(np.abs(ours).max()), 1.0), f"d{name}: bound too loose"
    # attention_backward gives the same dq, dk, dv, bit for bit
    for ours, again in zip((dq, dk, dv), reference.attention_backward(q, k, v, dout, mask=prob.mask,
                                                                       scale=prob.scale, score_mod=mod)):
        assert np.array_equal(ours, again)


@pytest.mark.lemma("L13")
def test_the_captured_gradient_is_bitwise_repeatable_and_a_sum_over_the_pairs():
    """Claim 4: dcaptured[e] is the sum over the pairs that read e of dS' times the derivative, in (b, h, i, j)
    order; two calls give the same bits, and the sum recomputed here in that order too."""
    prob = PROBLEMS["gqa-batch2"]
    rng, q, k, v, dout = prob.inputs(seed=7)
    mod = mods.relative_bias(rng.standard_normal((prob.heads, prob.n_q + prob.n_k - 1)), n_k=prob.n_k)
    first = reference.attention_backward_mod(q, k, v, dout, score_mod=mod)
    second = reference.attention_backward_mod(q, k, v, dout, score_mod=mod)
    assert all(np.array_equal(a, b) for a, b in zip(first[:3], second[:3]))
    assert np.array_equal(first[3][0], second[3][0]) and first[3][1] is None and second[3][1] is None
    grads = reference.dense_backward(q, k, v, dout, score_mod=mod)
    table = np.zeros(mod.captured[0].shape)
    for b, h, i, j in np.ndindex(grads.ds_mod.shape):  # lexicographic (b, h, i, j)
        table[h, i - j + prob.n_k - 1] += grads.ds_mod[b, h, i, j]
    assert np.array_equal(table, first[3][0])
    # with an additive mod the table's gradient sums dS along diagonals: its total is sum dS = 0 per row
    assert abs(table.sum()) <= 64 * U64 * np.abs(grads.ds_mod).sum()


def _tiled(mod, grads, lse, block_q, block_k, *, origin=True):
    """The v2 order tile by tile in NumPy (online_softmax's update and the backward's per-tile formulas),
    the mod evaluated per tile at global positions (origin=False: tile-local ones, which is wrong).
    Returns out, dq, dk, dv (4-D, K/V heads repeated) and the captured gradients summed tile by tile."""
    s_raw, vis_all, scale = grads.s_raw, grads.visible, grads.scale
    q4, k4, v4, do4 = grads.q, grads.k, grads.v, grads.dout
    batch, heads, n_q, n_k = s_raw.shape
    heads_all = [(b, h) for b in range(batch) for h in range(heads)]
    out, dq = np.zeros_like(q4), np.zeros_like(q4)
    dk, dv = np.zeros_like(k4), np.zeros_like(v4)
    dcap = [None if cg is None else np.zeros(c.shape) for c, cg in zip(mod.captured, mod.captured_grad)]
    for r0 in range(0, n_q, block_q):
        r1 = min(r0 + block_q, n_q)
        tiles = [(c0, min(c0 + block_k, n_k)) for c0 in range(0, n_k, block_k)
                 if vis_all[r0:r1, c0:c0 + block_k].any()]  # SKIP tiles are never touched
        state = {bh: osm.identity(r1 - r0, q4.shape[-1]) for bh in heads_all}
        for c0, c1 in tiles:
            vis = vis_all[r0:r1, c0:c1]
            tile = mods.scores(mod, s_raw[:, :, r0:r1, c0:c1], vis, origin=(r0, c0) if origin else (0, 0))
            for b, h in heads_all:
                state[b, h] = osm.update(state[b, h], tile[b, h], v4[b, h, c0:c1], vis)
        for b, h in heads_all:
            out[b, h, r0:r1] = osm.finalize(state[b, h], vis_all[r0:r1].any(axis=1))[0]
        for c0, c1 in tiles:  # the backward's visits of the same tiles, from the forward's LSE
            vis = vis_all[r0:r1, c0:c1]
            at = (r0, c0) if origin else (0, 0)
            raw = s_raw[:, :, r0:r1, c0:c1]
            tile = mods.scores(mod, raw, vis, origin=at)
            g = mods.derivatives(mod, raw, vis, origin=at)
            ds_mod = np.zeros(raw.shape)
            for b, h in heads_all:
                p = osm.recompute_p(tile[b, h], lse[b, h, r0:r1], vis)
                dp = do4[b, h, r0:r1] @ v4[b, h, c0:c1].T
                ds_mod[b, h] = osm.score_gradient(p, dp, grads.d_row[b, h, r0:r1], vis)
                ds = ds_mod[b, h] * g[b, h]
                dq[b, h, r0:r1] += scale * ds @ k4[b, h, c0:c1]
                dk[b, h, c0:c1] += scale * ds.T @ q4[b, h, r0:r1]
                dv[b, h, c0:c1] += p.T @ do4[b, h, r0:r1]
            for total, piece in zip(dcap, mods.captured_gradients(mod, raw, ds_mod, vis, origin=at)):
                if total is not None:
                    total += piece
    return out, dq, dk, dv, dcap


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("name", ["alibi", "softcap", "relative_bias", "key_bias", "decay"])
def test_tiles_compose_with_the_mod_at_global_positions(name):
    """Claims 1 and 3: the mod evaluated per tile at the pairs' global positions, before the online softmax,
    and the backward's dS = dS' mod'(S) per tile, give the dense result (within the bounds of both orders);
    SKIP tiles are never touched. Positions taken inside the tile instead break it for a mod that reads them."""
    spec = _spec(name)
    prob = Problem(1, 2, 1, 7, 9, 3, mask=masks.causal(), amplitude=1.5)  # GQA (group 2), causal, ragged tiles
    rng, q, k, v, dout = prob.inputs(seed=23)
    mod = spec.make(prob.heads, prob.n_q, prob.n_k, rng)
    grads = reference.dense_backward(q, k, v, dout, mask=prob.mask, score_mod=mod)
    forward = reference.dense(q, k, v, mask=prob.mask, score_mod=mod)
    out, dq, dk, dv, dcap = _tiled(mod, grads, forward.lse, 3, 4)
    n_k = prob.n_k
    values = forward.v[:, :, None]  # (B, H, 1, N_k, d): every row reads the same keys
    bound = softmax_bound(forward.s, values, *online_counts(n_k))[0] + softmax_bound(forward.s, values,
                                                                                     *dense_counts(n_k))[0]
    assert_within(out, forward.out, bound, name="out")  # both within their bounds of softmax(S') V
    b = _bounds(q, k, v, dout, mask=prob.mask, scale=None, mod=mod, lip_grad=spec.lip_grad(mod),
                lip_captured=spec.lip_captured(mod))
    grouped = (prob.batch, prob.heads_kv, prob.heads // prob.heads_kv, n_k, prob.d)
    _assert_within("dq", dq, grads.dq, b.dq)
    _assert_within("dk", dk.reshape(grouped).sum(2), grads.dk, b.dk)
    _assert_within("dv", dv.reshape(grouped).sum(2), grads.dv, b.dv)
    for ours, ref, bound in zip(dcap, grads.dcaptured, b.dcaptured):
        if ref is not None:
            _assert_within("dcaptured", ours, ref, bound, power=False)
    if name != "softcap":  # softcap reads no position: local positions change nothing there
        wrong, *_ = _tiled(mod, grads, forward.lse, 3, 4, origin=False)
        assert np.abs(wrong - forward.out).max() > 1e-3


# ----------------------------------------------------------------------------------------------------
# Masked pairs, rows with no visible key, and no mod.


@pytest.mark.lemma("L13")
def test_a_mod_is_never_evaluated_where_the_mask_hides_the_pair():
    """Claim 2: fn and grad are called once per visible pair and head, never at a masked pair: a mod that
    raises there (math.log of a negative number) works, and one that returns NaN there leaks nothing."""
    calls = []

    def logged(score, b, h, i, j):
        calls.append((b, h, i, j))
        return score + math.log(i - j + 1)  # raises ValueError above the causal diagonal (j > i + 1)

    mod = mods.ScoreMod(logged, lambda score, b, h, i, j: 1.0, name="log_distance")
    prob = PROBLEMS["causal"]
    _, q, k, v, dout = prob.inputs(seed=3)
    out, lse = reference.attention(q, k, v, causal=True, score_mod=mod)
    visible = reference.causal_mask(prob.n_q, prob.n_k)
    assert len(calls) == prob.batch * prob.heads * visible.sum()
    assert all(visible[i, j] for _, _, i, j in calls)
    with pytest.raises(mods.ModError, match=r"score_mod log_distance: fn raised ValueError: .* at b=0, h=0, i=0, "
                                            r"j=1.*Python's math raises"):
        reference.attention(q, k, v, score_mod=mod)  # without the mask the pair (0, 2) is evaluated

    def nan_above(score, b, h, i, j):
        return score + (0.0 if j <= i else math.nan)

    nan_mod = mods.ScoreMod(nan_above, lambda score, b, h, i, j: 1.0 if j <= i else math.nan, name="nan_above")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ours, plain in zip(reference.attention(q, k, v, causal=True, score_mod=nan_mod),
                               reference.attention(q, k, v, causal=True)):
            assert np.array_equal(ours, plain)
        for ours, plain in zip(reference.attention_backward(q, k, v, dout, causal=True, score_mod=nan_mod),
                               reference.attention_backward(q, k, v, dout, causal=True)):
            assert np.array_equal(ours, plain)


@pytest.mark.lemma("L13")
def test_softcap_of_an_infinite_score_at_a_masked_pair_does_not_leak():
    """Key 5 holds inf in K and NaN in V: the causal rows that cannot see it (i < 5) get, forward and dq,
    the same bits as with that key zeroed; the rows that see it follow the dense formula (softcap(inf) = cap
    is finite, the NaN value makes O NaN)."""
    prob = PROBLEMS["causal"]
    _, q, k, v, dout = prob.inputs(seed=5)
    mod = mods.softcap(1.5)
    bad_k, bad_v = k.copy(), v.copy()
    bad_k[..., 5, 0] = np.inf
    bad_v[..., 5, :] = np.nan
    zero_k, zero_v = k.copy(), v.copy()
    zero_k[..., 5, :] = 0.0
    zero_v[..., 5, :] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = reference.attention(q, bad_k, bad_v, causal=True, score_mod=mod)
        ref_out, ref_lse = reference.attention(q, zero_k, zero_v, causal=True, score_mod=mod)
        dq, dk, dv, (dcap,) = reference.attention_backward_mod(q, bad_k, bad_v, dout, causal=True, score_mod=mod)
        ref_dq, *_ = reference.attention_backward_mod(q, zero_k, zero_v, dout, causal=True, score_mod=mod)
    assert np.array_equal(out[..., :5, :], ref_out[..., :5, :]) and np.array_equal(lse[..., :5], ref_lse[..., :5])
    assert np.array_equal(dq[..., :5, :], ref_dq[..., :5, :])
    assert np.isnan(out[..., 5:, :]).all() and np.isfinite(lse).all()  # the score is capped, the value is NaN
    assert np.isnan(dcap).all()  # rows 5.. reach the cap's gradient through their NaN O: the dense formula


@pytest.mark.lemma("L13")
def test_rows_with_no_visible_key_stay_zero_with_a_mod():
    """N_q > N_k causal: rows 0 .. N_q - N_k - 1 see no key: O = 0, LSE = -inf, dq = 0, and they add nothing
    to dk, dv or the captured gradient (the same bits as the visible rows alone)."""
    rng = np.random.default_rng(11)
    q, dout = rng.standard_normal((2, 2, 7, 3)), rng.standard_normal((2, 2, 7, 3))
    k, v = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 4, 3))
    mod = mods.alibi([0.5, 0.125])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = reference.attention(q, k, v, causal=True, score_mod=mod)
        dq, dk, dv, (dslopes,) = reference.attention_backward_mod(q, k, v, dout, causal=True, score_mod=mod)
    dead = slice(0, 3)
    assert (out[..., dead, :] == 0).all() and (lse[..., dead] == -np.inf).all() and (dq[..., dead, :] == 0).all()
    garbage = dout.copy()
    garbage[..., dead, :] = 1e300  # what the dead rows' dO hold changes nothing
    _, dk2, dv2, (dslopes2,) = reference.attention_backward_mod(q, k, v, garbage, causal=True, score_mod=mod)
    assert np.array_equal(dk, dk2) and np.array_equal(dv, dv2) and np.array_equal(dslopes, dslopes2)


def _identity(score, b, h, i, j):
    return score


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("problem", list(PROBLEMS), ids=list(PROBLEMS))
def test_no_mod_and_the_identity_mod_give_the_same_bits_as_before(problem):
    """score_mod=None is the old code path; the identity mod and temperature(1) give the same bits too (S' = S
    exactly, dS = dS' * 1 exactly), in float64 and in the float32 twin."""
    prob = PROBLEMS[problem]
    _, q, k, v, dout = prob.inputs(seed=13)
    ident = mods.ScoreMod(_identity, lambda score, b, h, i, j: 1.0, name="identity")
    kw = dict(mask=prob.mask, scale=prob.scale)
    before = reference.attention(q, k, v, **kw)
    before_bwd = reference.attention_backward(q, k, v, dout, **kw)
    for mod in (None, ident, mods.temperature(1.0)):
        assert all(np.array_equal(a, b) for a, b in zip(reference.attention(q, k, v, **kw, score_mod=mod), before))
        assert all(np.array_equal(a, b) for a, b in zip(reference.attention_backward(q, k, v, dout, **kw,
                                                                                      score_mod=mod), before_bwd))
    q32, k32, v32, do32 = (x.astype(np.float32) for x in (q, k, v, dout))
    for c in reference.CONTRACTIONS:
        plain = reference.attention_naive_f32(q32, k32, v32, contraction=c, **kw)
        modded = reference.attention_naive_f32(q32, k32, v32, contraction=c, score_mod=ident, **kw)
        assert all(np.array_equal(a, b) for a, b in zip(plain, modded))
        plain = reference.attention_backward_naive_f32(q32, k32, v32, do32, contraction=c, **kw)
        modded = reference.attention_backward_naive_f32(q32, k32, v32, do32, contraction=c, score_mod=ident, **kw)
        assert all(np.array_equal(a, b) for a, b in zip(plain, modded))
    dense = reference.dense(q, k, v, **kw)
    assert dense.s_raw is None and dense.score_mod is None
    grads = reference.dense_backward(q, k, v, dout, **kw)
    assert grads.s_raw is None and grads.ds_mod is None and grads.mod_grad is None and grads.dcaptured == ()


# ----------------------------------------------------------------------------------------------------
# L6 through the mod: one float32 rounding of every score moves O and LSE by at most the derived term.


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("name", ["alibi", "softcap", "temperature", "decay"])
def test_one_rounding_of_the_score_moves_the_output_by_at_most_the_mods_score_term(name):
    """Claim 5: S -> S (1 + delta), |delta| <= u = 2^-24 per pair, moves S' by mod'(S) S delta to first order,
    so O_ix by at most sum_j W'_ij (|V_jx| + |O_ix|) and LSE_i by sum_j W'_ij, W'_ij = P_ij u |S_ij| |mod'(S_ij)|.
    The worst signs reach the sharp form sum_j W'_ij |V_jx - O_ix| (and sum_j W'_ij for LSE): the term is
    attained, not loose."""
    spec = _spec(name)
    prob = Problem(1, 2, 2, 6, 7, 4, mask=masks.causal() if name == "decay" else None, amplitude=2.5)
    rng, q, k, v, _ = prob.inputs(seed=17)
    mod = spec.make(prob.heads, prob.n_q, prob.n_k, rng)
    base = reference.dense_backward(q, k, v, np.zeros_like(q), mask=prob.mask, score_mod=mod)
    visible, p, o, v4 = base.visible, base.p, base.out, base.v
    s = np.where(visible, base.s_raw, 0.0)
    g = base.mod_grad
    u = tolerance.U32
    w = p * u * np.abs(s) * np.abs(g)  # W'
    term_out = w @ np.abs(v4) + np.abs(o) * w.sum(-1)[..., None]
    term_lse = w.sum(-1)
    sharp = np.einsum("bhij,bhijx->bhix", w, np.abs(v4[:, :, None] - o[:, :, :, None]))
    at = np.unravel_index(sharp.argmax(), sharp.shape)  # the entry whose worst case we build
    direction = np.sign(v4[at[0], at[1], :, at[3]] - o[at])  # per key: which way moves O[at] up
    bnd = _bounds(q, k, v, np.zeros_like(q), mask=prob.mask, scale=None, mod=mod,
                  lip_grad=spec.lip_grad(mod), lip_captured=spec.lip_captured(mod))

    def moved(delta):
        """the reference with S_ij -> S_ij (1 + delta_ij) before the mod: a user mod with a captured array"""
        def fn(score, b, h, i, j, delta, *captured):
            return mod.fn(score * (1.0 + delta[b, h, i, j]), b, h, i, j, *captured)

        perturbed = mods.ScoreMod(fn, name=f"{mod.name}_rounded", captured=(delta,) + mod.captured)
        return reference.attention(q, k, v, mask=prob.mask, score_mod=perturbed)

    lip = spec.lip_grad(mod)
    dmax = float((u * np.abs(s) * (np.abs(g) + lip * u * np.abs(s))).max())  # largest move of an S'
    second_out = 3 * np.abs(v4).max() * dmax**2 + np.abs(v4).max() * lip * (u * np.abs(s)).max() ** 2
    second_lse = dmax**2
    noise_out, noise_lse = 2 * bnd.out, 2 * bnd.lse  # two float64 evaluations, each within one bound
    worst = u * np.sign(s * g) * direction[None, None, None, :]  # every row: towards O[at] growing
    out_w, _ = moved(np.broadcast_to(worst, s.shape).copy())
    change = out_w - o.reshape(out_w.shape)
    assert (np.abs(change) <= term_out + second_out + noise_out).all()
    assert change[at] >= sharp[at] - second_out - noise_out[at]  # attained: the term is not loose
    _, lse_w = moved(u * np.sign(s * g))
    lse_change = lse_w - base.shift
    assert (np.abs(lse_change) <= term_lse + second_lse + noise_lse).all()
    assert (lse_change >= term_lse - second_lse - noise_lse).all()
    for seed in range(3):  # random roundings stay inside too
        delta = np.random.default_rng(seed).uniform(-u, u, s.shape)
        out_r, lse_r = moved(delta)
        assert (np.abs(out_r - o) <= term_out + second_out + noise_out).all()
        assert (np.abs(lse_r - base.shift) <= term_lse + second_lse + noise_lse).all()


# ----------------------------------------------------------------------------------------------------
# mods.check


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_check_passes_on_every_built_in_and_the_user_mods(spec):
    rng = np.random.default_rng(0)
    mod = spec.make(3, 5, 6, rng)
    assert mods.check(mod, n_q=5, n_k=6, heads=3, batch=2, examples=60) is None


@pytest.mark.lemma("L13")
def test_check_fails_on_a_wrong_score_derivative_and_names_it():
    cap = mods.softcap(2.0)
    wrong = mods.ScoreMod(cap.fn, lambda s, b, h, i, j, c: 1.0 - math.tanh(s / c[0]),  # the square forgotten
                          cap.captured_grad, "softcap_wrong", cap.captured, cap.captured_names)
    with pytest.raises(mods.ModCheckError, match=r"softcap_wrong: d fn / d score disagrees .* grad gives") as info:
        mods.check(wrong, n_q=4, n_k=4, heads=1)
    err = info.value
    assert isinstance(err, AssertionError) and err.argument == "score" and err.entry is None
    assert abs(err.claimed - err.central) > err.tolerance
    # wrong only far out: found and shrunk to the edge
    wide = mods.softcap(50.0)  # at cap 2 the derivative beyond 70 is 1e-30, below what differences resolve
    late = mods.ScoreMod(wide.fn, lambda s, b, h, i, j, c: wide.grad(s, b, h, i, j, c) * (1.5 if s > 70 else 1.0),
                         wide.captured_grad, "late", wide.captured)
    with pytest.raises(mods.ModCheckError, match=r"late: d fn / d score") as info:
        mods.check(late, n_q=4, n_k=4, heads=1)
    assert info.value.score > 70


@pytest.mark.lemma("L13")
def test_check_fails_on_a_wrong_captured_gradient_and_names_the_array():
    alibi = mods.alibi([0.5, 0.25])
    flipped = mods.ScoreMod(alibi.fn, alibi.grad, (lambda s, b, h, i, j, sl: ((h,), float(i - j)),),
                            "alibi_flipped", alibi.captured, ("slopes",))
    with pytest.raises(mods.ModCheckError, match=r"d fn / d captured\[0\] \(slopes\) entry \(\d,\) disagrees") as info:
        mods.check(flipped, n_q=5, n_k=5, heads=2)
    assert info.value.argument == "captured[0] (slopes)" and info.value.claimed == -info.value.central != 0
    rb = mods.relative_bias(np.ones((2, 9)))
    shifted = mods.ScoreMod(rb.fn, rb.grad, (lambda s, b, h, i, j, t, o: ((h, i - j + o[0] + 1), 1.0), None),
                            "shifted", rb.captured, rb.captured_names)
    with pytest.raises(mods.ModCheckError, match=r"captured\[0\] \(table\) entry") as info:
        mods.check(shifted, n_q=5, n_k=5, heads=2)
    assert info.value.argument == "captured[0] (table)"
    # naming the right entry with derivative 0 while the pair reads it: caught through the drawn other entry?
    # no: the named entry's own derivative is 1, so the claim 0 fails there
    zero = mods.ScoreMod(rb.fn, rb.grad, (lambda s, b, h, i, j, t, o: ((h, i - j + o[0]), 0.0), None),
                         "zero", rb.captured, rb.captured_names)
    with pytest.raises(mods.ModCheckError, match=r"captured_grad gives 0.0, central difference 1.0"):
        mods.check(zero, n_q=5, n_k=5, heads=2)


def test_check_takes_a_mask_for_a_mod_defined_only_where_it_is_visible():
    mod = mods.ScoreMod(lambda s, b, h, i, j: s + math.log(i - j + 1), lambda s, b, h, i, j: 1.0, name="log")
    with pytest.raises(mods.ModError, match=r"score_mod log: fn raised ValueError"):
        mods.check(mod, n_q=4, n_k=4, heads=1)
    mods.check(mod, n_q=4, n_k=4, heads=1, mask=masks.causal(), examples=20)


def test_check_needs_hypothesis_and_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    with pytest.raises(ImportError, match=r"needs Hypothesis, a test dependency: pip install 'fa_numba\[test\]'"):
        mods.check(mods.softcap(1.0), n_q=2, n_k=2, heads=1)


# ----------------------------------------------------------------------------------------------------
# Arguments, errors, and the Numba subset.


def test_scoremod_arguments_are_checked_and_named():
    with pytest.raises(TypeError, match=r"fn must be a function"):
        mods.ScoreMod(3.0)
    with pytest.raises(TypeError, match=r"grad must be a function .* or None, got str"):
        mods.ScoreMod(_identity, "1")
    with pytest.raises(TypeError, match=r"captured must be a tuple of arrays .* got ndarray"):
        mods.ScoreMod(_identity, captured=np.ones(3))
    with pytest.raises(TypeError, match=r"captured\[0\] must have an integer or floating dtype, got bool"):
        mods.ScoreMod(_identity, captured=(np.ones(3, bool),))
    with pytest.raises(ValueError, match=r"captured_grad must have one entry .* per captured array \(2\)"):
        mods.ScoreMod(_identity, captured=(np.ones(2), np.ones(2)), captured_grad=(None,))
    with pytest.raises(ValueError, match=r"captured_grad\[0\] is given but captured\[0\] \(ids\) has dtype int64"):
        mods.ScoreMod(_identity, captured=(np.arange(3),), captured_grad=(_key_bias_table_grad,),
                      captured_names=("ids",))
    with pytest.raises(ValueError, match=r"captured_names must be 1 strs, one per captured array"):
        mods.ScoreMod(_identity, captured=(np.ones(2),), captured_names=("a", "b"))
    with pytest.raises(TypeError, match=r"name must be a non-empty str"):
        mods.ScoreMod(_identity, name="")
    assert mods.ScoreMod(_identity).name == "_identity" and repr(mods.softcap(2.0)) == "ScoreMod(softcap)"


def _scaled_key_bias(score, b, h, i, j, bias):
    return score + bias[h, j] * 3.1  # float16 arithmetic would round the product to 11 bits


def _half_widths():
    """(name, 16-bit array of a (2, 7) table, its float64 twin) for the 16-bit dtypes a captured array may
    have, the float64 twin made by NumPy's own (exact) conversion."""
    rng = np.random.default_rng(23)
    table = rng.standard_normal((2, 7))
    out = [("float16", table.astype(np.float16))]
    try:
        import ml_dtypes
    except ImportError:
        pass
    else:
        out.append(("bfloat16", table.astype(ml_dtypes.bfloat16)))
    return [(name, half, half.astype(np.float64)) for name, half in out]


def test_16_bit_captured_arrays_are_read_as_their_exact_float32_widening():
    """float16 and bfloat16 captured arrays are taken (issue 50): the functions read them as float32, by the
    reference as by the kernels, so a mod gives what it gives with the float32 (or float64) copy of the same
    values; the captured gradient and `check` take them too."""
    prob = PROBLEMS["gqa-batch2"]
    _, q, k, v, dout = prob.inputs(seed=29)
    q, k, v, dout = (x[:, :2] for x in (q, k, v, dout))  # H = 2 query heads, one per table row
    for name, half, wide in _half_widths():
        mod = key_bias(half)
        assert mod.captured[0] is half  # held as given: read again at every call
        for ours, want in zip(reference.attention(q, k, v, score_mod=mod),
                              reference.attention(q, k, v, score_mod=key_bias(wide))):
            assert np.array_equal(ours, want), name
        for ours, want in zip(reference.attention_backward_mod(q, k, v, dout, score_mod=mod)[-1],
                              reference.attention_backward_mod(q, k, v, dout, score_mod=key_bias(wide))[-1]):
            assert np.array_equal(ours, want), name
        scaled = mods.ScoreMod(_scaled_key_bias, _key_bias_grad, captured=(half,))
        as_float32 = mods.ScoreMod(_scaled_key_bias, _key_bias_grad, captured=(wide.astype(np.float32),))
        for ours, want in zip(reference.attention(q, k, v, score_mod=scaled),
                              reference.attention(q, k, v, score_mod=as_float32)):
            assert np.array_equal(ours, want), name
        mods.check(mod, n_q=prob.n_q, n_k=prob.n_k, heads=2, examples=10)


def test_16_bit_torch_tensors_are_captured_and_read_at_every_call():
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    pytest.importorskip("ml_dtypes", reason="a bfloat16 tensor is read through ml_dtypes (the 'test' extra)")
    prob = PROBLEMS["gqa-batch2"]
    _, q, k, v, _ = prob.inputs(seed=31)
    q, k, v = (x[:, :2] for x in (q, k, v))
    for dtype in (torch.float16, torch.bfloat16):
        table = torch.randn(2, 7, generator=torch.Generator().manual_seed(5)).to(dtype)
        mod = mods.ScoreMod(_key_bias, _key_bias_grad, captured=(table,))
        wide = key_bias(table.double().numpy())
        for ours, want in zip(reference.attention(q, k, v, score_mod=mod),
                              reference.attention(q, k, v, score_mod=wide)):
            assert np.array_equal(ours, want), dtype
        table.mul_(-2)  # in place: the next call reads it
        moved = key_bias(table.double().numpy())
        assert np.array_equal(reference.attention(q, k, v, score_mod=mod)[0],
                              reference.attention(q, k, v, score_mod=moved)[0]), dtype


def test_captured_dtypes_the_kernels_cannot_read_are_refused_by_name():
    accepted = (r"\(accepted: int8, int16, int32, int64, uint8, uint16, uint32, uint64, float32, float64, or "
                r"float16 and bfloat16, read as float32\)")
    refused = [np.ones(3, np.complex64), np.array(["a"])]
    if np.dtype(np.longdouble).itemsize > 8:  # float128 / float96 where the platform has one
        refused.append(np.ones(3, np.longdouble))
    for array in refused:
        with pytest.raises(TypeError, match=rf"captured\[1\] \(table\) must have an integer or floating dtype, "
                                            rf"got {array.dtype} {accepted}"):
            mods.ScoreMod(_identity, captured=(np.ones(2), array), captured_names=("", "table"))


def test_built_in_parameters_are_checked_and_named():
    with pytest.raises(ValueError, match=r"cap must be a finite number > 0, got 0.0"):
        mods.softcap(0.0)
    with pytest.raises(TypeError, match=r"cap must be a real number, got str"):
        mods.softcap("30")
    with pytest.raises(ValueError, match=r"t must be a finite number > 0, got -1.0"):
        mods.temperature(-1)
    with pytest.raises(ValueError, match=r"t must be a finite number > 0, got inf"):
        mods.temperature(math.inf)
    with pytest.raises(ValueError, match=r"slopes must have 1 axis, got shape \(2, 2\)"):
        mods.alibi(np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"slopes must be finite, got nan"):
        mods.alibi([0.5, math.nan])
    with pytest.raises(ValueError, match=r"table has 8 columns .* pass n_k="):
        mods.relative_bias(np.ones((2, 8)))
    with pytest.raises(ValueError, match=r"n_k must be in \[1, 8\]"):
        mods.relative_bias(np.ones((2, 8)), n_k=9)
    q = np.ones((2, 3, 4))  # H = 2, N = 3
    with pytest.raises(ValueError, match=r"alibi: slopes must have one entry per query head \(H = 2\), got "
                                         r"shape \(3,\)"):
        reference.attention(q, q, q, score_mod=mods.alibi([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"relative_bias: table must have shape \(H, N_q \+ N_k - 1\) = \(2, 5\)"):
        reference.attention(q, q, q, score_mod=mods.relative_bias(np.ones((2, 7))))
    slopes = np.array([0.5, 0.25])
    mod = mods.alibi(slopes)
    slopes[0] = 9.0  # a built-in is a value: its copy does not move
    assert mod.captured[0][0] == 0.5 and not mod.captured[0].flags.writeable


def test_reference_refuses_what_is_not_a_score_mod_and_a_backward_without_grad():
    q = np.ones((3, 4))
    with pytest.raises(TypeError, match=r"score_mod must be a fa_numba.mods.ScoreMod .* got function \(wrap a "
                                        r"function: fa_numba.mods.ScoreMod\(fn, grad=...\)\)"):
        reference.attention(q, q, q, score_mod=_identity)
    forward_only = mods.ScoreMod(_identity, name="forward_only")
    reference.attention(q, q, q, score_mod=forward_only)
    with pytest.raises(ValueError, match=r"score_mod forward_only has no grad"):
        reference.attention_backward(q, q, q, q, score_mod=forward_only)
    with pytest.raises(ValueError, match=r"attention_backward_mod needs a score_mod"):
        reference.attention_backward_mod(q, q, q, q, score_mod=None)
    bad = mods.ScoreMod(lambda s, b, h, i, j: "x", name="stringy")
    with pytest.raises(mods.ModError, match=r"score_mod stringy: fn must return a real number, got str"):
        reference.attention(q, q, q, score_mod=bad)
    out_of_range = mods.ScoreMod(_key_bias, _key_bias_grad, (lambda s, b, h, i, j, t: ((h, j + 5), 1.0),),
                                 "oob", (np.zeros((1, 3)),), ("bias",))
    with pytest.raises(mods.ModError, match=r"captured_grad\[0\] \(bias\) must return an index of 2 non-negative "
                                            r"ints inside shape \(1, 3\)"):
        reference.attention_backward_mod(q, q, q, q, score_mod=out_of_range)


def test_the_built_ins_compile_in_numbas_nopython_mode_and_agree():
    """The functions are written in the subset Numba compiles (as CUDA device functions later): compiled for
    the CPU with numba.njit here, they return what Python returns (float32 and float64 scores)."""
    numba = pytest.importorskip("numba")
    rng = np.random.default_rng(1)
    for mod in (mods.alibi([0.5, 0.25]), mods.softcap(3.0), mods.relative_bias(rng.standard_normal((2, 9))),
                mods.temperature(0.5)):
        for f in [mod.fn, mod.grad] + [g for g in mod.captured_grad if g is not None]:
            for score in (np.float32(1.5), np.float64(-7.25)):
                got, want = numba.njit(f)(score, 0, 1, 3, 2, *mod.captured), f(score, 0, 1, 3, 2, *mod.captured)
                if isinstance(want, tuple):
                    assert tuple(int(x) for x in got[0]) == tuple(int(x) for x in want[0]), (mod.name, f.__name__)
                    got, want = got[1], want[1]
                # within 2 ulps: Numba's and CPython's libm calls may round differently
                assert abs(float(got) - float(want)) <= 4 * U64 * abs(float(want)), (mod.name, f.__name__)


def test_the_float32_twin_evaluates_the_mod_on_float32_scalars():
    """attention_naive_f32 and its backward call the mod with float32 scores and keep float32 results."""
    prob = PROBLEMS["causal"]
    _, q, k, v, dout = prob.inputs(seed=19)
    seen = set()

    def typed(score, b, h, i, j):
        seen.add(type(score))
        return score * 0.5

    mod = mods.ScoreMod(typed, lambda score, b, h, i, j: 0.5, name="typed")
    q32, k32, v32, do32 = (x.astype(np.float32) for x in (q, k, v, dout))
    out32, lse32 = reference.attention_naive_f32(q32, k32, v32, causal=True, score_mod=mod)
    grads32 = reference.attention_backward_naive_f32(q32, k32, v32, do32, causal=True, score_mod=mod)
    assert seen == {np.float32} and out32.dtype == lse32.dtype == np.float32
    assert all(g.dtype == np.float32 and np.isfinite(g).all() for g in grads32)
    # halving the scores is scale / 2: in float32 too, exactly (a power of two), so the same bits
    half = reference.attention_naive_f32(q32, k32, v32, causal=True, scale=0.5 / math.sqrt(prob.d))
    assert np.array_equal(out32, half[0]) and np.array_equal(lse32, half[1])


def test_mods_doctests():
    failures, tried = doctest.testmod(mods, raise_on_error=False)
    assert failures == 0 and tried > 0
