"""HBM traffic: the spec's ledger equals the closed form (proofs/L5_hbm_traffic.md)."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fa_numba import iomodel, masks, reference, tiled
from strategies import Case, MaskCase, cases, mask_cases, with_hard_cases, with_hard_mask_cases


@pytest.mark.lemma("L5")
@given(case=cases(max_n=24), skip=st.booleans())
@with_hard_cases(skip=True)
def test_ledger_equals_closed_form(case: Case, skip: bool):
    q, k, v = case.inputs()
    for order in ("v1", "v2"):
        _, _, ledger = tiled.attention(q, k, v, order=order, block_q=case.block_q, block_k=case.block_k,
                                       causal=case.causal, skip=skip)
        model = iomodel.traffic(order, case.n_q, case.n_k, case.d, case.block_q, case.block_k, case.causal,
                                batch=case.batch, heads=case.heads, heads_kv=case.heads_kv, skip=skip)
        assert ledger.reads == model.reads, order
        assert ledger.writes == model.writes, order


@pytest.mark.lemma("L5")
@given(n_q=st.integers(1, 300), n_k=st.integers(1, 300), d=st.integers(1, 128),
       block_q=st.integers(1, 64), block_k=st.integers(1, 64))
def test_non_causal_traffic_matches_the_textbook_formulas(n_q, n_k, d, block_q, block_k):
    t_r, t_c = -(-n_q // block_q), -(-n_k // block_k)
    v1 = iomodel.traffic("v1", n_q, n_k, d, block_q, block_k, causal=False)
    v2 = iomodel.traffic("v2", n_q, n_k, d, block_q, block_k, causal=False)
    # v1: K, V once; Q read and O read/written once per key tile (plus O's initial write).
    assert (v1.reads["K"], v1.reads["V"]) == (n_k * d, n_k * d)
    assert v1.reads["Q"] == v1.reads["O"] == t_c * n_q * d
    assert v1.writes["O"] == (t_c + 1) * n_q * d
    # v2: Q read and O written once; K, V once per query tile.
    assert (v2.reads["Q"], v2.writes["O"], v2.reads["O"]) == (n_q * d, n_q * d, 0)
    assert v2.reads["K"] == v2.reads["V"] == t_r * n_k * d
    qo = lambda t: t.reads["Q"] + t.reads["O"] + t.writes["O"]  # noqa: E731
    kv = lambda t: t.reads["K"] + t.reads["V"]  # noqa: E731
    assert qo(v1) - qo(v2) == (3 * t_c - 1) * n_q * d
    assert kv(v2) - kv(v1) == 2 * (t_r - 1) * n_k * d


@pytest.mark.lemma("L5")
@given(n=st.integers(1, 200), block=st.integers(1, 32), d=st.integers(1, 64))
def test_causal_square_traffic_matches_the_triangle(n, block, d):
    """N_q = N_k = n, B_r = B_c = b, n = T b: query tile i sees key tiles 0..i."""
    t = -(-n // block)
    n = t * block  # a whole number of tiles keeps the sum a plain triangle
    v2 = iomodel.traffic("v2", n, n, d, block, block, causal=True)
    v1 = iomodel.traffic("v1", n, n, d, block, block, causal=True)
    triangle = t * (t + 1) // 2  # visited tiles
    assert v2.reads["K"] == triangle * block * d
    assert v1.reads["Q"] == triangle * block * d
    assert v1.reads["K"] == n * d and v2.reads["Q"] == n * d


def test_more_queries_than_keys_does_not_load_empty_query_tiles():
    # delta = -8: query tiles 0 and 1 see nothing; v2 reads only Q rows 8..11.
    v2 = iomodel.traffic("v2", 12, 4, 2, 4, 4, causal=True)
    assert v2.reads["Q"] == 4 * 2 and v2.writes["O"] == 12 * 2 and v2.writes["LSE"] == 12


def test_gqa_does_not_change_per_head_traffic():
    a = iomodel.traffic("v2", 33, 47, 8, 16, 16, True, batch=2, heads=4)
    b = iomodel.traffic("v2", 33, 47, 8, 16, 16, True, batch=2, heads=4, heads_kv=1)
    assert a == b


def test_bytes_summary():
    t = iomodel.traffic("v2", 64, 64, 16, 16, 16, causal=False)
    b = iomodel.to_bytes(t, in_itemsize=2)
    assert b["read"]["Q"] == 64 * 16 * 2 and b["write"]["O"] == 64 * 16 * 4 and b["write"]["LSE"] == 64 * 4
    assert iomodel.total_bytes(t, 2) == sum(b["read"].values()) + sum(b["write"].values())


@pytest.mark.lemma("L5")
def test_extra_memory_is_linear_while_scores_are_quadratic():
    """Beyond Q, K, V, O the orders store l, m, LSE (v1) or LSE (v2): O(N). A materialised S is N^2."""
    for n in (256, 512, 1024):
        assert iomodel.extra_memory_elements("v1", n) == 3 * n
        assert iomodel.extra_memory_elements("v2", n) == n
        assert iomodel.materialized_scores_elements(n, n) == n * n
    # Doubling N doubles the extra state and quadruples S.
    assert iomodel.extra_memory_elements("v2", 2048) == 2 * iomodel.extra_memory_elements("v2", 1024)
    assert iomodel.materialized_scores_elements(2048, 2048) == 4 * iomodel.materialized_scores_elements(1024, 1024)
    # The spec really stores only that: its l, m writes in v1 touch N_q elements per visit, never N_q N_k.
    t = iomodel.traffic("v1", 64, 64, 8, 16, 16, causal=False)
    assert t.writes["l"] == 64 * (1 + 4)


# --- block masks (proofs/L8) ------------------------------------------------------------------------

BACKWARD_VARIANTS = (("kv", False), ("kv", True), ("q", False))


@pytest.mark.lemma("L8")
@given(mc=mask_cases(max_n=24), skip=st.booleans())
@with_hard_mask_cases(skip=True)
def test_ledger_with_a_mask_equals_the_model(mc: MaskCase, skip: bool):
    """The spec's counted ledger, forward and backward, equals the model's sum over the block-mask lists."""
    case = mc.case
    q, k, v = case.inputs()
    dout = case.grad_output()
    sizes = dict(batch=case.batch, heads=case.heads, heads_kv=case.heads_kv, skip=skip, mask=mc.mask)
    for order in ("v1", "v2"):
        out, lse, ledger = tiled.attention(q, k, v, order=order, block_q=case.block_q, block_k=case.block_k,
                                           mask=mc.mask, skip=skip)
        assert ledger == iomodel.traffic(order, case.n_q, case.n_k, case.d, case.block_q, case.block_k, **sizes), order
    for order, deterministic in BACKWARD_VARIANTS:
        *_, ledger = tiled.attention_backward(q, k, v, out, lse, dout, order=order, block_q=case.block_q,
                                              block_k=case.block_k, mask=mc.mask, deterministic=deterministic,
                                              skip=skip)
        model = iomodel.traffic_backward(order, case.n_q, case.n_k, case.d, case.block_q, case.block_k,
                                         deterministic=deterministic, **sizes)
        assert ledger == model, (order, deterministic)


@pytest.mark.lemma("L8")
@given(n_q=st.integers(1, 80), n_k=st.integers(1, 80), block_q=st.integers(1, 16), block_k=st.integers(1, 16),
       d=st.integers(1, 64))
@example(n_q=12, n_k=5, block_q=4, block_k=2, d=3)  # dead query tiles
@example(n_q=1, n_k=1, block_q=1, block_k=1, d=1)
def test_list_sums_of_causal_and_of_no_mask_equal_the_closed_forms(n_q, n_k, block_q, block_k, d):
    """The causal predicate built without its kernel form (SlidingWindow(None, 0), PrefixLM(0): "intervals", so
    summed over the lists) gives the closed form of causal=True (L5), and an all-visible window that of no mask."""
    tiles = (n_q, n_k, block_q, block_k)
    closed = iomodel.visits(*tiles, causal=True)
    assert iomodel.visits(*tiles, mask=masks.causal()) == closed  # kernel form "causal": the closed form
    for same in (masks.SlidingWindow(None, 0), masks.PrefixLM(0)):
        assert same.kernel_form() == "intervals"
        assert iomodel.visits(*tiles, mask=same) == closed
        for order in ("v1", "v2"):
            assert iomodel.traffic(order, n_q, n_k, d, block_q, block_k, mask=same) == \
                iomodel.traffic(order, n_q, n_k, d, block_q, block_k, True)
        for order, deterministic in BACKWARD_VARIANTS:
            assert iomodel.traffic_backward(order, n_q, n_k, d, block_q, block_k, mask=same, heads=2, heads_kv=1,
                                            deterministic=deterministic) == \
                iomodel.traffic_backward(order, n_q, n_k, d, block_q, block_k, True, heads=2, heads_kv=1,
                                         deterministic=deterministic)
    t_r, t_c = -(-n_q // block_q), -(-n_k // block_k)
    everything = iomodel.Visits(t_c * n_q, t_r * n_k, n_q, n_k)
    assert iomodel.visits(*tiles, mask=masks.sliding_window(None, None)) == everything == iomodel.visits(*tiles)
    assert iomodel.visits(*tiles, mask=masks.sliding_window(0, 0), skip=False) == everything


@pytest.mark.lemma("L8")
def test_a_window_by_hand():
    """window(2, 0), N = 8, 2 x 2 tiles: the block mask [[P . . .], [P P . .], [. P P .], [. . P P]]
    (tests/test_masks.py): 7 visits of 2 rows and 2 keys, every tile list non-empty."""
    window, d = masks.sliding_window(2, 0), 3
    assert iomodel.visits(8, 8, 2, 2, mask=window) == iomodel.Visits(rows=14, keys=14, live_rows=8, live_keys=8)
    v2 = iomodel.traffic("v2", 8, 8, d, 2, 2, mask=window)
    assert (v2.reads["Q"], v2.reads["K"], v2.reads["V"], v2.writes["O"], v2.writes["LSE"]) == (8 * d, 14 * d, 14 * d,
                                                                                              8 * d, 8)
    v1 = iomodel.traffic("v1", 8, 8, d, 2, 2, mask=window)
    assert (v1.reads["K"], v1.reads["Q"], v1.reads["O"], v1.writes["O"]) == (8 * d, 14 * d, 14 * d, (8 + 14) * d)
    assert (v1.reads["l"], v1.writes["m"], v1.writes["LSE"]) == (14 + 8, 8 + 14, 8)
    kv = iomodel.traffic_backward("kv", 8, 8, d, 2, 2, mask=window)
    assert (kv.reads["K"], kv.writes["dK"], kv.reads["Q"], kv.reads["dQ"], kv.writes["dQ"]) == (
        8 * d, 8 * d, 14 * d, 14 * d, (8 + 14) * d)
    q_order = iomodel.traffic_backward("q", 8, 8, d, 2, 2, mask=window)
    assert (q_order.reads["Q"], q_order.reads["K"], q_order.reads["dK"], q_order.writes["dK"]) == (
        8 * d, 14 * d, 14 * d, (8 + 14) * d)


@pytest.mark.lemma("L8")
def test_key_tiles_no_query_sees_are_never_read():
    """window(0, 0) with N_q = 3 < N_k = 5 (delta = 2): query i sees key i + 2 only, so key tile 0 (keys 0, 1)
    has an empty list. v1 and "kv" never read it; "kv" still writes its dK, dV (zeros); v2 never reads it.
    Visits (0, 1), (1, 1), (2, 2): 3 rows, 2 + 2 + 1 keys, live key tiles 1 and 2 (3 keys)."""
    window, d = masks.sliding_window(0, 0), 2
    assert iomodel.visits(3, 5, 1, 2, mask=window) == iomodel.Visits(rows=3, keys=5, live_rows=3, live_keys=3)
    assert iomodel.traffic("v2", 3, 5, d, 1, 2, mask=window).reads["K"] == 5 * d
    assert iomodel.traffic("v1", 3, 5, d, 1, 2, mask=window).reads["K"] == 3 * d
    kv = iomodel.traffic_backward("kv", 3, 5, d, 1, 2, mask=window)
    assert kv.reads["K"] == kv.reads["V"] == 3 * d and kv.writes["dK"] == kv.writes["dV"] == 5 * d
    q, k, v = Case(n_q=3, n_k=5, d=d, block_q=1, block_k=2, causal=False, seed=3).inputs()
    dout = Case(n_q=3, n_k=5, d=d, block_q=1, block_k=2, causal=False, seed=3).grad_output()
    out, lse = reference.attention(q, k, v, mask=window)
    dq, dk, dv, ledger = tiled.attention_backward(q, k, v, out, lse, dout, order="kv", block_q=1, block_k=2,
                                                  mask=window)
    assert ledger == kv and (dk[..., :2, :] == 0).all() and (dv[..., :2, :] == 0).all()
    assert (dv[..., 2:, :] != 0).all()


@pytest.mark.lemma("L8")
def test_query_tiles_a_mask_leaves_empty_read_nothing():
    """A dense mask with query rows 0..3 empty, 2-row tiles: query tiles 0 and 1 have empty lists, so v2, "q"
    and the dQ pass never read their Q (and dO, LSE, D); dQ is still written for every row."""
    visible = np.ones((7, 5), dtype=bool)
    visible[:4] = False
    mask, d = masks.from_dense(visible), 3
    assert iomodel.visits(7, 5, 2, 2, mask=mask) == iomodel.Visits(rows=3 * 3, keys=2 * 5, live_rows=3, live_keys=5)
    v2 = iomodel.traffic("v2", 7, 5, d, 2, 2, mask=mask)
    assert v2.reads["Q"] == 3 * d and v2.writes["O"] == 7 * d
    q_order = iomodel.traffic_backward("q", 7, 5, d, 2, 2, mask=mask)
    reads = (q_order.reads["Q"], q_order.reads["dO"], q_order.reads["LSE"])
    assert reads == (3 * d, 7 * d + 3 * d, 3) and q_order.writes["dQ"] == 7 * d  # dO: the preprocess reads all 7 rows
