"""Host-side fragment packers for the tensor-core warp primitives, written from NVIDIA's PTX ISA tables.

What this is: plain numpy (no numba) that says, for the PTX operations fa_numba's tensor-core path uses, which lane
holds which matrix element in which register and which half of it, and what bits a conversion produces. It is an
independent reading of the documentation, written without looking at fa_numba.warp's simulator emulation, so
that the tests can check that emulation (and, on a GPU, the hardware) against it. proofs/L10_fragments.md states
the tables and proves the lemmas these functions rely on (each layout is a bijection, ldmatrix x4 on the four
8x8 quadrants gives the mma A fragment, which quadrant orders give the B fragment).

Sources: "Parallel Thread Execution ISA", NVIDIA, version 9.x (docs.nvidia.com/cuda/parallel-thread-execution/),
sections named by their titles and anchors (the numbers move between versions: 9.7.14.5.x in the copy read, 9.7.16.5.x
in 9.4):
- "Matrix Fragments for mma.m16n8k16 with floating point type" (#warp-level-matrix-fragment-mma-16816-float);
- "Matrix Fragments for mma.m16n8k8" (#warp-level-matrix-fragment-mma-1688), the .tf32 and C/D tables;
- "Multiply-and-Accumulate Instruction: mma" (#warp-level-matrix-instructions-mma), "Precision and rounding";
- "Warp-level matrix load instruction: ldmatrix" (#warp-level-matrix-instructions-ldmatrix), its address table
  and text (its Figure "ldmatrix fragment layout for one 8x8 Matrix with 16-bit elements" was not read);
- "Data Movement and Conversion Instructions: cvt" (#data-movement-and-conversion-instructions-cvt):
  operand order of the x2 forms, .rn / .rna, what is said (and not said) of NaN;
- "Data Movement and Conversion Instructions: mov" (#data-movement-and-conversion-instructions-mov): packing
  two 16-bit elements into .b32 is d = a.x | (a.y << 16), the first element in the low half;
- "Alternate Floating-Point Data Formats" (#alternate-floating-point-data-formats): .bf16, .tf32;
- CUDA Math API, "Bfloat16 Arithmetic Constants": CUDART_NAN_BF16 = 0x7FFF, "canonical NaN"; cuda_fp16.hpp's
  host float-to-half conversion returns 0x7FFF for every NaN.

Lane conventions (the PTX tables' own names): groupID g = lane >> 2, threadID_in_group t = lane % 4. A fragment
element list "a0, a1, ..." is "Elements (low to high)": a 32-bit register holding two 16-bit elements holds
the even-numbered one in bits 15..0 and the odd-numbered one in bits 31..16.
"""

from __future__ import annotations

import numpy as np

LANES = 32
F16_NAN = 0x7FFF  # canonical NaN of binary16 (CUDA's host conversion; PTX's plain cvt.rn leaves it unspecified)
BF16_NAN = 0x7FFF  # canonical NaN of bfloat16 (CUDA Math API CUDART_NAN_BF16)
TF32_NAN = 0x7FFFE000  # our choice for a NaN input of cvt.rn.tf32.f32: PTX does not say (see tf32_bits)


def _lane_ids(lane: int) -> tuple[int, int]:
    """(groupID, threadID_in_group) of a lane, as every PTX fragment table defines them."""
    return lane >> 2, lane % 4


# ---------------------------------------------------------------------------------------------------------
# Element formats and conversions
# ---------------------------------------------------------------------------------------------------------

def bits_f16(x) -> np.ndarray:
    """IEEE binary16 bits of x, rounded to nearest, ties to even (cvt.rn.f16.f32).

    The input is taken as float32 first (cvt.rn.f16.f32 converts a float32 register), then numpy's float32 ->
    float16 cast, which is round-to-nearest-even with subnormals and overflow to infinity. Every NaN becomes
    0x7FFF: PTX's cvt section says what NaN gives only under .relu ("canonical NaN") and .satfinite, not for
    plain .rn; 0x7FFF is what CUDA's own host conversion (cuda_fp16.hpp) returns for a NaN, and numpy would
    otherwise keep a payload (0x7E00 for np.nan).
    """
    x32 = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):  # overflow to infinity is the correct rounding, not an error
        h = np.asarray(x32.astype(np.float16)).view(np.uint16)
    return np.where(np.isnan(x32), np.uint16(F16_NAN), h).astype(np.uint16)


def bits_bf16(x) -> np.ndarray:
    """bfloat16 bits of float32 x, rounded to nearest, ties to even (cvt.rn.bf16.f32).

    bfloat16 is the upper 16 bits of a float32 (PTX "Alternate Floating-Point Data Formats": 8 exponent bits,
    7 mantissa bits), so rounding adds 0x7FFF plus the lowest kept bit to the float32 bits and keeps the top
    16: a carry that runs into the exponent is the correct rounding up, overflow included (the largest finite
    float32 rounds to infinity, as ties-to-even does at 0x7F7F8000 and above); infinities stay infinities.

    NaN: the PTX cvt section specifies a NaN result only for .relu ("NaN results are converted to canonical
    NaN") and .satfinite ("the result is NaN in the specified destination format"); for plain .rn it says
    nothing about the bits. We give every NaN the canonical 0x7FFF (CUDART_NAN_BF16), sign dropped: that is an
    assumption about the hardware, not a PTX guarantee, and the rounding formula alone would be wrong for NaN
    (0x7FFFFFFF + 0x7FFF carries into the sign bit).
    """
    x32 = np.asarray(x, dtype=np.float32)
    u = x32.view(np.uint32).astype(np.uint64)  # 64 bits so that the additions below cannot wrap
    lsb = (u >> np.uint64(16)) & np.uint64(1)
    rounded = ((u + np.uint64(0x7FFF) + lsb) >> np.uint64(16)).astype(np.uint16)
    return np.where(np.isnan(x32), np.uint16(BF16_NAN), rounded).astype(np.uint16)


def value_f16(bits) -> np.ndarray:
    """float32 values of binary16 bit patterns (exact: every binary16 value is a float32 value)."""
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def value_bf16(bits) -> np.ndarray:
    """float32 values of bfloat16 bit patterns: the 16 bits become the upper half of a float32 (exact)."""
    b = np.asarray(bits, dtype=np.uint16).astype(np.uint32)
    return (b << np.uint32(16)).view(np.float32)


def pack_x2(lo_bits, hi_bits) -> np.ndarray:
    """The 32-bit register holding two 16-bit values, elementwise: lo in bits 15..0, hi in bits 31..16.

    PTX: mov.b32 d, {a, b} is d = a | (b << 16); fma/add.{f16x2,bf16x2} take element 0 from bits 0..15 and
    element 1 from bits 16..31; the mma fragment tables list the elements of a register "low to high". So in a
    fragment register the element with the even index (a0, a2, ..., b0, b2) is lo.
    """
    lo = np.asarray(lo_bits, dtype=np.uint16).astype(np.uint32)
    hi = np.asarray(hi_bits, dtype=np.uint16).astype(np.uint32)
    return (hi << np.uint32(16)) | lo


def cvt_x2(lo, hi, kind: str) -> np.ndarray:
    """The register that packs float32 values (lo, hi) as f16x2 or bf16x2 (kind "f16" or "bf16"), elementwise.

    Operand order (PTX cvt, Description and Semantics): for cvt.rn.{f16x2,bf16x2}.f32 d, a, b "the value
    converted from input a is stored in the upper half of d and the value converted from input b is stored
    in the lower half of d" (d[31:16] = convert(a); d[15:0] = convert(b)). So the register with lo in the low
    half is cvt.rn.f16x2.f32 d, hi, lo: the FIRST source operand is the HIGH half. The result equals
    pack_x2(bits(lo), bits(hi)).
    """
    if kind == "f16":
        bits = bits_f16
    elif kind == "bf16":
        bits = bits_bf16
    else:
        raise ValueError(f"kind must be 'f16' or 'bf16', not {kind!r}")
    a = np.asarray(hi, dtype=np.float32)  # cvt's source a: the upper half
    b = np.asarray(lo, dtype=np.float32)  # cvt's source b: the lower half
    return pack_x2(bits(b), bits(a))


def tf32_bits(x) -> np.ndarray:
    """What cvt.rn.tf32.f32 gives: x rounded to 10 mantissa bits, nearest, ties to even; low 13 bits 0.

    .rn is "mantissa LSB rounds to nearest even" (PTX cvt, Floating Point Notes). On the magnitude bits: keep
    the top 19, drop the 13 below; round the kept part up when the dropped part is over half a unit (0x1000),
    or exactly half and the kept part odd. A carry into the exponent is the correct rounding up, and a finite
    value that rounds past the largest tf32 becomes infinity (no .satfinite). Subnormals are rounded the same
    way (no .ftz). Infinities stay infinities (their dropped bits are 0). The kernels used .rna (ties away from
    zero) until 2026-12-05; sm_90 has one instruction for .rn and none for .rna.

    What PTX leaves open: "Alternate Floating-Point Data Formats" says the internal layout of tf32 is
    implementation defined (same range as f32, precision >= 10 bits), so "low 13 bits zero" is the expected
    register pattern, not a documented one; and the cvt section says nothing of a NaN input for .rn without
    .satfinite. We return TF32_NAN = 0x7FFFE000 (positive, quiet, every kept mantissa bit set, low 13 bits 0)
    for every NaN, a choice: a test should compare NaN by "is NaN", not by these bits.
    """
    x32 = np.asarray(x, dtype=np.float32)
    u = x32.view(np.uint32).astype(np.uint64)
    sign = u & np.uint64(0x80000000)
    mag = u & np.uint64(0x7FFFFFFF)
    kept, dropped = mag >> np.uint64(13), mag & np.uint64(0x1FFF)
    half = np.uint64(0x1000)
    up = (dropped > half) | ((dropped == half) & ((kept & np.uint64(1)) == np.uint64(1)))
    out = (sign | ((kept + up.astype(np.uint64)) << np.uint64(13))).astype(np.uint32)
    return np.where(np.isnan(x32), np.uint32(TF32_NAN), out).astype(np.uint32)


# ---------------------------------------------------------------------------------------------------------
# mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: A 16x16, B 16x8 (K x N), C/D 16x8
# ---------------------------------------------------------------------------------------------------------

def _a16816_rc(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of element a_i (i = 0..7) of `lane`, the PTX table for .f16/.bf16 A, transcribed:

    row = groupID for a_i where 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise;
    col = (threadID_in_group * 2) + (i & 0x1) for i < 4, (threadID_in_group * 2) + (i & 0x1) + 8 for i >= 4.
    """
    g, t = _lane_ids(lane)
    row = g if (0 <= i < 2 or 4 <= i < 6) else g + 8
    col = t * 2 + (i & 1) if i < 4 else t * 2 + (i & 1) + 8
    return row, col


def _b16816_rc(lane: int, i: int) -> tuple[int, int]:
    """(row, col) = (k, n) of element b_i (i = 0..3), the PTX table for .f16/.bf16 B, transcribed:

    row = (threadID_in_group * 2) + (i & 0x1) for b_i where i < 2, ... + 8 for i >= 2; col = groupID.
    """
    g, t = _lane_ids(lane)
    row = t * 2 + (i & 1) if i < 2 else t * 2 + (i & 1) + 8
    return row, g


def _c16816_rc(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of accumulator element c_i (i = 0..3), the PTX table for C/D, transcribed:

    row = groupID for c_i where i < 2, groupID + 8 for i >= 2; col = (threadID_in_group * 2) + (i & 0x1).
    The m16n8k8 section gives the same table for its .f32 C/D ("groupID for c0 and c1, groupID + 8 for c2 and
    c3"; the same col), so this one map serves both shapes.
    """
    g, t = _lane_ids(lane)
    row = g if i < 2 else g + 8
    col = t * 2 + (i & 1)
    return row, col


def a_16816(A_bits) -> np.ndarray:
    """The A fragment: uint32[32, 4], register r of lane l holding (a_{2r} low, a_{2r+1} high).

    A_bits: uint16[16, 16], the f16 or bf16 bits of A (M x K, .row). Register 0 is row g cols 2t, 2t+1;
    register 1 row g + 8, the same cols; register 2 row g, cols 2t + 8, 2t + 9; register 3 row g + 8, those cols.
    """
    A_bits = np.asarray(A_bits, dtype=np.uint16)
    if A_bits.shape != (16, 16):
        raise ValueError(f"A must be 16 x 16, not {A_bits.shape}")
    out = np.zeros((LANES, 4), dtype=np.uint32)
    for lane in range(LANES):
        for r in range(4):
            lo = A_bits[_a16816_rc(lane, 2 * r)]
            hi = A_bits[_a16816_rc(lane, 2 * r + 1)]
            out[lane, r] = pack_x2(lo, hi)
    return out


def b_16816(B_bits) -> np.ndarray:
    """The B fragment: uint32[32, 2], register r of lane l holding (b_{2r} low, b_{2r+1} high).

    B_bits: uint16[16, 8], the bits of B as K x N (.col means each of B's columns is what a lane reads along k;
    the table is in (k, n) terms). Register 0 is B[2t, g], B[2t + 1, g]; register 1 is B[2t + 8, g], B[2t + 9, g].
    """
    B_bits = np.asarray(B_bits, dtype=np.uint16)
    if B_bits.shape != (16, 8):
        raise ValueError(f"B must be 16 x 8 (K x N), not {B_bits.shape}")
    out = np.zeros((LANES, 2), dtype=np.uint32)
    for lane in range(LANES):
        for r in range(2):
            lo = B_bits[_b16816_rc(lane, 2 * r)]
            hi = B_bits[_b16816_rc(lane, 2 * r + 1)]
            out[lane, r] = pack_x2(lo, hi)
    return out


def c_16816(C) -> np.ndarray:
    """The f32 C (or D) fragment: float32[32, 4], lane l's c_0..c_3 (one float32 register each)."""
    C = np.asarray(C, dtype=np.float32)
    if C.shape != (16, 8):
        raise ValueError(f"C must be 16 x 8, not {C.shape}")
    out = np.zeros((LANES, 4), dtype=np.float32)
    for lane in range(LANES):
        for i in range(4):
            out[lane, i] = C[_c16816_rc(lane, i)]
    return out


def d_16816(frags) -> np.ndarray:
    """The 16 x 8 float32 matrix that the f32 D fragments float32[32, 4] hold: the inverse of c_16816."""
    frags = np.asarray(frags, dtype=np.float32)
    if frags.shape != (LANES, 4):
        raise ValueError(f"fragments must be 32 x 4, not {frags.shape}")
    D = np.full((16, 8), np.nan, dtype=np.float32)
    for lane in range(LANES):
        for i in range(4):
            D[_c16816_rc(lane, i)] = frags[lane, i]
    return D


# ---------------------------------------------------------------------------------------------------------
# mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: A 16x8, B 8x8 (K x N), C/D 16x8 (c_16816 / d_16816)
# ---------------------------------------------------------------------------------------------------------

def _a1688_tf32_rc(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of .tf32 A element a_i (i = 0..3), the PTX m16n8k8 table, transcribed:

    row = groupID for a0 and a2, groupID + 8 for a1 and a3;
    col = threadID_in_group for a0 and a1, threadID_in_group + 4 for a2 and a3.
    (Not the f16 order: here a1 is the row below a0, a2 the column block to the right.)
    """
    g, t = _lane_ids(lane)
    row = g if i in (0, 2) else g + 8
    col = t if i in (0, 1) else t + 4
    return row, col


def _b1688_tf32_rc(lane: int, i: int) -> tuple[int, int]:
    """(row, col) = (k, n) of .tf32 B element b_i (i = 0, 1): row = threadID_in_group for b0, + 4 for b1;
    col = groupID."""
    g, t = _lane_ids(lane)
    row = t if i == 0 else t + 4
    return row, g


def _tf32_patterns(X) -> np.ndarray:
    """The 32-bit patterns of X as given: float32 values are reinterpreted (no rounding), uint32 taken as is."""
    X = np.asarray(X)
    if X.dtype == np.uint32:
        return X
    return np.asarray(X, dtype=np.float32).view(np.uint32)


def a_1688(A) -> np.ndarray:
    """The .tf32 A fragment: uint32[32, 4], register i of lane l holding a_i (one tf32 element per .b32).

    A: float32[16, 8] (M x K), already tf32 values (e.g. tf32_bits(...).view(float32)), or their uint32 bits;
    the packer does not round, so an operand with low bits set goes to the fragment as it is.
    """
    bits = _tf32_patterns(A)
    if bits.shape != (16, 8):
        raise ValueError(f"A must be 16 x 8, not {bits.shape}")
    out = np.zeros((LANES, 4), dtype=np.uint32)
    for lane in range(LANES):
        for i in range(4):
            out[lane, i] = bits[_a1688_tf32_rc(lane, i)]
    return out


def b_1688(B) -> np.ndarray:
    """The .tf32 B fragment: uint32[32, 2], register i of lane l holding b_i. B: float32[8, 8] (K x N), as is."""
    bits = _tf32_patterns(B)
    if bits.shape != (8, 8):
        raise ValueError(f"B must be 8 x 8 (K x N), not {bits.shape}")
    out = np.zeros((LANES, 2), dtype=np.uint32)
    for lane in range(LANES):
        for i in range(2):
            out[lane, i] = bits[_b1688_tf32_rc(lane, i)]
    return out


# ---------------------------------------------------------------------------------------------------------
# What D = A B + C should be
# ---------------------------------------------------------------------------------------------------------

def mma_expected(A, B, C) -> np.ndarray:
    """D = A @ B + C in float64 from the decoded element values, rounded once to float32: float32[16, 8].

    A: 16 x K, B: K x 8, C: 16 x 8, K = 16 (f16/bf16) or 8 (tf32), all given as the VALUES the fragments encode
    (value_f16 / value_bf16 of the bits, tf32 values as float32). Every product of two such values is exact
    in float64 (at most 11 + 11 significand bits, exponents far inside float64's range), and the float64 sum of
    the K + 1 terms is off the exact sum by at most gamma_K(u64) times the sum of their magnitudes, under 2^-26
    of a float32 ulp of that magnitude: so this is the exact D rounded once to float32, except when the exact
    sum lies within that distance of a float32 rounding boundary (cancellation can make that happen).

    This is an assumption about the hardware, not a PTX guarantee: the mma section says only that products
    are formed "with at least single precision" (f16) or "with specified precision" (bf16, tf32), that
    accumulation is "with at least single precision", and that "the accumulation order, rounding and handling
    of subnormal inputs are unspecified". The tests compare against this value with a tolerance derived for K
    float32-like roundings, not bit for bit.
    """
    A64 = np.asarray(A, dtype=np.float64)
    B64 = np.asarray(B, dtype=np.float64)
    C64 = np.asarray(C, dtype=np.float64)
    k = A64.shape[1] if A64.ndim == 2 else -1
    if A64.shape not in ((16, 16), (16, 8)) or B64.shape != (k, 8) or C64.shape != (16, 8):
        raise ValueError(f"shapes must be A 16 x K, B K x 8, C 16 x 8 (K 8 or 16), not {A64.shape}, {B64.shape}, "
                         f"{C64.shape}")
    D = np.zeros((16, 8), dtype=np.float64)
    for m in range(16):
        for n in range(8):
            acc = C64[m, n]
            for kk in range(k):
                acc += A64[m, kk] * B64[kk, n]
            D[m, n] = acc
    return D.astype(np.float32)


# ---------------------------------------------------------------------------------------------------------
# ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16
# ---------------------------------------------------------------------------------------------------------

def ldmatrix_expected(mem_bits, row_addr, num: int, trans: bool) -> np.ndarray:
    """What each lane's `num` destination registers hold after ldmatrix: uint32[32, num].

    mem_bits: uint16[:], shared memory as 16-bit elements; row_addr: int[32], the element index each lane
    supplies as its address operand; num in {1, 2, 4}.

    Addresses (PTX address table): matrix j (j < num) takes its 8 row starts from lanes 8j .. 8j + 7, lane 8j + r
    giving row r. So .x1 reads only lanes 0-7's addresses and .x2 only lanes 0-15's; the other lanes' addresses
    are ignored here (PTX: for sm_75 and below they must still be valid). Every lane, all 32, receives a
    fragment of every matrix: destination register j holds matrix j's.

    Fragment (the text "Each thread in a warp loads fragments of a row, with thread 0 receiving the first
    fragment ... A group of four threads loads an entire row"; the Figure of one 8x8 matrix was not available as
    text): a 16-byte row is four 4-byte pieces, so lane l = 4g + t holds row g, columns 2t and 2t + 1, the shape
    of the mma tables (row = groupID, col = threadID_in_group * 2 + i). Column 2t (the lower address) in the low
    half is not stated for ldmatrix; it is what the mma "low to high" order needs (proofs/L10, 10.).

    .trans: "the matrix is loaded in column-major format": the 8 rows in memory are the columns of the matrix
    delivered, so lane 4g + t holds M[g, 2t], M[g, 2t + 1] with M[r, c] = mem[row_addr(c) + r], that is,
    mem[addr_{2t} + g] (low) and mem[addr_{2t + 1} + g] (high).

    Alignment: "a group of four consecutive threads loads 16 bytes. The matrix addresses must be naturally
    aligned accordingly": each row start used must be a multiple of 8 elements; otherwise the result is
    undefined and this raises.
    """
    if num not in (1, 2, 4):
        raise ValueError(f"num must be 1, 2 or 4, not {num}")
    mem = np.asarray(mem_bits, dtype=np.uint16).reshape(-1)
    addr = np.asarray(row_addr).astype(np.int64).reshape(-1)
    if addr.shape != (LANES,):
        raise ValueError(f"row_addr must hold one address per lane (32), not {addr.shape}")
    for lane in range(8 * num):
        a = int(addr[lane])
        if a % 8 != 0:
            raise ValueError(f"lane {lane}'s row address {a} is not 16-byte aligned (a multiple of 8 elements)")
        if a < 0 or a + 8 > mem.size:
            raise ValueError(f"lane {lane}'s row [{a}, {a + 8}) is outside shared memory of {mem.size} elements")
    out = np.zeros((LANES, num), dtype=np.uint32)
    for j in range(num):
        rows = [int(addr[8 * j + r]) for r in range(8)]  # row r of matrix j starts at rows[r]
        for lane in range(LANES):
            g, t = _lane_ids(lane)
            if trans:
                lo = mem[rows[2 * t] + g]
                hi = mem[rows[2 * t + 1] + g]
            else:
                lo = mem[rows[g] + 2 * t]
                hi = mem[rows[g] + 2 * t + 1]
            out[lane, j] = pack_x2(lo, hi)
    return out
