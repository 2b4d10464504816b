"""bfloat16 inputs: read as their bits, widened to float32 exactly by the kernels, checked by the tolerance rule.

NumPy has no bfloat16; `ml_dtypes` (the test extra) gives NumPy arrays of it, and torch tensors have one.
The reference is computed on the float32 values of the same bfloat16 inputs (the widening is exact).
"""

import numpy as np
import pytest
from numba import cuda

import fa_numba
from fa_numba import tolerance
from fa_numba.kernels import SIMT_VARIANTS, VARIANTS
from fa_numba.kernels.common import to_f32
from strategies import Case

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 NumPy arrays need ml_dtypes (the test extra)")
BF16 = ml_dtypes.bfloat16
SMALL = dict(block_q=4, block_k=4)


def _inputs(case: Case):
    """bfloat16 q, k, v and their exact float32 values."""
    q, k, v = (x.astype(BF16) for x in case.inputs(np.float32))
    return (q, k, v), tuple(x.astype(np.float32) for x in (q, k, v))


def test_the_bits_widen_to_float32_exactly():
    values = np.array([0.0, -0.0, 1.0, -2.25, 3.0e38, 1e-40, np.inf, -np.inf, np.nan], dtype=BF16)
    for bits in (values.view(np.uint16), values.view(np.int16)):
        widened = np.array([to_f32(b) for b in bits], dtype=np.float32)
        np.testing.assert_array_equal(widened.view(np.uint32), values.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("order", sorted(SIMT_VARIANTS))  # attention's orders (v2-mma: engine="mma")
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_host_arrays(order, causal):
    case = Case(n_q=9, n_k=7, d=3, block_q=4, block_k=4, causal=causal, heads_kv=1, group=2, seed=21)
    (q, k, v), exact = _inputs(case)
    out, lse = fa_numba.attention(q, k, v, causal=causal, order=order, return_lse=True, **SMALL)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == q.shape
    tolerance.check_attention(out, lse, *exact, causal=causal, name=f"{order} bfloat16", order=VARIANTS[order].order,
                              **SMALL)


@pytest.mark.skipif(fa_numba.backend.name() != "simulator",
                    reason="Numba device arrays of ml_dtypes.bfloat16 exist in the simulator only (on a GPU: torch)")
def test_bfloat16_device_arrays_in_the_simulator():
    case = Case(n_q=6, n_k=6, d=4, block_q=4, block_k=4, causal=True, seed=22)
    (q, k, v), exact = _inputs(case)
    out, lse = fa_numba.attention(*(cuda.to_device(x) for x in (q, k, v)), causal=True, return_lse=True, **SMALL)
    assert not isinstance(out, np.ndarray) and out.dtype == np.float32
    tolerance.check_attention(out.copy_to_host(), lse.copy_to_host(), *exact, causal=True, name="device bfloat16",
                              order="v2", **SMALL)


def test_bfloat16_torch_tensors():
    torch = pytest.importorskip("torch", reason="torch tensors need the torch extra")
    case = Case(n_q=5, n_k=8, d=4, block_q=4, block_k=4, causal=False, seed=23)
    _, exact = _inputs(case)
    q, k, v = (torch.from_numpy(x).bfloat16() for x in exact)  # exact: the values are bfloat16 already
    out, lse = fa_numba.attention(q, k, v, return_lse=True, **SMALL)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    tolerance.check_attention(out.numpy(), lse.numpy(), *exact, name="torch bfloat16", order="v2", **SMALL)


def test_mixed_bfloat16_is_named():
    (q, k, v), exact = _inputs(Case(n_q=4, n_k=4, d=2, block_q=4, block_k=4, causal=False))
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype, got q bfloat16, k float32, v bfloat16"):
        fa_numba.attention(q, exact[1], v)
