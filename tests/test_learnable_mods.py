"""Learnable biases: a score mod whose captured torch tensors require grad gets their gradients through torch
autograd (fa_numba.autograd), by the captured arrays' deterministic kernels; against torch autograd of a dense
float64 implementation written here, and the captured gradients' 3x rule (proofs/L13 claim 4)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="learnable biases are torch tensors (the torch extra)")

import fa_numba.autograd  # noqa: E402
from fa_numba import mods, tolerance_backward  # noqa: E402

TILES = dict(block_q=8, block_k=8, backward_block=8)


def _dense64(q, k, v, bias, causal=True):
    """softmax(q k^T / sqrt(d) + bias) v in float64 torch; bias broadcast to (B, H, N_q, N_k)."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
    if causal:
        n_q, n_k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q).logical_not(), -torch.inf)
    return torch.softmax(scores, dim=-1) @ v


def _inputs(seed, heads=2, n=12, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, d, generator=g) for _ in range(3)] + [torch.randn(1, heads, n, d, generator=g)]


@pytest.mark.lemma("L13")
def test_learnable_alibi_slopes_get_their_gradient_through_autograd():
    q, k, v, dout = _inputs(1)
    slopes = torch.nn.Parameter(torch.tensor([0.25, -0.5]))
    mod = mods.alibi(slopes)
    assert mod.learnable == (0,)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fa_numba.autograd.attention(*leaves, causal=True, score_mod=mod, **TILES)
    out.backward(dout)
    # the rule: dslopes against the float64 reference's captured gradients, the 3x rule with its floors
    tolerance_backward.check_captured_gradients((slopes.grad.numpy(),), *(x.numpy() for x in (q, k, v, dout)),
                                                score_mod=mods.alibi(slopes.detach().numpy()), causal=True,
                                                name="autograd alibi")
    tolerance_backward.check_attention_backward(*(x.grad.numpy() for x in leaves), *(x.numpy() for x in (q, k, v)),
                                                dout.numpy(), causal=True, score_mod=mods.alibi(slopes.detach().numpy()))
    # and torch autograd through a dense float64 implementation written here agrees with that reference
    s64 = slopes.detach().double().requires_grad_()
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    (_dense64(q.double(), k.double(), v.double(), s64.view(1, 2, 1, 1) * (j - i)) * dout.double()).sum().backward()
    base = tolerance_backward.baseline_captured(*(x.numpy() for x in (q, k, v, dout)), causal=True,
                                                score_mod=mods.alibi(slopes.detach().numpy()))
    np.testing.assert_allclose(s64.grad.numpy(), base.expected[0], rtol=0, atol=base.atols[0])


@pytest.mark.lemma("L13")
def test_a_learnable_relative_bias_table_is_read_at_every_call_and_differentiated():
    q, k, v, dout = _inputs(2, n=6)
    table = torch.nn.Parameter(0.1 * torch.randn(2, 11, generator=torch.Generator().manual_seed(3)))
    mod = mods.relative_bias(table)
    first = fa_numba.autograd.attention(q, k, v, causal=True, score_mod=mod, **TILES)
    with torch.no_grad():
        table += 1.0  # an optimizer's step, in place: the next call reads it
    second = fa_numba.autograd.attention(q, k, v, causal=True, score_mod=mod, **TILES)
    assert torch.allclose(first, second, atol=1e-5)  # a constant shift of every score leaves the softmax
    with torch.no_grad():
        table[:, 5] += 2.0  # offset 0 (the diagonal) only: now it matters
    third = fa_numba.autograd.attention(q, k, v, causal=True, score_mod=mod, **TILES)
    assert not torch.allclose(second, third, atol=1e-3)
    third.backward(dout)
    tolerance_backward.check_captured_gradients((table.grad.numpy(), None), *(x.numpy() for x in (q, k, v, dout)),
                                                score_mod=mods.relative_bias(table.detach().numpy()), causal=True,
                                                name="autograd relative_bias")


def test_torch_compile_traces_a_learnable_bias_in_one_graph():
    q, k, v, dout = _inputs(4, n=8)
    slopes = torch.nn.Parameter(torch.tensor([0.25, -0.5]))
    mod = mods.alibi(slopes)
    compiled = torch.compile(lambda q: fa_numba.autograd.attention(q, k, v, causal=True, score_mod=mod, **TILES),
                             fullgraph=True, backend="aot_eager")
    leaf = q.clone().requires_grad_()
    compiled(leaf).backward(dout)
    eager = slopes.grad.clone()
    slopes.grad = None
    fa_numba.autograd.attention(q.clone().requires_grad_(), k, v, causal=True, score_mod=mod, **TILES).backward(dout)
    assert torch.equal(eager, slopes.grad)  # the same kernels in the same order: the same bits


def test_a_loss_reading_lse_with_a_learnable_bias_is_refused_by_name():
    q, k, v, _ = _inputs(5, n=8)
    mod = mods.alibi(torch.nn.Parameter(torch.tensor([0.25, -0.5])))
    out, lse = fa_numba.autograd.attention_with_lse(q, k, v, causal=True, score_mod=mod, **TILES)
    with pytest.raises(NotImplementedError, match="learnable score mod"):
        (out.sum() + lse.sum()).backward()


@pytest.mark.lemma("L13")
def test_flash_attn_func_learnable_alibi_slopes_match_the_reference():
    """flash_attn_func(alibi_slopes=a tensor requiring grad): the slopes' gradient within the captured rule of
    the same mod built from their values (flash-attn's convention: - slope |i + delta - j|, softcap first)."""
    from fa_numba.mods import conventions

    q, k, v, dout = _inputs(6, n=10)
    slopes = torch.nn.Parameter(torch.tensor([0.25, 0.5]))
    to = lambda x: x.transpose(1, 2)  # noqa: E731 - (B, N, H, d), flash-attn's layout
    out = fa_numba.flash_attn_func(to(q), to(k), to(v), causal=True, alibi_slopes=slopes, softcap=5.0)
    out.backward(to(dout))
    fixed = conventions.flash_attn(slopes.detach().numpy(), softcap=5.0, delta=0, batch=1, heads=2)
    with_grad = mods.ScoreMod(fixed.fn, fixed.grad, (conventions._flash_slopes_grad, None), name="flash",
                              captured=fixed.captured, captured_names=("slopes", "params"))
    mods.check(with_grad, n_q=10, n_k=10, heads=2)  # the slopes' derivative against central differences
    tolerance_backward.check_captured_gradients((slopes.grad.numpy()[None], None),
                                                *(x.numpy() for x in (q, k, v, dout)), score_mod=with_grad,
                                                causal=True, name="flash_attn_func alibi")
