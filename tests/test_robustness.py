"""What a fuzzer and a new user found (issue 20): stale mask caches, unchecked backward inputs, scales and
mask parameters that overflow, np.matrix inputs, a negative scale's tolerance, bfloat16's backward dtypes,
V beyond the accumulator's range, launches from several threads, and simulator launches that cannot finish.

Each test here failed before its fix.
"""

import threading

import numpy as np
import pytest

import fa_numba
from fa_numba import backend, masks, reference, tolerance, tolerance_backward
from strategies import Case

SMALL = dict(block_q=8, block_k=8)


def _within(check) -> bool:
    """check_attention_backward raises outside the 3x rule; its returned errors say the verdict again."""
    return all(getattr(check, f"err_{g}") <= getattr(check, f"atol_{g}") for g in ("dq", "dk", "dv"))


def _case(n=16, d=4, seed=3):
    case = Case(n_q=n, n_k=n, d=d, block_q=8, block_k=8, causal=False, seed=seed)
    q, k, v = case.inputs(np.float32)
    return case, q, k, v


# -- 1. a from_function mask means what its predicate says at the call ------------------------------------

def _document_ids(*lengths):
    return np.repeat(np.arange(len(lengths)), lengths)


def test_a_predicate_reading_changed_state_is_evaluated_again():
    """The document-id idiom: the predicate reads `ids`, which the caller changes between calls. Before the
    fix the second call was served the first call's tile lists (error 0.83)."""
    _, q, k, v = _case()
    ids = _document_ids(8, 8)
    fn = lambda i, j: ids[i] == ids[j]  # noqa: E731 (the idiom as users write it)
    for lengths in ((8, 8), (4, 12), (16,), (3, 5, 8)):
        ids[:] = _document_ids(*lengths)
        for mask in (masks.from_function(fn), masks.from_function(fn)):  # the same fn, a new mask object
            out, lse = fa_numba.attention(q, k, v, mask=mask, return_lse=True, **SMALL)
            expected = masks.documents(list(lengths))
            tolerance.check_attention(out, lse, q, k, v, mask=expected, order="v2", **SMALL)


def test_the_backward_sees_the_predicate_at_its_own_call():
    case, q, k, v = _case()
    dout = case.grad_output(np.float32)
    ids = _document_ids(8, 8)
    mask = masks.from_function(lambda i, j: ids[i] == ids[j])
    for lengths in ((8, 8), (5, 11)):
        ids[:] = _document_ids(*lengths)
        expected = masks.documents(list(lengths))
        out, lse = fa_numba.attention(q, k, v, mask=mask, return_lse=True, **SMALL)
        dq, dk, dv = fa_numba.attention_backward(q, k, v, out, lse, dout, mask=mask, block_q=8)
        check = tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, mask=expected)
        assert _within(check), check


def test_autograd_differentiates_the_mask_its_forward_used():
    """State changed between forward and backward: the backward uses the mask as the forward evaluated it."""
    torch = pytest.importorskip("torch", reason="fa_numba.autograd needs the torch extra")
    import fa_numba.autograd

    case, q, k, v = _case()
    dout = case.grad_output(np.float32)
    ids = _document_ids(4, 12)
    mask = masks.from_function(lambda i, j: ids[i] == ids[j])
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    out = fa_numba.autograd.attention(tq, tk, tv, mask=mask)
    ids[:] = _document_ids(16)  # after the forward, before the backward
    out.backward(torch.from_numpy(dout))
    check = tolerance_backward.check_attention_backward(tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy(), q, k, v,
                                                        dout, mask=masks.documents([4, 12]))
    assert _within(check), check


def test_the_kernel_mask_cache_never_serves_a_predicate_s_old_lists():
    from fa_numba.kernels.block_lists import kernel_mask

    ids = _document_ids(8, 8)
    mask = masks.from_function(lambda i, j: ids[i] == ids[j])
    for lengths in ((8, 8), (16,), (8, 8)):
        ids[:] = _document_ids(*lengths)
        got, expected = kernel_mask(mask, 16, 16, 4, 4), kernel_mask(masks.from_dense(
            masks.documents(list(lengths)).dense(16, 16)), 16, 16, 4, 4)
        for name in ("row_ptr", "col_idx", "col_kind", "col_ptr", "row_idx", "row_kind", "lohi", "dense"):
            np.testing.assert_array_equal(getattr(got, name).copy_to_host(), getattr(expected, name).copy_to_host())


def test_fixed_keeps_value_masks_and_evaluates_predicates():
    window = masks.sliding_window(2, 0)
    assert masks.fixed(window, 8, 8) is window
    ids = _document_ids(2, 6)
    fixed = masks.fixed(masks.from_function(lambda i, j: ids[i] == ids[j]), 8, 8)
    np.testing.assert_array_equal(fixed.dense(8, 8), masks.documents([2, 6]).dense(8, 8))
    ids[:] = 0  # the fixed mask does not follow the state any more
    np.testing.assert_array_equal(fixed.dense(8, 8), masks.documents([2, 6]).dense(8, 8))


# -- 3, 6. the backward's out, lse and dout are checked like q, k, v ---------------------------------------

def _forward(case, q, k, v):
    out, lse = fa_numba.attention(q, k, v, return_lse=True, **SMALL)
    return out, lse, case.grad_output(np.float32)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.float64, np.complex64])
def test_backward_refuses_out_and_dout_of_other_dtypes(dtype):
    case, q, k, v = _case()
    out, lse, dout = _forward(case, q, k, v)
    with pytest.raises(TypeError, match=r"^out must have dtype"):
        fa_numba.attention_backward(q, k, v, out.astype(dtype), lse, dout, block_q=8)
    with pytest.raises(TypeError, match=r"^dout must have"):
        fa_numba.attention_backward(q, k, v, out, lse, dout.astype(dtype), block_q=8)
    with pytest.raises(TypeError, match=r"^lse must have dtype float32"):
        fa_numba.attention_backward(q, k, v, out, lse.astype(dtype), dout, block_q=8)


ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 NumPy arrays need ml_dtypes (the test extra)")
BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("dout_dtype", [np.float32, BF16])
def test_bfloat16_backward_takes_the_documented_dtypes(dout_dtype):
    """out in float32 or q's dtype, dout in q's dtype or float32: as float16 does. A bfloat16 out is read
    exactly (widened), so it gives the gradients of its float32 value, bit for bit."""
    case = Case(n_q=12, n_k=12, d=4, block_q=8, block_k=8, causal=True, seed=5)
    q, k, v = (x.astype(BF16) for x in case.inputs(np.float32))
    exact = tuple(x.astype(np.float32) for x in (q, k, v))
    out, lse = fa_numba.attention(q, k, v, causal=True, return_lse=True, **SMALL)
    dout = case.grad_output(np.float32).astype(BF16).astype(dout_dtype)
    grads = fa_numba.attention_backward(q, k, v, out, lse, dout, causal=True, block_q=8)
    check = tolerance_backward.check_attention_backward(*grads, *exact, dout.astype(np.float32), causal=True)
    assert _within(check), check
    rounded = out.astype(BF16)
    from_bf16 = fa_numba.attention_backward(q, k, v, rounded, lse, dout, causal=True, block_q=8)
    from_f32 = fa_numba.attention_backward(q, k, v, rounded.astype(np.float32), lse, dout, causal=True, block_q=8)
    for a, b in zip(from_bf16, from_f32):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_backward_refuses_a_third_dtype():
    case = Case(n_q=8, n_k=8, d=4, block_q=8, block_k=8, causal=False, seed=6)
    q, k, v = (x.astype(BF16) for x in case.inputs(np.float32))
    out, lse = fa_numba.attention(q, k, v, return_lse=True, **SMALL)
    with pytest.raises(TypeError, match=r"^dout must have q's dtype bfloat16 or float32, got float16"):
        fa_numba.attention_backward(q, k, v, out, lse, case.grad_output(np.float16), block_q=8)


# -- 4. scales and mask parameters that overflow, np.matrix ------------------------------------------------

@pytest.mark.parametrize("scale", [1e39, -1e39, 10**400, float("inf")])
def test_a_scale_that_is_not_finite_in_float32_is_refused(scale):
    _, q, k, v = _case()
    with pytest.raises(ValueError, match=r"^scale must be finite in float32"):
        fa_numba.attention(q, k, v, scale=scale, **SMALL)


@pytest.mark.parametrize("make, name", [
    (lambda: masks.sliding_window(2**63, 0), "left"),
    (lambda: masks.sliding_window(0, 2**31), "right"),
    (lambda: masks.prefix_lm(2**70), "prefix"),
    (lambda: masks.documents([2**31]), "lengths"),
    (lambda: masks.documents([2**30, 2**30]), "lengths"),
])
def test_mask_parameters_beyond_int32_are_refused_at_construction(make, name):
    with pytest.raises(ValueError, match=rf"^{name}.*2147483647"):
        make()


def test_mask_parameters_up_to_int32_still_work():
    _, q, k, v = _case()
    wide = masks.sliding_window(2**31 - 1, 0)  # as good as unbounded on the left: causal's answer
    out = fa_numba.attention(q, k, v, mask=wide, **SMALL)
    np.testing.assert_array_equal(out, fa_numba.attention(q, k, v, causal=True, **SMALL))
    assert masks.prefix_lm(2**31 - 1).row_intervals(4, 4)[1].tolist() == [4, 4, 4, 4]


def test_np_matrix_inputs_are_refused_by_name():
    _, q, k, v = _case()
    with pytest.raises(TypeError, match=r"^q must be a NumPy ndarray, not np.matrix"):
        fa_numba.attention(np.asmatrix(q[0, 0]), k[0, 0], v[0, 0], **SMALL)
    with pytest.raises(TypeError, match=r"^v must be a NumPy ndarray, not np.matrix"):
        fa_numba.attention(q[0, 0], k[0, 0], np.asmatrix(v[0, 0]), **SMALL)


# -- 5. a negative scale's tolerance -----------------------------------------------------------------------

@pytest.mark.parametrize("n_k", [1, 16])
def test_exact_gradients_pass_with_a_negative_scale(n_k):
    """The rule's floors are magnitudes: they scale with |scale|. With one key (dP - D cancels exactly, so
    the naive error is 0 and the floor is all the tolerance) a negative floor failed exact gradients."""
    case = Case(n_q=16, n_k=n_k, d=4, block_q=8, block_k=8, causal=False, seed=3)
    q, k, v = case.inputs(np.float32)
    dout = case.grad_output(np.float32)
    exact = reference.attention_backward(q, k, v, dout, scale=-0.7)
    check = tolerance_backward.check_attention_backward(*(g.astype(np.float32) for g in exact), q, k, v, dout,
                                                        scale=-0.7)
    assert _within(check) and min(check.atol_dq, check.atol_dk, check.atol_dv) >= 0, check
    out, lse = fa_numba.attention(q, k, v, scale=-0.7, return_lse=True, **SMALL)
    dq, dk, dv = fa_numba.attention_backward(q, k, v, out, lse, dout, scale=-0.7, block_q=8)
    assert _within(tolerance_backward.check_attention_backward(dq, dk, dv, q, k, v, dout, scale=-0.7))


# -- 7. V beyond the accumulator's range -------------------------------------------------------------------

def test_values_whose_weighted_sum_can_overflow_are_refused():
    """acc = sum_j p_j v_j reaches (visible keys) x max|v| before the division by l: with |v| = 3e38 that is
    inf in float32 where the exact answer is 3e38. The range is stated and such inputs refused."""
    _, q, k, v = _case()
    with pytest.raises(ValueError, match=r"^v must satisfy N_k \* max\|v\| <= 3.4028235e\+38"):
        fa_numba.attention(q, k, np.full_like(v, 3e38), **SMALL)
    limit = np.float32(np.finfo(np.float32).max / 16)  # N_k = 16: the largest |v| the range allows
    out = fa_numba.attention(q, k, np.full_like(v, limit), **SMALL)
    assert np.isfinite(out).all()


# -- 8. several threads at once in the simulator -----------------------------------------------------------

def test_concurrent_callers_get_correct_results():
    _, q, k, v = _case(n=8)
    results, errors = {}, []

    def call(index):
        try:
            results[index] = fa_numba.attention(q * (index + 1), k, v, return_lse=True, **SMALL)
        except Exception as error:  # collected and reported below, so the thread does not die silently
            errors.append(error)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index, (out, lse) in results.items():
        tolerance.check_attention(out, lse, q * (index + 1), k, v, order="v2", **SMALL)
    assert len(results) == 4


# -- 9. a simulator launch that cannot finish is refused ---------------------------------------------------

@pytest.mark.skipif(backend.name() != "simulator", reason="the refusal is the simulator's (a GPU runs the shape)")
def test_a_launch_the_simulator_cannot_finish_is_refused():
    q = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (1, 1, 10**6, 64), (0, 0, 0, 0))
    with pytest.raises(ValueError, match=r"too large for the CUDA simulator.*feasible here: N_q = N_k <= \d+"):
        fa_numba.attention(q, q, q)
    with pytest.raises(ValueError, match=r"too large for the CUDA simulator"):
        fa_numba.attention_backward(q, q, q, q, q[..., 0], q)


# -- 10. a launch past CUDA's grid or the int32 positions is refused, naming the sizes (L9) -------------------

def _wide_batch(batch: int, n: int = 1, d: int = 4) -> np.ndarray:
    """(batch, 1, n, d) float32 of zeros without the memory: every stride 0."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (batch, 1, n, d), (0, 0, 0, 0))


def test_a_grid_past_cuda_s_limit_is_refused_before_any_launch():
    q = _wide_batch(65536)
    with pytest.raises(ValueError, match=r"batch \* heads = 65536 is more blocks than CUDA's grid y allows \(65535\)"):
        fa_numba.attention(q, q, q, order="v2")
    with pytest.raises(ValueError, match=r"batch \* heads = 65536 is more blocks than CUDA's grid y allows"):
        fa_numba.attention_backward(q, q, q, q, q[..., 0], q)


def test_v1_s_one_axis_grid_takes_more_than_65535_heads_and_refuses_past_2_31():
    from fa_numba.kernels import VARIANTS

    v1, v2 = (VARIANTS[name].make(16, 16, 4, False) for name in ("v1", "v2"))
    v1.check_grid(65536, 1, 4096)  # grid x: up to 2^31 - 1 blocks, so no error
    with pytest.raises(ValueError, match=r"batch \* heads = 2147483648 .* grid x allows \(2147483647\)"):
        v1.check_grid(2**16, 2**15, 16)
    with pytest.raises(ValueError, match=r"grid y allows \(65535\)"):
        v2.check_grid(65536, 1, 16)


def test_sequences_past_int32_positions_are_refused():
    from fa_numba.kernels.common import check_sequence

    check_sequence(2**31 - 1, 2**31 - 1)
    with pytest.raises(ValueError, match=r"N_k = 2147483648 is over the 2147483647 positions"):
        check_sequence(16, 2**31)


def test_a_block_mask_with_more_tiles_than_int32_offsets_is_refused(monkeypatch):
    from fa_numba import tiling

    monkeypatch.setattr(tiling, "INT32_MAX", 9)  # the same check at a size this machine can build
    assert tiling.block_mask(12, 12, 4, 4).row_ptr[-1] == 9  # no mask: all 3 x 3 tiles FULL, 9 fit
    with pytest.raises(ValueError, match=r"the block mask lists 16 tiles, over the 9 int32 offsets"):
        tiling.block_mask(16, 16, 4, 4)
