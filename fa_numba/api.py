"""`fa_numba.attention`: validate, pick tiles, launch a kernel, return.

Host NumPy arrays in, NumPy out (copied to and from the device). CUDA device arrays, or any object with
`__cuda_array_interface__` (CuPy, PyTorch CUDA tensors), in: Numba device arrays out, no host copy.
Everything is checked before any launch; errors name the argument.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fa_numba import backend, shapes, tiling
from fa_numba.kernels import VARIANTS, default_tiles
from fa_numba.kernels.common import INPUT_DTYPES, MAX_HEAD_DIM, Config


def _is_device(x) -> bool:
    if isinstance(x, np.ndarray):
        return False
    if hasattr(x, "__cuda_array_interface__"):
        return True
    return backend.name() == "simulator" and isinstance(x, cuda.devicearray.FakeCUDAArray)


def _as_array(x, on_device: bool):
    """A Numba device array (a view, no copy) for a device input, a NumPy array for a host input, so that
    shapes and dtypes read the same way for NumPy, Numba, CuPy and PyTorch inputs."""
    if on_device:
        return cuda.as_cuda_array(x) if hasattr(x, "__cuda_array_interface__") else x
    return x if isinstance(x, np.ndarray) or not hasattr(x, "__array__") else np.asarray(x)


def _prepare(name: str, x, on_device: bool):
    """A C-contiguous (B, H, N, d) array on the device."""
    if on_device:
        if not x.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous on the device (make it .contiguous() first)")
        return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    return cuda.to_device(np.ascontiguousarray(shapes.as_4d(x)))


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, order: str = "v2",
              block_q: int | None = None, block_k: int | None = None, return_lse: bool = False):
    """Exact attention softmax(scale Q K^T) V with the v1 or v2 FlashAttention kernel.

    q: (N_q, d), (H, N_q, d) or (B, H, N_q, d); k, v: same number of axes with N_k keys and H_kv heads
    dividing H (GQA/MQA). float32 or float16, all the same dtype; arithmetic and outputs are float32.
    causal is bottom-right aligned (query i sees key j iff j <= i + N_k - N_q); a query that sees no key
    gets O = 0 and LSE = -inf. scale defaults to 1/sqrt(d). block_q / block_k default by head dim
    (`kernels.default_tiles`). Returns O, or (O, LSE) with return_lse=True, in q's layout.

    >>> import numpy as np, fa_numba
    >>> q = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    >>> out = fa_numba.attention(q, q, q, causal=True, block_q=8, block_k=8)
    >>> out.shape, out.dtype
    ((2, 8, 16), dtype('float32'))
    """
    on_device = _is_device(q)
    if on_device != _is_device(k) or on_device != _is_device(v):
        raise TypeError("q, k, v must be all host arrays or all device arrays")
    q, k, v = (_as_array(x, on_device) for x in (q, k, v))
    prob = shapes.problem(q, k, v, allowed=INPUT_DTYPES)
    causal = shapes.check_causal(causal)
    scale = shapes.resolve_scale(scale, prob.d)
    tiling.check_order(order)
    if prob.d > MAX_HEAD_DIM:
        raise ValueError(f"q must have head dim d <= {MAX_HEAD_DIM}, got {prob.d}")
    default_q, default_k = default_tiles(prob.d)
    block_q = default_q if block_q is None else shapes.check_block("block_q", block_q)
    block_k = default_k if block_k is None else shapes.check_block("block_k", block_k)
    Config(order, block_q, block_k, prob.d, causal).check()  # shared-memory budget, before any allocation

    backend.warn_if_slow_in_simulator(prob.batch * prob.heads * prob.n_q * prob.n_k * prob.d)
    ndim = len(q.shape)
    with backend.explain_driver_errors():  # numba.cuda imported first without a driver: say what to do
        dq, dk, dv = (_prepare(name, x, on_device) for name, x in (("q", q), ("k", k), ("v", v)))
        out = cuda.device_array((prob.batch, prob.heads, prob.n_q, prob.d), dtype=np.float32)
        lse = cuda.device_array((prob.batch, prob.heads, prob.n_q), dtype=np.float32)
        VARIANTS[order].make(block_q, block_k, prob.d, causal)(dq, dk, dv, out, lse, scale)

        if on_device:
            out = out.reshape(out.shape[4 - ndim:])
            lse = lse.reshape(lse.shape[4 - ndim:])
        else:
            out = shapes.drop_lead(out.copy_to_host(), ndim)
            lse = shapes.drop_lead(lse.copy_to_host(), ndim)
    return (out, lse) if return_lse else out
