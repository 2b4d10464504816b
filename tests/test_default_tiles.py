"""Every tensor-core configuration a call without tiles builds is one its kernels take.

The first H200 session (2026-12-04) found `attention_backward(float32, engine="mma", deterministic=True)` raising at
its default tiles: the deterministic dq pass took the 16-bit table (64 x 64 at d = 64, over 48 KB of shared memory).
The simulator tests had all passed tiles. These build, without launching, what the api builds by default
(engines.mma_tiles for the forwards, mma.backward.plan for the backward) over kinds, orders, head dims, causal and
deterministic, so a default that a kernel refuses fails here.
"""

import pytest

from fa_numba import engines
from fa_numba.kernels.mma import backward as mma_backward
from fa_numba.kernels.mma.engine_v1 import make_v1_mma
from fa_numba.kernels.mma.engine_v2 import make_v2_mma

HEAD_DIMS = [1, 8, 16, 24, 40, 56, 64, 72, 96, 100, 128]
WIDE = [136, 160, 176, 192]  # the 16-bit forwards only


@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float32", "tf32"])
@pytest.mark.parametrize("order", ["v1", "v2"])
def test_the_forward_defaults_build(kind, order):
    make = make_v1_mma if order == "v1" else make_v2_mma
    for d in HEAD_DIMS + (WIDE if kind in engines.MMA_KINDS else []):
        warps, block_k, row_blocks = engines.mma_tiles(d, None, None, kind, order)
        rows = {"row_blocks": row_blocks} if row_blocks != 1 else {}  # as the api passes it
        assert row_blocks == (2 if order == "v2" and kind in engines.MMA_KINDS and d <= 64 else 1)
        for causal in (False, True):
            kernel = make(kind, warps, block_k, d, causal, value_dim=d, **rows)
            assert (kernel.config.warps, kernel.config.block_k, kernel.config.row_blocks) == (warps, block_k,
                                                                                               row_blocks)
    if kind in engines.MMA_KINDS:  # MLA's d_qk = 192, d_v = 128, natively
        warps, block_k, row_blocks = engines.mma_tiles(192, None, None, kind, order)
        assert row_blocks == 1
        make(kind, warps, block_k, 192, True, value_dim=128)


@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float32"])
def test_the_backward_defaults_build(kind):
    for d in HEAD_DIMS:
        for causal in (False, True):
            for deterministic in (False, True):
                kernels = mma_backward.plan(kind, d, causal, deterministic)
                assert [side for _, side in kernels] == (["kv", "q"] if deterministic else ["kv"])
    if kind != "float32":  # d_v != d natively for 16-bit inputs
        for d, d_v in ((128, 64), (64, 128), (96, 32)):
            mma_backward.plan(kind, d, True, True, value_dim=d_v)


@pytest.mark.lemma("L7")
def test_the_16_bit_backward_at_a_head_dim_its_default_warps_did_not_split_passes_the_rule():
    """d = 72 (10 8-column blocks): the kv kernel's 4 warps per dQ slice became 2 (16 x 32), and the call that raised
    before now runs, within the gradients' rule with the 16-bit terms."""
    import numpy as np

    import fa_numba
    from fa_numba import reference, tolerance_backward

    rng = np.random.default_rng(72)
    q, k, v, dout = (rng.standard_normal((1, 1, 20, 72)).astype(np.float16) for _ in range(4))
    exact = [x.astype(np.float64) for x in (q, k, v, dout)]
    out, lse = reference.attention(*exact[:3], causal=True)
    grads = fa_numba.attention_backward(q, k, v, out.astype(np.float32), lse.astype(np.float32), dout, causal=True,
                                        engine="mma")
    tolerance_backward.check_attention_backward(*grads, *exact, causal=True, p_dtype="float16",
                                                contractions=("matmul",), name="bwd-kv-mma d=72")


def test_the_cuda_core_and_decode_defaults_build():
    """The CUDA-core kernels' default tiles (kernels.default_tiles, the backward's default_backward_tiles) for every
    head dim they take, and the tensor-core decode kernel's configuration for every row count it packs."""
    from fa_numba.kernels import SIMT_VARIANTS, VARIANTS, backward, default_tiles
    from fa_numba.kernels.common import MAX_HEAD_DIM
    from fa_numba.kernels.mma.decode import MAX_DECODE_HEAD_DIM, decode_split

    for d in range(1, MAX_HEAD_DIM + 1):
        block_q, block_k = default_tiles(d)
        for name in SIMT_VARIANTS:
            for causal in (False, True):
                assert VARIANTS[name].refusal(block_q, block_k, d, causal) is None, (name, d)
        block = backward.default_backward_tiles(d)[0]
        for order in ("kv", "q"):
            backward.BackwardConfig(order, block, d, True).check()
    for kind in ("float16", "bfloat16"):
        for d in range(8, MAX_DECODE_HEAD_DIM + 1, 8):
            for rows in (1, 4, 8, 16, 17, 64, 128):
                decode_split(kind, rows, d)
