"""NaN in the backward's inputs reaches exactly the gradients that depend on it, by the mask (proofs/L7.8).

The rule, the forward's (L2.6, L3.5) carried to the gradients: masked pairs are never multiplied. Row i's
gradient dQ_i depends only on Q_i, dO_i and the keys and values row i sees (through O_i, LSE_i, D_i as well);
the gradients dK_j, dV_j of a key depend only on the rows that see key j. So a NaN in one entry of q, k, v
or dO touches a set of gradient rows that the mask alone predicts (`_touched`, never from the code under
test); every other gradient entry is bit for bit the one of the run without the NaN, and wherever the
float64 reference is NaN the kernel is NaN too. Every backward order, every mask kind.

Without a GPU these run in the CUDA simulator on small shapes (N <= 32, tiles 8 or 16, <= 16 blocks a launch).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numba import cuda

from fa_numba import backend, masks, reference, tiled, tolerance_backward
from fa_numba.kernels import VARIANTS, backward, poisoned_outputs
from fa_numba.kernels.block_lists import kernel_mask
from strategies import MASK_KINDS, SIM_MAX_BLOCKS, Case, GlobalAndLocal, MaskCase, mask_cases

SIMULATOR = backend.name() == "simulator"
ORDERS = (("kv", False), ("kv", True), ("q", False))
ORDER_IDS = ["kv", "kv-deterministic", "q"]
TENSORS = ("q", "k", "v", "dout")
KINDS = ("none", *MASK_KINDS)  # "none": the unmasked kernels (mask form "none"), not a mask object
BLOCKS = (8, 16)


# --- running the kernels --------------------------------------------------------------------------------


def _launch_args(mask, case: Case):
    """(causal, mask form, KernelMask or None) of a launch with square tiles B = case.block_q."""
    if mask is None:
        return False, "none", None
    mask = masks.fixed(mask, case.n_q, case.n_k)  # a from_function mask as the dense mask of its answers
    form = mask.kernel_form()
    if form == "causal":
        return True, "causal", None
    return False, form, kernel_mask(mask, case.n_q, case.n_k, case.block_q, case.block_q)


def _forward(mask, case: Case, q, k, v):
    """O and LSE from the v2 forward kernel with the same mask and tiles, as a training step hands them on
    (a NaN input gives the NaN O and LSE rows the forward's rule says: tests/test_nonfinite.py)."""
    causal, form, blocks = _launch_args(mask, case)
    kernel = VARIANTS["v2"].make(case.block_q, case.block_q, case.d, causal, form)
    out, lse, workspace = poisoned_outputs(q.shape)
    kernel(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, lse, 1 / np.sqrt(case.d), workspace,
           mask=blocks)
    return out.copy_to_host(), lse.copy_to_host()


def _backward(mask, case: Case, order: str, deterministic: bool, q, k, v, dout):
    """kernels.backward.run after the forward kernel, gradients and D poisoned with NaN beforehand (an
    element the kernels forget to write shows)."""
    causal, _, blocks = _launch_args(mask, case)
    out, lse = _forward(mask, case, q, k, v)
    dev = [cuda.to_device(np.ascontiguousarray(x)) for x in (q, k, v, out, lse, dout)]
    grads = [cuda.to_device(np.full(shape, np.nan, np.float32)) for shape in (q.shape, k.shape, k.shape, q.shape[:-1])]
    backward.run(*dev, *grads, 1 / np.sqrt(case.d), causal=causal, order=order, deterministic=deterministic,
                 block=case.block_q, mask=blocks)
    return tuple(g.copy_to_host() for g in grads[:3])


# --- the prediction, from the mask alone ------------------------------------------------------------------


def _touched(visible: np.ndarray, case: Case, tensor: str, index):
    """Which gradient rows may depend on the entry `index` of `tensor`, from the visible pairs alone:
    (rows (B, H, N_q) for dq, keys (B, H_kv, N_k) for dk and dv).

    Row (b, h, i) depends on Q_i, dO_i and the K, V rows it sees (its O_i, LSE_i, D_i included), and
    nothing at all when it sees no key; key (b, h_kv, j) depends on the rows of the group's heads that see
    key j, hence on everything those rows depend on."""
    b, h, n, _ = index
    alive = visible.any(axis=1)
    rows = np.zeros((case.batch, case.heads, case.n_q), dtype=bool)
    if tensor in ("q", "dout"):
        rows[b, h, n] = alive[n]
    else:  # K/V head h is read by the query heads h g .. (h + 1) g - 1
        rows[b, h * case.group:(h + 1) * case.group] = visible[:, n]
    keys = np.zeros((case.batch, case.heads_kv, case.n_k), dtype=bool)
    for h_kv in range(case.heads_kv):
        group_rows = rows[:, h_kv * case.group:(h_kv + 1) * case.group]  # (B, g, N_q)
        keys[:, h_kv] = (group_rows[..., None] & visible).any(axis=(1, 2))
    return rows, keys


# --- the cases --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Poison:
    """A problem (mc.mask None: no mask), one entry of q, k, v or dout, (b, h, n, x), and the value it gets
    (NaN; or an infinity, which makes NaN through 0 x inf and inf - inf, with the sign bit x86 gives them)."""

    mc: MaskCase
    tensor: str
    index: tuple
    value: float = np.nan

    def inputs(self, clean: bool = False):
        """(q, k, v, dout) float32, with `value` at the poisoned entry unless clean."""
        case = self.mc.case
        arrays = dict(zip(("q", "k", "v"), case.inputs(np.float32)), dout=case.grad_output(np.float32))
        if not clean:
            arrays[self.tensor][self.index] = self.value
        return arrays["q"], arrays["k"], arrays["v"], arrays["dout"]


def _fit(case: Case, block: int) -> Case:
    """The case with square tiles `block` and at most SIM_MAX_BLOCKS blocks in every launch (the forward and
    q launch T_r B H blocks, kv launches T_c B H_kv)."""
    tiles = -(-max(case.n_q, case.n_k) // block)
    case = dataclasses.replace(case, block_q=block, block_k=block)
    if tiles * case.batch * case.heads > SIM_MAX_BLOCKS:
        case = dataclasses.replace(case, batch=1, group=min(case.group, 2))
    return case


@st.composite
def poisons(draw) -> Poison:
    kind = draw(st.sampled_from(KINDS))
    mc = draw(mask_cases(max_n=32, max_d=4, kinds=("causal",) if kind == "none" else (kind,)))
    case = _fit(mc.case, draw(st.sampled_from(BLOCKS)))
    tensor = draw(st.sampled_from(TENSORS))
    heads, n = (case.heads_kv, case.n_k) if tensor in ("k", "v") else (case.heads, case.n_q)
    index = tuple(draw(st.integers(0, size - 1)) for size in (case.batch, heads, n, case.d))
    value = draw(st.sampled_from([np.nan, np.nan, np.inf, -np.inf]))
    return Poison(MaskCase(case, None if kind == "none" else mc.mask), tensor, index, value)


def _square(n: int, mask, block: int = 8, d: int = 4, seed: int = 0) -> MaskCase:
    return MaskCase(Case(n, n, d, block, block, False, seed=seed), mask)


# The reproductions of issue 20 (each leaked before the backward skipped masked pairs in PARTIAL tiles):
# causal, key 15 is seen by query 15 alone, and dQ += dS K_j in the diagonal tile gave rows 8..14 0 x NaN;
CAUSAL_KEY_15 = Poison(_square(16, masks.causal()), "k", (0, 0, 15, 1))
# a window of two keys to the left: key 0 is seen by queries 0..2, and rows 3..15 had dq[:, 0] NaN;
WINDOW_KEY_0 = Poison(_square(16, masks.sliding_window(2, 0)), "k", (0, 0, 0, 0))
# a NaN in row 0 of dO (row 0 sees key 0 alone) reached dV_1..7 through dV += P^T dO_i,
CAUSAL_DOUT_ROW_0 = Poison(_square(16, masks.causal()), "dout", (0, 0, 0, 2))
# and in row 0 of Q reached dK_1..7 through dK += dS^T Q_i.
CAUSAL_Q_ROW_0 = Poison(_square(16, masks.causal()), "q", (0, 0, 0, 3))
REPRODUCTIONS = {"causal-key-15": CAUSAL_KEY_15, "window-key-0": WINDOW_KEY_0, "causal-dout-row-0": CAUSAL_DOUT_ROW_0,
                 "causal-q-row-0": CAUSAL_Q_ROW_0}
# One pinned case per kind, each with the poison where a PARTIAL tile holds rows or keys that cannot see it:
# no mask with a ragged tail and GQA; causal with N_q > N_k, GQA and the NaN in a dead row's query; a window
# with N_q != N_k and +inf in dO; a prefix-LM with -inf in a key past the prefix; documents with a boundary
# inside a tile, with and without causal; a Longformer-like predicate; a random dense mask.
PINNED = {
    "none": Poison(MaskCase(Case(29, 29, 4, 16, 16, False, heads_kv=1, group=2, seed=8), None), "k", (0, 0, 28, 3)),
    "causal": Poison(MaskCase(Case(20, 12, 3, 8, 8, False, heads_kv=2, group=2, seed=5), masks.causal()), "q",
                     (0, 1, 3, 0)),
    "window": Poison(MaskCase(Case(18, 21, 3, 8, 8, False, seed=12), masks.sliding_window(1, 2)), "dout",
                     (0, 0, 9, 1), np.inf),
    "prefix": Poison(_square(20, masks.prefix_lm(5), d=2, seed=13), "k", (0, 0, 12, 1), -np.inf),
    "documents": Poison(_square(24, masks.documents([5, 11, 8]), seed=7), "dout", (0, 0, 6, 1)),
    "documents-causal": Poison(_square(16, masks.documents([3, 9, 4], causal=True), d=3, seed=14), "q", (0, 0, 4, 2)),
    "function": Poison(_square(16, masks.from_function(GlobalAndLocal(1, 2)), d=3, seed=15), "v", (0, 0, 9, 1)),
    "dense": Poison(MaskCase(Case(13, 17, 3, 8, 8, False, seed=6),
                             masks.from_dense(np.random.default_rng(6).random((13, 17)) < 0.4)), "v", (0, 0, 9, 2)),
}


def with_pinned(test):
    """One @example per PINNED case."""
    for poison in PINNED.values():
        test = example(poison=poison)(test)
    return test


# --- the checks -------------------------------------------------------------------------------------------


def _spec(mask, case: Case, order: str, deterministic: bool, q, k, v, dout):
    """tiled.attention_backward in float64 after tiled.attention (v2) on the same inputs and mask."""
    tiles = dict(block_q=case.block_q, block_k=case.block_q, mask=mask)
    with np.errstate(invalid="ignore", over="ignore"):
        out, lse, _ = tiled.attention(q, k, v, order="v2", **tiles)
        return tiled.attention_backward(q, k, v, out, lse, dout, order=order, deterministic=deterministic, **tiles)[:3]


def _assert_isolated(poison: Poison, grads, clean, name: str, atomic=frozenset()):
    """The rule on one run: untouched entries bit for bit the clean run's (`atomic`: gradients added by
    atomics, whose last bits a GPU does not fix, only free of NaN there), NaN wherever the float64 reference
    on the poisoned inputs is NaN; and the reference itself NaN only on touched entries, the rest its own
    clean values bit for bit."""
    case, mask = poison.mc.case, poison.mc.mask
    with np.errstate(invalid="ignore", over="ignore"):
        ref = reference.attention_backward(*poison.inputs(), mask=mask)  # float64 on the poisoned inputs
    clean_ref = reference.attention_backward(*poison.inputs(clean=True), mask=mask)
    visible = reference.visible_mask(case.n_q, case.n_k, mask=mask)
    rows, keys = _touched(visible, case, poison.tensor, poison.index)
    for label, g, c, r, cr, touched in zip(("dq", "dk", "dv"), grads, clean, ref, clean_ref, (rows, keys, keys)):
        touched = np.broadcast_to(touched[..., None], g.shape)
        assert not np.isnan(r[~touched]).any(), f"reference {label}: NaN outside the rows that see the poison"
        assert np.array_equal(r[~touched], cr[~touched]), f"reference {label}: untouched entries changed"
        if SIMULATOR or label not in atomic:
            assert np.array_equal(g[~touched], c[~touched]), \
                f"{name} {label}: entries that cannot depend on {poison.tensor}{poison.index} changed: " \
                f"{np.argwhere((g != c) & ~touched)[:5].tolist()}"
        else:
            assert not np.isnan(g[~touched]).any(), f"{name} {label}: NaN outside the rows that see the poison"
        missing = np.isnan(r) & ~np.isnan(g)
        assert not missing.any(), f"{name} {label}: finite where the reference is NaN: {np.argwhere(missing)[:5].tolist()}"


def _check_poison(poison: Poison, order: str, deterministic: bool):
    """The kernels of one order on the clean inputs (checked by the 3x rule) and the poisoned ones."""
    case, mask = poison.mc.case, poison.mc.mask
    name = f"{order}{' deterministic' if deterministic else ''} {mask!r}"
    clean_inputs = poison.inputs(clean=True)
    clean = _backward(mask, case, order, deterministic, *clean_inputs)
    tolerance_backward.check_attention_backward(*clean, *clean_inputs, mask=mask, name=f"{name} clean")
    grads = _backward(mask, case, order, deterministic, *poison.inputs())
    # dQ is added by atomics across key tiles in order "kv" (not deterministic), dK and dV across query tiles
    # and heads in order "q": on a GPU their order of addition, hence their last bits, varies between runs
    atomic = {"dq"} if order == "kv" and not deterministic else {"dk", "dv"} if order == "q" else set()
    _assert_isolated(poison, grads, clean, name, atomic)


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("poison", list(REPRODUCTIONS.values()), ids=list(REPRODUCTIONS))
@pytest.mark.parametrize("order, deterministic", ORDERS, ids=ORDER_IDS)
def test_the_reproductions_of_issue_20_are_isolated(order, deterministic, poison: Poison):
    """The three leaks of issue 20, stated on the entries they hit: (1) causal, NaN in key 15: dq rows
    8..14 stay clean; (2) window (2, 0), NaN in key 0: dq of rows 3..15 stays clean; (3) NaN in row 0 of
    dO or Q: dV, resp. dK of keys 1..15 stay clean. Then the whole rule (`_check_poison`)."""
    case, mask = poison.mc.case, poison.mc.mask
    dq, dk, dv = _backward(mask, case, order, deterministic, *poison.inputs())
    if poison is CAUSAL_KEY_15:
        assert np.isfinite(dq[0, 0, :15]).all() and np.isnan(dq[0, 0, 15]).all()
    elif poison is WINDOW_KEY_0:
        assert np.isfinite(dq[0, 0, 3:]).all() and np.isnan(dq[0, 0, :3]).all()
    else:
        leaked = dv if poison.tensor == "dout" else dk
        assert np.isfinite(leaked[0, 0, 1:]).all() and np.isnan(leaked[0, 0, 0]).any()
    _check_poison(poison, order, deterministic)


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("order, deterministic", [
    ("kv", False), pytest.param("kv", True, marks=pytest.mark.slow), pytest.param("q", False, marks=pytest.mark.slow)],
    ids=ORDER_IDS)  # kv-deterministic and q (~15 s each in the simulator): the slow tier
@settings(max_examples=3)  # + the 8 pinned examples, per order: the simulator's budget (~60 s for the file)
@given(poison=poisons())
@with_pinned
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf in the simulator's NumPy
def test_a_nan_reaches_only_the_gradients_that_depend_on_it(order, deterministic, poison: Poison):
    _check_poison(poison, order, deterministic)


@pytest.mark.lemma("L7")
@settings(max_examples=30)
@given(poison=poisons())
@example(poison=CAUSAL_KEY_15)
@example(poison=WINDOW_KEY_0)
@example(poison=CAUSAL_DOUT_ROW_0)
@example(poison=CAUSAL_Q_ROW_0)
@with_pinned
def test_a_nan_reaches_only_the_gradients_that_depend_on_it_in_the_spec(poison: Poison):
    """tiled.attention_backward (float64, every order) follows the same rule, bit for bit."""
    case, mask = poison.mc.case, poison.mc.mask
    for order, deterministic in ORDERS:
        clean = _spec(mask, case, order, deterministic, *poison.inputs(clean=True))
        grads = _spec(mask, case, order, deterministic, *poison.inputs())
        _assert_isolated(poison, grads, clean, f"spec {order}{' deterministic' if deterministic else ''} {mask!r}")


def test_the_pinned_cases_cover_every_kind_and_reach_a_partial_tile():
    """PINNED holds one case of each kind, each poison (but the dead row's) seen by some row and hidden from
    another row or key of a tile that also holds one that sees it (so a 0 x NaN in that tile would show)."""
    kinds = {None: "none", masks.Causal: "causal", masks.SlidingWindow: "window", masks.PrefixLM: "prefix",
             masks.FromFunction: "function", masks.FromDense: "dense"}
    assert set(PINNED) == set(KINDS)
    for kind, poison in PINNED.items():
        mask = poison.mc.mask
        got = kinds.get(type(mask)) if mask is not None else "none"
        if isinstance(mask, masks.Documents):
            got = "documents-causal" if mask.causal else "documents"
        assert got == kind, (kind, mask)
        case = poison.mc.case
        visible = reference.visible_mask(case.n_q, case.n_k, mask=mask)
        rows, keys = _touched(visible, case, poison.tensor, poison.index)
        if kind == "causal":  # the NaN sits in the query of a row that sees no key: it touches nothing
            assert not visible[poison.index[2]].any() and not rows.any() and not keys.any()
            continue
        assert rows.any() and keys.any(), kind
        if mask is not None:  # some tile holds a touched and an untouched row, or key, of the same head
            b, h = poison.index[:2]
            tile_rows = [rows[b, hq, r0:r0 + case.block_q] for hq in range(case.heads) for r0 in range(0, case.n_q, case.block_q)]
            tile_keys = [keys[b, hk, c0:c0 + case.block_q] for hk in range(case.heads_kv) for c0 in range(0, case.n_k, case.block_q)]
            assert any(t.any() and not t.all() for t in tile_rows + tile_keys), kind


def test_the_prediction_is_the_dependency_of_the_formulas():
    """_touched on a hand-worked case: causal 4 x 4, GQA group 2; a NaN in K/V key 2 touches rows 2, 3 of
    both query heads and the keys those rows see (0..3); a NaN in dO row 1 of head 1 touches that row alone
    and keys 0, 1; a dead row (N_q > N_k) touches nothing."""
    case = Case(4, 4, 2, 8, 8, True, heads_kv=1, group=2)
    visible = reference.causal_mask(4, 4)
    rows, keys = _touched(visible, case, "v", (0, 0, 2, 1))
    assert rows[0].tolist() == [[False, False, True, True]] * 2 and keys[0, 0].tolist() == [True] * 4
    rows, keys = _touched(visible, case, "dout", (0, 1, 1, 0))
    assert rows[0].tolist() == [[False] * 4, [False, True, False, False]]
    assert keys[0, 0].tolist() == [True, True, False, False]
    dead = Case(6, 3, 2, 8, 8, True)
    rows, keys = _touched(reference.causal_mask(6, 3), dead, "q", (0, 0, 1, 0))
    assert not rows.any() and not keys.any()


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("order, deterministic", ORDERS, ids=ORDER_IDS)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf in the simulator's NumPy
def test_padding_full_of_garbage_leaves_the_visible_part_finite_and_exact(order, deterministic):
    """A padded batch: 13 real tokens in 24 (causal among themselves), the padding rows see nothing and no
    row sees the padding keys; q, k, v and dO of the padding hold NaN, +inf and -inf. Every gradient is
    finite, the padding's are exactly zero, and all pass the rule; with documents, a document whose k, v and
    dO are NaN poisons its own gradients only."""
    n, real = 24, 13
    dense = np.zeros((n, n), dtype=bool)
    dense[:real, :real] = reference.causal_mask(real, real)
    mc = MaskCase(Case(n, n, 4, 8, 8, False, heads_kv=1, group=2, seed=9), masks.from_dense(dense))
    q, k, v, dout = Poison(mc, "q", (0, 0, 0, 0)).inputs(clean=True)
    garbage = np.array([np.nan, np.inf, -np.inf], np.float32)
    for x in (q, k, v, dout):
        x[:, :, real:] = garbage[np.arange(x[:, :, real:].size).reshape(x[:, :, real:].shape) % 3]
    dq, dk, dv = _backward(mc.mask, mc.case, order, deterministic, q, k, v, dout)
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:, :, real:] == 0).all() and (dk[:, :, real:] == 0).all() and (dv[:, :, real:] == 0).all()
    tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, mask=mc.mask, name=f"{order} padded")

    docs = MaskCase(Case(n, n, 4, 8, 8, False, seed=10), masks.documents([7, 9, 8]))
    q, k, v, dout = Poison(docs, "q", (0, 0, 0, 0)).inputs(clean=True)
    for x in (k, v, dout):
        x[:, :, 7:16] = np.nan  # the middle document
    dq, dk, dv = _backward(docs.mask, docs.case, order, deterministic, q, k, v, dout)
    outside = np.r_[0:7, 16:24]
    assert all(np.isfinite(g[:, :, outside]).all() for g in (dq, dk, dv))
    assert np.isnan(dq[:, :, 7:16]).all() and np.isnan(dk[:, :, 7:16]).all()
    tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, mask=docs.mask, name=f"{order} documents")


@pytest.mark.lemma("L7")
def test_the_reference_floors_do_not_see_what_the_mask_hides():
    """The gradients' recomputation floors (tolerance_backward._recompute_floors) sum over visible pairs
    only: padding full of NaN and inf gives exactly the floors of the same padding filled with finite
    numbers (a NaN floor would be dropped as non-finite, and the visible rows judged with no floor at all)."""
    n, real = 24, 13
    dense = np.zeros((n, n), dtype=bool)
    dense[:real, :real] = reference.causal_mask(real, real)
    mask = masks.from_dense(dense)
    case = Case(n, n, 4, 8, 8, False, heads_kv=1, group=2, seed=11)
    finite = (*case.inputs(np.float32), case.grad_output(np.float32))
    garbage = tuple(x.copy() for x in finite)
    for x in garbage:
        x[:, :, real:] = np.nan
        x[:, :, real::3] = np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        want, got = (reference.dense_backward(*x, mask=mask) for x in (finite, garbage))
        want_floors, got_floors = tolerance_backward._recompute_floors(want), tolerance_backward._recompute_floors(got)
    assert all(f > 0 for f in want_floors) and got_floors == want_floors
    for g, w in zip((got.dq, got.dk, got.dv), (want.dq, want.dk, want.dv)):  # and the gradients of the visible
        assert np.array_equal(g, w)  # part are the same, bit for bit
