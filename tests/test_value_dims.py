"""A value head dim of its own, d_v != d (MLA: d = 192, d_v = 128): the spec, the reference, the traffic model
and every kernel path (natively in the tile engine's and the 16-bit tensor-core forwards, by zero padding in the
others, fa_numba.value_dims), forward and backward, host and device, and the
PyTorch entry points, each against an expected value computed apart from the code under test."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import fa_numba
from bounds import assert_within, attention_bound, dense_counts, tiled_counts
from float64_bounds import backward_bounds
from fa_numba import iomodel, reference, shapes, tiled, tolerance, tolerance_backward
from fa_numba.kernels import cast

RNG = np.random.default_rng(20261203)
SHAPES = [(8, 5), (5, 12)]  # (d, d_v): V narrower than Q and K, and wider


def _inputs(d, d_v, dtype=np.float32, batch=2, heads=2, heads_kv=1, n_q=11, n_k=9):
    q = RNG.standard_normal((batch, heads, n_q, d)).astype(dtype)
    k = RNG.standard_normal((batch, heads_kv, n_k, d)).astype(dtype)
    v = RNG.standard_normal((batch, heads_kv, n_k, d_v)).astype(dtype)
    return q, k, v


def _dense64(q, k, v, causal):
    """softmax(Q K^T / sqrt(d)) V in float64 by einsum, written apart from fa_numba.reference (GQA repeated)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) / np.sqrt(q.shape[-1])
    n_q, n_k = s.shape[-2:]
    if causal:  # bottom-right: key j visible to query i iff j <= i + n_k - n_q
        s = np.where(np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhij,bhjx->bhix", np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0), v)
    lse = np.where(l[..., 0] > 0, (m + np.log(np.where(l > 0, l, 1.0)))[..., 0], -np.inf)
    return out, lse


def test_problem_takes_a_value_head_dim_only_where_asked():
    q, k, v = _inputs(8, 5)
    with pytest.raises(ValueError, match=r"v must have the same shape as k .*d_v != d"):
        shapes.problem(q, k, v)
    prob = shapes.problem(q, k, v, value_dim=True)
    assert (prob.d, prob.d_v) == (8, 5)
    assert shapes.problem(q, k, k).d_v == 8  # the default: d_v = d
    assert shapes.Problem(1, 1, 1, 2, 2, 4) == shapes.Problem(1, 1, 1, 2, 2, 4, 4)
    with pytest.raises(ValueError, match=r"v must have the shape of k .* but for its last axis"):
        shapes.problem(q, k, v[:, :, :5], value_dim=True)
    with pytest.raises(ValueError, match=r"v must have head dim d_v >= 1"):
        shapes.problem(q, k, v[..., :0], value_dim=True)


@pytest.mark.parametrize("d, d_v", SHAPES)
def test_reference_and_spec_against_einsum(d, d_v):
    q, k, v = _inputs(d, d_v, np.float64)
    want_out, want_lse = _dense64(q, k, v, causal=True)
    out, lse = reference.attention(q, k, v, causal=True)
    assert out.shape == q.shape[:-1] + (d_v,)
    # Float64 evaluations in other orders, each within its derived bound of the exact value (tests/bounds.py):
    # einsum's scores divide by sqrt(d) (d + 2 roundings a score), the reference's dense order, the tiled fold.
    einsum_out, einsum_lse = attention_bound(q, k, v, causal=True, counts=dense_counts(9), score_ops=d + 2)
    dense_out, dense_lse = attention_bound(q, k, v, causal=True, counts=dense_counts(9))
    tiled_out, tiled_lse = attention_bound(q, k, v, causal=True, counts=tiled_counts(9, 3))
    assert_within(out, want_out, dense_out + einsum_out, name="out")
    assert_within(lse, want_lse, dense_lse + einsum_lse, name="lse")
    for order in ("v1", "v2"):
        t_out, t_lse, ledger = tiled.attention(q, k, v, order=order, block_q=4, block_k=3, causal=True)
        assert_within(t_out, want_out, tiled_out + einsum_out, name=f"{order} out")
        assert_within(t_lse, want_lse, tiled_lse + einsum_lse, name=f"{order} lse")
        model = iomodel.traffic(order, 11, 9, d, 4, 3, causal=True, batch=2, heads=2, heads_kv=1, d_v=d_v)
        assert (ledger.reads, ledger.writes) == (model.reads, model.writes)


def test_traffic_counts_value_columns_with_d_v():
    """Known answers, non-causal v2 and v1 (N_q = 8, N_k = 6, tiles 4 x 3: T_r = 2, T_c = 2), per head."""
    def moved(counts):
        return {name: n for name, n in counts.items() if n}

    v2 = iomodel.traffic("v2", 8, 6, 16, 4, 3, d_v=10)
    assert moved(v2.reads) == {"Q": 8 * 16, "K": 2 * 6 * 16, "V": 2 * 6 * 10}
    assert moved(v2.writes) == {"O": 8 * 10, "LSE": 8}
    v1 = iomodel.traffic("v1", 8, 6, 16, 4, 3, d_v=10)
    assert (v1.reads["Q"], v1.reads["K"], v1.reads["V"], v1.reads["O"]) == (2 * 8 * 16, 6 * 16, 6 * 10, 2 * 8 * 10)
    assert v1.writes["O"] == (8 + 2 * 8) * 10
    back = iomodel.traffic_backward("kv", 8, 6, 16, 4, 3, d_v=10)
    assert (back.reads["O"], back.reads["dO"]) == (8 * 10, 8 * 10 + 2 * 8 * 10)
    assert (back.writes["dK"], back.writes["dV"], back.writes["dQ"]) == (6 * 16, 6 * 10, (8 + 2 * 8) * 16)
    assert iomodel.traffic("v2", 8, 6, 16, 4, 3, d_v=16).reads == iomodel.traffic("v2", 8, 6, 16, 4, 3).reads


@pytest.mark.parametrize("d, d_v", SHAPES)
def test_reference_backward_against_torch_autograd(d, d_v):
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(d, d_v, np.float64, heads_kv=2)
    dout = RNG.standard_normal(q.shape[:-1] + (d_v,))
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=False)
    out.backward(torch.tensor(dout))
    dq, dk, dv = reference.attention_backward(q, k, v, dout)
    # Two float64 evaluations (ours, torch's autograd; the tiled spec from our O and LSE): each within
    # backward_bounds of the exact gradients (tests/float64_bounds.py).
    bounds = [2 * b for b in backward_bounds(q, k, v, dout)[:3]]
    for got, want, bound in zip((dq, dk, dv), (tq, tk, tv), bounds):
        assert_within(got, want.grad.numpy(), bound, name="torch")
    for order, det in (("kv", False), ("kv", True), ("q", False)):
        o, lse = reference.attention(q, k, v)
        t = tiled.attention_backward(q, k, v, o, lse, dout, order=order, block_q=4, block_k=3, deterministic=det)
        for got, want, bound in zip(t[:3], (dq, dk, dv), bounds):
            assert_within(got, want, bound, name=f"tiled {order}")
        model = iomodel.traffic_backward(order, 11, 9, d, 4, 3, batch=2, heads=2, heads_kv=2, deterministic=det,
                                         d_v=d_v)
        assert (t[3].reads, t[3].writes) == (model.reads, model.writes)


@pytest.mark.parametrize("d, d_v", SHAPES)
@pytest.mark.parametrize("order", ["v1", "v2"])
def test_attention_simt_within_the_rule(d, d_v, order):
    q, k, v = _inputs(d, d_v)
    out, lse = fa_numba.attention(q, k, v, causal=True, order=order, return_lse=True, block_q=8, block_k=8)
    assert out.shape == (2, 2, 11, d_v) and lse.shape == (2, 2, 11)
    tolerance.check_attention(out, lse, q, k, v, causal=True, order=order, block_q=8, block_k=8)


def _padded(x, width):
    return np.concatenate([x, np.zeros(x.shape[:-1] + (width - x.shape[-1],), x.dtype)], axis=-1)


NATIVE = [(order, d, d_v) for order in ("v2", "v1") for d, d_v in SHAPES + [(40, 16)]]


@pytest.mark.parametrize("order, d, d_v", [case if case in (("v2", 8, 5), ("v1", 5, 12))
                                           else pytest.param(*case, marks=pytest.mark.slow)  # 9 s each
                                           for case in NATIVE])
def test_the_tensor_cores_take_d_v_natively_and_match_the_padded_call_bitwise(order, d, d_v):
    """The 16-bit tensor-core kernels stage V_j and accumulate O at d_v: the bits of the same kernel on inputs the
    test pads itself (each O column is its own sum over the same P), within the rule; causal, GQA, and an inf in
    a value row a PARTIAL tile holds (the exact CUDA-core P V path, at d_v too)."""
    q, k, v = (x.astype(np.float16) for x in _inputs(d, d_v, n_q=19, n_k=21))
    v[0, 0, 20, 1] = np.inf  # the last key: only the last query row sees it (causal, N_q < N_k by 2)
    width = max(d, d_v)
    out, lse = fa_numba.attention(q, k, v, causal=True, order=order, engine="mma", return_lse=True, block_q=16,
                                  block_k=16)
    want, want_lse = fa_numba.attention(_padded(q, width), _padded(k, width), _padded(v, width), causal=True,
                                        order=order, engine="mma", return_lse=True, block_q=16, block_k=16,
                                        scale=1 / np.sqrt(d))
    assert out.shape == (2, 2, 19, d_v)
    np.testing.assert_array_equal(out, want[..., :d_v])
    np.testing.assert_array_equal(lse, want_lse)
    assert out[0, 0, 18, 1] == np.inf and np.isfinite(np.delete(out[0, 0, 18], 1)).all()  # p inf / l
    assert np.isfinite(out[0, 0, :18]).all()
    tolerance.check_attention(out, lse, q, k, v, causal=True, p_dtype="float16", contractions=("matmul",))


def test_the_tensor_core_v2_moves_v_and_o_at_d_v():
    """Counted in the simulator: V read and O written with d_v columns, Q and K with d (iomodel's d_v)."""
    from fa_numba.kernels.counting import run_counted
    from fa_numba.kernels.mma.engine_v2 import make_v2_mma

    q, k, v = (x.astype(np.float16).view(np.uint16) for x in _inputs(24, 8, batch=1, heads=1, n_q=20, n_k=37))
    kernel = make_v2_mma("float16", 1, 16, 24, False, value_dim=8)
    out, lse, ledger = run_counted(lambda *args, workspace=None, mask=None: kernel(*args, mask=mask), q, k, v, 0.2)
    assert ledger == iomodel.traffic("v2", 20, 37, 24, 16, 16, d_v=8)
    assert out.shape == (1, 1, 20, 8) and np.isfinite(out).all()


@pytest.mark.parametrize("order, d, d_v", [("v2", 8, 5), ("v1", 5, 12), pytest.param("v2", 5, 12, marks=pytest.mark.slow),
                                           pytest.param("v1", 8, 5, marks=pytest.mark.slow)])  # ~2 s each
def test_the_tile_engine_moves_v_and_o_at_d_v(order, d, d_v):
    """The CUDA-core engine kernels (v1, v2) take d_v natively (Layout.value_dim: tiles staged max(d, d_v) wide,
    each operand zero past its own width): counted in the simulator, V read and O moved with d_v columns, Q and
    K with d (iomodel's d_v; the padded path would move max(d, d_v) of each), and the bits of the same kernel
    order on inputs the test pads itself."""
    from fa_numba.kernels import VARIANTS
    from fa_numba.kernels.counting import run_counted

    q, k, v = _inputs(d, d_v, batch=1, heads=2, heads_kv=1, n_q=11, n_k=13)
    kernel = VARIANTS[order].make(8, 8, d, True, value_dim=d_v)
    assert kernel.config.d_v == d_v and kernel.config.layout.d_pad >= max(d, d_v)
    out, lse, ledger = run_counted(kernel, q, k, v, 1 / np.sqrt(d))
    model = iomodel.traffic(order, 11, 13, d, 8, 8, causal=True, heads=2, heads_kv=1, d_v=d_v)
    assert (ledger.reads, ledger.writes) == (model.reads, model.writes)
    width = max(d, d_v)
    want, want_lse = fa_numba.attention(_padded(q, width), _padded(k, width), _padded(v, width), causal=True,
                                        order=order, return_lse=True, block_q=8, block_k=8, scale=1 / np.sqrt(d))
    np.testing.assert_array_equal(out, want[..., :d_v])
    np.testing.assert_array_equal(lse, want_lse)
    got = fa_numba.attention(q, k, v, causal=True, order=order, block_q=8, block_k=8)  # the api takes it too
    np.testing.assert_array_equal(got, out)


@pytest.mark.parametrize("order, deterministic", [("kv", False), ("q", False),
                                                  pytest.param("kv", True, marks=pytest.mark.slow)])  # ~3 s each
@pytest.mark.parametrize("d, d_v", [(8, 5), pytest.param(5, 12, marks=pytest.mark.slow)])
def test_the_cuda_core_backward_moves_v_do_and_dv_at_d_v(order, deterministic, d, d_v):
    """The CUDA-core backward kernels take d_v natively (BackwardConfig.value_dim: Q, dO, K, V staged max(d, d_v)
    wide, each zero past its own width): counted in the simulator, V, O, dO and dV move d_v columns and Q, K, dQ,
    dK d (iomodel.traffic_backward's d_v; the padded path would move max(d, d_v) of each), and the gradients
    are the bits of the same kernels on operands the test pads itself."""
    from fa_numba.kernels.counting import run_counted_backward

    q, k, v = _inputs(d, d_v, batch=1, heads=2, heads_kv=1, n_q=11, n_k=13)
    scale = 1 / np.sqrt(d)
    out, lse = fa_numba.attention(q, k, v, causal=True, return_lse=True, block_q=8, block_k=8)
    dout = RNG.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv, ledger = run_counted_backward(q, k, v, out, lse, dout, scale, causal=True, order=order,
                                              deterministic=deterministic, block=8)
    model = iomodel.traffic_backward(order, 11, 13, d, 8, 8, causal=True, heads=2, heads_kv=1,
                                     deterministic=deterministic, d_v=d_v)
    assert (ledger.reads, ledger.writes) == (model.reads, model.writes)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    width = max(d, d_v)
    # the simulator runs blocks one after another, so even the atomic adds land in a fixed order: bitwise
    want = fa_numba.attention_backward(_padded(q, width), _padded(k, width), _padded(v, width), _padded(out, width),
                                       lse, _padded(dout, width), scale=scale, causal=True, order=order,
                                       deterministic=deterministic, block_q=8)
    for got, w, cut in zip((dq, dk, dv), want, (d, d, d_v)):
        np.testing.assert_array_equal(got, w[..., :cut])


@pytest.mark.parametrize("deterministic", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("d, d_v, heads", [(8, 5, 1), pytest.param(5, 12, 2, marks=pytest.mark.slow),  # ~5 s each
                                           pytest.param(24, 16, 2, marks=pytest.mark.slow)])  # 2: GQA's sums of dK, dV
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf in the simulator's NumPy
def test_the_tensor_core_backward_moves_v_do_and_dv_at_d_v(deterministic, d, d_v, heads):
    """The tensor-core backward takes d_v natively (MmaBackwardConfig.value_dim: V_j and dO_i staged d_v wide, dP
    summed over d_v's k-steps, dV accumulated d_v wide): counted in the simulator (cp.async copies included), V,
    O, dO and dV move d_v columns and Q, K, dQ, dK d (iomodel.traffic_backward's d_v), and the gradients are the
    bits of the same kernels on operands the test pads itself (a padded k-step adds 0 x 0 products, a padded
    column of dV is a sum of its own), an inf in a value row a causal PARTIAL tile holds (the exact paths, at
    d_v too) included."""
    from fa_numba.kernels.counting import run_counted_backward

    q, k, v = (x.astype(np.float16) for x in _inputs(d, d_v, batch=1, heads=heads, heads_kv=1, n_q=19, n_k=21))
    v[0, 0, 20, 1] = np.inf  # the last key: only the last query row sees it (causal, N_q < N_k by 2)
    scale = 1 / np.sqrt(d)
    tiles = dict(block_q=16, block_k=16)  # one warp a block
    out, lse = fa_numba.attention(q, k, v, causal=True, return_lse=True, engine="mma", **tiles)
    dout = RNG.standard_normal(out.shape).astype(np.float16)
    dq, dk, dv, ledger = run_counted_backward(q, k, v, out, lse, dout, scale, causal=True,
                                              deterministic=deterministic, block=16, engine="mma", kind="float16",
                                              block_k=16)
    model = iomodel.traffic_backward("kv", 19, 21, d, 16, 16, causal=True, heads=heads, heads_kv=1,
                                     deterministic=deterministic, d_v=d_v)
    assert (ledger.reads, ledger.writes) == (model.reads, model.writes)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    width = max(d, d_v)
    # the simulator runs blocks one after another, so even the atomic adds land in a fixed order: bitwise
    want = fa_numba.attention_backward(_padded(q, width), _padded(k, width), _padded(v, width), _padded(out, width),
                                       lse, _padded(dout, width), scale=scale, causal=True, engine="mma",
                                       deterministic=deterministic, **tiles)
    for got, w, cut in zip((dq, dk, dv), want, (d, d, d_v)):
        np.testing.assert_array_equal(got, w[..., :cut])
    assert np.isnan(dq[0, 0, 18]).any() and np.isfinite(dq[0, :, :18]).all()  # the inf reaches row 18 alone


def test_a_kernel_built_for_one_value_dim_refuses_another():
    from fa_numba.kernels import VARIANTS

    kernel = VARIANTS["v2"].make(8, 8, 8, False, value_dim=5)
    q, k, v = _inputs(8, 12, batch=1, heads=1)
    o = cuda.device_array((1, 1, 11, 12), np.float32)
    with pytest.raises(ValueError, match="v and o must have head dim d_v = 5 for this kernel, got 12 and 12"):
        kernel(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), o, cuda.device_array((1, 1, 11), np.float32),
               0.3)
    with pytest.raises(ValueError, match="taken natively by the tile engine's kernels only"):
        VARIANTS["v2-rowwise"].config(8, 8, 8, False, value_dim=5)


def test_a_value_head_dim_the_tensor_cores_cannot_take_is_named():
    from fa_numba.kernels.mma.engine import MmaConfig

    assert MmaConfig("float16", 4, 16, 192, False, value_dim=128).check().shared_bytes < \
        MmaConfig("float16", 4, 16, 192, False).shared_bytes  # V_j staged at 128 columns, not 192
    with pytest.raises(ValueError, match=r"d_v = 128 != d = 64\) is taken by the 16-bit tensor-core kernels"):
        MmaConfig("float32", 4, 16, 64, False, value_dim=128).check()
    with pytest.raises(ValueError, match=r"value head dim d_v must be in 1..192 .* got 200"):
        MmaConfig("float16", 4, 16, 64, False, value_dim=200).check()
    with pytest.raises(ValueError, match=r"async_copy needs the value head dim d_v to be a multiple of 8"):
        MmaConfig("float16", 4, 16, 64, False, async_copy=True, value_dim=20).check()


@pytest.mark.parametrize("d, d_v", SHAPES)
def test_padding_is_exact_against_an_explicitly_padded_call(d, d_v):
    """The call with d_v != d gives exactly the values of the same kernel on inputs the test pads itself."""
    q, k, v = _inputs(d, d_v)
    width = max(d, d_v)

    def pad(x):
        return np.concatenate([x, np.zeros(x.shape[:-1] + (width - x.shape[-1],), x.dtype)], axis=-1)

    out, lse = fa_numba.attention(q, k, v, return_lse=True, block_q=8, block_k=8)
    scale = 1 / np.sqrt(d)  # q's head dim: the padded call's default would read the padded one
    p_out, p_lse = fa_numba.attention(pad(q), pad(k), pad(v), scale=scale, return_lse=True, block_q=8, block_k=8)
    np.testing.assert_array_equal(out, p_out[..., :d_v])
    np.testing.assert_array_equal(lse, p_lse)
    dout = RNG.standard_normal(out.shape).astype(np.float32)
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, block_q=8, deterministic=True)
    p_grads = fa_numba.attention_backward(pad(q), pad(k), pad(v), p_out, p_lse, pad(dout), scale=scale, block_q=8,
                                          deterministic=True)
    for got, want, width_ in zip(grads, p_grads, (d, d, d_v)):
        np.testing.assert_array_equal(got, want[..., :width_])
        assert not np.any(want[..., width_:])  # the cut columns are zeros: nothing of value was dropped


@pytest.mark.parametrize("d, d_v", [SHAPES[0], pytest.param(*SHAPES[1], marks=pytest.mark.slow)])  # 10 s each
def test_backward_simt_and_mma_within_the_rule(d, d_v):
    q, k, v = _inputs(d, d_v)
    out, lse = fa_numba.attention(q, k, v, causal=True, return_lse=True, block_q=8, block_k=8)
    dout = RNG.standard_normal(out.shape).astype(np.float32)
    for order, det in (("kv", False), ("kv", True), ("q", False)):
        grads = fa_numba.attention_backward(q, k, v, out, lse, dout, causal=True, order=order, deterministic=det,
                                            block_q=8)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        tolerance_backward.check_attention_backward(*grads, q, k, v, dout, causal=True)
    h = [x.astype(np.float16) for x in (q, k, v, dout)]
    tiles = dict(block_q=16, block_k=16)  # one warp a block: the simulator runs every lane as a thread
    out16, lse16 = fa_numba.attention(*h[:3], causal=True, return_lse=True, engine="mma", **tiles)
    grads = fa_numba.attention_backward(*h[:3], out16, lse16, h[3], causal=True, engine="mma", **tiles)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    tolerance_backward.check_attention_backward(*grads, *h, causal=True, p_dtype="float16",
                                                contractions=("matmul",))


def test_device_arrays_strided_and_empty():
    """Numba device arrays (the device copy kernels, cast.resized_copy), a strided 4-D view among them."""
    q, k, v = _inputs(6, 10, heads_kv=2, n_q=7, n_k=5)
    want, want_lse = fa_numba.attention(q, k, v, return_lse=True, block_q=8, block_k=8)
    k_strided = cuda.to_device(np.ascontiguousarray(k.transpose(0, 2, 1, 3))).transpose((0, 2, 1, 3))
    assert not k_strided.is_c_contiguous()  # (B, N, H, d) memory read as (B, H, N, d): widened from a view
    out, lse = fa_numba.attention(cuda.to_device(q), k_strided, cuda.to_device(v), return_lse=True, block_q=8,
                                  block_k=8)
    np.testing.assert_array_equal(out.copy_to_host(), want)
    np.testing.assert_array_equal(lse.copy_to_host(), want_lse)
    empty = fa_numba.attention(q, k[:, :, :0], v[:, :, :0])
    assert empty.shape == (2, 2, 7, 10) and not np.any(empty)
    grads = fa_numba.attention_backward(q[:, :, :0], k, v, want[:, :, :0], want_lse[:, :, :0], want[:, :, :0])
    assert [g.shape for g in grads] == [(2, 2, 0, 6), k.shape, v.shape]


def test_resized_copy_pads_and_cuts_bits_as_they_are():
    x = np.array([1.5, -0.0, np.nan, np.inf, -2.0, 3.0], dtype=np.float32).reshape(1, 1, 2, 3)
    x.view(np.uint32)[0, 0, 0, 2] = 0x7FC00123  # a NaN payload the copy must keep
    wide = cuda.device_array((1, 1, 2, 5), dtype=np.float32)
    cast.resized_copy(cuda.to_device(x), wide)
    got = wide.copy_to_host()
    np.testing.assert_array_equal(got.view(np.uint32)[..., :3], x.view(np.uint32))
    np.testing.assert_array_equal(got.view(np.uint32)[..., 3:], 0)
    narrow = cuda.device_array((1, 1, 2, 2), dtype=np.float16)
    cast.resized_copy(cuda.to_device(x.astype(np.float16)), narrow)
    np.testing.assert_array_equal(narrow.copy_to_host().view(np.uint16), x.astype(np.float16).view(np.uint16)[..., :2])
    with pytest.raises(ValueError, match="src and dst must share their first three axes and dtype"):
        cast.resized_copy(cuda.to_device(x), cuda.device_array((1, 1, 2, 5), dtype=np.float64))


def test_torch_sdpa_drop_in_autograd_and_compile():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 3, 10, 6, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 10, 4, generator=gen, requires_grad=True)
    out = fa_numba.sdpa(q, k, v, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), is_causal=True)
    assert out.shape == (2, 3, 10, 4) and out.dtype == torch.float32
    assert float((out - want).detach().abs().max()) < 1e-5
    ours = torch.autograd.grad(out.sum(), (q, k, v))
    theirs = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and float((a - b).abs().max()) < 1e-5
    half = fa_numba.autograd.attention(q.detach().half(), k.detach().half(), v.detach().half())
    assert half.dtype == torch.float16 and half.shape == (2, 3, 10, 4)
    fa = fa_numba.flash_attn_func(*(x.detach().transpose(1, 2) for x in (q, k, v)), causal=True)
    assert fa.shape == (2, 10, 3, 4)
    compiled = torch.compile(lambda a, b, c: fa_numba.autograd.attention(a, b, c, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), fa_numba.autograd.attention(q, k, v, causal=True))


@pytest.mark.slow  # two sm_90a compilations, about 30 s each
def test_mla_on_tensor_cores_compiles_narrower_than_its_padded_build():
    """MLA's forward (d = 192, d_v = 128) on the tensor-core v2 at 64 x 16 tiles, sm_90a: no spills, no local
    memory in the tile loop, fewer registers and less shared memory than the same kernel with V padded to 192
    (its O accumulator holds 128 columns, not 192). Run with the real numba.cuda, in a process of its own."""
    import json
    import os
    import subprocess
    import sys

    from fa_numba import profile

    if profile.nvdisasm_path() is None:
        pytest.skip("SASS needs nvdisasm (the profile extra)")
    code = (
        "import json\n"
        "from fa_numba import profile, sass\n"
        "from fa_numba.kernels.mma.engine import MmaConfig\n"
        "from fa_numba.kernels.mma.engine_v2 import MmaV2Kernel, kernel_source\n"
        "rows = []\n"
        "for value_dim in (128, 0):\n"
        "    built = MmaV2Kernel(MmaConfig('float16', 4, 16, 192, False, True, None, 'none', value_dim), kernel_source)\n"
        "    p = profile.profile_kernel(built.source, built.argtypes(), 128, name='v2-mma')\n"
        "    tile = min((n for n in sass.loop_tree(p.sass) if any(i.opcode.startswith('HMMA') for i in n.instructions)),\n"
        "               key=lambda n: len(n.instructions))\n"
        "    local = sum(1 for i in tile.instructions if i.opcode.startswith(('LDL', 'STL')))\n"
        "    rows.append([p.registers, p.spill_stores + p.spill_loads, local, p.smem])\n"
        "print(json.dumps(rows))\n")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    (regs, spills, local, smem), (padded_regs, _, _, padded_smem) = json.loads(run.stdout.strip().splitlines()[-1])
    assert spills == 0 and local == 0, (regs, spills, local)
    assert regs <= padded_regs and smem < padded_smem, (regs, padded_regs, smem, padded_smem)
