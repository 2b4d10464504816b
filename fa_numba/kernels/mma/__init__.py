"""The tensor-core kernels: FlashAttention on mma.sync (fa_numba.warp), float16 and bfloat16 inputs.

`engine`: what both orders are made of (the configuration, staging, the fold of one key tile into a warp's
rows, the launch); `engine_v2`: the Q-outer forward (FlashAttention-2's order); `engine_v1`: the K/V-outer
forward (Algorithm 1, O, l and m through HBM). `fa_numba.attention(..., engine="mma")` runs them. Not yet in
the registry (`fa_numba.kernels.VARIANTS`): their tiles are multiples of 16 where the registry's tests draw
any size, and they have no block-mask lists yet; tests/test_mma_forward.py checks them on their own cases.
"""
