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
from fa_numba.kernels.common import BF16_BITS, INPUT_DTYPES, MAX_HEAD_DIM, kernel_mask


def _prepare(name: str, x, on_device: bool):
    """A C-contiguous (B, H, N, d) array on the device."""
    if on_device:
        if not x.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous on the device (make it .contiguous() first)")
        return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    return cuda.to_device(np.ascontiguousarray(shapes.as_4d(x)))


def _resolve_mask(causal, mask, prob):
    """(causal, mask, kernel form): causal=True or a mask whose kernel form is causal run the closed forms;
    any other mask runs the block-mask path (its "intervals" or "dense" form)."""
    causal, mask = shapes.check_mask(causal, mask)
    if mask is None:
        return causal, None, "causal" if causal else "none"
    mask.check(prob.n_q, prob.n_k)
    if mask.kernel_form() == "causal":
        return True, None, "causal"
    return False, mask, mask.kernel_form()


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, order: str = "v2",
              block_q: int | None = None, block_k: int | None = None, return_lse: bool = False, mask=None):
    """Exact attention softmax(scale Q K^T) V with the v1 or v2 FlashAttention kernel.

    q: (N_q, d), (H, N_q, d) or (B, H, N_q, d); k, v: same number of axes with N_k keys and H_kv heads
    dividing H (GQA/MQA). float32, float16 or bfloat16 (torch tensors, ml_dtypes NumPy arrays), all the same
    dtype; arithmetic and outputs are float32.
    causal is bottom-right aligned (query i sees key j iff j <= i + N_k - N_q); mask is any fa_numba.masks
    mask (sliding_window, documents, prefix_lm, from_function, from_dense; causal=True is the short form of
    mask=masks.causal(), and passing both is an error), whose SKIP tiles are never touched. A query that sees
    no key gets O = 0 and LSE = -inf. scale defaults to 1/sqrt(d). block_q / block_k default by head dim
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
    causal, mask, form = _resolve_mask(causal, mask, prob)
    scale = shapes.resolve_scale(scale, prob.d)
    if order not in VARIANTS:
        raise ValueError(f"order must be one of {tuple(VARIANTS)}, got {order!r}")
    if prob.d > MAX_HEAD_DIM:
        raise ValueError(f"q must have head dim d <= {MAX_HEAD_DIM}, got {prob.d}")
    default_q, default_k = default_tiles(prob.d)
    block_q = default_q if block_q is None else shapes.check_block("block_q", block_q)
    block_k = default_k if block_k is None else shapes.check_block("block_k", block_k)
    VARIANTS[order].config(block_q, block_k, prob.d, causal, form)  # threads, shared memory: before any allocation

    backend.warn_if_slow_in_simulator(prob.batch * prob.heads * prob.n_q * prob.n_k * prob.d)
    layout = tuple(q.shape[:-1])  # the caller's (B, H, N_q), (H, N_q) or (N_q,)
    with backend.explain_driver_errors(), call.context():
        dq, dk, dv = (_prepare(name, x, call.on_device) for name, x in (("q", q), ("k", k), ("v", v)))
        out = call.empty((prob.batch, prob.heads, prob.n_q, prob.d))
        lse = call.empty((prob.batch, prob.heads, prob.n_q))
        blocks = kernel_mask(mask, prob.n_q, prob.n_k, block_q, block_k) if mask is not None else None
        VARIANTS[order].make(block_q, block_k, prob.d, causal, form)(dq, dk, dv, out, lse, scale, stream=call.stream,
                                                                     mask=blocks)
        out, lse = call.output(out, layout + (prob.d,)), call.output(lse, layout)
    return (out, lse) if return_lse else out


BACKWARD_ORDERS = ("kv", "q")


def _prepare_stats(name: str, x, on_device: bool, ndim: int):
    """A C-contiguous (B, H, N) float32 array on the device, from the caller's LSE layout."""
    if on_device:
        if not x.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous on the device (make it .contiguous() first)")
        return x.reshape((1,) * (3 - x.ndim) + tuple(x.shape))
    x = np.ascontiguousarray(x, dtype=np.float32)
    return cuda.to_device(x.reshape((1,) * (3 - x.ndim) + x.shape))


def attention_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale: float | None = None,
                       order: str = "kv", deterministic: bool = False, block_q: int | None = None,
                       block_k: int | None = None, mask=None):
    """Gradients (dq, dk, dv) of sum(dout * attention(q, k, v)), recomputing P from the forward's LSE.

    q, k, v as for `attention`; out and lse are that forward's outputs (out like q, float32 or q's dtype;
    lse float32, q's layout without its last axis), dout like q (q's dtype or float32). Returns (dq, dk, dv) in float32 in the
    inputs' layout and array library: dq like q, dk and dv like k (H_kv heads: the sums over each group's
    query heads). order "kv" (K/V outer, FlashAttention-2's backward: dK, dV on chip, dQ added into HBM with
    atomic adds, or with deterministic=True computed by a second, Q-outer pass without atomics, bitwise
    repeatable) or "q" (Q outer: dQ on chip, dK and dV added into HBM). block_q = block_k (square tiles)
    default by head dim (kernels.backward.DEFAULTS). HBM traffic: iomodel.traffic_backward; the kernels:
    fa_numba/kernels/backward.py. mask as for `attention` (the forward's). Finite inputs (a row that sees no
    key gets zero gradient).

    >>> import numpy as np, fa_numba
    >>> q = np.random.default_rng(0).standard_normal((2, 8, 4)).astype(np.float32)
    >>> out, lse = fa_numba.attention(q, q, q, causal=True, return_lse=True)
    >>> dq, dk, dv = fa_numba.attention_backward(q, q, q, out, lse, np.ones_like(q), causal=True)
    >>> dq.shape, dk.dtype
    ((2, 8, 4), dtype('float32'))
    """
    from fa_numba.kernels import backward

    call = arrays.adopt({"q": q, "k": k, "v": v}, allowed=INPUT_DTYPES, bfloat16=True)
    saved = arrays.adopt({"out": out, "lse": lse, "dout": dout}, allowed=INPUT_DTYPES, bfloat16=call.bfloat16)
    if (saved.kind, saved.on_device) != (call.kind, call.on_device):
        raise TypeError(f"out, lse and dout must be arrays of the same kind as q, k, v ({call.kind}, "
                        f"{'device' if call.on_device else 'host'}), got {saved.kind}, "
                        f"{'device' if saved.on_device else 'host'}")
    q, k, v = call.arrays
    out, lse, dout = saved.arrays
    accepted = arrays.accepted(INPUT_DTYPES, bfloat16=True)
    prob = shapes.problem(q, k, v, allowed=BF16_BITS if call.bfloat16 else INPUT_DTYPES, names=accepted)
    for name, x, shape in (("dout", dout, q.shape), ("out", out, q.shape), ("lse", lse, q.shape[:-1])):
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)} (from q), got {tuple(x.shape)}")
    if np.dtype(dout.dtype) not in (np.dtype(q.dtype), np.dtype(np.float32)):
        raise TypeError(f"dout must have q's dtype {q.dtype} or float32 (the forward's output), got {dout.dtype}")
    if np.dtype(lse.dtype) != np.dtype(np.float32):
        raise TypeError(f"lse must have dtype float32 (the forward's), got {lse.dtype}")
    causal, mask, form = _resolve_mask(causal, mask, prob)
    scale = shapes.resolve_scale(scale, prob.d)
    if order not in BACKWARD_ORDERS:
        raise ValueError(f"order must be one of {BACKWARD_ORDERS}, got {order!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if deterministic and order != "kv":
        raise ValueError("deterministic=True is the K/V-outer order's mode (a Q-outer pass for dQ): use order='kv'")
    if prob.d > MAX_HEAD_DIM:
        raise ValueError(f"q must have head dim d <= {MAX_HEAD_DIM}, got {prob.d}")
    block = backward.default_backward_tiles(prob.d)[0]
    block_q = block if block_q is None else shapes.check_block("block_q", block_q)
    block_k = block_q if block_k is None else shapes.check_block("block_k", block_k)
    if block_q != block_k:
        raise ValueError(f"block_q and block_k must be equal for the backward kernels (square tiles), got "
                         f"{block_q} and {block_k}")
    for kind in ("kv", "q"):  # threads and shared memory, before any allocation
        backward.BackwardConfig(kind, block_q, prob.d, causal, mask_form=form).check()

    backend.warn_if_slow_in_simulator(3 * prob.batch * prob.heads * prob.n_q * prob.n_k * prob.d)
    with backend.explain_driver_errors(), call.context():
        dq_, dk_, dv_, do_ = (_prepare(name, x, call.on_device)
                              for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout)))
        o_ = _prepare("out", out, call.on_device)
        lse_ = _prepare_stats("lse", lse, call.on_device, len(q.shape))
        grad_q = call.empty((prob.batch, prob.heads, prob.n_q, prob.d))
        grad_k = call.empty((prob.batch, prob.heads_kv, prob.n_k, prob.d))
        grad_v = call.empty((prob.batch, prob.heads_kv, prob.n_k, prob.d))
        dvec = cuda.device_array((prob.batch, prob.heads, prob.n_q), dtype=np.float32, stream=call.stream)
        blocks = kernel_mask(mask, prob.n_q, prob.n_k, block_q, block_q) if mask is not None else None
        backward.run(dq_, dk_, dv_, o_, lse_, do_, grad_q, grad_k, grad_v, dvec, scale, causal=causal, order=order,
                     deterministic=bool(deterministic), block=block_q, stream=call.stream, mask=blocks)
        return (call.output(grad_q, tuple(q.shape)), call.output(grad_k, tuple(k.shape)),
                call.output(grad_v, tuple(v.shape)))
