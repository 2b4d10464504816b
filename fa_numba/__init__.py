"""fa_numba: exact FlashAttention (v1 KV-outer and v2 Q-outer loop orders) in Numba CUDA.

Layers, top to bottom (each imports only those above it):
    reference       float64 dense attention and its gradients (the definition), their float32 twins
    tolerance       the derived tolerance rules a float32 result is judged by: terms, baselines, checks
    tolerance_backward  the gradients' rule (3x and the recomputation floors), on tolerance's pieces
    online_softmax  the (m, l, acc) state and its merge / update / finalize
    tiling          tile grid, SKIP / FULL / PARTIAL classification (causal or any mask), block masks, schedules
    masks           causal, sliding window, documents, prefix-LM, from_function / from_dense: predicate,
                    tile classification, row intervals, the form a kernel reads (imports tiling for Kind)
    packed          packed variable-length batches (cu_seqlens) as one mask of the offsets, in closed form
    tiled           the executable NumPy spec of both schedules (and of the backward's two orders), with an HBM ledger;
                    causal or any mask (it visits exactly the block mask's listed tiles)
    iomodel         the same HBM traffic in closed form (forward and backward), summed over the lists for a mask
    kernels         Numba CUDA kernels v1 and v2, and their registry
    arrays          the caller's array library in and out: NumPy, Numba, PyTorch (CPU or CUDA), CuPy
    split_kv        split-KV decoding on the host: the split rule, the combine's NumPy twin, its tolerance
    sinks           learnable sinks: the argument as the entry points read it, and the rule of a result with them
    api             attention(q, k, v, ...): validate, pick tiles, launch, return in the caller's library
    decode          attention_with_kvcache: a few queries over a (paged) cache, split across the keys
    compare, cli    v1 vs v2 side by side (`python -m fa_numba compare | sweep`); timing, plots
    torch_ops       (torch) the kernels as operators fa_numba::attention, ::attention_backward and
                    ::attention_backward_lse (LSE's cotangent, the sinks' gradient)
    autograd        (torch) attention as a differentiable function on those operators
    dropins         (torch) sdpa and flash_attn_func: the signatures of torch SDPA and flash-attn
    ring_model      ring attention's schedule (chunks, pair kinds) and communication model
    distributed     (torch) ring attention over a torch.distributed group, forward and backward

Without an NVIDIA driver, importing fa_numba selects Numba's CUDA simulator (see fa_numba.backend): import
it before numba, or set NUMBA_ENABLE_CUDASIM=1 before numba is imported.
"""

from fa_numba import backend

backend.select()  # before anything imports numba.cuda

from fa_numba import (iomodel, masks, online_softmax, packed, reference, sinks, tiled, tiling,  # noqa: E402
                      tolerance, tolerance_backward)
from fa_numba.api import attention, attention_backward  # noqa: E402
from fa_numba.decode import attention_with_kvcache  # noqa: E402


def __getattr__(name):
    """fa_numba.sdpa, fa_numba.flash_attn_func and fa_numba.flash_attn_varlen_func (fa_numba.dropins), imported
    on first use: they need torch, which `import fa_numba` does not import."""
    if name in ("sdpa", "flash_attn_func", "flash_attn_varlen_func"):
        from fa_numba import dropins

        return getattr(dropins, name)
    raise AttributeError(f"module 'fa_numba' has no attribute {name!r}")


__all__ = ["attention", "attention_backward", "attention_with_kvcache", "backend", "flash_attn_func",
           "flash_attn_varlen_func", "iomodel", "masks", "online_softmax", "packed",
           "reference", "sdpa", "sinks", "tiled", "tiling", "tolerance", "tolerance_backward"]
__version__ = "0.1.0"
