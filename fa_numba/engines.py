"""Which compute units a call runs on: `engine="simt"` (the FP32 CUDA-core kernels of the registry),
`engine="mma"` (the tensor-core kernels, `kernels.mma`), `engine="mma-tf32"` (float32 inputs on tensor cores
by one TF32 product: an opt-in, not float32-exact) or `engine="auto"`.

`auto` takes the tensor cores for float16 and bfloat16 inputs wherever the tensor-core kernels take the call as
it is, and the CUDA cores otherwise:
- forward: order "v1" or "v2", d <= 192 (float16 / bfloat16; float32 d <= 128), the tiles asked for (if any)
  valid for mma.sync (block_q 16, 32, 64 or 128; block_k a multiple of 16) and within 48 KB of shared memory;
  any mask, any score mod;
- backward: the same dtype for dout as for q, order "kv" (deterministic or not), d <= 128, tiles the
  tensor-core backward takes (`kernels.mma.backward.plan`).
Decoding (`decode`): auto takes the tensor-core split kernel for float16 and bfloat16 inputs with d a multiple of
8 up to 128 and rows 16-byte aligned, the CUDA-core one otherwise. float32 inputs take the CUDA cores under
`auto`. `engine="mma"` runs float32 inputs' forward on tensor cores by 3xTF32 (kernels.mma.tf32: three TF32
products per product, within the float32 rule with the term of proofs/L6 part 9) and their backward too
(kernels.mma.backward_tf32: the K/V-outer kernel with atomic dQ or, deterministic, its dq pass, within the
gradients' rule with the term of proofs/L7's 3xTF32 part), `engine="mma-tf32"` by one
(about 2^-10 relative per product: for speed where that is acceptable, as torch's allow_tf32), forward only (a
ValueError says so). The 16-bit tensor-core results carry the rounding of P (and, backward, dS) to the inputs'
16-bit type before their products (proofs/L6 part 7, L7), as FlashAttention's own 16-bit kernels do; `engine="simt"`
keeps P in float32. `engine="mma"` asks for the tensor cores outright: a call they do not take is a ValueError that
says why, never a quiet fallback.
"""

from __future__ import annotations

ENGINES = ("auto", "simt", "mma", "mma-tf32")
MMA_KINDS = ("float16", "bfloat16")  # the 16-bit inputs: forward and backward, and auto's choice
# float32 inputs run the forward on tensor cores as kernel kind "float32" (3xTF32) or "tf32" ("mma-tf32"):
# kernels.mma.tf32.FLOAT32_KINDS, the kernels' kinds on float32 inputs
MMA_ORDERS = ("v1", "v2")


def resolve(engine: str, *, kind: str, order: str, head_dim: int, block_q: int | None = None,
            block_k: int | None = None) -> str:
    """"simt" or "mma" for a forward call (auto: the module docstring), or a ValueError naming what the
    tensor-core engine lacks for engine="mma"."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "auto":
        if kind not in MMA_KINDS:
            return "simt"  # float32: the CUDA cores, unless asked for (3xTF32 is slower than fp16, still exact)
        return "mma" if _takes(lambda: _forward_fits(kind, order, head_dim, block_q, block_k)) else "simt"
    if engine == "simt":
        return "simt"
    if order not in MMA_ORDERS:
        raise ValueError(f"engine={engine!r} runs orders {MMA_ORDERS} (not the one-thread-per-row kernels), got "
                         f"order={order!r}")
    _check_mma(mma_kind(engine, kind), head_dim)
    return "mma"


def mma_kind(engine: str, kind: str) -> str:
    """The tensor-core kernel's kind for inputs of `kind` under `engine` ("mma" or "mma-tf32"): the 16-bit kinds
    as they are, "float32" (3xTF32) for float32 inputs, "tf32" for float32 inputs under "mma-tf32"."""
    if engine == "mma-tf32":
        if kind != "float32":
            raise ValueError(f"engine='mma-tf32' multiplies float32 inputs by one TF32 product; got {kind} inputs "
                             f"(use engine='mma' for them)")
        return "tf32"
    return kind


def _takes(check) -> bool:
    """Whether check() passes: a ValueError (or TypeError) is a call the tensor cores do not take as it is."""
    try:
        check()
    except (ValueError, TypeError):
        return False
    return True


def _forward_fits(kind, order, head_dim, block_q, block_k) -> None:
    """A ValueError where the tensor-core forward does not take the call as it is (resolve's "auto")."""
    from fa_numba.kernels.mma.engine import MmaConfig

    if order not in MMA_ORDERS:
        raise ValueError(order)
    _check_mma(kind, head_dim)
    warps, block_k, row_blocks = mma_tiles(head_dim, block_q, block_k, kind, order)
    # shared memory (the same for every mask)
    MmaConfig(kind, warps, block_k, head_dim, False, row_blocks=row_blocks).check()


def _check_mma(kind: str, head_dim: int, backward: bool = False) -> None:
    """What every tensor-core kernel needs of a call: a kind it multiplies (the kernel's: 16-bit, or forward
    "float32" / "tf32"), d <= 192 (the 16-bit forward) or 128 (the backward, the float32 forward); every mask
    form is taken."""
    if backward and kind not in MMA_KINDS + ("float32",):
        raise ValueError(f"engine='mma' runs the backward for float16, bfloat16 or float32 (3xTF32) inputs, got "
                         f"{kind}; use engine='simt' for its backward")
    if kind not in MMA_KINDS + ("float32", "tf32"):  # the 16-bit kinds, 3xTF32, plain TF32
        raise ValueError(f"engine='mma' takes float16, bfloat16 or float32 inputs, got {kind}; use engine='simt' "
                         f"for {kind}")
    from fa_numba.kernels.mma.engine import MAX_FORWARD_HEAD_DIM, MAX_HEAD_DIM  # the kernels' own limits

    limit = MAX_FORWARD_HEAD_DIM if kind in MMA_KINDS and not backward else MAX_HEAD_DIM
    if head_dim > limit:
        what = "the backward" if backward else f"{kind} inputs"
        raise ValueError(f"engine='mma' needs head dim d <= {limit} for {what}, got {head_dim}")


def mma_tiles(head_dim: int, block_q: int | None, block_k: int | None, kind: str = "float16",
              order: str = "v2", plain: bool = True) -> tuple[int, int, int]:
    """(warps, block_k, row_blocks) of the tensor-core kernel: block_q = 16 warps row_blocks (default 64; 128
    for v2 on float32 inputs, and for a plain v2 on 16-bit inputs up to d = 64), block_k a
    multiple of 16 (default 64 for d <= 64, 32 for d <= 128, 16 above: under 48 KB of shared memory; half that
    for the float32 kinds, whose tiles hold two tf32 parts of each element).

    v2's 128-row tiles on 16-bit inputs take FlashAttention-2's layout: 4 warps of two m16 row blocks each
    (MmaConfig.row_blocks), so every K_j and V_j fragment a warp reads from shared memory feeds two products.
    `plain`: no score mod and no block mask compiled in (the closed forms, none or causal, only): a mod's or a
    dense mask's registers on top of two row blocks' spill (the softcap and dense-mask builds at d = 64), so
    those builds keep one row block a warp, 64 rows by default (`kernels.mma.engine.row_blocks_for`).
    Above d = 64 two row blocks spill (and a 128-row tile's Q_i, K_j and V_j exceed the 48 KB static budget):
    block_q = 128 means 8 warps of one row block, as it does on float32 inputs: their tiles are shared by 8 warps
    since a block stages and splits K_j and V_j once for 128 rows (half the staging per query row of 64-row
    blocks). v1's blocks own a K/V tile and loop over query tiles: one row block a warp, 64 rows by default."""
    from fa_numba.kernels.mma.engine import row_blocks_for

    if block_q is None:
        wide = kind not in MMA_KINDS or row_blocks_for(order, kind, 128, head_dim, plain) == 2
        block_q = 128 if order == "v2" and wide else 64
    if block_k is None:
        block_k = 64 if head_dim <= 64 else 32 if head_dim <= 128 else 16
        if kind not in MMA_KINDS:
            block_k //= 2
    if block_q not in (16, 32, 64, 128):
        raise ValueError(f"block_q must be 16, 32, 64 or 128 for engine='mma' (16 query rows a warp, or 32 in two row blocks), got "
                         f"{block_q}")
    if block_k <= 0 or block_k % 16:
        raise ValueError(f"block_k must be a positive multiple of 16 for engine='mma', got {block_k}")
    row_blocks = row_blocks_for(order, kind, block_q, head_dim, plain)
    return block_q // (16 * row_blocks), block_k, row_blocks


def backward(engine: str, *, kind: str | None = None, order: str = "kv", head_dim: int = 0,
             dout_kind: str | None = None, causal: bool = False, deterministic: bool = False,
             block_q: int | None = None, block_k: int | None = None) -> str:
    """"simt" or "mma" for a backward call (auto: the module docstring), or a ValueError naming what the
    tensor-core backward lacks for engine="mma". kind None checks the engine's name only (callers that know
    the inputs later ask again: "auto" is then returned as it is)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if kind is None:
        return engine
    if engine == "auto":
        def fits():
            from fa_numba.kernels.mma.backward import plan

            if order != "kv" or dout_kind not in (None, kind) or kind not in MMA_KINDS:
                raise ValueError(order)  # float32 inputs: the CUDA cores under auto, as the forward's
            _check_mma(kind, head_dim, backward=True)
            plan(kind, head_dim, causal, deterministic, block_q, block_k)
        return "mma" if _takes(fits) else "simt"
    if engine == "simt":
        return "simt"
    if engine == "mma-tf32":
        raise ValueError("engine='mma-tf32' has no backward (one TF32 product per product is not float32-grade): "
                         "engine='mma' runs the float32 backward by 3xTF32, engine='simt' on the CUDA cores")
    if order != "kv":
        raise ValueError(f"engine='mma' runs the K/V-outer backward (order='kv', deterministic or not), got "
                         f"order={order!r}")
    _check_mma(kind, head_dim, backward=True)
    return "mma"


def decode(engine: str, *, kind: str | None = None, head_dim: int = 0, block_k: int | None = None,
           aligned: bool = True, value_dim: int = 0) -> str:
    """"simt" or "mma" for a decoding call (`attention_with_kvcache`): the tensor-core split kernel
    (kernels.mma.decode) takes float16 and bfloat16 inputs with d and d_v (value_dim; 0: d) multiples of 8 up to
    128, rows 16-byte aligned
    (`aligned`) and block_k (if given) a multiple of 16 whose two pipeline stages fit 48 KB; `auto` takes it
    wherever it takes the call, the CUDA-core split kernel otherwise; `mma` asks for it outright (a ValueError
    says why it does not take the call). kind None checks the engine's name only."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if kind is None or engine == "simt":
        return engine
    if engine == "mma-tf32":
        raise ValueError("engine='mma-tf32' has no decode kernel (the tensor-core decode kernel takes float16 and "
                         "bfloat16); use engine='simt' for float32 decoding")

    def check():
        from fa_numba.kernels.mma.decode import decode_split

        if kind not in MMA_KINDS:
            raise ValueError(f"engine='mma' decodes float16 or bfloat16 inputs (no float32 decode kernel on tensor "
                             f"cores), got {kind}; use engine='simt'")
        if not aligned:
            raise ValueError("engine='mma' decodes from caches and q whose rows start on 16-byte boundaries (its "
                             "cp.async copies); these are not: use engine='simt'")
        decode_split(kind, 1, head_dim, block_k, value_dim)  # d, d_v and the tiles

    if engine == "auto":
        return "mma" if _takes(check) else "simt"
    check()
    return "mma"
