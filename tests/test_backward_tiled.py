"""The backward's executable spec in both orders and its traffic in closed form (proofs/L7_backward.md)."""

import warnings

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fa_numba import iomodel, masks, online_softmax as osm, reference, tiled, tiling, tolerance, tolerance_backward
from bounds import UNDERFLOW, assert_within, attention_bound, dense_counts, dot_bound, gamma, softmax_bound
from float64_bounds import float64_atols, magnitudes, recomputed_p_rel
from strategies import (HARD_MASK_CASES, Case, MaskCase, cases, mask_cases, with_backward_hard_cases,
                        with_hard_mask_cases)
from test_masks import definition

# (order, deterministic): the three variants of the spec.
VARIANTS = (("kv", False), ("kv", True), ("q", False))


def _backward(case: Case, order: str, deterministic: bool, inputs, forward, dtype=np.float64, skip=True):
    q, k, v, dout = inputs
    out, lse = forward
    return tiled.attention_backward(q, k, v, out, lse, dout, order=order, block_q=case.block_q, block_k=case.block_k,
                                    causal=case.causal, dtype=dtype, deterministic=deterministic, skip=skip)


def _inputs(case: Case, dtype=np.float64):
    return (*case.inputs(dtype), case.grad_output(dtype))


@pytest.mark.lemma("L7")
@given(case=cases(max_n=14, amplitudes=(1.0, 5.0)))
@with_backward_hard_cases
def test_float64_spec_of_both_orders_equals_the_reference(case: Case):
    inputs = _inputs(case)
    forward = reference.attention(*inputs[:3], causal=case.causal)
    ref = reference.attention_backward(*inputs, causal=case.causal)
    # Two float64 evaluations of the same formulas from the same O and LSE: within the first-order bound
    # 2 u kappa max G (tests/float64_bounds.py, proofs/L7), about 1e-14 of the gradients' magnitude G here,
    # 1e-11 at logits 1e4 (where G, not max |g|, is the scale: the exact dQ, dK are ~e^-gap there).
    atols = float64_atols(magnitudes(*inputs, case.causal))
    for order, deterministic in VARIANTS:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # dead rows and masked scores must not warn
            grads = _backward(case, order, deterministic, inputs, forward)[:3]
        for name, g, r, atol in zip(("dq", "dk", "dv"), grads, ref, atols):
            assert g.shape == r.shape and g.dtype == np.float64
            tolerance.assert_close(g, r, atol, name=f"tiled {order}{' deterministic' if deterministic else ''} {name}")


# Exceeds 3x its naive error plus the other floors by 10% without the LSE's ulp in the floor (proofs/L7).
LUCKY_LSE = Case(n_q=4, n_k=4, d=4, block_q=1, block_k=1, causal=False, heads_kv=1, group=3, logit=30.0, seed=4)


@pytest.mark.lemma("L7")
@given(case=cases(max_n=14, amplitudes=(1.0, 5.0)))
@with_backward_hard_cases
@example(case=LUCKY_LSE)
def test_float32_spec_of_both_orders_passes_the_3x_rule(case: Case):
    """The spec in float32 from the float32 forward's O and LSE (as the kernels will run), by the 3x rule."""
    inputs = _inputs(case, np.float32)
    q, k, v, dout = inputs
    out, lse, _ = tiled.attention(q, k, v, order="v2", block_q=case.block_q, block_k=case.block_k,
                                  causal=case.causal, dtype=np.float32)
    base = tolerance_backward.baseline_backward(q, k, v, dout, causal=case.causal)
    for order, deterministic in VARIANTS:
        grads = _backward(case, order, deterministic, inputs, (out, lse), dtype=np.float32)[:3]
        assert all(g.dtype == np.float32 for g in grads)
        tolerance_backward.judge_backward(*grads, base, name=f"tiled {order} float32")


@pytest.mark.lemma("L7")
def test_float16_inputs_are_checked_against_the_reference_of_the_same_inputs():
    case = Case(n_q=9, n_k=13, d=8, block_q=4, block_k=4, causal=True, seed=5)
    inputs = _inputs(case, np.float16)
    q, k, v, dout = inputs
    out, lse, _ = tiled.attention(q, k, v, order="v2", block_q=4, block_k=4, causal=True, dtype=np.float32)
    base = tolerance_backward.baseline_backward(q, k, v, dout, causal=True)
    for order, deterministic in VARIANTS:
        grads = _backward(case, order, deterministic, inputs, (out, lse), dtype=np.float32)[:3]
        tolerance_backward.judge_backward(*grads, base, name=f"tiled {order} from float16")


@pytest.mark.lemma("L7")
@given(case=cases(max_n=14))
@with_backward_hard_cases
def test_skipping_skip_tiles_changes_only_the_ledger(case: Case):
    """Visiting the SKIP tiles too adds exact zeros to every accumulator: the gradients are equal bit for bit."""
    inputs = _inputs(case)
    forward = reference.attention(*inputs[:3], causal=case.causal)
    for order, deterministic in VARIANTS:
        *skipped, ledger = _backward(case, order, deterministic, inputs, forward)
        *visited, ledger_all = _backward(case, order, deterministic, inputs, forward, skip=False)
        for a, b in zip(skipped, visited):
            np.testing.assert_array_equal(a, b)
        if case.causal and (tiling.classify(case.n_q, case.n_k, case.block_q, case.block_k, True) == 0).any():
            assert ledger != ledger_all


@pytest.mark.lemma("L7")
@pytest.mark.parametrize("order, deterministic", VARIANTS)
def test_dead_rows_are_exactly_zero_in_the_spec_and_touch_nothing(order, deterministic):
    # delta = -7: rows 0..6 see no key; query tile 0 is all dead (never loaded), tile 1 mixes dead and live
    # rows inside a PARTIAL tile; GQA with three query heads per K/V head.
    case = Case(n_q=11, n_k=4, d=3, block_q=4, block_k=3, causal=True, heads_kv=2, group=3, seed=7)
    q, k, v, dout = inputs = _inputs(case)
    forward = reference.attention(q, k, v, causal=True)
    dead = ~reference.visible_mask(case.n_q, case.n_k, True).any(axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dq, dk, dv, _ = _backward(case, order, deterministic, inputs, forward)
    assert (dq[:, :, dead] == 0).all() and (dq[:, :, ~dead] != 0).any()
    # A dead row's query, O and dO (even NaN) reach nothing: dk and dv equal bit for bit.
    q2, dout2, out2 = q.copy(), dout.copy(), forward[0].copy()
    q2[:, :, dead] = np.nan
    dout2[:, :, dead] = np.nan
    out2[:, :, dead] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dq2, dk2, dv2, _ = _backward(case, order, deterministic, (q2, k, v, dout2), (out2, forward[1]))
    for a, b in ((dq2, dq), (dk2, dk), (dv2, dv)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.lemma("L7")
@given(case=cases(max_n=10, max_d=5))
@with_backward_hard_cases
def test_recomputed_p_is_the_softmax_and_d_is_rowsum_p_dp(case: Case):
    """L7.1 and L7.2 on whole rows: exp(S - LSE) is the forward's softmax, and sum_x dO O = sum_j P dP.

    Every side is a float64 evaluation held to its derived bound against the exact value (tests/bounds.py,
    tests/float64_bounds.py), never to an rtol: the reference's O and LSE within attention_bound, the scores
    within sigma = gamma(d + 1) scale |q| |k|, the recomputed P within P r (recomputed_p_rel: the scores' and
    LSE's errors and the rounded exponent, about u |LSE| at logits 1e4), e / sum(e) within softmax_bound (values
    the identity), the d-term and N_k-term sums within dot_bound."""
    q, k, v, dout = _inputs(case)
    out, lse = reference.attention(q, k, v, causal=case.causal)
    out_err, lse_err = attention_bound(q, k, v, causal=case.causal, counts=dense_counts(case.n_k))
    visible = reference.visible_mask(case.n_q, case.n_k, case.causal)
    scale = 1 / np.sqrt(case.d)
    slack = 4 * UNDERFLOW
    for b in range(case.batch):
        for h in range(case.heads):
            kk, vv = k[b, h // case.group], v[b, h // case.group]
            s = scale * q[b, h] @ kk.T
            p = osm.recompute_p(s, lse[b, h], visible)
            alive = visible.any(axis=1)
            assert (p[~visible] == 0).all() and (p[~alive] == 0).all()
            if not alive.any():
                continue
            sigma = np.where(visible, gamma(case.d + 1) * scale * np.abs(q[b, h]) @ np.abs(kk).T, 0.0)[alive]
            masked = np.where(visible, s, -np.inf)[alive]
            e = np.exp(masked - s[alive].max(axis=1, where=visible[alive], initial=-np.inf)[:, None])
            soft = e / e.sum(axis=1, keepdims=True)  # stands for the exact P in the bounds' magnitudes
            soft_err, _ = softmax_bound(masked, np.eye(case.n_k), *dense_counts(case.n_k), sigma=sigma)
            r = recomputed_p_rel(soft, sigma, lse_err[b, h][alive])
            pa = p[alive]
            assert_within(pa, soft, soft * r + soft_err + slack, name="P")
            # P V from the recomputed P (N_k-term sums) against the reference's O.
            pv_err = (soft * r) @ np.abs(vv) + dot_bound((soft * (1 + r)) @ np.abs(vv), case.n_k)
            assert_within(pa @ vv, out[b, h][alive], pv_err + out_err[b, h][alive] + slack, name="P V")
            dp = dout[b, h] @ vv.T
            D = (dout[b, h] * out[b, h]).sum(axis=1)
            # D = dO . O (d terms, O within out_err) and sum_j P_j dP_j (dP's d terms, P within P r, N_k terms).
            dp_err = dot_bound(np.abs(dout[b, h]) @ np.abs(vv).T, case.d)[alive]
            d_err = (dot_bound((np.abs(dout[b, h]) * np.abs(out[b, h])).sum(axis=1), case.d)[alive]
                     + (np.abs(dout[b, h][alive]) * out_err[b, h][alive]).sum(axis=1))
            dpa = np.abs(dp[alive])
            pdp_err = ((soft * (r * dpa + (1 + r) * dp_err)).sum(axis=1)
                       + dot_bound((soft * (1 + r) * (dpa + dp_err)).sum(axis=1), case.n_k))
            assert_within(D[alive], (p * dp).sum(axis=1)[alive], d_err + pdp_err + slack, name="D")
            ds = osm.score_gradient(p, dp, D, visible)
            assert (ds[~visible] == 0).all()
            # sum_j P_j (dP_j - D) = 0 exactly; computed: P's, dP's and D's errors, two roundings per dS_j, N_k terms.
            spread = np.abs(dp[alive] - D[alive, None])
            ds_abs = np.abs(ds[alive])
            zero_err = ((soft * (r * spread + (1 + r) * (dp_err + d_err[:, None]))).sum(axis=1)
                        + (gamma(2) + gamma(case.n_k)) * (1 + gamma(2)) * ds_abs.sum(axis=1))
            assert_within(ds.sum(axis=1)[alive], np.zeros(int(alive.sum())), zero_err + slack, name="sum dS")


@pytest.mark.lemma("L7")
def test_a_broken_spec_is_caught(monkeypatch):
    """The spec tests can fail: forget D (dS = P dP instead of P (dP - D)) and every check catches it."""
    case = Case(n_q=8, n_k=12, d=4, block_q=4, block_k=4, causal=True, seed=9, logit=3.0)
    inputs = _inputs(case)
    forward = reference.attention(*inputs[:3], causal=case.causal)
    ref = reference.attention_backward(*inputs, causal=True)
    atols = float64_atols(magnitudes(*inputs, True))
    f32 = _inputs(case, np.float32)
    base = tolerance_backward.baseline_backward(*f32, causal=True)
    monkeypatch.setattr(tiled, "_preprocess", lambda out, dout: np.zeros(out.shape[:-1], dtype=out.dtype))
    for order, deterministic in VARIANTS:
        dq, dk, dv, _ = _backward(case, order, deterministic, inputs, forward)
        tolerance.assert_close(dv, ref[2], atols[2], name="dv")  # dV does not involve D: its derived bound holds
        for name, g, r, atol in (("dq", dq, ref[0], atols[0]), ("dk", dk, ref[1], atols[1])):
            with pytest.raises(AssertionError, match="beyond atol"):
                tolerance.assert_close(g, r, atol, name=name)
        grads = _backward(case, order, deterministic, f32, tuple(x.astype(np.float32) for x in forward),
                          dtype=np.float32)[:3]
        with pytest.raises(AssertionError, match="broken dq"):
            tolerance_backward.judge_backward(*grads, base, name="broken")


def test_arguments_are_validated_by_name():
    case = Case(n_q=4, n_k=4, d=2, block_q=2, block_k=2, causal=False)
    q, k, v, dout = _inputs(case)
    out, lse = reference.attention(q, k, v)
    call = lambda **kw: tiled.attention_backward(**{**dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, order="kv",  # noqa: E731
                                                            block_q=2, block_k=2), **kw})
    with pytest.raises(ValueError, match=r"deterministic=True is only available with order='kv'"):
        call(order="q", deterministic=True)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        call(deterministic=1)
    with pytest.raises(ValueError, match=r"order must be one of \('kv', 'q'\) for the backward, got 'v2'"):
        call(order="v2")
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 1, 4\) \(as q without its last axis\)"):
        call(lse=lse[..., :3])
    with pytest.raises(ValueError, match=r"out must have shape \(1, 1, 4, 2\) \(as q with v's head dim\)"):
        call(out=out[..., :1])
    with pytest.raises(TypeError, match="dout must have dtype in"):
        call(dout=dout.astype(np.int64))
    with pytest.raises(ValueError, match="block_k must be a positive int"):
        call(block_k=0)
    with pytest.raises(ValueError, match=r"deterministic=True is only available with order='kv'"):
        iomodel.traffic_backward("q", 4, 4, 2, 2, 2, False, deterministic=True)


# --- traffic -------------------------------------------------------------------------------------------


@pytest.mark.lemma("L7")
@given(case=cases(max_n=24), skip=st.booleans())
@with_backward_hard_cases(skip=True)
def test_backward_ledger_equals_closed_form(case: Case, skip: bool):
    inputs = _inputs(case)
    forward = reference.attention(*inputs[:3], causal=case.causal)
    for order, deterministic in VARIANTS:
        *_, ledger = _backward(case, order, deterministic, inputs, forward, skip=skip)
        model = iomodel.traffic_backward(order, case.n_q, case.n_k, case.d, case.block_q, case.block_k, case.causal,
                                         batch=case.batch, heads=case.heads, heads_kv=case.heads_kv,
                                         deterministic=deterministic, skip=skip)
        assert set(ledger.reads) == set(tiled.BACKWARD_TENSORS)
        assert ledger.reads == model.reads, (order, deterministic)
        assert ledger.writes == model.writes, (order, deterministic)


@pytest.mark.lemma("L7")
@given(n_q=st.integers(1, 300), n_k=st.integers(1, 300), d=st.integers(1, 128), block_q=st.integers(1, 64),
       block_k=st.integers(1, 64), heads_kv=st.integers(1, 3), group=st.integers(1, 3))
def test_non_causal_backward_traffic_matches_the_textbook_formulas(n_q, n_k, d, block_q, block_k, heads_kv, group):
    t_r, t_c = -(-n_q // block_q), -(-n_k // block_k)
    h, h_kv = heads_kv * group, heads_kv
    sizes = (n_q, n_k, d, block_q, block_k, False)
    kv = iomodel.traffic_backward("kv", *sizes, heads=h, heads_kv=h_kv)
    det = iomodel.traffic_backward("kv", *sizes, heads=h, heads_kv=h_kv, deterministic=True)
    qo = iomodel.traffic_backward("q", *sizes, heads=h, heads_kv=h_kv)
    for t in (kv, det, qo):  # the preprocess
        assert (t.reads["O"], t.writes["D"]) == (h * n_q * d, h * n_q)
    # "kv": K, V once per K/V head; Q, dO, dQ once per key tile and query head.
    assert kv.reads["K"] == kv.writes["dK"] == kv.writes["dV"] == h_kv * n_k * d
    assert kv.reads["Q"] == kv.reads["dQ"] == h * t_c * n_q * d
    assert kv.reads["dO"] == h * (t_c + 1) * n_q * d and kv.writes["dQ"] == h * (t_c + 1) * n_q * d
    assert kv.reads["LSE"] == kv.reads["D"] == h * t_c * n_q
    # deterministic: no dQ read-modify-write; the dQ pass reads Q, dO once and K, V once per query tile.
    assert det.reads["dQ"] == 0 and det.writes["dQ"] == h * n_q * d
    assert det.reads["Q"] == h * (t_c + 1) * n_q * d
    assert det.reads["K"] == h_kv * n_k * d + h * t_r * n_k * d
    # "q": Q, dO once per query head; K, V and dK, dV (read and written) once per query tile.
    assert qo.reads["Q"] == h * n_q * d and qo.writes["dQ"] == h * n_q * d and qo.reads["dQ"] == 0
    assert qo.reads["K"] == qo.reads["dK"] == h * t_r * n_k * d
    assert qo.writes["dK"] == h_kv * n_k * d + h * t_r * n_k * d


@pytest.mark.lemma("L7")
def test_more_queries_than_keys_does_not_load_dead_query_tiles():
    # delta = -8: query tiles 0 and 1 see nothing; "q" and the dQ pass read only Q rows 8..11 and write
    # dQ = 0 for the others; "kv" visits only the last query tile.
    q_order = iomodel.traffic_backward("q", 12, 4, 2, 4, 4, causal=True)
    assert q_order.reads["Q"] == 4 * 2 and q_order.reads["LSE"] == 4 and q_order.writes["dQ"] == 12 * 2
    det = iomodel.traffic_backward("kv", 12, 4, 2, 4, 4, causal=True, deterministic=True)
    assert det.reads["Q"] == 4 * 2 + 4 * 2 and det.writes["dQ"] == 12 * 2
    kv = iomodel.traffic_backward("kv", 12, 4, 2, 4, 4, causal=True)
    assert kv.reads["dQ"] == 4 * 2 and kv.writes["dQ"] == 12 * 2 + 4 * 2


def test_backward_bytes_summary():
    t = iomodel.traffic_backward("kv", 64, 64, 16, 16, 16, causal=False)
    b = iomodel.to_bytes(t, in_itemsize=2)
    assert set(b["read"]) == set(tiled.BACKWARD_TENSORS)
    assert b["read"]["dO"] == t.reads["dO"] * 2 and b["read"]["dQ"] == t.reads["dQ"] * 4
    assert b["write"]["D"] == 64 * 4 and b["read"]["K"] == 64 * 16 * 2
    assert iomodel.total_bytes(t, 2) == sum(b["read"].values()) + sum(b["write"].values())


# --- masks beyond causal (proofs/L8) -----------------------------------------------------------------


def _mask_backward(mc: MaskCase, order: str, deterministic: bool, inputs, forward, dtype=np.float64, skip=True,
                   mask=None):
    q, k, v, dout = inputs
    out, lse = forward
    return tiled.attention_backward(q, k, v, out, lse, dout, order=order, block_q=mc.case.block_q,
                                    block_k=mc.case.block_k, mask=mc.mask if mask is None else mask, dtype=dtype,
                                    deterministic=deterministic, skip=skip)


@pytest.mark.lemma("L8")
@given(mc=mask_cases(max_n=14, amplitudes=(1.0, 5.0)))
@with_hard_mask_cases
def test_float64_backward_spec_with_a_mask_equals_the_reference(mc: MaskCase):
    inputs = _inputs(mc.case)
    forward = reference.attention(*inputs[:3], mask=mc.mask)
    ref = reference.attention_backward(*inputs, mask=mc.mask)
    atols = float64_atols(magnitudes(*inputs, False, mask=mc.mask))  # as the causal test above (L7)
    dead = ~definition(mc.mask, mc.n_q, mc.n_k).any(axis=1)
    for order, deterministic in VARIANTS:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # dead rows and masked scores must not warn
            grads = _mask_backward(mc, order, deterministic, inputs, forward)[:3]
        for name, g, r, atol in zip(("dq", "dk", "dv"), grads, ref, atols):
            tolerance.assert_close(g, r, atol, name=f"tiled {order}{' deterministic' if deterministic else ''} {name}")
        assert (grads[0][..., dead, :] == 0).all()  # decided by the mask: exactly zero


@pytest.mark.lemma("L8")
@given(mc=mask_cases(max_n=14, amplitudes=(1.0, 5.0)))
@with_hard_mask_cases
def test_float32_backward_spec_with_a_mask_passes_the_3x_rule(mc: MaskCase):
    """From the float32 forward spec's O and LSE with the same mask, as the kernels will run."""
    inputs = _inputs(mc.case, np.float32)
    q, k, v, dout = inputs
    out, lse, _ = tiled.attention(q, k, v, order="v2", block_q=mc.case.block_q, block_k=mc.case.block_k,
                                  mask=mc.mask, dtype=np.float32)
    base = tolerance_backward.baseline_backward(q, k, v, dout, mask=mc.mask)
    for order, deterministic in VARIANTS:
        grads = _mask_backward(mc, order, deterministic, inputs, (out, lse), dtype=np.float32)[:3]
        assert all(g.dtype == np.float32 for g in grads)
        tolerance_backward.judge_backward(*grads, base, name=f"tiled {order} float32")


@pytest.mark.lemma("L8")
@given(mc=mask_cases(max_n=12))
@with_hard_mask_cases
def test_backward_builtins_equal_from_dense_and_skipping_changes_only_the_ledger(mc: MaskCase):
    """from_dense of a mask's definition gives the same gradients bit for bit and the same ledger; visiting
    its SKIP tiles too (skip=False) gives the same gradients bit for bit and a larger ledger (L7.4, L8.5)."""
    inputs = _inputs(mc.case)
    forward = reference.attention(*inputs[:3], mask=mc.mask)
    dense = masks.from_dense(definition(mc.mask, mc.n_q, mc.n_k))
    any_skip = (tiling.classify(*mc.tiles, mask=mc.mask) == tiling.SKIP).any()
    for order, deterministic in VARIANTS:
        *grads, ledger = _mask_backward(mc, order, deterministic, inputs, forward)
        *by_dense, ledger_dense = _mask_backward(mc, order, deterministic, inputs, forward, mask=dense)
        *visited, ledger_all = _mask_backward(mc, order, deterministic, inputs, forward, skip=False)
        for g, g_dense, g_all in zip(grads, by_dense, visited):
            np.testing.assert_array_equal(g, g_dense)
            np.testing.assert_array_equal(g, g_all)
        assert ledger == ledger_dense
        assert (ledger != ledger_all) == any_skip


@pytest.mark.lemma("L8")
@given(case=cases(max_n=12))
@with_backward_hard_cases
def test_causal_flag_equals_the_causal_mask_in_the_backward_spec_bitwise(case: Case):
    inputs = _inputs(case)
    forward = reference.attention(*inputs[:3], causal=True)
    q, k, v, dout = inputs
    for order, deterministic in VARIANTS:
        for dtype in (np.float64, np.float32):
            runs = [tiled.attention_backward(q, k, v, *forward, dout, order=order, block_q=case.block_q,
                                             block_k=case.block_k, dtype=dtype, deterministic=deterministic, **kw)
                    for kw in ({"causal": True}, {"mask": masks.causal()})]
            for a, b in zip(*(r[:3] for r in runs)):
                np.testing.assert_array_equal(a, b)
            assert runs[0][3] == runs[1][3]


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("order, deterministic", VARIANTS)
@pytest.mark.parametrize("mc", [mc for mc in HARD_MASK_CASES
                                if not definition(mc.mask, mc.n_q, mc.n_k).any(axis=1).all()],
                         ids=lambda mc: repr(mc.mask))
def test_dead_rows_under_a_mask_are_exactly_zero_in_the_spec_and_touch_nothing(order, deterministic, mc: MaskCase):
    """A row the mask shows no key: dQ row 0, and its Q, O, dO (even NaN) reach no gradient, bit for bit."""
    q, k, v, dout = inputs = _inputs(mc.case)
    forward = reference.attention(q, k, v, mask=mc.mask)
    dead = ~definition(mc.mask, mc.n_q, mc.n_k).any(axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dq, dk, dv, _ = _mask_backward(mc, order, deterministic, inputs, forward)
        q2, dout2, out2 = q.copy(), dout.copy(), forward[0].copy()
        q2[:, :, dead], dout2[:, :, dead], out2[:, :, dead] = np.nan, np.nan, np.nan
        dq2, dk2, dv2, _ = _mask_backward(mc, order, deterministic, (q2, k, v, dout2), (out2, forward[1]))
    assert (dq[:, :, dead] == 0).all()
    for a, b in ((dq2, dq), (dk2, dk), (dv2, dv)):
        np.testing.assert_array_equal(a, b)
