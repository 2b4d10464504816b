"""fa_numba's kernels as PyTorch operators, so that torch.compile traces a model that calls them.

Three operators, registered with `torch.library.custom_op`:

    fa_numba::attention(q, k, v, causal, scale, order, mask_spec, mask_dense, engine, block_q, block_k,
                        backward_order, deterministic, backward_block, score_mod="", sinks=None) -> (out, lse)
    fa_numba::attention_backward(q, k, v, out, lse, dout, causal, scale, order, deterministic,
                                 mask_spec, mask_dense, block, engine="auto", score_mod="") -> (dq, dk, dv)
    fa_numba::attention_backward_lse(q, k, v, out, lse, dout, dlse, causal, scale, order, deterministic,
                                     mask_spec, mask_dense, block, engine, score_mod, sinks, captured)
                                     -> (dq, dk, dv, dsinks, dcaptured)

Tile sizes are ints, 0 for the default: the shipped tiles of the head dim on a GPU, 16 in the CUDA
simulator (SIMULATOR_TILE), where the shipped tiles cost seconds (forward) to minutes (backward) per
launch; any tile gives a result within the same rule.

Each runs `fa_numba.attention` / `fa_numba.attention_backward` on real tensors (CUDA tensors on their device
and torch's current stream, CPU tensors in Numba's CUDA simulator) and has a fake ("meta") implementation that
gives shapes and dtypes only, which is what torch.compile, torch.export and FakeTensor tracing run. The
forward's autograd formula (`register_autograd`) saves q, k, v, out, lse and calls the backward operator: the
backward recomputes P from LSE, as the eager path does. Outputs are float32 (out, lse, dq, dk, dv), the
kernels' arithmetic; `fa_numba.autograd.attention` casts them to the caller's dtype outside the operator, so
the backward always reads the float32 O the forward computed (its D_i = rowsum(dO_i * O_i) is not rounded).
LSE is differentiable: a loss that reads it gives its cotangent dLSE, which enters the backward as D - dLSE
in D's place (proofs/L14), through a third operator, `fa_numba::attention_backward_lse(..., dlse, ..., sinks)`
-> (dq, dk, dv, dsinks), which also carries learnable sinks (`sinks`, an optional (H,) float32 tensor argument
of `fa_numba::attention`, differentiable). Without either, the backward is `fa_numba::attention_backward`.

A mask crosses the operator boundary as plain data, since an operator takes tensors and scalars only:
`mask_spec` is a built-in mask's text (`masks.parse` reads it back; "" for none) and `mask_dense` a bool
tensor, True where the query sees the key: (N_q, N_k) for one mask (any mask without a text, such as
from_function or from_dense, evaluated once by the caller), or (B_m, H_m, N_q, N_k) with B_m in {1, B} and
H_m in {1, H} for masks that differ by batch or head (SDPA's attn_mask), one launch whose blocks read their
own slice's tile lists (fa_numba.slice_masks). A mask_mod crosses as its key ("mask_mod:doc#2", looked up
weakly as a score mod is, below), so it stays compiled into the kernels and torch.compile traces it.

A score mod (`fa_numba.mods.ScoreMod`) crosses it as its `key`, a text unique to it in this process
("alibi#3"), and the operators look it up (`mods.lookup`). The registry holds the mod weakly: the caller
keeps it alive as long as a call (or a compiled graph) may run it, and the autograd formula holds it from the
forward to the backward; a key whose mod is gone is a clear error, never another mod. A captured array that is
a torch tensor requiring grad (a learnable bias: `ScoreMod.learnable`) is read at every call and gets its
gradient through `fa_numba.autograd`, which then wraps the forward operator in a function whose backward is
`fa_numba::attention_backward_lse` with those tensors as `captured` (the captured arrays' deterministic kernels,
`fa_numba.attention_backward(..., captured_grads=True)`); the operators themselves never see them.

Forward mode: the operators have no JVP formula, and torch would drop a tangent at them without a word (a
zero or missing tangent). So the entry points above them (`fa_numba.autograd.attention`, `fa_numba.sdpa`,
`fa_numba.flash_attn_func`) refuse an input that carries one (`refuse_forward_ad`): a dual tensor of
torch.autograd.forward_ad, or an input of torch.func.jvp or torch.func.jacfwd. Not checked: a direct call
of `attention_op`, and a torch.compile'd function called on dual tensors (the check runs on the trace's fake
tensors, which carry no tangent).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.autograd import forward_ad

from fa_numba import api, backend, masks, mods, shapes, slice_masks

SIMULATOR_TILE = 16  # the default tile in the simulator: 16 threads per block keep a launch to a second or so


def mod_key(score_mod) -> str:
    """The operators' text for a ScoreMod: its `key` ("" for None)."""
    return "" if score_mod is None else score_mod.key


def _score_mod(key: str):
    """The ScoreMod whose key this is (None for ""), or mods.lookup's RuntimeError if it is gone."""
    return mods.lookup(key) if key else None


FORWARD_AD_MESSAGE = ("forward-mode AD (torch.func.jvp, torch.func.jacfwd, torch.autograd.forward_ad dual tensors) "
                      "is not supported by fa_numba's attention: its operators have no JVP formula, and torch would "
                      "return a zero tangent instead of the true one. Use reverse mode: loss.backward() or "
                      "torch.autograd.grad (torch.autograd.functional.jacobian for a Jacobian)")


def refuse_forward_ad(*named) -> None:
    """A NotImplementedError (FORWARD_AD_MESSAGE) if a tensor of the (name, tensor) pairs carries a forward-mode
    tangent at the current dual level (torch.func.jvp and jacfwd make their inputs such duals too); non-tensors
    and plain tensors pass. Checked here, above the operators: torch.library's autograd kernel for them takes
    the no-grad path for a dual tensor (nothing requires grad) and offers no JVP hook."""
    for name, x in named:
        if isinstance(x, Tensor) and forward_ad.unpack_dual(x).tangent is not None:
            raise NotImplementedError(f"{name} carries a forward-mode tangent: {FORWARD_AD_MESSAGE}")


def _tile(block: int):
    """A tile argument for api: block itself, or for 0 the default (None on a GPU, SIMULATOR_TILE in the
    simulator)."""
    if block:
        return block
    return SIMULATOR_TILE if backend.name() == "simulator" else None


def _mask(mask_spec: str, mask_dense: Optional[Tensor]):
    """The mask of the operators' (mask_spec, mask_dense): a bool tensor (2-D, or 4-D per batch and head: one
    launch either way), a mask_mod's key, or a built-in's text."""
    if mask_dense is not None:
        return masks.from_dense(mask_dense.detach().cpu().numpy())
    if mask_spec.startswith(slice_masks.KEY_PREFIX):
        return slice_masks.lookup(mask_spec)
    return masks.parse(mask_spec) if mask_spec else None


@torch.library.custom_op("fa_numba::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, order: str, mask_spec: str,
                 mask_dense: Optional[Tensor], engine: str, block_q: int, block_k: int, backward_order: str,
                 deterministic: bool, backward_block: int, score_mod: str = "", sinks: Optional[Tensor] = None
                 ) -> tuple[Tensor, Tensor]:
    """O and LSE (float32) of softmax(scale Q K^T) V; arguments as fa_numba.attention (score_mod: a
    `mod_key`; sinks: (H,) float32 sink logits or None). backward_order, deterministic and backward_block are
    not the forward's: they say how its autograd formula runs the backward."""
    tiles = dict(block_q=_tile(block_q), block_k=_tile(block_k), score_mod=_score_mod(score_mod))
    return api.attention(q, k, v, causal=causal, scale=scale, order=order, return_lse=True,
                         mask=_mask(mask_spec, mask_dense), engine=engine, sinks=_detached(sinks), **tiles)


def _detached(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.detach()


@attention_op.register_fake
def _attention_fake(q, k, v, causal, scale, order, mask_spec, mask_dense, engine, block_q, block_k, backward_order,
                    deterministic, backward_block, score_mod="", sinks=None):
    return (q.new_empty(shapes.out_shape(q, v), dtype=torch.float32), q.new_empty(q.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("fa_numba::attention_backward", mutates_args=())
def attention_backward_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, causal: bool,
                          scale: float, order: str, deterministic: bool, mask_spec: str,
                          mask_dense: Optional[Tensor], block: int, engine: str = "auto", score_mod: str = ""
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), float32, of sum(dout * attention(q, k, v)); arguments as fa_numba.attention_backward
    (block: its square tile, block_q = block_k; score_mod: a `mod_key`). engine and score_mod default to the
    schema before they existed, so a graph compiled and cached against it still calls this operator correctly."""
    dout = dout.contiguous()
    tiles = dict(block_q=_tile(block), block_k=_tile(block))  # square: what both engines' backwards take
    tiles["score_mod"] = _score_mod(score_mod)
    if engine == "mma" and dout.dtype != q.dtype:  # the tensor cores read dO's 16 bits
        dout = dout.to(q.dtype)
    return api.attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale, order=order,
                                  deterministic=deterministic, mask=_mask(mask_spec, mask_dense), engine=engine,
                                  **tiles)


@attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, out, lse, dout, causal, scale, order, deterministic, mask_spec, mask_dense,
                             block, engine="auto", score_mod=""):
    return tuple(x.new_empty(x.shape, dtype=torch.float32) for x in (q, k, v))


@torch.library.custom_op("fa_numba::attention_backward_lse", mutates_args=())
def attention_backward_lse_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                              dlse: Tensor, causal: bool, scale: float, order: str, deterministic: bool,
                              mask_spec: str, mask_dense: Optional[Tensor], block: int, engine: str, score_mod: str,
                              sinks: Optional[Tensor], captured: list[Tensor]
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, dsinks, dcaptured), float32, of sum(dout * O) + sum(dlse * LSE), LSE with the sinks where
    given (proofs/L14); dsinks (H,), or empty (0,) without sinks. captured: the score mod's learnable tensors
    (`ScoreMod.learnable`, in order), [] for none; dcaptured their gradients, each like its tensor, by the
    captured arrays' deterministic kernels (then dlse must be zero: they compute D from O and dO). Other
    arguments as `attention_backward_op`."""
    dout = dout.contiguous()
    mod = _score_mod(score_mod)
    tiles = dict(block_q=_tile(block), block_k=_tile(block), score_mod=mod)
    if engine == "mma" and dout.dtype != q.dtype:  # the tensor cores read dO's 16 bits
        dout = dout.to(q.dtype)
    more = dict(captured_grads=True) if captured else dict(dlse=dlse.to(torch.float32).contiguous())
    if captured and bool((dlse != 0).any()):
        raise NotImplementedError("a loss that reads LSE with a learnable score mod is not supported: the captured "
                                  "arrays' gradients take D from O and dO alone")
    grads = api.attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale, order=order,
                                   deterministic=deterministic, mask=_mask(mask_spec, mask_dense), engine=engine,
                                   sinks=_detached(sinks), **more, **tiles)
    dsinks = grads[3] if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    dcaptured = [torch.as_tensor(grads[-1][k], dtype=torch.float32).to(t.device).reshape(t.shape)
                 for k, t in zip(mod.learnable, captured)] if captured else []
    return tuple(grads[:3]) + (dsinks, dcaptured)


@attention_backward_lse_op.register_fake
def _attention_backward_lse_fake(q, k, v, out, lse, dout, dlse, causal, scale, order, deterministic, mask_spec,
                                 mask_dense, block, engine, score_mod, sinks, captured):
    return tuple(x.new_empty(x.shape, dtype=torch.float32) for x in (q, k, v)) + (
        q.new_empty((0,) if sinks is None else tuple(sinks.shape), dtype=torch.float32),
        [t.new_empty(t.shape, dtype=torch.float32) for t in captured])


def _setup_context(ctx, inputs, output):
    (q, k, v, causal, scale, order, mask_spec, mask_dense, engine, block_q, block_k, backward_order, deterministic,
     backward_block, score_mod, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask_dense, sinks)
    ctx.set_materialize_grads(False)  # a cotangent the loss does not give stays None: no dLSE pass without one
    ctx.settings = (causal, scale, backward_order, deterministic, mask_spec, backward_block, engine, score_mod)
    ctx.score_mod = _score_mod(score_mod)  # held until the backward: a mod made for one call stays alive
    ctx.mask_mod = _mask(mask_spec, None) if mask_spec.startswith(slice_masks.KEY_PREFIX) else None  # the same


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, mask_dense, sinks = ctx.saved_tensors
    causal, scale, order, deterministic, mask_spec, block, engine, score_mod = ctx.settings
    if dout is None:  # the loss reads LSE alone
        dout = torch.zeros_like(out)
    if sinks is None and dlse is None:
        dq, dk, dv = attention_backward_op(q, k, v, out, lse, dout, causal, scale, order, deterministic, mask_spec,
                                           mask_dense, block, engine, score_mod)
        dsinks = None
    else:
        dlse = torch.zeros_like(lse) if dlse is None else dlse
        dq, dk, dv, dsinks, _ = attention_backward_lse_op(q, k, v, out, lse, dout, dlse, causal, scale, order,
                                                          deterministic, mask_spec, mask_dense, block, engine,
                                                          score_mod, sinks, [])
        dsinks = None if sinks is None else dsinks.to(sinks.dtype)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 12 + (dsinks,)


attention_op.register_autograd(_backward, setup_context=_setup_context)


def mask_arguments(mask, q_shape, n_k: int) -> tuple[str, Optional[Tensor]]:
    """(mask_spec, mask_dense) for q of shape q_shape (..., H, N_q, d) and a mask: a built-in fa_numba.masks
    mask by its text; a bool tensor (True: the query sees the key, SDPA's attn_mask) broadcastable to
    (..., H, N_q, N_k) as (N_q, N_k) if it is one mask for all, else (B_m, H_m, N_q, N_k) (`_bool_mask`);
    any other mask by its answers (`_evaluate`); None as ("", None)."""
    if mask is None:
        return "", None
    if isinstance(mask, Tensor):
        return "", _bool_mask(mask, tuple(q_shape[:-2]), q_shape[-2], n_k)
    if isinstance(mask, slice_masks.MaskMod):  # by its key, as a score mod: compiled into the kernels
        return mask.key, None
    if isinstance(mask, slice_masks.DenseSlices):
        return "", torch.from_numpy(mask.array.copy())
    spec = mask.spec()
    if spec is not None:
        return spec, None
    return "", _evaluate(mask, q_shape[-2], n_k)


def aligned_mask(name: str, mask: Tensor, full: tuple, axes: str) -> Tensor:
    """mask with leading axes of 1 added up to full's rank, or a ValueError naming `name` if it does not
    broadcast to `full` (axes: what full's axes are, for the message)."""
    try:
        fits = mask.dim() <= len(full) and torch.broadcast_shapes(tuple(mask.shape), full) == full
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{name} must be broadcastable to {full} ({axes}), got {tuple(mask.shape)}")
    return mask.reshape((1,) * (len(full) - mask.dim()) + tuple(mask.shape))


def _bool_mask(mask: Tensor, lead: tuple, n_q: int, n_k: int) -> Tensor:
    """A bool mask broadcastable to lead + (N_q, N_k), lead = q.shape[:-2] (its batch axes, then H), as
    (N_q, N_k) when no batch or head axis tells slices apart, else (B_m, H_m, N_q, N_k) with B_m in {1, B},
    H_m in {1, H} (B: the product of the batch axes)."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True: the query sees the key), got dtype {mask.dtype}; a "
                        "float mask added to the scores is a score modification: pass it to fa_numba.sdpa as "
                        "attn_mask, or as score_mod=fa_numba.mods.conventions.additive(...)")
    full = tuple(lead) + (n_q, n_k)
    aligned = aligned_mask("mask", mask, full, "q's axes before d, then N_k")
    per_batch = any(n != 1 for n in aligned.shape[:-3])
    per_head = len(lead) >= 1 and aligned.shape[-3] != 1
    if not (per_batch or per_head):
        return aligned.reshape(aligned.shape[-2:]).expand(n_q, n_k)  # one mask for every slice
    heads = lead[-1] if per_head else 1
    batch_axes = lead[:-1] if per_batch else (1,) * len(lead[:-1])
    return aligned.expand(batch_axes + (heads, n_q, n_k)).reshape(math.prod(batch_axes), heads, n_q, n_k)


@torch.compiler.disable
def _evaluate(mask, n_q: int, n_k: int) -> Tensor:
    """A from_function or from_dense mask's answers on every pair, in eager Python at every call: under
    torch.compile this is a graph break (fullgraph=True refuses it), since tracing it would fix a predicate's
    answers at trace time. Compiled code passes a built-in mask or a bool tensor instead."""
    return torch.from_numpy(np.ascontiguousarray(masks.fixed(mask, n_q, n_k).dense(n_q, n_k), dtype=np.bool_))
