"""The warp primitives (fa_numba.warp) against the host-side reading of the PTX ISA (tests/fragments.py).

In the simulator these test fa_numba.warp.emulated_tc and emulation; on a GPU (the same tests, simulator off)
the hardware. The two readings of the fragment tables were written apart (fragments.py without looking at the
emulation), so a layout both misread is the one thing these cannot catch: the GPU run is the last word.
Each probe is one block of one warp (tests/warp_probes.py); the emulation takes about 0.1 s per launch.
The SASS test (slow tier) compiles every probe for sm_90a: each primitive is the instruction it claims.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda, uint16

import fragments as fr
import warp_probes as wp
from fa_numba import backend, profile, warp

HERE = Path(__file__).parent
SIMULATOR = backend.name() == "simulator"
ONLY_EMULATION = pytest.mark.skipif(not SIMULATOR, reason="tests the emulation's own checks, which the hardware "
                                                          "does not make (a divergent warp operation is undefined)")
U32 = 2.0**-24


def launch(name, *arrays):
    cuda.jit(getattr(wp, name))[1, 32](*arrays)


def mma_bound(A, B, C):
    """|D - (A B + C)| for a float32 accumulation of K products, each exact (16-bit or tf32 operands have at
    most 11 significand bits, so a product fits in float32's 24): K additions, each with a relative error of at
    most 2 U32, which covers round-to-nearest and truncation (the PTX ISA leaves the order and rounding of the
    accumulation unspecified): gamma_K(2 U32) (|A| |B| + |C|) (Higham, eq. 3.5, for any order)."""
    k = A.shape[1]
    g = k * 2 * U32 / (1 - k * 2 * U32)
    return g * (np.abs(A.astype(np.float64)) @ np.abs(B.astype(np.float64)) + np.abs(C))


def _sixteen_bit(kind, shape, rng, scale=1.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    bits = fr.bits_f16(x) if kind == "f16" else fr.bits_bf16(x)
    return bits, (fr.value_f16(bits) if kind == "f16" else fr.value_bf16(bits))


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mma_m16n8k16_matches_the_fragment_tables(kind, seed):
    rng = np.random.default_rng(seed)
    scale = [1.0, 30.0, 1e-3][seed]
    a_bits, A = _sixteen_bit(kind, (16, 16), rng, scale)
    b_bits, B = _sixteen_bit(kind, (16, 8), rng, scale)
    C = (rng.standard_normal((16, 8)) * scale**2).astype(np.float32)
    out = np.zeros((32, 4), np.float32)
    launch(f"mma_{kind}_probe", fr.a_16816(a_bits), fr.b_16816(b_bits), fr.c_16816(C), out)
    D = fr.d_16816(out)
    exact = A.astype(np.float64) @ B.astype(np.float64) + C
    assert np.all(np.abs(D - exact) <= mma_bound(A, B, C))
    if SIMULATOR:  # the emulation's documented model: exact, then one rounding
        np.testing.assert_array_equal(D, fr.mma_expected(A, B, C))


def test_mma_fragment_positions_are_not_symmetric():
    """One nonzero product at a time: D[m, n] = A[m, k] B[k, n] lands where the tables say, for every (m, k)
    and a fixed n, so a transposed or shifted reading of A, B or D cannot pass."""
    for m, k, n in [(0, 0, 0), (3, 9, 5), (15, 15, 7), (8, 1, 2), (7, 14, 6)]:
        A = np.zeros((16, 16), np.float32)
        B = np.zeros((16, 8), np.float32)
        A[m, k], B[k, n] = 2.0, 3.0
        out = np.zeros((32, 4), np.float32)
        launch("mma_f16_probe", fr.a_16816(fr.bits_f16(A)), fr.b_16816(fr.bits_f16(B)),
               fr.c_16816(np.zeros((16, 8), np.float32)), out)
        expected = np.zeros((16, 8), np.float32)
        expected[m, n] = 6.0
        np.testing.assert_array_equal(fr.d_16816(out), expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_mma_tf32_matches_the_fragment_tables(seed):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((16, 8)).astype(np.float32)
    B = rng.standard_normal((8, 8)).astype(np.float32)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    A_t = fr.tf32_bits(A).view(np.float32)  # the tf32 values the products see
    B_t = fr.tf32_bits(B).view(np.float32)
    out = np.zeros((32, 4), np.float32)
    launch("mma_tf32_probe", fr.a_1688(A_t), fr.b_1688(B_t), fr.c_16816(C), out)
    D = fr.d_16816(out)
    exact = A_t.astype(np.float64) @ B_t.astype(np.float64) + C
    assert np.all(np.abs(D - exact) <= mma_bound(A_t, B_t, C))
    if SIMULATOR:
        np.testing.assert_array_equal(D, fr.mma_expected(A_t, B_t, C))


def _aligned_rows(rng, count):
    """count distinct 16-byte-aligned row starts in the probes' shared memory (8 elements per row)."""
    return rng.choice(wp.SMEM // 8, size=count, replace=False).astype(np.int32) * 8


@pytest.mark.parametrize("num,trans", [(4, False), (4, True), (2, False), (2, True)])
def test_ldmatrix_matches_the_address_and_fragment_tables(num, trans):
    rng = np.random.default_rng(num + 10 * trans)
    mem = rng.integers(0, 2**16, wp.SMEM, dtype=np.uint16)
    addr = _aligned_rows(rng, 32)
    out = np.zeros((32, num), np.uint32)
    launch(f"ldmatrix_x{num}{'_trans' if trans else ''}_probe", mem, addr, out)
    np.testing.assert_array_equal(out, fr.ldmatrix_expected(mem, addr, num, trans))


@pytest.mark.lemma("L10")
def test_ldmatrix_and_mma_give_an_attention_tiles_products():
    """proofs/L10 claims 2 to 4 run end to end: A by ldmatrix x4 on its quadrants, K^T by x2 from keys as they
    are stored, V by x2 .trans; S = A K^T and A V against float64, within the accumulation bound."""
    rng = np.random.default_rng(7)
    a_bits, A = _sixteen_bit("f16", (16, 16), rng)
    k_bits, K = _sixteen_bit("f16", (8, 16), rng)
    v_bits, V = _sixteen_bit("f16", (16, 8), rng)
    mem = np.zeros(wp.SMEM, np.uint16)
    for r in range(16):
        mem[wp.Q_AT + r * wp.STRIDE:][:16] = a_bits[r]
        mem[wp.V_AT + r * 8:][:8] = v_bits[r]
    for r in range(8):
        mem[wp.K_AT + r * wp.STRIDE:][:16] = k_bits[r]
    s_out = np.zeros((32, 4), np.float32)
    o_out = np.zeros((32, 4), np.float32)
    launch("qk_pv_probe", mem, s_out, o_out)
    zero = np.zeros((16, 8), np.float32)
    S, O = fr.d_16816(s_out), fr.d_16816(o_out)  # noqa: E741 (the paper's names)
    assert np.all(np.abs(S - A.astype(np.float64) @ K.T.astype(np.float64)) <= mma_bound(A, K.T, zero))
    assert np.all(np.abs(O - A.astype(np.float64) @ V.astype(np.float64)) <= mma_bound(A, V, zero))
    assert np.abs(S).max() > 0 and np.abs(O).max() > 0


def test_cp_async_copies_and_zero_fills():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 2**15, wp.SMEM, dtype=np.uint16)
    nbytes = rng.choice([0, 2, 6, 10, 16], size=32).astype(np.int32)
    out = np.zeros(wp.SMEM, np.uint16)
    launch("cp_async_probe", src, nbytes, out)
    expected = np.full(wp.SMEM, 0xFFFF, np.uint16)  # untouched shared memory keeps its marker
    for lane in range(32):
        row = expected[8 * lane:8 * lane + 8]
        row[:] = 0
        row[:nbytes[lane] // 2] = src[8 * lane:8 * lane + nbytes[lane] // 2]
    np.testing.assert_array_equal(out, expected)


def test_cp_async_wait_group_1_leaves_only_the_newest_group_pending():
    src = np.arange(wp.SMEM, dtype=np.uint16) * 3
    first = np.zeros(256, np.uint16)
    out = np.zeros(512, np.uint16)
    launch("cp_async_groups_probe", src, first, out)
    np.testing.assert_array_equal(first, src[:256])
    np.testing.assert_array_equal(out, src[:512])


@ONLY_EMULATION
def test_the_emulation_lands_a_copy_only_at_its_wait():
    """So that a kernel missing a wait reads stale shared memory in the simulator instead of passing by luck."""
    src = np.arange(wp.SMEM, dtype=np.uint16)
    out = np.zeros(wp.SMEM, np.uint16)
    launch("cp_async_no_wait_probe", src, out)
    assert np.all(out == 0xFFFF)


EX2_ULPS = 2  # ex2.approx.f32's largest error as we read the PTX ISA (2 ulp, full range): unconfirmed here


def test_conversions_and_ex2():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal((24, 2)) * 10,
                        [[0.1, -0.1], [65519.0, 65520.0], [1e-8, -3e-5], [np.inf, -np.inf], [-np.inf, -150.0],
                         [1 + 2**-11, 1 + 3 * 2**-11], [-126.5, 1e-40], [127.9, -0.0]]]).astype(np.float32)
    f16x2, bf16x2, tf32 = (np.zeros(32, np.uint32) for _ in range(3))
    tf32_back, exp2 = np.zeros(32, np.float32), np.zeros(32, np.float32)
    launch("conversions_probe", x, f16x2, bf16x2, tf32, tf32_back, exp2)
    np.testing.assert_array_equal(f16x2, fr.cvt_x2(x[:, 0], x[:, 1], "f16"))
    np.testing.assert_array_equal(bf16x2, fr.cvt_x2(x[:, 0], x[:, 1], "bf16"))
    np.testing.assert_array_equal(tf32, fr.tf32_bits(x[:, 0]))
    np.testing.assert_array_equal(tf32_back.view(np.uint32), tf32)
    with np.errstate(over="ignore"):
        exact = np.exp2(x[:, 0].astype(np.float64))
    normal = (exact >= 2.0**-126) & np.isfinite(exact) & (exact < 2.0**128)
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(exp2[normal] - exact[normal]) <= EX2_ULPS * ulp[normal])
    assert np.all(exp2[exact < 2.0**-126] == 0)  # .ftz: a subnormal result is flushed to zero
    assert exp2[x[:, 0] == np.inf][0] == np.inf and exp2[x[:, 0] == -np.inf][0] == 0



@ONLY_EMULATION
def test_the_ex2_emulation_at_its_edges():
    """The emulation decides the ranges itself (no np.errstate): NaN, subnormal inputs, the flush and overflow."""
    from fa_numba.warp import emulated_tc

    assert np.isnan(emulated_tc.ex2(np.float32(np.nan)))
    assert emulated_tc.ex2(np.float32(1e-40)) == 1 and emulated_tc.ex2(np.float32(-1e-40)) == 1
    assert emulated_tc.ex2(np.float32(-126.0)) == np.float32(2.0**-126)
    assert emulated_tc.ex2(np.float32(-126.001)) == 0 and emulated_tc.ex2(np.float32(-np.inf)) == 0
    assert emulated_tc.ex2(np.float32(127.5)) == np.float32(2.0**127.5)
    assert emulated_tc.ex2(np.float32(128.0)) == np.inf and emulated_tc.ex2(np.float32(np.inf)) == np.inf
    assert all(type(emulated_tc.ex2(x)) is np.float32 for x in (0.5, np.nan, 1e-40, -200.0, 200.0))

def test_min_and_max_keep_a_nan():
    """warp.min_nan / max_nan (min.NaN.f32, max.NaN.f32) against NumPy's minimum and maximum, which propagate a NaN
    as PTX's .NaN forms say: a NaN in either operand gives a NaN, infinities order as numbers. Signed zeros are left
    out (PTX orders -0 below +0; NumPy may return either)."""
    rng = np.random.default_rng(7)
    a = np.concatenate([rng.standard_normal(20) * 1e3, [np.nan, 1.0, np.nan, np.inf, -np.inf, 3e38, -3e38, 5.0,
                                                        np.inf, -2.0, 1e-40, np.nan]]).astype(np.float32)
    b = np.concatenate([rng.standard_normal(20), [1.0, np.nan, np.nan, 2.0, 7.0, -np.inf, np.inf, 5.0, -np.inf,
                                                   -np.inf, -1e-40, -np.inf]]).astype(np.float32)
    mins, maxs = np.zeros(32, np.float32), np.zeros(32, np.float32)
    launch("min_max_nan_probe", a, b, mins, maxs)
    np.testing.assert_array_equal(mins, np.minimum(a, b))  # NaN positions must agree (assert_array_equal's rule)
    np.testing.assert_array_equal(maxs, np.maximum(a, b))
    assert np.isnan(mins[20:23]).all() and np.isnan(maxs[20:23]).all()  # the check can fail: a dropped NaN shows


def test_shuffles():
    vals = (np.arange(32, dtype=np.int32) * 37 + 11) % 101
    outs = [np.zeros(32, np.int32) for _ in range(5)]
    launch("shuffles_probe", vals, *outs)
    lane = np.arange(32)
    xor1, xor16, idx, up3, down5 = outs
    np.testing.assert_array_equal(xor1, vals[lane ^ 1])
    np.testing.assert_array_equal(xor16, vals[lane ^ 16])
    np.testing.assert_array_equal(idx, vals[(lane * 7 + 3) % 32])
    np.testing.assert_array_equal(up3, np.where(lane >= 3, vals[np.maximum(lane - 3, 0)], vals))
    np.testing.assert_array_equal(down5, np.where(lane + 5 < 32, vals[np.minimum(lane + 5, 31)], vals))


def _half_warp_shuffle(out):
    lane = cuda.threadIdx.x
    if lane < 16:
        out[lane] = cuda.shfl_xor_sync(0xFFFFFFFF, lane, 1)


def _half_warp_then_barrier(out):
    lane = cuda.threadIdx.x
    if lane < 16:
        out[lane] = cuda.shfl_xor_sync(0xFFFFFFFF, lane, 1)
    cuda.syncthreads()


def _two_shuffles(out):
    lane = cuda.threadIdx.x
    if lane < 16:
        out[lane] = cuda.shfl_xor_sync(0xFFFFFFFF, lane, 1)
    else:
        out[lane] = cuda.shfl_down_sync(0xFFFFFFFF, lane, 1)


@ONLY_EMULATION
@pytest.mark.parametrize("fn,says", [(_half_warp_shuffle, "exited"),
                                     (_half_warp_then_barrier, "waits at cuda.syncthreads()"),
                                     (_two_shuffles, "diverged")])
def test_a_divergent_warp_operation_fails_at_once(fn, says):
    from fa_numba.warp.emulation import WarpDivergence

    with pytest.raises(WarpDivergence, match=says.replace("(", r"\(").replace(")", r"\)")):
        cuda.jit(fn)[1, 64](np.zeros(64, np.int32))


def _last_lane_reads_past_shared(out):
    smem = cuda.shared.array(256, uint16)
    lane = cuda.threadIdx.x
    frags = warp.ldmatrix_x4(smem, 8 * lane if lane < 31 else 4096)  # lane 31: past the array
    out[lane] = frags[0]


@ONLY_EMULATION
def test_a_warp_operation_that_fails_releases_every_lane():
    """Whichever lane computes the ldmatrix (the last to arrive) raises the IndexError, and the other 31, whose
    operands were all deposited, raise with it instead of waiting out TIMEOUT (300 s) for a result."""
    import threading
    import time

    from numba.cuda.simulator.kernel import BlockThread

    from fa_numba.warp.emulation import WarpDivergence

    with pytest.raises((IndexError, WarpDivergence), match="outside the shared array"):
        cuda.jit(_last_lane_reads_past_shared)[1, 32](np.zeros(32, np.uint32))
    deadline = time.monotonic() + 10.0
    while any(isinstance(th, BlockThread) for th in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(isinstance(th, BlockThread) for th in threading.enumerate())


@ONLY_EMULATION
def test_mma_in_a_partial_warp_is_refused():
    from fa_numba.warp.emulation import WarpDivergence

    with pytest.raises(WarpDivergence, match="needs all 32 lanes"):
        cuda.jit(wp.mma_f16_probe)[1, 16](np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32),
                                          np.zeros((32, 4), np.float32), np.zeros((32, 4), np.float32))


REAL_CUDA = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "PYTHONPATH": str(HERE.parent)}
EXPECTED_SASS = {  # probe -> opcodes its SASS must hold (the instruction each primitive claims to be)
    "mma_f16_probe": ["HMMA.16816.F32"],
    "mma_bf16_probe": ["HMMA.16816.F32.BF16"],
    "mma_tf32_probe": ["HMMA.1688.F32.TF32"],
    "ldmatrix_x4_probe": ["LDSM.16.M88.4"],
    "ldmatrix_x4_trans_probe": ["LDSM.16.MT88.4"],
    "ldmatrix_x2_probe": ["LDSM.16.M88.2"],
    "ldmatrix_x2_trans_probe": ["LDSM.16.MT88.2"],
    "qk_pv_probe": ["LDSM.16.M88.4", "LDSM.16.M88.2", "LDSM.16.MT88.2", "HMMA.16816.F32"],
    "cp_async_probe": ["LDGSTS.E.BYPASS.128.ZFILL", "LDGDEPBAR", "DEPBAR.LE"],
    "cp_async_groups_probe": ["LDGSTS.E.BYPASS.128", "LDGDEPBAR", "DEPBAR.LE"],
    "conversions_probe": ["F2FP.F16.F32.PACK_AB", "F2FP.BF16.F32.PACK_AB", "F2FP.TF32.F32", "MUFU.EX2"],  # to_tf32: cvt.rn
    "shuffles_probe": ["SHFL.BFLY", "SHFL.IDX", "SHFL.UP", "SHFL.DOWN"],
    "min_max_nan_probe": ["FMNMX.NAN"],
}


@pytest.mark.slow
@pytest.mark.skipif(profile.nvdisasm_path() is None, reason="nvdisasm is missing: install the profile extra")
def test_every_primitive_compiles_to_its_instruction():
    done = subprocess.run([sys.executable, str(HERE / "warp_probes.py")], env=REAL_CUDA, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert set(found) == set(wp.SIGNATURES)
    for name, wanted in EXPECTED_SASS.items():
        opcodes = found[name]["opcodes"]
        for opcode in wanted:
            assert any(op == opcode or op.startswith(opcode + ".") for op in opcodes), (name, opcode, opcodes)
        assert not any(op.split(".")[0] in ("LDL", "STL", "CALL") for op in opcodes), (name, opcodes)
        assert found[name]["spill_stores"] == 0 and found[name]["spill_loads"] == 0
