"""Score mods compiled into the CUDA-core kernels (issue 27, proofs/L13; fa_numba/kernels/score_mod.py):
every forward order and every backward variant, with every built-in and three user-written mods (one with a
captured table, one without captured arrays, one reading the batch index), against the float64 reference
with the derived rules (`tolerance.check_attention(score_mod=)`,
`tolerance_backward.check_attention_backward(score_mod=)`).

Problems are ragged on purpose (N_q = 13, N_k = 11, tiles of 4): a mod evaluated past N reads its captured
table out of bounds, which the simulator raises on. GQA (4 query heads over 2 K/V heads) and two batch
entries, so that a mod reading h or b at the wrong index shows. The default tier runs each (mod, mask) pair
on one order (the orders taken in turn); the slow tier runs every order.
"""

import fractions
import math

import numpy as np
import pytest

import fa_numba
from fa_numba import backend, masks, mods, reference, tolerance, tolerance_backward
from fa_numba.kernels import SIMT_VARIANTS
from fa_numba.kernels.score_mod import MAX_CAPTURED, ModCompileError
from test_mods import DECAY, key_bias

B, H, H_KV, N_Q, N_K, D = 2, 4, 2, 13, 11, 6
TILE = 4
BACKWARD_VARIANTS = (("kv", False), ("kv", True), ("q", False))
SIMULATOR = backend.name() == "simulator"


def _batch_bias(score, b, h, i, j, bias):
    return score + bias[b] * (i - j)


def _batch_bias_grad(score, b, h, i, j, bias):
    return 1.0


def batch_bias() -> mods.ScoreMod:
    """A user mod reading the batch index: a per-batch slope of (i - j)."""
    return mods.ScoreMod(_batch_bias, _batch_bias_grad, name="batch_bias", captured=(np.array([0.3, -0.2]),))


def _mods():
    rng = np.random.default_rng(7)
    return {
        "alibi": mods.alibi(2.0 ** (-8.0 * np.arange(1, H + 1) / H)),
        "softcap": mods.softcap(1.5),
        "relative_bias": mods.relative_bias(rng.standard_normal((H, N_Q + N_K - 1)), n_k=N_K),
        "temperature": mods.temperature(0.6),
        "key_bias": key_bias(rng.standard_normal((H, N_K))),
        "decay": DECAY,
        "batch_bias": batch_bias(),
    }


MODS = _mods()
MASKS = {
    "none": None,
    "causal": masks.causal(),
    "window": masks.sliding_window(3, 2),  # the block-mask path, "intervals" form
    "dense": masks.from_dense(np.random.default_rng(3).random((N_Q, N_K)) < 0.7),  # "dense" form
}
PAIRS = [(m, k) for m in MODS for k in MASKS]


def _inputs(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N_Q, D)).astype(dtype)
    k = rng.standard_normal((B, H_KV, N_K, D)).astype(dtype)
    v = rng.standard_normal((B, H_KV, N_K, D)).astype(dtype)
    dout = rng.standard_normal((B, H, N_Q, D)).astype(dtype)
    return q, k, v, dout


def _check_forward(order, mod_name, mask_name):
    q, k, v, _ = _inputs()
    mod, mask = MODS[mod_name], MASKS[mask_name]
    out, lse = fa_numba.attention(q, k, v, order=order, block_q=TILE, block_k=TILE, return_lse=True, mask=mask,
                                  score_mod=mod)
    tiles = dict(order="v1", block_q=TILE, block_k=TILE) if order.startswith("v1") else {}
    tolerance.check_attention(out, lse, q, k, v, mask=mask, score_mod=mod, name=f"{order} {mod_name}", **tiles)


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("pair", range(len(PAIRS)), ids=[f"{m}-{k}" for m, k in PAIRS])
def test_every_mod_and_mask_on_a_forward_order(pair):
    mod_name, mask_name = PAIRS[pair]  # every order meets every mask (and every mod) across the pairs
    _check_forward(SIMT_VARIANTS[(pair + pair // len(MASKS)) % len(SIMT_VARIANTS)], mod_name, mask_name)


@pytest.mark.slow
@pytest.mark.parametrize("order", SIMT_VARIANTS)
@pytest.mark.parametrize("pair", range(len(PAIRS)), ids=[f"{m}-{k}" for m, k in PAIRS])
def test_every_mod_and_mask_on_every_forward_order(order, pair):
    _check_forward(order, *PAIRS[pair])


def _check_backward(variant, mod_name, mask_name):
    order, deterministic = variant
    q, k, v, dout = _inputs(1)
    mod, mask = MODS[mod_name], MASKS[mask_name]
    out, lse = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, return_lse=True, mask=mask, score_mod=mod)
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, order=order, deterministic=deterministic,
                                        block_q=TILE, mask=mask, score_mod=mod)
    tolerance_backward.check_attention_backward(*grads, q, k, v, dout, mask=mask, score_mod=mod,
                                                name=f"{order}{' deterministic' if deterministic else ''} {mod_name}")
    return grads


# the default tier: each mod once, the masks and the variants taken in turn (every mask and every variant met)
BACKWARD_DEFAULT = [(m, list(MASKS)[n % len(MASKS)], BACKWARD_VARIANTS[n % len(BACKWARD_VARIANTS)])
                    for n, m in enumerate(MODS)]


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("case", BACKWARD_DEFAULT, ids=[f"{m}-{k}-{v[0]}{'-det' if v[1] else ''}"
                                                        for m, k, v in BACKWARD_DEFAULT])
def test_every_mod_on_a_backward_variant(case):
    mod_name, mask_name, variant = case
    _check_backward(variant, mod_name, mask_name)


@pytest.mark.slow
@pytest.mark.parametrize("variant", BACKWARD_VARIANTS, ids=["kv", "kv-deterministic", "q"])
@pytest.mark.parametrize("pair", range(len(PAIRS)), ids=[f"{m}-{k}" for m, k in PAIRS])
def test_every_mod_and_mask_on_every_backward_variant(variant, pair):
    grads = _check_backward(variant, *PAIRS[pair])
    if variant == ("kv", True):  # the deterministic mode stays bitwise repeatable with a mod
        again = _check_backward(variant, *PAIRS[pair])
        for first, second in zip(grads, again):
            np.testing.assert_array_equal(first, second)


MMA_PAIRS = [(m, causal) for m in MODS for causal in (False, True)]
MMA_DEFAULT = [n for n in range(len(MMA_PAIRS)) if n % 2 == (n // 2) % 2]  # each mod once, causal in turn
MMA_SLOW = [n for n in range(len(MMA_PAIRS)) if n not in MMA_DEFAULT]


def _mma_id(n):
    return f"{MMA_PAIRS[n][0]}-{'causal' if MMA_PAIRS[n][1] else 'none'}"


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("pair", MMA_DEFAULT, ids=[_mma_id(n) for n in MMA_DEFAULT])
def test_every_mod_on_the_tensor_core_forward(pair):
    _check_mma_forward(pair)


@pytest.mark.slow
@pytest.mark.parametrize("pair", MMA_SLOW, ids=[_mma_id(n) for n in MMA_SLOW])
def test_every_mod_on_the_tensor_core_forward_other_masks(pair):
    _check_mma_forward(pair)


def _check_mma_forward(pair):
    """The tensor-core forward (engine="mma") applies the mod on its S fragments: both orders in turn (every
    mod meets both), float16 and bfloat16 in turn, against the rule with the mod and P's 16-bit rounding."""
    mod_name, causal = MMA_PAIRS[pair]
    order, kind = ("v2", "v1")[pair % 2], ("float16", "bfloat16")[(pair // 2) % 2]
    q, k, v, _ = _inputs(20 + pair)
    if kind == "bfloat16":
        import ml_dtypes
        cast = ml_dtypes.bfloat16
    else:
        cast = np.float16
    q, k, v = (x.astype(cast) for x in (q, k, v))
    mod = MODS[mod_name]
    out, lse = fa_numba.attention(q, k, v, engine="mma", order=order, causal=causal, block_q=16, block_k=16,
                                  return_lse=True, score_mod=mod)
    tiles = dict(order="v1", block_q=16, block_k=16) if order == "v1" else {}
    tolerance.check_attention(out, lse, *(x.astype(np.float32) for x in (q, k, v)), causal=causal, score_mod=mod,
                              p_dtype=kind, name=f"{order}-mma {kind} {mod_name}", **tiles)


@pytest.mark.parametrize("order", ["v1", "v2"])
def test_the_tensor_core_exact_path_applies_the_mod(order):
    """A PARTIAL tile whose V holds a NaN (at the last key, which the causal mask hides from every row but the
    last) takes the CUDA-core P V (`exact_pv`), which recomputes the weights: with the mod too, so every row
    stays within the rule and only the last one is NaN."""
    q, k, v, _ = _inputs(30)
    q, k, v = (x[:1, :, :N_K].astype(np.float16) for x in (q, k, v))
    v[0, :, N_K - 1, 0] = np.nan
    mod = MODS["softcap"]
    out, lse = fa_numba.attention(q, k, v, engine="mma", order=order, causal=True, block_q=16, block_k=16,
                                  return_lse=True, score_mod=mod)
    assert np.isnan(out[0, :, N_K - 1, 0]).all() and np.isfinite(out[0, :, :N_K - 1]).all()
    tiles = dict(order="v1", block_q=16, block_k=16) if order == "v1" else {}
    tolerance.check_attention(out, lse, *(x.astype(np.float32) for x in (q, k, v)), causal=True, score_mod=mod,
                              p_dtype="float16", **tiles)


# (mod, deterministic, causal): one case in the default tier (the simulator's warp emulation makes each tens
# of seconds; alibi-det-causal moved to the slow tier on 2026-12-02 to keep the default run under 8 minutes),
# every mod in both modes and both masks in the slow tier
MMA_BACKWARD_CASES = [("softcap", False, False)]
MMA_BACKWARD_SLOW = [(m, d, c) for m in ("alibi", "softcap", "key_bias", "decay") for d in (False, True)
                     for c in (False, True) if (m, d, c) not in MMA_BACKWARD_CASES]


def _case_id(case):
    return f"{case[0]}-{'det' if case[1] else 'atomic'}-{'causal' if case[2] else 'none'}"


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("case", MMA_BACKWARD_CASES, ids=[_case_id(c) for c in MMA_BACKWARD_CASES])
def test_mods_on_the_tensor_core_backward(case):
    _check_mma_backward(*case, tiles=dict(block_q=16, block_k=16))  # one-warp blocks: the simulator's fastest


@pytest.mark.slow
@pytest.mark.parametrize("case", MMA_BACKWARD_SLOW, ids=[_case_id(c) for c in MMA_BACKWARD_SLOW])
def test_mods_on_the_tensor_core_backward_every_combination(case):
    _check_mma_backward(*case, repeat=True)


def _check_mma_backward(mod_name, deterministic, causal, repeat=False, tiles=None):
    """The tensor-core backward (engine="mma", atomic and deterministic) with P = exp(mod(S) - LSE) and dS = dS'
    mod'(S) on its fragments, both rounded to 16 bits, against the rule with the mod and those roundings;
    repeat: the deterministic mode twice, bitwise equal; tiles: the backward's (None: its defaults)."""
    tiles = tiles or {}
    q, k, v, dout = (x[:1].astype(np.float16) for x in _inputs(60))
    mod = MODS[mod_name]
    out, lse = fa_numba.attention(q, k, v, engine="mma", causal=causal, block_q=16, block_k=16, return_lse=True,
                                  score_mod=mod)
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, engine="mma", deterministic=deterministic,
                                        causal=causal, score_mod=mod, **tiles)
    tolerance_backward.check_attention_backward(*grads, *(x.astype(np.float32) for x in (q, k, v, dout)), causal=causal,
                                                score_mod=mod, p_dtype="float16", name=f"bwd-mma {mod_name}")
    if deterministic and repeat:
        again = fa_numba.attention_backward(q, k, v, out, lse, dout, engine="mma", deterministic=True,
                                            causal=causal, score_mod=mod)
        for first, second in zip(grads, again):
            np.testing.assert_array_equal(first, second)


def _identity(score, b, h, i, j):
    return score


def _one(score, b, h, i, j):
    return 1.0


IDENTITY = mods.ScoreMod(_identity, _one, name="identity")


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("order", SIMT_VARIANTS)
def test_the_identity_mod_gives_the_bits_of_no_mod(order):
    """The mod step changes nothing else: the identity gives the kernel's own bits without a mod (forward,
    and with the backward's chain rule times 1)."""
    q, k, v, dout = _inputs(2)
    run = dict(order=order, block_q=TILE, block_k=TILE, return_lse=True, mask=MASKS["window"])
    plain, modded = fa_numba.attention(q, k, v, **run), fa_numba.attention(q, k, v, score_mod=IDENTITY, **run)
    for x, y in zip(plain, modded):
        np.testing.assert_array_equal(x, y)
    if order == "v2":
        out, lse = plain
        for variant in BACKWARD_VARIANTS:
            back = dict(order=variant[0], deterministic=variant[1], block_q=TILE, causal=True)
            g0 = fa_numba.attention_backward(q, k, v, out, lse, dout, **back)
            g1 = fa_numba.attention_backward(q, k, v, out, lse, dout, score_mod=IDENTITY, **back)
            if variant != ("kv", False) or SIMULATOR:  # the atomic dQ's order is the GPU's to choose
                for x, y in zip(g0, g1):
                    np.testing.assert_array_equal(x, y)


def _sqrt_of_distance(score, b, h, i, j):
    return score + math.sqrt(i - j)  # a ValueError in the simulator, NaN on a GPU, above the diagonal


def _sqrt_grad(score, b, h, i, j):
    return 1.0


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("order", SIMT_VARIANTS)
def test_a_mod_is_never_evaluated_at_a_masked_pair(order):
    """L13 claim 2 in the kernels: above the causal diagonal the mod is undefined (the simulator raises, a
    GPU gives NaN), and a table NaN at the pairs a dense mask hides; neither reaches a result."""
    q, k, v, dout = _inputs(3)
    q, k, v, dout = (x[:, :, :N_K] for x in (q, k, v, dout))  # N_q = N_k: the diagonal i = j
    mod = mods.ScoreMod(_sqrt_of_distance, _sqrt_grad, name="sqrt_distance")
    out, lse = fa_numba.attention(q, k, v, order=order, block_q=TILE, block_k=TILE, causal=True, return_lse=True,
                                  score_mod=mod)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    tiles = dict(order="v1", block_q=TILE, block_k=TILE) if order.startswith("v1") else {}
    tolerance.check_attention(out, lse, q, k, v, causal=True, score_mod=mod, **tiles)
    if order == "v2":
        for variant in BACKWARD_VARIANTS:
            grads = fa_numba.attention_backward(q, k, v, out, lse, dout, order=variant[0], deterministic=variant[1],
                                                block_q=TILE, causal=True, score_mod=mod)
            assert all(np.isfinite(g).all() for g in grads)
            tolerance_backward.check_attention_backward(*grads, q, k, v, dout, causal=True, score_mod=mod)
    visible = np.random.default_rng(4).random((N_K, N_K)) < 0.6
    table = np.where(visible, 0.5, np.nan)[None].repeat(H, axis=0)  # NaN exactly where the mask hides the pair
    dense = key_table(table)
    out = fa_numba.attention(q, k, v, order=order, block_q=TILE, block_k=TILE, mask=masks.from_dense(visible),
                             score_mod=dense)
    assert np.isfinite(out).all()


def _pair_table(score, b, h, i, j, table):
    return score + table[h, i, j]


def _pair_table_grad(score, b, h, i, j, table):
    return 1.0


def key_table(table):
    return mods.ScoreMod(_pair_table, _pair_table_grad, name="pair_table", captured=(table,))


def test_rows_that_see_no_key_stay_zero_with_a_mod():
    """A row the mask hides completely gets O = 0, LSE = -inf, and zero gradients, mod or not."""
    q, k, v, dout = _inputs(5)
    visible = np.ones((N_Q, N_K), bool)
    visible[[0, 5, 12]] = False
    mask, mod = masks.from_dense(visible), MODS["softcap"]
    for order in SIMT_VARIANTS:
        out, lse = fa_numba.attention(q, k, v, order=order, block_q=TILE, block_k=TILE, return_lse=True, mask=mask,
                                      score_mod=mod)
        assert (out[:, :, [0, 5, 12]] == 0).all() and (lse[:, :, [0, 5, 12]] == -np.inf).all(), order
    dq, _, _ = fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=TILE, mask=mask, score_mod=mod)
    assert (dq[:, :, [0, 5, 12]] == 0).all()


def _fraction(score, b, h, i, j):
    return score + float(fractions.Fraction(i, 3))


def test_a_mod_numba_cannot_compile_is_named_before_any_launch():
    q, k, v, _ = _inputs()
    bad = mods.ScoreMod(_fraction, name="thirds")
    with pytest.raises(ModCompileError, match=r"score_mod thirds: Numba cannot compile fn \(_fraction\)"):
        fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, score_mod=bad)


def _grad_only(score, b, h, i, j):
    return float(fractions.Fraction(1, 1))


def test_a_grad_numba_cannot_compile_is_named_by_the_backward():
    q, k, v, dout = _inputs()
    mod = mods.ScoreMod(_identity, _grad_only, name="bad_grad")
    out, lse = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, return_lse=True, score_mod=mod)  # fn compiles
    with pytest.raises(ModCompileError, match=r"score_mod bad_grad: Numba cannot compile grad \(_grad_only\)"):
        fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=TILE, score_mod=mod)


def test_what_the_kernels_refuse_is_named():
    q, k, v, dout = _inputs()
    forward_only = mods.ScoreMod(_identity, name="forward_only")
    out, lse = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, return_lse=True, score_mod=forward_only)
    with pytest.raises(ValueError, match="score_mod forward_only has no grad"):
        fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=TILE, score_mod=forward_only)
    many = mods.ScoreMod(_identity_many, name="many", captured=(np.zeros(1),) * (MAX_CAPTURED + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_CAPTURED} captured arrays"):
        fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, score_mod=many)
    with pytest.raises(ValueError, match="alibi: slopes must have one entry per query head"):
        fa_numba.attention(q[:, :2], k[:, :1], v[:, :1], block_q=TILE, block_k=TILE, score_mod=MODS["alibi"])
    with pytest.raises(TypeError, match="score_mod must be a fa_numba.mods.ScoreMod"):
        fa_numba.attention(q, k, v, score_mod=_identity)


def _identity_many(score, b, h, i, j, *captured):
    return score


def test_leading_batch_axes_give_the_mod_the_flattened_batch_index():
    """b is the index over the flattened leading axes (mods' convention): (2, 1, H, N, d) is (2, H, N, d)."""
    q, k, v, _ = _inputs(6)
    mod = MODS["batch_bias"]
    flat = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, score_mod=mod)
    nested = fa_numba.attention(q[:, None], k[:, None], v[:, None], block_q=TILE, block_k=TILE, score_mod=mod)
    np.testing.assert_array_equal(flat, nested[:, 0])


def test_a_hand_built_mod_reads_its_arrays_at_every_call():
    q, k, v, _ = _inputs(8)
    table = np.zeros((H, N_K))
    mod = key_bias(table)
    before = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, score_mod=mod)
    mod.captured[0][:] = 2.0 * np.arange(N_K) / N_K  # in place: the next call sees it
    after = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, score_mod=mod)
    assert not np.array_equal(before, after)
    expected, _ = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), score_mod=mod)
    np.testing.assert_allclose(after, expected, atol=1e-5)


def _torch():
    return pytest.importorskip("torch", reason="needs PyTorch (the 'torch' extra)")


def test_autograd_with_a_mod_matches_the_rule_and_compiles_in_one_graph():
    torch = _torch()
    import fa_numba.autograd as fa

    q, k, v, dout = _inputs(9)
    mod = MODS["relative_bias"]
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = fa.attention(tq, tk, tv, causal=True, score_mod=mod, block_q=TILE, block_k=TILE, backward_block=TILE)
    out.backward(torch.from_numpy(dout))
    _, lse = fa_numba.attention(q, k, v, causal=True, return_lse=True, score_mod=mod, block_q=TILE, block_k=TILE)
    tolerance.check_attention(out.detach().numpy(), lse, q, k, v, causal=True, score_mod=mod)
    tolerance_backward.check_attention_backward(tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy(), q, k, v, dout,
                                                causal=True, score_mod=mod)
    compiled = torch.compile(lambda a, b, c: fa.attention(a, b, c, causal=True, score_mod=mod, block_q=TILE,
                                                          block_k=TILE), fullgraph=True, backend="eager")
    again = compiled(*(torch.from_numpy(x) for x in (q, k, v)))
    np.testing.assert_array_equal(again.numpy(), out.detach().numpy())


def test_a_mod_that_is_gone_is_a_clear_error_and_a_per_head_mask_takes_a_mod():
    torch = _torch()
    import fa_numba.autograd as fa
    from fa_numba import torch_ops

    q, k, v, _ = (torch.from_numpy(x) for x in _inputs(10))
    mod = mods.softcap(2.0)
    key = mod.key
    assert mods.lookup(key) is mod
    del mod
    import gc

    gc.collect()
    with pytest.raises(RuntimeError, match=f"score_mod '{key}' is no longer alive"):
        torch_ops.attention_op(q, k, v, False, 0.5, "v2", "", None, "auto", TILE, TILE, "kv", False, TILE, key)
    # a mask per head and a mod in one launch (slice_masks): b and h are the problem's, within the rule
    per_head = torch.rand(H, N_Q, N_K, generator=torch.Generator().manual_seed(3)) < 0.7
    out = fa.attention(q, k, v, mask=per_head, score_mod=MODS["softcap"], block_q=TILE, block_k=TILE,
                       out_dtype=torch.float32)
    mask = masks.from_dense(per_head.numpy()[None])
    _, lse = fa_numba.attention(q.numpy(), k.numpy(), v.numpy(), mask=mask, score_mod=MODS["softcap"],
                                block_q=TILE, block_k=TILE, return_lse=True)
    tolerance.check_attention(out.numpy(), lse, q.numpy(), k.numpy(), v.numpy(), mask=mask,
                              score_mod=MODS["softcap"])


# ----------------------------------------------------------------------------------------------------
# The captured arrays' gradients (kernels/captured_grad.py): no atomics, bitwise repeatable.

_DIFFERENTIABLE = [m for m in MODS if any(cg is not None for cg in MODS[m].captured_grad)]
# two masks per mod, taken in turn: every mask form meets several mods
CAPTURED_PAIRS = [(m, list(MASKS)[(2 * n + t) % len(MASKS)]) for n, m in enumerate(_DIFFERENTIABLE) for t in (0, 1)]
CAPTURED_DEFAULT = CAPTURED_PAIRS[::2]  # each mod once (every mask form met across them); the slow tier: the rest


@pytest.mark.lemma("L13")
@pytest.mark.parametrize("pair", CAPTURED_DEFAULT, ids=[f"{m}-{k}" for m, k in CAPTURED_DEFAULT])
def test_captured_gradients_against_the_rule(pair):
    _check_captured(*pair)


@pytest.mark.slow
@pytest.mark.parametrize("pair", CAPTURED_PAIRS[1::2], ids=[f"{m}-{k}" for m, k in CAPTURED_PAIRS[1::2]])
def test_captured_gradients_against_the_rule_other_masks(pair):
    _check_captured(*pair)


def _check_captured(mod_name, mask_name):
    """Every mod with a differentiable captured array (ALiBi's slopes, softcap's cap, the relative table,
    the temperature, a user's key bias) against the float64 reference with the 3x rule."""
    q, k, v, dout = _inputs(40 + CAPTURED_PAIRS.index((mod_name, mask_name)))
    mod, mask = MODS[mod_name], MASKS[mask_name]
    out, lse = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, return_lse=True, mask=mask, score_mod=mod)
    *_, dcaptured = fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=TILE, mask=mask, score_mod=mod,
                                                captured_grads=True)
    tolerance_backward.check_captured_gradients(dcaptured, q, k, v, dout, score_mod=mod, mask=mask,
                                                name=f"{mod_name} {mask_name}")


def test_captured_gradients_are_bitwise_repeatable_and_independent_of_the_chunking(monkeypatch):
    from fa_numba.kernels import captured_grad

    q, k, v, dout = _inputs(50)
    mod = MODS["relative_bias"]
    out, lse = fa_numba.attention(q, k, v, causal=True, block_q=TILE, block_k=TILE, return_lse=True, score_mod=mod)
    run = dict(causal=True, block_q=TILE, score_mod=mod, captured_grads=True)
    first = fa_numba.attention_backward(q, k, v, out, lse, dout, **run)[3]
    again = fa_numba.attention_backward(q, k, v, out, lse, dout, **run)[3]
    size = mod.captured[0].size
    monkeypatch.setattr(captured_grad, "WORKSPACE_BYTES", 8 * size * 10)  # 10 rows a chunk: 11 chunks here
    chunked = fa_numba.attention_backward(q, k, v, out, lse, dout, **run)[3]
    for x in (again, chunked):
        np.testing.assert_array_equal(x[0], first[0])
        assert x[1] is None


def _outside(score, b, h, i, j, bias):
    return (h, j + 1), 1.0  # j + 1 = N_k for the last key: past the table


def _bare(score, b, h, i, j, slopes):
    return h, 1.0  # a bare int index: the reference takes it, the kernels need (h,)


def test_captured_gradient_errors_are_named():
    q, k, v, dout = _inputs(51)
    out, lse = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, return_lse=True)
    outside = mods.ScoreMod(_key_bias_fn, _one_grad, (_outside,), "outside", (np.zeros((H, N_K)),), ("bias",))
    with pytest.raises(mods.ModError, match=r"score_mod outside: captured_grad\[0\] \(bias\) returned an index "
                                            r"outside shape \(4, 11\)"):
        fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=TILE, score_mod=outside, captured_grads=True)
    bare = mods.ScoreMod(_alibi_fn, _one_grad, (_bare,), "bare", (np.zeros(H),))
    with pytest.raises(ModCompileError, match=r"captured_grad\[0\].*a single int index: wrap it"):
        fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=TILE, score_mod=bare, captured_grads=True)
    with pytest.raises(ValueError, match="captured_grads=True needs a score_mod"):
        fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=TILE, captured_grads=True)


def _key_bias_fn(score, b, h, i, j, bias):
    return score + bias[h, j]


def _alibi_fn(score, b, h, i, j, slopes):
    return score + slopes[h] * (j - i)


def _one_grad(score, b, h, i, j, captured):
    return 1.0


# ----------------------------------------------------------------------------------------------------
# 16-bit captured arrays, and a mod's function that raises (issue 50).


def test_a_float16_captured_array_runs_as_its_float32_widening():
    """A float16 (and bfloat16) table is read as float32 by the kernels: the bits of the float32 copy's
    result, within the rule of the float64 reference with the 16-bit mod, and read again at every call."""
    q, k, v, dout = _inputs(60)
    rng = np.random.default_rng(61)
    half = rng.standard_normal((H, N_K)).astype(np.float16)
    tables = [half]
    try:
        import ml_dtypes
    except ImportError:
        pass
    else:
        tables.append(rng.standard_normal((H, N_K)).astype(ml_dtypes.bfloat16))
    for table in tables:
        mod = key_bias(table)
        out, lse = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, return_lse=True, score_mod=mod)
        wide_out, wide_lse = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, return_lse=True,
                                                score_mod=key_bias(table.astype(np.float32)))
        assert np.array_equal(out, wide_out) and np.array_equal(lse, wide_lse), table.dtype
        tolerance.check_attention(out, lse, q, k, v, score_mod=mod, name=f"{table.dtype} table")
    mod = key_bias(half)
    out, lse = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, return_lse=True, score_mod=mod)
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=TILE, score_mod=mod)
    tolerance_backward.check_attention_backward(*grads, q, k, v, dout, score_mod=mod)
    half[:] = np.float16(2.0) * np.arange(N_K) / N_K  # in place: the next call sees it
    moved = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, score_mod=mod)
    assert not np.array_equal(moved, out)
    assert np.array_equal(moved, fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE,
                                                    score_mod=key_bias(half.astype(np.float32))))


def _raises_at(score, b, h, i, j):
    if b == 0 and h == 1 and i == 3 and j == 2:
        raise ValueError("bad pair")
    return score


def _raises_grad_at(score, b, h, i, j):
    if b == 0 and h == 1 and i == 4 and j == 0:
        raise KeyError("bad grad")
    return 1.0


def _raises_captured_grad_at(score, b, h, i, j, slopes):
    if h == 0 and i == 2 and j == 1:
        raise ZeroDivisionError("bad captured grad")
    return (h,), float(j - i)


@pytest.mark.skipif(not SIMULATOR, reason="a GPU reports no raise in a device function (fa_numba.mods)")
def test_a_mod_that_raises_in_a_simulated_kernel_is_a_mod_error_naming_the_pair():
    """The simulator runs the mod as Python: a raise at one pair is a ModError naming the mod, its function,
    its role and the pair (b, h, i, j), with the function's own exception as __cause__, not the simulator's
    bare 'tid=[..] ctaid=[..]: bad pair'. Forward (each order), the backward's grad, a captured_grad."""
    rng = np.random.default_rng(62)
    q, k, v, dout = (rng.standard_normal((1, 2, 5, 4)).astype(np.float32) for _ in range(4))
    mod = mods.ScoreMod(_raises_at, _one_grad_plain, name="picky")
    for order in SIMT_VARIANTS:
        with pytest.raises(mods.ModError) as caught:
            fa_numba.attention(q, k, v, order=order, block_q=TILE, block_k=TILE, score_mod=mod)
        message = str(caught.value)
        assert message.startswith("score_mod picky: fn (_raises_at) raised ValueError: bad pair at b=0, h=1, i=3, "
                                  "j=2, score="), (order, message)
        assert type(caught.value.__cause__) is ValueError and caught.value.__cause__.args == ("bad pair",), order
    out, lse = fa_numba.attention(q, k, v, block_q=TILE, block_k=TILE, return_lse=True)
    bad_grad = mods.ScoreMod(_identity, _raises_grad_at, name="picky_grad")
    for variant in BACKWARD_VARIANTS:
        with pytest.raises(mods.ModError, match=r"^score_mod picky_grad: grad \(_raises_grad_at\) raised KeyError: "
                                                r"'bad grad' at b=0, h=1, i=4, j=0, score=") as caught:
            fa_numba.attention_backward(q, k, v, out, lse, dout, order=variant[0], deterministic=variant[1],
                                        block_q=TILE, score_mod=bad_grad)
        assert type(caught.value.__cause__) is KeyError, variant
    slopes = mods.ScoreMod(_alibi_fn, _one_grad, (_raises_captured_grad_at,), "picky_slopes", (np.zeros(2),),
                           ("slopes",))
    with pytest.raises(mods.ModError, match=r"^score_mod picky_slopes: captured_grad\[0\] \(slopes\) "
                                            r"\(_raises_captured_grad_at\) raised ZeroDivisionError: bad captured "
                                            r"grad at b=0, h=0, i=2, j=1, score=") as caught:
        fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=TILE, score_mod=slopes, captured_grads=True)
    assert type(caught.value.__cause__) is ZeroDivisionError


def _one_grad_plain(score, b, h, i, j):
    return 1.0
