"""Every registered kernel against the float64 reference, the tiled spec and the IO model.

Without a GPU these run in the CUDA simulator on small shapes; with one, the same tests run on the device.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fa_numba import backend, iomodel, tiled, tolerance
from fa_numba.kernels import VARIANTS, default_tiles, poisoned_outputs
from strategies import HARD_CASES, Case, kernel_cases, launch_blocks, with_hard_cases

NAMES = sorted(name for name, v in VARIANTS.items() if "float32" in v.dtypes and v.tile_multiple == 1)
# (the variants that take what these cases draw, float32 and any tiles; the tensor-core v1-mma and v2-mma take
# 16-bit inputs and tiles of 16: tests/test_mma_forward.py and tests/test_registry_mma.py check them)
SIMULATOR = backend.name() == "simulator"


def run_kernel(name: str, case: Case, dtype=np.float32, inputs=None):
    """Launch variant `name` on the case's inputs with NaN-poisoned outputs; returns host (out, lse)."""
    q, k, v = case.inputs(dtype) if inputs is None else inputs
    kernel = VARIANTS[name].make(case.block_q, case.block_k, case.d, case.causal)
    out, lse, workspace = poisoned_outputs(q.shape)
    kernel(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, lse, 1 / np.sqrt(case.d), workspace)
    return out.copy_to_host(), lse.copy_to_host()


def test_registry_lists_both_orders_with_descriptions():
    assert {v.order for v in VARIANTS.values()} == {"v1", "v2"}
    for variant in VARIANTS.values():
        assert variant.description and variant.make.__doc__


def test_hard_cases_fit_the_simulator_budget():
    assert all(launch_blocks(c) <= 16 and c.block_q <= 64 for c in HARD_CASES)


@pytest.mark.lemma("L4")
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25)
@given(case=kernel_cases(), half=st.booleans())
@with_hard_cases(half=False)
def test_kernel_matches_reference_and_spec(name, case: Case, half: bool):
    dtype = np.float16 if half else np.float32
    q, k, v = inputs = case.inputs(dtype)
    out, lse = run_kernel(name, case, inputs=inputs)
    check = tolerance.check_attention(out, lse, q, k, v, causal=case.causal, name=f"{name} kernel",
                                      order=VARIANTS[name].order, block_q=case.block_q, block_k=case.block_k)
    # The kernel follows the tiled spec of its order, computed in float32. Both round differently (the kernel's
    # loops against NumPy's matmul), and each is within the tolerance of the reference (the spec by
    # test_tiled), so they are within twice it of each other; nothing tighter is derived.
    spec_out, spec_lse, _ = tiled.attention(q, k, v, order=VARIANTS[name].order, block_q=case.block_q,
                                            block_k=case.block_k, causal=case.causal, dtype=np.float32)
    tolerance.assert_close(out, spec_out, 2 * check.atol_out, name=f"{name} kernel vs tiled spec out")
    tolerance.assert_close(lse, spec_lse, 2 * check.atol_lse, name=f"{name} kernel vs tiled spec lse")


@pytest.mark.lemma("L4")
@pytest.mark.parametrize("case", [c for c in HARD_CASES if c.causal] + [
    Case(n_q=7, n_k=7, d=3, block_q=8, block_k=8, causal=True, seed=8),  # N < B_c
    Case(n_q=9, n_k=9, d=3, block_q=4, block_k=8, causal=False, seed=9),  # N = B_c + 1
], ids=lambda c: f"nq{c.n_q}-nk{c.n_k}-d{c.d}-b{c.block_q}x{c.block_k}-{'causal' if c.causal else 'full'}")
def test_v1_equals_v2(case: Case):
    out1, lse1 = run_kernel("v1", case)
    out2, lse2 = run_kernel("v2", case)
    q, k, v = case.inputs(np.float32)
    base = tolerance.baseline(q, k, v, causal=case.causal, block_q=case.block_q, block_k=case.block_k)
    check1 = tolerance.judge(out1, lse1, base, name="v1 kernel", order="v1")
    check2 = tolerance.judge(out2, lse2, base, name="v2 kernel", order="v2")
    # Each is within its tolerance of the reference, so they are within the sum of both of each other.
    tolerance.assert_close(out1, out2, check1.atol_out + check2.atol_out, name="v1 vs v2 out")
    tolerance.assert_close(lse1, lse2, check1.atol_lse + check2.atol_lse, name="v1 vs v2 lse")


@pytest.mark.lemma("L3")
@pytest.mark.parametrize("name", NAMES)
def test_rows_without_visible_keys_are_exactly_zero_and_minus_inf(name):
    case = Case(n_q=11, n_k=3, d=4, block_q=4, block_k=2, causal=True, seed=3)  # rows 0..7 see nothing
    out, lse = run_kernel(name, case)
    assert (out[0, 0, :8] == 0).all() and np.isneginf(lse[0, 0, :8]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[0, 0, 8:]).all()


@pytest.mark.lemma("L2")
@pytest.mark.parametrize("name", NAMES)
def test_huge_logits_stay_finite_and_exact(name):
    case = Case(n_q=6, n_k=6, d=4, block_q=4, block_k=2, causal=False, logit=1e4, seed=4)
    q, k, v = case.inputs(np.float32)
    out, lse = run_kernel(name, case, inputs=(q, k, v))
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    tolerance.check_attention(out, lse, q, k, v, name=f"{name} kernel", order=VARIANTS[name].order,
                              block_q=case.block_q, block_k=case.block_k)


@pytest.mark.lemma("L5")
@pytest.mark.skipif(not SIMULATOR, reason="element counts are taken with counting arrays in the CUDA simulator")
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=8)
@given(case=kernel_cases())
@with_hard_cases
def test_kernel_traffic_equals_iomodel(name, case: Case):
    from fa_numba.kernels.counting import run_counted

    q, k, v = case.inputs(np.float32)
    kernel = VARIANTS[name].make(case.block_q, case.block_k, case.d, case.causal)
    out, lse, ledger = run_counted(kernel, q, k, v, 1 / np.sqrt(case.d))
    model = iomodel.traffic(VARIANTS[name].order, case.n_q, case.n_k, case.d, case.block_q, case.block_k,
                            case.causal, batch=case.batch, heads=case.heads, heads_kv=case.heads_kv)
    assert ledger.reads == model.reads
    assert ledger.writes == model.writes
    tolerance.check_attention(out, lse, q, k, v, causal=case.causal, name=f"{name} counted",
                              order=VARIANTS[name].order, block_q=case.block_q, block_k=case.block_k)


@pytest.mark.skipif(not SIMULATOR, reason="simulator-only check of the counting harness itself")
def test_counting_harness_sees_an_extra_read():
    """The traffic test can fail: a kernel that reads Q twice shows up in the ledger."""
    from fa_numba.kernels.counting import run_counted

    case = Case(n_q=4, n_k=4, d=2, block_q=4, block_k=4, causal=False)
    q, k, v = case.inputs(np.float32)
    kernel = VARIANTS["v2"].make(4, 4, 2, False)

    def reads_q_twice(q_, k_, v_, o_, lse_, scale, workspace=None, mask=None):
        _ = q_[0, 0, 0, 0]
        kernel(q_, k_, v_, o_, lse_, scale)

    _, _, ledger = run_counted(reads_q_twice, q, k, v, 0.5)
    assert ledger.reads["Q"] == iomodel.traffic("v2", 4, 4, 2, 4, 4, False).reads["Q"] + 1


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="larger shapes need a real GPU; the simulator would take hours")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_larger_shapes(name, causal, d):
    case = Case(n_q=517, n_k=389 if causal else 1031, d=d, block_q=default_tiles(d)[0], block_k=default_tiles(d)[1],
                causal=causal, batch=2, heads_kv=2, group=2, seed=d)
    for dtype in (np.float32, np.float16):
        q, k, v = inputs = case.inputs(dtype)
        out, lse = run_kernel(name, case, inputs=inputs)
        tolerance.check_attention(out, lse, q, k, v, causal=causal, name=f"{name} {dtype.__name__}",
                                  contractions=("matmul", "loop"), order=VARIANTS[name].order,
                                  block_q=case.block_q, block_k=case.block_k)


@pytest.mark.skipif(not SIMULATOR, reason="the workaround patches the CUDA simulator only")
def test_simulator_shared_arrays_are_per_call_site_and_shared_by_the_block():
    """backend.patch_simulator: one array per call site for the whole block, distinct sites distinct."""
    from numba import float32, int32

    @cuda.jit
    def kernel(out):
        first = cuda.shared.array(32, int32)
        second = cuda.shared.array(32, float32)
        tid = cuda.threadIdx.x
        first[tid] = tid + 1
        second[tid] = float32(-1.0)
        # every thread has written its slot before thread 0 sums them
        cuda.syncthreads()
        if tid == 0:
            total = 0
            for t in range(32):
                total += first[t]
            out[0] = total

    for _ in range(10):
        out = np.zeros(1, np.int64)
        kernel[1, 32](out)
        assert out[0] == 32 * 33 // 2  # the int32 array was neither private nor aliased with the float one
