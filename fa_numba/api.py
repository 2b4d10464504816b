"""`fa_numba.attention`: validate, pick tiles, launch a kernel, return.

Results come back in the caller's array library (see fa_numba.arrays): NumPy in, NumPy out; PyTorch in,
PyTorch out (a CPU tensor for CPU tensors, a CUDA tensor on the same device for CUDA tensors, launched on
torch's current stream); CuPy in, CuPy out (on CuPy's current stream); Numba device arrays in, Numba
device arrays out. Device inputs are read where they are, with no host copy.
Everything is checked before any launch; errors name the argument.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import cuda

from fa_numba import arrays, backend, engines, masks, mods, packed, shapes, value_dims
from fa_numba import sinks as sink_arrays
from fa_numba.kernels import SIMT_VARIANTS, VARIANTS, default_tiles
from fa_numba.kernels import score_mod as kernel_mods
from fa_numba.kernels import sinks as kernel_sinks
from fa_numba.kernels.block_lists import kernel_mask
from fa_numba.kernels.cast import contiguous_copy
from fa_numba.kernels.common import BF16_BITS, INPUT_DTYPES, MAX_HEAD_DIM, check_sequence


def _prepare(name: str, x, on_device: bool, strided: bool = True, stream=0):
    """A (B, H, N, d) array on the device. A device array is read where it is when it is C-contiguous, or when
    `strided` (the kernel reads strides: `reads_strided`) and it is a 4-D view with a unit last stride (the
    (B, N, H, d) layout's transpose(1, 2), as flash-attn takes it; each CUDA-core kernel is compiled a second
    time for strided arrays). Any other 4-D device view is copied to a C-contiguous array on the device
    (kernels.cast.contiguous_copy); a host array is copied to the device."""
    if on_device:
        view = arrays.device_view_4d(name, x)
        if x.is_c_contiguous() or (strided and x.strides[-1] == x.dtype.itemsize):
            return view
        return contiguous_copy(view, stream=stream)
    return cuda.to_device(np.ascontiguousarray(shapes.as_4d(x)))


def reads_strided(kernel) -> bool:
    """Whether a compiled kernel takes strided inputs as they are (`_prepare`): every CUDA-core kernel but the
    tile engine's v1 above d = 64, whose strided compilation spills to local memory (255 registers at d = 128;
    `python -m fa_numba profile --strided`, 2026-12-02). The tensor-core kernels read views too: their cp.async
    copies find rows by the strides (kernels/mma/staging.py, stage_async; a view whose rows are not 16-byte
    aligned takes the kernel's synchronous loads instead), and none spills when compiled for them."""
    config = kernel.config
    return not (getattr(config, "order", None) == "v1" and getattr(config, "engine", False) and config.head_dim > 64)


def _resolve_mask(causal, mask, prob):
    """(causal, mask, kernel form): causal=True or a mask whose kernel form is causal run the closed forms;
    any other mask runs the block-mask path (its "intervals" or "dense" form; a mask that differs by batch
    and head, fa_numba.slice_masks, its "dense" or, for a mask_mod, "function" form)."""
    causal, mask = shapes.check_mask(causal, mask)
    if mask is None:
        return causal, None, "causal" if causal else "none"
    if getattr(mask, "sliced", False):
        mask.check_slices(prob.batch, prob.heads, prob.n_q, prob.n_k)
        return False, mask, mask.kernel_form()
    mask.check(prob.n_q, prob.n_k)
    if mask.kernel_form() == "causal":
        return True, None, "causal"
    mask = masks.fixed(mask, prob.n_q, prob.n_k)  # a predicate is evaluated now, at this call (masks.fixed)
    return False, mask, mask.kernel_form()


def _check_value_range(v, n_k: int, bfloat16: bool, on_device: bool) -> None:
    """The kernels accumulate acc = sum_j p_j v_j before dividing by l (p_j <= 1, so |acc| <= N_k max|v|):
    it is finite, and so is O, when N_k max|v| <= FLOAT32_MAX. Host inputs beyond that range are refused
    (the exact answer may be finite, like 3e38 for V = 3e38 everywhere, but acc is not); non-finite entries
    are not range errors (they propagate by the NaN rules). Device inputs are not scanned: that would cost a
    reduction and a host synchronisation per call; the same range holds for them, and beyond it O may be inf.
    Attention is linear in V, so scaling V down and O up is exact in real arithmetic."""
    if on_device:
        return
    values = np.asarray(v)
    if bfloat16:  # the bits: bfloat16 is the high half of a float32
        values = (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    magnitude = np.abs(values, dtype=np.float32)
    largest = float(magnitude[np.isfinite(magnitude)].max(initial=0.0))
    if largest * n_k > shapes.FLOAT32_MAX:
        raise ValueError(f"v must satisfy N_k * max|v| <= {shapes.FLOAT32_MAX:.8g} (the float32 accumulator "
                         f"sum_j p_j v_j reaches it before the division by l), got N_k = {n_k} and max|v| = "
                         f"{largest:.8g}: scale v down by {n_k * largest / shapes.FLOAT32_MAX:.3g} or more and "
                         f"the output up (attention is linear in v)")


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, order: str = "v2",
              block_q: int | None = None, block_k: int | None = None, return_lse: bool = False, mask=None,
              engine: str = "auto", out_dtype=None, score_mod=None, sinks=None, cu_seqlens_q=None,
              cu_seqlens_k=None):
    """Exact attention softmax(scale Q K^T) V by a FlashAttention kernel, checked against float64 by its tests.

    Args:
        q: queries, (N_q, d), (H, N_q, d), (B, H, N_q, d) or (B1, ..., Bm, H, N_q, d); float32, float16 or
            bfloat16 (NumPy, ml_dtypes, torch on the CPU or a GPU, CuPy, Numba device arrays), the dtype of k, v.
        k, v: keys and values, q's axes with N_k rows and H_kv heads dividing H (GQA / MQA); v's last axis d_v
            may differ from d (O then has d_v; `fa_numba.value_dims`).
        causal: bottom-right causal (query i sees key j iff j <= i + N_k - N_q); the short form of
            mask=masks.causal() (both at once is an error).
        scale: the score scale, finite in float32; default 1 / sqrt(d).
        order: "v2" (FlashAttention-2, Q outer) or "v1" (Algorithm 1, K/V outer); the rowwise orders
            "v1-rowwise", "v2-rowwise" run on the CUDA cores.
        block_q, block_k: the tile sizes; default by head dim, engine and order (`kernels.default_tiles`,
            `engines.mma_tiles`).
        return_lse: also return LSE, the log-sum-exp of each row's visible scores.
        mask: any `fa_numba.masks` mask (sliding_window, documents, prefix_lm, from_function, from_dense,
            mask_mod, per batch and head); its SKIP tiles are never touched; a from_function mask is evaluated
            at this call.
        engine: "auto" (the tensor cores for float16 and bfloat16 where they take the call, else the CUDA
            cores), "simt", "mma" (tensor cores; float32 by 3xTF32) or "mma-tf32" (one TF32 product: not
            float32-exact); `fa_numba.engines` says what each takes.
        out_dtype: O's dtype, float32 (None), float16 or bfloat16.
        score_mod: a `fa_numba.mods.ScoreMod` (alibi, softcap, relative_bias, temperature, or your own):
            softmax(mod(S)) V, applied after the scale at the visible pairs only.
        sinks: learnable sinks, (H,) one logit per query head (float32; on q's device for device inputs): a
            column every row of the head sees that has no value, LSE_i = log(exp(s_h) + sum_j exp(S_ij)) and O
            scaled by exp(LSE without the sink - LSE); a row that sees no key gets O = 0 and LSE = s_h; -inf is
            no sink (proofs/L14: merged once into every row after the kernel, exact in any order).
        cu_seqlens_q, cu_seqlens_k: a packed batch: (B + 1,) int offsets of B sequences along N (flash-attn's
            cu_seqlens; q (H, total_q, d), k and v (H_kv, total_k, d)); each row sees only its own sequence's
            keys, causal bottom-right inside it: the short form of mask=packed.varlen(cu_seqlens_q,
            cu_seqlens_k, causal=causal), which also takes a window.

    Returns:
        O, or (O, LSE) with return_lse=True, in q's layout and array library (a torch tensor on q's device, read
        through .detach(); CuPy for CuPy; NumPy for host arrays; a Numba device array otherwise); float32 but for
        out_dtype. A query that sees no key gets O = 0 and LSE = -inf; N_q = 0 or B = 0 give empty results,
        N_k = 0 gives O = 0 and LSE = -inf, without a launch. A CUDA tensor's or CuPy's call runs on that
        library's current stream.

    Raises:
        ValueError: an argument the kernels do not take, named with what was expected (shapes, dtypes, tiles,
            head dims, an order or engine, a mask that does not fit, host values whose sum could overflow float32,
            N_k max|v| > 3.4e38).
        TypeError: inputs of different dtypes, or of a dtype other than float32, float16, bfloat16.

    The guide (docs/api.md) has the details: the tolerance rule each engine meets, the simulator, threads.

    >>> import numpy as np, fa_numba
    >>> q = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    >>> out = fa_numba.attention(q, q, q, causal=True, block_q=8, block_k=8)
    >>> out.shape, out.dtype
    ((2, 8, 16), dtype('float32'))
    """
    out_dtype = arrays.dtype_name("out_dtype", out_dtype)
    causal, mask = _packed_mask(causal, mask, cu_seqlens_q, cu_seqlens_k)
    call, out, lse = _forward(q, k, v, causal, scale, order, block_q, block_k, mask, engine, score_mod, sinks)
    out = arrays.cast(call, out, out_dtype)
    return (out, lse) if return_lse else out


def _packed_mask(causal, mask, cu_seqlens_q, cu_seqlens_k):
    """(causal, mask) with a packed batch's offsets turned into its mask (`fa_numba.packed`)."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return causal, mask
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("give both cu_seqlens_q and cu_seqlens_k (a packed batch's offsets), or neither")
    if mask is not None:
        raise ValueError("pass cu_seqlens_q and cu_seqlens_k, or mask=..., not both (a window inside packed "
                         "sequences: mask=fa_numba.packed.varlen(cu_seqlens_q, cu_seqlens_k, window=(left, right)))")
    return False, packed.varlen(cu_seqlens_q, cu_seqlens_k, causal=causal)


def _check_mod(score_mod, prob, *, backward: bool = False, mask=None):
    """The ScoreMod (None: none) checked against the problem's sizes and compiled for the CPU before any
    launch (kernels.score_mod.check_compiles), with the KernelMod of it and of the mask, if that is a
    mask_mod (compiled into the kernels with it; its check came with `_resolve_mask`)."""
    score_mod = mods.check_score_mod(score_mod)
    mask_fn = mask if kernel_mods.has_mask_fn(mask) else None
    if score_mod is None:
        return None, kernel_mods.KernelMod.of(None, mask_fn)
    if backward and score_mod.grad is None:
        raise ValueError(f"score_mod {score_mod.name} has no grad: the backward needs d fn / d score "
                         "(ScoreMod(fn, grad=...))")
    score_mod.check_sizes(prob.batch, prob.heads, prob.n_q, prob.n_k)
    kmod = kernel_mods.KernelMod.of(score_mod, mask_fn)
    kernel_mods.check_compiles(score_mod, backward=backward)
    return score_mod, kmod


def _forward(q, k, v, causal, scale, order, block_q, block_k, mask, engine, score_mod=None, sinks=None):
    """(call, O, LSE) for `attention`, O and LSE float32 in the caller's layout and library; sinks merged into
    both where given (kernels.sinks)."""
    call = arrays.adopt({"q": q, "k": k, "v": v}, allowed=INPUT_DTYPES, bfloat16=True)
    q, k, v = call.arrays
    prob = shapes.problem(q, k, v, allowed=BF16_BITS if call.bfloat16 else INPUT_DTYPES,
                          names=arrays.accepted(INPUT_DTYPES, bfloat16=True), empty=True, value_dim=True)
    scale = shapes.resolve_scale(scale, prob.d)  # q's head dim, before any padding
    out_shape = shapes.out_shape(q, v)
    if order not in SIMT_VARIANTS:  # the registry's v1-mma / v2-mma are engine="mma" with order "v1" / "v2"
        raise ValueError(f"order must be one of {SIMT_VARIANTS} (engine='mma' picks the tensor-core kernel of "
                         f"order 'v1' or 'v2'), got {order!r}")
    kind = call.kind_of(q)
    if 0 in (prob.batch, prob.n_q, prob.n_k):
        shapes.check_mask(causal, mask)
        engines.resolve(engine, kind=kind, order=order, head_dim=max(prob.d, prob.d_v), block_q=block_q,
                        block_k=block_k)  # its errors, as for any size
        mods.check_score_mod(score_mod)
        lse = -np.inf
        if sinks is not None:  # every row sees the sink alone: LSE = s_h
            with call.context():
                lse = _sink_rows(sink_arrays.host_values(sink_arrays.device_sinks(call, sinks, prob.heads)),
                                 q.shape[:-1])
        return call, _without_launch(call, out_shape, 0.0), _without_launch(call, q.shape[:-1], lse)
    causal, mask, form = _resolve_mask(causal, mask, prob)
    score_mod, kmod = _check_mod(score_mod, prob, mask=mask)
    unit = engines.resolve(engine, kind=kind, order=order, head_dim=max(prob.d, prob.d_v), block_q=block_q,
                           block_k=block_k)
    # d_v != d: the 16-bit tensor-core kernels and the tile engine's (v1, v2) stage V and accumulate O at d_v;
    # the others take one head dim, so the narrower operands are padded with zeros (value_dims: exact) and O cut
    # back
    native = unit == "mma" and kind in engines.MMA_KINDS or unit == "simt" and VARIANTS[order].engine
    if prob.d_v != prob.d and not native:
        width = max(prob.d, prob.d_v)
        with call.context():  # on the inputs' GPU
            q, k, v = (value_dims.widened(call, name, x, width) for name, x in (("q", q), ("k", k), ("v", v)))
        prob = dataclasses.replace(prob, d=width, d_v=width)
    if unit == "mma":
        return (call,) + _attention_mma(call, q, k, v, prob, causal, scale, block_q, block_k,
                                        engines.mma_kind(engine, kind), order, score_mod, kmod, mask, form, out_shape,
                                        sinks)
    width = max(prob.d, prob.d_v)  # the engine's tiles are staged this wide (Layout.d_pad)
    _check_head_dims(prob)
    default_q, default_k = default_tiles(width)
    block_q = default_q if block_q is None else shapes.check_block("block_q", block_q)
    block_k = default_k if block_k is None else shapes.check_block("block_k", block_k)
    # threads, shared memory: checked before any allocation
    VARIANTS[order].config(block_q, block_k, prob.d, causal, form, value_dim=prob.d_v)
    value_dim = {} if prob.d_v == prob.d else {"value_dim": prob.d_v}
    kernel = VARIANTS[order].make(block_q, block_k, prob.d, causal, form, mod=kmod, **value_dim)
    check_sequence(prob.n_q, prob.n_k)
    kernel.check_grid(prob.batch, prob.heads, prob.n_q)  # CUDA's grid limits, before any copy

    backend.check_simulator_work(prob.batch, prob.heads, prob.n_q, prob.n_k, width)
    _check_value_range(v, prob.n_k, call.bfloat16, call.on_device)
    layout = tuple(q.shape[:-1])  # the caller's (B, H, N_q), (H, N_q) or (N_q,)
    with backend.explain_driver_errors(), backend.serialised(), call.context():
        strided = reads_strided(kernel)
        dq, dk, dv = (_prepare(name, x, call.on_device, strided, call.stream)
                      for name, x in (("q", q), ("k", k), ("v", v)))
        out = call.empty((prob.batch, prob.heads, prob.n_q, prob.d_v))
        lse = call.empty((prob.batch, prob.heads, prob.n_q))
        blocks = (kernel_mask(mask, prob.n_q, prob.n_k, block_q, block_k, prob.batch, prob.heads)
                  if mask is not None else None)
        captured = kernel_mods.device_arrays(score_mod, stream=call.stream, mask=mask)
        sinks_ = None if sinks is None else sink_arrays.device_sinks(call, sinks, prob.heads)
        kernel(dq, dk, dv, out, lse, scale, stream=call.stream, mask=blocks, captured=captured)
        if sinks_ is not None:
            kernel_sinks.merge(out, lse, sinks_, stream=call.stream)
        return call, value_dims.result(call, out, out_shape), call.output(lse, layout)


def _check_head_dims(prob) -> None:
    """The CUDA-core kernels' limit on q's head dim d and v's d_v, named by operand."""
    for name, dim, what in (("q", prob.d, "d"), ("v", prob.d_v, "d_v")):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{name} must have head dim {what} <= {MAX_HEAD_DIM}, got {dim}")


def _sink_rows(values: np.ndarray, shape) -> np.ndarray:
    """(..., H, N_q) float32 holding sink s_h on every row of head h: the LSE of rows that see no key."""
    rows = shapes.batch_shape(tuple(shape) + (1,))[:3]
    return np.broadcast_to(values[None, :, None], rows).reshape(tuple(shape))


def _without_launch(call, shape, value):
    """A float32 result filled with `value` (a number, or an array of `shape`), in the caller's library, for an
    empty problem (N_q = 0, N_k = 0 or B = 0): no kernel runs. With N_k = 0 every query sees no key, so O = 0
    and LSE = -inf (the rule for a row without a visible key; s_h with sinks); an empty array has nothing to
    fill."""
    host = np.full(tuple(shape), value, dtype=np.float32)
    if not call.on_device:  # a host call's result is this very array (a CPU tensor of it for torch)
        return call.output_host(host)
    with call.context():
        return call.output(cuda.to_device(host, stream=call.stream), shape)


def _attention_mma(call, q, k, v, prob, causal, scale, block_q, block_k, kind, order, score_mod, kmod, mask, form,
                   out_shape, sinks=None):
    """attention(..., engine="mma" or "mma-tf32"): the tensor-core kernel of `order` and `kind` (the kernel's:
    float16 / bfloat16 on the inputs' 16-bit bits, "float32" (3xTF32) or "tf32" on float32 inputs; d_v =
    prob.d_v, the 16-bit kernels' own, or d). out_shape: O's in the caller's layout, its last axis d_v <= the
    kernel's (value_dims.result)."""
    from fa_numba.kernels.mma.engine_v1 import make_v1_mma
    from fa_numba.kernels.mma.engine_v2 import make_v2_mma

    warps, block_k, row_blocks = engines.mma_tiles(max(prob.d, prob.d_v), block_q, block_k, kind, order,
                                                   plain=kmod is None and mask is None)
    kernel = (make_v1_mma if order == "v1" else make_v2_mma)(kind, warps, block_k, prob.d, causal, mod=kmod,
                                                              mask_form=form if mask is not None else "none",
                                                              value_dim=prob.d_v, row_blocks=row_blocks)
    check_sequence(prob.n_q, prob.n_k)
    backend.check_simulator_work(prob.batch, prob.heads, prob.n_q, prob.n_k, prob.d)
    sixteen = kind in engines.MMA_KINDS
    if not sixteen:
        _check_value_range(v, prob.n_k, call.bfloat16, call.on_device)
    layout = tuple(q.shape[:-1])
    with backend.explain_driver_errors(), backend.serialised(), call.context():
        strided = reads_strided(kernel)
        bits = [_prepare(name, x, call.on_device, strided, call.stream) for name, x in (("q", q), ("k", k), ("v", v))]
        if sixteen:  # float16: the same 16 bits
            bits = [b.view(np.uint16) if b.dtype != np.uint16 else b for b in bits]
        out = call.empty((prob.batch, prob.heads, prob.n_q, prob.d_v))
        lse = call.empty((prob.batch, prob.heads, prob.n_q))
        blocks = (kernel_mask(mask, prob.n_q, prob.n_k, kernel.config.block_q, block_k, prob.batch, prob.heads)
                  if mask is not None else None)
        sinks_ = None if sinks is None else sink_arrays.device_sinks(call, sinks, prob.heads)
        kernel(*bits, out, lse, scale, stream=call.stream, mask=blocks,
               captured=kernel_mods.device_arrays(score_mod, stream=call.stream, mask=mask))
        if sinks_ is not None:
            kernel_sinks.merge(out, lse, sinks_, stream=call.stream)
        return value_dims.result(call, out, out_shape), call.output(lse, layout)


BACKWARD_ORDERS = ("kv", "q")


def _prepare_stats(name: str, x, on_device: bool, ndim: int):
    """A C-contiguous (B, H, N) float32 array on the device, from the caller's LSE layout."""
    if on_device:
        if not x.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous on the device (make it .contiguous() first)")
        return x.reshape(shapes.batch_shape(tuple(x.shape) + (1,))[:3])
    x = np.ascontiguousarray(x, dtype=np.float32)
    return cuda.to_device(x.reshape(shapes.batch_shape(x.shape + (1,))[:3]))


def _saved_inputs(call, q, v, named: dict) -> tuple:
    """out, lse, dout (and dlse) read like q, k, v (same library and side) and checked by name: shapes from q
    (and v's head dim for out and dout); out
    and dout in float32 or q's dtype (bfloat16 included: each is read on its own, so a bfloat16 out can
    come with a float32 dout and the float32 lse), lse and dlse float32."""
    q_dtype = call.kind_of(q)
    wanted = {"out": f"dtype float32 or q's dtype {q_dtype} (the forward's output)",
              "dout": f"q's dtype {q_dtype} or float32", "lse": "dtype float32 (the forward's)",
              "dlse": "dtype float32 (LSE's cotangent)"}
    shapes_ = {"out": shapes.out_shape(q, v), "dout": shapes.out_shape(q, v), "lse": tuple(q.shape)[:-1],
               "dlse": tuple(q.shape)[:-1]}
    found = []
    for name, x in named.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array with .shape and .dtype, got {type(x).__name__}")
        stats = name in ("lse", "dlse")
        bf16 = call.bfloat16 and not stats
        try:
            one = arrays.adopt({name: x}, allowed=INPUT_DTYPES, bfloat16=bf16)
        except TypeError as error:  # a dtype without a NumPy twin (torch): say what this argument takes
            raise TypeError(f"{name} must have {wanted[name]}, got {x.dtype}") from error
        if (one.kind, one.on_device) != (call.kind, call.on_device):
            raise TypeError(f"{name} must be an array of the same kind as q, k, v ({call.kind}, "
                            f"{'device' if call.on_device else 'host'}), got {one.kind}, "
                            f"{'device' if one.on_device else 'host'}")
        (value,) = one.arrays
        if tuple(value.shape) != tuple(shapes_[name]):
            source = "q" if stats else "q and v"
            raise ValueError(f"{name} must have shape {tuple(shapes_[name])} (from {source}), got {tuple(value.shape)}")
        dtype = np.dtype(value.dtype)
        ok = one.bfloat16 or dtype == np.dtype(np.float32) or (not stats and not call.bfloat16
                                                                and dtype == np.dtype(q.dtype))
        if not ok:
            raise TypeError(f"{name} must have {wanted[name]}, got {x.dtype}")
        found.append(value)
    return tuple(found)


def attention_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale: float | None = None,
                       order: str = "kv", deterministic: bool = False, block_q: int | None = None,
                       block_k: int | None = None, mask=None, engine: str = "auto", score_mod=None,
                       captured_grads: bool = False, sinks=None, dlse=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Gradients (dq, dk, dv) of sum(dout * attention(q, k, v)), recomputing P from the forward's LSE.

    Args:
        q, k, v: the forward's inputs, as for `attention`.
        out, lse: the forward's outputs (out like q with v's head dim d_v, float32 or q's dtype; lse float32,
            q's layout without its last axis).
        dout: the cotangent of out, like out (q's dtype or float32).
        causal, scale, mask: the forward's.
        order: "kv" (K/V outer, FlashAttention-2's backward: dK, dV on chip, dQ added into HBM) or "q" (Q
            outer: dQ on chip, dK and dV added into HBM).
        deterministic: order "kv" without atomic adds: dQ by a second, Q-outer pass, bitwise repeatable.
        block_q, block_k: the tiles; default by head dim (kernels.backward.DEFAULTS; the tensor-core backward's
            own, kernels.mma.backward).
        engine: "auto", "simt" or "mma" (tensor cores: float16 or bfloat16, or float32 by 3xTF32; order "kv";
            d <= 128; P and dS rounded to the inputs' 16-bit type before their products, proofs/L7).
        score_mod: the forward's `fa_numba.mods.ScoreMod`, with its grad: dS = P (dP - D) mod'(S) (proofs/L13).
        captured_grads: also return the gradients of the score mod's captured arrays, computed without
            atomics and bitwise repeatable (kernels/captured_grad.py: a research path, O(B H N_q N_k d)).
        sinks: the forward's sink logits (then out and lse are the forward's with them): their gradient
            dsinks_h = -sum_{b, i} exp(s_h - LSE_i) (D_i - dlse_i) is returned too, by a fixed-order sum.
        dlse: the cotangent of lse, like lse (float32), for a loss that reads LSE as well as O: D_i - dlse_i
            takes D_i's place (proofs/L14). None: the loss reads O alone.
        cu_seqlens_q, cu_seqlens_k: the forward's packed batch (`attention`).

    Returns:
        (dq, dk, dv), float32, in the inputs' layout and array library: dq like q, dk like k, dv like v (H_kv
        heads: the sums over each group's query heads); with sinks, (dq, dk, dv, dsinks), dsinks float32 (H,)
        in the same library; with captured_grads=True, dcaptured last, one float64 NumPy array per captured
        array (None where it takes no gradient). A row that sees no key gets zero gradient.

    Raises:
        ValueError: an argument the kernels do not take, named with what was expected (shapes, dtypes, tiles,
            an order or engine, a score mod without grad).

    NaN and infinities follow the forward's rule (proofs/L7.8): masked pairs are never multiplied, so a NaN
    reaches exactly the gradients of the rows and keys that see it; every other entry is bit for bit the one
    without it (on a GPU, up to the order of the atomic adds). HBM traffic: iomodel.traffic_backward.

    >>> import numpy as np, fa_numba
    >>> q = np.random.default_rng(0).standard_normal((2, 8, 4)).astype(np.float32)
    >>> out, lse = fa_numba.attention(q, q, q, causal=True, return_lse=True, block_q=8, block_k=8)
    >>> dq, dk, dv = fa_numba.attention_backward(q, q, q, out, lse, np.ones_like(q), causal=True, block_q=8)
    >>> dq.shape, dk.dtype
    ((2, 8, 4), dtype('float32'))
    """
    engines.backward(engine)  # the engine's name, before anything is read
    from fa_numba.kernels import backward

    causal, mask = _packed_mask(causal, mask, cu_seqlens_q, cu_seqlens_k)

    call = arrays.adopt({"q": q, "k": k, "v": v}, allowed=INPUT_DTYPES, bfloat16=True)
    q, k, v = call.arrays
    accepted = arrays.accepted(INPUT_DTYPES, bfloat16=True)
    prob = shapes.problem(q, k, v, allowed=BF16_BITS if call.bfloat16 else INPUT_DTYPES, names=accepted, empty=True,
                          value_dim=True)
    saved = {"out": out, "lse": lse, "dout": dout} if dlse is None else {"out": out, "lse": lse, "dout": dout,
                                                                          "dlse": dlse}
    out, lse, dout, *dlse_ = _saved_inputs(call, q, v, saved)
    dlse = dlse_[0] if dlse_ else None
    grad_shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))  # the caller's, before any padding
    empty = 0 in (prob.batch, prob.n_q, prob.n_k)
    if empty:
        shapes.check_mask(causal, mask)  # mask.check would refuse the zero sizes
    else:
        causal, mask, form = _resolve_mask(causal, mask, prob)
    scale = shapes.resolve_scale(scale, prob.d)
    if order not in BACKWARD_ORDERS:
        raise ValueError(f"order must be one of {BACKWARD_ORDERS}, got {order!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if not isinstance(captured_grads, (bool, np.bool_)):
        raise TypeError(f"captured_grads must be a bool, got {type(captured_grads).__name__}")
    if captured_grads and mods.check_score_mod(score_mod) is None:
        raise ValueError("captured_grads=True needs a score_mod (the gradients of its captured arrays)")
    if captured_grads and dlse is not None:
        raise ValueError("captured_grads=True with dlse is not supported: the captured arrays' kernels compute D "
                         "from O and dO alone (give dlse=None, or take the captured gradients without LSE's)")
    if deterministic and order != "kv":
        raise ValueError("deterministic=True is the K/V-outer order's mode (a Q-outer pass for dQ): use order='kv'")
    if empty:  # every gradient is a sum over no pair: zero (or empty)
        mods.check_score_mod(score_mod)
        grads = tuple(_without_launch(call, x.shape, 0.0) for x in (q, k, v))
        if sinks is not None:  # D = 0 on every row: dsinks_h = sum exp(s_h - LSE_i) dlse_i
            with call.context():
                grads += (_without_launch(call, (prob.heads,), _empty_sink_gradients(call, sinks, prob, lse, dlse)),)
        if captured_grads:
            grads += (tuple(None if cg is None else np.zeros(a.shape) for a, cg in
                            zip(score_mod.captured, score_mod.captured_grad)),)
        return grads
    score_mod, kmod = _check_mod(score_mod, prob, backward=True, mask=mask)
    dtype = call.kind_of(q)
    if captured_grads:
        kernel_mods.check_compiles(score_mod, captured=True)
    dout_kind = call.kind_of(dout)
    width = max(prob.d, prob.d_v)
    unit = engines.backward(engine, kind=dtype, order=order, head_dim=width, dout_kind=dout_kind, causal=causal,
                            deterministic=bool(deterministic), block_q=block_q, block_k=block_k)
    # d_v != d: the backward kernels of both engines take V, dO (and O) d_v wide; the captured gradients' pair
    # kernels and the float32 (3xTF32) tensor-core backward take one head dim, so there the narrower operands
    # are padded with zeros (value_dims: exact) and the gradients cut back
    if prob.d_v != prob.d and (captured_grads or (unit == "mma" and dtype == "float32")):
        with call.context():  # on the inputs' GPU
            q, k, v, out, dout = tuple(value_dims.widened(call, name, x, width)
                                       for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)))
        prob = dataclasses.replace(prob, d=width, d_v=width)
    if unit == "mma":
        grads = _attention_backward_mma(call, q, k, v, out, lse, dout, prob, causal, scale, bool(deterministic),
                                        block_q, block_k, dtype, score_mod, kmod, mask, form, grad_shapes, sinks,
                                        dlse)
        if captured_grads:  # the CUDA-core pair kernels, on the float32 view of the same inputs
            grads += (_captured_grads(call, q, k, v, out, lse, dout, prob, causal, scale, score_mod, mask),)
        return grads
    _check_head_dims(prob)
    block = backward.default_backward_tiles(width)[0]
    block_q = block if block_q is None else shapes.check_block("block_q", block_q)
    block_k = block_q if block_k is None else shapes.check_block("block_k", block_k)
    if block_q != block_k:
        raise ValueError(f"block_q and block_k must be equal for the backward kernels (square tiles), got "
                         f"{block_q} and {block_k}")
    for kind in ("kv", "q"):  # threads and shared memory, before any allocation
        backward.BackwardConfig(kind, block_q, prob.d, causal, mask_form=form, value_dim=prob.d_v).check()
    backward.check_launches(prob.batch, prob.heads, prob.heads_kv, prob.n_q, prob.n_k, block=block_q,
                            head_dim=prob.d, causal=causal, order=order, deterministic=bool(deterministic),
                            mask_form=form, mod=kmod, value_dim=prob.d_v)  # CUDA's grid limits, before any copy

    backend.check_simulator_work(prob.batch, prob.heads, prob.n_q, prob.n_k, width, passes=3)
    with backend.explain_driver_errors(), backend.serialised(), call.context():
        dq_, dk_, dv_, do_ = (_prepare(name, x, call.on_device)
                              for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout)))
        o_ = _prepare("out", out, call.on_device)
        lse_ = _prepare_stats("lse", lse, call.on_device, len(q.shape))
        grad_q = call.empty((prob.batch, prob.heads, prob.n_q, prob.d))
        grad_k = call.empty((prob.batch, prob.heads_kv, prob.n_k, prob.d))
        grad_v = call.empty((prob.batch, prob.heads_kv, prob.n_k, prob.d_v))
        dvec = cuda.device_array((prob.batch, prob.heads, prob.n_q), dtype=np.float32, stream=call.stream)
        blocks = (kernel_mask(mask, prob.n_q, prob.n_k, block_q, block_q, prob.batch, prob.heads)
                  if mask is not None else None)
        captured = kernel_mods.device_arrays(score_mod, stream=call.stream, mask=mask)
        sinks_ = None if sinks is None else sink_arrays.device_sinks(call, sinks, prob.heads)
        dlse_ = None if dlse is None else _prepare_stats("dlse", dlse, call.on_device, len(q.shape))
        backward.run(dq_, dk_, dv_, o_, lse_, do_, grad_q, grad_k, grad_v, dvec, scale, causal=causal, order=order,
                     deterministic=bool(deterministic), block=block_q, stream=call.stream, mask=blocks, mod=kmod,
                     captured=captured, dlse=dlse_)
        grads = tuple(value_dims.result(call, g, shape) for g, shape in zip((grad_q, grad_k, grad_v), grad_shapes))
        grads += _sink_gradients(call, lse_, dvec, sinks_, prob.heads)
        if captured_grads:
            from fa_numba.kernels import captured_grad

            grads += (captured_grad.run(dq_, dk_, dv_, o_, do_, lse_, scale, score_mod, captured, causal=causal,
                                        mask=blocks, stream=call.stream,
                                        mask_mod=mask if kernel_mods.has_mask_fn(mask) else None),)
        return grads


def _captured_grads(call, q, k, v, out, lse, dout, prob, causal, scale, score_mod, mask):
    """The captured arrays' gradients (kernels/captured_grad.py) of a call the tensor-core backward ran."""
    from fa_numba.kernels import captured_grad

    with backend.explain_driver_errors(), backend.serialised(), call.context():
        q_, k_, v_, do_, o_ = (_prepare(name, x, call.on_device)
                               for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)))
        lse_ = _prepare_stats("lse", lse, call.on_device, len(q.shape))
        captured = kernel_mods.device_arrays(score_mod, stream=call.stream, mask=mask)
        blocks = kernel_mask(mask, prob.n_q, prob.n_k, 16, 16, prob.batch, prob.heads) if mask is not None else None
        return captured_grad.run(q_, k_, v_, o_, do_, lse_, scale, score_mod, captured, causal=causal, mask=blocks,
                                 stream=call.stream, mask_mod=mask if kernel_mods.has_mask_fn(mask) else None)


def _sink_gradients(call, lse_, dvec, sinks_, heads: int) -> tuple:
    """(dsinks,) in the caller's library from the backward's LSE and D (less dlse), or () without sinks."""
    if sinks_ is None:
        return ()
    dsinks = call.empty((heads,))
    kernel_sinks.gradients(lse_, dvec, sinks_, dsinks, stream=call.stream)
    return (call.output(dsinks, (heads,)),)


def _empty_sink_gradients(call, sinks, prob, lse, dlse) -> np.ndarray:
    """dsinks of a problem without a pair (N_k = 0: every row has LSE = s_h and O = 0, so D = 0; or no row):
    sum over its rows of exp(s_h - LSE_i) dlse_i, on the host (float64 sums, rounded once)."""
    values = sink_arrays.host_values(sink_arrays.device_sinks(call, sinks, prob.heads)).astype(np.float64)
    if dlse is None or prob.batch * prob.n_q == 0:
        return np.zeros(prob.heads, np.float32)
    host = (lambda x: x.copy_to_host()) if call.on_device else np.asarray
    rows = (prob.batch, prob.heads, prob.n_q)
    lse_h, dlse_h = (host(x).astype(np.float64).reshape(rows) for x in (lse, dlse))
    with np.errstate(invalid="ignore", over="ignore"):
        weight = np.where(lse_h == -np.inf, 0.0, np.exp(values[None, :, None] - lse_h))
    return (weight * dlse_h).sum(axis=(0, 2)).astype(np.float32)


def _attention_backward_mma(call, q, k, v, out, lse, dout, prob, causal, scale, deterministic, block_q, block_k,
                            kind, score_mod, kmod, mask, form, grad_shapes, sinks=None, dlse=None):
    """attention_backward(..., engine="mma"): the tensor-core backward (kernels.mma.backward) on the inputs'
    16-bit bits, or on float32 inputs by 3xTF32; dout must be in q's dtype (the products read it as they are). grad_shapes: those of
    (dq, dk, dv) in the caller's layout, their last axes at most the kernels' head dim (value_dims.result)."""
    from fa_numba.kernels.mma import backward as mma_backward

    dout_kind = call.kind_of(dout)
    if dout_kind != kind:
        raise TypeError(f"dout must have q's dtype {kind} for engine='mma' (the tensor cores read it as q's), "
                        f"got {dout_kind}; cast it, or use engine='simt'")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None:
            shapes.check_block(name, size)
    form = form if mask is not None else "none"
    value_dim = prob.d_v if prob.d_v != prob.d else 0
    plan = mma_backward.plan(kind, prob.d, causal, deterministic, block_q, block_k, kmod, form,
                             value_dim)  # before copies
    for kernel, side in plan:
        kernel.check_grid(prob.batch, *((prob.heads, prob.n_q) if side == "q" else (prob.heads_kv, prob.n_k)))
    backend.check_simulator_work(prob.batch, prob.heads, prob.n_q, prob.n_k, max(prob.d, prob.d_v), passes=3)
    with backend.explain_driver_errors(), backend.serialised(), call.context():
        q_, k_, v_, do_, o_ = (_prepare(name, x, call.on_device, True, call.stream)  # views read where they are
                               for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)))
        lse_ = _prepare_stats("lse", lse, call.on_device, len(q.shape))
        grad_q = call.empty((prob.batch, prob.heads, prob.n_q, prob.d))
        grad_k = call.empty((prob.batch, prob.heads_kv, prob.n_k, prob.d))
        grad_v = call.empty((prob.batch, prob.heads_kv, prob.n_k, prob.d_v))
        dvec = cuda.device_array((prob.batch, prob.heads, prob.n_q), dtype=np.float32, stream=call.stream)
        sinks_ = None if sinks is None else sink_arrays.device_sinks(call, sinks, prob.heads)
        dlse_ = None if dlse is None else _prepare_stats("dlse", dlse, call.on_device, len(q.shape))
        mma_backward.run(q_, k_, v_, o_, lse_, do_, grad_q, grad_k, grad_v, dvec, scale, kind=kind, causal=causal,
                         deterministic=deterministic, block_q=block_q, block_k=block_k, stream=call.stream, mod=kmod,
                         captured=kernel_mods.device_arrays(score_mod, stream=call.stream, mask=mask), mask=mask,
                         mask_form=form, dlse=dlse_)
        grads = tuple(value_dims.result(call, g, shape) for g, shape in zip((grad_q, grad_k, grad_v), grad_shapes))
        return grads + _sink_gradients(call, lse_, dvec, sinks_, prob.heads)
