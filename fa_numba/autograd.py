"""PyTorch autograd for fa_numba: `attention(q, k, v, ...)` as a differentiable torch function.

    >>> import torch, fa_numba.autograd
    >>> q = torch.randn(1, 2, 8, 4, requires_grad=True)
    >>> out = fa_numba.autograd.attention(q, q, q, causal=True)
    >>> out.sum().backward()
    >>> q.grad.shape
    torch.Size([1, 2, 8, 4])

The forward runs `fa_numba.attention` (the `order` kernel) and saves O and LSE; the backward runs
`fa_numba.attention_backward` (`backward_order`, `deterministic`), which recomputes P from LSE instead of
storing it. Tensors stay where they are: CUDA tensors run on the GPU on torch's current stream, CPU tensors
in Numba's CUDA simulator on a machine without a GPU (slowly: keep them small). Outputs and gradients come
back as torch tensors on the inputs' device; gradients in the inputs' dtypes (computed in float32).

torch is an optional extra (`pip install "fa_numba[torch]"`); this module imports it, `import fa_numba`
does not.
"""

from __future__ import annotations

import torch

from fa_numba import api, engines, masks, shapes


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, order, backward_order, deterministic, mask):
        if shapes.check_mask(causal, mask)[1] is not None and q.dim() >= 2 and k.dim() >= 2:
            # evaluated once, here: the backward differentiates the mask this forward used, even if the
            # state a from_function predicate reads changes in between (masks.fixed)
            mask = masks.fixed(mask, q.shape[-2], k.shape[-2])
        out, lse = api.attention(q, k, v, causal=causal, scale=scale, order=order, return_lse=True, mask=mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = dict(causal=causal, scale=scale, order=backward_order, deterministic=deterministic, mask=mask)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = api.attention_backward(q, k, v, out, lse, dout.contiguous(), **ctx.settings)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, order: str = "v2",
              backward_order: str = "kv", deterministic: bool = False, mask=None, engine: str = "auto"):
    """softmax(scale Q K^T) V for torch tensors, differentiable in q, k and v (see the module docstring).

    Arguments as `fa_numba.attention` (layouts, GQA, bottom-right causal alignment, masks) and, for the backward,
    as `fa_numba.attention_backward` (backward_order "kv" or "q", deterministic). Returns O (float32).
    engine: "auto" or "simt"; "mma" is a NotImplementedError until the tensor-core backward exists (for the
    tensor-core forward alone, call fa_numba.attention(..., engine="mma"))."""
    engines.backward(engine)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} (use fa_numba.attention "
                            "for other arrays)")
    return _Attention.apply(q, k, v, causal, scale, order, backward_order, deterministic, mask)
