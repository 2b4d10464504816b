"""`fa_numba.attention`: validate, pick tiles, launch a kernel, return.

Results come back in the caller's array library (see fa_numba.arrays): NumPy in, NumPy out; PyTorch in,
PyTorch out (a CPU tensor for CPU tensors, a CUDA tensor on the same device for CUDA tensors, launched on
torch's current stream); CuPy in, CuPy out (on CuPy's current stream); Numba device arrays in, Numba
device arrays out. Device inputs are read where they are, with no host copy.
Everything is checked before any launch; errors name the argument.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fa_numba import arrays, backend, shapes
from fa_numba.kernels import VARIANTS, default_tiles
from fa_numba.kernels.common import BF16_BITS, INPUT_DTYPES, MAX_HEAD_DIM


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
    dividing H (GQA/MQA). float32, float16 or bfloat16 (torch tensors, ml_dtypes NumPy arrays), all the same
    dtype; arithmetic and outputs are float32.
    causal is bottom-right aligned (query i sees key j iff j <= i + N_k - N_q); a query that sees no key
    gets O = 0 and LSE = -inf. scale defaults to 1/sqrt(d). block_q / block_k default by head dim
    (`kernels.default_tiles`). Returns O, or (O, LSE) with return_lse=True, in q's layout and q's array
    library: NumPy for NumPy (or other host array-likes), a torch tensor on q's device for a torch tensor
    (CPU or CUDA; read through .detach(), so without autograd history), a CuPy array for CuPy, a Numba
    device array for a Numba device array or another `__cuda_array_interface__` object. A CUDA tensor or
    CuPy call is launched on that library's current stream, so work queued before and after it on that
    stream stays ordered.

    >>> import numpy as np, fa_numba
    >>> q = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    >>> out = fa_numba.attention(q, q, q, causal=True, block_q=8, block_k=8)
    >>> out.shape, out.dtype
    ((2, 8, 16), dtype('float32'))
    """
    call = arrays.adopt({"q": q, "k": k, "v": v}, allowed=INPUT_DTYPES, bfloat16=True)
    q, k, v = call.arrays
    prob = shapes.problem(q, k, v, allowed=BF16_BITS if call.bfloat16 else INPUT_DTYPES,
                          names=arrays.accepted(INPUT_DTYPES, bfloat16=True))
    causal = shapes.check_causal(causal)
    scale = shapes.resolve_scale(scale, prob.d)
    if order not in VARIANTS:
        raise ValueError(f"order must be one of {tuple(VARIANTS)}, got {order!r}")
    if prob.d > MAX_HEAD_DIM:
        raise ValueError(f"q must have head dim d <= {MAX_HEAD_DIM}, got {prob.d}")
    default_q, default_k = default_tiles(prob.d)
    block_q = default_q if block_q is None else shapes.check_block("block_q", block_q)
    block_k = default_k if block_k is None else shapes.check_block("block_k", block_k)
    VARIANTS[order].config(block_q, block_k, prob.d, causal)  # threads, shared memory: before any allocation

    backend.warn_if_slow_in_simulator(prob.batch * prob.heads * prob.n_q * prob.n_k * prob.d)
    layout = tuple(q.shape[:-1])  # the caller's (B, H, N_q), (H, N_q) or (N_q,)
    with backend.explain_driver_errors(), call.context():
        dq, dk, dv = (_prepare(name, x, call.on_device) for name, x in (("q", q), ("k", k), ("v", v)))
        out = call.empty((prob.batch, prob.heads, prob.n_q, prob.d))
        lse = call.empty((prob.batch, prob.heads, prob.n_q))
        VARIANTS[order].make(block_q, block_k, prob.d, causal)(dq, dk, dv, out, lse, scale, stream=call.stream)
        out, lse = call.output(out, layout + (prob.d,)), call.output(lse, layout)
    return (out, lse) if return_lse else out
