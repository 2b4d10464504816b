"""Two m16 row blocks a warp in the tensor-core v2 forward (kernels.mma.engine, MmaConfig.row_blocks = 2).

A warp that owns 32 query rows reads each K_j and V_j fragment from shared memory once and feeds it to both row
blocks' products (FlashAttention-2's layout); its Q fragments come from the staged Q_i at every tile. Nothing
else changes: every row's S takes the same mma.sync products in the same k order, its softmax the same
operations, its P V the same products in the same key order. So a block of W warps of two row blocks gives the
bits of a block of 2 W warps of one row block (the same B_r, the same tiles, the same masks): that equality is
the test, on every path the kernel has (closed-form causal, block-mask lists, the exact CUDA-core path of a
PARTIAL tile with a NaN value, plain loads and cp.async, pipelined or one stage, tails in N and d, GQA,
d_v != d, an odd count of k-steps, bfloat16), and one case against the float64 reference with the derived rule.
A GPU's tensor cores are deterministic, so the equality holds there too.

Simulator cost: a plain-load launch of a 32-row block takes seconds; a cp.async launch tens of seconds. The
default tier keeps one plain-load case; the slow tier the rest.
"""

import numpy as np
import pytest
from numba import cuda

import fa_numba
import fragments as fr
from fa_numba import masks, reference, tolerance
from fa_numba.kernels.block_lists import kernel_mask
from fa_numba.kernels.mma.engine_v2 import make_v2_mma
from strategies import Case

SLOW = pytest.mark.slow
BITS = {"float16": fr.bits_f16, "bfloat16": fr.bits_bf16}
VALUES = {"float16": fr.value_f16, "bfloat16": fr.value_bf16}


def _run(kernel, bits, d_v, mask_of=None):
    q, k, v = bits
    o = cuda.to_device(np.full(q.shape[:3] + (d_v,), np.nan, np.float32))
    lse = cuda.to_device(np.full(q.shape[:3], np.nan, np.float32))
    blocks = None if mask_of is None else mask_of(kernel.config.block_q, kernel.config.block_k)
    kernel(*(cuda.to_device(x) for x in bits), o, lse, 1 / np.sqrt(q.shape[-1]), mask=blocks)
    return o.copy_to_host(), lse.copy_to_host()


def _both(kind, warps, block_k, d, causal, bits, d_v=None, mask=None, **kw):
    """(two row blocks a warp on `warps` warps, one row block on 2 `warps`): the same B_r = 32 warps."""
    n_q, n_k, heads = bits[0].shape[2], bits[1].shape[2], bits[0].shape[1]
    form = "none" if mask is None else mask.kernel_form()
    mask_of = None if mask is None else (lambda bq, bk: kernel_mask(mask, n_q, n_k, bq, bk, 1, heads))
    two = make_v2_mma(kind, warps, block_k, d, causal, value_dim=d_v, mask_form=form, row_blocks=2, **kw)
    one = make_v2_mma(kind, 2 * warps, block_k, d, causal, value_dim=d_v, mask_form=form, **kw)
    assert two.config.block_q == one.config.block_q == 32 * warps and two.config.row_blocks == 2
    return _run(two, bits, d_v or d, mask_of), _run(one, bits, d_v or d, mask_of)


def _inputs(case: Case, kind="float16", d_v=None, nan_at=None):
    q, k, v = case.inputs(np.float32)
    if d_v is not None:
        v = np.random.default_rng(case.seed + 1).standard_normal(v.shape[:3] + (d_v,)).astype(np.float32)
    if nan_at is not None:
        v[nan_at] = np.nan
    bits = [BITS[kind](x) for x in (q, k, v)]
    return bits, [VALUES[kind](b).astype(np.float64) for b in bits]


def _same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_two_row_blocks_give_the_bits_of_twice_the_warps_and_pass_the_rule():
    """Causal with N_q > N_k (rows that see nothing), tails in N and d, plain loads, one stage; a NaN value in
    key 9 that rows 0-13 do not see, so a PARTIAL tile takes the exact path in each row block (GQA: the slow
    tier's cases)."""
    case = Case(n_q=36, n_k=31, d=20, block_q=32, block_k=16, causal=True, seed=3)
    bits, (q, k, v) = _inputs(case, nan_at=(0, 0, 9, 3))
    two, one = _both("float16", 1, 16, case.d, True, bits, async_copy=False)
    _same(two, one)
    out, lse = two
    tolerance.check_attention(out, lse, q, k, v, causal=True, name="v2-mma two row blocks", order="v2",
                              block_q=32, block_k=16, p_dtype="float16")
    delta = case.n_k - case.n_q  # row r sees keys <= r + delta: rows 0-4 see nothing, 5-13 not key 9
    assert (out[0, :, :-delta] == 0).all() and np.isneginf(lse[0, :, :-delta]).all()
    assert not np.isnan(out[0, :, : 9 - delta]).any() and np.isnan(out[0, :, 9 - delta:, 3]).all()


@SLOW
@pytest.mark.parametrize("kind,d,d_v,causal,block_k,pipelined", [
    ("float16", 64, None, False, 64, None),  # cp.async, pipelined: the shipped layout's path; 4 k-steps
    ("float16", 48, None, True, 32, None),  # an odd k-step count (3), causal pipelined
    ("bfloat16", 32, None, True, 16, False),  # cp.async in one stage
    ("float16", 32, 16, True, 32, None),  # d_v != d
], ids=lambda x: str(x))
def test_two_row_blocks_give_the_same_bits_on_every_staging_path(kind, d, d_v, causal, block_k, pipelined):
    case = Case(n_q=50, n_k=61, d=d, block_q=64, block_k=block_k, causal=causal, seed=5, group=2)
    bits, _ = _inputs(case, kind, d_v)
    two, one = _both(kind, 2, block_k, d, causal, bits, d_v=d_v, pipelined=pipelined)
    _same(two, one)
    assert np.isfinite(two[0]).all()


@SLOW
@pytest.mark.parametrize("name", ["window", "dense"])
def test_two_row_blocks_walk_a_block_masks_lists_as_one_does(name):
    """A block mask's lists on B_r = 32 tiles (intervals, dense bytes), a NaN value behind the mask: the same
    bits with two row blocks a warp as with one."""
    case = Case(n_q=45, n_k=50, d=16, block_q=32, block_k=16, causal=False, seed=7, group=1)
    bits, (q, k, v) = _inputs(case, nan_at=(0, 0, 20, 2))
    i, j = np.arange(case.n_q)[:, None], np.arange(case.n_k)[None, :]
    mask = (masks.sliding_window(6, 0) if name == "window" else
            masks.from_dense(((i + j) % 3 != 0) & (j <= i + 5)))
    two, one = _both("float16", 1, 16, case.d, False, bits, mask=mask, async_copy=False)
    _same(two, one)
    tolerance.check_attention(*two, q, k, v, mask=mask, name=f"v2-mma two row blocks {name}", order="v2",
                              block_q=32, block_k=16, p_dtype="float16")


@SLOW
def test_the_api_takes_two_row_blocks_at_its_128_row_tiles_with_a_mod_and_a_mask_mod():
    """fa_numba.attention at block_q = 128 on 16-bit inputs, d <= 64 (engines.mma_tiles: 4 warps of two row
    blocks), with a score mod and a mask_mod compiled in: within the derived rule."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, n, 16)).astype(np.float16) for n in (130, 140, 140))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    mod = fa_numba.mods.softcap(20.0)
    mask = masks.mask_mod(lambda b, h, r, c: c <= r + 10 and (c + h) % 5 != 0)
    out, lse = fa_numba.attention(q, k, v, engine="mma", block_q=128, block_k=64, score_mod=mod, mask=mask,
                                  return_lse=True)
    tolerance.check_attention(out, lse, q64, k64, v64, mask=mask, score_mod=mod, name="v2-mma 128 rows mod",
                              order="v2", block_q=128, block_k=64, p_dtype="float16")
    ref, _ = reference.attention(q64, k64, v64, mask=mask, score_mod=mod)
    assert out.shape == ref.shape
