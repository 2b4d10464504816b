"""Which compute units a call runs on: `engine="simt"` (the FP32 CUDA-core kernels of the registry),
`engine="mma"` (the tensor-core kernels, `kernels.mma`) or `engine="auto"`.

`auto` takes the CUDA-core kernels today for every input: the tensor-core forward does not yet cover what
the registry's kernels do (block-mask lists, float32 by 3xTF32), and its results
carry one more rounding (P in 16 bits, proofs/L6 part 7), so a silent switch would change what existing
callers get. Ask for `engine="mma"` to run it; an input or option it does not take is a ValueError that says
which, never a quiet fallback.
"""

from __future__ import annotations

ENGINES = ("auto", "simt", "mma")
MMA_KINDS = ("float16", "bfloat16")
MMA_ORDERS = ("v1", "v2")
MMA_MAX_HEAD_DIM = 128


def resolve(engine: str, *, kind: str, order: str, form: str, head_dim: int) -> str:
    """"simt" or "mma" for a forward call, or a ValueError naming what the tensor-core engine lacks."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine != "mma":
        return "simt"
    if order not in MMA_ORDERS:
        raise ValueError(f"engine='mma' runs orders {MMA_ORDERS} (not the one-thread-per-row kernels), got "
                         f"order={order!r}")
    _check_mma(kind, form, head_dim, "kernel")
    return "mma"


def _check_mma(kind: str, form: str, head_dim: int, what: str) -> None:
    """What every tensor-core kernel needs of a call: a 16-bit dtype, causal or no mask, d <= 128."""
    if kind not in MMA_KINDS:
        raise ValueError(f"engine='mma' takes float16 or bfloat16 inputs (float32 on tensor cores, 3xTF32, is "
                         f"not built yet), got {kind}; use engine='simt' for {kind}")
    if form not in ("none", "causal"):
        raise ValueError(f"engine='mma' takes causal=True or no mask (block-mask lists are not built yet for "
                         f"the tensor-core {what}); use engine='simt' for this mask")
    if head_dim > MMA_MAX_HEAD_DIM:
        raise ValueError(f"engine='mma' needs head dim d <= {MMA_MAX_HEAD_DIM}, got {head_dim}")


def mma_tiles(head_dim: int, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """(warps, block_k) of the tensor-core kernel: block_q = 16 warps (default 64), block_k a multiple of 16
    (default 64 for d <= 64, else 32: under 48 KB of shared memory)."""
    block_q = 64 if block_q is None else block_q
    block_k = (64 if head_dim <= 64 else 32) if block_k is None else block_k
    if block_q not in (16, 32, 64, 128):
        raise ValueError(f"block_q must be 16, 32, 64 or 128 for engine='mma' (16 query rows per warp), got "
                         f"{block_q}")
    if block_k <= 0 or block_k % 16:
        raise ValueError(f"block_k must be a positive multiple of 16 for engine='mma', got {block_k}")
    return block_q // 16, block_k


def backward(engine: str, *, kind: str | None = None, order: str = "kv", form: str = "none",
             head_dim: int = 0) -> str:
    """"simt" or "mma" for a backward call, or a ValueError naming what the tensor-core backward lacks.
    kind None checks the engine's name only (callers that know the inputs later ask again)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine != "mma" or kind is None:
        return "simt" if engine != "mma" else "mma"
    if order != "kv":
        raise ValueError(f"engine='mma' runs the K/V-outer backward (order='kv', deterministic or not), got "
                         f"order={order!r}")
    _check_mma(kind, form, head_dim, "backward")
    return "mma"


def decode(engine: str) -> None:
    """The decode kernels' engine: the CUDA-core split and combine kernels; engine='mma' is refused until a
    tensor-core split kernel exists (the split kernel is built on the CUDA-core tile engine)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "mma":
        raise NotImplementedError("engine='mma': the tensor-core decode kernel is not built yet; use engine='simt' "
                                  "or 'auto' (both run the CUDA-core split-KV kernels)")
