"""Bad input: a ValueError or TypeError whose message names the argument, before any work."""

import numpy as np
import pytest

from fa_numba import iomodel, reference, tiled, tiling


def _qkv(q_shape=(2, 4, 5, 8), kv_shape=(2, 2, 7, 8), dtype=np.float32):
    return np.zeros(q_shape, dtype), np.zeros(kv_shape, dtype), np.zeros(kv_shape, dtype)


def _entry_points():
    """Every public function that takes (q, k, v)."""
    return [
        reference.attention,
        reference.attention_naive_f32,
        lambda q, k, v, **kw: tiled.attention(q, k, v, order="v2", block_q=4, block_k=4, **kw),
    ]


BAD_INPUTS = [
    (dict(q_shape=(2, 4, 5, 6)), ValueError, r"k must have head dim d = 6"),
    (dict(q_shape=(3, 4, 5, 8)), ValueError, r"k and v must have batch 3"),
    (dict(q_shape=(2, 3, 5, 8)), ValueError, r"k and v heads \(2\) must divide q heads \(3\)"),
    (dict(q_shape=(2, 4, 0, 8)), ValueError, r"q must have sequence length N >= 1"),
    (dict(kv_shape=(2, 2, 0, 8)), ValueError, r"k must have sequence length N >= 1"),
    (dict(q_shape=(5, 8), kv_shape=(2, 7, 8)), ValueError, r"q, k, v must have the same number of dimensions"),
    (dict(q_shape=(8,), kv_shape=(8,)), ValueError, r"q must have shape \(N, d\)"),
    (dict(dtype=np.int32), TypeError, r"q must have dtype in"),
    (dict(dtype=np.complex64), TypeError, r"q must have dtype in"),
    (dict(dtype=bool), TypeError, r"q must have dtype in"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_INPUTS)
@pytest.mark.parametrize("fn", _entry_points(), ids=["reference", "naive_f32", "tiled"])
def test_bad_shapes_and_dtypes_are_named(fn, kwargs, error, message):
    with pytest.raises(error, match=message):
        fn(*_qkv(**kwargs))


def test_v_must_match_k():
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=r"v must have the shape of k .* but for its last axis"):
        reference.attention(q, k, np.zeros((2, 2, 6, 8), np.float32))


def test_mixed_dtypes_are_refused():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype"):
        reference.attention(q.astype(np.float64), k, v)


def test_non_array_is_refused():
    _, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q must be an array"):
        reference.attention([[1.0]], k, v)


@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), (float("inf"), ValueError), ("1", TypeError), (True, TypeError)])
def test_bad_scale(scale, error):
    with pytest.raises(error, match=r"scale must be"):
        reference.attention(*_qkv(), scale=scale)


def test_causal_must_be_bool():
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        reference.attention(*_qkv(), causal="yes")


@pytest.mark.parametrize("name, value, error", [("block_q", 0, ValueError), ("block_k", -3, ValueError),
                                                ("block_q", 2.0, TypeError), ("block_k", None, TypeError)])
def test_non_positive_tile_sizes(name, value, error):
    sizes = dict(block_q=4, block_k=4)
    sizes[name] = value
    with pytest.raises(error, match=name):
        tiled.attention(*_qkv(), order="v2", **sizes)
    with pytest.raises(error, match=name):
        iomodel.traffic("v2", 5, 7, 8, causal=False, **sizes)
    with pytest.raises(error, match=name):
        tiling.classify(5, 7, causal=True, **sizes)


def test_unknown_order_and_compute_dtype():
    with pytest.raises(ValueError, match=r"order must be one of \('v1', 'v2'\), got 'v3'"):
        tiled.attention(*_qkv(), order="v3", block_q=4, block_k=4)
    with pytest.raises(TypeError, match=r"dtype must be float32 or float64"):
        tiled.attention(*_qkv(), order="v1", block_q=4, block_k=4, dtype=np.float16)
    with pytest.raises(ValueError, match=r"heads_kv \(3\) must divide heads \(4\)"):
        iomodel.traffic("v1", 5, 5, 8, 4, 4, False, heads=4, heads_kv=3)
