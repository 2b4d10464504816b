"""Contracts of the closed-form IO model (fa_numba.iomodel) that no other test states: the dense algorithm
it is compared against, and how the storage counts scale with batch and heads."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fa_numba import iomodel, tiled


def _dense_ledger(n_q, n_k, d):
    """Unfused dense attention of one head, step by step: S = Q K^T; P = softmax(S); O = P V."""
    ledger = tiled.Ledger.empty(("Q", "K", "V", "S", "P", "O"))
    ledger.read("Q", n_q * d)
    ledger.read("K", n_k * d)
    ledger.write("S", n_q * n_k)
    ledger.read("S", n_q * n_k)  # softmax reads S and writes P
    ledger.write("P", n_q * n_k)
    ledger.read("P", n_q * n_k)
    ledger.read("V", n_k * d)
    ledger.write("O", n_q * d)
    return ledger


@given(n_q=st.integers(1, 300), n_k=st.integers(1, 300), d=st.integers(1, 128), batch=st.integers(1, 4),
       heads=st.integers(1, 5))
def test_dense_traffic_counts_every_step_of_unfused_attention(n_q, n_k, d, batch, heads):
    ledger = _dense_ledger(n_q, n_k, d)
    per_head = sum(ledger.reads.values()) + sum(ledger.writes.values())
    assert iomodel.dense_traffic_elements(n_q, n_k, d, batch, heads) == batch * heads * per_head
    assert iomodel.dense_traffic_elements(n_q, n_k, d) == per_head  # one batch, one head by default
    assert iomodel.materialized_scores_elements(n_q, n_k, batch, heads) == batch * heads * n_q * n_k
    assert iomodel.materialized_scores_elements(n_q, n_k) == n_q * n_k


def _elements(ledger):
    return sum(ledger.reads.values()) + sum(ledger.writes.values())


@pytest.mark.parametrize("order", ["v1", "v2"])
def test_both_orders_move_fewer_elements_than_dense_attention(order):
    """At N = 4096, d = 64 with 64 x 64 tiles, dense attention moves 4 N^2 + 4 N d elements per head (S and P
    written and read once each); v2 moves K and V once per query tile, 2 N^2 d / B_r (half of dense), v1
    moves Q, O in and O out once per key tile, 3 N^2 d / B_c (three quarters). Causal masking moves less."""
    n, d, block = 4096, 64, 64
    dense = iomodel.dense_traffic_elements(n, n, d, batch=2, heads=3)
    full = _elements(iomodel.traffic(order, n, n, d, block, block, causal=False, batch=2, heads=3))
    causal = _elements(iomodel.traffic(order, n, n, d, block, block, causal=True, batch=2, heads=3))
    assert causal < full < {"v1": 0.8, "v2": 0.55}[order] * dense


@given(n_q=st.integers(1, 500), batch=st.integers(1, 4), heads=st.integers(1, 5))
def test_extra_memory_scales_with_every_head_of_every_batch(n_q, batch, heads):
    """v1 keeps l, m and LSE per query row of every (batch, head); v2 only LSE."""
    assert iomodel.extra_memory_elements("v1", n_q, batch, heads) == 3 * batch * heads * n_q
    assert iomodel.extra_memory_elements("v2", n_q, batch, heads) == batch * heads * n_q


def test_visits_are_an_immutable_value():
    """The four sums are a value: equal for equal schedules, hashable (a cache key), and not changeable by a
    caller that holds one (the traffic of every order is built from the same object)."""
    import dataclasses

    a = iomodel.visits(9, 7, 2, 3, causal=True)
    assert a == iomodel.visits(9, 7, 2, 3, causal=True) and hash(a) == hash(iomodel.visits(9, 7, 2, 3, causal=True))
    assert a != iomodel.visits(9, 7, 2, 3, causal=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.rows = 0
