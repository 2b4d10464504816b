"""HBM traffic: the spec's ledger equals the closed form (proofs/L5_hbm_traffic.md)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fa_numba import iomodel, tiled
from strategies import Case, cases, with_hard_cases


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
