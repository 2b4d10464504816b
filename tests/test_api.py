"""`fa_numba.attention`: host and device arrays, layouts, defaults, and errors before any launch."""

import numpy as np
import pytest
from numba import cuda

import fa_numba
from fa_numba import tolerance
from fa_numba.kernels import VARIANTS, default_tiles
from strategies import Case

SMALL = dict(block_q=4, block_k=4)


@pytest.mark.parametrize("order", ["v1", "v2"])
def test_numpy_in_numpy_out_in_every_layout(order):
    q, k, v = Case(n_q=5, n_k=6, d=3, block_q=4, block_k=4, causal=True, heads_kv=1, group=2).inputs(np.float32)
    out4, lse4 = fa_numba.attention(q, k, v, causal=True, order=order, return_lse=True, **SMALL)
    assert isinstance(out4, np.ndarray) and out4.shape == q.shape and out4.dtype == np.float32
    assert lse4.shape == q.shape[:-1]
    tolerance.check_attention(out4, lse4, q, k, v, causal=True, order=order, **SMALL)
    out3 = fa_numba.attention(q[0], k[0], v[0], causal=True, order=order, **SMALL)
    out2 = fa_numba.attention(q[0, 1], k[0, 0], v[0, 0], causal=True, order=order, **SMALL)
    assert out3.shape == (2, 5, 3) and out2.shape == (5, 3)
    np.testing.assert_array_equal(out3, out4[0])
    np.testing.assert_array_equal(out2, out4[0, 1])


def test_device_arrays_in_device_arrays_out():
    q, k, v = Case(n_q=4, n_k=4, d=2, block_q=4, block_k=4, causal=False).inputs(np.float32)
    dq, dk, dv = (cuda.to_device(x[0]) for x in (q, k, v))
    out, lse = fa_numba.attention(dq, dk, dv, return_lse=True, **SMALL)
    assert not isinstance(out, np.ndarray) and hasattr(out, "copy_to_host")
    assert tuple(out.shape) == (1, 4, 2) and tuple(lse.shape) == (1, 4)
    tolerance.check_attention(out.copy_to_host(), lse.copy_to_host(), q[0], k[0], v[0], order="v2", **SMALL)


def test_defaults_scale_and_tiles():
    q, k, v = Case(n_q=3, n_k=3, d=4, block_q=1, block_k=1, causal=False).inputs(np.float32)
    default = fa_numba.attention(q, k, v, **SMALL)
    explicit = fa_numba.attention(q, k, v, scale=0.5, **SMALL)
    np.testing.assert_array_equal(default, explicit)  # 1/sqrt(4) = 0.5
    assert default_tiles(32) == (64, 64) and default_tiles(64) == (64, 32) and default_tiles(128) == (64, 16)
    assert default_tiles(256) == (16, 16)
    for d in range(1, 257):  # every registered kernel takes the default tiles of every head dim it takes: every d
        for variant in VARIANTS.values():  # for the CUDA-core ones; the tensor-core ones d <= 192 (16-bit), 128
            tiles = default_tiles(d)
            if variant.unit == "mma" and d > 192:
                assert "head dim d must be in 1..192" in variant.refusal(*tiles, d, True, dtype="float16")
            elif variant.unit == "mma" and d > 128:
                assert variant.refusal(*tiles, d, True, dtype="float16") is None
                assert "head dim d must be in 1..128" in variant.refusal(*tiles, d, True, dtype="float32")
            else:
                assert variant.config(*default_tiles(d), d, True).shared_bytes <= 48 * 1024


def test_float16_inputs_give_float32_outputs():
    q, k, v = Case(n_q=6, n_k=7, d=4, block_q=4, block_k=4, causal=True).inputs(np.float16)
    out, lse = fa_numba.attention(q, k, v, causal=True, return_lse=True, **SMALL)
    assert out.dtype == np.float32
    tolerance.check_attention(out, lse, q, k, v, causal=True, order="v2", **SMALL)


def _qkv(dtype=np.float32, d=8):
    return (np.zeros((2, 5, d), dtype), np.zeros((2, 5, d), dtype), np.zeros((2, 5, d), dtype))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(order="v3"), ValueError, r"order must be one of"),
    (dict(block_q=0), ValueError, r"block_q must be a positive int"),
    (dict(block_k=2.5), TypeError, r"block_k must be a positive int"),
    (dict(block_k=4096), ValueError, r"block_q x block_k / \(tm x tn\) = 16384 threads per block, over 1024"),
    (dict(block_k=4096, order="v2-rowwise"), ValueError, r"block_k = 4096 with d = 8 needs 262144 bytes of shared"),
    (dict(block_q=2048, order="v2-rowwise"), ValueError, r"block_q is the threads per block and must be <= 1024"),
    (dict(order="v2-fast"), ValueError, r"order must be one of \('v1', 'v2', 'v1-rowwise', 'v2-rowwise'\)"),
    (dict(causal=1), TypeError, r"causal must be a bool"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
])
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        fa_numba.attention(*_qkv(), **kwargs)


def test_tiles_over_the_shared_memory_budget_are_named():
    with pytest.raises(ValueError, match=r"block_q = 64, block_k = 64 with d = 256 need \d+ bytes of shared memory"):
        fa_numba.attention(*_qkv(d=256), block_q=64, block_k=64)


def test_bad_dtypes_and_shapes_are_named():
    with pytest.raises(TypeError, match=r"q must have dtype in \(float32, float16, bfloat16\), got float64"):
        fa_numba.attention(*_qkv(np.float64))
    with pytest.raises(ValueError, match=r"q must have head dim d <= 256, got 300"):
        fa_numba.attention(*_qkv(d=300))
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"k and v heads \(2\) must divide q heads \(3\)"):
        fa_numba.attention(np.zeros((3, 5, 8), np.float32), k, v)
    with pytest.raises(TypeError, match=r"all host arrays or all device arrays"):
        fa_numba.attention(cuda.to_device(q), k, v)


def test_non_contiguous_device_array_is_refused():
    strided = cuda.to_device(np.zeros((5, 16), np.float32))[:, ::2]  # (5, 8) view with a stride of 2
    assert not strided.is_c_contiguous()
    kv = cuda.to_device(np.zeros((7, 8), np.float32))
    with pytest.raises(ValueError, match=r"q must be C-contiguous"):
        fa_numba.attention(strided, kv, kv)


def test_non_contiguous_host_array_is_accepted():
    q = np.asfortranarray(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32))
    out, lse = fa_numba.attention(q, q, q, return_lse=True, **SMALL)
    tolerance.check_attention(out, lse, q, q, q, order="v2", **SMALL)


def test_backend_is_reported():
    assert fa_numba.backend.name() in ("simulator", "gpu")


def test_array_likes_and_foreign_dtypes():
    class HostTensor:  # like a CPU torch tensor: converts with __array__
        def __init__(self, a):
            self.a = a

        def __array__(self, dtype=None, copy=None):
            return self.a

    q = np.random.default_rng(1).standard_normal((4, 2)).astype(np.float32)
    out, lse = fa_numba.attention(HostTensor(q), HostTensor(q), HostTensor(q), return_lse=True, **SMALL)
    tolerance.check_attention(out, lse, q, q, q, order="v2", **SMALL)

    class ForeignDtype:  # has a shape and a dtype NumPy cannot read
        shape, dtype = (4, 2), "torch.bfloat16"

    with pytest.raises(TypeError, match=r"q must have dtype in \(float32, float16, bfloat16\), got torch.bfloat16"):
        fa_numba.attention(ForeignDtype(), q, q)


@pytest.mark.skipif(not fa_numba.backend.name() == "simulator", reason="the warning is about the simulator")
def test_simulator_warns_before_a_slow_launch(monkeypatch):
    monkeypatch.setattr(fa_numba.backend, "SIM_MAX_WORK", 10)  # make a tiny launch count as slow
    q = np.zeros((4, 2), np.float32)
    with pytest.warns(UserWarning, match=r"CUDA simulator \(no GPU\): B\*H\*N_q\*N_k\*d = 32 will take about") as seen:
        out = fa_numba.attention(q, q, q, **SMALL)
    assert len(seen) == 1 and out.shape == (4, 2)
