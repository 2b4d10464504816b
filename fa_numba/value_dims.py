"""A value head dim of its own (d_v != d, MLA's d = 192 with d_v = 128) on kernels built for one head dim.

The 16-bit tensor-core forwards take d_v natively (kernels/mma: V_j staged and O accumulated at d_v), and so do
the tile engine's CUDA-core forwards (kernels/engine_v1.py, engine_v2.py: `Layout.value_dim`, tiles staged
max(d, d_v) wide with each operand zero past its own width, V read and O written d_v wide), the CUDA-core
backward (kernels/backward.py: `BackwardConfig.value_dim`, the same staging), the 16-bit tensor-core backward
(kernels/mma/backward.py: `MmaBackwardConfig.value_dim`, V_j and dO_i staged d_v wide) and both decoding
kernels. Every other kernel (the rowwise forwards, float32 on tensor cores, the captured gradients' pair
kernels) takes Q, K, V and O with one head dim: a call with d_v != d runs it at w = max(d, d_v): the
narrower operands get zero columns appended (Q and K when d < d_v; V, and in the backward O and dO, when
d_v < d), and the results are cut back (O to d_v; dQ, dK to d; dV to d_v). This is exact: the values a kernel
with two head dims would compute from the same sums, whatever the inputs hold (a zero may change sign):

- a score sum_x q_x k_x gains terms 0 * 0 = +0, and s + 0 = s exactly (but for a sum of -0, which becomes
  +0; the kernels' sums start from +0 and cannot be -0 anyway); so S, P, LSE and every sum over keys are
  unchanged;
- an appended column of V gives an appended column of O (sum_j p_j 0 = 0, or NaN where a P row is NaN), which
  is cut; the columns that stay never read it (each O column is its own sum);
- in the backward dP_ij = sum_x dO_ix V_jx and D_i = sum_x dO_ix O_ix gain 0 * 0 terms only (both operands
  are padded), so dS is unchanged; the appended columns of dQ = scale dS K and dK = scale dS^T Q are sums of
  dS * 0 and are cut, as those of dV = P^T dO.

The cost is not the native one: the padded operands are copied once (a read and a write of each, on the
device for device inputs, by NumPy for host ones) and the kernels move and multiply w columns where a native
kernel would move d or d_v (`iomodel.traffic(..., d_v=...)` counts the native traffic; the padded call moves
that of head dim w plus the copies). The scale's default stays 1/sqrt(d), q's head dim, as torch SDPA's.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fa_numba import arrays, shapes
from fa_numba.kernels.cast import resized_copy


def widened(call, name: str, x, width: int):
    """x (one of the call's arrays: host NumPy, or a Numba device array, any strides with a unit last one)
    with zero columns appended up to `width` on its last axis, in the same place and leading shape; x itself
    when it already has that width."""
    if tuple(x.shape)[-1] == width:
        return x
    if not call.on_device:
        return np.pad(np.asarray(x), [(0, 0)] * (len(x.shape) - 1) + [(0, width - tuple(x.shape)[-1])])
    src = arrays.device_view_4d(name, x)
    out = cuda.device_array(tuple(x.shape)[:-1] + (width,), dtype=x.dtype, stream=call.stream)
    resized_copy(src, out.reshape(shapes.batch_shape(out.shape)), stream=call.stream)
    return out


def result(call, array, shape):
    """call.output(array, shape) with array's last axis (the kernels' head dim) cut to shape's first: a
    result in the caller's library and layout."""
    width = tuple(shape)[-1]
    if tuple(array.shape)[-1] == width:
        return call.output(array, shape)
    if not call.on_device:
        host = array.copy_to_host(stream=call.stream)[..., :width]
        return call.output_host(np.ascontiguousarray(host).reshape(tuple(shape)))
    narrow = call.empty(tuple(array.shape)[:-1] + (width,), dtype=array.dtype)
    resized_copy(array, narrow, stream=call.stream)
    return call.output(narrow, shape)
