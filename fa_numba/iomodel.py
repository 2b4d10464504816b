"""HBM traffic of the v1 and v2 loop orders in closed form (proofs/L5_hbm_traffic.md), and of any block
mask as a sum over its lists (proofs/L8_block_masks.md).

Counts are in elements, per tensor, for the schedules that `tiled` executes; tests prove the two agree.
Per (batch, query head), with r_i the rows of query tile i, c_j the columns of key tile j and
delta = N_k - N_q, everything depends on four sums over the visited tiles (`visits`):

    R      = sum over visits (i, j) of r_i        row-visits: what travels once per visit in v1 and "kv"
    K      = sum over visits (i, j) of c_j        key-visits: what travels once per visit in v2 and "q"
    Q_vis  = sum of r_i over the query tiles whose list of key tiles is non-empty
    K_vis  = sum of c_j over the key tiles whose list of query tiles is non-empty

Causal masking (causal=True, or a mask whose kernel form is "causal") has them in closed form (L5):

    last visible key tile of query tile i:  J_i = min(T_c - 1, floor((r1_i - 1 + delta) / B_c))   (-1: none)
    keys seen by query tile i:              K_i = min(N_k, (J_i + 1) B_c)     (0 when J_i = -1)
    first query tile that needs key tile j: I_j = clip(ceil((c0_j + 1 - delta) / B_r) - 1, 0, T_r - 1)
    query rows that visit key tile j:       R_j = N_q - I_j B_r
    R = sum_j R_j,  K = sum_i K_i,  Q_vis = sum_{i: J_i >= 0} r_i,  K_vis = N_k (the last query tile sees
    every key tile)

Without masking (or with skip=False: every tile visited) R = T_c N_q, K = T_r N_k, Q_vis = N_q, K_vis = N_k.
Any other mask (`mask=`, a `fa_numba.masks` mask) sums the lengths of its `tiling.block_mask` lists:
R = sum_i r_i n_i and Q_vis = sum_{i: n_i > 0} r_i with n_i the length of query tile i's list (row_ptr),
K = sum_j c_j m_j and K_vis = sum_{j: m_j > 0} c_j with m_j that of key tile j's list (col_ptr). The
lengths come from `tile_counts.count`, which reads them off the mask's row intervals in O(N_q log N_q)
(window, prefix, documents; equal to the lists' lengths, tests/test_analytic_scale.py) and classifies tile
by tile, O(T_r T_c), only a mask without intervals (from_function, from_dense). Then

    v2:  Q read Q_vis d;  K, V read K d;  O written N_q d;  LSE written N_q.
    v1:  O, l, m initialised (written N_q d, N_q, N_q);  K, V read K_vis d;  Q read R d;
         O read R d, written (N_q + R) d;  l, m read R + N_q, written N_q + R;  LSE written N_q.

So v1 moves Q and O about T_c times (non-causal: Q read T_c N_q d) and v2 moves K and V about T_r times
(non-causal: K read T_r N_k d). Non-causal, v1 - v2 in Q+O elements is (3 T_c - 1) N_q d, and v2 - v1 in
K+V elements is 2 (T_r - 1) N_k d. Extra memory beyond Q, K, V, O is O(N) for l, m, LSE, never O(N^2).

The backward (`traffic_backward`, proofs/L7_backward.md), per query head unless "per K/V head":

    preprocess (both):  O read N_q d;  dO read N_q d;  D written N_q.
    "kv":   per K/V head: K, V read K_vis d each;  dK, dV written N_k d each (zeros where no tile is visited).
            Q read R d;  dO read R d;  LSE, D read R each;  dQ read R d, written (N_q + R) d (zeroed,
            then one atomic read-modify-write per visit).
    "kv", deterministic: as "kv" without dQ traffic, plus the dQ pass: Q, dO read Q_vis d; LSE, D read
            Q_vis; K, V read K d each; dQ written N_q d.
    "q":    per K/V head: dK, dV written N_k d each (zeroed).  Q, dO read Q_vis d;  LSE, D read Q_vis;
            K, V read K d each;  dK, dV read K d and written K d each (atomic adds);  dQ written N_q d
            (zeros for a query tile with an empty list).

With a value head dim of its own (d_v=, MLA's d = 192, d_v = 128), every count of V, O, dO and dV above has
d_v where it says d; Q, K, dQ and dK keep d.

Non-causal (R = T_c N_q, K = T_r N_k, Q_vis = N_q): "kv" moves Q, dO, dQ about T_c times and K, V, dK,
dV once; "q" moves K, V about T_r times and dK, dV 2 T_r times (read and written).

The block mask is metadata, not in these counts (it is the same for every batch and head, and small):
per (batch, head) a kernel reads its walk's lists, 4 (T + 1) bytes of pointers (T = T_r for v2 and "q",
T_c for v1 and "kv") and 5 bytes (int32 index, int8 kind) per visit; on each PARTIAL visit the row
intervals of the tile's rows, 8 r_i bytes, and for a "dense" mask at most the tile's r_i c_j bytes of the
uint8 mask (only the pairs inside a row's interval are read); the forward kernels read 8 bytes per row to
decide whether it sees a key. A kernel's threads read some of these several times (the tile engine's
column groups each read their rows' intervals); those repeats hit in cache. Causal reads none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_numba import shapes, tile_counts
from fa_numba.split_kv import row_intervals
from fa_numba.tiled import BACKWARD_TENSORS, Ledger
from fa_numba.tiling import Grid, check_backward_order, check_order


def _tile_sizes(grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """r_i (T_r,) and c_j (T_c,) int64: the rows of each query tile and the columns of each key tile."""
    rows = np.full(grid.t_r, grid.block_q, dtype=np.int64)
    rows[-1] = grid.n_q - (grid.t_r - 1) * grid.block_q  # the ragged last tile
    cols = np.full(grid.t_c, grid.block_k, dtype=np.int64)
    cols[-1] = grid.n_k - (grid.t_c - 1) * grid.block_k
    return rows, cols


def _keys_seen(grid: Grid) -> np.ndarray:
    """K_i (T_r,): keys (a prefix) that query tile i reads under causal masking (0 when J_i = -1)."""
    r1 = np.minimum((np.arange(grid.t_r, dtype=np.int64) + 1) * grid.block_q, grid.n_q)
    last_tile = np.clip((r1 - 1 + grid.delta) // grid.block_k, -1, grid.t_c - 1)  # J_i (floor: -1 if negative)
    return np.minimum(grid.n_k, (last_tile + 1) * grid.block_k)


def _rows_visiting(grid: Grid) -> np.ndarray:
    """R_j (T_c,): query rows (a suffix) whose tiles visit key tile j under causal masking."""
    c0 = np.arange(grid.t_c, dtype=np.int64) * grid.block_k
    first_tile = np.clip(-(-(c0 + 1 - grid.delta) // grid.block_q) - 1, 0, grid.t_r - 1)  # I_j
    return grid.n_q - first_tile * grid.block_q


@dataclass(frozen=True)
class Visits:
    """The four sums over the visited tiles of one (batch, query head) that the traffic is made of
    (module docstring): rows R, keys K, live_rows Q_vis, live_keys K_vis."""

    rows: int
    keys: int
    live_rows: int
    live_keys: int


def visits(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = False, mask=None,
           skip: bool = True) -> Visits:
    """R, K, Q_vis and K_vis of the schedules of `tiling.schedule(..., causal, skip, mask)`: in closed form
    without masking (or skip=False) and for causal masking (causal=True or a mask of kernel form "causal"),
    summed over the lengths of the block-mask lists for any other mask (`tile_counts.count`: from the
    mask's row intervals, O(N_q log N_q), or tile by tile for a mask without them). O(T_r + T_c) arrays,
    no Python loop over tiles, so it answers for N = 10^6."""
    grid = Grid(n_q, n_k, block_q, block_k)
    causal, mask = shapes.check_mask(causal, mask)
    if mask is not None:
        mask.check(n_q, n_k)
        if mask.kernel_form() == "causal":
            causal, mask = True, None
    if not skip or (mask is None and not causal):
        return Visits(grid.t_c * n_q, grid.t_r * n_k, n_q, n_k)
    rows, cols = _tile_sizes(grid)  # r_i, c_j
    if mask is None:  # causal: the closed forms of L5
        keys = _keys_seen(grid)
        return Visits(int(_rows_visiting(grid).sum()), int(keys.sum()), int(rows[keys > 0].sum()), n_k)
    counts = tile_counts.count(n_q, n_k, block_q, block_k, mask=mask)
    per_row, per_col = counts.per_row, counts.per_col  # n_i, m_j: the lists' lengths
    return Visits(int(rows @ per_row), int(cols @ per_col), int(rows[per_row > 0].sum()),
                  int(cols[per_col > 0].sum()))


def _check_sizes(n_q, n_k, d, block_q, block_k, causal, batch, heads, heads_kv, skip, mask):
    """Validated (d, batch, heads, heads_kv) and the Visits of the schedules (which validate the rest)."""
    d = shapes.check_block("d", d)
    batch = shapes.check_block("batch", batch)
    heads = shapes.check_block("heads", heads)
    heads_kv = heads if heads_kv is None else shapes.check_block("heads_kv", heads_kv)
    if heads % heads_kv:
        raise ValueError(f"heads_kv ({heads_kv}) must divide heads ({heads})")
    return d, batch, heads, heads_kv, visits(n_q, n_k, block_q, block_k, causal, mask, skip)


def _value_dim(d_v, d: int) -> int:
    """V's and O's head dim: d_v, or d where it is None."""
    return d if d_v is None else shapes.check_block("d_v", d_v)


def traffic(order: str, n_q: int, n_k: int, d: int, block_q: int, block_k: int, causal: bool = False,
            batch: int = 1, heads: int = 1, heads_kv: int | None = None, skip: bool = True, mask=None,
            d_v: int | None = None) -> Ledger:
    """Elements read and written per tensor by one call, summed over batch and query heads.
    d is Q's and K's head dim, d_v V's and O's (None: d); Q and K travel with d, V and O with d_v.

    `heads_kv` only has to divide `heads`: each query head streams its own K/V head, so GQA does not
    change the counts. skip=False gives the traffic of a schedule that computes SKIP tiles too. mask: any
    `fa_numba.masks` mask (not with causal=True); its traffic is summed over its block-mask lists.
    """
    check_order(order)
    d, batch, heads, heads_kv, seen = _check_sizes(n_q, n_k, d, block_q, block_k, causal, batch, heads, heads_kv,
                                                   skip, mask)
    dv = _value_dim(d_v, d)
    ledger = Ledger()
    if order == "v2":
        ledger.read("Q", seen.live_rows * d)
        ledger.read("K", seen.keys * d)
        ledger.read("V", seen.keys * dv)
        ledger.write("O", n_q * dv)
        ledger.write("LSE", n_q)
    else:
        ledger.read("K", seen.live_keys * d)
        ledger.read("V", seen.live_keys * dv)
        ledger.read("Q", seen.rows * d)
        ledger.read("O", seen.rows * dv)
        ledger.write("O", (n_q + seen.rows) * dv)
        for stat in ("l", "m"):
            ledger.read(stat, seen.rows + n_q)
            ledger.write(stat, n_q + seen.rows)
        ledger.write("LSE", n_q)
    return ledger.scaled(batch * heads)


def traffic_backward(order: str, n_q: int, n_k: int, d: int, block_q: int, block_k: int, causal: bool = False,
                     batch: int = 1, heads: int = 1, heads_kv: int | None = None, deterministic: bool = False,
                     skip: bool = True, mask=None, d_v: int | None = None) -> Ledger:
    """Elements read and written per tensor (BACKWARD_TENSORS) by one backward call of `tiled.attention_backward`.
    d is Q's, K's, dQ's and dK's head dim, d_v that of V, O, dO and dV (None: d).

    order "kv" (K/V outer, dQ by atomic adds, or with deterministic=True by a separate Q-outer pass) or
    "q" (Q outer, dK and dV by atomic adds); formulas in the module docstring and proofs/L7. Unlike the
    forward, GQA changes the counts: "kv" reads K_j, V_j and writes dK_j, dV_j once per K/V head for
    all the query heads of its group (B H_kv heads), everything else is per query head (B H heads).
    skip=False gives the traffic of schedules that visit SKIP tiles too. mask: any `fa_numba.masks` mask
    (not with causal=True), summed over its block-mask lists (proofs/L8).
    """
    order, deterministic = check_backward_order(order, deterministic)
    d, batch, heads, heads_kv, seen = _check_sizes(n_q, n_k, d, block_q, block_k, causal, batch, heads, heads_kv,
                                                   skip, mask)
    dv = _value_dim(d_v, d)
    width = {"Q": d, "K": d, "dQ": d, "dK": d, "V": dv, "O": dv, "dO": dv, "dV": dv}  # elements per row
    q_heads, kv_heads = batch * heads, batch * heads_kv
    ledger = Ledger.empty(BACKWARD_TENSORS)
    ledger.read("O", q_heads * n_q * dv)  # preprocess: D = rowsum(dO o O)
    ledger.read("dO", q_heads * n_q * dv)
    ledger.write("D", q_heads * n_q)

    def q_outer(kv_grads: bool) -> None:  # per query head: each query tile with a non-empty list, once
        live = seen.live_rows
        for name, count in (("Q", live * d), ("dO", live * dv), ("LSE", live), ("D", live),
                            ("K", seen.keys * d), ("V", seen.keys * dv)):
            ledger.read(name, q_heads * count)
        ledger.write("dQ", q_heads * n_q * d)
        if kv_grads:  # dK_j, dV_j += ... for every visit: atomic read-modify-writes
            for name in ("dK", "dV"):
                ledger.read(name, q_heads * seen.keys * width[name])
                ledger.write(name, q_heads * seen.keys * width[name])

    if order == "q":
        ledger.write("dK", kv_heads * n_k * d)  # dK = dV = 0
        ledger.write("dV", kv_heads * n_k * dv)
        q_outer(kv_grads=True)
        return ledger
    for name in ("K", "V"):  # per K/V head: K_j, V_j read once if key tile j's list is non-empty, dK_j, dV_j written
        ledger.read(name, kv_heads * seen.live_keys * width[name])
        ledger.write("d" + name, kv_heads * n_k * width[name])
    rows = seen.rows
    for name, count in (("Q", rows * d), ("dO", rows * dv), ("LSE", rows), ("D", rows)):
        ledger.read(name, q_heads * count)
    if deterministic:
        q_outer(kv_grads=False)
    else:
        ledger.write("dQ", q_heads * n_q * d)  # dQ = 0, then one read-modify-write per visit
        ledger.read("dQ", q_heads * rows * d)
        ledger.write("dQ", q_heads * rows * d)
    return ledger


def to_bytes(ledger: Ledger, in_itemsize: int, out_itemsize: int = 4, stat_itemsize: int = 4) -> dict[str, dict[str, int]]:
    """Bytes per tensor of a forward or backward ledger: Q, K, V (and dO) at the input itemsize, O (and
    dQ, dK, dV) at the output itemsize, l, m, LSE (and D) as statistics."""
    size = {"Q": in_itemsize, "K": in_itemsize, "V": in_itemsize, "dO": in_itemsize, "O": out_itemsize,
            "dQ": out_itemsize, "dK": out_itemsize, "dV": out_itemsize,
            "l": stat_itemsize, "m": stat_itemsize, "LSE": stat_itemsize, "D": stat_itemsize,
            "O_split": 4, "LSE_split": 4}  # decode's partials: float32 always
    return {
        "read": {t: count * size[t] for t, count in ledger.reads.items()},
        "write": {t: count * size[t] for t, count in ledger.writes.items()},
    }


def total_bytes(ledger: Ledger, in_itemsize: int, out_itemsize: int = 4, stat_itemsize: int = 4) -> int:
    b = to_bytes(ledger, in_itemsize, out_itemsize, stat_itemsize)
    return sum(b["read"].values()) + sum(b["write"].values())


def extra_memory_elements(order: str, n_q: int, batch: int = 1, heads: int = 1) -> int:
    """HBM storage beyond Q, K, V, O: v1 keeps l, m and LSE (3 N_q), v2 only LSE (N_q). O(N), not O(N^2)."""
    check_order(order)
    return batch * heads * n_q * (3 if order == "v1" else 1)


def dense_traffic_elements(n_q: int, n_k: int, d: int, batch: int = 1, heads: int = 1) -> int:
    """HBM elements moved by unfused dense attention that materialises S and P once each:
    read Q, K; write S; read S, write P; read P and V; write O: B H (4 N_q N_k + 2 N_q d + 2 N_k d)."""
    return batch * heads * (4 * n_q * n_k + 2 * n_q * d + 2 * n_k * d)


def materialized_scores_elements(n_q: int, n_k: int, batch: int = 1, heads: int = 1) -> int:
    """Size of S (and of P) that dense attention would materialise in HBM: B H N_q N_k."""
    return batch * heads * n_q * n_k


# The decode kernels' HBM tensors: the inputs, the splits' partial O and LSE (float32), the combined O and LSE.
DECODE_TENSORS = ("Q", "K", "V", "O_split", "LSE_split", "O", "LSE")


def traffic_decode(lengths, n_q: int, d: int, block_q: int, block_k: int, tiles_per_split: int, splits: int,
                   causal: bool = True, heads: int = 1, heads_kv: int = 1, d_v: int | None = None) -> Ledger:
    """Elements read and written by one attention_with_kvcache call (kernels/decode.py), summed over the batch.

    Per request b (n_b = lengths[b] keys) and K/V head, the g N_q rows of its g = heads / heads_kv query heads
    are one problem of R = g N_q rows (row r = t N_q + i), tiled by block_q; row r sees keys [lo_r, hi_r)
    (split_kv.row_intervals). Split s of query tile i visits the key tiles j of s T_s .. (s + 1) T_s - 1 within
    [min lo, max hi) of the tile's rows: K and V are read c_j d each per visit (c_j = min(B_c, n_b - j B_c)),
    Q r_i d once if the split visits any tile; O_split and LSE_split are written r_i d and r_i always. The
    combine reads every LSE_split once per row and O_split's d features only for the splits the row sees a key
    of (an empty split is skipped), and writes O (d) and LSE (1) per row. K and V are read once per (request,
    K/V head, query tile, split): with R <= block_q, once per K/V head, which GQA packing buys. With a value
    head dim of its own (d_v; None: d), V, O_split and O count d_v features where the above says d.
    """
    dv = _value_dim(d_v, d)
    lengths = np.asarray(lengths, dtype=np.int64)
    group = heads // heads_kv
    rows = n_q * group
    lohi = row_intervals(lengths, n_q, group, causal)
    ledger = Ledger.empty(DECODE_TENSORS)
    keys = tiles_per_split * block_k
    for b, n_k in enumerate(lengths):
        lo, hi = lohi[b, :, 0].astype(np.int64), lohi[b, :, 1].astype(np.int64)
        for r0 in range(0, rows, block_q):
            r = min(block_q, rows - r0)
            lo_min, hi_max = lo[r0:r0 + r].min(), hi[r0:r0 + r].max()
            for s in range(splits):
                start = max(s * tiles_per_split, lo_min // block_k)
                stop = min((s + 1) * tiles_per_split, -(-hi_max // block_k))
                if stop > start:
                    ledger.read("Q", r * d)
                    seen = min(n_k, stop * block_k) - start * block_k
                    ledger.read("K", seen * d)
                    ledger.read("V", seen * dv)
                ledger.write("O_split", r * dv)
                ledger.write("LSE_split", r)
        alive_splits = sum(((np.maximum(lo, s * keys) < np.minimum(hi, (s + 1) * keys)).sum())
                           for s in range(splits))
        ledger.read("LSE_split", rows * splits)
        ledger.read("O_split", int(alive_splits) * dv)
        ledger.write("O", rows * dv)
        ledger.write("LSE", rows)
    return ledger.scaled(heads_kv)
