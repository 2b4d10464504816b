"""Contracts of the input conventions (fa_numba.shapes) a caller relies on: every empty axis is refused by
name, a non-array is a TypeError before anything reads it, a dtype error lists what is accepted, and the
validated sizes are an immutable value."""

import dataclasses

import numpy as np
import pytest

from fa_numba import reference, shapes, tiled

# (q shape, k/v shape, the message): one empty axis at a time, the others valid (B=2, H=4, H_kv=2, N=5/7, d=8).
EMPTY_AXES = [
    ((0, 4, 5, 8), (0, 2, 7, 8), r"q must have batch >= 1 \(axis 0\), got 0"),
    ((2, 0, 5, 8), (2, 2, 7, 8), r"q and k must have heads >= 1, got q 0, k 2"),
    ((2, 4, 5, 8), (2, 0, 7, 8), r"q and k must have heads >= 1, got q 4, k 0"),
    ((2, 4, 0, 8), (2, 2, 7, 8), r"q must have sequence length N >= 1 \(axis -2\), got 0"),
    ((2, 4, 5, 8), (2, 2, 0, 8), r"k must have sequence length N >= 1 \(axis -2\), got 0"),
    ((2, 4, 5, 0), (2, 2, 7, 0), r"q must have head dim d >= 1 \(axis -1\), got 0"),
]


@pytest.mark.parametrize("q_shape, kv_shape, message", EMPTY_AXES,
                         ids=["batch", "q heads", "kv heads", "N_q", "N_k", "d"])
@pytest.mark.parametrize("entry", ["reference", "tiled"])
def test_every_empty_axis_is_refused_by_name(q_shape, kv_shape, message, entry):
    """An empty tensor is a caller's mistake, never an empty result: each axis is named in a ValueError."""
    q, k, v = np.ones(q_shape), np.ones(kv_shape), np.ones(kv_shape)
    with pytest.raises(ValueError, match=message):
        if entry == "reference":
            reference.attention(q, k, v)
        else:
            tiled.attention(q, k, v, order="v2", block_q=2, block_k=2)


class _ShapeOnly:
    shape = (4, 2)


class _DtypeOnly:
    dtype = np.dtype(np.float32)


@pytest.mark.parametrize("thing", [_ShapeOnly(), _DtypeOnly(), [[1.0, 2.0]], 3.0], ids=["shape only", "dtype only",
                                                                                        "list", "float"])
def test_a_non_array_is_a_type_error_naming_the_argument(thing):
    """Anything without both .shape and .dtype is refused as a TypeError naming the argument (not an
    AttributeError from deeper inside)."""
    v = np.ones((4, 2))
    with pytest.raises(TypeError, match=r"^k must be an array with .shape and .dtype, got "):
        reference.attention(np.ones((4, 2)), thing, v)


def test_a_dtype_error_lists_the_accepted_dtypes():
    q = np.ones((3, 2), dtype=np.int32)
    with pytest.raises(TypeError, match=r"^q must have dtype in \(float16, float32, float64\), got int32$"):
        reference.attention(q, q, q)
    # A caller may name the accepted dtypes in its own words.
    with pytest.raises(TypeError, match=r"^q must have dtype in \(float32 or float16\), got int32$"):
        shapes.problem(q, q, q, names="float32 or float16")


def test_the_validated_sizes_are_an_immutable_value():
    """Problem compares and hashes by its sizes (a cache key) and cannot be changed after validation."""
    q, k = np.ones((2, 6, 5, 3)), np.ones((2, 3, 7, 3))
    prob = shapes.problem(q, k, k)
    assert prob == shapes.problem(q.copy(), k.copy(), k.copy())
    assert hash(prob) == hash(shapes.Problem(2, 6, 3, 5, 7, 3)) and prob.group == 2
    assert {prob: "cached"}[shapes.Problem(2, 6, 3, 5, 7, 3)] == "cached"
    with pytest.raises(dataclasses.FrozenInstanceError):
        prob.n_q = 6
