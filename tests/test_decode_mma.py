"""The tensor-core split kernel (kernels/mma/decode.py) through attention_with_kvcache(engine="mma"): within the
rule with the 16-bit P term, one split bitwise the v2-mma kernel, paged == contiguous and batch invariance
bitwise, a masked non-finite value never multiplied, keys past a request's length never read, the counted
traffic, the engine's choice, and a pipeline without its wait caught by the simulator's deferred copies."""

import math

import numpy as np
import pytest

import fa_numba
from fa_numba import engines, iomodel, split_kv, warp
from fa_numba.kernels.counting import run_counted_decode
from fa_numba.kernels.mma import decode as mma_decode

D = 16
BLOCK_K = 16  # the smallest tile of m16n8k16: the simulator runs each of a warp's 32 lanes as a thread


def problem(rng, batch, heads, heads_kv, n_q, n_max, dtype=np.float16):
    q = rng.standard_normal((batch, heads, n_q, D)).astype(dtype)
    k = rng.standard_normal((batch, heads_kv, n_max, D)).astype(dtype)
    v = rng.standard_normal((batch, heads_kv, n_max, D)).astype(dtype)
    return q, k, v


def call(q, k, v, lengths, **kw):
    return fa_numba.attention_with_kvcache(q, k, v, lengths, block_k=BLOCK_K, return_lse=True, engine="mma", **kw)


def bits(x):
    return np.asarray(x).view(np.uint32)


@pytest.mark.lemma("L11")
@pytest.mark.parametrize("causal, n_q", [(True, 2), pytest.param(False, 1, marks=pytest.mark.slow)])  # ~8 s each
def test_split_result_is_within_the_rule_with_the_16_bit_p_term(causal, n_q):
    rng = np.random.default_rng(n_q)
    q, k, v = problem(rng, 2, 4, 2, n_q, 80)
    lengths = [75, 33]
    out, lse = call(q, k, v, lengths, causal=causal, split_size=32)
    assert out.dtype == np.float32 and out.shape == q.shape and lse.shape == q.shape[:-1]
    for b, n in enumerate(lengths):
        c = split_kv.check(out[b], lse[b], q[b], k[b, :, :n], v[b, :, :n], causal=causal, scale=1 / math.sqrt(D),
                           block_k=BLOCK_K, splits=split_kv.Splits(3, 2, BLOCK_K), p_dtype="float16")
        assert c.err_out <= c.atol_out and c.err_lse <= c.atol_lse


@pytest.mark.slow  # ~8 s
def test_bfloat16_is_within_the_rule():
    rng = np.random.default_rng(7)
    q32, k32, v32 = problem(rng, 1, 2, 1, 1, 40, dtype=np.float32)
    to_bf16 = lambda x: (x.view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731 (truncated: exact bf16 values)
    back = lambda x: (x.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    q, k, v = (to_bf16(x) for x in (q32, k32, v32))
    out, lse = fa_numba.attention_with_kvcache(*(bf16(x) for x in (q, k, v)), [37], block_k=BLOCK_K, return_lse=True,
                                               engine="mma", split_size=16)
    c = split_kv.check(out[0], lse[0], back(q)[0], back(k)[0, :, :37], back(v)[0, :, :37], causal=True,
                       scale=1 / math.sqrt(D), block_k=BLOCK_K, splits=split_kv.Splits(3, 1, BLOCK_K),
                       p_dtype="bfloat16")
    assert c.err_out <= c.atol_out and c.err_lse <= c.atol_lse


def bf16(x):
    """bfloat16 bits as a torch tensor (how the API takes bfloat16 without a NumPy dtype)."""
    torch = pytest.importorskip("torch")
    return torch.from_numpy(x.astype(np.int16)).view(torch.bfloat16)


@pytest.mark.lemma("L11")
def test_one_split_is_the_v2_mma_kernel_bitwise():
    """One split folds the tiles exactly as the tensor-core v2 kernel of the same tiles does (the packed rows of
    one K/V head are that kernel's query rows), and the combine gives it back exactly: the same bits."""
    from numba import cuda

    from fa_numba.kernels.mma.engine_v2 import make_v2_mma

    rng = np.random.default_rng(3)
    q, k, v = problem(rng, 1, 4, 2, 1, 48)  # 2 packed rows per K/V head
    n = 45
    out, lse = call(q, k, v, [n], causal=False, num_splits=1)
    kernel = make_v2_mma("float16", 1, BLOCK_K, D, False)
    packed = q.reshape(1, 2, 2, D)  # (B, H_kv, R, d): row r = query head 2 h_kv + r
    inputs = [cuda.to_device(np.ascontiguousarray(x).view(np.uint16)) for x in (packed, k[:, :, :n], v[:, :, :n])]
    o, m = cuda.device_array((1, 2, 2, D), np.float32), cuda.device_array((1, 2, 2), np.float32)
    kernel(*inputs, o, m, 1 / math.sqrt(D))
    assert np.array_equal(bits(out), bits(o.copy_to_host().reshape(out.shape)))
    assert np.array_equal(bits(lse), bits(m.copy_to_host().reshape(lse.shape)))


@pytest.mark.lemma("L11")
def test_a_paged_cache_equals_contiguous_bitwise_and_junk_past_a_length_is_never_read():
    rng = np.random.default_rng(2026)
    q, k, v = problem(rng, 2, 2, 2, 1, 64)
    lengths = [61, 20]
    page = 32
    pool = 5
    k_pages = np.full((pool, 2, page, D), np.nan, np.float16)  # NaN wherever no key of a request is
    v_pages = np.full((pool, 2, page, D), np.inf, np.float16)
    table = np.array([[3, 0], [4, 1]], np.int32)
    for b, n in enumerate(lengths):
        for p in range(-(-n // page)):
            width = min(page, n - p * page)
            k_pages[table[b, p], :, :width] = k[b, :, p * page:p * page + width]
            v_pages[table[b, p], :, :width] = v[b, :, p * page:p * page + width]
    flat = call(q, k, v, lengths, split_size=32)
    paged = call(q, k_pages, v_pages, lengths, block_table=table, split_size=32)
    assert np.isfinite(paged[0]).all()
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(flat, paged))


@pytest.mark.lemma("L11")
def test_a_fixed_split_size_makes_a_request_independent_of_its_batch():
    rng = np.random.default_rng(5)
    q, k, v = problem(rng, 3, 2, 1, 2, 64)
    lengths = [29, 64, 7]
    together = call(q, k, v, lengths, split_size=32)
    alone = call(q[:1], k[:1], v[:1], lengths[:1], split_size=32)
    assert all(np.array_equal(bits(a[:1]), bits(b)) for a, b in zip(together, alone))


def test_a_masked_inf_value_is_never_multiplied():
    """Causal with N_q = 2: the last key is the second query's alone. An inf value there must not reach the
    first query (0 * inf would be NaN): the PARTIAL tile takes the engine's exact path."""
    rng = np.random.default_rng(9)
    q, k, v = problem(rng, 1, 2, 1, 2, 32)
    n = 27
    v[0, 0, n - 1] = np.inf
    out, lse = call(q, k, v, [n], split_size=32)
    first = out[:, :, 0]  # both heads' first query: keys 0 .. n - 2
    assert np.isfinite(first).all()
    c = split_kv.check(out[0][:, :1], lse[0][:, :1], q[0][:, :1], k[0, :, :n - 1], v[0, :, :n - 1], causal=True,
                       scale=1 / math.sqrt(D), block_k=BLOCK_K, splits=None, p_dtype="float16")
    assert c.err_out <= c.atol_out


@pytest.mark.lemma("L11")
def test_counted_traffic_equals_the_model():
    rng = np.random.default_rng(12)
    lengths, n_q, heads, heads_kv, tiles = [40, 9], 2, 4, 2, 2
    rows = n_q * heads // heads_kv
    q = rng.standard_normal((2, heads_kv, rows, D)).astype(np.float16).view(np.uint16)
    k = rng.standard_normal((2, heads_kv, 48, D)).astype(np.float16).view(np.uint16)
    split = mma_decode.decode_split("float16", rows, D, BLOCK_K)
    splits = 2  # 3 key tiles of the longest request, 2 a split
    lohi = split_kv.row_intervals(np.array(lengths), n_q, heads // heads_kv, True)
    out, lse, ledger = run_counted_decode(q, k, k, lengths, np.arange(2)[:, None], lohi, 0.25, layout=split,
                                          tiles_per_split=tiles, splits=splits)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert ledger == iomodel.traffic_decode(lengths, n_q, D, split.block_q, BLOCK_K, tiles, splits, True, heads,
                                            heads_kv)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the stale tiles' NaN through exp and the products
def test_a_pipeline_without_its_wait_reads_stale_tiles(monkeypatch):
    """The simulator lands a cp.async group only at the wait that covers it, so the same kernel with its
    wait_group 1 taken out computes from tiles that never arrived: the check this module's tests rest on."""
    rng = np.random.default_rng(4)
    q, k, v = problem(rng, 1, 2, 1, 1, 64)
    right = call(q, k, v, [64], split_size=64)[0]
    monkeypatch.setattr(warp, "cp_async_wait_1", lambda: None)
    wrong = call(q, k, v, [64], split_size=64)[0]
    assert not np.allclose(wrong, right, atol=1e-2, equal_nan=True)


@pytest.mark.parametrize("kind, d, aligned, block_k, chosen", [
    ("float16", 16, True, None, "mma"), ("bfloat16", 128, True, None, "mma"),
    ("float32", 16, True, None, "simt"),  # no float32 decode kernel on tensor cores
    ("float16", 12, True, None, "simt"),  # d not a multiple of 8: no 16-byte rows for cp.async
    ("float16", 16, False, None, "simt"),  # caches not 16-byte aligned
    ("float16", 16, True, 8, "simt"),  # a tile mma.sync cannot take
    ("float16", 192, True, None, "simt")])  # over the decode kernel's limit (d = 192 spills)
def test_auto_takes_the_tensor_cores_wherever_they_take_the_call(kind, d, aligned, block_k, chosen):
    assert engines.decode("auto", kind=kind, head_dim=d, block_k=block_k, aligned=aligned) == chosen
    if chosen == "simt":
        with pytest.raises(ValueError, match="engine='mma'|head dim|block_k|tile"):
            engines.decode("mma", kind=kind, head_dim=d, block_k=block_k, aligned=aligned)


def test_the_default_tiles_fit_two_stages_in_48_kb():
    for d, block_k in ((32, 64), (64, 64), (128, 32)):
        split = mma_decode.decode_split("float16", 4, d)
        assert split.block_k == block_k and split.shared_bytes <= 48 * 1024 and split.block_q == 16
    assert [mma_decode.decode_split("float16", r, 64).block_q for r in (16, 17, 40, 64, 65)] == [16, 32, 64, 64, 64]
    with pytest.raises(ValueError, match="over the 49152 static limit"):
        mma_decode.decode_split("float16", 4, 128, block_k=64)


def test_a_head_dim_of_24_copies_a_zero_chunk_past_d():
    """d = 24 pads to 32 columns: each row's last 16-byte chunk is zero-filled, on the whole tiles' lean copies
    and on the last tile's general ones alike."""
    rng = np.random.default_rng(24)
    d = 24
    q = rng.standard_normal((1, 2, 1, d)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, 64, d)).astype(np.float16) for _ in range(2))
    out, lse = fa_numba.attention_with_kvcache(q, k, v, [57], block_k=BLOCK_K, split_size=32, return_lse=True,
                                               engine="mma")
    c = split_kv.check(out[0], lse[0], q[0], k[0, :, :57], v[0, :, :57], causal=True, scale=1 / math.sqrt(d),
                       block_k=BLOCK_K, splits=split_kv.Splits(2, 2, BLOCK_K), p_dtype="float16")
    assert c.err_out <= c.atol_out and c.err_lse <= c.atol_lse
