"""The definition: dense attention that materialises S and P, and the derived tolerance rule.

    S = scale * Q K^T,  S_ij = -inf where key j is masked,
    LSE_i = log sum_j exp(S_ij),  O_i = sum_j exp(S_ij - LSE_i) V_j.

`attention` computes this in float64 and is what every other layer is checked against.
`attention_naive_f32` is the same computation in float32: its error against the float64 result is the
yardstick of the tolerance rule (DESIGN.md, proofs/L6_floating_point.md):

    err(x) = max |x - ref_float64|,   pass iff err(x) <= 2 * err(naive float32) + floor + score floor,
    floor  = 2 * max |fl32(ref + 0.3) - 0.3 - ref|, taken at its bound ulp32(max |ref| + 0.3),

and for the output of the v1 order also + the round-trip term.

Refinements, all because the simulator's tensors are tiny (a few dozen entries), where one sample of
rounding noise can be lucky: err(naive float32) is the largest error over five evaluation orders of the
sums (BLAS matmul; plain loops forward and reversed that round every product as a kernel without FMA does;
a balanced tree, as SIMD reductions sum; fused multiply-adds in index order, as a GPU kernel's FFMA loop
does), and the floor is the ulp bound its DESIGN.md formula tends to on large tensors. Two terms are
derived (proofs/L6, parts 3 and 4), with u = U32 = 2^-24 and W_ij = P_ij u |S_ij|:

- score floor: every float32 implementation rounds each score at least once; to first order that moves
  O_ix by at most sum_j W_ij (|V_jx| + |O_ix|) and LSE_i by at most sum_j W_ij (max over entries). The naive
  evaluation rounds its scores too, but on a tiny tensor its rounding of the few scores that matter (a near
  tie of two keys) can happen to be almost exact.
- v1 round trips: v1 keeps O = acc / l in HBM between the visits of a row (Algorithm 1), so after each of
  its key tiles but the last it rebuilds acc = O l: acc times (1 + d1)(1 + d2), two roundings the naive
  computation never makes. They move O by at most
  gamma_2 (1 + gamma_2)^(R - 1) max_{i,x} sum_{t < T_i - 1} |sum_{j < c_1(t)} P_ij V_jx|,
  T_i the key tiles row i's query tile visits, R = max T_i - 1, gamma_n = n u / (1 - n u). l, m and LSE
  make no round trip. The term needs the tiles: baseline(..., block_q=, block_k=), judged with order="v1".

Causal masking is bottom-right aligned (FlashAttention >= 2.1): query i sees key j iff j <= i + N_k - N_q.
A row with no visible key (possible when N_q > N_k) has O = 0 and LSE = -inf; no NaN and no warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_numba import shapes


U32 = 2.0**-24  # unit roundoff of float32, the kernels' arithmetic: |fl(x) - x| <= U32 |x|


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): |prod_{k<=n} (1 + d_k) - 1| <= gamma_n whenever every |d_k| <= u."""
    if n < 0 or n * u >= 1:
        raise ValueError(f"gamma needs 0 <= n u < 1, got n = {n}, u = {u}")
    return n * u / (1 - n * u)


ROUND_TRIP = gamma(2)  # one v1 round trip, fl(fl(acc / l) l) = acc (1 + d1)(1 + d2): at most gamma_2 relative


def visits(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool) -> np.ndarray:
    """(N_q,) number of key tiles the query tile of each row visits: T_c, or with `causal` the non-SKIP
    prefix J_i + 1 of L3 (0 for a tile that sees no key). A v1 row makes visits - 1 round trips.

    >>> visits(4, 4, 2, 2, causal=True).tolist(), visits(4, 6, 2, 4, causal=False).tolist()
    ([1, 1, 2, 2], [2, 2, 2, 2])
    """
    for name, value in (("n_q", n_q), ("n_k", n_k), ("block_q", block_q), ("block_k", block_k)):
        shapes.check_block(name, value)
    t_c = -(-n_k // block_k)
    if not causal:
        return np.full(n_q, t_c)
    tile_end = np.minimum((np.arange(n_q) // block_q + 1) * block_q, n_q)  # r_1 of each row's query tile
    last_key = tile_end - 1 + (n_k - n_q)  # the last key the tile's last row sees (bottom-right causal)
    return np.where(last_key >= 0, np.minimum(last_key // block_k, t_c - 1) + 1, 0)


def causal_mask(n_q: int, n_k: int) -> np.ndarray:
    """Boolean (N_q, N_k) mask of visible pairs: True iff j <= i + (N_k - N_q) (bottom-right aligned)."""
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    return j <= i + (n_k - n_q)


CONTRACTIONS = ("matmul", "loop", "loop_reversed", "pairwise", "fma")


def _pairwise(a, b, lo, hi):
    """sum_{x in [lo, hi)} a[..., x] b[x, :] as a balanced tree, every product and every sum rounded."""
    if hi - lo == 1:
        return a[..., lo, None] * b[..., lo, None, :]
    mid = (lo + hi) // 2
    return _pairwise(a, b, lo, mid) + _pairwise(a, b, mid, hi)


def _contract(a, b, contraction):
    """a @ b over the last axis of a, in one of the CONTRACTIONS orders (see attention_naive_f32)."""
    if contraction == "matmul":
        return np.matmul(a, b)
    if contraction == "pairwise":
        return _pairwise(a, b, 0, a.shape[-1])
    total = np.zeros(a.shape[:-1] + b.shape[-1:], dtype=a.dtype)
    if contraction == "fma":  # float32 products are exact in float64; the sum is then rounded to float32
        for x in range(a.shape[-1]):
            total = (a[..., x, None].astype(np.float64) * b[..., x, None, :] + total).astype(a.dtype)
        return total
    steps = range(a.shape[-1]) if contraction == "loop" else reversed(range(a.shape[-1]))
    for x in steps:
        total += a[..., x, None] * b[..., x, None, :]
    return total


@dataclass(frozen=True)
class Terms:
    """The derived terms of the tolerance rule, from the float64 reference of one problem (proofs/L6).

    With W_ij = P_ij u |S_ij| (u = U32), the score floor is score_out = max_{i,x} (W |V| + |O| sum_j W)_ix and
    score_lse = max_i sum_j W_ij: what one float32 rounding of every score can move O and LSE by, to first
    order. v1_out = ROUND_TRIP (1 + ROUND_TRIP)^(R - 1) max_{i,x} sum_{t < T_i - 1} |sum_{j < c_1(t)} P_ij V_jx|,
    T_i = visits(...)_i, R = max_i T_i - 1: what v1's round trips of O through HBM can move O by (None when
    the tiles were not given).
    """

    score_out: float
    score_lse: float
    v1_out: float | None = None


def _round_trip_sums(p, v4, tiles, causal):
    """(sums, R): sums (B, H, N_q, d) adds up, over the round trips t = 0 .. T_i - 2 of row i, the partial
    output |P_i,:c_1(t) V_:c_1(t)| after key tile t, which the round trip after tile t perturbs (proofs/L6,
    part 3); R = max_i T_i - 1 is the most round trips a row makes."""
    block_q, block_k = tiles
    n_q, n_k = p.shape[-2:]
    trips = visits(n_q, n_k, block_q, block_k, causal) - 1  # (N_q,)
    partial = np.zeros(p.shape[:-1] + v4.shape[-1:])
    total = np.zeros_like(partial)
    for t in range(int(trips.max(initial=0))):
        c0, c1 = t * block_k, min((t + 1) * block_k, n_k)
        partial += p[..., c0:c1] @ v4[..., c0:c1, :]
        total += np.where((trips > t)[:, None], np.abs(partial), 0.0)
    return total, int(trips.max(initial=0))


def _dense(q, k, v, causal, scale, dtype, contraction="matmul", terms=False, tiles=None):
    if contraction not in CONTRACTIONS:
        raise ValueError(f"contraction must be one of {CONTRACTIONS}, got {contraction!r}")
    prob = shapes.problem(q, k, v)
    causal = shapes.check_causal(causal)
    scale = dtype(shapes.resolve_scale(scale, prob.d))
    q4, k4, v4 = (shapes.as_4d(np.asarray(x)).astype(dtype) for x in (q, k, v))
    # GQA: query head h reads K/V head h // group.
    k4 = np.repeat(k4, prob.group, axis=1)
    v4 = np.repeat(v4, prob.group, axis=1)
    s = scale * _contract(q4, np.swapaxes(k4, -1, -2), contraction)  # S: (B, H, N_q, N_k)
    if causal:
        s = np.where(causal_mask(prob.n_q, prob.n_k), s, dtype(-np.inf))
    m = s.max(axis=-1)  # row max, -inf on a fully masked row
    m_safe = np.where(np.isfinite(m), m, dtype(0))  # shift by 0 on empty rows: exp(-inf - 0) = 0, not NaN
    p = np.exp(s - m_safe[..., None])  # every exponent argument <= 0
    l = _contract(p, np.ones(p.shape[-1:] + (1,), dtype=dtype), contraction)[..., 0]
    visible = l > 0
    lse = np.full_like(m, -np.inf)
    np.add(m_safe, np.log(l, where=visible, out=np.zeros_like(l)), out=lse, where=visible)
    p = np.divide(p, l[..., None], where=visible[..., None], out=np.zeros_like(p))
    out = _contract(p, v4, contraction)
    result = shapes.drop_lead(out, q.ndim), shapes.drop_lead(lse, q.ndim)
    if not terms:
        return result
    v1_out = None
    if tiles is not None:
        sums, trips = _round_trip_sums(p, v4, tiles, causal)
        v1_out = ROUND_TRIP * (1 + ROUND_TRIP) ** max(trips - 1, 0) * _finite_max(sums)
    w = np.abs(s, out=s)  # reuse S's memory for W = P u |S|, 0 where P = 0 (a masked P |S| would be 0 inf)
    np.copyto(w, 0, where=p == 0)
    w *= p
    w *= U32
    w_sum = w.sum(axis=-1)
    score_out = w @ np.abs(v4) + np.abs(out) * w_sum[..., None]
    return result + (Terms(_finite_max(score_out), _finite_max(w_sum), v1_out),)


def _finite_max(x: np.ndarray) -> float:
    """max of the finite entries of x (0.0 if none): rows made non-finite by their inputs are judged by
    assert_close's non-finite check, not by a tolerance."""
    finite = x[np.isfinite(x)]
    return float(finite.max()) if finite.size else 0.0


def attention(q, k, v, *, causal: bool = False, scale: float | None = None):
    """Float64 dense attention. Returns (out, lse) with out like q and lse like q without its last axis.

    >>> import numpy as np
    >>> q = k = v = np.eye(2)
    >>> out, lse = attention(q, k, v, causal=True)
    >>> out[0].tolist(), round(float(lse[0]), 6)   # query 0 sees only key 0: LSE = S_00 = 1/sqrt(2)
    ([1.0, 0.0], 0.707107)
    """
    return _dense(q, k, v, causal, scale, np.float64)


def attention_naive_f32(q, k, v, *, causal: bool = False, scale: float | None = None, contraction: str = "matmul"):
    """The same dense computation in float32: the baseline the tolerance rule scales with.

    contraction picks how the three sums (over d for S, over keys for l and for P V) are evaluated:
    "matmul" (BLAS, which may fuse multiply-adds and block the sums), "loop" (one rounded product and one
    rounded add per term, in index order, as a CUDA-core kernel without FMA does), "loop_reversed",
    "pairwise" (a balanced tree of rounded sums, as SIMD reductions do) or "fma" (index order, one rounding
    per fused multiply-add, as a GPU's FFMA loop does; emulated by an exact float64 product and a float64 sum
    rounded to float32, which differs from one rounding only in rare double-rounding ties).
    """
    return _dense(q, k, v, causal, scale, np.float32, contraction)


# ----------------------------------------------------------------------------------------------------
# The derived tolerance rule.


def max_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| over entries where `expected` is finite (0.0 if there are none).

    Non-finite entries are compared by `assert_close`, never skipped there.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    finite = np.isfinite(expected)
    if not finite.any():
        return 0.0
    diff = np.abs(actual[finite] - expected[finite])
    return float(np.max(diff)) if np.isfinite(diff).all() else float("inf")


def rounding_floor(expected: np.ndarray) -> float:
    """floor = ulp32(max |ref| + 0.3): the float32 rounding step at the data's magnitude.

    DESIGN.md writes it as 2 max |fl32(ref + 0.3) - 0.3 - ref|. Each |fl32(x) - x| is at most half an
    ulp of x, and on a large tensor the max reaches that bound, so the formula tends to ulp32(max|ref| + 0.3).
    We use the bound itself: on the simulator's tiny tensors the realised max can be far below it by luck.
    """
    expected = np.asarray(expected, dtype=np.float64)
    finite = np.abs(expected[np.isfinite(expected)])
    if finite.size == 0:
        return 0.0
    return float(np.spacing(np.float32(finite.max() + 0.3)))


def tolerance(expected: np.ndarray, naive, score_floor: float = 0.0) -> float:
    """atol = 2 * err(naive float32) + floor + score floor for one output tensor (O or LSE).

    `naive` is one float32 evaluation or a sequence of them (e.g. the CONTRACTIONS); err(naive) is the
    largest of their errors, which estimates float32 rounding noise better than one evaluation on a tiny tensor.
    `score_floor` is Terms.score_out or Terms.score_lse of the problem (0 leaves it out).
    """
    naive = [naive] if isinstance(naive, np.ndarray) else list(naive)
    return 2.0 * max(max_error(n, expected) for n in naive) + rounding_floor(expected) + score_floor


def assert_close(actual, expected, atol: float, *, name: str = "value") -> float:
    """Assert |actual - expected| <= atol entrywise; non-finite entries must match exactly.

    Returns the max error. The AssertionError reports how many entries fail and the first few indices,
    with NaN/inf mismatches counted separately from finite ones that are too far.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {actual.shape} != expected {expected.shape}")
    finite = np.isfinite(expected)
    # Any disagreement in NaN/inf status is its own category: a non-finite reference entry (LSE = -inf on
    # an empty row) must be reproduced exactly, and a NaN or inf where the reference is finite never passes.
    nonfinite_bad = np.where(finite, ~np.isfinite(actual), ~(actual == expected))
    with np.errstate(invalid="ignore"):
        finite_bad = finite & np.isfinite(actual) & ~(np.abs(actual - expected) <= atol)
    problems = []
    for label, bad in (("non-finite mismatch", nonfinite_bad), ("beyond atol", finite_bad)):
        count = int(bad.sum())
        if count:
            first = [tuple(int(c) for c in idx) for idx in np.argwhere(bad)[:5]]
            shown = ", ".join(f"{idx}: got {actual[idx]!r}, expected {expected[idx]!r}" for idx in first)
            problems.append(f"{count} entries {label} (first: {shown})")
    err = max_error(actual, expected)
    if problems:
        raise AssertionError(f"{name}: max error {err:.3e} vs atol {atol:.3e}; " + "; ".join(problems))
    return err


@dataclass(frozen=True)
class Check:
    """The outcome of `check_attention`: errors and tolerances of O and LSE."""

    err_out: float
    err_lse: float
    atol_out: float
    atol_lse: float


@dataclass(frozen=True)
class Baseline:
    """The float64 reference of one problem and the tolerances the derived rule allows around it.

    atol_out and atol_lse are the rule for an order that keeps its state on chip (v2, or any dense
    implementation); `tolerances("v1")` adds v1's round-trip term to atol_out, which needs the baseline to
    have been built with the tiles (baseline(..., block_q=, block_k=)).
    """

    out: np.ndarray
    lse: np.ndarray
    atol_out: float
    atol_lse: float
    terms: Terms = Terms(0.0, 0.0)

    def tolerances(self, order: str | None = None) -> tuple[float, float]:
        """(atol_out, atol_lse) for an implementation of `order` ("v1", "v2", or None for a dense one)."""
        if order in (None, "v2"):
            return self.atol_out, self.atol_lse
        if order != "v1":
            raise ValueError(f"order must be 'v1', 'v2' or None, got {order!r}")
        if self.terms.v1_out is None:
            raise ValueError("judging order 'v1' needs the tiles: build the baseline with block_q= and block_k=")
        return self.atol_out + self.terms.v1_out, self.atol_lse


def baseline(q, k, v, *, causal: bool = False, scale: float | None = None, contractions=CONTRACTIONS,
             block_q: int | None = None, block_k: int | None = None) -> Baseline:
    """Reference and tolerances, computed once per problem and shared by every implementation checked.

    The naive float32 baseline is evaluated once per contraction order; pass contractions=("matmul",) on
    large tensors, where one evaluation already samples the rounding noise well and the loops are slow.
    Give the tiles (block_q and block_k) to judge a v1 implementation: its round-trip term depends on them.
    """
    if (block_q is None) != (block_k is None):
        raise ValueError("give both block_q and block_k, or neither")
    tiles = None if block_q is None else (block_q, block_k)
    ref_out, ref_lse, terms = _dense(q, k, v, causal, scale, np.float64, terms=True, tiles=tiles)
    naive = [attention_naive_f32(q, k, v, causal=causal, scale=scale, contraction=c) for c in contractions]
    return Baseline(ref_out, ref_lse, tolerance(ref_out, [n[0] for n in naive], terms.score_out),
                    tolerance(ref_lse, [n[1] for n in naive], terms.score_lse), terms)


def judge(out, lse, base: Baseline, *, name: str = "kernel", order: str | None = None) -> Check:
    """Assert (out, lse) is within the baseline's tolerances for `order`; returns the errors and tolerances."""
    atol_out, atol_lse = base.tolerances(order)
    err_out = assert_close(out, base.out, atol_out, name=f"{name} out")
    err_lse = assert_close(lse, base.lse, atol_lse, name=f"{name} lse")
    return Check(err_out, err_lse, atol_out, atol_lse)


def check_attention(out, lse, q, k, v, *, causal: bool = False, scale: float | None = None, name: str = "kernel",
                    contractions=CONTRACTIONS, order: str | None = None, block_q: int | None = None,
                    block_k: int | None = None) -> Check:
    """Check (out, lse) from any implementation against the float64 reference with the derived rule.

    For a v1 implementation pass order="v1" and its tiles, so that its round-trip term is allowed for.
    """
    base = baseline(q, k, v, causal=causal, scale=scale, contractions=contractions, block_q=block_q, block_k=block_k)
    return judge(out, lse, base, name=name, order=order)
