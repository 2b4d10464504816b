"""The tensor-core forwards (fa_numba.kernels.mma: engine_v2, engine_v1) against the float64 reference.

Judged by the derived rule with the terms this kernel adds (tolerance: the online rescalings, v1's round trips, and the
rounding of P to the input's 16-bit type before P V, proofs/L6 part 7), and by flash-attn's own criterion
(err <= 2 x the error of a naive attention computed in the input dtype). In the simulator the mma.sync
products are emulated (fa_numba.warp.emulated_tc); on a GPU the same tests run on the tensor cores. Shapes stay
small: a launch of two 64-thread blocks takes about 2 s in the simulator (2 cores).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

import fragments as fr
import fa_numba
from fa_numba import profile, reference, tolerance
from fa_numba.warp import emulated_tc
from fa_numba.kernels.mma.engine import MmaConfig
from fa_numba.kernels.mma.engine_v1 import make_v1_mma
from fa_numba.kernels.mma.engine_v2 import make_v2_mma
from strategies import Case

BITS = {"float16": lambda x: fr.bits_f16(x), "bfloat16": lambda x: fr.bits_bf16(x)}
VALUES = {"float16": fr.value_f16, "bfloat16": fr.value_bf16}


def sixteen_bit(case: Case, kind: str):
    """The case's inputs rounded to `kind`: (bits for the kernel, their exact values as float64)."""
    bits = [BITS[kind](x.astype(np.float32)) for x in case.inputs(np.float64)]
    return bits, [VALUES[kind](b).astype(np.float64) for b in bits]


MAKE = {"v1": make_v1_mma, "v2": make_v2_mma}


def run(case: Case, kind: str, warps: int, bits=None, async_copy=None, order="v2"):
    if bits is None:
        bits, _ = sixteen_bit(case, kind)
    q, k, v = bits
    kernel = MAKE[order](kind, warps, case.block_k, case.d, case.causal, async_copy)
    o = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    lse = cuda.to_device(np.full(q.shape[:-1], np.nan, np.float32))
    kernel(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), o, lse, 1 / np.sqrt(case.d))
    return o.copy_to_host(), lse.copy_to_host()


def naive_in(kind: str, q, k, v, causal: bool):
    """flash-attn's yardstick: attention with every stage rounded to the input dtype (S, P and O), products
    accumulated in float32 as a 16-bit matmul does."""
    def r16(x):
        return VALUES[kind](BITS[kind](np.asarray(x, np.float32))).astype(np.float64)

    scale = 1 / np.sqrt(q.shape[-1])
    s = r16(np.einsum("bhqd,bhkd->bhqk", q.astype(np.float32), _expand(k, q).astype(np.float32)) * scale)
    visible = reference.visible_mask(q.shape[2], k.shape[2], causal)
    s = np.where(visible, s, -np.inf)
    with np.errstate(invalid="ignore"):
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(m), m, 0))
        p = r16(p / p.sum(axis=-1, keepdims=True))
    out = r16(np.einsum("bhqk,bhkd->bhqd", p.astype(np.float32), _expand(v, q).astype(np.float32)))
    return np.where(visible.any(axis=-1)[..., None], out, 0.0)


def _expand(kv, q):
    return np.repeat(kv, q.shape[1] // kv.shape[1], axis=1)


SLOW = pytest.mark.slow  # a launch of two 64-thread blocks takes seconds in the simulator: the default run keeps
# one case per hard class, the slow tier the rest
CASES = [  # (case, warps): tails in N and d, GQA, N_q > N_k causal (rows that see nothing), N = 1
    pytest.param(Case(n_q=37, n_k=45, d=20, block_q=32, block_k=16, causal=False, seed=1, group=2), 2, marks=SLOW),
    pytest.param(Case(n_q=37, n_k=45, d=20, block_q=32, block_k=16, causal=True, seed=2, group=2), 2, marks=SLOW),
    (Case(n_q=40, n_k=24, d=32, block_q=16, block_k=32, causal=True, seed=3), 1),
    (Case(n_q=1, n_k=1, d=16, block_q=16, block_k=16, causal=False, seed=4), 1),
    pytest.param(Case(n_q=17, n_k=33, d=64, block_q=16, block_k=16, causal=True, seed=5), 1, marks=SLOW),
]


def _id(x):
    if isinstance(x, Case):
        return f"nq{x.n_q}-nk{x.n_k}-d{x.d}-bk{x.block_k}-g{x.group}-{'causal' if x.causal else 'full'}"
    return f"w{x}"


KINDS = ["float16", pytest.param("bfloat16", marks=SLOW)]  # bfloat16 in the default run: the P-term test below


@pytest.mark.lemma("L6")
@pytest.mark.parametrize("order", ["v1", "v2"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case,warps", CASES, ids=_id)
def test_mma_matches_reference_within_the_derived_rule(order, kind, case, warps):
    """Both orders on tensor cores, each judged with its own terms (v1: its O round trips through HBM)."""
    bits, (q, k, v) = sixteen_bit(case, kind)
    out, lse = run(case, kind, warps, bits, order=order)
    check = tolerance.check_attention(out, lse, q, k, v, causal=case.causal, name=f"{order}-mma {kind}",
                                      order=order, block_q=16 * warps, block_k=case.block_k, p_dtype=kind)
    # flash-attn's criterion, on the same inputs: no worse than twice a naive attention in the input dtype
    ref_out, _ = reference.attention(q, k, v, causal=case.causal)
    naive_err = tolerance.max_error(naive_in(kind, q, k, v, case.causal), ref_out)
    assert check.err_out <= 2 * naive_err + tolerance.rounding_floor(ref_out), (check.err_out, naive_err)


@SLOW
def test_plain_loads_and_cp_async_staging_give_the_same_bits():
    """The two ways of staging a tile put the same bits in shared memory, so the results agree exactly."""
    case = Case(n_q=20, n_k=40, d=32, block_q=16, block_k=16, causal=True, seed=17)
    bits, _ = sixteen_bit(case, "float16")
    assert make_v2_mma("float16", 1, 16, 32, True).config.async_copy
    out_a, lse_a = run(case, "float16", 1, bits, async_copy=True)
    out_p, lse_p = run(case, "float16", 1, bits, async_copy=False)
    np.testing.assert_array_equal(out_a, out_p)
    np.testing.assert_array_equal(lse_a, lse_p)


@pytest.mark.parametrize("land_at", ["wait", "issue"])
@pytest.mark.parametrize("kind", ["float16", pytest.param("float32", marks=SLOW)])
def test_the_pipelined_copies_give_the_one_stage_bits_and_the_exact_path_still_sees_k(kind, land_at, monkeypatch):
    """v2's copies in FlashAttention-2's order (V_j beside S, K_j+1 beside the softmax and P V) change when a
    tile lands, not what is computed: the same bits as the one-stage build, whether each copy lands at its
    wait (a tile read before its wait reads the old bits) or at its issue (a K_j+1 issued over a K_j that is
    still to be read replaces it): fa_numba.warp.emulated_tc.LAND_AT; on a GPU the hardware decides. The
    case: 2 warps (32 rows) over 16-key tiles, causal, a NaN value in key 9, which rows 0-3 do not see: tile 0
    is PARTIAL with a non-finite V_j, so it takes the exact path, which reads K_j again, and K_1 is issued after
    it; GQA and tails in N and d."""
    if fa_numba.backend.name() == "simulator":
        monkeypatch.setattr(emulated_tc, "LAND_AT", land_at)
    elif land_at == "issue":
        pytest.skip("the GPU lands copies when it does: one run covers it (land_at names the emulation's choice)")
    case = Case(n_q=40, n_k=45, d=24, block_q=32, block_k=16, causal=True, seed=19, group=2)
    q, k, v = case.inputs(np.float32)
    v[0, 0, 9, 3] = np.nan
    arrays = [fr.bits_f16(x) for x in (q, k, v)] if kind == "float16" else [q, k, v]
    results = []
    for pipelined in (True, False):
        kernel = make_v2_mma(kind, 2, 16, case.d, True, pipelined=pipelined)
        assert kernel.config.async_copy and kernel.config.pipelines == pipelined
        o = cuda.to_device(np.full(q.shape, np.nan, np.float32))
        lse = cuda.to_device(np.full(q.shape[:-1], np.nan, np.float32))
        kernel(*(cuda.to_device(x) for x in arrays), o, lse, 1 / np.sqrt(case.d))
        results.append((o.copy_to_host(), lse.copy_to_host()))
    (out, lse), (out_one, lse_one) = results
    np.testing.assert_array_equal(out, out_one)
    np.testing.assert_array_equal(lse, lse_one)
    # the exact path kept key 9's NaN from the rows that do not see it (delta = 5: row r sees keys <= r + 5);
    # query heads 0 and 1 read K/V head 0
    assert not np.isnan(out[0, :2, :4]).any() and np.isnan(out[0, :2, 4:, 3]).all()
    assert np.isfinite(lse).all()


@pytest.mark.lemma("L6")
def test_the_p_rounding_term_is_what_lets_16_bit_p_pass():
    """Without the term the rule is too tight for P rounded to bfloat16 (8 bits), with it the kernel passes:
    the term is needed, and it is enough. A value tensor far from its mean makes the rounding visible."""
    case = Case(n_q=16, n_k=48, d=16, block_q=16, block_k=16, causal=False, seed=11)
    bits, (q, k, v) = sixteen_bit(case, "bfloat16")
    v = v + 4.0  # |V| large against O's spread: P's rounding moves O by about u16 |V|
    bits[2] = fr.bits_bf16(v.astype(np.float32))
    v = fr.value_bf16(bits[2]).astype(np.float64)
    out, lse = run(case, "bfloat16", 1, bits)
    base = tolerance.baseline(q, k, v, block_q=16, block_k=16, p_dtype="bfloat16")
    tolerance.judge(out, lse, base, name="v2-mma bfloat16", order="v2")
    without = tolerance.baseline(q, k, v, block_q=16, block_k=16)
    with pytest.raises(AssertionError, match="beyond atol"):
        tolerance.judge(out, lse, without, name="v2-mma bfloat16 without the P term", order="v2")


@pytest.mark.parametrize("order", ["v1", "v2"])
@pytest.mark.parametrize("where,expect", [
    ("masked value", "clean"),  # key 5 is hidden from rows 0-4 (causal): its NaN must not reach them
    ("visible value", "column"),  # a value every row sees: that column NaN for the rows that see it
    ("query", "row"),  # row 3's query: row 3 NaN, LSE NaN
])
def test_mma_non_finite_inputs_follow_the_dense_rule(where, expect, order):
    case = Case(n_q=16, n_k=16, d=16, block_q=16, block_k=16, causal=True, seed=13)
    bits, (q, k, v) = sixteen_bit(case, "float16")
    target, index = {"masked value": ("v", (0, 0, 5, 3)), "visible value": ("v", (0, 0, 0, 3)),
                     "query": ("q", (0, 0, 3, 7))}[where]
    arrays = {"q": q, "k": k, "v": v}
    arrays[target][index] = np.nan
    bits = [fr.bits_f16(arrays[n].astype(np.float32)) for n in "qkv"]
    out, lse = run(case, "float16", 1, bits, order=order)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True)
    tolerance.check_attention(out, lse, q, k, v, causal=True, name=f"{order}-mma nan", order=order, block_q=16,
                              block_k=16, p_dtype="float16")
    nan_rows = np.isnan(out[0, 0]).any(axis=-1)
    if expect == "clean":  # rows 0-4 untouched, rows 5-15 (which see key 5) NaN in column 3 only
        assert not np.isnan(out[0, 0, :5]).any() and np.isnan(out[0, 0, 5:, 3]).all()
        assert not np.isnan(np.delete(out[0, 0], 3, axis=-1)).any()
    elif expect == "column":
        assert np.isnan(out[0, 0, :, 3]).all() and not np.isnan(np.delete(out[0, 0], 3, axis=-1)).any()
    else:
        assert list(np.flatnonzero(nan_rows)) == [3] and np.isnan(lse[0, 0, 3]) and np.isnan(ref_lse[0, 0, 3])


def test_only_the_checked_causal_16_bit_v2_builds_are_register_capped():
    """MmaV2Kernel.REGISTER_CAPS: the causal 16-bit v2 builds at (d, block_k) = (64, 64), 4 warps of one row block, no mod
    or block mask, are compiled at 168 registers (3 blocks an SM; their SASS in tests/test_profile.py); every
    other build is left to the compiler (d = 56 spills at 168; a block mask's lists are not causal builds)."""
    capped = [("float16", 4, 64, 64, True), ("bfloat16", 4, 64, 64, True)]
    for kind, warps, block_k, d, causal in capped:
        assert make_v2_mma(kind, warps, block_k, d, causal).max_registers == 168
        assert make_v2_mma(kind, warps, block_k, d, causal, mask_form="causal").max_registers == 168
        assert make_v2_mma(kind, warps, block_k, d, causal, value_dim=d).max_registers == 168  # as the api builds it
    for args in [("float16", 4, 64, 64, False), ("float16", 4, 64, 56, True), ("float16", 2, 64, 64, True),
                 ("float32", 8, 32, 64, True), ("float16", 4, 32, 128, True),
                 ("float16", 4, 64, 64, True, None, None, "none", 32),  # d_v = 32: another build
                 ("float16", 4, 32, 96, True),  # spills 4 bytes at 168: uncapped
                 ("float16", 2, 64, 64, True, None, None, "none", None, None, 2)]:  # two row blocks: 255 uncapped
        assert make_v2_mma(*args).max_registers is None, args
    assert make_v1_mma("float16", 4, 64, 64, True).max_registers is None


def test_v2_mma_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="block_k must be a positive multiple of 16"):
        MmaConfig("float16", 1, 24, 64, False).check()
    with pytest.raises(ValueError, match="head dim d must be in 1..192 for the float16 tensor-core forward"):
        MmaConfig("float16", 1, 16, 256, False).check()
    with pytest.raises(ValueError, match="head dim d must be in 1..128 for the float32 tensor-core forward"):
        MmaConfig("float32", 1, 16, 192, False).check()
    with pytest.raises(ValueError, match="kind must be one of"):
        MmaConfig("float64", 1, 16, 64, False).check()  # float32 is 3xTF32 (test_mma_tf32.py)
    with pytest.raises(ValueError, match="async_copy needs the head dim d to be a multiple of 8"):
        MmaConfig("float16", 1, 16, 20, False, async_copy=True).check()
    with pytest.raises(ValueError, match="over the 49152 static limit"):
        MmaConfig("float16", 8, 128, 128, False).check()
    with pytest.raises(ValueError, match=r"row_blocks must be one of \(1, 2\) \(m16 row blocks a warp\), got 3"):
        MmaConfig("float16", 1, 16, 64, False, row_blocks=3).check()
    with pytest.raises(ValueError, match="row_blocks 2 is taken by the 16-bit kinds"):
        MmaConfig("float32", 1, 16, 64, False, row_blocks=2).check()
    with pytest.raises(ValueError, match="block_q 128, block_k 32, d 128: 52224 bytes"):  # 128 rows at d = 128
        MmaConfig("float16", 4, 32, 128, False, row_blocks=2).check()


def test_head_dims_up_to_192_take_the_tensor_core_forward_and_the_backward_says_128():
    """MLA's d_qk = 192 on tensor cores: the 16-bit forward takes d <= 192 (64 x 16 tiles: under 48 KB), auto
    picks it; the backward and float32 stop at 128, each refusal naming the limit."""
    from fa_numba import engines

    assert engines.mma_tiles(192, None, None) == (4, 16, 1) and engines.mma_tiles(128, None, None) == (4, 32, 1)
    assert engines.mma_tiles(64, None, None) == (4, 64, 2)  # FlashAttention-2's 128 rows: 4 warps of 32
    # float32 (tf32 parts): half the keys; v2's 8 warps share a staged tile, v1 keeps 4 (engines.mma_tiles)
    assert engines.mma_tiles(64, None, None, "float32") == (8, 32, 1)
    assert engines.mma_tiles(128, None, None, "tf32", "v2") == (8, 16, 1)
    assert engines.mma_tiles(64, None, None, "float32", "v1") == (4, 32, 1)
    assert MmaConfig("float16", 4, 16, 192, True).check().shared_bytes <= 48 * 1024
    assert engines.resolve("auto", kind="bfloat16", order="v1", head_dim=192) == "mma"
    assert engines.resolve("auto", kind="float16", order="v2", head_dim=200) == "simt"
    assert engines.backward("auto", kind="float16", head_dim=192) == "simt"
    for call, message in ((lambda: engines.resolve("mma", kind="float16", order="v2", head_dim=200),
                           r"d <= 192 for float16 inputs, got 200"),
                          (lambda: engines.resolve("mma", kind="float32", order="v2", head_dim=192),
                           r"d <= 128 for float32 inputs, got 192"),
                          (lambda: engines.backward("mma", kind="float16", head_dim=192),
                           r"d <= 128 for the backward, got 192")):
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.parametrize("order, d, d_v, causal", [("v2", 192, 128, True), ("v1", 176, 176, False)])
def test_the_widest_head_dims_on_tensor_cores_pass_the_rule(order, d, d_v, causal):
    """MLA's shape (d = 192, d_v = 128: V padded to 192, fa_numba.value_dims) and a d past 128 with a tail in
    its last k-step's O blocks (176 = 11 x 16), through engine="mma" at its default 16-key tiles."""
    rng = np.random.default_rng(d)
    q = rng.standard_normal((1, 1, 16, d)).astype(np.float16)
    k = rng.standard_normal((1, 1, 21, d)).astype(np.float16)
    v = rng.standard_normal((1, 1, 21, d_v)).astype(np.float16)
    out, lse = fa_numba.attention(q, k, v, causal=causal, order=order, engine="mma", block_q=16, return_lse=True)
    assert out.shape == (1, 1, 16, d_v)
    tolerance.check_attention(out, lse, q, k, v, causal=causal, p_dtype="float16", contractions=("matmul",),
                              order=order, block_q=16, block_k=16)


HERE = Path(__file__).parent


@pytest.mark.slow
@pytest.mark.skipif(profile.nvdisasm_path() is None, reason="nvdisasm is missing: install the profile extra")
def test_mma_compiles_to_tensor_core_products_without_local_memory():
    """sm_90a SASS of the shipped-size configurations and of the widest head dim, 192 at B_c = 16: per key tile
    and warp exactly the products the layout calls for (B_c/8 d/16 for S, B_c/16 d/8 for P V, so 64 at B_c = 64,
    d = 64 and at 32, 128, 48 at 16, 192) and half as many ldmatrix (x4: K's fragments of two k-steps, V's of
    two column blocks, a load; v1's visit also reads Q's d/16 A fragments), tiles staged by cp.async (v2: no LDG in the tile
    loop; v1 reads back its O, l and m: 2 rows x (d/4 + 2) per lane), no local memory, no spills, <= 48 KB.
    At d = 192 the unmasked v2's epilogue (48 IEEE divisions of O by l, a loop the compiler keeps rolled) puts
    the accumulator in 384 bytes of local memory after the tile loop; the tile loop itself has none."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run([sys.executable, str(HERE / "mma_probe.py")], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for row in json.loads(done.stdout):
        products = row["block_k"] // 8 * row["d"] // 16 + row["block_k"] // 16 * row["d"] // 8
        v1 = row["order"] == "v1"
        assert row["tile_hmma"] == products, row
        ks = row["d"] // 16  # k-steps of S: K's B fragments two k-steps an ldmatrix x4 (x2 for an odd last one)
        loads = row["block_k"] // 8 * (ks // 2 + ks % 2) + row["block_k"] // 16 * row["d"] // 16  # V: x4, 2 blocks
        assert row["tile_ldsm"] == loads + (ks if v1 else 0), row
        assert row["tile_ldgsts"] > 0 and row["tile_ldg"] == (2 * (row["d"] // 4 + 2) if v1 else 0), row
        assert row["tile_local"] == 0 and row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        assert row["local"] == 0 or (row["d"] > 128 and row["order"] == "v2" and not row["causal"]), row
        assert row["smem"] <= 48 * 1024, row
