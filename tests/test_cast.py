"""kernels.cast: a float32 device result as float16, or as the uint16 bits of bfloat16, for Numba device arrays
(`attention(..., out_dtype=...)` on them). Checked against NumPy's own float16 conversion and ml_dtypes'
bfloat16, on values that exercise the rounding: ties to even, subnormals, overflow, infinities, NaN."""

import numpy as np
import pytest
from numba import cuda

import fa_numba
from fa_numba.kernels.cast import cast_device

ml_dtypes = pytest.importorskip("ml_dtypes")  # a test dependency: bfloat16 on the host, the independent reading


def _hard_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    edges = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 1e-40, 2.0**-126,
                      1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.4e38, np.inf, -np.inf],
                     np.float32)
    nans = np.array([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF], np.uint32).view(np.float32)
    scaled = (rng.standard_normal(300) * 10.0 ** rng.integers(-8, 8, 300)).astype(np.float32)
    return np.concatenate([edges, nans, scaled])


def test_float16_is_numpys_round_to_nearest_even():
    x = _hard_values().reshape(1, -1)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf and NaN are the values under test
        want = x.astype(np.float16)
    got = cast_device(cuda.to_device(x), "float16").copy_to_host()
    assert got.dtype == np.float16 and got.shape == x.shape
    assert np.array_equal(got.view(np.uint16)[~np.isnan(want)], want.view(np.uint16)[~np.isnan(want)])
    assert np.array_equal(np.isnan(got), np.isnan(want))


def test_bfloat16_bits_are_ml_dtypes_round_to_nearest_even():
    x = _hard_values()
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16)
    got = cast_device(cuda.to_device(x), "bfloat16").copy_to_host()
    assert got.dtype == np.uint16
    finite = ~np.isnan(x)
    assert np.array_equal(got[finite], want.view(np.uint16)[finite])
    assert np.all((got[~finite] & 0x7FFF) == 0x7FC0)  # a NaN stays a (quiet) NaN, never an infinity


def test_attention_on_numba_device_arrays_honours_out_dtype():
    q = np.random.default_rng(1).standard_normal((1, 2, 8, 4)).astype(np.float16)
    dq = cuda.to_device(q)
    wide = fa_numba.attention(dq, dq, dq, block_q=8, block_k=8).copy_to_host()
    half = fa_numba.attention(dq, dq, dq, block_q=8, block_k=8, out_dtype="float16").copy_to_host()
    assert half.dtype == np.float16 and np.array_equal(half, wide.astype(np.float16))
    bits = fa_numba.attention(dq, dq, dq, block_q=8, block_k=8, out_dtype="bfloat16").copy_to_host()
    assert bits.dtype == np.uint16 and np.array_equal(bits, wide.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="result must be a float32 device array"):
        cast_device(cuda.to_device(np.zeros(3, np.float64)), "float16")
    with pytest.raises(ValueError, match="name must be 'float16' or 'bfloat16'"):
        cast_device(cuda.to_device(np.zeros(3, np.float32)), "float64")
