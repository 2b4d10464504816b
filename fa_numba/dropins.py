"""Drop-ins with the signatures people already call: `sdpa` (torch's scaled_dot_product_attention),
`flash_attn_func` and `flash_attn_varlen_func` (flash-attn 2's), differentiable, traced by torch.compile, on
fa_numba's kernels.

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
| score modifications    | attn_mask float: added to the scores   | softcap, alibi_slopes                    |
| a row that sees no key | O = 0 (torch >= 2.5's SDPA too)        | O = 0, LSE = -inf (flash-attn: +inf)     |

Both return O in the input dtype, computed in float32 (flash-attn takes only float16 and bfloat16; these
take float32 too). A float attn_mask, softcap and alibi_slopes are score mods (`mods.conventions`) compiled
into the CUDA-core kernels; their mod is built in eager Python from the tensors' values (a graph break
under torch.compile, which fullgraph=True refuses) and cached by value, so repeated calls reuse one mod
and one compiled graph; no gradient reaches the float mask (one that requires grad is refused); slopes that
require grad get theirs (a mod of their own per call, holding the tensor: `ScoreMod.learnable`). The mask
and the slopes may have any real floating dtype (SDPA's mask in the query's dtype,
bfloat16 included), widened to float64 exactly. A row whose float attn_mask holds no finite entry sees no key,
as in torch SDPA: O = 0 and zero gradients (the row is masked, not computed from its -inf scores). A value
head dim other than q's (d_v != d, MLA's 192 / 128) is taken: natively by the 16-bit tensor-core forwards
and backward, the tile engine's CUDA-core forwards and the CUDA-core backward, by the other kernels (rowwise,
3xTF32) at max(d, d_v) with the narrower operands padded with zeros, which is exact (fa_numba.value_dims).
What is refused, with a message naming the argument: dropout (dropout_p != 0: fa_numba is exact), float64
q, k, v, an integer or complex attn_mask or alibi_slopes, and forward-mode AD (a NotImplementedError: the operators
have no JVP formula, `torch_ops.refuse_forward_ad`).
"""

from __future__ import annotations

import collections
import hashlib
import math

import numpy as np
import torch

from fa_numba import autograd, masks, torch_ops
from fa_numba.mods import conventions

_MOD_CACHE: "collections.OrderedDict" = collections.OrderedDict()  # value -> ScoreMod, the latest CACHED_MODS
CACHED_MODS = 32


_ARGUMENTS = {"additive": "attn_mask", "flash_attn": "alibi_slopes"}  # the argument each mod's tensor comes from


def _host(name: str, array) -> np.ndarray:
    """array's values as a float64 NumPy array. Every real floating dtype widens to float64 exactly (bfloat16,
    which torch cannot hand to NumPy, included); an integer, bool or complex tensor is a TypeError naming the
    argument."""
    if not array.is_floating_point():
        raise TypeError(f"{name} must be a real floating tensor (float32, float16, bfloat16 or float64), got "
                        f"dtype {array.dtype}")
    return np.ascontiguousarray(array.detach().to(device="cpu", dtype=torch.float64).numpy())


@torch.compiler.disable
def _cached_mod(kind: str, array, **params):
    """The drop-in's ScoreMod for these values (`mods.conventions.<kind>`), made once per distinct value and
    kept while among the latest CACHED_MODS used: an equal mod keeps its key, so a compiled graph that bakes
    the key in is reused (a bfloat16 tensor and its float32 copy are one value). Eager (a graph break under
    torch.compile): it reads the tensor's values."""
    host = None if array is None else _host(_ARGUMENTS[kind], array)
    digest = None if host is None else (host.shape, hashlib.sha256(host.tobytes()).hexdigest())
    key = (kind, digest, tuple(sorted(params.items())))
    if key not in _MOD_CACHE:
        _MOD_CACHE[key] = getattr(conventions, kind)(host, **params)
        while len(_MOD_CACHE) > CACHED_MODS:
            _MOD_CACHE.popitem(last=False)
    _MOD_CACHE.move_to_end(key)
    return _MOD_CACHE[key]


def _no_dropout(dropout_p) -> None:
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0: fa_numba computes attention exactly, without dropout; got "
                         f"{dropout_p!r}")


def _float_inputs(*named) -> None:
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must have dtype float32, float16 or bfloat16 (the kernels compute in "
                            f"float32), got {x.dtype}")


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's signature and semantics on fa_numba's kernels.

    Args:
        query: (..., H, L, d) torch tensor (float32, float16 or bfloat16).
        key, value: (..., H_kv, S, d) and (..., H_kv, S, d_v) (a value head dim of its own, as SDPA takes it),
            query's leading axes.
        attn_mask: a bool tensor broadcastable to (..., H, L, S), True where the query takes part in attention
            with the key (a mask that differs by batch or head is one launch reading each slice's tile lists),
            or a float tensor broadcastable to it, in any real floating dtype, added to the scores (-inf masks a
            pair; a row with no finite entry sees no key; a score mod, `mods.conventions.additive`, taking no
            gradient).
        dropout_p: must be 0.
        is_causal: the top-left causal mask (query i sees keys j <= i); not with attn_mask, as SDPA.
        scale: default 1 / sqrt(d).
        enable_gqa: H_kv < H (GQA) only with it, as SDPA.

    Returns:
        O, (..., H, L, d_v), in query's dtype; differentiable and traced by torch.compile. A row that sees no key
        gets O = 0 (so does torch SDPA's, since torch 2.5).

    Raises:
        ValueError, TypeError, NotImplementedError: what SDPA refuses, and what this drop-in does not take
        (dropout, forward-mode AD: the module docstring), each naming the argument."""
    _float_inputs(("query", query), ("key", key), ("value", value))
    _no_dropout(dropout_p)
    if query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"key must have query's {query.shape[-3]} heads (axis -3), got {key.shape[-3]}: pass "
                         "enable_gqa=True for grouped-query attention, as torch SDPA asks")
    if is_causal and attn_mask is not None:
        raise ValueError("pass attn_mask or is_causal=True, not both (torch SDPA refuses both too)")
    mask, causal, mod = attn_mask, False, None
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype != torch.bool:
        mod = _additive(query, key, attn_mask)
        mask = _rows_without_a_key(key, attn_mask)
    if is_causal:
        n_q, n_k = query.shape[-2], key.shape[-2]
        if n_q == n_k:
            causal = True  # top-left and bottom-right alignment agree
        elif n_q > n_k:  # j <= i is j <= i + delta + (n_q - n_k): a window with right = n_q - n_k
            mask = masks.sliding_window(None, n_q - n_k)
        else:
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device="cpu").tril()
    return autograd.attention(query, key, value, causal=causal, scale=scale, mask=mask, score_mod=mod)


def _additive(query, key, attn_mask):
    """The ScoreMod of a float attn_mask broadcastable to (..., H, L, S): (B_m, H_m, L, S) with the batch axes
    flattened, B_m in {1, B}, H_m in {1, H}."""
    if not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be a bool tensor (True: the query sees the key) or a real floating tensor "
                        f"added to the scores, got dtype {attn_mask.dtype}")
    if attn_mask.requires_grad:
        raise ValueError("attn_mask: a float mask that requires grad is not supported (no gradient reaches it)")
    torch_ops.refuse_forward_ad(("attn_mask", attn_mask))
    lead, n_q, n_k = tuple(query.shape[:-2]), query.shape[-2], key.shape[-2]
    full = lead + (n_q, n_k)
    aligned = torch_ops.aligned_mask("attn_mask", attn_mask, full, "query's axes before d, then S")
    heads = lead[-1] if lead else 1
    batch = int(np.prod(lead[:-1])) if len(lead) > 1 else 1
    per_batch = any(n != 1 for n in aligned.shape[:-3])
    if per_batch:
        aligned = aligned.expand(lead[:-1] + tuple(aligned.shape[-3:]))
    per_head = aligned.shape[-3] if aligned.dim() >= 3 else 1
    bias = aligned.reshape(batch if per_batch else 1, per_head, aligned.shape[-2], aligned.shape[-1])
    bias = bias.expand(bias.shape[0], per_head, n_q, n_k)
    return _cached_mod("additive", bias, batch=batch, heads=heads, n_q=n_q, n_k=n_k)


@torch.compiler.disable
def _rows_without_a_key(key, attn_mask):
    """None, or a bool mask broadcastable as attn_mask is that hides every key of each row whose float mask
    holds no finite entry (all -inf: NaN and +inf are refused by the mod). Such a row sees no key, decided by
    the mask structurally as for a bool mask: O = 0, LSE = -inf and zero gradients, as torch SDPA gives;
    through the additive mod alone its weights would be exp(-inf - (-inf)) = NaN. Eager, like the mod: the
    answer depends on the mask's values."""
    alive = torch.isfinite(attn_mask.detach()).any(dim=-1, keepdim=True)
    if bool(alive.all()):
        return None
    return alive.expand(tuple(attn_mask.shape[:-1]) + (key.shape[-2],))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, learnable_sink=None):
    """flash-attn 2's flash_attn_func signature and semantics on fa_numba's kernels.

    Args:
        q: (B, S_q, H, d) torch tensor (float32, float16 or bfloat16).
        k, v: (B, S_k, H_kv, d) and (B, S_k, H_kv, d_v), H_kv dividing H (GQA / MQA; d_v != d as FlashAttention-3
            takes it).
        dropout_p: must be 0.
        softmax_scale: default 1 / sqrt(d).
        causal, window_size: bottom-right aligned: query i sees keys j with i + S_k - S_q - left <= j <=
            i + S_k - S_q + right, -1 unbounded; causal means right = 0.
        softcap: > 0 gives S' = softcap tanh(S / softcap).
        alibi_slopes: (H,) or (B, H): subtracts slope |i + S_k - S_q - j| after the softcap, as flash-attn does
            (a score mod, `mods.conventions.flash_attn`); slopes that require grad get their gradient (a
            learnable ALiBi, by the captured arrays' deterministic kernels).
        deterministic: the backward without atomic adds.
        return_attn_probs: also return the LSE.
        learnable_sink: (H,) float32 tensor, one sink logit per query head (gpt-oss; flash-attn's pull request
            #1819's name): a column every row sees that has no value, differentiable (`fa_numba.attention`'s
            sinks, proofs/L14). The LSE returned then includes it.

    Returns:
        O (B, S_q, H, d_v) in q's dtype, contiguous; with return_attn_probs=True (out, softmax_lse, None): LSE
        (B, H, S_q) float32, and None where flash-attn returns its testing-only S_dmask (fa_numba never
        materialises P).

    Raises:
        ValueError, TypeError, NotImplementedError: each naming the argument (layouts, window_size, alibi_slopes'
        type, dropout, forward-mode AD: the module docstring)."""
    _float_inputs(("q", q), ("k", k), ("v", v))
    _no_dropout(dropout_p)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (B, N, H, d) (flash-attn's layout), got {tuple(x.shape)}")
    mod = None
    if softcap != 0.0 or alibi_slopes is not None:
        if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor of shape (H,) or (B, H), got "
                            f"{type(alibi_slopes).__name__}")
        torch_ops.refuse_forward_ad(("alibi_slopes", alibi_slopes))
        params = dict(softcap=softcap, delta=k.shape[1] - q.shape[1], batch=q.shape[0], heads=q.shape[2])
        if alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled():
            mod = conventions.flash_attn(alibi_slopes, **params)  # learnable: a mod of its own, holding the tensor
        else:
            mod = _cached_mod("flash_attn", alibi_slopes, **params)
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded, got {window_size!r}")
    left, right = (None if w < 0 else w for w in window_size)
    right = 0 if causal else right
    mask = None if (left, right) == (None, None) else masks.sliding_window(left, right)
    out, lse = autograd.attention_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale,
                                           mask=mask, deterministic=bool(deterministic), score_mod=mod,
                                           sinks=learnable_sink)
    out = out.transpose(1, 2).contiguous()
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, learnable_sink=None):
    """flash-attn 2's flash_attn_varlen_func on fa_numba's kernels: B sequences packed along the first axis.

    Args:
        q: (total_q, H, d) torch tensor, the sequences' queries one after another; k, v: (total_k, H_kv, d) and
            (total_k, H_kv, d_v).
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 offsets, sequence t being rows [cu[t], cu[t + 1]); lengths may
            be 0 and may differ between q and k (each sequence aligned bottom-right, as flash-attn).
        max_seqlen_q, max_seqlen_k: at least the longest sequence (flash-attn sizes its grid by them; here they
            are checked, not needed).
        the rest: as `flash_attn_func`, per sequence: alibi_slopes (H,) or (B, H) subtract slope |a + M - L - b| at
            local positions (query a, key b of an L-query, M-key sequence), learnable when they require grad.

    Returns:
        O (total_q, H, d_v) in q's dtype; with return_attn_probs=True (out, softmax_lse (H, total_q) float32, None).

    Packed, not padded: the mask of the offsets (`fa_numba.packed`) gives each row its key interval and each
    tile its kind in closed form, so the kernels visit only the tiles inside some sequence's block, and the
    tensors are read where they are ((total, H, d) is the strided (1, H, total, d) view)."""
    from fa_numba import packed

    _float_inputs(("q", q), ("k", k), ("v", v))
    _no_dropout(dropout_p)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(f"{name} must have shape (total, H, d) (flash-attn's packed layout), got {tuple(x.shape)}")
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded, got {window_size!r}")
    left, right = window_size
    mask = packed.varlen(cu_seqlens_q, cu_seqlens_k, causal=bool(causal), window=(left, -1 if causal else right))
    for name, offsets, bound in (("max_seqlen_q", mask.cu_q, max_seqlen_q), ("max_seqlen_k", mask.cu_k, max_seqlen_k)):
        longest = max(np.diff(offsets), default=0)
        if not isinstance(bound, (int, np.integer)) or isinstance(bound, bool) or bound < longest:
            raise ValueError(f"{name} must be an int >= the longest sequence ({longest}), got {bound!r}")
    mod = None
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor of shape (H,) or (B, H), got "
                            f"{type(alibi_slopes).__name__}")
        torch_ops.refuse_forward_ad(("alibi_slopes", alibi_slopes))
        mod = _varlen_alibi(alibi_slopes, softcap, mask, q.shape[1])
    elif softcap != 0.0:
        mod = _cached_mod("flash_attn", None, softcap=softcap, delta=0, batch=1, heads=q.shape[1])
    as4 = lambda x: x.unsqueeze(0).transpose(1, 2)  # noqa: E731 - (1, H, total, d): a view, no copy
    out, lse = autograd.attention_with_lse(as4(q), as4(k), as4(v), scale=softmax_scale, mask=mask,
                                           deterministic=bool(deterministic), score_mod=mod, sinks=learnable_sink)
    out = out[0].transpose(0, 1).contiguous()
    return (out, lse[0], None) if return_attn_probs else out


def _varlen_flash(score, b, h, i, j, slopes, params, rows):
    cap = params[0]
    s = score * 1.0
    if cap > 0.0:
        s = cap * math.tanh(score / cap)
    return s - slopes[rows[i, 0], h] * abs(i + rows[i, 1] - j)


def _varlen_flash_grad(score, b, h, i, j, slopes, params, rows):
    cap = params[0]
    if cap > 0.0:
        t = math.tanh(score / cap)
        return 1.0 - t * t
    return 1.0


def _varlen_slopes_grad(score, b, h, i, j, slopes, params, rows):
    return (rows[i, 0], h), -1.0 * abs(i + rows[i, 1] - j)


def _varlen_alibi(slopes, softcap, mask, heads: int):
    """flash-attn's softcap and ALiBi over a packed batch as a score mod: row i of sequence t (queries from qs_t,
    keys from ks_t, L_t and M_t of them) subtracts slopes[t or 0, h] |i + (ks_t + M_t - L_t - qs_t) - j|, which is
    |a + M_t - L_t - b| at the sequence's local positions a, b; rows (total_q, 2) int64 holds each row's slope row
    and that shift. Slopes that require grad are kept (learnable, `ScoreMod.learnable`)."""
    from fa_numba import mods

    cap = float(softcap)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no soft cap), got {softcap}")
    sequences = mask.sequences
    table = slopes if slopes.dim() == 2 else slopes.reshape(1, -1)
    if tuple(table.shape) not in ((1, heads), (sequences, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({sequences}, {heads}) (one row per sequence), "
                         f"got {tuple(slopes.shape)}")
    cu_q, cu_k = np.asarray(mask.cu_q, np.int64), np.asarray(mask.cu_k, np.int64)
    t = np.repeat(np.arange(sequences), np.diff(cu_q))  # each packed row's sequence
    shift = cu_k[t] + (cu_k[t + 1] - cu_k[t]) - (cu_q[t + 1] - cu_q[t]) - cu_q[t]
    rows = np.stack([t if table.shape[0] > 1 else np.zeros_like(t), shift], axis=1).astype(np.int64)
    params = np.array([cap, 0.0, 0.0])
    learnable = table.requires_grad and torch.is_grad_enabled()
    captured = (table if learnable else table.detach().to(torch.float64).cpu().numpy(), params, rows)
    grads = (_varlen_slopes_grad, None, None) if learnable else None
    return mods.ScoreMod(_varlen_flash, _varlen_flash_grad, grads, name="alibi(varlen)", captured=captured,
                         captured_names=("slopes", "params", "rows"))
