"""attention_with_kvcache with a value head dim of its own (d_v != d, MLA's 192 / 128): both split kernels take
it natively, reading the caches where they are. Within the rule against the float64 reference, bitwise the call
whose V is zero-padded to d (the arithmetic the native kernels must reproduce), the append of k (d) and v (d_v)
into a paged cache, the counted traffic against iomodel.traffic_decode(d_v=), and the checks by name."""

import math

import numpy as np
import pytest

import fa_numba
from fa_numba import iomodel, split_kv
from fa_numba.kernels import decode as kernels
from fa_numba.kernels.counting import run_counted_decode
from fa_numba.kernels.mma import decode as mma_decode

# engine, dtype, d, d_v, block_k: the simulator runs every thread as a Python thread, so the tiles are small;
# 24 = 16 + 8 makes the tensor-core kernel copy a zero chunk past d_v
CASES = {
    "simt-wider-v": ("simt", np.float32, 8, 16, 8),
    "simt-narrower-v": ("simt", np.float32, 16, 8, 8),
    "mma-narrower-v": ("mma", np.float16, 16, 8, 16),
    "mma-wider-v": ("mma", np.float16, 8, 24, 16),
}
SLOW = {"simt-narrower-v", "mma-wider-v"}  # ~3 s and ~8 s in the simulator; one case of each engine stays


def cases():
    return [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in CASES]


def problem(rng, dtype, d, d_v, batch=2, heads=2, heads_kv=1, n_q=1, n_max=32):
    q = rng.standard_normal((batch, heads, n_q, d)).astype(dtype)
    k = rng.standard_normal((batch, heads_kv, n_max, d)).astype(dtype)
    v = rng.standard_normal((batch, heads_kv, n_max, d_v)).astype(dtype)
    return q, k, v


def to_pages(cache, page, order):
    """A contiguous cache (B, H_kv, N_max, w) as pages (B N_max / page, H_kv, page, w) laid out in `order`, and
    the table that reads them back."""
    batch, heads_kv, n_max, width = cache.shape
    per = n_max // page
    pages = cache.reshape(batch, heads_kv, per, page, width).transpose(0, 2, 1, 3, 4).reshape(-1, heads_kv, page,
                                                                                             width)
    return np.ascontiguousarray(pages[np.argsort(order)]), order.reshape(batch, per).astype(np.int32)


@pytest.mark.lemma("L11")
@pytest.mark.parametrize("name", cases())
def test_a_value_head_dim_of_its_own_is_within_the_rule_with_new_keys_appended_to_pages(name):
    engine, dtype, d, d_v, block_k = CASES[name]
    rng = np.random.default_rng(len(name))
    q, k, v = problem(rng, dtype, d, d_v)
    starts = np.array([13, 30])
    new_k = rng.standard_normal((2, 1, 2, d)).astype(dtype)
    new_v = rng.standard_normal((2, 1, 2, d_v)).astype(dtype)
    order = rng.permutation(2 * 32 // 16)  # pages of 16 keys, shuffled
    k_pages, table = to_pages(k, 16, order)
    v_pages, _ = to_pages(v, 16, order)
    out, lse = fa_numba.attention_with_kvcache(q, k_pages, v_pages, starts, k=new_k, v=new_v, block_table=table,
                                               split_size=16, block_k=block_k, engine=engine, return_lse=True)
    assert out.shape == (2, 2, 1, d_v) and out.dtype == np.float32 and lse.shape == (2, 2, 1)
    want_k, want_v = k.copy(), v.copy()
    for b, s in enumerate(starts):
        want_k[b, :, s:s + 2], want_v[b, :, s:s + 2] = new_k[b], new_v[b]
    for b, s in enumerate(starts):
        n = s + 2
        got_k, got_v = (np.concatenate(list(c[table[b]]), axis=1)[:, :n] for c in (k_pages, v_pages))
        assert np.array_equal(got_k, want_k[b, :, :n]) and np.array_equal(got_v, want_v[b, :, :n])
        c = split_kv.check(out[b], lse[b], q[b].astype(np.float32), want_k[b, :, :n].astype(np.float32),
                           want_v[b, :, :n].astype(np.float32), causal=True, scale=1 / math.sqrt(d),
                           block_k=block_k, splits=split_kv.Splits(-(-n // 16), 16 // block_k, block_k),
                           p_dtype="float16" if engine == "mma" else None)
        assert c.err_out <= c.atol_out and c.err_lse <= c.atol_lse


@pytest.mark.parametrize("name", cases())
def test_the_native_value_dim_is_bitwise_the_call_on_zero_padded_operands(name):
    """The CUDA-core kernel stages every tile max(d, d_v) wide with zeros past each operand's own width, which is
    what padding the narrower operand with zeros gives; the tensor-core kernel's O columns are independent sums.
    So the native call must equal, bit for bit, the d_v = d call on padded operands (its first d_v columns)."""
    engine, dtype, d, d_v, block_k = CASES[name]
    rng = np.random.default_rng(3)
    q, k, v = problem(rng, dtype, d, d_v, batch=1)
    width = max(d, d_v)
    pad = lambda x: np.concatenate([x, np.zeros(x.shape[:-1] + (width - x.shape[-1],), x.dtype)], -1)  # noqa: E731
    kw = dict(split_size=16, block_k=block_k, engine=engine, return_lse=True)
    out, lse = fa_numba.attention_with_kvcache(q, k, v, [27], **kw)
    if d_v < d:  # V padded to d; q, k as they are
        out_p, lse_p = fa_numba.attention_with_kvcache(q, k, pad(v), [27], **kw)
    else:  # q, K padded to d_v: the same scores, the same scale
        out_p, lse_p = fa_numba.attention_with_kvcache(pad(q), pad(k), v, [27], scale=1 / math.sqrt(d), **kw)
    assert np.array_equal(out, out_p[..., :d_v]) and np.array_equal(lse, lse_p)
    assert np.array_equal(out_p[..., d_v:], np.zeros_like(out_p[..., d_v:]))


@pytest.mark.lemma("L11")
@pytest.mark.parametrize("name", cases())
def test_counted_traffic_with_a_value_dim_equals_the_model(name):
    engine, dtype, d, d_v, block_k = CASES[name]
    rng = np.random.default_rng(12)
    lengths, n_q, heads, heads_kv, tiles = [30, 9], 2, 4, 2, 1
    rows = n_q * heads // heads_kv
    q = rng.standard_normal((2, heads_kv, rows, d)).astype(dtype)
    k = rng.standard_normal((2, heads_kv, 32, d)).astype(dtype)
    v = rng.standard_normal((2, heads_kv, 32, d_v)).astype(dtype)
    if engine == "mma":
        layout = mma_decode.decode_split("float16", rows, d, block_k, d_v)
        q, k, v = (x.view(np.uint16) for x in (q, k, v))
    else:
        layout = kernels.decode_layout(rows, d, block_k, d_v)
    splits = -(-32 // (tiles * block_k))
    lohi = split_kv.row_intervals(np.array(lengths), n_q, heads // heads_kv, True)
    out, lse, ledger = run_counted_decode(q, k, v, lengths, np.arange(2)[:, None], lohi, 0.25, layout=layout,
                                          tiles_per_split=tiles, splits=splits)
    assert out.shape == (2, heads_kv, rows, d_v) and not np.isnan(out).any() and not np.isnan(lse).any()
    model = iomodel.traffic_decode(lengths, n_q, d, layout.block_q, block_k, tiles, splits, True, heads, heads_kv,
                                   d_v=d_v)
    assert ledger == model
    assert model.reads["V"] * d == model.reads["K"] * d_v  # V counted d_v wide, K d wide


def test_value_dims_are_checked_by_name():
    rng = np.random.default_rng(5)
    q, k, v = problem(rng, np.float32, 8, 16, batch=1)
    args = dict(block_k=8, split_size=16)
    with pytest.raises(ValueError, match=r"v_cache must have k_cache's first three axes \(1, 1, 32\)"):
        fa_numba.attention_with_kvcache(q, k, v[:, :, :16], [8], **args)
    with pytest.raises(ValueError, match=r"v must have shape \(1, 1, 1, 16\) \(B of q, H_kv of the cache, d_v of "):
        fa_numba.attention_with_kvcache(q, k, v, [8], k=k[:, :, :1], v=v[:, :, :1, :8], **args)
    with pytest.raises(ValueError, match="v_cache must have head dim 1 <= d_v <= 256, got 0"):
        fa_numba.attention_with_kvcache(q, k, v[..., :0], [8], **args)
    half = [x.astype(np.float16) for x in (q, k, v[..., :12])]  # d_v = 12: no 16-byte rows for cp.async
    with pytest.raises(ValueError, match="value head dim d_v a multiple of 8"):
        fa_numba.attention_with_kvcache(*half, [8], engine="mma", block_k=16, split_size=16)
