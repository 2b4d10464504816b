"""The tensor-core backward (fa_numba.kernels.mma.backward) against the float64 reference.

Judged by the gradients' rule (3x a naive float32 backward, plus the floors of what the backward recomputes)
with the terms of the two 16-bit roundings this backward adds (P before dV, dS before dK and dQ:
tolerance_backward.grad_rounding_terms, proofs/L7), through `fa_numba.attention_backward(..., engine="mma")`. In the
simulator the mma.sync products are emulated (fa_numba.warp.emulated_tc); on a GPU the same tests run on the
tensor cores. Shapes stay small: one-warp blocks (block_k = 16) unless a case says otherwise.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fa_numba
from bounds import assert_within
from float64_bounds import backward_bounds
from fa_numba import backend, profile, reference, tolerance_backward
from fa_numba.kernels.mma import backward as mma_backward
from strategies import Case

HERE = Path(__file__).resolve().parent
SIMULATOR = backend.name() == "simulator"
SLOW = pytest.mark.slow
ml_dtypes = pytest.importorskip("ml_dtypes")  # a test dependency: bfloat16 NumPy arrays
TO_16 = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _problem(case: Case, kind: str, poison=None):
    """(16-bit q, k, v, dout as the API takes them, their exact float64 values, float32 out and lse of the
    float64 forward). poison(values) may write NaN or inf into the float64 values before rounding."""
    q, k, v = case.inputs(np.float64)
    dout = np.random.default_rng(case.seed + 100).standard_normal(q.shape)
    values = [q, k, v, dout]
    if poison is not None:
        poison(values)
    sixteen = [x.astype(TO_16[kind]) for x in values]  # round to nearest even
    exact = [x.astype(np.float64) for x in sixteen]
    with np.errstate(invalid="ignore"):
        out, lse = reference.attention(*exact[:3], causal=case.causal)
    return sixteen, exact, out.astype(np.float32), lse.astype(np.float32)


def _backward(case, kind, sixteen, out, lse, *, deterministic=False, block_q=16, block_k=16):
    q, k, v, dout = sixteen
    return fa_numba.attention_backward(q, k, v, out, lse, dout, causal=case.causal, engine="mma",
                                       deterministic=deterministic, block_q=block_q, block_k=block_k)


CASES = [  # (case, kind, deterministic): tails in N and d, GQA, N_q > N_k causal (rows that see nothing)
    (Case(n_q=24, n_k=40, d=16, block_q=16, block_k=16, causal=False, seed=1), "float16", False),
    pytest.param(Case(n_q=37, n_k=29, d=20, block_q=16, block_k=16, causal=True, seed=2, group=2), "bfloat16", True,
                 marks=SLOW),  # 6 s; the default tier's deterministic and causal cases: the tests below
    pytest.param(Case(n_q=37, n_k=29, d=20, block_q=16, block_k=16, causal=True, seed=2, group=2), "float16", False,
                 marks=SLOW),
    pytest.param(Case(n_q=45, n_k=30, d=32, block_q=16, block_k=16, causal=True, seed=3), "float16", True,
                 marks=SLOW),
    pytest.param(Case(n_q=40, n_k=24, d=48, block_q=16, block_k=16, causal=True, seed=4), "bfloat16", False,
                 marks=SLOW),
]


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("case, kind, deterministic", CASES,
                         ids=lambda x: f"{x.n_q}x{x.n_k}-d{x.d}-{'causal' if x.causal else 'full'}"
                         if isinstance(x, Case) else str(x))
def test_mma_backward_matches_reference_within_the_derived_rule(case, kind, deterministic):
    sixteen, exact, out, lse = _problem(case, kind)
    grads = _backward(case, kind, sixteen, out, lse, deterministic=deterministic)
    assert all(g.dtype == np.float32 for g in grads)
    tolerance_backward.check_attention_backward(*grads, *exact, causal=case.causal, p_dtype=kind,
                                                name=f"bwd-mma {kind}{' det' if deterministic else ''}")


@pytest.mark.lemma("L7")
def test_the_16_bit_terms_are_what_let_the_mma_gradients_pass():
    """Without the P and dS rounding terms the plain float32 rule is too tight for these gradients (the
    terms are needed), and with them it passes (they suffice): on a problem where P and dS carry mass."""
    case = Case(n_q=32, n_k=32, d=16, block_q=16, block_k=16, causal=False, seed=7)
    sixteen, exact, out, lse = _problem(case, "bfloat16")
    grads = _backward(case, "bfloat16", sixteen, out, lse)
    with pytest.raises(AssertionError):
        tolerance_backward.check_attention_backward(*grads, *exact, causal=False)
    tolerance_backward.check_attention_backward(*grads, *exact, causal=False, p_dtype="bfloat16")


def test_deterministic_mode_is_bitwise_repeatable_and_agrees_with_the_atomic_one():
    case = Case(n_q=33, n_k=33, d=16, block_q=16, block_k=16, causal=True, seed=5)
    sixteen, exact, out, lse = _problem(case, "float16")
    first = _backward(case, "float16", sixteen, out, lse, deterministic=True)
    second = _backward(case, "float16", sixteen, out, lse, deterministic=True)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    atomic = _backward(case, "float16", sixteen, out, lse)
    assert np.array_equal(first[1], atomic[1]) and np.array_equal(first[2], atomic[2])  # dK, dV: the same kernel
    tolerance_backward.check_attention_backward(*atomic, *exact, causal=True, p_dtype="float16", name="atomic")
    tolerance_backward.check_attention_backward(*first, *exact, causal=True, p_dtype="float16", name="deterministic")


def _at(tensor: int, row: int, col: int, value: float):
    def poison(values):
        values[tensor][0, 0, row, col] = value
    return poison


# causal 32 x 32: key 20 is hidden from rows 0..19, row 5 sees keys 0..5: each NaN or inf sits in a tile that
# masks some pair, so the exact path must keep it out of the gradients the mask says it cannot reach
NONFINITE = [pytest.param(_at(1, 20, 3, np.nan), id="k-nan"),
             pytest.param(_at(2, 30, 1, np.nan), id="v-nan", marks=SLOW),
             pytest.param(_at(3, 5, 3, np.inf), id="dout-inf"),
             pytest.param(_at(0, 9, 0, -np.inf), id="q-inf", marks=SLOW)]


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("deterministic", [False, pytest.param(True, marks=SLOW)], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("poison", NONFINITE)
def test_mma_backward_non_finite_inputs_follow_the_dense_rule(poison, deterministic):
    """NaN or inf reaches exactly the gradient entries the dense formula (masked pairs never multiplied) puts
    it in: the rule requires the reference's non-finite entries reproduced exactly and every other entry
    finite and within the tolerance."""
    case = Case(n_q=32, n_k=32, d=16, block_q=16, block_k=16, causal=True, seed=6)
    sixteen, exact, out, lse = _problem(case, "float16", poison)
    grads = _backward(case, "float16", sixteen, out, lse, deterministic=deterministic)
    ref = reference.attention_backward(*exact, causal=True)
    assert any(not np.isfinite(r).all() for r in ref)  # the poison reaches some gradient ...
    assert any(np.isfinite(r).any() and not np.isfinite(r).all() for r in ref)  # ... and not all of it
    tolerance_backward.check_attention_backward(*grads, *exact, causal=True, p_dtype="float16", name="non-finite")


@pytest.mark.lemma("L7")
def test_without_a_causal_mask_padding_keeps_non_finite_inputs_where_they_belong():
    """The non-causal kernels have no exact path: their only masked pairs are padded rows or keys, staged as
    zeros. A NaN in the last key of a ragged tile and an inf in the last row of another must still reach
    exactly the dense formula's gradients (every dQ row sees the NaN key; dV's rows take the inf), and no
    padded pair may spread them further."""
    case = Case(n_q=21, n_k=29, d=16, block_q=16, block_k=16, causal=False, seed=12)

    def poison(values):
        values[2][0, 0, 28, 5] = np.nan  # v: the last key, in the second (ragged) key tile
        values[3][0, 0, 20, 2] = np.inf  # dout: the last row, in the second (ragged) query tile
    sixteen, exact, out, lse = _problem(case, "float16", poison)
    grads = _backward(case, "float16", sixteen, out, lse)
    ref = reference.attention_backward(*exact, causal=False)
    assert np.isnan(ref[0]).any() and not np.isfinite(ref[2]).all()  # the poison reaches dq and dv
    tolerance_backward.check_attention_backward(*grads, *exact, causal=False, p_dtype="float16", name="padded")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(role="xy"), ValueError, "role must be one of"),
    (dict(kind="float64"), ValueError, "dtype must be one of"),
    (dict(warps=3), ValueError, "warps must be 1, 2, 4 or 8"),
    (dict(head_dim=129), ValueError, "head dim d must be in 1..128"),
    (dict(block_q=24), ValueError, "block_q must be a positive multiple of 16"),
    (dict(block_k=32), ValueError, "block_k must be 16 x warps = 16"),
    (dict(warps=4, block_k=64, block_q=48), ValueError, "must divide one another"),
    (dict(block_q=64), ValueError, "block_q must be at most 32 x warps = 32"),
    (dict(block_q=128, head_dim=128, warps=8, block_k=128), ValueError, "over the 49152 static limit"),
])
def test_mma_backward_config_errors_name_the_argument(kwargs, error, message):
    base = dict(role="kv", kind="float16", warps=1, block_q=16, block_k=16, head_dim=16, causal=False)
    with pytest.raises(error, match=message):
        mma_backward.MmaBackwardConfig(**{**base, **kwargs}).check()


def test_the_shipped_tiles_fit_and_the_api_refuses_bad_tiles_by_name():
    for d in (16, 64, 96, 128):
        for role in mma_backward.ROLES:
            warps, block_q, block_k = mma_backward.default_tiles(role, d)
            mma_backward.MmaBackwardConfig(role, "float16", warps, block_q, block_k, d, True).check()
    h = np.zeros((1, 16, 16), np.float16)
    lse = np.zeros((1, 16), np.float32)
    with pytest.raises(ValueError, match="block_k must be 16, 32, 64 or 128"):
        fa_numba.attention_backward(h, h, h, h.astype(np.float32), lse, h, engine="mma", block_k=48)


@SLOW
@pytest.mark.skipif(profile.nvdisasm_path() is None, reason="nvdisasm is missing: install the profile extra")
def test_mma_backward_compiles_to_unrolled_products_without_local_memory():
    """sm_90a SASS of the shipped tiles: no local memory, no spills, <= 48 KB of shared memory, and the
    products of one visit unrolled (kv: S^T, dP^T, dV, dK, 2 NQ KS + 2 KQ DN HMMA in the visit loop, and dQ's
    rolled slice loop of KK; dq: S, dP and dQ, 2 NT KS + PK DN in the key-tile loop)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run([sys.executable, str(HERE / "mma_backward_probe.py")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert {(r["role"], r["d"]) for r in rows} == {(role, d) for role in ("kv", "dq") for d in (64, 128)}
    for row in rows:
        dp = -(-row["d"] // 16) * 16
        if row["role"] == "kv":  # plus dQ's slice loop, left rolled inside the visit: B_c / 16 k-steps a block
            products = (2 * (row["block_q"] // 8) * (dp // 16) + 2 * (row["block_q"] // 16) * (dp // 8)
                        + row["block_k"] // 16)
        else:
            products = 2 * (row["block_k"] // 8) * (dp // 16) + (row["block_k"] // 16) * (dp // 8)
        assert row["loop_hmma"] == products, row
        assert row["local"] == 0 and row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        assert row["smem"] <= 48 * 1024, row


@pytest.mark.lemma("L7")
@pytest.mark.skipif(not SIMULATOR, reason="element counts are taken with counting arrays in the CUDA simulator")
@pytest.mark.parametrize("deterministic", [False, pytest.param(True, marks=SLOW)], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", [pytest.param(Case(n_q=37, n_k=29, d=24, block_q=32, block_k=16, causal=True, seed=8,
                                                    group=2), marks=SLOW),  # 6 s; test_mma_masks counts one
                                  pytest.param(Case(n_q=20, n_k=45, d=16, block_q=16, block_k=32, causal=False,
                                                    seed=9), marks=SLOW)],
                         ids=lambda c: f"{c.n_q}x{c.n_k}-d{c.d}-{c.block_q}x{c.block_k}")
def test_mma_backward_traffic_equals_iomodel(case, deterministic):
    """Every element read and written in HBM, counted in the simulator (cp.async copies included), equals the
    K/V-outer order's model: K_j, V_j once per block, Q_i, dO_i, LSE_i, D_i once per visit, dQ read and
    written per visit by the atomic adds (or the deterministic dQ pass's own reads and one write)."""
    from fa_numba import iomodel
    from fa_numba.kernels.counting import run_counted_backward

    sixteen, exact, out, lse = _problem(case, "float16")
    dq, dk, dv, ledger = run_counted_backward(*sixteen[:3], out, lse, sixteen[3], 1 / np.sqrt(case.d),
                                              causal=case.causal, deterministic=deterministic, block=case.block_q,
                                              engine="mma", kind="float16", block_k=case.block_k)
    model = iomodel.traffic_backward("kv", case.n_q, case.n_k, case.d, case.block_q, case.block_k, case.causal,
                                     batch=case.batch, heads=case.heads, heads_kv=case.heads_kv,
                                     deterministic=deterministic)
    assert ledger.reads == model.reads
    assert ledger.writes == model.writes
    tolerance_backward.check_attention_backward(dq, dk, dv, *exact, causal=case.causal, p_dtype="float16",
                                                name="counted")


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=SLOW)])
def test_autograd_on_tensor_cores_matches_sdpa_in_float64(dtype):
    """fa_numba.autograd.attention(engine="mma") (both passes on the tensor-core kernels) against torch SDPA's
    gradients of the same 16-bit values in float64: within the rule with the P and dS terms, plus one
    rounding of each gradient to the inputs' dtype (autograd returns them in it, as torch does)."""
    torch = pytest.importorskip("torch")
    from fa_numba import autograd

    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(1, 2, 24, 16, generator=g).to(torch_dtype) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = autograd.attention(*leaves, causal=True, engine="mma")
    assert out.dtype == torch_dtype
    out.backward(dout)
    assert all(x.grad.dtype == torch_dtype for x in leaves)
    wide = [x.double().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*wide, is_causal=True).backward(dout.double())
    exact = [x.double().numpy() for x in (q, k, v, dout)]
    base = tolerance_backward.baseline_backward(*exact, causal=True, p_dtype=dtype)
    unit = {"float16": 2.0**-11, "bfloat16": 2.0**-8}[dtype]  # half an ulp, relative: the result's rounding
    # the two float64 references agree: each (ours, torch's autograd) within backward_bounds of the exact gradients
    agree = backward_bounds(*exact, causal=True)[:3]
    for name, leaf, ref, ours, atol, bound in zip("qkv", leaves, wide, (base.dq, base.dk, base.dv),
                                                  (base.atol_dq, base.atol_dk, base.atol_dv), agree):
        sdpa = ref.grad.numpy()
        assert_within(ours, sdpa, 2 * bound, name=f"d{name} float64")
        err = np.abs(leaf.grad.double().numpy() - sdpa).max()
        assert err <= atol + unit * np.abs(sdpa).max(), (name, err, atol)
