"""Two-float max and min in a kernel are the device's fmax / fmin (a NaN operand dropped), in the simulator as on a
GPU (fa_numba.simulator_builtins; numba-cuda lowers them to libdevice's __nv_fmaxf / __nv_fminf). The expected
values are numpy's np.fmax / np.fmin, documented apart from both: "if one of the elements being compared is a NaN,
then the non-nan element is returned"."""

import numpy as np
from numba import cuda

import fa_numba  # noqa: F401 - the backend (and its simulator patches) before the kernels below

NAN = np.float32(np.nan)


@cuda.jit
def _minmax(a, b, hi, lo, ints):
    i = cuda.grid(1)
    if i < a.size:
        hi[i] = max(a[i], b[i])
        lo[i] = min(a[i], b[i])
        ints[i] = max(i, 3) - min(i, 3)  # integers: Python's meaning, unchanged


def test_two_float_max_and_min_drop_a_nan_in_either_place():
    a = np.array([1.0, NAN, 2.0, NAN, -np.inf, 0.5, np.inf, NAN], np.float32)
    b = np.array([NAN, 1.0, NAN, NAN, NAN, -0.5, 1.0, -np.inf], np.float32)
    hi, lo = np.zeros_like(a), np.zeros_like(a)
    ints = np.zeros(a.size, np.int64)
    _minmax[1, 32](a, b, hi, lo, ints)
    np.testing.assert_array_equal(hi, np.fmax(a, b))  # NaN only where both are NaN
    np.testing.assert_array_equal(lo, np.fmin(a, b))
    np.testing.assert_array_equal(ints, np.abs(np.arange(a.size) - 3))


def test_host_code_keeps_pythons_max_after_a_kernel():
    _minmax[1, 32](*(np.zeros(4, np.float32) for _ in range(4)), np.zeros(4, np.int64))
    assert "max" not in globals() and "min" not in globals()
    assert np.isnan(max(NAN, 1.0))  # Python's own: the first argument unless the second is larger
