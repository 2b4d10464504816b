"""Packed variable-length batches (fa_numba.packed, flash_attn_varlen_func): the mask of the offsets against
one written here from the sequences, the kernels against each sequence run alone (bitwise where the offsets
are whole tiles), the rule, the I/O model summed over the sequences, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fa_numba
from fa_numba import iomodel, masks, packed, tiling, tolerance, tolerance_backward


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _blocks(lengths_q, lengths_k, causal, left=None, right=None) -> np.ndarray:
    """The packed mask built from the sequences: a block per sequence on the diagonal, each the bottom-right
    aligned window of an L x M problem (written here, apart from fa_numba.packed)."""
    dense = np.zeros((sum(lengths_q), sum(lengths_k)), bool)
    r = c = 0
    for n_q, n_k in zip(lengths_q, lengths_k):
        i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
        offset = j - (i + n_k - n_q)
        block = np.ones((n_q, n_k), bool)
        if causal or right is not None:
            block &= offset <= (0 if causal else right)
        if left is not None:
            block &= offset >= -left
        dense[r:r + n_q, c:c + n_k] = block
        r, c = r + n_q, c + n_k
    return dense


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=5), st.booleans(),
       st.one_of(st.none(), st.integers(0, 4)), st.integers(1, 5), st.integers(1, 5))
def test_the_mask_is_the_sequences_blocks_and_classifies_every_tile_exactly(pairs, causal, left, block_q, block_k):
    lengths_q, lengths_k = zip(*pairs)
    if sum(lengths_q) == 0 or sum(lengths_k) == 0:
        return
    mask = packed.varlen(_offsets(lengths_q), _offsets(lengths_k), causal=causal, window=(left, None))
    want = _blocks(lengths_q, lengths_k, causal, left)
    n_q, n_k = want.shape
    assert np.array_equal(mask.dense(n_q, n_k), want)
    lo, hi = mask.row_intervals(n_q, n_k)
    cols = np.arange(n_k)[None, :]
    assert np.array_equal((lo[:, None] <= cols) & (cols < hi[:, None]), want)  # each row one interval
    brute = tiling.classify(n_q, n_k, block_q, block_k, mask=masks.from_dense(want))
    assert np.array_equal(tiling.classify(n_q, n_k, block_q, block_k, mask=mask), brute)
    assert masks.parse(mask.spec()) == mask


def _problem(seed, lengths_q, lengths_k, heads=2, heads_kv=1, d=8, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((heads, sum(lengths_q), d)).astype(dtype)
    k, v = (rng.standard_normal((heads_kv, sum(lengths_k), d)).astype(dtype) for _ in range(2))
    return rng, q, k, v


@pytest.mark.parametrize("order, engine, dtype", [("v2", "simt", np.float32), ("v1", "simt", np.float32),
                                                  ("v2", "mma", np.float16)])
def test_whole_tile_offsets_give_each_sequence_alone_bit_for_bit(order, engine, dtype):
    """Offsets that are multiples of the tiles: every row visits its own sequence's key tiles, in the same order
    and at the same positions in them, as the sequence run alone, so the packed result is that run's bits."""
    lengths_q, lengths_k = (16, 32, 0, 16), (32, 16, 16, 0)  # a sequence without queries, one without keys
    rng, q, k, v = _problem(1, lengths_q, lengths_k, dtype=dtype)
    cu_q, cu_k = _offsets(lengths_q), _offsets(lengths_k)
    tiles = dict(block_q=16, block_k=16, order=order, engine=engine)
    out, lse = fa_numba.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True,
                                  **tiles)
    for t in range(len(lengths_q)):
        rows, keys = slice(cu_q[t], cu_q[t + 1]), slice(cu_k[t], cu_k[t + 1])
        alone = fa_numba.attention(q[:, rows], k[:, keys], v[:, keys], causal=True, return_lse=True, **tiles)
        assert np.array_equal(out[:, rows], alone[0]) and np.array_equal(lse[:, rows], alone[1]), t


@pytest.mark.parametrize("engine, dtype, p_dtype", [("simt", np.float32, None), ("mma", np.float16, "float16")])
def test_any_offsets_are_within_the_rule_forward_and_backward(engine, dtype, p_dtype):
    lengths_q, lengths_k = (5, 0, 13, 9), (7, 4, 11, 0)  # sequences straddle tiles; empty ones; dead rows
    rng, q, k, v = _problem(2, lengths_q, lengths_k, dtype=dtype)
    mask = packed.varlen(_offsets(lengths_q), _offsets(lengths_k), causal=True)
    out, lse = fa_numba.attention(q, k, v, mask=mask, return_lse=True, engine=engine, block_q=16, block_k=16)
    tolerance.check_attention(out, lse, q, k, v, mask=mask, p_dtype=p_dtype,
                              **({} if engine == "mma" else dict(order="v2", block_q=16, block_k=16)))
    assert np.all(out[:, 18:27] == 0) and np.all(lse[:, 18:27] == -np.inf)  # the sequence without keys
    exact = [x.astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = fa_numba.reference.attention(*exact, mask=mask)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = fa_numba.attention_backward(q, k, v, ref_out.astype(np.float32), ref_lse.astype(np.float32), dout,
                                        mask=mask, engine=engine, block_q=16, block_k=16)
    tolerance_backward.check_attention_backward(*grads, *exact, dout.astype(np.float64), mask=mask, p_dtype=p_dtype)


def test_the_io_model_of_whole_tile_offsets_is_the_sum_over_the_sequences():
    lengths = (64, 128, 32)
    mask = packed.varlen(_offsets(lengths), _offsets(lengths), causal=True)
    for order in ("v1", "v2"):
        whole = iomodel.traffic(order, 224, 224, 64, 32, 32, mask=mask)
        parts = [iomodel.traffic(order, n, n, 64, 32, 32, causal=True) for n in lengths]
        for tensor in whole.reads:
            assert whole.reads[tensor] == sum(p.reads[tensor] for p in parts), (order, tensor)
            assert whole.writes[tensor] == sum(p.writes[tensor] for p in parts), (order, tensor)


@pytest.mark.parametrize("cu_q, cu_k, error, words", [
    ([1, 3], [0, 3], ValueError, "cu_seqlens_q must start at 0"),
    ([0, 5, 3], [0, 3, 6], ValueError, "nondecreasing"),
    ([0, 3], [0, 3, 6], ValueError, "B + 1 = 2 offsets"),
    ([0.0, 3.0], [0, 3], TypeError, "integers"),
    ([0, 3], [0, 5], ValueError, "N_k = cu_seqlens_k[-1] = 5"),
])
def test_bad_offsets_are_refused_by_name(cu_q, cu_k, error, words):
    _, q, k, v = _problem(3, (3,), (3,))
    with pytest.raises(error) as info:
        fa_numba.attention(q, k, v, cu_seqlens_q=np.asarray(cu_q), cu_seqlens_k=np.asarray(cu_k), block_q=8,
                           block_k=8)
    assert words in str(info.value)


def test_offsets_and_a_mask_together_are_refused():
    _, q, k, v = _problem(4, (3,), (3,))
    with pytest.raises(ValueError, match="not both"):
        fa_numba.attention(q, k, v, cu_seqlens_q=[0, 3], cu_seqlens_k=[0, 3], mask=masks.causal())
    with pytest.raises(ValueError, match="give both"):
        fa_numba.attention(q, k, v, cu_seqlens_q=[0, 3])


def test_flash_attn_varlen_func_is_within_the_rule_forward_and_backward():
    torch = pytest.importorskip("torch", reason="the drop-in takes torch tensors (the torch extra)")
    lengths_q, lengths_k = (5, 11), (8, 11)
    rng, q, k, v = _problem(5, lengths_q, lengths_k)
    packed_ = [torch.tensor(x).transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v)]  # (total, H, d)
    cu_q, cu_k = (torch.tensor(_offsets(x)) for x in (lengths_q, lengths_k))
    out, lse, _ = fa_numba.flash_attn_varlen_func(*packed_, cu_q, cu_k, 11, 11, causal=True, return_attn_probs=True)
    assert out.shape == (16, 2, 8) and lse.shape == (2, 16)
    mask = packed.varlen(cu_q, cu_k, causal=True)
    tolerance.check_attention(out.detach().transpose(0, 1).numpy(), lse.detach().numpy(), q, k, v, mask=mask, order="v2",
                              block_q=16, block_k=16)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    out.backward(torch.tensor(dout))
    exact = [x.astype(np.float64) for x in (q, k, v)]
    tolerance_backward.check_attention_backward(*(x.grad.transpose(0, 1).numpy() for x in packed_), *exact,
                                                dout.transpose(1, 0, 2).astype(np.float64), mask=mask)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= the longest sequence"):
        fa_numba.flash_attn_varlen_func(*packed_, cu_q, cu_k, 10, 11)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(2,\) or \(2, 2\)"):
        fa_numba.flash_attn_varlen_func(*packed_, cu_q, cu_k, 11, 11, alibi_slopes=torch.ones(3))


def test_compare_shows_a_packed_batch_beside_its_padded_equivalent(capsys):
    from fa_numba import cli

    assert cli.main(["compare", "--varlen", "100,300,50", "--causal", "--head-dim", "64", "--block-q", "64",
                     "--block-k", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    packed_row, padded_row = (line.split() for line in lines[2:4])
    mask = packed.varlen(_offsets((100, 300, 50)), _offsets((100, 300, 50)), causal=True)
    want_packed = iomodel.total_bytes(iomodel.traffic("v2", 450, 450, 64, 64, 32, mask=mask, heads=2), 4)
    want_padded = iomodel.total_bytes(iomodel.traffic("v2", 300, 300, 64, 64, 32, causal=True, batch=3, heads=2), 4)
    assert packed_row[-1] == f"{want_packed / 2**20:.2f}" and padded_row[-1] == f"{want_padded / 2**20:.2f}"
    kinds = tiling.classify(450, 450, 64, 32, mask=mask)
    assert int(packed_row[2]) == 2 * int((kinds != tiling.SKIP).sum())  # tiles computed, both heads
    assert packed_row[-2] == padded_row[-2] == str(2 * (100 * 101 + 300 * 301 + 50 * 51) // 2)  # the same pairs


def test_compare_varlen_refuses_what_it_does_not_use(capsys):
    from fa_numba import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["compare", "--varlen", "10,20", "--mask", "causal"])
    assert info.value.code == 2 and "argument --varlen: not allowed with --mask" in capsys.readouterr().err


def _alibi_case():
    """Three sequences (L != M, one without keys), per-sequence slopes, softcap 3: the varlen drop-in's mod."""
    torch = pytest.importorskip("torch", reason="the drop-in takes torch tensors (the torch extra)")
    from fa_numba import dropins

    lengths_q, lengths_k = (5, 9, 4), (8, 9, 0)
    cu_q, cu_k = _offsets(lengths_q), _offsets(lengths_k)
    mask = packed.varlen(cu_q, cu_k, causal=True)
    slopes = torch.tensor([[0.25, 0.5], [0.125, 1.0], [2.0, 0.75]])
    return lengths_q, lengths_k, cu_q, cu_k, mask, slopes, dropins._varlen_alibi(slopes, 3.0, mask, heads=2)


def test_flash_attn_varlen_func_takes_alibi_at_each_sequences_own_positions():
    """alibi_slopes over a packed batch: the varlen mod's score at a packed pair (i, j) is bit for bit flash-attn's
    ALiBi mod of that sequence alone at its local pair (a, b), delta = M - L (mods.conventions.flash_attn);
    per-sequence slopes (B, H) index their sequence's row."""
    from fa_numba import mods
    from fa_numba.mods import conventions

    lengths_q, lengths_k, cu_q, cu_k, mask, slopes, mod = _alibi_case()
    scores = np.random.default_rng(8).standard_normal((1, 2, 18, 17)) * 4
    visible = mask.dense(18, 17)
    packed_scores = mods.scores(mod, scores, visible)
    for t in range(3):
        rows, keys = slice(cu_q[t], cu_q[t + 1]), slice(cu_k[t], cu_k[t + 1])
        if cu_k[t + 1] == cu_k[t]:
            continue
        alone = conventions.flash_attn(slopes[t].numpy(), softcap=3.0, delta=lengths_k[t] - lengths_q[t], batch=1,
                                       heads=2)
        want = mods.scores(alone, scores[:, :, rows, keys], visible[rows, keys])
        assert np.array_equal(packed_scores[:, :, rows, keys], want), t


@pytest.mark.slow  # 14 s: the mod's compile for the kernel, and its reference evaluated pair by pair
def test_flash_attn_varlen_func_with_alibi_is_within_the_rule():
    torch = pytest.importorskip("torch", reason="the drop-in takes torch tensors (the torch extra)")
    lengths_q, lengths_k, cu_q, cu_k, mask, slopes, mod = _alibi_case()
    _, q, k, v = _problem(9, lengths_q, lengths_k)
    as_packed = [torch.tensor(x).transpose(0, 1).contiguous() for x in (q, k, v)]
    out, lse, _ = fa_numba.flash_attn_varlen_func(*as_packed, torch.tensor(cu_q), torch.tensor(cu_k), 9, 9,
                                                  causal=True, softcap=3.0, alibi_slopes=slopes,
                                                  return_attn_probs=True)
    tolerance.check_attention(out.transpose(0, 1).numpy(), lse.numpy(), q, k, v, mask=mask, score_mod=mod,
                              order="v2", block_q=16, block_k=16)
