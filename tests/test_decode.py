"""attention_with_kvcache: split-KV decoding against the float64 reference, bitwise paged == contiguous and
batch invariance, the cache append, the checks, the combine, and the counted traffic (proofs/L11)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fa_numba
from bounds import assert_within, attention_bound, dense_counts, merge_bound
from fa_numba import iomodel, online_softmax, reference, split_kv
from fa_numba.kernels import decode as kernels
from fa_numba.kernels.counting import run_counted_decode

D = 8
BLOCK_K = 8  # small tiles: the simulator runs every thread as a Python thread


def problem(rng, batch, heads, heads_kv, n_q, n_max, d=D, dtype=np.float32):
    q = rng.standard_normal((batch, heads, n_q, d)).astype(dtype)
    k = rng.standard_normal((batch, heads_kv, n_max, d)).astype(dtype)
    v = rng.standard_normal((batch, heads_kv, n_max, d)).astype(dtype)
    return q, k, v


def keys_of(cache, b, n):
    """Request b's first n keys of a contiguous cache, (H_kv, n, d): what the reference attends over."""
    return cache[b, :, :n]


def check_all(out, lse, q, k, v, lengths, *, causal=True, splits):
    """Judge every request of a contiguous-cache call by split_kv.check."""
    scale = 1 / math.sqrt(q.shape[-1])
    return [split_kv.check(out[b], lse[b], q[b], keys_of(k, b, n), keys_of(v, b, n), causal=causal, scale=scale,
                           block_k=BLOCK_K, splits=splits) for b, n in enumerate(lengths)]


@pytest.mark.lemma("L11")
@pytest.mark.parametrize("causal, n_q, dtype", [  # ~3 s each in the simulator: three in the slow tier
    (True, 1, np.float32), pytest.param(True, 3, np.float32, marks=pytest.mark.slow),
    pytest.param(False, 2, np.float32, marks=pytest.mark.slow),
    pytest.param(True, 2, np.float16, marks=pytest.mark.slow)])
def test_split_result_is_within_the_rule(causal, n_q, dtype):
    rng = np.random.default_rng(n_q)
    q, k, v = problem(rng, 2, 4, 2, n_q, 56, dtype=dtype)
    lengths = [53, 20]
    out, lse = fa_numba.attention_with_kvcache(q, k, v, lengths, causal=causal, split_size=16, block_k=BLOCK_K,
                                               return_lse=True)
    assert out.dtype == np.float32 and out.shape == q.shape and lse.shape == q.shape[:-1]
    checks = check_all(out, lse, q, k, v, lengths, causal=causal, splits=split_kv.Splits(4, 2, BLOCK_K))
    assert all(c.err_out <= c.atol_out and c.err_lse <= c.atol_lse for c in checks)


@pytest.mark.lemma("L11")
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])  # ~2 s each
def test_one_split_is_the_v2_kernel_bitwise(causal):
    """One split folds the tiles exactly as the v2 engine kernel of the same layout does, and the combine gives it
    back exactly (merge(identity, a) = a; O_s / 1; LSE_s + log 1): the same bits, request by request."""
    from numba import cuda

    from fa_numba.kernels.engine_v2 import make_v2_engine

    rng = np.random.default_rng(3)
    q, k, v = problem(rng, 2, 2, 1, 3, 40)
    lengths = [37, 16]
    out, lse = fa_numba.attention_with_kvcache(q, k, v, lengths, causal=causal, num_splits=1, block_k=BLOCK_K,
                                               return_lse=True)
    layout = kernels.decode_layout(2 * 3, D, BLOCK_K)  # 2 query heads x 3 queries per K/V head
    v2 = make_v2_engine(layout.block_q, layout.block_k, D, causal, micro=(layout.tm, layout.tn))
    for b, n in enumerate(lengths):
        inputs = [cuda.to_device(np.ascontiguousarray(x)) for x in (q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])]
        o, m = cuda.device_array((1, 2, 3, D), np.float32), cuda.device_array((1, 2, 3), np.float32)
        v2(*inputs, o, m, 1 / math.sqrt(D))
        assert np.array_equal(out[b], o.copy_to_host()[0]) and np.array_equal(lse[b], m.copy_to_host()[0])


def paged(k, v, lengths, page, rng):
    """The contiguous caches cut into pages of `page` keys, shuffled into a pool with spare pages, and the
    page table that finds them again."""
    batch, heads_kv, n_max, d = k.shape
    per = -(-n_max // page)
    pool = batch * per + 3  # spare pages, never referenced
    order = rng.permutation(pool)
    k_pages = rng.standard_normal((pool, heads_kv, page, d)).astype(k.dtype)  # junk where no key is
    v_pages = rng.standard_normal((pool, heads_kv, page, d)).astype(k.dtype)
    table = np.zeros((batch, per), np.int32)
    for b in range(batch):
        for p in range(per):
            slot = int(order[b * per + p])
            table[b, p] = slot
            chunk = slice(p * page, min((p + 1) * page, n_max))
            width = chunk.stop - chunk.start
            k_pages[slot, :, :width] = k[b, :, chunk]
            v_pages[slot, :, :width] = v[b, :, chunk]
    return k_pages, v_pages, table


@pytest.mark.lemma("L11")
@pytest.mark.slow  # ~4 s an example; test_a_paged_cache_of_16_key_pages_equals_contiguous_bitwise stays
@settings(max_examples=4)
@given(page=st.sampled_from([8, 16, 24]), seed=st.integers(0, 2**16))
def test_paged_cache_equals_contiguous_bitwise(page, seed):
    flat, pages = paged_and_contiguous(page, seed)
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(flat, pages))


@pytest.mark.lemma("L11")
def test_a_paged_cache_of_16_key_pages_equals_contiguous_bitwise():
    flat, pages = paged_and_contiguous(16, 2026)
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(flat, pages))


def paged_and_contiguous(page, seed):
    """(out, lse) of one call on a contiguous cache and of the same call on a shuffled paged copy of it."""
    rng = np.random.default_rng(seed)
    q, k, v = problem(rng, 2, 2, 2, 1, 48)
    lengths = [int(rng.integers(1, 49)), int(rng.integers(0, 49))]
    k_pages, v_pages, table = paged(k, v, lengths, page, rng)
    flat = fa_numba.attention_with_kvcache(q, k, v, lengths, split_size=16, block_k=BLOCK_K, return_lse=True)
    pages = fa_numba.attention_with_kvcache(q, k_pages, v_pages, lengths, block_table=table, split_size=16,
                                            block_k=BLOCK_K, return_lse=True)
    return flat, pages


@pytest.mark.lemma("L11")
def test_a_fixed_split_size_makes_a_request_independent_of_its_batch():
    """A request alone, and the same request among others of other lengths: the same bits (split_size fixed)."""
    rng = np.random.default_rng(5)
    q, k, v = problem(rng, 3, 2, 1, 2, 64)
    lengths = [29, 64, 7]
    together = fa_numba.attention_with_kvcache(q, k, v, lengths, split_size=16, block_k=BLOCK_K, return_lse=True)
    alone = fa_numba.attention_with_kvcache(q[:1], k[:1], v[:1], lengths[:1], split_size=16, block_k=BLOCK_K,
                                            return_lse=True)
    for a, b in zip(together, alone):
        assert np.array_equal(a[:1].view(np.uint32), b.view(np.uint32))


@pytest.mark.lemma("L11")
@pytest.mark.slow  # five calls, ~3 s
def test_every_num_splits_is_within_the_rule():
    rng = np.random.default_rng(6)
    q, k, v = problem(rng, 1, 2, 1, 1, 40)
    tiles = 5
    for count in range(1, tiles + 1):
        out, lse = fa_numba.attention_with_kvcache(q, k, v, [40], num_splits=count, block_k=BLOCK_K,
                                                   return_lse=True)
        per = -(-tiles // count)
        (c,) = check_all(out, lse, q, k, v, [40], splits=split_kv.Splits(-(-tiles // per), per, BLOCK_K))
        assert c.err_out <= c.atol_out


@pytest.mark.lemma("L11")
def test_lengths_zero_one_a_tile_boundary_and_the_whole_cache():
    rng = np.random.default_rng(7)
    q, k, v = problem(rng, 4, 2, 2, 1, 32)
    lengths = [0, 1, 16, 32]
    out, lse = fa_numba.attention_with_kvcache(q, k, v, np.array(lengths, np.int32), split_size=16,
                                               block_k=BLOCK_K, return_lse=True)
    assert np.array_equal(out[0], np.zeros_like(out[0])) and np.all(lse[0] == -np.inf)  # a dead row
    checks = check_all(out, lse, q, k, v, lengths, splits=split_kv.Splits(2, 2, BLOCK_K))
    assert all(c.err_out <= c.atol_out for c in checks)
    # N_q = 2 causal with one key: query 0 sees none (0, -inf), query 1 sees key 0 (its value, LSE = its score)
    q2 = rng.standard_normal((1, 1, 2, D)).astype(np.float32)
    out2, lse2 = fa_numba.attention_with_kvcache(q2, k[:1, :1], v[:1, :1], [1], block_k=BLOCK_K, return_lse=True)
    assert np.array_equal(out2[0, 0, 0], np.zeros(D)) and lse2[0, 0, 0] == -np.inf
    np.testing.assert_allclose(out2[0, 0, 1], v[0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(lse2[0, 0, 1], q2[0, 0, 1] @ k[0, 0, 0] / math.sqrt(D), rtol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_new_keys_are_appended_in_place_and_attended(layout):
    rng = np.random.default_rng(8)
    q, k, v = problem(rng, 2, 2, 1, 2, 32)
    starts = np.array([5, 17])
    new_k, new_v = (rng.standard_normal((2, 1, 2, D)).astype(np.float32) for _ in range(2))
    want_k, want_v = k.copy(), v.copy()
    for b, s in enumerate(starts):
        want_k[b, :, s:s + 2], want_v[b, :, s:s + 2] = new_k[b], new_v[b]
    if layout == "contiguous":
        k_cache, v_cache, table = k, v, None
    else:
        k_cache, v_cache, table = paged(k, v, starts, 8, rng)
    out, lse = fa_numba.attention_with_kvcache(q, k_cache, v_cache, starts, k=new_k, v=new_v, block_table=table,
                                               split_size=16, block_k=BLOCK_K, return_lse=True)
    for b, s in enumerate(starts):
        n = s + 2
        if table is None:
            got_k, got_v = k_cache[b, :, :n], v_cache[b, :, :n]
        else:
            got_k, got_v = (np.concatenate([c[p] for p in table[b]], axis=1)[:, :n] for c in (k_cache, v_cache))
        assert np.array_equal(got_k, want_k[b, :, :n]) and np.array_equal(got_v, want_v[b, :, :n])
    checks = check_all(out, lse, q, want_k, want_v, starts + 2, splits=split_kv.Splits(2, 2, BLOCK_K))
    assert all(c.err_out <= c.atol_out for c in checks)


def test_a_step_without_queries_still_appends_its_keys_and_values():
    """N_q = 0 with new k, v: an empty result, and the caches hold the new keys and values, as a step with
    queries leaves them (the append comes before the attention, whatever the queries)."""
    rng = np.random.default_rng(10)
    k, v = (rng.standard_normal((2, 1, 32, D)).astype(np.float32) for _ in range(2))
    starts = np.array([3, 20])
    new_k, new_v = (rng.standard_normal((2, 1, 2, D)).astype(np.float32) for _ in range(2))
    want_k, want_v = k.copy(), v.copy()
    for b, s in enumerate(starts):
        want_k[b, :, s:s + 2], want_v[b, :, s:s + 2] = new_k[b], new_v[b]
    q = np.zeros((2, 2, 0, D), np.float32)
    out = fa_numba.attention_with_kvcache(q, k, v, starts, k=new_k, v=new_v, block_k=BLOCK_K)
    assert out.shape == (2, 2, 0, D)
    assert np.array_equal(k, want_k) and np.array_equal(v, want_v)


def test_one_array_as_both_caches_is_refused_when_keys_are_appended():
    """k_cache and v_cache the same memory with new k, v: the values would overwrite the keys. Refused by name
    before anything is written; without new keys the same array is a valid (if unusual) cache."""
    rng = np.random.default_rng(11)
    cache = rng.standard_normal((1, 1, 32, D)).astype(np.float32)
    before = cache.copy()
    q = rng.standard_normal((1, 1, 1, D)).astype(np.float32)
    new = rng.standard_normal((1, 1, 1, D)).astype(np.float32)
    with pytest.raises(ValueError, match="k_cache and v_cache must not share memory when k, v are given"):
        fa_numba.attention_with_kvcache(q, cache, cache, [4], k=new, v=new.copy(), block_k=BLOCK_K)
    with pytest.raises(ValueError, match="must not share memory"):
        fa_numba.attention_with_kvcache(q, cache[:, :, :16], cache[:, :, 8:24], [4], k=new, v=new.copy(),
                                        block_k=BLOCK_K)
    assert np.array_equal(cache, before)
    out = fa_numba.attention_with_kvcache(q, cache, cache, [4], block_k=BLOCK_K)
    assert out.shape == (1, 1, 1, D) and np.isfinite(out).all()


@pytest.mark.slow  # ~3 s; the NumPy append test stays in the default run
def test_a_cpu_tensor_cache_is_appended_in_place():
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    rng = np.random.default_rng(9)
    q, k, v = (torch.from_numpy(x) for x in problem(rng, 1, 2, 1, 1, 16))
    new_k, new_v = torch.ones(1, 1, 1, D), torch.full((1, 1, 1, D), 2.0)
    out = fa_numba.attention_with_kvcache(q, k, v, torch.tensor([3], dtype=torch.int32), k=new_k, v=new_v,
                                          block_k=BLOCK_K)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert torch.equal(k[0, :, 3], new_k[0, :, 0]) and torch.equal(v[0, :, 3], new_v[0, :, 0])


def bad(**change):
    rng = np.random.default_rng(10)
    q, k, v = problem(rng, 2, 2, 1, 1, 16)
    args = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=[4, 16], block_k=BLOCK_K)
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, words", [
    (dict(cache_seqlens=[4, 17]), ValueError, "cache_seqlens[1] + N_new"),
    (dict(cache_seqlens=[-1, 3]), ValueError, "cache_seqlens must be >= 0"),
    (dict(cache_seqlens=[1.0, 2.0]), TypeError, "cache_seqlens must be an integer array"),
    (dict(cache_seqlens=[1, 2, 3]), ValueError, "cache_seqlens must have shape (2,)"),
    (dict(block_table=np.array([[5, 0], [1, 0]])), ValueError, "block_table[0, 0] = 5 is not a page"),
    (dict(num_splits=2, split_size=16), ValueError, "num_splits or split_size"),
    (dict(split_size=12), ValueError, "split_size must be a positive multiple of block_k"),
    (dict(num_splits=0), ValueError, "num_splits must be an int in 1..128"),
    (dict(split_size=8, cache_seqlens=[4, 16]), None, None),
    (dict(engine="mma"), ValueError, "engine='mma' decodes float16 or bfloat16 inputs"),
    (dict(engine="mma-tf32"), ValueError, "no decode kernel"),
    (dict(engine="fast"), ValueError, "engine must be one of"),
    (dict(q=np.zeros((2, 3, 1, D), np.float32), k_cache=np.zeros((2, 2, 16, D), np.float32),
          v_cache=np.zeros((2, 2, 16, D), np.float32)), ValueError, "must divide q's heads"),
    (dict(q=np.zeros((2, 2, 1, D), np.float64)), TypeError, "q must have dtype"),
    (dict(k=np.zeros((2, 1, 1, D), np.float32)), ValueError, "give both k and v"),
])
def test_bad_arguments_are_refused_by_name(change, error, words):
    args = bad(**change)
    if error is None:  # the control: the same call with valid arguments runs
        assert fa_numba.attention_with_kvcache(**args).shape == (2, 2, 1, D)
        return
    with pytest.raises(error) as caught:
        fa_numba.attention_with_kvcache(**args)
    assert words in str(caught.value)


def test_page_tables_that_would_read_outside_the_cache_are_refused():
    rng = np.random.default_rng(11)
    q, _, _ = problem(rng, 2, 2, 1, 1, 16)
    pages = rng.standard_normal((4, 1, 8, D)).astype(np.float32)
    table = np.array([[0, 1], [2, 3]], np.int32)
    ok = fa_numba.attention_with_kvcache(q, pages, pages, [16, 9], block_table=table, block_k=BLOCK_K)
    assert ok.shape == q.shape
    for wrong, words in ((np.array([[0, 1], [2, 4]]), "block_table[1, 1] = 4"),
                         (np.array([[0, -1], [2, 3]]), "block_table[0, 1] = -1"),
                         (np.array([[0], [2]]), "over the cache's capacity of 8 keys")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            fa_numba.attention_with_kvcache(q, pages, pages, [16, 9], block_table=wrong, block_k=BLOCK_K)
    # an unused entry is not read, so it is not checked: request 1 has 5 keys in page 2
    assert fa_numba.attention_with_kvcache(q, pages, pages, [16, 5], block_table=np.array([[0, 1], [2, 99]]),
                                           block_k=BLOCK_K).shape == q.shape
    with pytest.raises(ValueError, match="page_size .8. must be a multiple of block_k = 16"):
        fa_numba.attention_with_kvcache(q, pages, pages, [16, 9], block_table=table, block_k=16)


def strided_on_device(x):
    """x on the device as a view that is not C-contiguous: every other feature of a twice as wide array."""
    from numba import cuda

    wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    wide[..., ::2] = x
    view = cuda.to_device(wide)[..., ::2]
    assert not view.is_c_contiguous()
    return view


@pytest.mark.parametrize("case, words", [
    ("control", None),
    ("k_cache strided on the device", "k_cache must be C-contiguous on the device"),
    ("v_cache strided on the device", "v_cache must be C-contiguous on the device"),
    ("q strided on the device", "q must be C-contiguous on the device"),
    ("v_cache read-only", "v_cache must be writable"),
    ("the split grid over CUDA's limit", "batch * heads_kv = 2 is more blocks than CUDA's grid y allows (1)"),
])
def test_a_refused_call_leaves_the_caches_untouched(case, words, monkeypatch):
    """Every check comes before the new keys are written: a refusal leaves both caches bit for bit as they were
    (k_cache is appended first, so each case here would otherwise find the caches written)."""
    from numba import cuda

    from fa_numba.kernels import common

    rng = np.random.default_rng(17)
    q, k, v = problem(rng, 2, 2, 1, 1, 16)
    new_k, new_v = (rng.standard_normal((2, 1, 1, D)).astype(np.float32) for _ in range(2))
    device = case == "control" or case.endswith("on the device")
    if device:
        place = {name: strided_on_device(x) if case.startswith(name + " ") else cuda.to_device(x)
                 for name, x in dict(q=q, k_cache=k, v_cache=v).items()}
        new_k, new_v = cuda.to_device(new_k), cuda.to_device(new_v)
    else:
        place = dict(q=q, k_cache=k, v_cache=v)
        if case == "v_cache read-only":
            v.setflags(write=False)
        else:  # grid y = batch * heads_kv = 2 over a limit of 1; the append's grid (2, 1) is within it
            monkeypatch.setattr(common, "GRID_LIMITS", (2**31 - 1, 1, 65535))

    def contents():
        return [(x.copy_to_host() if device else x).tobytes() for x in (place["k_cache"], place["v_cache"])]

    before = contents()
    call = dict(place, cache_seqlens=[4, 9], k=new_k, v=new_v, split_size=16, block_k=BLOCK_K)
    if words is None:  # the same call with nothing wrong writes both caches, so an unchanged cache means something
        fa_numba.attention_with_kvcache(**call)
        after = [np.frombuffer(b, np.float32).reshape(k.shape) for b in contents()]
        assert np.array_equal(after[0][[0, 1], 0, [4, 9]], new_k.copy_to_host()[:, 0, 0])
        assert np.array_equal(after[1][[0, 1], 0, [4, 9]], new_v.copy_to_host()[:, 0, 0])
        return
    with pytest.raises(ValueError) as caught:
        fa_numba.attention_with_kvcache(**call)
    assert words in str(caught.value)
    assert contents() == before


@pytest.mark.parametrize("lengths", ["list", "numpy", "torch"])
def test_an_empty_batch_gives_empty_results(lengths):
    """B = 0 is an empty problem: O (0, H, N_q, d_v) and LSE (0, H, N_q), float32 as every decode result, in q's
    library, with no launch; an empty list of lengths is read as the B = 0 integers it stands for."""
    q, k, v = (np.zeros(shape, np.float32) for shape in ((0, 2, 3, D), (0, 1, 16, D), (0, 1, 16, 4)))
    new = dict(k=np.zeros((0, 1, 1, D), np.float32), v=np.zeros((0, 1, 1, 4), np.float32))
    if lengths == "list":
        seqlens = []
    elif lengths == "numpy":
        seqlens = np.zeros(0, np.int32)
    else:
        torch = pytest.importorskip("torch", reason="the torch extra is not installed")
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
        new = {name: torch.from_numpy(x) for name, x in new.items()}
        seqlens = torch.zeros(0, dtype=torch.int32)
    for extra in ({}, new):
        out, lse = fa_numba.attention_with_kvcache(q, k, v, seqlens, block_k=BLOCK_K, return_lse=True, **extra)
        assert tuple(out.shape) == (0, 2, 3, 4) and tuple(lse.shape) == (0, 2, 3)
        assert type(out) is type(q) and type(lse) is type(q)
        assert str(out.dtype).endswith("float32") and str(lse.dtype).endswith("float32")
        assert fa_numba.attention_with_kvcache(q, k, v, seqlens, block_k=BLOCK_K, **extra).shape == out.shape
    with pytest.raises(TypeError, match="cache_seqlens must be an integer array"):  # a float array says float
        fa_numba.attention_with_kvcache(q, k, v, np.zeros(0), block_k=BLOCK_K)


@pytest.mark.lemma("L11")
@pytest.mark.slow  # ~1.3 s an example; test_cli's compare --decode compares a count with the model by default
@settings(max_examples=6)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=2), n_q=st.integers(1, 3),
       tiles=st.integers(1, 3), causal=st.booleans())
def test_counted_traffic_equals_the_model(lengths, n_q, tiles, causal):
    rng = np.random.default_rng(12)
    batch, heads, heads_kv = len(lengths), 4, 2
    rows = n_q * heads // heads_kv
    q = rng.standard_normal((batch, heads_kv, rows, D)).astype(np.float32)
    k = rng.standard_normal((batch, heads_kv, 40, D)).astype(np.float32)
    splits = max(1, -(-max(-(-n // BLOCK_K) for n in lengths) // tiles))
    lohi = split_kv.row_intervals(np.array(lengths), n_q, heads // heads_kv, causal)
    layout = kernels.decode_layout(rows, D, BLOCK_K)
    out, lse, ledger = run_counted_decode(q, k, k, lengths, np.arange(batch)[:, None], lohi, 0.3, layout=layout,
                                          tiles_per_split=tiles, splits=splits)
    assert not np.isnan(out).any()
    assert ledger == iomodel.traffic_decode(lengths, n_q, D, layout.block_q, BLOCK_K, tiles, splits, causal,
                                            heads, heads_kv)


def test_the_model_reads_each_key_once_per_kv_head_when_the_rows_fit_one_tile():
    """B = 1, H = 32, H_kv = 8, N_q = 1: 4 packed rows per K/V head, so K and V are read once, whatever the split."""
    for splits, tiles in ((1, 64), (8, 8)):
        ledger = iomodel.traffic_decode([2048], 1, 128, 4, 32, tiles, splits, True, 32, 8)
        assert ledger.reads["K"] == ledger.reads["V"] == 8 * 2048 * 128
        assert ledger.writes["O_split"] == 8 * splits * 4 * 128 and ledger.reads["O_split"] == 8 * splits * 4 * 128


@pytest.mark.lemma("L11")
def test_the_combine_kernel_merges_like_its_numpy_twin():
    """Partials with empty splits (-inf, 0), a dead row, a NaN split: the kernel against split_kv.combine, the
    NumPy fold of online_softmax.merge (float64 here), within a few float32 roundings."""
    from numba import cuda

    rng = np.random.default_rng(13)
    splits, rows = 4, 3
    lse_s = rng.normal(2.0, 3.0, (splits, rows)).astype(np.float32)
    o_s = rng.standard_normal((splits, rows, D)).astype(np.float32)
    lse_s[1, 0] = -np.inf  # an empty split inside a row
    o_s[1, 0] = 0.0
    lse_s[:, 1] = -np.inf  # a row no split sees a key of
    o_s[:, 1] = 0.0
    o_s[2, 2, 3] = np.nan  # a NaN in one feature reaches that feature only
    alive = np.array([True, False, True])
    lohi = np.array([[[0, 1], [0, 0], [0, 1]]], np.int32)
    dev = [cuda.to_device(x) for x in (np.ascontiguousarray(np.moveaxis(o_s, 0, 0)[None]),
                                       np.ascontiguousarray(lse_s[None]))]
    out = cuda.device_array((1, 1, rows, D), np.float32)
    lse = cuda.device_array((1, 1, rows), np.float32)
    kernels.make_combine(kernels.combine_threads(D))[(rows,), (kernels.combine_threads(D),)](
        dev[0], dev[1], out, lse, cuda.to_device(lohi))
    got_out, got_lse = out.copy_to_host()[0, 0], lse.copy_to_host()[0, 0]
    want_out, want_lse = split_kv.combine(lse_s.astype(np.float64), o_s.astype(np.float64), alive)
    assert np.isnan(got_out[2, 3]) and np.isnan(want_out[2, 3])
    assert np.array_equal(got_out[1], np.zeros(D)) and got_lse[1] == -np.inf == want_lse[1]
    finite = np.isfinite(want_out)
    np.testing.assert_allclose(got_out[finite], want_out[finite], rtol=0, atol=2e-6)
    np.testing.assert_allclose(got_lse[[0, 2]], want_lse[[0, 2]], rtol=1e-6)


@pytest.mark.lemma("L11")
@settings(max_examples=30)
@given(n_k=st.integers(1, 30), keys=st.integers(1, 12), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_split_states_merge_to_the_unsplit_result_in_exact_arithmetic(n_k, keys, causal, seed):
    """L11.1 in float64: the per-split (LSE_s, O_s) of the reference, folded by split_kv.combine (empty splits
    included), give the unsplit reference to float64 rounding."""
    rng = np.random.default_rng(seed)
    n_q = 3
    q, k, v = (rng.standard_normal((n, 4)) for n in (n_q, n_k, n_k))
    visible = reference.visible_mask(n_q, n_k, causal)
    whole_out, whole_lse = reference.attention(q, k, v, causal=causal)
    lse_parts, o_parts, lse_errs, out_errs = [], [], [], []
    for lo in range(0, n_k, keys):
        sub = visible[:, lo:lo + keys]
        dense = reference.dense(q, k[lo:lo + keys], v[lo:lo + keys], mask=fa_numba.masks.from_dense(sub)
                                if sub.any() else None)
        o_s, lse_s = dense.result() if sub.any() else (np.zeros((n_q, 4)), np.full(n_q, -np.inf))
        o_parts.append(np.where(sub.any(axis=1)[:, None], o_s, 0.0))
        lse_parts.append(np.where(sub.any(axis=1), lse_s, -np.inf))
        # each split a dense float64 evaluation of its keys: within its derived bound (tests/bounds.py)
        errs = (attention_bound(q[None, None], k[None, None, lo:lo + keys], v[None, None, lo:lo + keys], causal=False,
                                counts=dense_counts(sub.shape[1]), mask=fa_numba.masks.from_dense(sub))
                if sub.any() else (np.zeros((1, 1, n_q, 4)), np.zeros((1, 1, n_q))))
        out_errs.append(errs[0][0, 0])
        lse_errs.append(errs[1][0, 0])
    out, lse = split_kv.combine(np.stack(lse_parts), np.stack(o_parts), visible.any(axis=1))
    # The combine's fold (merge_bound: its own rounding and the splits' errors carried through) against the
    # dense evaluation of all the keys (attention_bound), both against the exact values.
    merged_out, merged_lse = merge_bound(np.stack(lse_parts), np.stack(o_parts), np.stack(lse_errs), np.stack(out_errs))
    whole_err = attention_bound(q[None, None], k[None, None], v[None, None], causal=causal, counts=dense_counts(n_k))
    assert_within(out, whole_out, merged_out + whole_err[0][0, 0], name="out")
    assert_within(lse, whole_lse, merged_lse + whole_err[1][0, 0], name="lse")


def test_empty_splits_are_the_identity_of_the_twin_exactly():
    rng = np.random.default_rng(14)
    lse_s, o_s = rng.standard_normal((1, 2)), rng.standard_normal((1, 2, 3))
    padded_lse = np.concatenate([np.full((2, 2), -np.inf), lse_s, np.full((1, 2), -np.inf)])
    padded_o = np.concatenate([np.zeros((2, 2, 3)), o_s, np.zeros((1, 2, 3))])
    alive = np.ones(2, bool)
    one = split_kv.combine(lse_s, o_s, alive)
    assert all(np.array_equal(a, b) for a, b in zip(one, split_kv.combine(padded_lse, padded_o, alive)))
    assert np.array_equal(one[0], o_s[0]) and np.array_equal(one[1], lse_s[0])  # merge(identity, a) = a


def test_the_heuristic_follows_the_wave_rule():
    """The fewest splits within EFFICIENCY_SLACK of the best wave efficiency, among the counts that change the
    tiles per split (counted here from the definition, not by the function)."""
    sms, tiles = 132, 4096
    assert split_kv.heuristic_splits(132, tiles, sms, 128) == 1  # the grid fills the GPU: no split
    eligible = [c for c in range(1, 129) if c == 1 or -(-tiles // c) != -(-tiles // (c - 1))]
    assert len(eligible) < 128  # some counts give the same split size as one fewer
    for blocks in (1, 8, 32, 64):
        s = split_kv.heuristic_splits(blocks, tiles, sms, 128)
        assert s in eligible
        best = max(split_kv.wave_efficiency(blocks * c, sms) for c in eligible)
        assert split_kv.wave_efficiency(blocks * s, sms) >= split_kv.EFFICIENCY_SLACK * best
        assert all(split_kv.wave_efficiency(blocks * c, sms) < split_kv.EFFICIENCY_SLACK * best
                   for c in eligible if c < s)
    assert split_kv.heuristic_splits(8, 3, sms, 128) <= 3  # never more splits than key tiles
    # by hand: 1024 tiles, 8 blocks; the best eligible count is 49 (392 blocks: 2.97 waves, 0.990); 14 splits
    # (112 blocks, 0.848) is the first within 0.85 x 0.990 = 0.841
    assert split_kv.heuristic_splits(8, 1024, sms, 128) == 14


def test_online_softmax_merge_with_a_split_state_is_its_finalized_pair():
    """A split's (LSE_s, 1, O_s) is the same state as its (m_s, l_s, acc_s) up to the common factor e^m: both
    finalise to (O_s, LSE_s), which is why the combine may take the kernel's normalised outputs."""
    rng = np.random.default_rng(15)
    scores, values = rng.standard_normal((2, 5)), rng.standard_normal((5, 3))
    state = online_softmax.from_block(scores, values)
    o_s, lse_s = online_softmax.finalize(state)
    again = online_softmax.finalize(online_softmax.State(lse_s, np.ones(2), o_s))
    # Exact: finalize computes acc / l = O_s / 1 = O_s and m + log l = LSE_s + log 1 = LSE_s + 0 = LSE_s.
    np.testing.assert_array_equal(again[0], o_s)
    np.testing.assert_array_equal(again[1], lse_s)


@pytest.mark.lemma("L11")
def test_the_combine_term_is_needed_and_enough():
    """L6 part 8 in isolation: exact float64 split states combined with every weight off by E (part 8's factor)
    stay within the combine's out term; off by 10 E, with signs that push one entry one way, they do not."""
    rng = np.random.default_rng(16)
    q, k, v = rng.standard_normal((2, 4)), rng.standard_normal((40, 4)), rng.standard_normal((40, 4))
    whole_out, whole_lse = reference.attention(q, k, v)
    parts = [reference.attention(q, k[lo:lo + 8], v[lo:lo + 8]) for lo in range(0, 40, 8)]
    o_s = np.stack([p[0] for p in parts])
    lse_s = np.stack([p[1] for p in parts])
    share = np.exp(lse_s - whole_lse)
    out_term, _, factor = split_kv.combine_terms(lse_s, share, np.abs(o_s), np.abs(whole_out))
    sign = np.sign(o_s[:, 0, 0] - whole_out[0, 0])  # every split pushes entry (0, 0) the same way

    def combined(eta):
        w = share * (1 + eta[:, None] * factor[None, :])
        return np.einsum("sr,srx->rx", w, o_s) / w.sum(axis=0)[:, None]

    assert np.all(np.abs(combined(sign) - whole_out) <= out_term)
    assert np.abs(combined(10 * sign) - whole_out)[0, 0] > out_term[0, 0]


@pytest.mark.parametrize("engine, dtype, p_dtype", [("simt", np.float32, None), ("mma", np.float16, "float16")])
def test_a_sliding_window_decodes_over_the_cache_within_the_rule(engine, dtype, p_dtype):
    """mask=sliding_window(left, 0) over each request's positions (query i at n_b - N_q + i), both split kernels,
    three splits: within split_kv.check's rule with the window; a request shorter than the window sees all."""
    from fa_numba import masks

    rng = np.random.default_rng(21)
    q, k, v = problem(rng, 2, 4, 2, 2, 48, d=16, dtype=dtype)
    lengths = [40, 5]
    window = masks.sliding_window(12, 0)
    out, lse = fa_numba.attention_with_kvcache(q, k, v, lengths, mask=window, split_size=16, block_k=16,
                                               engine=engine, return_lse=True)
    for b, n in enumerate(lengths):
        split_kv.check(out[b], lse[b], q[b], keys_of(k, b, n), keys_of(v, b, n), causal=True, scale=0.25,
                       block_k=16, splits=split_kv.Splits(3, 1, 16), mask=window, p_dtype=p_dtype)


def test_a_mask_fixed_to_one_size_is_refused_for_decoding():
    from fa_numba import masks

    rng = np.random.default_rng(22)
    q, k, v = problem(rng, 1, 2, 2, 1, 16)
    with pytest.raises(ValueError, match="mask must be one whose rows each see one interval"):
        fa_numba.attention_with_kvcache(q, k, v, [8], mask=masks.documents([4, 4]), block_k=8)
