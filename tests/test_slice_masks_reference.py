"""Masks that differ by batch and head (`fa_numba.slice_masks`) in the float64 reference, the score-mod
evaluation and the tolerance rule: a (B_m, H_m, N_q, N_k) mask gives, slice by slice, what the 2-D mask of
that slice gives on that slice alone; a (1, 1, N_q, N_k) one gives bit for bit what the 2-D mask gives; the
rule passes the reference's own float32 twin and fails a perturbed or wrongly masked output."""

import numpy as np
import pytest

from bounds import assert_within, attention_bound, dense_counts, dot_bound, restated_bound
from float64_bounds import backward_bounds
from fa_numba import masks, mods, reference, tolerance, tolerance_backward

B, N_Q, N_K, D = 2, 13, 10, 8


def _inputs(seed, heads, heads_kv, n_q=N_Q, n_k=N_K, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, heads, n_q, D)).astype(dtype)
    k, v = (rng.standard_normal((B, heads_kv, n_k, D)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal((B, heads, n_q, D)).astype(dtype)
    return q, k, v, dout


def _array(seed, b_m, h_m, n_q=N_Q, n_k=N_K):
    """A random (b_m, h_m, n_q, n_k) mask with row 2 dead in the last slice (in every slice when 1 x 1) and
    a row that sees every key."""
    array = np.random.default_rng(100 + seed).random((b_m, h_m, n_q, n_k)) < 0.6
    array[-1, -1, 2, :] = False
    array[0, 0, 0, :] = True
    return array


def _alibi_bias(slopes, n_q=N_Q, n_k=N_K):
    """ALiBi's additive scores slopes[h] (j - i), (1, H, N_q, N_k), as the mod computes them (one product each)."""
    return np.asarray(slopes)[None, :, None, None] * (np.arange(n_k)[None, :] - np.arange(n_q)[:, None])


def _slice(array, b, h):
    """Slice (b, h) of a broadcast (B_m, H_m, N_q, N_k) array, as 2-D."""
    return array[b if array.shape[0] > 1 else 0, h if array.shape[1] > 1 else 0]


SHAPES = [("BH", lambda h: (B, h)), ("1H", lambda h: (1, h)), ("B1", lambda h: (B, 1)), ("11", lambda h: (1, 1))]
HEADS = [(4, 4), (2, 1)]  # (H, H_kv): one K/V head per query head, and GQA with two query heads per K/V head


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("heads,heads_kv", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("name,slices", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("with_mod", [False, True], ids=["plain", "alibi"])
def test_forward_equals_each_slice_alone(name, slices, heads, heads_kv, with_mod):
    q, k, v, _ = _inputs(1, heads, heads_kv)
    array = _array(1, *slices(heads))
    slopes = np.linspace(0.25, 1.0, heads)
    mod = mods.alibi(slopes) if with_mod else None
    out, lse = reference.attention(q, k, v, mask=masks.from_dense(array), score_mod=mod)
    group = heads // heads_kv
    # Two dense float64 evaluations (all slices at once, the slice alone): each within its derived bound of the
    # exact value (tests/bounds.py), the mod's addition included.
    err_out, err_lse = (2 * e for e in attention_bound(q, k, v, causal=False, counts=dense_counts(N_K),
                                                        mask=masks.from_dense(array),
                                                        bias=_alibi_bias(slopes) if with_mod else None))
    dead_slices = 0
    for b in range(B):
        for h in range(heads):
            visible = _slice(array, b, h)
            hk = h // group
            one_mod = mods.alibi(slopes[h:h + 1]) if with_mod else None  # the slice alone is head 0
            want_out, want_lse = reference.attention(q[b:b + 1, h:h + 1], k[b:b + 1, hk:hk + 1],
                                                     v[b:b + 1, hk:hk + 1], mask=masks.from_dense(visible),
                                                     score_mod=one_mod)
            assert_within(out[b, h], want_out[0, 0], err_out[b, h], name=f"O {b, h}")
            assert_within(lse[b, h], want_lse[0, 0], err_lse[b, h], name=f"LSE {b, h}")
            dead = ~visible.any(axis=1)
            dead_slices += bool(dead.any())
            assert (out[b, h][dead] == 0).all() and (lse[b, h][dead] == -np.inf).all()
            assert np.isfinite(lse[b, h][~dead]).all()
    assert dead_slices >= 1  # a row with no visible key is exercised


@pytest.mark.parametrize("heads,heads_kv", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("name,slices", SHAPES[:1] + SHAPES[2:3], ids=["BH", "B1"])
@pytest.mark.parametrize("with_mod", [False, True], ids=["plain", "alibi"])
def test_backward_equals_the_sum_of_the_slices(name, slices, heads, heads_kv, with_mod):
    q, k, v, dout = _inputs(2, heads, heads_kv)
    array = _array(2, *slices(heads))
    slopes = np.linspace(0.25, 1.0, heads)
    mod = mods.alibi(slopes) if with_mod else None
    grads = reference.dense_backward(q, k, v, dout, mask=masks.from_dense(array), score_mod=mod)
    group = heads // heads_kv
    # Two float64 evaluations, each from its own forward: within twice backward_bounds (tests/float64_bounds.py);
    # dslopes_h = sum over (b, i, j) of dS'_bhij (j - i), B N_q N_k terms in two orders, each dS' within e_ds.
    bias = _alibi_bias(slopes) if with_mod else None
    err_dq, err_dk, err_dv, e_ds, ds_abs = backward_bounds(q, k, v, dout, mask=masks.from_dense(array), bias=bias)
    dist = np.abs(np.arange(N_K)[None, :] - np.arange(N_Q)[:, None])
    err_dslopes = 2 * ((e_ds * dist).sum(axis=(0, 2, 3))
                       + dot_bound((ds_abs * dist).sum(axis=(0, 2, 3)), B * N_Q * N_K))
    want_dk, want_dv = np.zeros_like(k), np.zeros_like(v)
    want_dslopes = np.zeros(heads)
    for b in range(B):
        for h in range(heads):
            hk = h // group
            one = (q[b:b + 1, h:h + 1], k[b:b + 1, hk:hk + 1], v[b:b + 1, hk:hk + 1], dout[b:b + 1, h:h + 1])
            mask = masks.from_dense(_slice(array, b, h))
            if with_mod:
                dq, dk, dv, (dslope,) = reference.attention_backward_mod(*one, mask=mask,
                                                                         score_mod=mods.alibi(slopes[h:h + 1]))
                want_dslopes[h] += dslope[0]
            else:
                dq, dk, dv = reference.attention_backward(*one, mask=mask)
            assert_within(grads.dq[b, h], dq[0, 0], 2 * err_dq[b, h], name=f"dq {b, h}")
            want_dk[b, hk] += dk[0, 0]
            want_dv[b, hk] += dv[0, 0]
            dead = ~_slice(array, b, h).any(axis=1)
            assert (grads.dq[b, h][dead] == 0).all()
    assert_within(grads.dk, want_dk, 2 * err_dk, name="dk")
    assert_within(grads.dv, want_dv, 2 * err_dv, name="dv")
    if with_mod:
        assert_within(grads.dcaptured[0], want_dslopes, err_dslopes, name="dslopes")


def _same(a, b, what):
    """Bitwise equal, NaN and inf included, field by field for dataclasses and tuples."""
    if a is None or isinstance(a, (int, float, np.floating)):
        assert (a == b) or (a is None and b is None), f"{what}: {a!r} != {b!r}"
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for n, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{n}]")
    elif hasattr(a, "__dataclass_fields__"):
        for field in a.__dataclass_fields__:
            _same(getattr(a, field), getattr(b, field), f"{what}.{field}")
    else:
        np.testing.assert_array_equal(a, b, err_msg=what)


@pytest.mark.parametrize("mod_name", [None, "alibi", "softcap"])
def test_one_slice_for_all_is_bitwise_the_2d_mask(mod_name):
    heads, heads_kv = 2, 1
    q, k, v, dout = _inputs(3, heads, heads_kv)
    array = _array(3, 1, 1)
    mod = {None: None, "alibi": mods.alibi([0.5, -0.25]), "softcap": mods.softcap(2.0)}[mod_name]
    sliced, flat = masks.from_dense(array), masks.from_dense(array[0, 0])
    assert sliced.sliced and not getattr(flat, "sliced", False)
    for f in (reference.attention, reference.attention_naive_f32):
        _same(f(q, k, v, mask=sliced, score_mod=mod), f(q, k, v, mask=flat, score_mod=mod), f.__name__)
    _same(reference.attention_backward(q, k, v, dout, mask=sliced, score_mod=mod),
          reference.attention_backward(q, k, v, dout, mask=flat, score_mod=mod), "attention_backward")
    contractions = ("matmul", "loop", "fma")
    tiles = dict(block_q=4, block_k=4)
    _same(tolerance.baseline(q, k, v, mask=sliced, score_mod=mod, contractions=contractions, p_dtype="float16",
                             **tiles),
          tolerance.baseline(q, k, v, mask=flat, score_mod=mod, contractions=contractions, p_dtype="float16",
                             **tiles), "baseline")
    _same(tolerance_backward.baseline_backward(q, k, v, dout, mask=sliced, score_mod=mod, contractions=contractions,
                                               p_dtype="bfloat16"),
          tolerance_backward.baseline_backward(q, k, v, dout, mask=flat, score_mod=mod, contractions=contractions,
                                               p_dtype="bfloat16"), "baseline_backward")
    if mod is not None:
        _same(tolerance_backward.baseline_captured(q, k, v, dout, mask=sliced, score_mod=mod,
                                                   contractions=contractions),
              tolerance_backward.baseline_captured(q, k, v, dout, mask=flat, score_mod=mod, contractions=contractions),
              "baseline_captured")


def doc(b, h, i, j, ids):
    return ids[b, i] == ids[b, j]


def test_document_mask_mod_equals_its_dense_slices():
    heads, heads_kv, n = 2, 1, 12
    q, k, v, dout = _inputs(4, heads, heads_kv, n, n)
    ids = np.array([[0] * 5 + [1] * 4 + [2] * 3, [0] * 2 + [1] * 10], dtype=np.int32)
    mod = masks.mask_mod(doc, ids)
    dense = masks.from_dense(mod.dense_slices(B, heads, n, n))
    assert dense.shape == (B, heads, n, n)
    assert not np.array_equal(dense.array[0], dense.array[1])  # the batches differ: a per-slice mask
    got, want = reference.attention(q, k, v, mask=mod), reference.attention(q, k, v, mask=dense)
    _same(got, want, "attention")
    _same(reference.attention_backward(q, k, v, dout, mask=mod),
          reference.attention_backward(q, k, v, dout, mask=dense), "attention_backward")
    # and it is not what the first batch's documents give everywhere
    first = masks.from_dense(np.broadcast_to(dense.array[:1], dense.shape))
    wrong = reference.attention(q, k, v, mask=first)[0]
    # beyond what rounding explains: the two dense evaluations' derived bounds (tests/bounds.py)
    bound = sum(attention_bound(q, k, v, causal=False, counts=dense_counts(n), mask=m)[0] for m in (first, dense))
    assert (np.abs(wrong - got[0]) > bound).any()


def test_tile_sums_visit_per_slice():
    """A query tile of slice (b, h) visits the key tiles where it sees a key in that slice (tolerance's tiled
    terms): the 4-D visible gives, slice by slice, the 2-D sums of that slice."""
    heads = 2
    q, k, v, _ = _inputs(5, heads, heads, 16, 24)
    array = _array(5, B, heads, 16, 24)
    array[1, 0, :, 8:] = False  # slice (1, 0) never visits key tiles 2..5: fewer round trips there
    tiles = (4, 4)
    dense = reference.dense(q, k, v, mask=masks.from_dense(array))
    assert dense.visible.shape == (B, heads, 16, 24)
    sums = tolerance._tile_sums(dense.p, dense.v, dense.s, dense.visible, dense.out, tiles)
    # Each slice alone from the same S, P, O (a slice of the 4-D problem's) with its 2-D mask, so that both
    # decide alike which tiles may raise the row max; the sums may still round in other orders (a slice's
    # matmuls): each field is within gamma(N_k + T_c + 4) of its magnitude on either side (n_k-term partial
    # sums over T_c tiles, e and |O| products), the magnitude being the same sums of |V| with |O| -> P |V|.
    n_k, t_c = 24, 6
    max_trips = []
    for b in range(B):
        for h in range(heads):
            one = [x[b:b + 1, h:h + 1] for x in (dense.p, dense.v, dense.s, dense.out)]
            alone = tolerance._tile_sums(*one[:3], array[b, h], one[3], tiles)
            bar = tolerance._tile_sums(one[0], np.abs(one[1]), one[2], array[b, h], one[0] @ np.abs(one[1]), tiles)
            for field in ("trips", "rescaled", "rescaled_lse"):
                bound = restated_bound(getattr(bar, field)[0, 0], 0.0, 0, n_k + t_c + 4)
                assert_within(getattr(sums, field)[b, h], getattr(alone, field)[0, 0], bound, name=f"{field} {b, h}")
            max_trips.append(alone.max_trips)
    assert sums.max_trips == max(max_trips) and min(max_trips) < max(max_trips)


@pytest.mark.parametrize("heads,heads_kv", HEADS, ids=["mha", "gqa"])
def test_rule_passes_the_float32_twin_and_fails_wrong_outputs(heads, heads_kv):
    q, k, v, dout = (x.astype(np.float32) for x in _inputs(6, heads, heads_kv))
    array = _array(6, B, heads)
    mask = masks.from_dense(array)
    out, lse = reference.attention_naive_f32(q, k, v, mask=mask)
    base = tolerance.baseline(q, k, v, mask=mask, block_q=4, block_k=4)
    for order in (None, "v1", "v2"):
        tolerance.judge(out, lse, base, order=order)
    tolerance.check_attention(out, lse, q, k, v, mask=mask)
    # one visible entry (slice (1, h-1), row 3 sees keys) moved by a large amount
    assert _slice(array, 1, heads - 1)[3].any()
    bad = out.copy()
    bad[1, heads - 1, 3, 0] += 1.0
    with pytest.raises(AssertionError, match="out"):
        tolerance.judge(bad, lse, base, order="v1")
    # a dead row (slice (B-1, H-1), row 2) must stay exactly 0
    bad = out.copy()
    bad[-1, -1, 2, 0] = 1e-3
    with pytest.raises(AssertionError, match="out"):
        tolerance.check_attention(bad, lse, q, k, v, mask=mask)
    # the first head's mask used for every head: wrong for the others
    wrong = masks.from_dense(np.repeat(array[:, :1], heads, axis=1))
    with pytest.raises(AssertionError):
        tolerance.judge(*reference.attention_naive_f32(q, k, v, mask=wrong), base)
    # the gradients' rule, the same way
    dq, dk, dv = reference.attention_backward_naive_f32(q, k, v, dout, mask=mask)
    tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, mask=mask)
    dv = dv.copy()
    dv[0, 0, 1, 0] += 1.0
    with pytest.raises(AssertionError, match="dv"):
        tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, mask=mask)


# dense_backward's float32 S = scale Q K^T (no errstate there, unlike the forward's) warns on inf - inf in the
# masked row it then discards: the result is right, the warning is noise (as for any 2-D mask)
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("heads,heads_kv", HEADS, ids=["mha", "gqa"])
def test_nonfinite_inputs_reach_only_the_slices_that_see_them(heads, heads_kv):
    """A NaN or inf in a value, key, query or dO that one slice masks and another sees: only the slice that
    sees it is made non-finite (visible_matmul per slice), as on that slice alone; the gradients' floors do
    not see it either."""
    q, k, v, dout = _inputs(7, heads, heads_kv)
    array = _array(7, B, heads)
    group = heads // heads_kv
    # key 5 is masked in slice (b, h_masked) and seen in (b, h_seen): the same K/V head under GQA (the NaN
    # reaches h_seen), another one without (slice h_seen's own key 5 is finite)
    h_masked, h_seen = (1, 0) if group == 1 else (0, 1)
    kv = h_masked // group
    for b in range(B):
        array[b, h_masked, :, 5] = False
        array[b, h_seen, :, 5] = True
    v[0, kv, 5, 3] = np.nan
    k[1, kv, 5, 1] = np.inf
    array[-1, -1, 2, :] = False
    q[-1, -1, 2, 1] = np.inf  # a query and a dO of a row with no visible key in its slice
    dout[-1, -1, 2, :] = np.nan
    mask = masks.from_dense(array)
    out, lse = reference.attention(q, k, v, mask=mask)
    dq, dk, dv = reference.attention_backward(q, k, v, dout, mask=mask)
    assert np.isfinite(out[:, h_masked]).all() and np.isfinite(dq[:, h_masked]).all()
    assert np.isnan(out[0, h_seen, :, 3]).all() == (group > 1) and np.isnan(dq[1, h_seen]).any() == (group > 1)
    want_dk, want_dv = np.zeros_like(k), np.zeros_like(v)
    # The finite entries depend on no non-finite input: their bounds (twice one float64 evaluation's, each from
    # its own forward, tests/bounds.py and float64_bounds.py) are those of the inputs with the non-finite
    # entries set to 0.
    clean = [np.where(np.isfinite(x), x, 0.0) for x in (q, k, v, dout)]
    err_out, err_lse = (2 * e for e in attention_bound(*clean[:3], causal=False, counts=dense_counts(N_K), mask=mask))
    err_dq, err_dk, err_dv = (2 * e for e in backward_bounds(*clean, mask=mask)[:3])
    for b in range(B):
        for h in range(heads):
            hk = h // group
            one = (q[b:b + 1, h:h + 1], k[b:b + 1, hk:hk + 1], v[b:b + 1, hk:hk + 1])
            one_mask = masks.from_dense(array[b, h])
            want = reference.attention(*one, mask=one_mask)
            assert_within(out[b, h], want[0][0, 0], err_out[b, h], name=f"O {b, h}", equal_nan=True)
            assert_within(lse[b, h], want[1][0, 0], err_lse[b, h], name=f"LSE {b, h}", equal_nan=True)
            g = reference.attention_backward(*one, dout[b:b + 1, h:h + 1], mask=one_mask)
            assert_within(dq[b, h], g[0][0, 0], err_dq[b, h], name=f"dq {b, h}", equal_nan=True)
            want_dk[b, hk] += g[1][0, 0]
            want_dv[b, hk] += g[2][0, 0]
    assert_within(dk, want_dk, err_dk, name="dk", equal_nan=True)
    assert_within(dv, want_dv, err_dv, name="dv", equal_nan=True)
    assert (dq[-1, -1, 2] == 0).all() and (out[-1, -1, 2] == 0).all() and lse[-1, -1, 2] == -np.inf
    # the floors of the gradients' rule: the dead row's NaN dO and inf query are never multiplied
    clean_q, clean_dout = q.copy(), dout.copy()
    clean_q[-1, -1, 2, 1] = 0.0
    clean_dout[-1, -1, 2, :] = 0.0
    contractions = ("matmul",)
    _same(tolerance_backward.baseline_backward(q, k, v, dout, mask=mask, contractions=contractions, p_dtype="float16"),
          tolerance_backward.baseline_backward(clean_q, k, v, clean_dout, mask=mask, contractions=contractions,
                                               p_dtype="float16"), "baseline_backward")


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_rule_terms_are_the_max_over_the_slices():
    """Without GQA every derived term of the rule (forward: score floor, P rounding; backward: recomputation
    floors, 16-bit rounding terms) is a max over pairs of one slice: the 4-D mask's term is the max of the
    terms of the slices alone. The slice (B-1, H-1), whose dO is scaled to hold the largest terms, has a dead
    row with an inf query and a NaN dO, which its terms must not see (a mask of the wrong slice would
    multiply them and make its terms NaN, dropped by _finite_max)."""
    heads = 2
    q, k, v, dout = _inputs(8, heads, heads)
    array = _array(8, B, heads)
    dout[-1, -1] *= 50
    q[-1, -1, 2, 1] = np.inf
    dout[-1, -1, 2, :] = np.nan
    mask = masks.from_dense(array)

    def terms(q, k, v, dout, mask):
        grads = reference.dense_backward(q, k, v, dout, mask=mask)
        forward = tolerance._terms(reference.dense(q, k, v, mask=mask), None, "float16")
        return ((forward.score_out, forward.score_lse, forward.p_out) + tolerance_backward._recompute_floors(grads)
                + tolerance_backward.grad_rounding_terms(grads, "float16"))

    got = terms(q, k, v, dout, mask)
    alone = [terms(q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1], dout[b:b + 1, h:h + 1],
                   masks.from_dense(array[b, h])) for b in range(B) for h in range(heads)]
    # Exact: every term is a max over pairs of one slice, and a slice alone goes through the same operations in
    # the same order as inside the 4-D problem (elementwise operations, reductions over its own last axis, one
    # matmul per (b, h) slice of the same shape and strides), so the max over the slices is the same bits.
    np.testing.assert_array_equal(got, np.max(alone, axis=0))
    assert np.all(np.argmax(alone, axis=0)[3:] == len(alone) - 1)  # the backward's terms: the scaled slice's
