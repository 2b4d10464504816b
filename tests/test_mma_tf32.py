"""float32 inputs on tensor cores (fa_numba.kernels.mma.tf32): 3xTF32, within the float32 rule with the term of
proofs/L6 part 9, and plain TF32, which is not float32-exact and needs its own, larger term.

The products' claims are tested on the host first, with fragments.py's tf32 rounding (written apart from the
kernels and the emulation): a product split into three tf32 products errs by at most eps |a| |b|; the S
accumulator's fragment, read with the keys of each 8-key block in the order (0, 2, 4, 6, 1, 3, 5, 7), is the
tf32 A fragment of P, so P V needs no lane moves (proofs/L10, claim 7). Then the kernels, in the simulator at
small shapes (a 3xTF32 tile issues three emulated mma.sync per product: a launch takes 5 to 20 s here), the
default tier one case per order, the slow tier the hard classes.
"""

import numpy as np
import pytest
from numba import cuda

import fa_numba
import fragments as fr
from fa_numba import reference, tolerance
from fa_numba.kernels.mma import tf32
from fa_numba.kernels.mma.engine_v1 import make_v1_mma
from fa_numba.kernels.mma.engine_v2 import make_v2_mma
from strategies import Case

MAKE = {"v1": make_v1_mma, "v2": make_v2_mma}
PRODUCTS = {"float32": "3xtf32", "tf32": "tf32"}
SLOW = pytest.mark.slow
FLOAT32_MAX = np.finfo(np.float32).max


def host_split(x):
    """(hi, lo) as float32 values, read from the module docstring of kernels.mma.tf32 with fragments.py's cvt.rn
    (fr.tf32_bits): hi of x clamped to the largest finite tf32, lo the residual's tf32."""
    x = np.asarray(x, np.float32)
    top = np.float32((2 - 2.0**-10) * 2.0**127)
    hi = fr.tf32_bits(np.clip(x, -top, top)).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        lo = fr.tf32_bits(x - hi).view(np.float32)
    return hi, lo


def split_dot(a, b, three=True):
    """sum_x a_x b_x as the kernel's products form it: tf32 parts, each part product exact in float64."""
    ah, al = (p.astype(np.float64) for p in host_split(a))
    bh, bl = (p.astype(np.float64) for p in host_split(b))
    total = ah * bh
    if three:
        total = al * bh + ah * bl + total
    return total.sum(axis=-1)


@pytest.mark.lemma("L6")
@pytest.mark.parametrize("three", [True, False], ids=["3xtf32", "tf32"])
def test_a_split_product_errs_by_at_most_eps_times_the_magnitudes(three):
    """|sum_x split(a_x b_x) - sum_x a_x b_x| <= eps sum_x |a_x| |b_x| (tolerance.SPLIT_ROUNDING), on random
    vectors over a wide exponent range and on an adversarial pattern whose errors all have one sign: for 3xTF32
    x = 1 - 2^-13 - 2^-23 - 2^-24 (hi = 1; its residual -2^-13 (1 + 2^-10 + 2^-11) is a tie whose kept part is odd,
    so cvt.rn rounds it away from zero, and the dropped lo lo and both residual roundings add up; under cvt.rna,
    used until 2026-12-05, 1 - 2^-13 - 2^-24 did this, and under cvt.rn its error partly cancels), for plain TF32
    x = 1 + 2^-11 - 2^-23 (rounded down by almost half a tf32 unit). There the error is above 0.15 of the 3xTF32
    bound (a float32 x has too few bits below its tf32 part to reach it all) and above 0.9 of the TF32 one: eps is not loose by more than that."""
    eps = tolerance.SPLIT_ROUNDING["3xtf32" if three else "tf32"][0]
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((200, 64)) * 2.0 ** rng.integers(-60, 60, (200, 64))).astype(np.float32)
    b = (rng.standard_normal((200, 64)) * 2.0 ** rng.integers(-60, 60, (200, 64))).astype(np.float32)
    pattern = 1 - 2.0**-13 - 2.0**-23 - 2.0**-24 if three else 1 + 2.0**-11 - 2.0**-23
    worst = np.full((1, 64), pattern, np.float32)
    a, b = np.vstack([a, worst]), np.vstack([b, worst])
    exact = (a.astype(np.float64) * b.astype(np.float64)).sum(axis=-1)  # products of float32: exact in float64
    bound = eps * (np.abs(a.astype(np.float64)) * np.abs(b.astype(np.float64))).sum(axis=-1)
    err = np.abs(split_dot(a, b, three) - exact)
    slack = 64 * 2.0**-52 * np.abs(exact)  # float64's own sums of 64 terms
    assert np.all(err <= bound + slack), np.max(err / bound)
    assert err[-1] > (0.15 if three else 0.9) * bound[-1]  # the adversarial row


def test_the_split_clamps_so_a_finite_input_never_gives_a_non_finite_part():
    """Near float32's largest value cvt.rn rounds to infinity; the clamp keeps hi finite and hi + lo = x.
    inf keeps an infinite residual and NaN a NaN one, so non-finite inputs still reach the products."""
    x = np.array([FLOAT32_MAX, -FLOAT32_MAX, np.float32(3.4025e38), 1.0, -2.5e-40, np.inf, -np.inf, np.nan],
                 np.float32)
    hi, lo = host_split(x)
    finite = np.isfinite(x)
    assert np.isfinite(hi[finite]).all() and np.isfinite(lo[finite]).all()
    # relative u_t^2 for normal x; a subnormal residual keeps fewer bits (an absolute error below 2^-136)
    np.testing.assert_allclose(hi[finite].astype(np.float64) + lo[finite], x[finite], rtol=2.0**-21, atol=2.0**-136)
    assert np.isposinf(lo[5]) and np.isneginf(lo[6]) and np.isnan(lo[7])


def _probe(split):
    """A kernel writing split(x[i]) of every element: its tf32 bits (hi, lo)."""
    @cuda.jit
    def probe(x, hi, lo):
        i = cuda.grid(1)
        if i < x.size:
            h, l_ = split(x[i])
            hi[i], lo[i] = h, l_

    return probe


_split_probe, _split_weight_probe = _probe(tf32.split), _probe(tf32.split_weight)


def test_the_device_split_is_the_host_reading():
    """kernels.mma.tf32.split (the kernels' split, cvt.rn through fa_numba.warp) gives the bits of the host
    reading above, specials included (NaN compared as NaN: PTX leaves a NaN's bits open)."""
    rng = np.random.default_rng(2)
    x = np.concatenate([(rng.standard_normal(58) * 2.0 ** rng.integers(-140, 127, 58)).astype(np.float32),
                        np.array([FLOAT32_MAX, -FLOAT32_MAX, np.inf, -np.inf, np.nan, 0.0], np.float32)])
    hi, lo = np.zeros(x.size, np.uint32), np.zeros(x.size, np.uint32)
    _split_probe[1, 64](x, hi, lo)
    want_hi, want_lo = host_split(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(hi.view(np.float32), want_hi)
    np.testing.assert_array_equal(lo[~nan], want_lo[~nan].view(np.uint32))
    assert np.isnan(lo.view(np.float32)[nan]).all()
    # a softmax weight (in [0, 1], or NaN) is split without the clamp: the same parts there
    w = np.concatenate([rng.random(60).astype(np.float32), np.array([0.0, 1.0, 2.0**-130, np.nan], np.float32)])
    _split_weight_probe[1, 64](w, hi, lo)
    want_hi, want_lo = host_split(w)
    nan = np.isnan(w)
    np.testing.assert_array_equal(hi[~nan], want_hi[~nan].view(np.uint32))
    np.testing.assert_array_equal(lo[~nan], want_lo[~nan].view(np.uint32))
    assert np.isnan(lo.view(np.float32)[nan]).all()


@cuda.jit(device=True, inline=True)
def _record_step(i, out, state, b, c, d):
    """One step of `tf32.unrolled`'s probe: a state that depends on the order of the calls."""
    state[0] = state[0] * 3 + i
    out[i] = state[0]


def _unrolled_probe(n):
    run = tf32.unrolled(n, _record_step)

    @cuda.jit
    def probe(out, state):
        if cuda.threadIdx.x == 0:
            run(out, state, 0, 0, 0)

    return probe


@pytest.mark.parametrize("n", [0, 1, 5])
def test_unrolled_calls_the_step_once_per_index_in_order(n):
    """tf32.unrolled(n, step) (its body generated as source) is step(0), ..., step(n - 1), in that order."""
    out, state = np.full(max(n, 1), -1, np.int64), np.zeros(1, np.int64)
    _unrolled_probe(n)[1, 1](out, state)
    want, s = [], 0
    for i in range(n):
        s = 3 * s + i
        want.append(s)
    np.testing.assert_array_equal(out[:n], want)
    assert state[0] == s and (n > 0 or out[0] == -1)


@pytest.mark.lemma("L10")
def test_the_s_accumulator_is_the_tf32_a_fragment_of_p_with_the_keys_reordered():
    """L10 claim 7, from fragments.py's packers alone: lane (g, t)'s S accumulator (c0, c2, c1, c3) is the tf32
    A fragment of P with its 8 keys in the order 2t, 2t + 1 -> k = t, t + 4; V's B fragment with the same
    order; and their mma.sync product is P V (the order of a sum's terms is free)."""
    rng = np.random.default_rng(8)
    P = fr.tf32_bits(rng.random((16, 8)).astype(np.float32)).view(np.float32)
    V = fr.tf32_bits(rng.standard_normal((8, 8)).astype(np.float32)).view(np.float32)
    order = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # k-index -> key: t -> 2t, t + 4 -> 2t + 1
    from_c = fr.c_16816(P)[:, [0, 2, 1, 3]].view(np.uint32)
    np.testing.assert_array_equal(from_c, fr.a_1688(P[:, order]))
    b = fr.b_1688(V[order])
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes & 3
    np.testing.assert_array_equal(b[:, 0], V[2 * t, g].view(np.uint32))  # what the kernel reads: rows 2t, 2t + 1
    np.testing.assert_array_equal(b[:, 1], V[2 * t + 1, g].view(np.uint32))
    np.testing.assert_allclose(fr.mma_expected(P[:, order], V[order], np.zeros((16, 8), np.float32)),
                               (P.astype(np.float64) @ V).astype(np.float32), rtol=2.0**-22)


def run(case: Case, kind: str, warps: int, order="v2", inputs=None, async_copy=None):
    q, k, v = case.inputs(np.float32) if inputs is None else inputs
    kernel = MAKE[order](kind, warps, case.block_k, case.d, case.causal, async_copy)
    o = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    lse = cuda.to_device(np.full(q.shape[:-1], np.nan, np.float32))
    kernel(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), o, lse, 1 / np.sqrt(case.d))
    return o.copy_to_host(), lse.copy_to_host()


CASES = [  # (case, warps): tails in N and d (d = 12, 20: padded to 16, 24), GQA, N_q > N_k causal, N = 1
    (Case(n_q=20, n_k=37, d=12, block_q=16, block_k=16, causal=True, seed=21), 1),
    pytest.param(Case(n_q=37, n_k=45, d=20, block_q=32, block_k=16, causal=False, seed=22, group=2), 2, marks=SLOW),
    pytest.param(Case(n_q=40, n_k=24, d=32, block_q=16, block_k=32, causal=True, seed=23), 1, marks=SLOW),
    pytest.param(Case(n_q=1, n_k=1, d=8, block_q=16, block_k=16, causal=False, seed=24), 1, marks=SLOW),
    pytest.param(Case(n_q=17, n_k=33, d=16, block_q=16, block_k=16, causal=True, seed=25, logit=30.0), 1,
                 marks=SLOW),
    # v2's float32 default: 8 warps share each staged K_j, V_j (engines.mma_tiles); a second query tile of 2 rows
    pytest.param(Case(n_q=130, n_k=40, d=8, block_q=128, block_k=16, causal=True, seed=30), 8, marks=SLOW),
]


def _id(x):
    if isinstance(x, Case):
        return f"nq{x.n_q}-nk{x.n_k}-d{x.d}-bk{x.block_k}-g{x.group}-{'causal' if x.causal else 'full'}"
    return f"w{x}"


@pytest.mark.lemma("L6")
@pytest.mark.parametrize("order", ["v1", "v2"])
@pytest.mark.parametrize("case,warps", CASES, ids=_id)
def test_3xtf32_matches_reference_within_the_float32_rule(order, case, warps):
    """Both orders with float32 inputs on tensor cores, judged by the float32 rule plus the 3xTF32 term."""
    q, k, v = case.inputs(np.float32)
    out, lse = run(case, "float32", warps, order, (q, k, v))
    check = tolerance.check_attention(out, lse, q, k, v, causal=case.causal, name=f"{order}-mma 3xtf32",
                                      order=order, block_q=16 * warps, block_k=case.block_k, products="3xtf32")
    assert check.err_out <= check.atol_out and check.err_lse <= check.atol_lse


@pytest.mark.lemma("L6")
def test_plain_tf32_is_not_float32_exact_and_its_term_covers_it():
    """One TF32 product per product: about 2^-10 relative, far outside the float32 rule (without its term the
    check fails), within the rule with products="tf32"; 3xTF32 on the same inputs passes the float32 rule."""
    case = Case(n_q=16, n_k=32, d=16, block_q=16, block_k=16, causal=False, seed=26)
    q, k, v = case.inputs(np.float32)
    out, lse = run(case, "tf32", 1, "v2", (q, k, v))
    tolerance.check_attention(out, lse, q, k, v, name="v2-mma tf32", order="v2", block_q=16, block_k=16,
                              products="tf32")
    with pytest.raises(AssertionError, match="beyond atol"):
        tolerance.check_attention(out, lse, q, k, v, name="v2-mma tf32 as float32", order="v2", block_q=16,
                                  block_k=16)
    out3, lse3 = run(case, "float32", 1, "v2", (q, k, v))
    fp32 = tolerance.check_attention(out3, lse3, q, k, v, name="v2-mma 3xtf32", order="v2", block_q=16,
                                     block_k=16)
    assert fp32.err_out < tolerance.max_error(out, reference.attention(q, k, v)[0]) / 100


@SLOW
def test_plain_loads_and_cp_async_staging_give_the_same_bits():
    case = Case(n_q=20, n_k=40, d=16, block_q=16, block_k=16, causal=True, seed=27)
    assert make_v2_mma("float32", 1, 16, 16, True).config.async_copy  # d % 4 == 0: 16-byte rows of 4 floats
    out_a, lse_a = run(case, "float32", 1, async_copy=True)
    out_p, lse_p = run(case, "float32", 1, async_copy=False)
    np.testing.assert_array_equal(out_a, out_p)
    np.testing.assert_array_equal(lse_a, lse_p)


@pytest.mark.parametrize("where", ["masked value", "visible value", pytest.param("huge query", marks=SLOW)])
def test_3xtf32_non_finite_and_huge_inputs_follow_the_dense_rule(where):
    """A NaN in V behind the causal mask never reaches a row that does not see it (the exact path); a visible
    one makes its column NaN; a finite query entry near float32's largest value gives no NaN (the clamp)."""
    case = Case(n_q=16, n_k=16, d=8, block_q=16, block_k=16, causal=True, seed=28)
    q, k, v = case.inputs(np.float32)
    if where == "masked value":
        v[0, 0, 5, 3] = np.nan
    elif where == "visible value":
        v[0, 0, 0, 3] = np.nan
    else:
        q[0, 0, 9, :] = 0.0
        q[0, 0, 9, 2] = FLOAT32_MAX
        k[..., 2] = 1e-38  # a finite score of about 3.4 for row 9
    out, lse = run(case, "float32", 1, "v2", (q, k, v))
    tolerance.check_attention(out, lse, q, k, v, causal=True, name=f"3xtf32 {where}", order="v2", block_q=16,
                              block_k=16, products="3xtf32")
    if where == "masked value":
        assert not np.isnan(out[0, 0, :5]).any() and np.isnan(out[0, 0, 5:, 3]).all()
    elif where == "visible value":
        assert np.isnan(out[0, 0, :, 3]).all() and not np.isnan(np.delete(out[0, 0], 3, axis=-1)).any()
    else:
        assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_attention_engine_mma_runs_3xtf32_for_float32_and_auto_keeps_the_cuda_cores():
    """engine='mma' on float32 inputs is the 3xTF32 kernel bit for bit; 'mma-tf32' the plain one; 'auto' keeps
    float32 on the CUDA cores (the simt result, bit for bit)."""
    case = Case(n_q=16, n_k=16, d=8, block_q=16, block_k=16, causal=False, seed=29)
    q, k, v = case.inputs(np.float32)
    out, lse = fa_numba.attention(q[0], k[0], v[0], engine="mma", return_lse=True, block_q=16, block_k=16)
    want_out, want_lse = run(case, "float32", 1, "v2", (q, k, v))
    np.testing.assert_array_equal(out, want_out[0])
    np.testing.assert_array_equal(lse, want_lse[0])
    plain = fa_numba.attention(q[0], k[0], v[0], engine="mma-tf32", block_q=16, block_k=16)
    np.testing.assert_array_equal(plain, run(case, "tf32", 1, "v2", (q, k, v))[0][0])
    auto = fa_numba.attention(q[0], k[0], v[0], block_q=16, block_k=16)
    np.testing.assert_array_equal(auto, fa_numba.attention(q[0], k[0], v[0], engine="simt", block_q=16,
                                                           block_k=16))


def test_float32_tensor_core_requests_it_cannot_take_are_refused_by_name():
    q = np.zeros((1, 16, 8), np.float32)
    with pytest.raises(ValueError, match="engine='mma-tf32' multiplies float32 inputs"):
        fa_numba.attention(q.astype(np.float16), q.astype(np.float16), q.astype(np.float16), engine="mma-tf32")
    with pytest.raises(ValueError, match="engine='mma-tf32' has no backward"):
        fa_numba.attention_backward(q, q, q, q, q[..., 0].copy(), q, engine="mma-tf32")
    with pytest.raises(ValueError, match="engine='mma-tf32' has no decode kernel"):
        fa_numba.attention_with_kvcache(q[None], q[None], q[None], engine="mma-tf32")
    with pytest.raises(ValueError, match="engine must be one of"):
        fa_numba.attention(q, q, q, engine="tf32")
