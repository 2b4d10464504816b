"""PyTorch autograd for fa_numba: `attention(q, k, v, ...)` as a differentiable torch function.

    >>> import torch, fa_numba.autograd
    >>> q = torch.randn(1, 2, 8, 4, requires_grad=True)
    >>> out = fa_numba.autograd.attention(q, q, q, causal=True)
    >>> out.sum().backward()
    >>> q.grad.shape
    torch.Size([1, 2, 8, 4])

It calls the operator `fa_numba::attention` (fa_numba.torch_ops), whose autograd formula runs
`fa_numba::attention_backward`: the forward runs `fa_numba.attention` (the `order` kernel) and saves O and
LSE; the backward runs `fa_numba.attention_backward` (`backward_order`, `deterministic`), which recomputes P
from LSE instead of storing it. Being an operator with a fake implementation, it is traced by
`torch.compile(model, fullgraph=True)` as one node (no graph break), and checked by `torch.library.opcheck`.
Tensors stay where they are: CUDA tensors run on the GPU on torch's current stream, CPU tensors in Numba's
CUDA simulator on a machine without a GPU (slowly: keep them small). Outputs and gradients come back as
torch tensors on the inputs' device, in the inputs' dtype (computed in float32; out_dtype=torch.float32 keeps
the float32 O).

Forward mode: a tangent on q, k or v (torch.func.jvp, torch.func.jacfwd, a torch.autograd.forward_ad dual
tensor) is a NotImplementedError, since the operators have no JVP formula and torch would return a zero
tangent (`torch_ops.refuse_forward_ad`).

Strides: a CUDA tensor in any layout whose last axis has unit stride is read where it is by the CUDA-core kernels
and the tensor-core ones (the (B, N, H, d) view `x.view(B, N, H, d).transpose(1, 2)` costs no copy; each kernel
is compiled a second time for strided arrays; the tensor-core kernels' cp.async copies find rows by the strides,
and a view whose rows are not 16-byte aligned takes their synchronous loads). What still copies: a tensor whose
last axis is strided, leading batch axes that torch cannot merge into one without a copy, the inputs of the tile
engine's v1 above d = 64 (its strided compilation spills: `api.reads_strided`), and dO for the backward
(`.contiguous()`, usually a no-op). CPU tensors are copied to the simulator's device arrays in any case.

torch is an optional extra (`pip install "fa_numba[torch]"`); this module imports it, `import fa_numba`
does not.
"""

from __future__ import annotations

import torch

from fa_numba import engines, mods, shapes, torch_ops

BACKWARD_ORDERS = ("kv", "q")


def check_gradients_engine(engine: str, q, k, v) -> None:
    """A ValueError where `engine` cannot give the gradients a call will want: float32 inputs under plain TF32
    have a forward only. Also what `distributed.ring_attention` asks before its forward."""
    if (engine == "mma-tf32" and q.dtype == torch.float32 and torch.is_grad_enabled()
            and any(x.requires_grad for x in (q, k, v))):
        raise ValueError("engine='mma-tf32' runs float32 inputs' forward only (one TF32 product per product is not "
                         "float32-grade): use engine='mma' (3xTF32), 'simt' or 'auto' for gradients, or call it "
                         "under torch.no_grad()")


def _flatten(name: str, x):
    """(..., H, N, d) as (B, H, N, d) (shapes.batch_shape: leading batch axes as one, none as B = H = 1): a
    view where torch can make one and its last axis has unit stride (the CUDA-core kernels read it through
    its strides, as the tensor-core ones do); a contiguous copy otherwise (module docstring)."""
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape (..., N, d) with at least 2 axes, got {x.dim()}-D shape "
                         f"{tuple(x.shape)}")
    x = x.reshape(shapes.batch_shape(x.shape))
    return x.contiguous() if x.stride(-1) != 1 else x


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, order: str = "v2",
              backward_order: str = "kv", deterministic: bool = False, mask=None, engine: str = "auto",
              out_dtype=None, block_q: int | None = None, block_k: int | None = None,
              backward_block: int | None = None, score_mod=None, sinks=None):
    """softmax(scale Q K^T) V for torch tensors, differentiable in q, k and v (see the module docstring).

    Arguments as `fa_numba.attention` (layouts, GQA, bottom-right causal alignment, masks) and, for the backward,
    as `fa_numba.attention_backward` (backward_order "kv" or "q", deterministic). q, k, v: (..., H, N, d) with
    any number of leading batch axes, shared by all three. block_q, block_k: the forward's tiles, and
    backward_block the backward's square tile (None: the defaults for the head dim; small tiles are what
    keep the simulator fast). Returns O in q's dtype, or in out_dtype
    (torch.float32 keeps the kernels' float32 result). engine: "simt" (CUDA cores), "mma" (tensor cores,
    forward and backward: float16 or bfloat16, any mask, d <= 128 (the forward alone to 192), backward_order
    "kv"; float32 by 3xTF32, both passes; "mma-tf32", plain TF32, has a forward only: refused where a gradient
    is wanted) or "auto" (the
    default: each pass takes the tensor cores for float16 and bfloat16 tensors where they take it as it is,
    `fa_numba.engines`, and the CUDA cores otherwise, float32 always: a float32 dO, with out_dtype=torch.float32,
    keeps the CUDA-core backward). mask: as fa_numba.attention's, or a bool tensor broadcastable to
    (..., H, N_q, N_k), True where the query sees the key (torch SDPA's attn_mask; one that differs by batch
    or head is one launch reading each slice's tile lists), or a `masks.mask_mod` (compiled into the kernels,
    crossing the operators by its key: keep it referenced as a score mod). score_mod: a `fa_numba.mods.ScoreMod`
    (with its grad for the backward), compiled into the kernels of either engine (fa_numba.attention's); gradients
    reach q, k, v and its captured torch tensors that require grad (`ScoreMod.learnable`: a learnable bias, by
    the captured arrays' deterministic kernels; a loss reading LSE too is refused then); keep the mod referenced while
    a compiled graph that uses it may run (torch_ops.mod_key). sinks: learnable sinks, a float32 (H,) tensor on
    q's device, one logit per query head (fa_numba.attention's; proofs/L14), differentiable: its gradient is
    a fixed-order sum, no atomics."""
    out, _ = attention_with_lse(q, k, v, causal=causal, scale=scale, order=order, backward_order=backward_order,
                                deterministic=deterministic, mask=mask, engine=engine, out_dtype=out_dtype,
                                block_q=block_q, block_k=block_k, backward_block=backward_block, score_mod=score_mod,
                                sinks=sinks)
    return out


def attention_with_lse(q, k, v, *, causal: bool = False, scale: float | None = None, order: str = "v2",
                       backward_order: str = "kv", deterministic: bool = False, mask=None, engine: str = "auto",
                       out_dtype=None, block_q: int | None = None, block_k: int | None = None,
                       backward_block: int | None = None, score_mod=None, sinks=None):
    """`attention`, and LSE (float32, q's shape without d; differentiable: a loss may read it, proofs/L14)."""
    engines.backward(engine)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} (use fa_numba.attention "
                            "for other arrays)")
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape (H,) or None, got {type(sinks).__name__}")
    torch_ops.refuse_forward_ad(("q", q), ("k", k), ("v", v), ("sinks", sinks))
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__}")
    if backward_order not in BACKWARD_ORDERS:
        raise ValueError(f"backward_order must be one of {BACKWARD_ORDERS}, got {backward_order!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if not isinstance(mask, torch.Tensor):
        causal, mask = shapes.check_mask(causal, mask)
    elif causal:
        raise ValueError("pass causal=True or mask=..., not both (got causal=True and a mask tensor)")
    if q.dim() > 4 and not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        raise ValueError(f"q, k, v must share their leading batch axes, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    check_gradients_engine(engine, q, k, v)
    shape = q.shape
    tiles = [0 if b is None else shapes.check_block(name, b)
             for name, b in (("block_q", block_q), ("block_k", block_k), ("backward_block", backward_block))]
    q4, k4, v4 = (_flatten(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    scale = shapes.resolve_scale(scale, q.shape[-1])
    mask_spec, mask_dense = torch_ops.mask_arguments(mask, q.shape, k.shape[-2])
    mod = mods.check_score_mod(score_mod)
    key = torch_ops.mod_key(mod)
    arguments = (causal, scale, order, mask_spec, mask_dense, engine, tiles[0], tiles[1], backward_order,
                 deterministic, tiles[2], key)
    if mod is not None and mod.learnable and torch.is_grad_enabled():
        learnable = [mod.tensors[k] for k in mod.learnable]
        out, lse = _LearnableMod.apply(q4, k4, v4, sinks, arguments, mod, *learnable)
    else:
        out, lse = torch_ops.attention_op(q4, k4, v4, *arguments, sinks)
    return out.reshape(shapes.out_shape(q, v)).to(q.dtype if out_dtype is None else out_dtype), lse.reshape(shape[:-1])


class _LearnableMod(torch.autograd.Function):
    """The forward operator with a score mod whose captured tensors require grad: the same forward, and a backward
    through `fa_numba::attention_backward_lse` that returns those tensors' gradients too (the captured arrays'
    deterministic kernels), so autograd reaches a learnable bias (`ScoreMod.learnable`)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, arguments, mod, *learnable):
        out, lse = torch_ops.attention_op(q, k, v, *arguments, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *learnable)
        ctx.arguments, ctx.mod = arguments, mod  # the mod held until the backward, as the operators' formula does
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, *learnable = ctx.saved_tensors
        (causal, scale, _, mask_spec, mask_dense, engine, _, _, order, deterministic, block, key) = ctx.arguments
        dout = torch.zeros_like(out) if dout is None else dout
        dlse = torch.zeros_like(lse) if dlse is None else dlse
        dq, dk, dv, dsinks, dcaptured = torch_ops.attention_backward_lse_op(
            q, k, v, out, lse, dout, dlse, causal, scale, order, deterministic, mask_spec, mask_dense, block, engine,
            key, sinks, list(learnable))
        dsinks = None if sinks is None else dsinks.to(sinks.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None,
                *(g.to(t.dtype) for g, t in zip(dcaptured, learnable)))
