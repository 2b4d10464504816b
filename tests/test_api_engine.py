"""fa_numba.attention(..., engine=): "simt" the CUDA-core kernels, "mma" the tensor-core forward, "auto" (the
tensor cores for 16-bit inputs they take as they are, the CUDA cores otherwise: fa_numba.engines); what the
tensor-core engine does not take is refused by name."""

import numpy as np
import pytest

import fa_numba
from fa_numba import tolerance

ml_dtypes = pytest.importorskip("ml_dtypes")  # a test dependency (setup.cfg): bfloat16 NumPy arrays


def _inputs(dtype, n_q=24, n_k=40, d=16, heads=2, heads_kv=1, seed=0):
    rng = np.random.default_rng(seed)
    sizes = ((heads, n_q), (heads_kv, n_k), (heads_kv, n_k))
    return [rng.standard_normal((1, h, n, d)).astype(dtype) for h, n in sizes]


@pytest.mark.parametrize("dtype,kind,order", [
    (np.float16, "float16", "v2"),
    pytest.param(ml_dtypes.bfloat16, "bfloat16", "v2", marks=pytest.mark.slow),  # seconds each in the simulator
    pytest.param(np.float16, "float16", "v1", marks=pytest.mark.slow)])
def test_engine_mma_runs_the_tensor_core_forward_within_its_rule(dtype, kind, order):
    q, k, v = _inputs(dtype)
    out, lse = fa_numba.attention(q, k, v, causal=True, engine="mma", block_q=16, block_k=16, return_lse=True,
                                  order=order)
    assert out.dtype == np.float32 and out.shape == q.shape
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    tolerance.check_attention(out, lse, q64, k64, v64, causal=True, name=f"attention(engine='mma') {kind}",
                              order=order, block_q=16, block_k=16, p_dtype=kind)


def test_engine_auto_takes_the_tensor_cores_for_16_bit_inputs_they_take_and_the_cuda_cores_otherwise():
    """fa_numba.engines' rule, forward: float16 with tiles mma.sync takes is engine="mma" bit for bit; tiles it
    does not take (block_q = 8), a one-thread-per-row order and float32 are engine="simt" bit for bit."""
    q, k, v = _inputs(np.float16, n_q=16, n_k=16, heads=1)
    mma = fa_numba.attention(q, k, v, causal=True, block_q=16, block_k=16, engine="mma")
    np.testing.assert_array_equal(fa_numba.attention(q, k, v, causal=True, block_q=16, block_k=16), mma)
    for kwargs in (dict(block_q=8, block_k=8), dict(order="v2-rowwise")):
        simt = fa_numba.attention(q, k, v, causal=True, engine="simt", **kwargs)
        assert not np.array_equal(simt, mma)  # the engines differ on this input (P's rounding) ...
        np.testing.assert_array_equal(fa_numba.attention(q, k, v, causal=True, **kwargs), simt)  # ... auto is simt
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    np.testing.assert_array_equal(fa_numba.attention(q32, k32, v32, block_q=16, block_k=16),
                                  fa_numba.attention(q32, k32, v32, block_q=16, block_k=16, engine="simt"))


@pytest.mark.slow
def test_engine_auto_in_the_backward_follows_dout_and_the_order():
    """Backward: 16-bit dout in q's dtype, order "kv": the tensor cores bit for bit; a float32 dout or order "q":
    the CUDA cores bit for bit."""
    q, k, v = _inputs(np.float16, n_q=16, n_k=16, heads=1)
    out, lse = fa_numba.attention(q, k, v, causal=True, block_q=16, block_k=16, return_lse=True)
    dout = np.random.default_rng(3).standard_normal(q.shape).astype(np.float16)
    kw = dict(causal=True, block_q=16, block_k=16)
    for got, want in zip(fa_numba.attention_backward(q, k, v, out, lse, dout, **kw),
                         fa_numba.attention_backward(q, k, v, out, lse, dout, engine="mma", **kw)):
        np.testing.assert_array_equal(got, want)
    for dout_, order in ((dout.astype(np.float32), "kv"), (dout, "q")):
        for got, want in zip(fa_numba.attention_backward(q, k, v, out, lse, dout_, order=order, **kw),
                             fa_numba.attention_backward(q, k, v, out, lse, dout_, order=order, engine="simt", **kw)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kwargs,message", [
    (dict(order="v2-rowwise"), "engine='mma' runs orders"),
    (dict(block_q=24), "block_q must be 16, 32, 64 or 128 for engine='mma'"),
    (dict(block_k=24), "block_k must be a positive multiple of 16 for engine='mma'"),
    (dict(engine="tensor"), "engine must be one of"),
])
def test_engine_mma_refuses_what_it_does_not_take(kwargs, message):
    kwargs = dict(kwargs)
    q, k, v = _inputs(kwargs.pop("dtype", np.float16))
    kwargs.setdefault("engine", "mma")
    with pytest.raises(ValueError, match=message):
        fa_numba.attention(q, k, v, **kwargs)


def test_the_tensor_core_backward_refuses_what_it_does_not_take_by_name():
    """float32 inputs under plain TF32 (a forward only), the Q-outer order, d > 128: each a ValueError naming it,
    before anything is read (the kernels themselves: tests/test_mma_backward.py)."""
    q, k, v = _inputs(np.float32, n_q=8, n_k=8, heads=1)
    out, lse = np.zeros_like(q), np.zeros(q.shape[:-1], np.float32)
    with pytest.raises(ValueError, match="engine='mma-tf32' has no backward"):
        fa_numba.attention_backward(q, k, v, out, lse, np.ones_like(q), engine="mma-tf32")
    h = q.astype(np.float16)
    with pytest.raises(ValueError, match="runs the K/V-outer backward"):
        fa_numba.attention_backward(h, h, h, out, lse, h, engine="mma", order="q")
    with pytest.raises(TypeError, match="dout must have q's dtype float16"):
        fa_numba.attention_backward(h, h, h, out, lse, np.ones_like(q), engine="mma")
    torch = pytest.importorskip("torch")
    from fa_numba import autograd

    t = torch.from_numpy(q).requires_grad_()
    with pytest.raises(ValueError, match="engine='mma-tf32' runs float32 inputs' forward only"):
        autograd.attention(t, t, t, engine="mma-tf32")
