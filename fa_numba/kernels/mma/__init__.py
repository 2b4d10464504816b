"""The tensor-core kernels: FlashAttention on mma.sync (fa_numba.warp), float16 and bfloat16 inputs, and
float32 inputs by 3xTF32 (or plain TF32, an opt-in).

`engine`: what both orders are made of (the configuration, the fold of one key tile into a warp's rows);
`staging`: tiles into shared memory by plain loads or cp.async, any row width, contiguous or strided;
`launch`: the checks and launch both orders share (`MmaKernel`); `products16`: the 16-bit products; `tf32`:
the float32 inputs' products (the split into tf32 parts, three m16n8k8 per product); `masking`: causal closed forms and block-mask lists; `engine_v2`: the Q-outer forward
(FlashAttention-2's order); `engine_v1`: the K/V-outer forward (Algorithm 1, O, l and m through HBM);
`backward`: the backward's configuration and launches, its kernels in `backward_kv` (K/V outer) and `backward_dq`
(the deterministic dQ pass), `backward_tf32` the K/V-outer kernel's products on float32 inputs (3xTF32).
`fa_numba.attention(..., engine="mma")` runs them; the registry
holds them as v1-mma and v2-mma (`kernels.mma_variant` gives them the registry's call shape), so `compare` runs
them beside the CUDA-core kernels; tests/test_mma_forward.py and test_mma_tf32.py check them on their own cases
and tests/test_registry_mma.py through the registry.
"""
