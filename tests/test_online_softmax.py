"""The online-softmax state (m, l, acc): monoid laws, order independence, numerical safety.

Every float64 comparison uses a bound derived in tests/bounds.py from the operations each side performs,
relative to the condition of the sums (sum of |terms|), never a relative tolerance on a value that can cancel.
"""

import functools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bounds import assert_within, dense_counts, online_counts, softmax_bound, weighted_sum_bound
from fa_numba import online_softmax as osm

ROWS, D = 3, 2


def _row_problem(seed: int, n: int, logit: float, masked: float):
    """Scores (ROWS, n) with a fraction `masked` set to -inf (whole rows may be empty), values (n, D)."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((ROWS, n)) * logit
    scores[rng.random((ROWS, n)) < masked] = -np.inf
    values = rng.standard_normal((n, D))
    return scores, values


def _expected(scores, values):
    """Dense float64 softmax(scores) @ values and log-sum-exp per row: e = exp(s - max), e / sum(e) @ values and
    max + log(sum(e)); an empty row gives 0 and -inf."""
    visible = np.isfinite(scores)
    top = np.where(visible.any(axis=1), np.where(visible, scores, -np.inf).max(axis=1), 0.0)
    e = np.where(visible, np.exp(scores - top[:, None]), 0.0)
    total = e.sum(axis=1)
    nonempty = total > 0
    out = np.divide(e, total[:, None], where=nonempty[:, None], out=np.zeros_like(e)) @ values
    lse = np.where(nonempty, top + np.log(np.where(nonempty, total, 1.0)), -np.inf)
    return out, lse


def _assert_merges_agree(x: osm.State, y: osm.State, states, counts_x, counts_y):
    """x and y merge the same states (m_g, l_g, acc_g) by two trees where state g passes through counts_x[g] and
    counts_y[g] = (exps, other roundings): m exactly, l and acc within the sum of both trees' bounds, which are
    relative to sum_g e^{m_g - m} |acc_g| (the condition of the sum), not to the sum itself."""
    np.testing.assert_array_equal(x.m, y.m)  # max is exact in any order
    logw = np.stack([s.m for s in states])
    (ex, ox), (ey, oy) = zip(*counts_x), zip(*counts_y)
    for name, parts in (("l", [s.l for s in states]), ("acc", [s.acc for s in states])):
        parts = np.stack(parts)
        bound = weighted_sum_bound(logw, parts, ex, ox) + weighted_sum_bound(logw, parts, ey, oy)
        assert_within(getattr(x, name), getattr(y, name), bound, name=name)


def _assert_final(state: osm.State, scores, values):
    """finalize(state) is softmax(scores) @ values and the LSE: both it (any fold or merge tree over the n keys)
    and the dense evaluation are within their derived bounds of the exact values, so of each other."""
    out, lse = osm.finalize(state)
    exp_out, exp_lse = _expected(scores, values)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    n = scores.shape[1]
    ours = softmax_bound(scores, values, *online_counts(n))
    dense = softmax_bound(scores, values, *dense_counts(n))
    assert_within(out, exp_out, ours[0] + dense[0], name="out")
    assert_within(lse, exp_lse, ours[1] + dense[1], name="lse")


@st.composite
def partitioned_rows(draw):
    """A row problem and a random partition of its columns into contiguous blocks."""
    n = draw(st.integers(1, 16))
    cuts = sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    blocks = [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]
    scores, values = _row_problem(draw(st.integers(0, 2**32 - 1)), n,
                                  draw(st.sampled_from([1.0, 50.0, 1e4])), draw(st.sampled_from([0.0, 0.3, 0.9])))
    return scores, values, blocks


def _block_states(scores, values, blocks):
    return [osm.from_block(scores[:, a:b], values[a:b]) for a, b in blocks]


@pytest.mark.lemma("L2")
@given(problem=partitioned_rows(), order_seed=st.integers(0, 2**32 - 1))
def test_folding_blocks_in_any_order_gives_the_softmax(problem, order_seed):
    scores, values, blocks = problem
    perm = np.random.default_rng(order_seed).permutation(len(blocks))
    state = osm.identity(ROWS, D)
    for idx in perm:  # update, block by block, in a random order
        a, b = blocks[idx]
        state = osm.update(state, scores[:, a:b], values[a:b])
    _assert_final(state, scores, values)


@pytest.mark.lemma("L2")
@given(problem=partitioned_rows(), data=st.data())
def test_merge_any_bracketing_gives_the_softmax(problem, data):
    scores, values, blocks = problem
    states = _block_states(scores, values, blocks)
    while len(states) > 1:  # merge two random neighbours-or-not until one is left: a random tree
        i, j = data.draw(st.lists(st.integers(0, len(states) - 1), min_size=2, max_size=2, unique=True))
        merged = osm.merge(states[i], states[j])
        states = [s for k, s in enumerate(states) if k not in (i, j)] + [merged]
    _assert_final(states[0], scores, values)


@pytest.mark.lemma("L2")
@given(problem=partitioned_rows())
# An accumulator entry that cancels to -2.6e-5 from terms of order 1: its bracketings differ by 1.4e-13 of its
# value here, so a relative tolerance fails it; the bound relative to the condition holds.
@example(problem=(*_row_problem(1040, 4, 1.0, 0.0), [(0, 1), (1, 2), (2, 4)]))
def test_merge_is_associative_commutative_with_identity(problem):
    scores, values, blocks = problem
    states = _block_states(scores, values, blocks)
    a = states[0]
    b = states[1] if len(states) > 1 else osm.identity(ROWS, D)
    c = states[2] if len(states) > 2 else osm.identity(ROWS, D)
    e = osm.identity(ROWS, D)
    # Identity is exact: exp(0) = 1 scales a, exp(-inf) = 0 kills e.
    for x in (osm.merge(e, a), osm.merge(a, e)):
        np.testing.assert_array_equal(x.m, a.m)
        np.testing.assert_array_equal(x.l, a.l)
        np.testing.assert_array_equal(x.acc, a.acc)
    # Commutativity is exact too (IEEE addition and multiplication commute).
    ab, ba = osm.merge(a, b), osm.merge(b, a)
    for x, y in zip(ab, ba):
        np.testing.assert_array_equal(x, y)
    # Associativity holds up to rounding: per merge a state's terms pass through one exp, one multiplication
    # and one addition, so with depths (2, 2, 1) on the left and (1, 2, 2) on the right:
    left, right = [(2, 4), (2, 4), (1, 2)], [(1, 2), (2, 4), (2, 4)]
    _assert_merges_agree(osm.merge(osm.merge(a, b), c), osm.merge(a, osm.merge(b, c)), [a, b, c], left, right)


@pytest.mark.lemma("L2")
def test_identity_merged_with_identity_stays_identity():
    e = osm.merge(osm.identity(2, 3), osm.identity(2, 3))
    assert np.isneginf(e.m).all() and (e.l == 0).all() and (e.acc == 0).all()
    out, lse = osm.finalize(e)
    assert (out == 0).all() and np.isneginf(lse).all()


@pytest.mark.lemma("L2")
@given(problem=partitioned_rows())
def test_every_exponent_argument_is_nonpositive(problem):
    scores, values, blocks = problem
    seen = []

    def checked_exp(x):
        x = np.asarray(x)
        assert not np.isnan(x).any(), "NaN exponent argument"
        assert (x <= 0).all(), f"positive exponent argument {x.max()}"
        seen.append(x.size)
        return np.exp(x)

    original = osm._exp_nonpositive
    osm._exp_nonpositive = checked_exp
    try:
        states = _block_states(scores, values, blocks)
        functools.reduce(osm.merge, states, osm.identity(ROWS, D))
        state = osm.identity(ROWS, D)
        for a, b in blocks:
            state = osm.update(state, scores[:, a:b], values[a:b])
    finally:
        osm._exp_nonpositive = original
    assert seen  # the hook was exercised


@pytest.mark.lemma("L2")
def test_update_equals_merge_with_block_state():
    scores, values = _row_problem(7, 8, 3.0, 0.2)
    prefix = osm.from_block(scores[:, :3], values[:3])
    via_update = osm.update(prefix, scores[:, 3:], values[3:])
    via_merge = osm.merge(prefix, osm.from_block(scores[:, 3:], values[3:]))
    # Terms: the prefix state (rescaled once either way: exp, multiplication, addition), then each new key:
    # update takes exp(s_j - m), the dot product (b roundings) and one addition; the merge takes exp(s_j - m_Y),
    # the dot product, the addition to the identity's 0, then exp(m_Y - m), a multiplication and an addition.
    b = scores.shape[1] - 3
    keys = [osm.State(scores[:, j], np.ones(ROWS), np.broadcast_to(values[j], (ROWS, D))) for j in range(3, 3 + b)]
    _assert_merges_agree(via_update, via_merge, [prefix, *keys], [(1, 2)] + [(1, b + 1)] * b, [(1, 2)] + [(2, b + 3)] * b)


def test_float32_state_keeps_float32():
    scores, values = _row_problem(1, 5, 1.0, 0.0)
    state = osm.update(osm.identity(ROWS, D, np.float32), scores.astype(np.float32), values.astype(np.float32))
    assert state.m.dtype == state.l.dtype == state.acc.dtype == np.float32
    out, lse = osm.finalize(state)
    assert out.dtype == lse.dtype == np.float32


class OnlineSoftmaxMachine(RuleBasedStateMachine):
    """Split raw key blocks, turn them into states, fold and merge them in random order; every live
    state always finalises to the softmax over exactly the keys it has absorbed."""

    def __init__(self):
        super().__init__()
        self.scores, self.values = _row_problem(11, 12, 20.0, 0.25)
        self.raw = [np.arange(12)]  # key index sets not yet absorbed
        self.states = []  # (indices, State)

    @precondition(lambda self: any(len(r) > 1 for r in self.raw))
    @rule(data=st.data())
    def split(self, data):
        big = [r for r in self.raw if len(r) > 1]
        block = data.draw(st.sampled_from(big))
        cut = data.draw(st.integers(1, len(block) - 1))
        self.raw = [r for r in self.raw if r is not block] + [block[:cut], block[cut:]]

    @precondition(lambda self: self.raw)
    @rule(data=st.data())
    def start(self, data):
        block = self.raw.pop(data.draw(st.integers(0, len(self.raw) - 1)))
        self.states.append((block, osm.from_block(self.scores[:, block], self.values[block])))

    @precondition(lambda self: self.raw and self.states)
    @rule(data=st.data())
    def fold(self, data):
        block = self.raw.pop(data.draw(st.integers(0, len(self.raw) - 1)))
        k = data.draw(st.integers(0, len(self.states) - 1))
        idx, state = self.states[k]
        self.states[k] = (np.concatenate([idx, block]), osm.update(state, self.scores[:, block], self.values[block]))

    @precondition(lambda self: len(self.states) > 1)
    @rule(data=st.data())
    def merge(self, data):
        i, j = data.draw(st.lists(st.integers(0, len(self.states) - 1), min_size=2, max_size=2, unique=True))
        (ia, a), (ib, b) = self.states[i], self.states[j]
        self.states = [s for k, s in enumerate(self.states) if k not in (i, j)]
        self.states.append((np.concatenate([ia, ib]), osm.merge(a, b)))

    @precondition(lambda self: self.states)
    @rule(data=st.data())
    def finalize(self, data):
        idx, state = data.draw(st.sampled_from(self.states))
        _assert_final(state, self.scores[:, idx], self.values[idx])

    @invariant()
    def every_state_finalises_to_its_softmax(self):
        for idx, state in self.states:
            _assert_final(state, self.scores[:, idx], self.values[idx])

    def teardown(self):
        state = functools.reduce(osm.merge, [s for _, s in self.states], osm.identity(ROWS, D))
        for block in self.raw:
            state = osm.update(state, self.scores[:, block], self.values[block])
        _assert_final(state, self.scores, self.values)


TestOnlineSoftmaxMachine = pytest.mark.lemma("L2")(OnlineSoftmaxMachine.TestCase)
TestOnlineSoftmaxMachine.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)
