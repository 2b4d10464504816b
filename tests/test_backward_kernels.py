"""The backward kernels (fa_numba/kernels/backward.py), `attention_backward` and `fa_numba.autograd`, against the
float64 gradients with the gradients' rule (proofs/L7), the spec's traffic, and torch's own SDPA.

Without a GPU these run in the CUDA simulator on small shapes; with one, the same tests run on the device.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fa_numba
from bounds import assert_within
from float64_bounds import backward_bounds
from fa_numba import backend, iomodel, reference, tolerance, tolerance_backward
from fa_numba.kernels import backward
from strategies import BACKWARD_HARD_CASES, Case, kernel_cases

SIMULATOR = backend.name() == "simulator"
# (order, deterministic): the backward's three kernel combinations
ORDERS = (("kv", False), ("kv", True), ("q", False))
NO_TORCH = "fa_numba.autograd needs torch (the torch extra)"


def _square(case: Case) -> Case:
    """The backward kernels take square tiles: block_k = block_q."""
    return dataclasses.replace(case, block_k=case.block_q)


def _problem(case: Case, dtype=np.float32):
    """Inputs, dO and the forward kernel's O and LSE (what a training step hands the backward)."""
    q, k, v = case.inputs(dtype)
    dout = case.grad_output(dtype)
    out, lse = fa_numba.attention(q, k, v, causal=case.causal, return_lse=True, block_q=case.block_q,
                                  block_k=case.block_q)
    return q, k, v, dout, out, lse


SMALL_HARD = [_square(c) for c in BACKWARD_HARD_CASES if c.n_q * c.heads * c.batch <= 64]


def _within(check: tolerance_backward.CheckBackward) -> bool:
    """judge_backward raises on any entry beyond its tolerance; this states the verdict in the test too."""
    return check.err_dq <= check.atol_dq and check.err_dk <= check.atol_dk and check.err_dv <= check.atol_dv


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("order, deterministic", [
    pytest.param("kv", False, marks=pytest.mark.slow), pytest.param("kv", True, marks=pytest.mark.slow), ("q", False)],
    ids=["kv", "kv-deterministic", "q"])  # kv and kv-deterministic (7-20 s in the simulator): the slow tier; the
@settings(max_examples=10)  # kv order stays in the default run through the masked, NaN and traffic properties
@given(case=kernel_cases().map(_square), half=st.booleans())
def test_backward_kernels_pass_the_3x_rule(order, deterministic, case: Case, half):
    dtype = np.float16 if half else np.float32
    q, k, v, dout, out, lse = _problem(case, dtype)
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, causal=case.causal, order=order,
                                        deterministic=deterministic, block_q=case.block_q, block_k=case.block_q)
    assert all(g.dtype == np.float32 for g in grads)
    assert grads[0].shape == q.shape and grads[1].shape == k.shape and grads[2].shape == v.shape
    tolerance_backward.check_attention_backward(*grads, q, k, v, dout, causal=case.causal, name=f"kernel {order}")


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("case", SMALL_HARD, ids=lambda c: f"nq{c.n_q}-nk{c.n_k}-d{c.d}-b{c.block_q}-"
                                                          f"{'causal' if c.causal else 'full'}-x{c.amplitude:g}")
def test_backward_kernels_on_the_hard_cases(case: Case):
    q, k, v, dout, out, lse = _problem(case)
    base = tolerance_backward.baseline_backward(q, k, v, dout, causal=case.causal)
    for order, deterministic in ORDERS:
        grads = fa_numba.attention_backward(q, k, v, out, lse, dout, causal=case.causal, order=order,
                                            deterministic=deterministic, block_q=case.block_q)
        assert _within(tolerance_backward.judge_backward(
            *grads, base, name=f"kernel {order}{' deterministic' if deterministic else ''}"))


# The tiles and micro-tiles a launch gets by default (backward.DEFAULTS: 32x32 with 4x4 per thread at d = 64,
# 16x16 with 2x2 at d = 128, 8x8 with 1x1 at d = 256; 64 threads each), run once per order: the random cases
# above pick their own tiles, so without these the shipped layouts would be compiled but never executed.
SHIPPED = [Case(n_q=37, n_k=45, d=64, block_q=32, block_k=32, causal=True, seed=31),
           Case(n_q=21, n_k=18, d=128, block_q=16, block_k=16, causal=False, heads_kv=1, group=2, seed=32),
           Case(n_q=11, n_k=13, d=256, block_q=8, block_k=8, causal=True, seed=33)]


@pytest.mark.slow  # about 3 minutes in the simulator, so in the tier CI also runs
@pytest.mark.lemma("L7")
@pytest.mark.parametrize("case", SHIPPED, ids=lambda c: f"d{c.d}-b{c.block_q}")
def test_the_shipped_backward_layouts_pass_the_3x_rule(case: Case):
    assert backward.default_backward_tiles(case.d)[0] == case.block_q
    q, k, v, dout, out, lse = _problem(case)
    base = tolerance_backward.baseline_backward(q, k, v, dout, causal=case.causal)
    for order, deterministic in ORDERS:
        grads = fa_numba.attention_backward(q, k, v, out, lse, dout, causal=case.causal, order=order,
                                            deterministic=deterministic)  # tiles left to the defaults
        assert _within(tolerance_backward.judge_backward(
            *grads, base, name=f"shipped d={case.d} {order}{' det' if deterministic else ''}"))


@pytest.mark.lemma("L7")
@pytest.mark.skipif(not SIMULATOR, reason="element counts are taken with counting arrays in the CUDA simulator")
@pytest.mark.parametrize("order, deterministic", [
    ("kv", False), pytest.param("kv", True, marks=pytest.mark.slow), ("q", False)],
    ids=["kv", "kv-deterministic", "q"])  # kv-deterministic (~10 s in the simulator): the slow tier
@settings(max_examples=6)
@given(case=kernel_cases().map(_square))
def test_backward_traffic_equals_iomodel(order, deterministic, case: Case):
    from fa_numba.kernels.counting import run_counted_backward

    q, k, v, dout, out, lse = _problem(case)
    dq, dk, dv, ledger = run_counted_backward(q, k, v, out, lse, dout, 1 / np.sqrt(case.d), causal=case.causal,
                                              order=order, deterministic=deterministic, block=case.block_q)
    model = iomodel.traffic_backward(order, case.n_q, case.n_k, case.d, case.block_q, case.block_q, case.causal,
                                     batch=case.batch, heads=case.heads, heads_kv=case.heads_kv,
                                     deterministic=deterministic)
    assert ledger.reads == model.reads
    assert ledger.writes == model.writes
    tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, causal=case.causal, name=f"counted {order}")


@pytest.mark.lemma("L7")
def test_rows_without_visible_keys_get_exactly_zero_gradient():
    case = Case(n_q=11, n_k=3, d=4, block_q=4, block_k=4, causal=True, seed=3)  # rows 0..7 see nothing
    q, k, v, dout, out, lse = _problem(case)
    for order, deterministic in ORDERS:
        dq, dk, dv = fa_numba.attention_backward(q, k, v, out, lse, dout, causal=True, order=order,
                                                 deterministic=deterministic, block_q=4)
        assert (dq[0, 0, :8] == 0).all() and np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
        tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, causal=True)


def test_deterministic_mode_is_bitwise_repeatable():
    case = Case(n_q=12, n_k=12, d=4, block_q=4, block_k=4, causal=True, heads_kv=1, group=2, seed=8)
    q, k, v, dout, out, lse = _problem(case)
    runs = [fa_numba.attention_backward(q, k, v, out, lse, dout, causal=True, deterministic=True, block_q=4)
            for _ in range(3)]
    for grads in runs[1:]:
        for a, b in zip(grads, runs[0]):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    atomic = fa_numba.attention_backward(q, k, v, out, lse, dout, causal=True, block_q=4)
    tolerance_backward.check_attention_backward(*atomic, q, k, v, dout, causal=True, name="atomic dq")


def _qkvo():
    q, k, v, dout, out, lse = _problem(Case(n_q=5, n_k=6, d=4, block_q=4, block_k=4, causal=False))
    return q, k, v, out, lse, dout


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(order="v2"), ValueError, r"order must be one of \('kv', 'q'\)"),
    (dict(order="q", deterministic=True), ValueError, r"deterministic=True is the K/V-outer order's mode"),
    (dict(deterministic=1), TypeError, r"deterministic must be a bool"),
    (dict(block_q=4, block_k=8), ValueError, r"block_q and block_k must be equal"),
    (dict(block_q=64), ValueError, r"needs \d+ bytes of shared memory"),
])
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        fa_numba.attention_backward(*_qkvo(), **kwargs)


def test_bad_shapes_and_dtypes_are_named():
    q, k, v, out, lse, dout = _qkvo()
    with pytest.raises(ValueError, match=r"dout must have shape \(1, 1, 5, 4\) \(from q and v\), got \(1, 1, 5, 3\)"):
        fa_numba.attention_backward(q, k, v, out, lse, dout[..., :3])
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 1, 5\)"):
        fa_numba.attention_backward(q, k, v, out, lse[..., :4], dout)
    with pytest.raises(TypeError, match=r"lse must have dtype float32"):
        fa_numba.attention_backward(q, k, v, out, lse.astype(np.float16), dout)
    with pytest.raises(TypeError, match=r"dout must have q's dtype float32 or float32"):
        fa_numba.attention_backward(q, k, v, out, lse, dout.astype(np.float16))


def test_layouts_and_float32_dout_with_float16_inputs():
    q, k, v, out, lse, dout = _qkvo()
    four = fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=8)  # 8 x 8 tiles: the simulator's pace
    two = fa_numba.attention_backward(q[0, 0], k[0, 0], v[0, 0], out[0, 0], lse[0, 0], dout[0, 0], block_q=8)
    for g4, g2 in zip(four, two):
        assert g2.shape == g4.shape[2:]
        np.testing.assert_array_equal(g2, g4[0, 0])
    halves = [x.astype(np.float16) for x in (q, k, v)]
    out16, lse16 = fa_numba.attention(*halves, return_lse=True, block_q=8, block_k=8)
    grads = fa_numba.attention_backward(*halves, out16, lse16, dout, block_q=8)  # dout float32: the forward's dtype
    tolerance_backward.check_attention_backward(*grads, *halves, dout)


def _sdpa_grads(torch, q, k, v, dout, causal):
    """torch's own SDPA gradients in float64 (GQA by repeating K/V heads, causal by an explicit mask)."""
    q64, k64, v64 = (torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    mask = torch.from_numpy(reference.visible_mask(q.shape[2], k.shape[2], causal)) if causal else None
    out = torch.nn.functional.scaled_dot_product_attention(q64, k64.repeat_interleave(group, 1),
                                                           v64.repeat_interleave(group, 1), attn_mask=mask)
    out.backward(torch.from_numpy(dout.astype(np.float64)))
    return out.detach().numpy(), q64.grad.numpy(), k64.grad.numpy(), v64.grad.numpy()


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])  # causal: slow tier
@pytest.mark.parametrize("backward_order", ["kv", pytest.param("q", marks=pytest.mark.slow)])  # q: slow tier
def test_autograd_matches_torch_sdpa_in_float64(causal, backward_order):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    import fa_numba.autograd

    case = Case(n_q=9, n_k=12, d=4, block_q=8, block_k=8, causal=causal, heads_kv=1, group=2, seed=31)
    q, k, v = case.inputs(np.float32)
    dout = case.grad_output(np.float32)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = fa_numba.autograd.attention(tq, tk, tv, causal=causal, backward_order=backward_order)
    out.backward(torch.from_numpy(dout))
    sdpa_out, *sdpa = _sdpa_grads(torch, q, k, v, dout, causal)
    # torch's float64 gradients and our float64 reference's: each within backward_bounds of the exact gradients
    agree = backward_bounds(*(x.astype(np.float64) for x in (q, k, v, dout)), causal=causal)[:3]
    ours_all = reference.attention_backward(q, k, v, dout, causal=causal)
    for ours, theirs, bound, name in zip(ours_all, sdpa, agree, "qkv"):
        assert_within(ours, theirs, 2 * bound, name=f"d{name}")
    base = tolerance_backward.baseline_backward(q, k, v, dout, causal=causal)
    for name, g, theirs, atol in zip(("dq", "dk", "dv"), (tq.grad, tk.grad, tv.grad), sdpa,
                                     (base.atol_dq, base.atol_dk, base.atol_dv)):
        assert g.dtype == torch.float32 and g.shape == theirs.shape
        tolerance.assert_close(g.numpy(), theirs, atol, name=f"autograd {name} vs torch SDPA")
    tolerance.assert_close(out.detach().numpy(), sdpa_out, tolerance.baseline(q, k, v, causal=causal).atol_out,
                           name="autograd out vs torch SDPA")


def test_autograd_refuses_other_arrays():
    pytest.importorskip("torch", reason=NO_TORCH)
    import fa_numba.autograd

    q = np.zeros((4, 2), np.float32)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got ndarray"):
        fa_numba.autograd.attention(q, q, q)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="larger shapes need a real GPU; the simulator would take hours")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_larger_shapes(causal, d):
    block = backward.default_backward_tiles(d)[0]
    case = Case(n_q=517, n_k=389 if causal else 1031, d=d, block_q=block, block_k=block, causal=causal, batch=2,
                heads_kv=2, group=2, seed=d)
    q, k, v, dout, out, lse = _problem(case)
    base = tolerance_backward.baseline_backward(q, k, v, dout, causal=causal, contractions=("matmul", "loop"))
    for order, deterministic in ORDERS:
        grads = fa_numba.attention_backward(q, k, v, out, lse, dout, causal=causal, order=order,
                                            deterministic=deterministic)
        assert _within(tolerance_backward.judge_backward(*grads, base, name=f"gpu {order}"))
