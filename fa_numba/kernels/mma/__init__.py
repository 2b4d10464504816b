"""The tensor-core kernels: FlashAttention on mma.sync (fa_numba.warp), 16-bit inputs.

`engine_v2`: the Q-outer forward (FlashAttention-2's order) for float16 and bfloat16. Not yet in the
registry (`fa_numba.kernels.VARIANTS`): its tiles are multiples of 16 where the registry's tests draw any
size, and it has no block-mask lists yet; tests/test_mma_forward.py checks it on its own cases.
"""
