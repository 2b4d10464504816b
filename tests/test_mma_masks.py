"""Block masks on the tensor-core kernels (kernels/mma/masking.py): the forward's two orders and the backward's
two modes walk a block mask's lists (every form: row intervals, dense bytes, a mask_mod's function; one mask or
one per (batch, head)) and test pairs inside PARTIAL tiles only.

- every form within the derived rule (with the P and dS rounding terms) against the float64 reference, rows
  that see no key included (O = 0, LSE = -inf), under GQA with masks that differ between the query heads of one
  K/V head (the K/V-outer backward switches lists per query head);
- equal masks in different forms give the same bits, and a dense causal mask the causal kernels' bits (the
  lists and the closed form visit the same tiles and test the same pairs);
- the counted HBM traffic equals iomodel's with the mask (a key tile no row sees is never read);
- a NaN behind the mask stays out of every result (the exact CUDA-core path of PARTIAL tiles), and a mask_mod
  is never called past the problem.

Shapes stay tiny: a tensor-core launch takes seconds in the simulator (emulated mma). Default tier: one forward
and one backward case; the slow tier the rest.
"""

import numpy as np
import pytest

import fa_numba
from fa_numba import iomodel, masks, reference, tolerance, tolerance_backward
from fa_numba.kernels.counting import run_counted_backward

SLOW = pytest.mark.slow
B, H, H_KV, N_Q, N_K, D = 1, 2, 1, 29, 37, 16  # ragged over 16 x 16 tiles: 2 query tiles, 3 key tiles
TILE = 16


def _inputs(seed, kind=np.float16):
    """16-bit q, k, v, dout and their exact float64 values."""
    rng = np.random.default_rng(seed)
    sizes = ((H, N_Q), (H_KV, N_K), (H_KV, N_K), (H, N_Q))
    sixteen = [rng.standard_normal((B, h, n, D)).astype(kind) for h, n in sizes]
    return sixteen, [x.astype(np.float64) for x in sixteen]


def _per_head(b, h, i, j):
    """Query head 0: a band of width 5 around the bottom-right diagonal; head 1: keys 0..7 and 24..36 only (rows
    that see the middle key tile see nothing there; head 1's lists differ from head 0's in every tile row)."""
    if h == 0:
        return abs(i + 8 - j) <= 5
    return j < 8 or j >= 24


def _sparse_dense():
    """A 2-D mask with a key tile no row sees (keys 16..31), rows that see nothing (3, 17) and PARTIAL tiles."""
    rng = np.random.default_rng(11)
    dense = rng.random((N_Q, N_K)) < 0.4
    dense[:, 16:32] = False
    dense[[3, 17], :] = False
    return dense


MASKS = {
    "window": lambda: masks.sliding_window(6, 3),  # row intervals
    "dense": lambda: masks.from_dense(_sparse_dense()),  # dense bytes, dead rows, an empty key tile
    "per-head": lambda: masks.mask_mod(_per_head),  # a function that differs by query head
    "4d-dense": lambda: masks.from_dense(np.random.default_rng(5).random((B, H, N_Q, N_K)) < 0.5),
}


def _forward(sixteen, mask, order="v2", **kw):
    q, k, v = sixteen[:3]
    return fa_numba.attention(q, k, v, mask=mask, engine="mma", order=order, block_q=TILE, block_k=TILE,
                              return_lse=True, **kw)


def _cases(default):
    return [pytest.param(order, name, marks=() if (order, name) == default else SLOW, id=f"{order}-{name}")
            for order in ("v2", "v1") for name in MASKS]


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("order, name", _cases(("v2", "per-head")))
def test_the_tensor_core_forward_takes_every_mask_form_within_the_rule(order, name):
    sixteen, exact = _inputs(1)
    mask = MASKS[name]()
    out, lse = _forward(sixteen, mask, order)
    assert out.shape == (B, H, N_Q, D) and lse.shape == (B, H, N_Q)
    tolerance.check_attention(out, lse, *exact[:3], mask=mask, name=f"{order}-mma {name}", order=order,
                              block_q=TILE, block_k=TILE, p_dtype="float16")


@pytest.mark.lemma("L8")
@SLOW
@pytest.mark.parametrize("order", ["v2", "v1"])
def test_equal_masks_in_every_form_give_the_same_bits(order):
    """A sliding window as row intervals, as dense bytes and as a mask_mod: the same tiles, kinds and pairs, so
    the same bits; a dense bottom-right causal mask gives the causal closed form's bits."""
    sixteen, _ = _inputs(2)
    i, j = np.arange(N_Q)[:, None], np.arange(N_K)[None, :]
    band = (j <= i + N_K - N_Q) & (j > i + N_K - N_Q - 6)
    forms = [masks.sliding_window(5, 0), masks.from_dense(band),
             masks.mask_mod(lambda b, h, r, c: c <= r + 8 and c > r + 2)]
    first = _forward(sixteen, forms[0], order)
    for mask in forms[1:]:
        for got, want in zip(_forward(sixteen, mask, order), first):
            np.testing.assert_array_equal(got, want, err_msg=f"{mask!r} against {forms[0]!r}")
    causal = _forward(sixteen, masks.from_dense(j <= i + N_K - N_Q), order)
    q, k, v = sixteen[:3]
    closed = fa_numba.attention(q, k, v, causal=True, engine="mma", order=order, block_q=TILE, block_k=TILE,
                                return_lse=True)
    for got, want in zip(causal, closed):
        np.testing.assert_array_equal(got, want)


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("deterministic", [False, pytest.param(True, marks=SLOW)], ids=["atomic", "deterministic"])
def test_the_tensor_core_backward_with_a_mask_is_within_the_rule_and_reads_what_the_model_says(deterministic):
    """Dense bytes with dead rows and a key tile no row sees: the gradients within the rule (dK, dV of the unseen
    keys exactly 0) and every element read and written in HBM, counted in the simulator, equal to iomodel's
    K/V-outer order with the mask."""
    sixteen, exact = _inputs(3)
    mask = masks.from_dense(_sparse_dense())
    out, lse = reference.attention(*exact[:3], mask=mask)
    q, k, v, dout = sixteen
    dq, dk, dv, ledger = run_counted_backward(q, k, v, out.astype(np.float32), lse.astype(np.float32), dout,
                                              1 / np.sqrt(D), deterministic=deterministic, block=TILE, mask=mask,
                                              engine="mma", kind="float16", block_k=TILE)
    model = iomodel.traffic_backward("kv", N_Q, N_K, D, TILE, TILE, batch=B, heads=H, heads_kv=H_KV,
                                     deterministic=deterministic, mask=mask)
    assert ledger.reads == model.reads and ledger.writes == model.writes
    if not deterministic:  # K read once per key tile some row sees: not keys 16..31 (by hand)
        assert ledger.reads["K"] == (N_K - 16) * D * B * H_KV
    assert not (dk[:, :, 16:32].any() or dv[:, :, 16:32].any())
    tolerance_backward.check_attention_backward(dq, dk, dv, *exact, mask=mask, p_dtype="float16", name="counted")


@pytest.mark.lemma("L8")
@SLOW
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("name", ["window", "per-head", "4d-dense"])
def test_the_tensor_core_backward_takes_every_mask_form(name, deterministic):
    """Through fa_numba.attention_backward: the lists per query head under GQA (per-head, 4d-dense)."""
    sixteen, exact = _inputs(4)
    mask = MASKS[name]()
    out, lse = _forward(sixteen, mask)
    q, k, v, dout = sixteen
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=mask, engine="mma", block_q=TILE,
                                        block_k=TILE, deterministic=deterministic)
    tolerance_backward.check_attention_backward(*grads, *exact, mask=mask, p_dtype="float16", name=name)


@pytest.mark.lemma("L8")
@SLOW
def test_a_nan_behind_the_mask_stays_out_of_every_result():
    """K and V rows of a key the mask hides from every row, in a PARTIAL tile, set to NaN: the tensor core would
    multiply them by the masked pairs' 0 weights; the exact path keeps them out (forward, both orders, and
    the backward's gradients but dK, dV of that key, which the reference also gives as 0)."""
    sixteen, exact = _inputs(5)
    dense = np.ones((N_Q, N_K), bool)
    dense[:, 20] = False  # key 20, inside key tile 1, which stays PARTIAL
    mask = masks.from_dense(dense)
    for x16, x64 in ((sixteen[1], exact[1]), (sixteen[2], exact[2])):
        x16[..., 20, 3] = np.nan
        x64[..., 20, 3] = np.nan
    for order in ("v2", "v1"):
        out, lse = _forward(sixteen, mask, order)
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        tolerance.check_attention(out, lse, *exact[:3], mask=mask, order=order, block_q=TILE, block_k=TILE,
                                  p_dtype="float16", name=f"{order}-mma NaN hidden")
    q, k, v, dout = sixteen
    for deterministic in (False, True):
        grads = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=mask, engine="mma", block_q=TILE,
                                            block_k=TILE, deterministic=deterministic)
        tolerance_backward.check_attention_backward(*grads, *exact, mask=mask, p_dtype="float16", name="NaN hidden")
        assert all(np.isfinite(g).all() for g in grads)


def _table_pair(b, h, i, j, table):
    return table[b, h, i, j] != 0


@SLOW
def test_a_mask_mod_is_never_called_past_the_problem_on_tensor_cores():
    """A mask_mod indexing a captured (B, H, N_q, N_k) table: ragged tiles (29 x 37 over 16 x 16) would read past
    its end if fn were called at a pair outside the problem (the simulator raises IndexError)."""
    sixteen, exact = _inputs(6)
    table = (np.random.default_rng(6).random((B, H, N_Q, N_K)) < 0.7).astype(np.uint8)
    mm, dense = masks.mask_mod(_table_pair, table), masks.from_dense(table.astype(bool))
    out, lse = _forward(sixteen, mm)
    for got, want in zip((out, lse), _forward(sixteen, dense)):
        np.testing.assert_array_equal(got, want)
    q, k, v, dout = sixteen
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=mm, engine="mma", block_q=TILE, block_k=TILE)
    tolerance_backward.check_attention_backward(*grads, *exact, mask=dense, p_dtype="float16")
