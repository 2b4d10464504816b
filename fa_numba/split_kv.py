"""Split-KV decoding on the host: how the keys are split, the rule that picks the split count, the combine's
NumPy twin, and the tolerance a split result is judged by (proofs/L11_split_kv.md).

A split is a range of `tiles_per_split` key tiles: split s holds keys [s T_s B_c, (s + 1) T_s B_c). With a
fixed split size the same keys always fall in the same split whatever else is in the batch, so a request's
result does not depend on its batch (bitwise); `num_splits` (or the heuristic) derives the split size from
the longest request of the batch, which trades that invariance away.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_numba import masks, online_softmax, reference, tolerance
from fa_numba.tolerance import EXP_REL, U32

#: The heuristic stops adding splits once the grid fills this share of the SMs without them (flash-attn's
#: rule of thumb), and takes the fewest splits whose wave efficiency is within EFFICIENCY_SLACK of the best.
FULL_ENOUGH = 0.8
EFFICIENCY_SLACK = 0.85


def wave_efficiency(blocks: int, slots: int) -> float:
    """The share of the SM slots the last wave of `blocks` blocks leaves busy, over all waves: n / ceil(n),
    n = blocks / slots (slots: SMs x the blocks one SM holds at a time)."""
    waves = blocks / slots
    return waves / np.ceil(waves)


def heuristic_splits(blocks: int, key_tiles: int, slots: int, max_splits: int) -> int:
    """The split count for a grid of `blocks` blocks (requests x K/V heads x query tiles) over `key_tiles`
    key tiles on `slots` block slots (SMs x resident blocks per SM), by the wave-efficiency rule flash-attn
    uses: no split when the grid already fills FULL_ENOUGH of the slots; otherwise, among the counts
    1..max_splits that change the tiles per split, the fewest whose efficiency (`wave_efficiency` of blocks x
    splits) is within EFFICIENCY_SLACK of the best. Counting slots, not SMs, matters to decoding: a split
    kernel hides its load latency only with several blocks on each SM.

    >>> heuristic_splits(8, 1024, 132, 128), heuristic_splits(256, 1024, 132, 128)
    (14, 1)
    """
    if blocks >= FULL_ENOUGH * slots:
        return 1
    limit = max(1, min(max_splits, key_tiles, slots))
    eligible = [s for s in range(1, limit + 1) if s == 1 or -(-key_tiles // s) != -(-key_tiles // (s - 1))]
    efficiency = {s: wave_efficiency(blocks * s, slots) for s in eligible}
    best = max(efficiency.values())
    return next(s for s in eligible if efficiency[s] >= EFFICIENCY_SLACK * best)


def row_intervals(lengths: np.ndarray, n_q: int, group: int, causal: bool, mask=None) -> np.ndarray:
    """(B, R, 2) int32: the keys [lo, hi) packed row r = t N_q + i of each request sees: all n_b of them, or
    with causal masking those up to n_b - N_q + i (bottom-right aligned), none past the request's length.
    mask: a `fa_numba.masks` mask with row intervals (window, prefix-LM, causal), evaluated per request over
    (N_q, n_b), so its diagonal is the request's bottom-right one (query i at absolute position n_b - N_q + i);
    a row sees the intersection of the mask's interval and the causal one."""
    i = np.tile(np.arange(n_q), group)  # the query index of each packed row
    hi = np.broadcast_to(lengths[:, None], (len(lengths), n_q * group))
    if causal:
        hi = np.clip(lengths[:, None] - n_q + i[None, :] + 1, 0, lengths[:, None])
    lo = np.zeros_like(hi)
    if mask is not None:
        lo, hi = lo.copy(), hi.copy()
        for b, n in enumerate(lengths):
            if n == 0 or n_q == 0:
                continue
            mask_lo, mask_hi = (np.tile(x.astype(np.int64), group) for x in mask.row_intervals(n_q, int(n)))
            lo[b], hi[b] = np.maximum(lo[b], mask_lo), np.minimum(hi[b], mask_hi)
        lo = np.minimum(lo, hi)  # lo = hi: the row sees no key
    return np.ascontiguousarray(np.stack([lo, hi], axis=-1).astype(np.int32))


@dataclass(frozen=True)
class Splits:
    """The split of one launch: `count` splits of `tiles` key tiles of `block_k` keys each."""

    count: int
    tiles: int
    block_k: int

    @property
    def keys(self) -> int:
        """Keys per split (the split size)."""
        return self.tiles * self.block_k

    def ranges(self, n_k: int) -> list[tuple[int, int]]:
        """The key range [lo, hi) of every split over n_k keys (empty ranges past n_k included)."""
        return [(min(s * self.keys, n_k), min((s + 1) * self.keys, n_k)) for s in range(self.count)]


def combine(lse_splits: np.ndarray, o_splits: np.ndarray, alive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The combine kernel's NumPy twin: fold online_softmax.merge over the split states (LSE_s, 1, O_s) in
    split order, skipping empty splits (LSE_s = -inf, the identity); lse_splits (S, rows), o_splits (S, rows,
    d), alive (rows,) bool (the mask's word). Returns (O, LSE) by online_softmax.finalize."""
    rows, d = o_splits.shape[1:]
    state = online_softmax.identity(rows, d, o_splits.dtype)
    for lse_s, o_s in zip(lse_splits, o_splits):
        full = lse_s != -np.inf
        split = online_softmax.State(np.where(full, lse_s, -np.inf), full.astype(o_s.dtype),
                                     np.where(full[:, None], o_s, 0))
        merged = online_softmax.merge(state, split)
        state = online_softmax.State(*(np.where(full if x.ndim == 1 else full[:, None], y, x)
                                       for x, y in zip(state, merged)))
    return online_softmax.finalize(state, alive)


@dataclass(frozen=True)
class DecodeCheck:
    """What `check` measured of one request: errors and the tolerances they were held to."""

    err_out: float
    err_lse: float
    atol_out: float
    atol_lse: float


def combine_terms(lse_s: np.ndarray, share: np.ndarray, o_abs: np.ndarray, out_abs: np.ndarray):
    """(out, lse, E) rounding terms of the combine (proofs/L11, L6 part 8), per row: lse_s and share (S, rows),
    o_abs (S, rows, d), out_abs (rows, d). Each non-empty split's weight
    exp(LSE_s - m) is off by at most e = EXP_REL + u (1 + |LSE_s - M|) relative, and the fold's products and
    sums compound E = (1 + e + 2u)^S (1 + u) - 1 over S splits; O = acc / l then moves by at most
    E sum_s pi_s (|O_s| + |O|), LSE = m + log l by E + u |LSE| + EXP_REL log S (log's error on l <= S)."""
    splits = lse_s.shape[0]
    with np.errstate(invalid="ignore"):
        top = np.max(lse_s, axis=0)
        spread = np.where(share > 0, np.abs(lse_s - top), 0.0).max(axis=0)
    e = EXP_REL + U32 * (1 + spread)
    compound = (1 + e + 2 * U32) ** splits * (1 + U32) - 1
    out_term = compound[..., None] * (np.einsum("sr,srx->rx", share, o_abs) + out_abs)
    return out_term, compound + EXP_REL * np.log(splits) + U32, compound


@dataclass(frozen=True)
class ExactPart:
    """A part of a merge that carries no error (a sink's state: O = 0, LSE = s_h, proofs/L14), beside the
    `tolerance.Baseline`s that `combined_tolerances` merges."""

    out: np.ndarray
    lse: np.ndarray

    def tolerances(self, order=None) -> tuple[float, float]:
        return 0.0, 0.0


def check(out, lse, q, k, v, *, causal: bool, scale: float, block_k: int, splits: Splits | None,
          name: str = "decode", contractions=None, p_dtype: str | None = None, sinks=None, mask=None) -> DecodeCheck:
    """Judge one request's decode result against the float64 reference with the derived rule: q (H, N_q, d),
    k, v (H_kv, n, d) its keys (the cache up to its length), out (H, N_q, d), lse (H, N_q).

    Unsplit (splits=None) it is the v2 rule with tiles (1, block_k): a row's rescalings happen only at key
    tiles it sees, whichever rows share its query tile. Split, each split's keys are a sub-problem judged by
    that rule; its errors reach the combined row through the combine's derivatives (dO/dO_s = pi_s, dO/dLSE_s =
    pi_s (O_s - O), dLSE/dLSE_s = pi_s, pi_s = exp(LSE_s - LSE)), and the combine adds its own rounding
    (`combine_terms`). A request with no key gets exactly O = 0 and LSE = -inf. contractions: the naive float32
    evaluations' orders (tolerance.baseline's; ("matmul",) on large problems). p_dtype: the kernel rounds P to
    this 16-bit type before P V (the tensor-core split kernel), which each split's rule and the whole's then
    carry (`tolerance.p_rounding_term`, proofs/L6 part 7). sinks: (H,) the sink logits the call merged into every
    row after the combine (proofs/L14): one more exact part of the merge, so the rule is the combined one even
    unsplit. mask: the call's mask (`row_intervals`), intersected with causal as the call does."""
    more = {} if contractions is None else {"contractions": contractions}
    more["p_dtype"] = p_dtype
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if n_k == 0:
        empty = -np.inf if sinks is None else np.broadcast_to(np.asarray(sinks, np.float64)[:, None], lse.shape)
        tolerance.assert_close(out, np.zeros(out.shape), 0.0, name=f"{name} out")
        tolerance.assert_close(lse, np.full(lse.shape, empty), 0.0, name=f"{name} lse")
        return DecodeCheck(0.0, 0.0, 0.0, 0.0)
    visible = masks.causal().dense(n_q, n_k) if causal else np.ones((n_q, n_k), bool)
    if mask is not None:
        visible = visible & mask.dense(n_q, n_k)
    whole = tolerance.baseline(q, k, v, scale=scale, mask=_mask(visible), block_q=1, block_k=block_k, **more)
    if sinks is not None:  # the reference with the sinks' columns, and the sink as one more part of the merge
        ref_out, ref_lse = reference.attention(q, k, v, scale=scale, mask=_mask(visible), sinks=sinks)
        sink = ExactPart(np.zeros(ref_out.shape), np.broadcast_to(np.asarray(sinks, np.float64)[:, None],
                                                                  ref_lse.shape))
        parts = [whole] if splits is None else _parts(q, k, v, scale, visible, block_k, splits, more)
        atol_out, atol_lse = combined_tolerances(ref_out, ref_lse, parts + [sink])
        err_out = tolerance.assert_close(out, ref_out, atol_out, name=f"{name} out")
        err_lse = tolerance.assert_close(lse, ref_lse, atol_lse, name=f"{name} lse")
        return DecodeCheck(err_out, err_lse, atol_out, atol_lse)
    if splits is None:
        atol_out, atol_lse = whole.tolerances("v2")
        err_out = tolerance.assert_close(out, whole.out, atol_out, name=f"{name} out")
        err_lse = tolerance.assert_close(lse, whole.lse, atol_lse, name=f"{name} lse")
        return DecodeCheck(err_out, err_lse, atol_out, atol_lse)
    parts = _parts(q, k, v, scale, visible, block_k, splits, more)
    atol_out, atol_lse = combined_tolerances(whole.out, whole.lse, parts)
    err_out = tolerance.assert_close(out, whole.out, atol_out, name=f"{name} out")
    err_lse = tolerance.assert_close(lse, whole.lse, atol_lse, name=f"{name} lse")
    return DecodeCheck(err_out, err_lse, atol_out, atol_lse)


def _parts(q, k, v, scale, visible, block_k, splits: Splits, more: dict) -> list:
    """The baselines of the splits that see a key of these rows (each a v2 problem on its keys)."""
    return [tolerance.baseline(q, k[..., lo:hi, :], v[..., lo:hi, :], scale=scale, mask=_mask(visible[:, lo:hi]),
                               block_q=1, block_k=block_k, **more)
            for lo, hi in splits.ranges(k.shape[-2]) if hi > lo and visible[:, lo:hi].any()]


def combined_tolerances(ref_out: np.ndarray, ref_lse: np.ndarray, parts: list,
                        order: str | None = "v2") -> tuple[float, float]:
    """(atol_out, atol_lse) of rows merged from the parts' (O_s, LSE_s) (proofs/L11 part 8): ref_out, ref_lse the
    float64 reference of the whole rows; parts the `tolerance.baseline`s of the disjoint key sets merged (each
    judged by `tolerances(order)`: the v2 rule by default; a sink's exact part gives 0), sub-problems of the same
    rows. Each part's tolerances reach a row
    through pi_s (and pi_s |O_s - O| for LSE_s's), the merge adds `combine_terms`, and the result's rounding
    floor is added once."""
    count = len(parts)
    with np.errstate(invalid="ignore", over="ignore"):
        lse_s = np.stack([p.lse for p in parts])  # (S', rows...)
        o_s = np.stack([p.out for p in parts])  # (S', rows..., d)
        share = np.where(np.isfinite(lse_s), np.exp(lse_s - ref_lse), 0.0)  # pi_s
        atols = np.array([p.tolerances(order) for p in parts])  # (S', 2): each part's (atol_out, atol_lse)
        spread = np.abs(o_s - ref_out)
        out_term, lse_term, _ = combine_terms(lse_s.reshape(count, -1), share.reshape(count, -1),
                                              np.abs(o_s).reshape(count, -1, o_s.shape[-1]),
                                              np.abs(ref_out).reshape(-1, o_s.shape[-1]))
        atol_out_rows = (np.einsum("s,s...->...", atols[:, 0], share)[..., None]
                         + np.einsum("s,s...,s...x->...x", atols[:, 1], share, spread)
                         + out_term.reshape(o_s.shape[1:]) + tolerance.rounding_floor(ref_out))
        atol_lse_rows = (np.einsum("s,s...->...", atols[:, 1], share) + lse_term.reshape(lse_s.shape[1:])
                         + tolerance.rounding_floor(ref_lse))
    return tolerance._finite_max(atol_out_rows), tolerance._finite_max(atol_lse_rows)


def _mask(visible: np.ndarray):
    """A from_dense mask of `visible`, or None when every pair is visible (the unmasked reference)."""
    return None if visible.all() else masks.from_dense(visible)
