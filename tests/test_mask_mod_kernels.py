"""Masks that differ by batch and head in the kernels (issue 27's mask_mod, issue 24's per-slice masks;
fa_numba/slice_masks.py, fa_numba/kernels/mask_mod.py): one launch whose blocks read their own slice's tile
lists, and a mask_mod compiled into the PARTIAL tiles.

- mask_mod == from_function == from_dense, bit for bit, in every forward order and backward variant, for a
  mask the same on every slice (the kernels' "function" form against their "dense" form);
- a mask_mod that differs by batch and by query head (also between the query heads of one K/V head, which
  the K/V-outer backward visits in turn) against the float64 reference with the derived rules, and equal to
  the 4-D from_dense of its own answers;
- fn is never called out of bounds (a captured array of exactly (B, H, N_q, N_k) entries, ragged tiles: the
  simulator raises on an index past its end), and its tile lists follow the captured arrays' content;
- clear errors where a mask_mod is not taken, or cannot be compiled.

Default tier: one order or variant per property; the slow tier runs every one.
"""

import numpy as np
import pytest

import fa_numba
from fa_numba import masks, mods, reference, slice_masks, tiling, tolerance, tolerance_backward
from fa_numba.kernels import SIMT_VARIANTS

B, H, H_KV, N_Q, N_K, D = 2, 4, 2, 21, 27, 8
TILE = 8
BACKWARD_VARIANTS = (("kv", False), ("kv", True), ("q", False))


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N_Q, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, H_KV, N_K, D)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal((B, H, N_Q, D)).astype(np.float32)
    return q, k, v, dout


def _band(b, h, i, j):
    return abs(i + 6 - j) <= 4 or j == 0


def _band_dense(i, j):
    return (np.abs(i + 6 - j) <= 4) | (j == 0)


def _documents(b, h, i, j, ids):
    """Documents per batch entry (ids[b, position]); query heads 0 and 2 causal within the document, heads 1
    and 3 bidirectional: the two query heads of each K/V head differ."""
    return ids[b, i] == ids[b, j] and (h % 2 == 1 or j <= i + N_K - N_Q)


def _document_ids():
    ids = np.zeros((B, max(N_Q, N_K) + N_K), np.int32)
    ids[0, :] = np.arange(ids.shape[1]) // 7
    ids[1, :] = np.arange(ids.shape[1]) // 12
    ids[1, 3] = 99  # a key no query of its batch entry shares a document with, at some positions
    return ids


def _run(mask, order, q, k, v, score_mod=None):
    return fa_numba.attention(q, k, v, mask=mask, order=order, return_lse=True, block_q=TILE, block_k=TILE,
                              score_mod=score_mod)


def _orders(default):
    return [pytest.param(o, marks=() if o == default else pytest.mark.slow) for o in SIMT_VARIANTS]


def _variants(default):
    return [pytest.param(*x, marks=() if x == default else pytest.mark.slow, id=f"{x[0]}-{'det' if x[1] else 'at'}")
            for x in BACKWARD_VARIANTS]


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("order", _orders("v2-rowwise"))
def test_mask_mod_equals_from_function_and_from_dense_bitwise(order):
    q, k, v, _ = _inputs(1)
    dense = _band_dense(np.arange(N_Q)[:, None], np.arange(N_K)[None, :])
    results = [_run(m, order, q, k, v) for m in (masks.mask_mod(_band), masks.from_function(_band_dense),
                                                  masks.from_dense(dense))]
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])
    tolerance.check_attention(*results[0], q, k, v, mask=masks.from_dense(dense), order=order[:2],
                              block_q=TILE, block_k=TILE)


@pytest.mark.slow  # the default tier's per-slice backward test compares kv-det with the 4-D dense mask bitwise
@pytest.mark.parametrize("order,deterministic", _variants(None))
def test_mask_mod_backward_equals_from_dense_bitwise(order, deterministic):
    q, k, v, dout = _inputs(2)
    dense = _band_dense(np.arange(N_Q)[:, None], np.arange(N_K)[None, :])
    out, lse = _run(masks.from_dense(dense), "v2", q, k, v)
    grads = [fa_numba.attention_backward(q, k, v, out, lse, dout, mask=m, order=order, deterministic=deterministic,
                                         block_q=TILE) for m in (masks.mask_mod(_band), masks.from_dense(dense))]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("order", _orders("v1"))
def test_mask_mod_per_slice_within_the_rule_and_equal_to_its_4d_dense(order):
    q, k, v, _ = _inputs(3)
    mm = masks.mask_mod(_documents, _document_ids())
    answers = mm.dense_slices(B, H, N_Q, N_K)
    assert not np.array_equal(answers[0], answers[1]) and not np.array_equal(answers[:, 0], answers[:, 1])
    out, lse = _run(mm, order, q, k, v)
    tolerance.check_attention(out, lse, q, k, v, mask=mm, order=order[:2], block_q=TILE, block_k=TILE)
    out4, lse4 = _run(masks.from_dense(answers), order, q, k, v)
    np.testing.assert_array_equal(out, out4)
    np.testing.assert_array_equal(lse, lse4)


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("order,deterministic", _variants(("kv", True)))
def test_mask_mod_per_slice_backward_within_the_rule(order, deterministic):
    """GQA: the K/V-outer kernels walk the query heads of a K/V head in turn, each with its own tile list."""
    q, k, v, dout = _inputs(4)
    mm = masks.mask_mod(_documents, _document_ids())
    out, lse = _run(mm, "v2", q, k, v)
    dq, dk, dv = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=mm, order=order,
                                             deterministic=deterministic, block_q=TILE)
    tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, mask=mm)
    grads4 = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=masks.from_dense(mm.dense_slices(B, H, N_Q, N_K)),
                                         order=order, deterministic=deterministic, block_q=TILE)
    for a, b in zip((dq, dk, dv), grads4):
        np.testing.assert_array_equal(a, b)


def test_a_mask_per_batch_or_head_broadcasts_its_axes_of_length_one():
    """(1, H) and (B, 1) masks: the kernels read slice min(b, B_m - 1), min(h, H_m - 1)."""
    q, k, v, _ = _inputs(5)
    rng = np.random.default_rng(5)
    for shape in ((1, H), (B, 1)):
        array = rng.random(shape + (N_Q, N_K)) < 0.5
        array[..., 4, :] = False  # a dead row in every slice
        out, lse = _run(masks.from_dense(array), "v2", q, k, v)
        tolerance.check_attention(out, lse, q, k, v, mask=masks.from_dense(array))
        assert np.all(out[:, :, 4] == 0) and np.all(lse[:, :, 4] == -np.inf)


def _table_pair(b, h, i, j, table):
    return table[b, h, i, j] != 0


@pytest.mark.lemma("L8")
def test_fn_is_never_called_past_the_problem():
    """A mask_mod indexing a captured (B, H, N_q, N_k) table: ragged tiles (21 x 27 over 8 x 8) would read
    past its end if fn were called at a pair outside the problem (the simulator raises IndexError)."""
    q, k, v, dout = _inputs(6)
    table = (np.random.default_rng(6).random((B, H, N_Q, N_K)) < 0.7).astype(np.uint8)
    mm = masks.mask_mod(_table_pair, table)
    out, lse = _run(mm, "v2", q, k, v)
    out4, lse4 = _run(masks.from_dense(table.astype(bool)), "v2", q, k, v)
    np.testing.assert_array_equal(out, out4)
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=mm, block_q=TILE)
    tolerance_backward.check_attention_backward(*grads, q, k, v, dout, mask=masks.from_dense(table.astype(bool)))


def test_tile_lists_follow_the_captured_arrays_content():
    """Document ids changed in place: the next call sees the new documents (the scan keys by content), and
    a mask over equal arrays built anew shares the scan."""
    q, k, v, _ = _inputs(7)
    ids = _document_ids()
    mm = masks.mask_mod(_documents, ids)
    before, _ = _run(mm, "v2", q, k, v)
    _, lohi_before = mm.scan(B, H, N_Q, N_K, TILE, TILE)
    ids[0, :] = np.arange(ids.shape[1]) // 3  # new documents, same array object
    after, lse = _run(mm, "v2", q, k, v)
    assert not np.array_equal(before, after)
    tolerance.check_attention(after, lse, q, k, v, mask=masks.from_dense(mm.dense_slices(B, H, N_Q, N_K)))
    fresh = masks.mask_mod(_documents, ids.copy())
    assert fresh.scan(B, H, N_Q, N_K, TILE, TILE)[0] is mm.scan(B, H, N_Q, N_K, TILE, TILE)[0]  # one cache entry
    assert not np.array_equal(lohi_before, fresh.scan(B, H, N_Q, N_K, TILE, TILE)[1])  # rows' key ranges moved


def test_mask_mod_with_a_score_mod_and_captured_gradients():
    """Both user functions in one kernel (the captured tuple holds the mod's arrays, then the mask's)."""
    q, k, v, dout = _inputs(8)
    mm = masks.mask_mod(_documents, _document_ids())
    mod = mods.relative_bias(np.random.default_rng(8).standard_normal((H, N_Q + N_K - 1)), n_k=N_K)
    out, lse = _run(mm, "v2", q, k, v, score_mod=mod)
    tolerance.check_attention(out, lse, q, k, v, mask=mm, score_mod=mod)
    dq, dk, dv, dcaptured = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=mm, block_q=TILE,
                                                        score_mod=mod, captured_grads=True)
    tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, mask=mm, score_mod=mod)
    errors = tolerance_backward.check_captured_gradients(dcaptured, q, k, v, dout, score_mod=mod, mask=mm)
    assert errors[0] is not None  # the table takes a gradient, and it was checked


def test_where_a_mask_mod_is_not_taken_the_error_says_so():
    q, k, v, _ = _inputs(9)
    mm = masks.mask_mod(_band)
    with pytest.raises(ValueError, match="differs by batch and head"):
        tiling.block_mask(N_Q, N_K, TILE, TILE, mm)
    with pytest.raises(ValueError, match="its batch axis has length 3"):
        _run(masks.from_dense(np.ones((3, 1, N_Q, N_K), bool)), "v2", q, k, v)


def _plain_python(i):
    return i > 1


def _calls_python(b, h, i, j):
    return _plain_python(i)  # a plain Python function: Numba cannot call it from compiled code


DOCS = np.zeros(4, np.int32)


def _reads_a_global(b, h, i, j):
    return DOCS[0] == 0


def test_a_mask_mod_numba_cannot_compile_is_a_clear_error():
    q, k, v, _ = _inputs(10)
    with pytest.raises(slice_masks.MaskModError, match=r"mask_mod _calls_python: Numba cannot compile it"):
        _run(masks.mask_mod(_calls_python), "v2", q, k, v)
    with pytest.raises(slice_masks.MaskModError, match="reads the global array.*DOCS.*captured array"):
        masks.mask_mod(_reads_a_global)
    with pytest.raises(ValueError, match="at most 4 captured arrays"):
        masks.mask_mod(_band, *[np.zeros(1)] * 5)
    with pytest.raises(TypeError, match="fn must be a callable"):
        masks.mask_mod(3)


def test_reference_takes_a_mask_mod_on_every_slice():
    """The reference's answers are the mask_mod's on every pair of every slice (its dense_slices)."""
    q, k, v, _ = _inputs(11)
    mm = masks.mask_mod(_documents, _document_ids())
    out, lse = reference.attention(q, k, v, mask=mm)
    out4, lse4 = reference.attention(q, k, v, mask=masks.from_dense(mm.dense_slices(B, H, N_Q, N_K)))
    np.testing.assert_array_equal(out, out4)
    np.testing.assert_array_equal(lse, lse4)
    ids = _document_ids()
    i, j = np.meshgrid(np.arange(N_Q), np.arange(N_K), indexing="ij")
    want = (ids[1][i] == ids[1][j]) & (j <= i + N_K - N_Q)
    np.testing.assert_array_equal(mm.dense_slices(B, H, N_Q, N_K)[1, 2], want)


def test_the_reference_with_a_mask_mod_matches_flex_attention_in_float64():
    """FlexAttention's own mask_mod path (create_block_mask on every (b, h), flex_attention run eagerly on CPU
    in float64) against the reference with the same predicate as a mask_mod, within their float64 bounds
    (test_mods._bounds; a mod that is exactly the identity, temperature 1, carries the bounds' mod terms)."""
    torch = pytest.importorskip("torch", reason="the comparison with FlexAttention needs torch (the torch extra)")
    import warnings

    from test_mods import _assert_within, _bounds

    try:
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    except ImportError as exc:
        pytest.skip(f"torch {torch.__version__} has no flex_attention with AuxRequest: {exc}")
    q, k, v, dout = (x.astype(np.float64) for x in _inputs(12))
    ids = _document_ids()
    ids_t = torch.from_numpy(ids)

    def twin(b, h, i, j):  # the mask_mod on tensors, as FlexAttention calls it
        return (ids_t[b, i] == ids_t[b, j]) & ((h % 2 == 1) | (j <= i + N_K - N_Q))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": eager on purpose
        try:
            block_mask = create_block_mask(twin, B, H, N_Q, N_K, device="cpu")
            out_t, aux = flex_attention(*(torch.from_numpy(x) for x in (q, k, v)), block_mask=block_mask,
                                        enable_gqa=True, return_aux=AuxRequest(lse=True))
        except (NotImplementedError, RuntimeError) as exc:
            pytest.skip(f"flex_attention does not run eagerly on CPU in float64 in torch {torch.__version__}: {exc}")
    mm = masks.mask_mod(_documents, ids)
    out, lse = reference.attention(q, k, v, mask=mm)
    bounds = _bounds(q, k, v, np.zeros_like(q), mask=mm, scale=None, mod=mods.temperature(1.0))
    _assert_within("out", out, out_t.numpy(), bounds.out)
    _assert_within("lse", lse, aux.lse.numpy(), bounds.lse)
    # the comparison has power against a mask that ignores b or h
    one_slice = masks.from_dense(np.broadcast_to(mm.dense_slices(B, H, N_Q, N_K)[:1, :1], (1, 1, N_Q, N_K)).copy())
    assert np.abs(reference.attention(q, k, v, mask=one_slice)[0] - out).max() > 1e-3
