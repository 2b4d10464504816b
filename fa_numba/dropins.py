"""Drop-ins with the signatures people already call: `sdpa` (torch's scaled_dot_product_attention) and
`flash_attn_func` (flash-attn 2's), differentiable, traced by torch.compile, on fa_numba's kernels.

    >>> import torch, fa_numba
    >>> q = torch.randn(1, 2, 8, 4)
    >>> bool(torch.allclose(fa_numba.sdpa(q, q, q, is_causal=True),
    ...                     torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), atol=1e-5))
    True

Both run `fa_numba.autograd` (the operator fa_numba::attention and its backward) and differ from it only
in conventions:

|                        | `fa_numba.sdpa`                        | `fa_numba.flash_attn_func`               |
|---|---|---|
| layout                 | (..., H, N, d)                         | (B, N, H, d)                             |
| causal alignment       | top-left: query i sees keys j <= i     | bottom-right: j <= i + N_k - N_q (ours)  |
| GQA (H_kv < H)         | only with enable_gqa=True              | always                                   |
| masks                  | attn_mask: bool, broadcastable         | window_size=(left, right), -1 unbounded  |
| a row that sees no key | O = 0 (torch >= 2.5's SDPA too)        | O = 0, LSE = -inf (flash-attn: +inf)     |

Both return O in the input dtype, computed in float32 (flash-attn takes only float16 and bfloat16; these
take float32 too). What is refused, with a message naming the argument: dropout (dropout_p != 0: fa_numba is
exact), a float attn_mask (an additive bias is a score modification, not built yet), softcap and
alibi_slopes, a value head dim other than q's (not built yet), float64.
"""

from __future__ import annotations

import torch

from fa_numba import autograd, masks


def _no_dropout(dropout_p) -> None:
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0: fa_numba computes attention exactly, without dropout; got "
                         f"{dropout_p!r}")


def _same_head_dim(query, value, name: str = "value") -> None:
    if query.shape[-1] != value.shape[-1]:
        raise ValueError(f"{name} must have q's head dim {query.shape[-1]} (a value head dim of its own, d_v != "
                         f"d_qk, is not built yet), got {value.shape[-1]}")


def _float_inputs(*named) -> None:
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must have dtype float32, float16 or bfloat16 (the kernels compute in "
                            f"float32), got {x.dtype}")


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's signature and semantics on fa_numba's kernels.

    query (..., H, L, d), key and value (..., H_kv, S, d), the same leading axes; attn_mask a bool tensor
    broadcastable to (..., H, L, S), True where the query takes part in attention with the key (a mask that
    differs by batch or head runs one launch per slice of its batch and head axes); is_causal the top-left causal mask (query
    i sees keys j <= i; not with attn_mask, as SDPA); scale default 1/sqrt(d); H_kv < H (GQA) only with
    enable_gqa=True, as SDPA. A row that sees no key gets O = 0 (so does torch SDPA's, since torch 2.5).
    Returns O, (..., H, L, d), in query's dtype. Differentiable and traced by torch.compile (see the module
    docstring for what is refused)."""
    _float_inputs(("query", query), ("key", key), ("value", value))
    _no_dropout(dropout_p)
    _same_head_dim(query, value)
    if query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"key must have query's {query.shape[-3]} heads (axis -3), got {key.shape[-3]}: pass "
                         "enable_gqa=True for grouped-query attention, as torch SDPA asks")
    if is_causal and attn_mask is not None:
        raise ValueError("pass attn_mask or is_causal=True, not both (torch SDPA refuses both too)")
    mask, causal = attn_mask, False
    if is_causal:
        n_q, n_k = query.shape[-2], key.shape[-2]
        if n_q == n_k:
            causal = True  # top-left and bottom-right alignment agree
        elif n_q > n_k:  # j <= i is j <= i + delta + (n_q - n_k): a window with right = n_q - n_k
            mask = masks.sliding_window(None, n_q - n_k)
        else:
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device="cpu").tril()
    return autograd.attention(query, key, value, causal=causal, scale=scale, mask=mask)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's flash_attn_func signature and semantics on fa_numba's kernels.

    q (B, S_q, H, d), k and v (B, S_k, H_kv, d) with H_kv dividing H (GQA/MQA); causal and window_size
    bottom-right aligned (query i sees keys j with i + S_k - S_q - left <= j <= i + S_k - S_q + right, -1
    unbounded; causal means right = 0); softmax_scale default 1/sqrt(d); deterministic=True runs the
    backward's deterministic mode (no atomic adds). Returns O (B, S_q, H, d) in q's dtype, contiguous; with
    return_attn_probs=True (out, softmax_lse, None): LSE (B, H, S_q) float32, and None where flash-attn
    returns its testing-only S_dmask (fa_numba never materialises P). dropout_p must be 0, softcap 0 and
    alibi_slopes None (see the module docstring)."""
    _float_inputs(("q", q), ("k", k), ("v", v))
    _no_dropout(dropout_p)
    _same_head_dim(q, v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (B, N, H, d) (flash-attn's layout), got {tuple(x.shape)}")
    if softcap != 0.0:
        raise ValueError(f"softcap must be 0.0 (a soft cap is a score modification, not built yet), got {softcap!r}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes must be None (ALiBi is a score modification, not built yet)")
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded, got {window_size!r}")
    left, right = (None if w < 0 else w for w in window_size)
    right = 0 if causal else right
    mask = None if (left, right) == (None, None) else masks.sliding_window(left, right)
    out, lse = autograd.attention_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale,
                                           mask=mask, deterministic=bool(deterministic))
    out = out.transpose(1, 2).contiguous()
    return (out, lse, None) if return_attn_probs else out
