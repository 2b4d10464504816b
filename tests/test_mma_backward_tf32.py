"""The tensor-core backward of float32 inputs (3xTF32: fa_numba.kernels.mma.backward_tf32) against the float64
reference.

Judged by the gradients' rule (3x a naive float32 backward plus its floors) with the terms of what this backward
adds: every product by tf32 parts (tolerance_backward.grad_split_terms) and P recomputed by ex2
(grad_exp2_terms), through `fa_numba.attention_backward(..., engine="mma")` on float32 inputs. In the simulator
the m16n8k8 products are emulated (three per product): the shapes stay small, one-warp blocks (16 x 16 tiles)
in the default tier, the shipped d <= 64 tiles (32 x 32, two warps) in the slow tier.
"""

import numpy as np
import pytest

import fa_numba
from bounds import assert_within
from float64_bounds import backward_bounds
from fa_numba import backend, masks, reference, tolerance_backward
from fa_numba.kernels.mma import backward as mma_backward
from strategies import Case

SIMULATOR = backend.name() == "simulator"
SLOW = pytest.mark.slow


def _problem(case: Case, poison=None):
    """(float32 q, k, v, dout; their float64 values; float32 out and lse of the float64 forward)."""
    q, k, v = case.inputs(np.float64)
    dout = np.random.default_rng(case.seed + 100).standard_normal(q.shape)
    values = [q, k, v, dout]
    if poison is not None:
        poison(values)
    single = [x.astype(np.float32) for x in values]
    exact = [x.astype(np.float64) for x in single]
    with np.errstate(invalid="ignore"):
        out, lse = reference.attention(*exact[:3], causal=case.causal)
    return single, exact, out.astype(np.float32), lse.astype(np.float32)


def _backward(case, single, out, lse, **kwargs):
    q, k, v, dout = single
    return fa_numba.attention_backward(q, k, v, out, lse, dout, causal=case.causal, engine="mma",
                                       block_q=case.block_q, block_k=case.block_k, **kwargs)


CASES = [  # tails in N and d (d = 20: 24 padded), GQA, N_q > N_k causal (rows that see nothing), two warps
    Case(n_q=16, n_k=24, d=8, block_q=16, block_k=16, causal=True, seed=1),
    pytest.param(Case(n_q=37, n_k=29, d=20, block_q=16, block_k=16, causal=True, seed=2, group=2), marks=SLOW),
    pytest.param(Case(n_q=24, n_k=40, d=16, block_q=32, block_k=32, causal=False, seed=3), marks=SLOW),
    pytest.param(Case(n_q=40, n_k=24, d=12, block_q=16, block_k=16, causal=True, seed=4, amplitude=3.0),
                 marks=SLOW),  # large scores: a sharp softmax
]


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.n_q}x{c.n_k}-d{c.d}-{c.block_q}x{c.block_k}"
                         f"-{'causal' if c.causal else 'full'}-g{c.group}")
def test_tf32_backward_matches_reference_within_the_derived_rule(case):
    single, exact, out, lse = _problem(case)
    grads = _backward(case, single, out, lse)
    assert all(g.dtype == np.float32 for g in grads)
    tolerance_backward.check_attention_backward(*grads, *exact, causal=case.causal, products="3xtf32",
                                                name="bwd-mma 3xTF32")


@pytest.mark.lemma("L7")
@SLOW
def test_tf32_backward_agrees_with_the_cuda_core_backward_closely():
    """Both engines on the same float32 inputs: the 3xTF32 gradients are float32-grade, within a few float32
    ulps of the magnitudes of the CUDA-core ones (not the 2^-10 of one TF32 product)."""
    case = Case(n_q=32, n_k=32, d=16, block_q=16, block_k=16, causal=False, seed=7)
    single, exact, out, lse = _problem(case)
    ours = _backward(case, single, out, lse)
    simt = fa_numba.attention_backward(*single[:3], out, lse, single[3], engine="simt")
    for a, b in zip(ours, simt):
        assert np.abs(a - b).max() <= 2.0**-18 * np.abs(b).max()


def test_tf32_deterministic_mode_is_bitwise_repeatable_and_agrees_with_the_atomic_one():
    case = Case(n_q=16, n_k=24, d=8, block_q=16, block_k=16, causal=True, seed=5)
    single, exact, out, lse = _problem(case)
    first = _backward(case, single, out, lse, deterministic=True)
    second = _backward(case, single, out, lse, deterministic=True)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    atomic = _backward(case, single, out, lse)
    assert np.array_equal(first[1], atomic[1]) and np.array_equal(first[2], atomic[2])  # dK, dV: the same kernel
    tolerance_backward.check_attention_backward(*first, *exact, causal=True, products="3xtf32", name="deterministic")


@pytest.mark.lemma("L7")
@SLOW
@pytest.mark.parametrize("case", [Case(n_q=37, n_k=29, d=20, block_q=16, block_k=16, causal=True, seed=2, group=2),
                                  Case(n_q=40, n_k=56, d=16, block_q=32, block_k=32, causal=False, seed=3),
                                  # the dq pass at its float32 default's shape up to d = 64: 1 warp, 16 x 32
                                  Case(n_q=45, n_k=40, d=12, block_q=16, block_k=32, causal=True, seed=6)],
                         ids=["tails-gqa-causal", "two-warps", "dq-default-shape"])
def test_tf32_deterministic_mode_matches_reference_within_the_derived_rule(case):
    single, exact, out, lse = _problem(case)
    grads = _backward(case, single, out, lse, deterministic=True)
    tolerance_backward.check_attention_backward(*grads, *exact, causal=case.causal, products="3xtf32",
                                                name="bwd-mma 3xTF32 det")


# causal 32 x 32 (16 x 16 tiles): key 20 is hidden from rows 0..19, row 5 sees keys 0..5: each NaN or inf sits in
# a tile that masks some pair, so the exact path must keep it out of the gradients the mask says it cannot reach
def _at(tensor: int, row: int, col: int, value: float):
    def poison(values):
        values[tensor][0, 0, row, col] = value
    return poison


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("poison", [pytest.param(_at(1, 20, 3, np.nan), id="k-nan", marks=SLOW),
                                    pytest.param(_at(3, 5, 3, np.inf), id="dout-inf", marks=SLOW),
                                    pytest.param(_at(0, 9, 0, -np.inf), id="q-inf", marks=SLOW)])
def test_tf32_backward_non_finite_inputs_follow_the_dense_rule(poison):
    case = Case(n_q=32, n_k=32, d=8, block_q=16, block_k=16, causal=True, seed=6)
    single, exact, out, lse = _problem(case, poison)
    grads = _backward(case, single, out, lse)
    ref = reference.attention_backward(*exact, causal=True)
    assert any(not np.isfinite(r).all() for r in ref)  # the poison reaches some gradient ...
    assert any(np.isfinite(r).any() and not np.isfinite(r).all() for r in ref)  # ... and not all of it
    tolerance_backward.check_attention_backward(*grads, *exact, causal=True, products="3xtf32", name="non-finite")


@pytest.mark.lemma("L8")
@SLOW
def test_tf32_backward_takes_a_block_mask():
    case = Case(n_q=32, n_k=32, d=8, block_q=16, block_k=16, causal=False, seed=13)
    single, exact, out, lse = _problem(case)
    mask = masks.sliding_window(12, 4)
    with np.errstate(invalid="ignore"):
        out, lse = (x.astype(np.float32) for x in reference.attention(*exact[:3], mask=mask))
    q, k, v, dout = single
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, engine="mma", block_q=16, block_k=16, mask=mask)
    tolerance_backward.check_attention_backward(*grads, *exact, mask=mask, products="3xtf32", name="window")


@pytest.mark.lemma("L7")
@pytest.mark.skipif(not SIMULATOR, reason="element counts are taken with counting arrays in the CUDA simulator")
@SLOW
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_tf32_backward_traffic_equals_iomodel(deterministic):
    """Every element read and written in HBM, counted in the simulator (cp.async copies included), equals the
    K/V-outer order's model, as for the 16-bit kernel: the tiles are staged raw, each once per visit."""
    from fa_numba import iomodel
    from fa_numba.kernels.counting import run_counted_backward

    case = Case(n_q=37, n_k=29, d=16, block_q=16, block_k=16, causal=True, seed=8, group=2)
    single, exact, out, lse = _problem(case)
    dq, dk, dv, ledger = run_counted_backward(*single[:3], out, lse, single[3], 1 / np.sqrt(case.d),
                                              causal=case.causal, block=case.block_q, engine="mma", kind="float32",
                                              block_k=case.block_k, deterministic=deterministic)
    model = iomodel.traffic_backward("kv", case.n_q, case.n_k, case.d, case.block_q, case.block_k, case.causal,
                                     batch=case.batch, heads=case.heads, heads_kv=case.heads_kv,
                                     deterministic=deterministic)
    assert ledger.reads == model.reads
    assert ledger.writes == model.writes
    tolerance_backward.check_attention_backward(dq, dk, dv, *exact, causal=case.causal, products="3xtf32",
                                                name="counted")


@pytest.mark.parametrize("kwargs, message", [
    (dict(value_dim=8), "float32 inputs are padded to d"),
    (dict(role="dq", warps=2, block_q=32, block_k=64, head_dim=128), "over the 49152 static limit"),
    (dict(warps=2, block_k=32, block_q=32, head_dim=128), "over the 49152 static limit"),
])
def test_tf32_backward_config_errors_name_the_argument(kwargs, message):
    base = dict(role="kv", kind="float32", warps=1, block_q=16, block_k=16, head_dim=16, causal=False)
    with pytest.raises(ValueError, match=message):
        mma_backward.MmaBackwardConfig(**{**base, **kwargs}).check()


@pytest.mark.parametrize("d", [8, 64, 100, 128])
def test_the_deterministic_plan_at_default_tiles_takes_the_float32_dq_tiles(d):
    """plan() without tiles (what `attention_backward(..., deterministic=True)` launches) gives the dq pass the
    float32 defaults: it took the 16-bit table's (64 x 64 at d = 64, 87552 bytes of shared memory, refused) and
    the first H200 run (2026-12-04) failed every float32 deterministic call there."""
    kernels = mma_backward.plan("float32", d, False, True)
    dq = next(kernel for kernel, side in kernels if side == "q")
    warps, block_q, block_k = mma_backward.default_tiles("dq", d, "float32")
    assert (dq.config.warps, dq.config.block_q, dq.config.block_k) == (warps, block_q, block_k)


def test_the_float32_tiles_fit_and_auto_keeps_float32_on_the_cuda_cores():
    from fa_numba import engines

    for d in range(1, 129):
        for role in mma_backward.ROLES:
            warps, block_q, block_k = mma_backward.default_tiles(role, d, "float32")
            mma_backward.MmaBackwardConfig(role, "float32", warps, block_q, block_k, d, True).check()
    assert engines.backward("auto", kind="float32", head_dim=64) == "simt"  # as the forward: 3xTF32 is asked for
    assert engines.backward("mma", kind="float32", head_dim=64) == "mma"
    with pytest.raises(ValueError, match="mma-tf32' has no backward"):
        engines.backward("mma-tf32", kind="float32", head_dim=64)


@pytest.mark.lemma("L7")
@SLOW
def test_tf32_backward_with_a_value_head_dim_pads_v_and_cuts_back():
    """d_v != d on float32 inputs: V, O and dO padded to d with zeros (value_dims, exact), dV cut back to d_v."""
    rng = np.random.default_rng(21)
    q, k = (rng.standard_normal((1, 1, 16, 16)).astype(np.float32) for _ in range(2))
    v, dout = (rng.standard_normal((1, 1, 16, 8)).astype(np.float32) for _ in range(2))
    exact = [x.astype(np.float64) for x in (q, k, v, dout)]
    out, lse = (x.astype(np.float32) for x in reference.attention(*exact[:3], causal=True))
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, causal=True, engine="mma", block_q=16, block_k=16)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    tolerance_backward.check_attention_backward(*grads, *exact, causal=True, products="3xtf32", name="d_v")


@pytest.mark.lemma("L7")
@SLOW
def test_autograd_on_tensor_cores_in_float32_matches_sdpa_in_float64():
    """fa_numba.autograd.attention(engine="mma") on float32 tensors (both passes by 3xTF32) against torch SDPA's
    gradients of the same values in float64, within the rule with the 3xTF32 terms."""
    torch = pytest.importorskip("torch")
    from fa_numba import autograd

    g = torch.Generator().manual_seed(12)
    q, k, v, dout = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = autograd.attention(*leaves, causal=True, engine="mma", block_q=16, block_k=16)
    out.backward(dout)
    wide = [x.double().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*wide, is_causal=True).backward(dout.double())
    exact = [x.double().numpy() for x in (q, k, v, dout)]
    base = tolerance_backward.baseline_backward(*exact, causal=True, products="3xtf32")
    # the two float64 references agree: each (ours, torch's autograd) within backward_bounds of the exact gradients
    agree = backward_bounds(*exact, causal=True)[:3]
    for name, leaf, ref, ours, atol, bound in zip("qkv", leaves, wide, (base.dq, base.dk, base.dv),
                                                  (base.atol_dq, base.atol_dk, base.atol_dv), agree):
        sdpa = ref.grad.numpy()
        assert_within(ours, sdpa, 2 * bound, name=f"d{name} float64")
        assert leaf.grad.dtype == torch.float32
        err = np.abs(leaf.grad.double().numpy() - sdpa).max()
        assert err <= atol, (name, err, atol)


def test_the_model_counts_the_one_warp_staging_loop_by_its_copies():
    """MmaBackwardKernel.staged_copies (what whole_kernel.mma_iteration_counts divides a rolled staging loop's
    copies by): the staged tile's rows (the kv kernel's Q_i, B_r; the dq pass's K_j, B_c) of d / 4 16-byte copies
    over the block's threads, float32 cp.async kernels only."""
    one_warp = mma_backward.make("kv", "float32", 1, 16, 16, 128, False)
    assert one_warp.staged_copies == 16 * (128 // 4) // 32
    assert mma_backward.make("kv", "float32", 2, 16, 32, 64, False).staged_copies == 16 * (64 // 4) // 64
    assert mma_backward.make("kv", "float32", 1, 16, 16, 20, False).staged_copies is None  # plain loads (d % 4)
    assert mma_backward.make("kv", "float16", 1, 16, 16, 64, False).staged_copies is None
    assert mma_backward.make("dq", "float32", 1, 16, 32, 64, False).staged_copies == 32 * (64 // 4) // 32
    assert mma_backward.make("dq", "float16", 1, 16, 32, 64, False).staged_copies is None
