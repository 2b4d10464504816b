"""L10: the host-side tensor-core fragment packers of tests/fragments.py against the PTX tables (issue: L10).

No expected value here comes from tests/fragments.py. The expectations are:
- the fragment tables of proofs/L10_fragments.md (3. to 7.), written below as literal (row, col) offsets from
  (groupID, threadID_in_group), and the inverse maps of the proof of claim 1;
- for ldmatrix, the address and fragment rules of 8. applied to labelled memory (every 16-bit value distinct,
  so a wrong lane, register, half or address shows), and for every ordering of the four 8x8 blocks, so the wrong
  quadrant orders are seen to fail;
- for the conversions, an exhaustive nearest-value search over every value of the target format (decoded from
  its sign, exponent and mantissa fields here, not by numpy), with the tie rule of the cvt section; numpy's
  float16 only where the rounding is exact (claim 5's labels). torch's bfloat16 is not used: importing torch
  costs ~3 s, more than this file's budget, and the search is already an independent, exhaustive route.
"""

import itertools
from collections import Counter

import numpy as np
import pytest

import fragments as F

LANES = 32

# The tables of proofs/L10_fragments.md, element i of lane 4g + t -> (row, col), as literal offsets.
A16816_OFFSETS = [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)]  # 3.: (g + dr, 2t + dc)
B16816_OFFSETS = [0, 1, 8, 9]  # 4.: (2t + dk, g)
C16816_OFFSETS = [(0, 0), (0, 1), (8, 0), (8, 1)]  # 5.: (g + dr, 2t + dc)
A1688_OFFSETS = [(0, 0), (8, 0), (0, 4), (8, 4)]  # 6.: (g + dr, t + dc)
B1688_OFFSETS = [0, 4]  # 7.: (t + dk, g)


def table_a16816(g, t, i):
    return g + A16816_OFFSETS[i][0], 2 * t + A16816_OFFSETS[i][1]


def table_b16816(g, t, i):
    return 2 * t + B16816_OFFSETS[i], g


def table_c16816(g, t, i):
    return g + C16816_OFFSETS[i][0], 2 * t + C16816_OFFSETS[i][1]


def table_a1688(g, t, i):
    return g + A1688_OFFSETS[i][0], t + A1688_OFFSETS[i][1]


def table_b1688(g, t, i):
    return t + B1688_OFFSETS[i], g


# name, map under test, elements per lane, matrix shape, the table, the inverse (row, col) -> (lane, i) of the proof
TABLES = [
    ("A m16n8k16", F._a16816_rc, 8, (16, 16), table_a16816,
     lambda r, c: (4 * (r % 8) + (c % 8) // 2, 4 * (c // 8) + 2 * (r // 8) + c % 2)),
    ("B m16n8k16", F._b16816_rc, 4, (16, 8), table_b16816,
     lambda k, n: (4 * n + (k % 8) // 2, 2 * (k // 8) + k % 2)),
    ("C/D", F._c16816_rc, 4, (16, 8), table_c16816,
     lambda m, n: (4 * (m % 8) + n // 2, 2 * (m // 8) + n % 2)),
    ("A m16n8k8 tf32", F._a1688_tf32_rc, 4, (16, 8), table_a1688,
     lambda m, k: (4 * (m % 8) + k % 4, 2 * (k // 4) + m // 8)),
    ("B m16n8k8 tf32", F._b1688_tf32_rc, 2, (8, 8), table_b1688,
     lambda k, n: (4 * n + k % 4, k // 4)),
]


def is_bijection(rc, n_elem, shape) -> bool:
    """(lane, i) -> rc(lane, i) hits every cell of `shape` exactly once."""
    hits = Counter(rc(lane, i) for lane in range(LANES) for i in range(n_elem))
    cells = set(itertools.product(range(shape[0]), range(shape[1])))
    return set(hits) == cells and set(hits.values()) == {1}


def pack_by_table(M, table, n_regs) -> np.ndarray:
    """uint32[32, n_regs]: register r of lane 4g + t holds element 2r (bits 15..0) and 2r + 1 (bits 31..16)."""
    out = np.zeros((LANES, n_regs), dtype=np.uint32)
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for r in range(n_regs):
            out[lane, r] = int(M[table(g, t, 2 * r)]) | (int(M[table(g, t, 2 * r + 1)]) << 16)
    return out


def labels(shape, start) -> np.ndarray:
    """Distinct uint16 labels start, start + 1, ... in a shuffled order (a fixed seed)."""
    n = int(np.prod(shape))
    return (start + np.random.default_rng(start).permutation(n)).astype(np.uint16).reshape(shape)


@pytest.mark.lemma("L10")
def test_fragment_maps_are_bijections():
    """Claim 1: each transcribed map is the table, a bijection with the proof's inverse; the packers place every
    element once, where the table says, and d_16816 undoes c_16816."""
    for name, rc, n_elem, shape, table, inverse in TABLES:
        assert LANES * n_elem == shape[0] * shape[1], name
        for lane in range(LANES):
            for i in range(n_elem):
                assert rc(lane, i) == table(lane // 4, lane % 4, i), (name, lane, i)
                assert inverse(*rc(lane, i)) == (lane, i), (name, lane, i)
        assert is_bijection(rc, n_elem, shape), name
        for cell in itertools.product(range(shape[0]), range(shape[1])):
            assert rc(*inverse(*cell)) == cell, (name, cell)
    # the check can fail: the f16 A table with a2, a3 in row g (not g + 8), and the tf32 A table read in the
    # f16 order (a1 beside a0, not below it), are not bijections
    assert not is_bijection(lambda lane, i: (lane // 4, table_a16816(lane // 4, lane % 4, i)[1]), 8, (16, 16))
    assert not is_bijection(lambda lane, i: (lane // 4 + 8 * (i // 2), lane % 4 + i % 2), 4, (16, 8))

    # the packers, on distinct labels: each register holds exactly the table's elements, lo = the even one
    A = labels((16, 16), 0x1000)
    fa = F.a_16816(A)
    assert fa.dtype == np.uint32 and np.array_equal(fa, pack_by_table(A, table_a16816, 4))
    assert sorted(np.concatenate([fa & 0xFFFF, fa >> 16]).ravel().tolist()) == sorted(A.ravel().tolist())
    assert fa[5, 0] == (int(A[1, 3]) << 16) | int(A[1, 2])  # lane 5 = (g 1, t 1), read off table 3. by hand
    assert fa[5, 3] == (int(A[9, 11]) << 16) | int(A[9, 10])
    B = labels((16, 8), 0x2000)
    fb = F.b_16816(B)
    assert np.array_equal(fb, pack_by_table(B, table_b16816, 2))
    assert fb[6, 1] == (int(B[13, 1]) << 16) | int(B[12, 1])  # lane 6 = (g 1, t 2), b-reg 1
    C = np.random.default_rng(1).permutation(128).astype(np.float32).reshape(16, 8) - 64
    fc = F.c_16816(C)
    for lane in range(LANES):
        for i in range(4):
            assert fc[lane, i] == C[table_c16816(lane // 4, lane % 4, i)]
    assert np.array_equal(F.d_16816(fc), C)
    assert np.array_equal(F.c_16816(F.d_16816(fc)), fc)
    # tf32: one element per register, taken as given (float32 reinterpreted, not rounded)
    A8 = labels((16, 8), 0x3000).astype(np.uint32) | np.uint32(0x3F800000)  # 1 + small mantissas: low bits set
    B8 = labels((8, 8), 0x4000).astype(np.uint32) | np.uint32(0x40000000)
    for X, packer, table, n in ((A8, F.a_1688, table_a1688, 4), (B8, F.b_1688, table_b1688, 2)):
        frag = packer(X)
        assert np.array_equal(packer(X.view(np.float32)), frag)
        for lane in range(LANES):
            for i in range(n):
                assert frag[lane, i] == X[table(lane // 4, lane % 4, i)]
    for bad in (lambda: F.a_16816(np.zeros((16, 8), np.uint16)), lambda: F.b_16816(np.zeros((8, 16), np.uint16)),
                lambda: F.c_16816(np.zeros((8, 16))), lambda: F.d_16816(np.zeros((32, 2))),
                lambda: F.a_1688(np.zeros((16, 16), np.float32)), lambda: F.b_1688(np.zeros((16, 8), np.float32))):
        with pytest.raises(ValueError):
            bad()


def ldmatrix_by_rule(mem, addr, num, trans) -> np.ndarray:
    """Table 8. of the proof: matrix j's row r starts at addr[8j + r]; lane 4g + t's register j holds
    (M_j[g][2t], M_j[g][2t + 1]), or with .trans (mem[addr_{8j+2t} + g], mem[addr_{8j+2t+1} + g])."""
    out = np.zeros((LANES, num), dtype=np.uint32)
    for j in range(num):
        for lane in range(LANES):
            g, t = lane // 4, lane % 4
            if trans:
                lo, hi = mem[addr[8 * j + 2 * t] + g], mem[addr[8 * j + 2 * t + 1] + g]
            else:
                lo, hi = mem[addr[8 * j + g] + 2 * t], mem[addr[8 * j + g] + 2 * t + 1]
            out[lane, j] = int(lo) | (int(hi) << 16)
    return out


def block_addresses(origins, stride, base=0) -> np.ndarray:
    """Lane l supplies the start of row l % 8 of block l // 8, block q's top-left at origins[q] (row, col)."""
    return np.array([base + (origins[lane // 8][0] + lane % 8) * stride + origins[lane // 8][1]
                     for lane in range(LANES)])


def orders_that_work(mem, blocks, stride, base, trans, expected) -> list:
    """Which of the 24 orderings of the four blocks give `expected` through ldmatrix.x4."""
    return [order for order in itertools.permutations(blocks)
            if np.array_equal(F.ldmatrix_expected(mem, block_addresses(order, stride, base), 4, trans), expected)]


@pytest.mark.lemma("L10")
def test_ldmatrix_quadrant_orders_give_the_mma_fragments():
    """Claims 2 to 4: of the 24 orders of the four 8x8 blocks, exactly the one the proof names gives the mma
    fragment (written here from tables 3. and 4.); the x2 forms, the wrong orders and .trans refuted."""
    # table 8. itself, x1 / x2 / x4 with shuffled, aligned row addresses over distinct labels
    mem = labels((512,), 0x5000)
    rows = 8 * np.random.default_rng(2).permutation(64)[:32]
    for num in (1, 2, 4):
        addr = rows.copy()
        addr[8 * num:] = 3  # not used by .x1 / .x2: a misaligned address there must not matter
        for trans in (False, True):
            assert np.array_equal(F.ldmatrix_expected(mem, addr, num, trans), ldmatrix_by_rule(mem, rows, num, trans))
    x1 = F.ldmatrix_expected(mem, rows, 1, False)
    assert x1[6, 0] == (int(mem[rows[1] + 5]) << 16) | int(mem[rows[1] + 4])  # lane 6: row 1, cols 4, 5
    x1t = F.ldmatrix_expected(mem, rows, 1, True)
    assert x1t[6, 0] == (int(mem[rows[5] + 1]) << 16) | int(mem[rows[4] + 1])  # .trans: col 1 of rows 4, 5
    for bad_addr in (np.full(LANES, 4), np.full(LANES, 512 - 4), np.full(LANES, -8)):
        with pytest.raises(ValueError):
            F.ldmatrix_expected(mem, bad_addr, 1, False)

    # claim 2: A 16 x 16 row-major, row stride 24 (16-byte aligned), in labelled memory
    A = labels((16, 16), 0x1000)
    stride, base = 24, 8
    mem = labels((base + 16 * stride + 8,), 0x8000)
    for r in range(16):
        mem[base + r * stride: base + r * stride + 16] = A[r]
    a_frag = pack_by_table(A, table_a16816, 4)
    assert np.array_equal(F.a_16816(A), a_frag)
    A00, A10, A01, A11 = (0, 0), (8, 0), (0, 8), (8, 8)
    assert orders_that_work(mem, [A00, A01, A10, A11], stride, base, False, a_frag) == [(A00, A10, A01, A11)]
    row_major = F.ldmatrix_expected(mem, block_addresses([A00, A01, A10, A11], stride, base), 4, False)
    assert not np.array_equal(row_major, a_frag)
    assert np.array_equal(row_major[:, [0, 2, 1, 3]], a_frag)  # the row-major order swaps registers 1 and 2

    # claim 3: B (K x N) row-major as V is stored; x2.trans, lane l < 16 -> row l
    V = labels((16, 16), 0x2000)  # keys x head dim
    mem = V.ravel().copy()
    b_lo, b_hi = pack_by_table(V[:, 0:8], table_b16816, 2), pack_by_table(V[:, 8:16], table_b16816, 2)
    assert np.array_equal(F.b_16816(V[:, 0:8]), b_lo) and np.array_equal(F.b_16816(V[:, 8:16]), b_hi)
    addr = np.where(np.arange(LANES) < 16, 16 * (np.arange(LANES) % 16), 3)
    assert np.array_equal(F.ldmatrix_expected(mem, addr, 2, True), b_lo)
    assert not np.array_equal(F.ldmatrix_expected(mem, addr, 2, False), b_lo)  # without .trans: not B
    swapped = np.where(np.arange(LANES) < 16, 16 * ((np.arange(LANES) + 8) % 16), 3)
    assert not np.array_equal(F.ldmatrix_expected(mem, swapped, 2, True), b_lo)
    # x4.trans on N = 16: [(k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)], block = (row, col)
    K0N0, K8N0, K0N8, K8N8 = (0, 0), (8, 0), (0, 8), (8, 8)
    two_n = np.concatenate([b_lo, b_hi], axis=1)
    assert orders_that_work(mem, [K0N0, K0N8, K8N0, K8N8], 16, 0, True, two_n) == [(K0N0, K8N0, K0N8, K8N8)]

    # claim 4: K (N x K) row-major as the keys are stored, 16 keys x 32 head dims; B = K^T
    Kt = labels((16, 32), 0x3000)
    mem = Kt.ravel().copy()
    bk = {(n, k): pack_by_table(Kt[n:n + 8, k:k + 16].T, table_b16816, 2) for n in (0, 8) for k in (0, 16)}
    assert np.array_equal(F.b_16816(Kt[0:8, 0:16].T), bk[0, 0])
    addr = np.where(np.arange(LANES) < 16, block_addresses([(0, 0), (0, 8), (0, 0), (0, 0)], 32), 3)
    assert np.array_equal(F.ldmatrix_expected(mem, addr, 2, False), bk[0, 0])
    assert not np.array_equal(F.ldmatrix_expected(mem, addr, 2, True), bk[0, 0])  # with .trans: not B
    swapped = np.where(np.arange(LANES) < 16, block_addresses([(0, 8), (0, 0), (0, 0), (0, 0)], 32), 3)
    assert not np.array_equal(F.ldmatrix_expected(mem, swapped, 2, False), bk[0, 0])
    # x4, two n-tiles: [(n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)], block = (row, col)
    N0K0, N0K8, N8K0, N8K8 = (0, 0), (0, 8), (8, 0), (8, 8)
    expected = np.concatenate([bk[0, 0], bk[8, 0]], axis=1)
    assert orders_that_work(mem, [N0K0, N8K0, N0K8, N8K8], 32, 0, False, expected) == [(N0K0, N0K8, N8K0, N8K8)]
    # x4, two k-steps of one n-tile: [(n 0-7, k 0-7), (k 8-15), (k 16-23), (k 24-31)]
    K0, K8, K16, K24 = (0, 0), (0, 8), (0, 16), (0, 24)
    expected = np.concatenate([bk[0, 0], bk[0, 16]], axis=1)
    assert orders_that_work(mem, [K16, K0, K24, K8], 32, 0, False, expected) == [(K0, K8, K16, K24)]


# ---------------------------------------------------------------------------------------------------------
# The rounding oracle: exhaustive nearest-value search over a format's values, decoded from its fields here
# ---------------------------------------------------------------------------------------------------------

def decode(patterns, exp_bits, man_bits) -> np.ndarray:
    """float64 values of non-negative bit patterns (exponent, mantissa fields); exact. The all-ones exponent with
    a zero mantissa (infinity) decodes to 2^(emax + 1), the value one ulp past the largest finite one, so that
    nearest-value rounding with it as a candidate overflows exactly as IEEE rounding does."""
    p = np.asarray(patterns, dtype=np.int64)
    e, m = p >> man_bits, p & ((1 << man_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    sub = np.ldexp(m.astype(np.float64), 1 - bias - man_bits)
    nor = np.ldexp((m + (1 << man_bits)).astype(np.float64), (e - bias - man_bits).astype(np.int32))
    return np.where(e == 0, sub, nor)


def nearest(x, exp_bits, man_bits, ties) -> np.ndarray:
    """The bit pattern (sign included) of the value of the format nearest to each non-NaN float32 x, among all
    of them from +0 to infinity; ties "even" (the even pattern) or "away" (the larger magnitude)."""
    x = np.asarray(x, dtype=np.float32)
    assert not np.isnan(x).any()
    inf = ((1 << exp_bits) - 1) << man_bits
    vals = decode(np.arange(inf + 1), exp_bits, man_bits)
    assert (np.diff(vals) > 0).all()
    y = np.abs(x.astype(np.float64))
    hi = np.minimum(np.searchsorted(vals, y, side="left"), inf)  # vals[hi - 1] < y <= vals[hi]
    lo = np.maximum(hi - 1, 0)
    with np.errstate(invalid="ignore"):
        d_lo, d_hi = y - vals[lo], vals[hi] - y
    tie = np.where(lo % 2 == 0, lo, hi) if ties == "even" else hi
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, tie))
    pick = np.where(y >= vals[inf], inf, pick)
    return pick | (np.signbit(x).astype(np.int64) << (exp_bits + man_bits))


def ties_and_neighbours(exp_bits, man_bits) -> np.ndarray:
    """float32: every midpoint between consecutive values of the format (+0 to infinity), and the float32
    values just below and above each, both signs."""
    inf = ((1 << exp_bits) - 1) << man_bits
    vals = decode(np.arange(inf + 1), exp_bits, man_bits)
    mid64 = (vals[:-1] + vals[1:]) / 2
    mid = mid64.astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), mid64)  # every midpoint is a float32 (the test's own premise)
    x = np.concatenate([mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    return np.concatenate([x, -x])


F32_EDGES = np.array([0.0, -0.0, np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                      np.finfo(np.float32).tiny, 1e-45, -1e-45, 65504, 65519.996, 65520, 65536, 6e-8, 3e-8, 1.0,
                      3.3895314e38, 3.4e38], dtype=np.float32)


def float32_sample(seed) -> np.ndarray:
    """Random float32: uniform over bit patterns (every exponent), and normal values scaled over f16's range."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    y = (rng.standard_normal(100_000) * 2.0 ** rng.uniform(-27, 17, 100_000)).astype(np.float32)
    x = np.concatenate([x, y, F32_EDGES])
    return x[~np.isnan(x)]


@pytest.mark.lemma("L10")
def test_conversions_round_as_the_cvt_section_says():
    """Claim 6 and 1.: bits_f16 / bits_bf16 and tf32_bits are round-to-nearest-even (cvt.rn; tf32 to 10 mantissa
    bits, cvt.rn.tf32.f32 since 2026-12-05, cvt.rna before), on random float32 and on every tie of each format
    and its neighbours; infinities stay; NaN gives the documented choices; cvt_x2 puts its lo operand in the low
    half (cvt's source b)."""
    x = float32_sample(3)
    f16_ties, bf16_ties, tf32_ties = ties_and_neighbours(5, 10), ties_and_neighbours(8, 7), ties_and_neighbours(8, 10)
    # the oracle can fail: on the exact ties, nearest-even rounds some up and some down, and differs from ties-away
    n_mid = len(f16_ties) // 6
    mid, down = f16_ties[:n_mid], nearest(f16_ties[n_mid:2 * n_mid], 5, 10, "even")
    assert (nearest(mid, 5, 10, "even") != down).any() and (nearest(mid, 5, 10, "even") == down).any()
    assert (nearest(mid, 5, 10, "even") != nearest(mid, 5, 10, "away")).any()

    for sample in (x, f16_ties):
        got = F.bits_f16(sample)
        assert got.dtype == np.uint16 and np.array_equal(got.astype(np.int64), nearest(sample, 5, 10, "even"))
    for sample in (x, bf16_ties):
        got = F.bits_bf16(sample)
        assert got.dtype == np.uint16 and np.array_equal(got.astype(np.int64), nearest(sample, 8, 7, "even"))
    for sample in (x, tf32_ties):
        got = F.tf32_bits(sample)
        assert got.dtype == np.uint32 and np.array_equal(got.astype(np.int64), nearest(sample, 8, 10, "even") << 13)
    # by hand: ties to even and away, overflow, infinities
    assert F.bits_f16(np.float32([1 + 2**-11, 1 + 3 * 2**-11, 65519.996, 65520, -np.inf])).tolist() == \
        [0x3C00, 0x3C02, 0x7BFF, 0x7C00, 0xFC00]
    assert F.bits_bf16(np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F7FFF, 0x7F7F8000, 0xFF800000],
                                dtype=np.uint32).view(np.float32)).tolist() == [0x3F80, 0x3F82, 0xBF80, 0x7F7F, 0x7F80,
                                                                                0xFF80]
    # tf32: 1 + half a unit is a tie onto the even 1 (down), 1 + 3 halves onto the even 1 + 2 units (up); the
    # largest tf32 plus half a unit rounds to infinity (its kept part is odd), just under half stays
    assert F.tf32_bits(np.array([0x3F801000, 0xBF801000, 0x3F803000, 0x3F801001, 0x3F800FFF, 0x7F7FEFFF,
                                 0x7F7FF000, 0x7F800000], dtype=np.uint32).view(np.float32)).tolist() == \
        [0x3F800000, 0xBF800000, 0x3F804000, 0x3F802000, 0x3F800000, 0x7F7FE000, 0x7F800000, 0x7F800000]
    # a float64 input is taken as float32 first (cvt.rn.f16.f32 reads a float32): 1 + 2^-11 + 2^-40 becomes the tie
    assert int(F.bits_f16(np.float64(1 + 2**-11 + 2**-40))) == 0x3C00
    # NaN: any payload, either sign -> the canonical 0x7FFF for f16 / bf16 (a choice, 10.), a NaN for tf32
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000],
                    dtype=np.uint32).view(np.float32)
    assert (F.bits_f16(nans) == 0x7FFF).all() and np.isnan(F.value_f16(F.bits_f16(nans))).all()
    assert (F.bits_bf16(nans) == 0x7FFF).all() and np.isnan(F.value_bf16(F.bits_bf16(nans))).all()
    assert np.isnan(F.tf32_bits(nans).view(np.float32)).all() and (F.tf32_bits(nans) & 0x1FFF == 0).all()

    # decoding: value_f16 / value_bf16 of every non-NaN pattern, both signs, against the fields decoded here
    for value, exp_bits, man_bits in ((F.value_f16, 5, 10), (F.value_bf16, 8, 7)):
        inf = ((1 << exp_bits) - 1) << man_bits
        p = np.arange(inf + 1)
        want = np.where(p == inf, np.inf, decode(p, exp_bits, man_bits))
        got = value(p.astype(np.uint16))
        assert got.dtype == np.float32 and np.array_equal(got.astype(np.float64), want)
        neg = value((p | (1 << (exp_bits + man_bits))).astype(np.uint16))
        assert np.array_equal(neg.astype(np.float64), -want) and np.signbit(neg).all()

    # 0. and 1.: the halves of a register, and cvt's operand order (the first source a is the HIGH half)
    assert int(F.pack_x2(0x1234, 0xABCD)) == 0xABCD1234
    assert int(F.cvt_x2(np.float32(1.0), np.float32(2.0), "f16")) == 0x40003C00  # f16 1.0 = 0x3C00, 2.0 = 0x4000
    assert int(F.cvt_x2(np.float32(1.0), np.float32(-2.0), "bf16")) == 0xC0003F80  # bf16 1.0 = 0x3F80, -2 = 0xC000
    lo, hi = x[:5000], x[5000:10000]
    for kind, exp_bits, man_bits in (("f16", 5, 10), ("bf16", 8, 7)):
        reg = F.cvt_x2(lo, hi, kind).astype(np.int64)
        assert np.array_equal(reg & 0xFFFF, nearest(lo, exp_bits, man_bits, "even"))
        assert np.array_equal(reg >> 16, nearest(hi, exp_bits, man_bits, "even"))
    with pytest.raises(ValueError):
        F.cvt_x2(lo, hi, "tf32")


def exact_bits(S, kind) -> np.ndarray:
    """The 16-bit patterns of float32 values that are exact in the format (asserted): numpy's float16, or the
    upper half of the float32 for bfloat16 (its definition); no rounding is involved."""
    if kind == "f16":
        h = S.astype(np.float16)
        assert np.array_equal(h.astype(np.float32), S)
        return h.view(np.uint16)
    u = S.view(np.uint32)
    assert (u & 0xFFFF == 0).all()
    return (u >> 16).astype(np.uint16)


@pytest.mark.lemma("L10")
def test_accumulator_fragments_convert_to_the_next_a_fragment():
    """Claim 5: the f32 C fragments of S[:, 0:8] and S[:, 8:16], converted pairwise in their own lane as
    cvt(c0, c1), cvt(c2, c3) of the first then of the second, are the A fragment (table 3.) of round(S), f16 and
    bf16; the other register order and the swapped cvt operands are not."""
    # distinct values exact in both formats (k / 4, |k| <= 128), so placement alone is tested; then random S,
    # rounded by the independent nearest-value search
    S_exact = (np.random.default_rng(4).permutation(256).astype(np.float32) - 128).reshape(16, 16) / 4
    S_random = np.random.default_rng(5).standard_normal((16, 16)).astype(np.float32)
    for S in (S_exact, S_random):
        c0, c1 = F.c_16816(S[:, 0:8]), F.c_16816(S[:, 8:16])
        for kind, exp_bits, man_bits in (("f16", 5, 10), ("bf16", 8, 7)):
            if S is S_exact:
                bits = exact_bits(S, kind)
            else:
                bits = nearest(S, exp_bits, man_bits, "even").astype(np.uint16)
            want = pack_by_table(bits, table_a16816, 4)
            regs = np.stack([F.cvt_x2(c0[:, 0], c0[:, 1], kind), F.cvt_x2(c0[:, 2], c0[:, 3], kind),
                             F.cvt_x2(c1[:, 0], c1[:, 1], kind), F.cvt_x2(c1[:, 2], c1[:, 3], kind)], axis=1)
            assert np.array_equal(regs, want), kind
            assert np.array_equal(F.a_16816(bits), want), kind
            if S is S_exact:  # the wrong readings differ (distinct labels)
                assert not np.array_equal(regs[:, [0, 2, 1, 3]], want)  # c0 rows g, then c1 rows g, ...
                swapped = np.stack([F.cvt_x2(c0[:, 1], c0[:, 0], kind), F.cvt_x2(c0[:, 3], c0[:, 2], kind),
                                    F.cvt_x2(c1[:, 1], c1[:, 0], kind), F.cvt_x2(c1[:, 3], c1[:, 2], kind)], axis=1)
                assert not np.array_equal(swapped, want)  # cvt.rn.f16x2.f32 d, lo, hi: halves swapped
