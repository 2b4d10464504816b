"""Every registered kernel with every mask kind (proofs/L8): the forward variants and the backward orders
against the float64 reference with the mask, and their HBM traffic, counted element by element in the
simulator, against iomodel's sum over the block-mask lists.

Without a GPU these run in the CUDA simulator on small shapes (N <= 16, d <= 6, tiles <= 8); with one, the
checks against the reference run on the device and the counting tests are skipped. A mask whose kernel
form is "causal" runs the closed forms (causal=True, as fa_numba.attention does); every other mask runs the
block-mask path with the lists, row intervals and dense mask of `kernel_mask`.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from numba import cuda

import fa_numba
from fa_numba import backend, iomodel, masks, tiled, tolerance, tolerance_backward
from fa_numba.kernels import VARIANTS, backward, poisoned_outputs
from fa_numba.kernels.block_lists import kernel_mask
from strategies import HARD_MASK_CASES, MaskCase, mask_kernel_cases, with_hard_mask_cases
from test_masks import definition

NAMES = sorted(name for name, v in VARIANTS.items() if v.block_masks and v.tile_multiple == 1)
# (the variants that take block-mask lists and any tiles: not v1-mma / v2-mma, whose tiles are multiples of 16:
# their masked cases are tests/test_mma_masks.py's)
SIMULATOR = backend.name() == "simulator"
BACKWARD_VARIANTS = (("kv", False), ("kv", True), ("q", False))
DEAD_ROW_CASES = [mc for mc in HARD_MASK_CASES if not definition(mc.mask, mc.n_q, mc.n_k).any(axis=1).all()]
# One case per built-in kind (causal, window, prefix-LM, documents with and without causal), for from_dense.
BUILT_IN_CASES = [HARD_MASK_CASES[t] for t in (2, 3, 6, 11, 12, 13)]
# A mask of each kernel form ("causal", "intervals", "dense"), for the API.
API_CASES = [HARD_MASK_CASES[t] for t in (2, 10, 13, 16)]


def _ids(mc: MaskCase) -> str:
    return f"{mc.mask!r}-{mc.n_q}x{mc.n_k}-b{mc.case.block_q}x{mc.case.block_k}"


def _launch_args(mask, n_q: int, n_k: int, block_q: int, block_k: int):
    """(causal, mask_form, KernelMask or None) of a launch with this mask."""
    form = mask.kernel_form()
    if form == "causal":
        return True, "causal", None
    return False, form, kernel_mask(mask, n_q, n_k, block_q, block_k)


def _forward_kernel(name: str, mc: MaskCase, mask=None):
    mask = mc.mask if mask is None else mask
    c = mc.case
    causal, form, blocks = _launch_args(mask, c.n_q, c.n_k, c.block_q, c.block_k)
    return VARIANTS[name].make(c.block_q, c.block_k, c.d, causal, form), blocks


def run_forward(name: str, mc: MaskCase, inputs):
    """Launch variant `name` with the case's mask on NaN-poisoned outputs; returns host (out, lse)."""
    q, k, v = inputs
    kernel, blocks = _forward_kernel(name, mc)
    out, lse, workspace = poisoned_outputs(q.shape)
    kernel(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, lse, 1 / np.sqrt(mc.case.d), workspace,
           mask=blocks)
    return out.copy_to_host(), lse.copy_to_host()


def _kernel_forward(mc: MaskCase, inputs):
    """The O and LSE the backward kernels take, as in training: the v2 kernel's with the same mask. (Its LSE
    comes from S summed over d in the order the backward kernels sum it again; an LSE from another summation
    order, e.g. the float32 spec's BLAS, differs from the recomputed S by more than the one ulp of LSE the 3x
    rule's floor allows where the dot product cancels: see proofs/L7, floating point.)"""
    return run_forward("v2", mc, inputs)


def run_backward(mc: MaskCase, order: str, deterministic: bool, inputs, forward, mask=None):
    """kernels.backward.run with square tiles B = block_q on device arrays, dq, dk, dv and D poisoned with NaN."""
    mask = mc.mask if mask is None else mask
    q, k, v, dout = inputs
    c = mc.case
    causal, _, blocks = _launch_args(mask, c.n_q, c.n_k, c.block_q, c.block_q)
    dev = [cuda.to_device(np.ascontiguousarray(x)) for x in (q, k, v, *forward, dout)]
    grads = [cuda.to_device(np.full(shape, np.nan, np.float32)) for shape in (q.shape, k.shape, k.shape, q.shape[:-1])]
    backward.run(*dev, *grads, 1 / np.sqrt(c.d), causal=causal, order=order, deterministic=deterministic,
                 block=c.block_q, mask=blocks)
    return tuple(g.copy_to_host() for g in grads[:3])


def _counted_backward(mc: MaskCase, order: str, deterministic: bool, inputs, forward, mask=None):
    from fa_numba.kernels.counting import run_counted_backward

    mask = mc.mask if mask is None else mask
    c = mc.case
    causal, _, blocks = _launch_args(mask, c.n_q, c.n_k, c.block_q, c.block_q)
    return run_counted_backward(*inputs[:3], *forward, inputs[3], 1 / np.sqrt(c.d), causal=causal, order=order,
                                deterministic=deterministic, block=c.block_q, mask=blocks)


def _backward_model(mc: MaskCase, order: str, deterministic: bool, mask=None):
    c = mc.case
    return iomodel.traffic_backward(order, c.n_q, c.n_k, c.d, c.block_q, c.block_q, batch=c.batch, heads=c.heads,
                                    heads_kv=c.heads_kv, deterministic=deterministic,
                                    mask=mc.mask if mask is None else mask)


def _dead(mc: MaskCase) -> np.ndarray:
    return ~definition(mc.mask, mc.n_q, mc.n_k).any(axis=1)


def test_the_pinned_cases_cover_what_they_claim():
    """The kernel tests' parametrised cases hold what their names say."""
    assert DEAD_ROW_CASES and all(_dead(mc).any() for mc in DEAD_ROW_CASES)
    kinds = {type(mc.mask) for mc in BUILT_IN_CASES}
    assert kinds == {masks.Causal, masks.SlidingWindow, masks.PrefixLM, masks.Documents}
    assert {mc.mask.causal for mc in BUILT_IN_CASES if isinstance(mc.mask, masks.Documents)} == {False, True}
    assert {mc.mask.kernel_form() for mc in API_CASES} == set(masks.KERNEL_FORMS)


# --- forward ------------------------------------------------------------------------------------------


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "v1" else n
                                  for n in NAMES])  # v1 (~5 s): the slow tier; v1-rowwise stays
@settings(max_examples=8)
@given(mc=mask_kernel_cases())
@with_hard_mask_cases
def test_forward_kernels_with_a_mask_match_the_reference(name, mc: MaskCase):
    q, k, v = inputs = mc.case.inputs(np.float32)
    out, lse = run_forward(name, mc, inputs)
    check = tolerance.check_attention(out, lse, q, k, v, mask=mc.mask, name=f"{name} kernel",
                                      order=VARIANTS[name].order, block_q=mc.case.block_q, block_k=mc.case.block_k)
    # The kernel follows the float32 spec of its order with the same mask: same tolerance.
    spec_out, spec_lse, _ = tiled.attention(q, k, v, order=VARIANTS[name].order, block_q=mc.case.block_q,
                                            block_k=mc.case.block_k, mask=mc.mask, dtype=np.float32)
    tolerance.assert_close(out, spec_out, check.atol_out, name=f"{name} kernel vs tiled spec out")
    tolerance.assert_close(lse, spec_lse, check.atol_lse, name=f"{name} kernel vs tiled spec lse")
    dead = _dead(mc)
    assert (out[..., dead, :] == 0).all() and np.isneginf(lse[..., dead]).all()


@pytest.mark.lemma("L8")
@pytest.mark.skipif(not SIMULATOR, reason="element counts are taken with counting arrays in the CUDA simulator")
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=8)
@given(mc=mask_kernel_cases())
@with_hard_mask_cases
def test_forward_kernel_traffic_with_a_mask_equals_the_model(name, mc: MaskCase):
    from fa_numba.kernels.counting import run_counted

    c = mc.case
    q, k, v = c.inputs(np.float32)
    kernel, blocks = _forward_kernel(name, mc)
    out, lse, ledger = run_counted(kernel, q, k, v, 1 / np.sqrt(c.d), mask=blocks)
    model = iomodel.traffic(VARIANTS[name].order, c.n_q, c.n_k, c.d, c.block_q, c.block_k, batch=c.batch,
                            heads=c.heads, heads_kv=c.heads_kv, mask=mc.mask)
    assert ledger.reads == model.reads
    assert ledger.writes == model.writes
    assert not np.isnan(out).any() and not np.isnan(lse).any()  # every output element written (finite inputs)


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mc", DEAD_ROW_CASES, ids=_ids)
def test_rows_a_mask_shows_no_key_are_zero_and_minus_inf_in_every_kernel(name, mc: MaskCase):
    """Decided by the mask, not by the values: a NaN in such a row's query changes nothing, bit for bit."""
    q, k, v = mc.case.inputs(np.float32)
    dead = _dead(mc)
    out, lse = run_forward(name, mc, (q, k, v))
    poisoned = q.copy()
    poisoned[:, :, dead] = np.nan
    out2, lse2 = run_forward(name, mc, (poisoned, k, v))
    assert (out[..., dead, :] == 0).all() and np.isneginf(lse[..., dead]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[..., ~dead]).all()
    np.testing.assert_array_equal(out2, out)
    np.testing.assert_array_equal(lse2, lse)


# --- backward -----------------------------------------------------------------------------------------


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("order, deterministic", [  # kv-True and q (~11 s each): the slow tier
    ("kv", False), pytest.param("kv", True, marks=pytest.mark.slow), pytest.param("q", False, marks=pytest.mark.slow)])
@settings(max_examples=8)
@given(mc=mask_kernel_cases())
@with_hard_mask_cases
def test_backward_kernels_with_a_mask_match_the_reference(order, deterministic, mc: MaskCase):
    q, k, v = mc.case.inputs(np.float32)
    dout = mc.case.grad_output(np.float32)
    forward = _kernel_forward(mc, (q, k, v))
    dq, dk, dv = run_backward(mc, order, deterministic, (q, k, v, dout), forward)
    tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, mask=mc.mask,
                                                name=f"{order}{' deterministic' if deterministic else ''} kernel")
    assert (dq[..., _dead(mc), :] == 0).all()  # zero gradient, decided by the mask


@pytest.mark.lemma("L8")
@pytest.mark.skipif(not SIMULATOR, reason="element counts are taken with counting arrays in the CUDA simulator")
@pytest.mark.parametrize("order, deterministic", [  # kv-True and q (~10 s each): the slow tier
    ("kv", False), pytest.param("kv", True, marks=pytest.mark.slow), pytest.param("q", False, marks=pytest.mark.slow)])
@settings(max_examples=8)
@given(mc=mask_kernel_cases())
@with_hard_mask_cases
def test_backward_kernel_traffic_with_a_mask_equals_the_model(order, deterministic, mc: MaskCase):
    inputs = (*mc.case.inputs(np.float32), mc.case.grad_output(np.float32))
    dq, dk, dv, ledger = _counted_backward(mc, order, deterministic, inputs, _kernel_forward(mc, inputs[:3]))
    model = _backward_model(mc, order, deterministic)
    assert ledger.reads == model.reads
    assert ledger.writes == model.writes
    assert not any(np.isnan(g).any() for g in (dq, dk, dv))  # every gradient element written


# --- the built-ins against from_dense -------------------------------------------------------------------


@pytest.mark.lemma("L8")
@pytest.mark.skipif(not SIMULATOR, reason="element counts are taken with counting arrays in the CUDA simulator")
@pytest.mark.parametrize("mc", BUILT_IN_CASES, ids=_ids)
def test_builtins_and_from_dense_give_the_same_counts_in_every_kernel(mc: MaskCase):
    """A built-in (closed form or row intervals) and from_dense of its definition (the dense byte mask) visit
    the same tiles: the same counted traffic in every forward and backward kernel, and both pass the reference."""
    from fa_numba.kernels.counting import run_counted

    c = mc.case
    dense = masks.from_dense(definition(mc.mask, c.n_q, c.n_k))
    assert dense.kernel_form() == "dense" and mc.mask.kernel_form() != "dense"
    q, k, v = inputs = c.inputs(np.float32)
    dout = c.grad_output(np.float32)
    for name in NAMES:
        ledgers = []
        for mask in (mc.mask, dense):
            kernel, blocks = _forward_kernel(name, mc, mask)
            out, lse, ledger = run_counted(kernel, q, k, v, 1 / np.sqrt(c.d), mask=blocks)
            tolerance.check_attention(out, lse, q, k, v, mask=mask, name=f"{name} {mask!r}",
                                      order=VARIANTS[name].order, block_q=c.block_q, block_k=c.block_k)
            ledgers.append(ledger)
        assert ledgers[0] == ledgers[1], name
    forward = _kernel_forward(mc, inputs)
    for order, deterministic in BACKWARD_VARIANTS:
        ledgers = []
        for mask in (mc.mask, dense):
            *grads, ledger = _counted_backward(mc, order, deterministic, (q, k, v, dout), forward, mask=mask)
            tolerance_backward.check_attention_backward(*grads, q, k, v, dout, mask=mask, name=f"{order} {mask!r}")
            ledgers.append(ledger)
        assert ledgers[0] == ledgers[1] == _backward_model(mc, order, deterministic), (order, deterministic)


# --- through the API ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mc", API_CASES, ids=_ids)
def test_attention_and_attention_backward_take_a_mask(mc: MaskCase):
    """fa_numba.attention(mask=) and attention_backward(mask=) give what the kernels give when launched by
    hand with the same tiles (bit for bit), for a mask of each kernel form."""
    c = mc.case
    q, k, v = inputs = c.inputs(np.float32)
    dout = c.grad_output(np.float32)
    for name in NAMES:
        out, lse = fa_numba.attention(q, k, v, mask=mc.mask, order=name, block_q=c.block_q, block_k=c.block_k,
                                      return_lse=True)
        by_hand = run_forward(name, mc, inputs)
        np.testing.assert_array_equal(out, by_hand[0])
        np.testing.assert_array_equal(lse, by_hand[1])
    for order, deterministic in (("kv", True), ("q", False)):  # the deterministic orders: bitwise repeatable
        grads = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=mc.mask, order=order,
                                            deterministic=deterministic, block_q=c.block_q, block_k=c.block_q)
        by_hand = run_backward(mc, order, deterministic, (q, k, v, dout), (out, lse))
        for a, b in zip(grads, by_hand):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make", [
    lambda form: VARIANTS["v2"].make(4, 4, 4, False, form),
    lambda form: VARIANTS["v1-rowwise"].make(4, 4, 4, False, form),
    lambda form: backward.BackwardConfig("kv", 4, 4, False, False, form).check(),
], ids=["engine", "rowwise", "backward"])
def test_a_causal_mask_form_without_causal_is_refused_not_compiled_unmasked(make):
    """The causal kernels are compiled from the flag: a "causal" form with causal=False would run unmasked."""
    with pytest.raises(ValueError, match="mask_form 'causal' needs causal=True"):
        make("causal")
    with pytest.raises(ValueError, match=r"mask_form must be one of \('none', 'causal', 'intervals', 'dense', 'function'\)"):
        make("bogus")
