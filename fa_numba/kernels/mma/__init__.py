"""The tensor-core kernels: FlashAttention on mma.sync (fa_numba.warp), float16 and bfloat16 inputs.

`engine`: what both orders are made of (the configuration, staging, the fold of one key tile into a warp's
rows, the launch); `engine_v2`: the Q-outer forward (FlashAttention-2's order); `engine_v1`: the K/V-outer
forward (Algorithm 1, O, l and m through HBM). `fa_numba.attention(..., engine="mma")` runs them; the
registry holds them as v1-mma and v2-mma (`kernels.mma_variant` gives them the registry's call shape), so
`compare` runs them beside the CUDA-core kernels on 16-bit shapes; tests/test_mma_forward.py checks them on
their own cases and tests/test_registry_mma.py through the registry.
"""
