"""HBM traffic of the v1 and v2 loop orders in closed form (proofs/L5_hbm_traffic.md).

Counts are in elements, per tensor, for the schedules that `tiled` executes; tests prove the two agree.
Per (batch, query head), with r_i the rows of query tile i, c_j the columns of key tile j and
delta = N_k - N_q:

    last visible key tile of query tile i:  J_i = min(T_c - 1, floor((r1_i - 1 + delta) / B_c))   (-1: none)
    keys seen by query tile i:              K_i = min(N_k, (J_i + 1) B_c)     (0 when J_i = -1)
    first query tile that needs key tile j: I_j = clip(ceil((c0_j + 1 - delta) / B_r) - 1, 0, T_r - 1)
    query rows that visit key tile j:       R_j = N_q - I_j B_r

Without causal masking J_i = T_c - 1, K_i = N_k, I_j = 0 and R_j = N_q. Let R = sum_j R_j (row-visits).

    v2:  Q read sum_{i: J_i >= 0} r_i d;  K, V read d sum_i K_i;  O written N_q d;  LSE written N_q.
    v1:  K, V read N_k d (every key tile is needed by the last query tile);
         Q read R d;  O read R d, written (N_q + R) d;  l, m read R + N_q, written N_q + R;  LSE written N_q.

So v1 moves Q and O about T_c times (non-causal: Q read T_c N_q d) and v2 moves K and V about T_r times
(non-causal: K read T_r N_k d). Non-causal, v1 - v2 in Q+O elements is (3 T_c - 1) N_q d, and v2 - v1 in
K+V elements is 2 (T_r - 1) N_k d. Extra memory beyond Q, K, V, O is O(N) for l, m, LSE, never O(N^2).

The backward (`traffic_backward`, proofs/L7_backward.md), with Q_vis = sum_{i: J_i >= 0} r_i (rows of the
query tiles that see a key), K = sum_i K_i and R as above, per query head unless "per K/V head":

    preprocess (both):  O read N_q d;  dO read N_q d;  D written N_q.
    "kv":   per K/V head: K, V read N_k d each;  dK, dV written N_k d each.
            Q read R d;  dO read R d;  LSE, D read R each;  dQ read R d, written (N_q + R) d (zeroed,
            then one atomic read-modify-write per visit).
    "kv", deterministic: as "kv" without dQ traffic, plus the dQ pass: Q, dO read Q_vis d; LSE, D read
            Q_vis; K, V read K d each; dQ written N_q d.
    "q":    per K/V head: dK, dV written N_k d each (zeroed).  Q, dO read Q_vis d;  LSE, D read Q_vis;
            K, V read K d each;  dK, dV read K d and written K d each (atomic adds);  dQ written N_q d.

Non-causal (R = T_c N_q, K = T_r N_k, Q_vis = N_q): "kv" moves Q, dO, dQ about T_c times and K, V, dK,
dV once; "q" moves K, V about T_r times and dK, dV 2 T_r times (read and written).
"""

from __future__ import annotations

from fa_numba import shapes
from fa_numba.tiled import BACKWARD_TENSORS, Ledger
from fa_numba.tiling import Grid, check_backward_order, check_order


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _keys_seen(grid: Grid, i: int, causal: bool) -> int:
    """K_i: keys (a prefix) that query tile i reads."""
    last_tile = grid.last_visible_tile(i, causal)
    return min(grid.n_k, (last_tile + 1) * grid.block_k)


def _rows_visiting(grid: Grid, j: int, causal: bool) -> int:
    """R_j: query rows (a suffix) whose tiles visit key tile j."""
    if not causal:
        return grid.n_q
    c0, _ = grid.cols(j)
    first_tile = min(max(_ceil_div(c0 + 1 - grid.delta, grid.block_q) - 1, 0), grid.t_r - 1)
    return grid.n_q - first_tile * grid.block_q


def _check_sizes(n_q, n_k, d, block_q, block_k, causal, batch, heads, heads_kv, skip):
    """Validated (grid, d, batch, heads, heads_kv, causal); causal is False when skip=False (every tile visited)."""
    grid = Grid(n_q, n_k, block_q, block_k)
    d = shapes.check_block("d", d)
    batch = shapes.check_block("batch", batch)
    heads = shapes.check_block("heads", heads)
    heads_kv = heads if heads_kv is None else shapes.check_block("heads_kv", heads_kv)
    if heads % heads_kv:
        raise ValueError(f"heads_kv ({heads_kv}) must divide heads ({heads})")
    return grid, d, batch, heads, heads_kv, shapes.check_causal(causal) and skip


def traffic(order: str, n_q: int, n_k: int, d: int, block_q: int, block_k: int, causal: bool,
            batch: int = 1, heads: int = 1, heads_kv: int | None = None, skip: bool = True) -> Ledger:
    """Elements read and written per tensor by one call, summed over batch and query heads.

    `heads_kv` only has to divide `heads`: each query head streams its own K/V head, so GQA does not
    change the counts. skip=False gives the traffic of a schedule that computes SKIP tiles too.
    """
    check_order(order)
    grid, d, batch, heads, heads_kv, causal = _check_sizes(n_q, n_k, d, block_q, block_k, causal, batch, heads,
                                                           heads_kv, skip)
    ledger = Ledger()
    if order == "v2":
        for i in range(grid.t_r):
            r0, r1 = grid.rows(i)
            keys = _keys_seen(grid, i, causal)
            if keys:
                ledger.read("Q", (r1 - r0) * d)
            ledger.read("K", keys * d)
            ledger.read("V", keys * d)
        ledger.write("O", n_q * d)
        ledger.write("LSE", n_q)
    else:
        row_visits = sum(_rows_visiting(grid, j, causal) for j in range(grid.t_c))
        ledger.read("K", n_k * d)
        ledger.read("V", n_k * d)
        ledger.read("Q", row_visits * d)
        ledger.read("O", row_visits * d)
        ledger.write("O", (n_q + row_visits) * d)
        for stat in ("l", "m"):
            ledger.read(stat, row_visits + n_q)
            ledger.write(stat, n_q + row_visits)
        ledger.write("LSE", n_q)
    return ledger.scaled(batch * heads)


def traffic_backward(order: str, n_q: int, n_k: int, d: int, block_q: int, block_k: int, causal: bool,
                     batch: int = 1, heads: int = 1, heads_kv: int | None = None, deterministic: bool = False,
                     skip: bool = True) -> Ledger:
    """Elements read and written per tensor (BACKWARD_TENSORS) by one backward call of `tiled.attention_backward`.

    order "kv" (K/V outer, dQ by atomic adds, or with deterministic=True by a separate Q-outer pass) or
    "q" (Q outer, dK and dV by atomic adds); formulas in the module docstring and proofs/L7. Unlike the
    forward, GQA changes the counts: "kv" reads K_j, V_j and writes dK_j, dV_j once per K/V head for
    all the query heads of its group (B H_kv heads), everything else is per query head (B H heads).
    skip=False gives the traffic of schedules that visit SKIP tiles too.
    """
    order, deterministic = check_backward_order(order, deterministic)
    grid, d, batch, heads, heads_kv, causal = _check_sizes(n_q, n_k, d, block_q, block_k, causal, batch, heads,
                                                           heads_kv, skip)
    q_heads, kv_heads = batch * heads, batch * heads_kv
    row_visits = sum(_rows_visiting(grid, j, causal) for j in range(grid.t_c))  # R
    keys = [_keys_seen(grid, i, causal) for i in range(grid.t_r)]  # K_i
    live_rows = sum(grid.rows(i)[1] - grid.rows(i)[0] for i in range(grid.t_r) if keys[i])  # Q_vis
    ledger = Ledger.empty(BACKWARD_TENSORS)
    ledger.read("O", q_heads * n_q * d)  # preprocess: D = rowsum(dO o O)
    ledger.read("dO", q_heads * n_q * d)
    ledger.write("D", q_heads * n_q)

    def q_outer(kv_grads: bool) -> None:  # per query head: each query tile that sees a key, once
        for name, count in (("Q", live_rows * d), ("dO", live_rows * d), ("LSE", live_rows), ("D", live_rows),
                            ("K", sum(keys) * d), ("V", sum(keys) * d)):
            ledger.read(name, q_heads * count)
        ledger.write("dQ", q_heads * n_q * d)
        if kv_grads:  # dK_j, dV_j += ... for every visit: atomic read-modify-writes
            for name in ("dK", "dV"):
                ledger.read(name, q_heads * sum(keys) * d)
                ledger.write(name, q_heads * sum(keys) * d)

    if order == "q":
        ledger.write("dK", kv_heads * n_k * d)  # dK = dV = 0
        ledger.write("dV", kv_heads * n_k * d)
        q_outer(kv_grads=True)
        return ledger
    for name in ("K", "V"):  # per K/V head: K_j, V_j read once, dK_j, dV_j written once
        ledger.read(name, kv_heads * n_k * d)
        ledger.write("d" + name, kv_heads * n_k * d)
    for name, count in (("Q", row_visits * d), ("dO", row_visits * d), ("LSE", row_visits), ("D", row_visits)):
        ledger.read(name, q_heads * count)
    if deterministic:
        q_outer(kv_grads=False)
    else:
        ledger.write("dQ", q_heads * n_q * d)  # dQ = 0, then one read-modify-write per visit
        ledger.read("dQ", q_heads * row_visits * d)
        ledger.write("dQ", q_heads * row_visits * d)
    return ledger


def to_bytes(ledger: Ledger, in_itemsize: int, out_itemsize: int = 4, stat_itemsize: int = 4) -> dict[str, dict[str, int]]:
    """Bytes per tensor of a forward or backward ledger: Q, K, V (and dO) at the input itemsize, O (and
    dQ, dK, dV) at the output itemsize, l, m, LSE (and D) as statistics."""
    size = {"Q": in_itemsize, "K": in_itemsize, "V": in_itemsize, "dO": in_itemsize, "O": out_itemsize,
            "dQ": out_itemsize, "dK": out_itemsize, "dV": out_itemsize,
            "l": stat_itemsize, "m": stat_itemsize, "LSE": stat_itemsize, "D": stat_itemsize}
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
