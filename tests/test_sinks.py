"""Learnable sinks (proofs/L14) and LSE's cotangent: the definition against an oracle written apart from it,
the merge as the monoid's, the kernels of both engines within the derived rule, the edge rows exactly.

The oracle is HF's form, written here and sharing nothing with fa_numba: append the sink as one more column of
the scores, take the softmax, drop the column before P V; its gradients by torch's float64 autograd."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fa_numba
import fa_numba.autograd
from fa_numba import masks, online_softmax, reference, sinks, tolerance, tolerance_backward

from bounds import UNDERFLOW, assert_within, dense_counts, factor, gamma, online_counts, softmax_bound

torch = pytest.importorskip("torch", reason="the float64 oracle's gradients are torch autograd (the torch extra)")


def _oracle(q, k, v, s, visible, scale):
    """(O, LSE) by the concatenated column, float64 torch; visible (N_q, N_k) bool; GQA by repeating K/V."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (scale * q @ k.transpose(-1, -2)).masked_fill(~torch.as_tensor(visible), -torch.inf)
    column = s.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    both = torch.cat([scores, column], dim=-1)
    return torch.softmax(both, dim=-1)[..., :-1] @ v, torch.logsumexp(both, dim=-1)


def _problem(seed, batch=2, heads=4, heads_kv=2, n_q=6, n_k=9, d=8, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in
               ((batch, heads, n_q, d), (batch, heads_kv, n_k, d), (batch, heads_kv, n_k, d)))
    s = (2 * rng.standard_normal(heads)).astype(np.float32)
    return rng, q, k, v, s


@pytest.mark.lemma("L14")
@pytest.mark.parametrize("causal, n_q, n_k", [(False, 6, 9), (True, 6, 9), (True, 9, 5)])  # 9 x 5: dead rows
def test_the_reference_with_sinks_is_the_concatenated_column_and_its_autograd(causal, n_q, n_k):
    rng, q, k, v, s = _problem(1, n_q=n_q, n_k=n_k)
    if n_q <= n_k:
        s[1] = -np.inf  # no sink on head 1 (not with dead rows: the oracle's logsumexp of no column has no gradient)
    visible = masks.causal().dense(n_q, n_k) if causal else np.ones((n_q, n_k), bool)
    dout, dlse = rng.standard_normal((2, 4, n_q, 8)), rng.standard_normal((2, 4, n_q))
    out, lse = reference.attention(q, k, v, causal=causal, sinks=s)
    grads = reference.dense_backward(q, k, v, dout, causal=causal, sinks=s, dlse=dlse)
    leaves = [torch.tensor(x.astype(np.float64), requires_grad=True) for x in (q, k, v, s)]
    o, l = _oracle(*leaves, visible, 1 / np.sqrt(8))
    ((o * torch.tensor(dout)).sum() + (l * torch.tensor(dlse)).sum()).backward()
    # The forward as softmax over the keys and one more with score s_h and value 0 (tests/py): each side
    # within the bound of the exact value, so they are within twice it of each other.
    scores = np.where(visible, q.astype(float) @ np.swapaxes(np.repeat(k, 2, 1).astype(float), -1, -2) / np.sqrt(8),
                      -np.inf)
    column = np.broadcast_to(s.astype(float)[None, :, None, None], scores.shape[:-1] + (1,))
    values = np.concatenate([np.repeat(v, 2, 1).astype(float), np.zeros((2, 4, 1, 8))], axis=2)
    sigma = gamma(10) * np.concatenate([np.abs(q) @ np.swapaxes(np.abs(np.repeat(k, 2, 1)), -1, -2) / np.sqrt(8),
                                               np.zeros(column.shape)], axis=-1)
    out_bound, lse_bound = softmax_bound(np.concatenate([scores, column], -1), values[:, :, None], 
                                                *dense_counts(n_k + 1), sigma=sigma)
    assert_within(out, o.detach().numpy(), 2 * out_bound, "out")
    assert_within(lse, l.detach().numpy(), 2 * lse_bound, "lse")
    # The gradients, first order: every P (and P_sink) within rel of its exact value (its score's d-term dot
    # product, the max and LSE's roundings, one exp, through exponent arguments of size |S| + |LSE|), and each
    # gradient a sum of such weights times operands with at most n_q + n_k + 2 d further roundings: twice
    # rel times the sum of the magnitudes of its terms bounds the two evaluations' distance.
    big = max(np.abs(scores[np.isfinite(scores)]).max(), np.abs(lse[np.isfinite(lse)]).max(),
              np.abs(s[np.isfinite(s)]).max())
    rel = factor(2, 2 * 8 + n_q + n_k + 8, 4 * big)
    p, dp, pd = grads.p, np.abs(grads.dp), np.abs(grads.d_row)[..., None]
    weight = p * (dp + pd)  # |dS| and its parts' magnitudes
    mags = {"dq": weight @ np.abs(grads.k) / np.sqrt(8),
            "dk": (np.swapaxes(weight, -1, -2) @ np.abs(grads.q) / np.sqrt(8)).reshape(2, 2, 2, n_k, 8).sum(2),
            "dv": (np.swapaxes(p, -1, -2) @ np.abs(grads.dout)).reshape(2, 2, 2, n_k, 8).sum(2),
            "dsinks": (np.exp(s.astype(float)[:, None] - grads.shift) * pd[..., 0]).sum(axis=(0, 2))}
    for (name, magnitude), mine, theirs in zip(mags.items(), (grads.dq, grads.dk, grads.dv, grads.dsinks), leaves):
        assert_within(mine, theirs.grad.numpy(), 2 * rel * magnitude + UNDERFLOW, name)
    if causal and n_q > n_k:  # rows that see no key: O = 0 and LSE = s_h exactly
        dead = n_q - n_k
        assert np.all(out[:, :, :dead] == 0)
        assert np.array_equal(lse[:, :, :dead], np.broadcast_to(s.astype(np.float64)[None, :, None], (2, 4, dead)))


@pytest.mark.lemma("L14")
@settings(deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.integers(0, 4), st.floats(-30, 30))
def test_the_sink_is_one_state_merged_anywhere_in_the_fold(seed, tiles, where, sink):
    """L14.1: (m = s, l = 1, acc = 0) merged at any position of the tiles' fold gives the same (O, LSE) as the
    definition (float64; online_softmax's merge is the monoid of L2)."""
    rng = np.random.default_rng(seed)
    n_k, d = 3 * tiles, 4
    scores, values = 4 * rng.standard_normal((2, n_k)), rng.standard_normal((n_k, d))
    states = [online_softmax.State(scores[:, j:j + 3].max(axis=1),
                                   np.exp(scores[:, j:j + 3] - scores[:, j:j + 3].max(axis=1, keepdims=True)).sum(1),
                                   np.exp(scores[:, j:j + 3] - scores[:, j:j + 3].max(axis=1, keepdims=True))
                                   @ values[j:j + 3]) for j in range(0, n_k, 3)]
    sink_state = online_softmax.State(np.full(2, sink), np.ones(2), np.zeros((2, d)))
    states.insert(min(where, len(states)), sink_state)
    state = online_softmax.identity(2, d, np.float64)
    for part in states:
        state = online_softmax.merge(state, part)
    out, lse = online_softmax.finalize(state, np.ones(2, bool))
    # the definition: the sink as one more key of value 0; both evaluations within the softmax bound of the
    # exact value (the fold: every weight through one rescale per merge level, tests/py)
    both = np.concatenate([scores, np.full((2, 1), sink)], axis=1)
    values0 = np.concatenate([values, np.zeros((1, d))])
    top = both.max(axis=1, keepdims=True)
    weights = np.exp(both - top)
    ref_out, ref_lse = weights @ values0 / weights.sum(1)[:, None], top[:, 0] + np.log(weights.sum(1))
    fold = softmax_bound(both, values0, *online_counts(n_k + 1))
    dense = softmax_bound(both, values0, *dense_counts(n_k + 1))
    assert_within(out, ref_out, fold[0] + dense[0], "out")
    assert_within(lse, ref_lse, fold[1] + dense[1], "lse")


ENGINES = [  # (engine, order, dtype, p_dtype)
    ("simt", "v2", np.float32, None),
    ("simt", "v1", np.float32, None),
    ("mma", "v2", np.float16, "float16"),
]


@pytest.mark.lemma("L14")
@pytest.mark.parametrize("engine, order, dtype, p_dtype", ENGINES, ids=lambda x: str(getattr(x, "__name__", x)))
@pytest.mark.parametrize("causal", [False, True])
def test_every_engine_with_sinks_is_within_the_combined_rule(engine, order, dtype, p_dtype, causal):
    rng, q, k, v, s = _problem(2, batch=1, heads=2, heads_kv=1, n_q=20, n_k=13, d=16, dtype=dtype)
    s[0] = 4.0  # a sink that outweighs the keys
    tiles = dict(block_q=16, block_k=16)
    out, lse = fa_numba.attention(q, k, v, causal=causal, order=order, engine=engine, sinks=s, return_lse=True,
                                  **tiles)
    base = sinks.baseline(q, k, v, s, causal=causal, p_dtype=p_dtype,
                          **({} if engine == "mma" else tiles))
    tolerance.judge(out, lse, base, order=None if engine == "mma" else order, name=f"{engine} {order}")
    dead = 20 - 13
    if causal:  # rows that see no key: exactly the sink
        assert np.all(out[0, :, :dead] == 0) and np.array_equal(lse[0, :, :dead], np.repeat(s[:, None], dead, 1))


@pytest.mark.lemma("L14")
def test_a_sink_of_minus_infinity_is_no_sink_bit_for_bit_and_nan_stays_in_its_head():
    rng, q, k, v, s = _problem(3, batch=1, heads=2, heads_kv=2, n_q=8, n_k=8, d=8)
    plain = fa_numba.attention(q, k, v, return_lse=True, block_q=8, block_k=8)
    none = fa_numba.attention(q, k, v, return_lse=True, block_q=8, block_k=8,
                              sinks=np.full(2, -np.inf, np.float32))
    assert all(np.array_equal(a, b) for a, b in zip(plain, none))
    out, lse = fa_numba.attention(q, k, v, return_lse=True, block_q=8, block_k=8,
                                  sinks=np.array([np.nan, 0.5], np.float32))
    assert np.isnan(out[0, 0]).all() and np.isnan(lse[0, 0]).all()
    assert np.isfinite(out[0, 1]).all() and np.isfinite(lse[0, 1]).all()


@pytest.mark.lemma("L14")
@pytest.mark.parametrize("engine, order, deterministic, dtype, p_dtype, with_dlse", [
    ("simt", "kv", False, np.float32, None, False), ("simt", "kv", False, np.float32, None, True),
    ("mma", "kv", False, np.float16, "float16", True),
    pytest.param("simt", "q", False, np.float32, None, True, marks=pytest.mark.slow),  # 1 s each: the other
    pytest.param("simt", "kv", True, np.float32, None, True, marks=pytest.mark.slow),  # orders in the slow tier
    pytest.param("mma", "kv", True, np.float16, "float16", False, marks=pytest.mark.slow)])
def test_backward_with_sinks_and_dlse_is_within_the_rule(engine, order, deterministic, dtype, p_dtype, with_dlse):
    rng, q, k, v, s = _problem(4, batch=1, heads=2, heads_kv=1, n_q=20, n_k=13, d=16, dtype=dtype)
    exact = [x.astype(np.float64) for x in (q, k, v)]
    out, lse = reference.attention(*exact, causal=True, sinks=s)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dlse = rng.standard_normal(lse.shape).astype(np.float32) if with_dlse else None
    grads = fa_numba.attention_backward(q, k, v, out.astype(np.float32), lse.astype(np.float32), dout, causal=True,
                                        order=order, deterministic=deterministic, engine=engine, sinks=s, dlse=dlse,
                                        block_q=16, block_k=16)
    assert len(grads) == 4 and grads[3].shape == (2,) and grads[3].dtype == np.float32
    base = tolerance_backward.baseline_backward(*exact, dout.astype(np.float64), causal=True, sinks=s, dlse=dlse,
                                                p_dtype=p_dtype)
    tolerance_backward.judge_backward(*grads[:3], base, dsinks=grads[3], name=f"{engine} {order}")


@pytest.mark.lemma("L14")
def test_the_sink_gradient_is_bitwise_repeatable():
    rng, q, k, v, s = _problem(5, batch=1, heads=2, heads_kv=2, n_q=24, n_k=24, d=8)
    out, lse = fa_numba.attention(q, k, v, causal=True, sinks=s, return_lse=True, block_q=8, block_k=8)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    runs = [fa_numba.attention_backward(q, k, v, out, lse, dout, causal=True, sinks=s, block_q=8)[3]
            for _ in range(2)]
    assert np.array_equal(runs[0], runs[1])


def test_no_keys_gives_the_sink_alone_without_a_launch():
    _, q, k, v, s = _problem(6, n_k=0)
    out, lse = fa_numba.attention(q, k, v, sinks=s, return_lse=True)
    assert np.all(out == 0) and np.array_equal(lse, np.broadcast_to(s[None, :, None], lse.shape))
    dlse = np.ones(lse.shape, np.float32)
    *_, dsinks = fa_numba.attention_backward(q, k, v, out, lse, np.zeros_like(out), sinks=s, dlse=dlse)
    np.testing.assert_array_equal(dsinks, np.full(4, 2 * 6, np.float32))  # d LSE_i / d s_h = 1 on every row


@pytest.mark.parametrize("bad, error, words", [
    (np.zeros(3, np.float32), ValueError, "shape (4,)"),
    (np.zeros((4, 1), np.float32), ValueError, "shape (4,)"),
    (np.zeros(4, np.int32), TypeError, "float"),
    (0.5, TypeError, "sinks must be an array"),
])
def test_bad_sinks_are_refused_by_name(bad, error, words):
    _, q, k, v, _ = _problem(7)
    with pytest.raises(error, match="sinks") as info:
        fa_numba.attention(q, k, v, sinks=bad, block_q=8, block_k=8)
    assert words in str(info.value)


def test_dlse_of_the_wrong_shape_is_refused_by_name():
    _, q, k, v, s = _problem(8)
    out, lse = fa_numba.attention(q, k, v, sinks=s, return_lse=True, block_q=8, block_k=8)
    with pytest.raises(ValueError, match="dlse must have shape"):
        fa_numba.attention_backward(q, k, v, out, lse, np.ones_like(out), sinks=s, dlse=np.ones(3, np.float32))


@pytest.mark.lemma("L14")
def test_autograd_gradients_of_sinks_and_lse_are_within_the_rule():
    rng, q, k, v, s = _problem(9, batch=1, heads=2, heads_kv=1, n_q=8, n_k=8, d=8)
    weights = torch.tensor(rng.standard_normal((1, 2, 8)))
    mine = [torch.tensor(x, requires_grad=True) for x in (q, k, v, s)]
    out, lse = fa_numba.autograd.attention_with_lse(*mine[:3], causal=True, sinks=mine[3])
    (out.double().sum() + (lse.double() * weights).sum()).backward()
    exact = [x.astype(np.float64) for x in (q, k, v)]
    base = tolerance_backward.baseline_backward(*exact, np.ones((1, 2, 8, 8)), causal=True, sinks=s,
                                                dlse=weights.numpy())
    check = tolerance_backward.judge_backward(*(x.grad.numpy() for x in mine[:3]), base,
                                              dsinks=mine[3].grad.numpy(), name="autograd")  # raises beyond the rule
    assert mine[3].grad.shape == (2,) and np.all(mine[3].grad.numpy() != 0)  # the sinks do take a gradient
    assert check.err_dq <= check.atol_dq and check.err_dk <= check.atol_dk and check.err_dv <= check.atol_dv


def test_flash_attn_func_takes_learnable_sink():
    rng, q, k, v, s = _problem(10, batch=1, heads=2, heads_kv=2, n_q=8, n_k=8, d=8)
    to = lambda x: torch.tensor(x).transpose(1, 2)  # noqa: E731 - (B, N, H, d), flash-attn's layout
    sink = torch.tensor(s, requires_grad=True)
    out, lse, _ = fa_numba.flash_attn_func(to(q), to(k), to(v), causal=True, learnable_sink=sink,
                                           return_attn_probs=True)
    base = sinks.baseline(q, k, v, s, causal=True, block_q=16, block_k=16)
    check = tolerance.judge(out.detach().transpose(1, 2).numpy(), lse.detach().numpy(), base, order="v2",
                            name="flash_attn_func")  # raises beyond the rule
    assert check.err_out <= check.atol_out and check.err_lse <= check.atol_lse
    out.sum().backward()  # dO = 1: the sinks' gradient reaches the tensor, within the gradients' rule
    grads = tolerance_backward.baseline_backward(q, k, v, np.ones(q.shape), causal=True, sinks=s)
    err = tolerance.assert_close(sink.grad.numpy(), grads.dsinks, grads.atol_dsinks, name="learnable_sink grad")
    assert err <= grads.atol_dsinks and sink.grad.shape == (2,)


@pytest.mark.slow  # 3 to 7 s: opcheck runs each operator several times (aot dispatch included)
def test_the_operators_with_sinks_pass_opcheck():
    """The forward with sinks (a tensor argument that takes a gradient) and the backward that carries dLSE and
    the sinks, under torch.library.opcheck (schema, fake tensors, autograd registration)."""
    from fa_numba import torch_ops

    rng, q, k, v, s = _problem(11, batch=1, heads=2, heads_kv=1, n_q=5, n_k=5, d=4)
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    sink = torch.tensor(s, requires_grad=True)
    forward = (q, k, v, True, 0.5, "v2", "", None, "auto", 8, 8, "kv", False, 8, "", sink)
    result = torch.library.opcheck(torch_ops.attention_op, forward)
    assert set(result.values()) == {"SUCCESS"}, result
    out, lse = torch_ops.attention_op(*forward)
    backward = (q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), torch.ones_like(out),
                torch.ones_like(lse), True, 0.5, "kv", False, "", None, 8, "auto", "", sink.detach(), [])
    result = torch.library.opcheck(torch_ops.attention_backward_lse_op, backward)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.lemma("L14")
@pytest.mark.parametrize("split_size", [None, 8])  # None: one split; 8: three splits of the longest request
def test_decoding_merges_the_sink_once_after_the_combine(split_size):
    """attention_with_kvcache with sinks: packed GQA rows name their query head (h_kv g + r // N_q), the sink
    joins once per row after the combine (split_kv.check's rule with the sink as an exact part), and a request
    with no key gets (0, s_h) exactly."""
    from fa_numba import split_kv

    rng = np.random.default_rng(12)
    heads, heads_kv, n_q, d = 4, 2, 2, 8
    q = rng.standard_normal((3, heads, n_q, d)).astype(np.float32)
    cache_k, cache_v = (rng.standard_normal((3, heads_kv, 24, d)).astype(np.float32) for _ in range(2))
    s = np.array([0.5, -1.0, 3.0, -np.inf], np.float32)
    lengths = [20, 0, 7]
    out, lse = fa_numba.attention_with_kvcache(q, cache_k, cache_v, lengths, split_size=split_size, block_k=8,
                                               return_lse=True, sinks=s)
    splits = None if split_size is None else split_kv.Splits(3, 1, 8)
    for b, n in enumerate(lengths):
        if n == 0:  # splits=None: a request without keys is judged exactly, whatever the split
            split_kv.check(out[b], lse[b], q[b], cache_k[b, :, :0], cache_v[b, :, :0], causal=True, scale=d**-0.5,
                           block_k=8, splits=None, sinks=s)
            continue
        split_kv.check(out[b], lse[b], q[b], cache_k[b, :, :n], cache_v[b, :, :n], causal=True, scale=d**-0.5,
                       block_k=8, splits=splits, sinks=s)


@pytest.mark.lemma("L14")
@pytest.mark.slow  # two processes of their own, the kernels in the simulator: about 30 s
def test_ring_attention_merges_the_sink_once_across_the_ring(tmp_path):
    """Two ranks (gloo), zigzag, causal: (O, LSE) within the ring's rule with the sink as one more exact part,
    and the gradients (dq, dk, dv, dsinks, for a loss reading O and LSE) within L7's rule."""
    import fa_numba.distributed as fd
    from test_distributed import spawn

    case = dict(seed=14, shape=(1, 2, 1, 32, 8), layout="zigzag", causal=True, block=8, sinks=True)
    spawn(2, case, tmp_path / "ring.npz")
    got = np.load(tmp_path / "ring.npz")
    s = got["sinks"]
    atol_out, atol_lse = fd.ring_tolerances(got["q"], got["k"], got["v"], True, 2, "zigzag", 8, sinks=s)
    ref_out, ref_lse = reference.attention(got["q"], got["k"], got["v"], causal=True, sinks=s)
    tolerance.assert_close(got["out"], ref_out, atol_out, name="ring out")
    tolerance.assert_close(got["lse"], ref_lse, atol_lse, name="ring lse")
    base = tolerance_backward.baseline_backward(got["q"], got["k"], got["v"], got["dout"], causal=True, sinks=s,
                                                dlse=got["dlse"])
    tolerance_backward.judge_backward(got["dq"], got["dk"], got["dv"], base, dsinks=got["dsinks"], name="ring")
