"""The drop-ins (fa_numba/dropins.py) against the originals' documented behaviour.

`sdpa` is checked against torch's own scaled_dot_product_attention in float64 on the cases its semantics
turn on (top-left causal for N_q <, =, > N_k, broadcast bool masks, GQA behind enable_gqa, scale, 3-D
inputs). `flash_attn_func` is checked against masks written here from flash-attn's docstring (bottom-right
windows: query i sees keys i + N_k - N_q - left <= j <= i + N_k - N_q + right, -1 unbounded), evaluated by
torch SDPA in float64: flash-attn itself needs a CUDA build this machine does not have.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the drop-ins need torch (the torch extra)")

import fa_numba  # noqa: E402
import fa_numba.autograd  # noqa: E402
from fa_numba import tolerance, tolerance_backward  # noqa: E402

F = torch.nn.functional


def _tensors(*shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _judge(out, want, q, k, v, mask_dense, name):
    """out against want (float64) with the forward rule of each (batch..., head) slice's mask."""
    group = q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1
    qf, kf, vf = (x.float().numpy() for x in (q, k, v))
    kf, vf = (np.repeat(x, group, axis=-3) if x.ndim >= 3 else x for x in (kf, vf))
    mask = None if mask_dense is None else fa_numba.masks.from_dense(mask_dense.numpy())
    # engine "auto" runs 16-bit inputs on the tensor cores (fa_numba.engines): P rounded to their type
    p_dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(q.dtype)
    base = tolerance.baseline(qf, kf, vf, mask=mask, p_dtype=p_dtype)
    tolerance.assert_close(out.float().numpy(), want.numpy(), base.tolerances()[0], name=name)


@pytest.mark.parametrize("n_q, n_k", [(6, 6), (7, 4), (4, 7)], ids=["square", "more-queries", "more-keys"])
def test_sdpa_causal_is_top_left_like_torch(n_q, n_k):
    q, k, v = _tensors((2, 2, n_q, 4), (2, 2, n_k, 4), (2, 2, n_k, 4))
    out = fa_numba.sdpa(q, k, v, is_causal=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    top_left = torch.ones(n_q, n_k, dtype=torch.bool).tril()  # torch's documented is_causal mask
    _judge(out, want, q, k, v, top_left, f"sdpa causal {n_q}x{n_k}")
    bottom_right = fa_numba.autograd.attention(q, k, v, causal=True)  # ours: j <= i + n_k - n_q
    assert torch.equal(out, bottom_right) == (n_q == n_k)  # the alignments agree only for square problems


def test_sdpa_takes_bool_masks_scale_gqa_and_3d_inputs_like_torch():
    q, k, v = _tensors((2, 4, 5, 4), (2, 2, 6, 4), (2, 2, 6, 4), seed=1)
    mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(2)) > 0.4
    out = fa_numba.sdpa(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.3,
                                          enable_gqa=True)
    qf, kf, vf = (x.numpy() for x in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))
    base = tolerance.baseline(qf, kf, vf, mask=fa_numba.masks.from_dense(mask.numpy()), scale=0.3)
    tolerance.assert_close(out.numpy(), want.numpy(), base.atol_out, name="sdpa mask + scale + GQA")
    q3, k3, v3 = _tensors((3, 5, 4), (3, 6, 4), (3, 6, 4), seed=3)  # (N, L, E): torch's batch, our heads
    out = fa_numba.sdpa(q3, k3, v3)
    _judge(out, F.scaled_dot_product_attention(q3.double(), k3.double(), v3.double()), q3, k3, v3, None, "sdpa 3-D")


def test_sdpa_gradients_match_torch_and_the_dtype_comes_back():
    q, k, v = (x.requires_grad_() for x in _tensors((1, 2, 6, 4), (1, 2, 6, 4), (1, 2, 6, 4), seed=4))
    (dout,) = _tensors((1, 2, 6, 4), seed=7)
    fa_numba.sdpa(q, k, v, is_causal=True).backward(dout)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).backward(dout.double())
    base = tolerance_backward.baseline_backward(*(x.detach().numpy() for x in (q, k, v)), dout.numpy(), causal=True)
    for name, ours, theirs, atol in zip("qkv", (q, k, v), ref, (base.atol_dq, base.atol_dk, base.atol_dv)):
        tolerance.assert_close(ours.grad.numpy(), theirs.grad.numpy(), atol, name=f"sdpa d{name}")
    half = fa_numba.sdpa(*(x.detach().half() for x in (q, k, v)))
    assert half.dtype == torch.float16


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(dropout_p=0.1), ValueError, "dropout_p must be 0.0"),
    (dict(is_causal=True, attn_mask=torch.ones(4, 4, dtype=torch.bool)), ValueError, "not both"),
    (dict(attn_mask=torch.zeros(4, 4, requires_grad=True)), ValueError, "attn_mask: a float mask that requires grad"),
    (dict(attn_mask=torch.zeros(3, 4)), ValueError, r"attn_mask must be broadcastable to \(1, 2, 4, 4\)"),
    (dict(attn_mask=torch.full((4, 4), float("nan"))), ValueError, "attn_mask must hold no NaN"),
    (dict(attn_mask=torch.zeros(4, 4, dtype=torch.int64)), TypeError,
     "attn_mask must be a bool tensor .* or a real floating tensor added to the scores, got dtype torch.int64"),
    (dict(attn_mask=torch.zeros(4, 4, dtype=torch.complex64)), TypeError,
     "attn_mask must be a bool tensor .* or a real floating tensor added to the scores, got dtype torch.complex64"),
])
def test_sdpa_refuses_what_it_does_not_do_by_name(kwargs, error, message):
    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(error, match=message):
        fa_numba.sdpa(q, q, q, **kwargs)


def test_sdpa_asks_for_enable_gqa_and_takes_another_value_head_dim():
    q, k = torch.zeros(1, 4, 4, 4), torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fa_numba.sdpa(q, k, k)
    value = torch.arange(12.0).reshape(1, 1, 4, 3).expand(1, 4, 4, 3)  # d_v = 3: zero scores average it
    assert torch.equal(fa_numba.sdpa(q, q, value), value.mean(dim=-2, keepdim=True).expand(1, 4, 4, 3))
    with pytest.raises(TypeError, match="query must have dtype float32, float16 or bfloat16"):
        fa_numba.sdpa(q.double(), q.double(), q.double())


def _flash_mask(n_q, n_k, left, right, causal):
    """flash-attn's documented visibility: bottom-right, window (left, right) with -1 unbounded; causal
    sets right = 0."""
    i = torch.arange(n_q)[:, None] + n_k - n_q
    j = torch.arange(n_k)[None, :]
    right = 0 if causal else right
    visible = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return visible


@pytest.mark.parametrize("causal, window", [  # seconds each on the emulated tensor cores: one in the default tier
    pytest.param(True, (-1, -1), marks=pytest.mark.slow), pytest.param(False, (2, 1), marks=pytest.mark.slow),
    (True, (3, -1)), pytest.param(False, (-1, -1), marks=pytest.mark.slow)],
    ids=["causal", "window-2-1", "causal-window-3", "none"])
def test_flash_attn_func_is_bottom_right_in_its_layout(causal, window):
    q, k, v = _tensors((2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8), seed=5, dtype=torch.bfloat16)  # (B, N, H, d)
    out, lse, probs = fa_numba.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous() and probs is None
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    mask = _flash_mask(5, 7, *window, causal)
    th = [x.transpose(1, 2).double() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(th[0], th[1].repeat_interleave(2, 1), th[2].repeat_interleave(2, 1),
                                          attn_mask=mask)
    wide, wide_lse = fa_numba.autograd.attention_with_lse(*(x.transpose(1, 2) for x in (q, k, v)),
                                                          mask=fa_numba.masks.from_dense(mask.numpy()),
                                                          out_dtype=torch.float32)
    assert torch.equal(out, wide.transpose(1, 2).to(torch.bfloat16))  # O is the checked float32 O, rounded once
    assert torch.equal(lse, wide_lse)
    _judge(wide, want, *(x.transpose(1, 2) for x in (q, k, v)), mask, f"flash_attn_func {causal} {window}")
    scores = th[0] @ th[1].repeat_interleave(2, 1).transpose(-1, -2) / np.sqrt(8)
    want_lse = torch.logsumexp(scores.masked_fill(~mask, -np.inf), dim=-1)
    np.testing.assert_allclose(lse.numpy(), want_lse.numpy(), atol=1e-5)


def test_flash_attn_func_refuses_what_it_does_not_do_by_name():
    q = torch.zeros(1, 4, 2, 4, dtype=torch.float16)
    for kwargs, message in [(dict(dropout_p=0.5), "dropout_p"), (dict(softcap=-1.0), "softcap must be >= 0"),
                            (dict(alibi_slopes=torch.zeros(3)), r"alibi_slopes must have shape \(2,\) or \(1, 2\)"),
                            (dict(alibi_slopes=torch.tensor([0.5, float("inf")])), "alibi_slopes must be finite")]:
        with pytest.raises(ValueError, match=message):
            fa_numba.flash_attn_func(q, q, q, **kwargs)
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor"):
        fa_numba.flash_attn_func(q, q, q, alibi_slopes=[0.5, 0.25])
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        fa_numba.flash_attn_func(q, q, q, window_size=3)
    with pytest.raises(ValueError, match=r"q must have shape \(B, N, H, d\)"):
        fa_numba.flash_attn_func(q[0], q[0], q[0])


def test_the_drop_ins_compile_fullgraph():
    q, k, v = _tensors((1, 2, 6, 4), (1, 2, 6, 4), (1, 2, 6, 4), seed=6)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fa_numba.sdpa(q, k, v, is_causal=True), fullgraph=True,
                             backend="aot_eager")
    assert torch.equal(compiled(q, k, v), fa_numba.sdpa(q, k, v, is_causal=True))
    flash = torch.compile(lambda q, k, v: fa_numba.flash_attn_func(q, k, v, window_size=(2, 0)), fullgraph=True,
                          backend="aot_eager")
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    assert torch.equal(flash(qt, kt, vt), fa_numba.flash_attn_func(qt, kt, vt, window_size=(2, 0)))


# ----------------------------------------------------------------------------------------------------
# Score modifications: SDPA's float attn_mask, flash-attn's softcap and alibi_slopes (mods.conventions).
# The expected values are written here from the originals' documented formulas, in float64 torch; the rule's
# atol comes from tolerance.baseline with the mod (how far float32 may move them), not the expected value.


def _rule_check(out, lse, want, want_lse, q, k, v, mod, name, causal=False):
    base = tolerance.baseline(*(x.detach().float().numpy() for x in (q, k, v)), causal=causal, score_mod=mod)
    tolerance.assert_close(out.detach().double().numpy(), want.numpy(), base.atol_out, name=f"{name} out")
    if lse is not None:
        tolerance.assert_close(lse.numpy(), want_lse.numpy(), base.atol_lse, name=f"{name} lse")


@pytest.mark.parametrize("shape", [(5, 7), (3, 5, 7), (2, 1, 5, 7), (2, 3, 5, 7), (1, 7)])
def test_sdpa_adds_a_float_attn_mask_as_torch_does(shape):
    q, k, v = _tensors((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8), seed=11)
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(shape, generator=g)
    bias[..., 0, 1] = -np.inf  # -inf masks a pair, as in torch
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fa_numba.sdpa(*leaves, attn_mask=bias)
    wide = [x.double().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*wide, attn_mask=bias.double())
    from fa_numba.dropins import _additive
    mod = _additive(q, k, bias)
    _rule_check(out, None, want.detach(), None, q, k, v, mod, f"sdpa float mask {shape}")
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    want.backward(dout.double())
    base = tolerance_backward.baseline_backward(*(x.numpy() for x in (q, k, v)), dout.numpy(), score_mod=mod)
    for name, ours, theirs, atol in zip("qkv", leaves, wide, (base.atol_dq, base.atol_dk, base.atol_dv)):
        tolerance.assert_close(ours.grad.numpy(), theirs.grad.numpy(), atol, name=f"sdpa float mask d{name}")


@pytest.mark.parametrize("shape", [(5, 6), (1, 2, 5, 6)], ids=["one", "per-head"])
def test_sdpa_float_mask_rows_of_only_minus_inf_see_no_key_as_in_torch(shape):
    """A row whose float mask holds no finite entry: torch SDPA (every backend, the math one included) gives
    O = 0 and zero gradients there; so does sdpa (the row is masked, not computed as exp(-inf + inf))."""
    from fa_numba.dropins import _additive, _rows_without_a_key

    q, k, v = _tensors((1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), seed=21)
    g = torch.Generator().manual_seed(22)
    bias = torch.randn(shape, generator=g)
    bias[..., 3, :2] = -np.inf  # some keys of a row masked: the row still sees the others
    bias[..., 1, :] = -np.inf  # no finite entry: the row sees no key
    if len(shape) == 4:
        bias[0, 1, 4, :] = -np.inf  # a row without a key in one head only
    dead = ~torch.isfinite(bias).any(-1).expand(1, 2, 5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fa_numba.sdpa(*leaves, attn_mask=bias)
    wide = [x.double().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*wide, attn_mask=bias.double())
    assert not want.detach()[dead].any()  # torch's answer, the one matched: 0, not NaN
    assert torch.isfinite(out).all() and not out.detach()[dead].any()
    mod = _additive(q, k, bias)
    visible = np.broadcast_to((~dead)[..., None].numpy(), (1, 2, 5, 6))  # the float64 reference's mask
    base = tolerance.baseline(q.numpy(), k.numpy(), v.numpy(), mask=fa_numba.masks.from_dense(visible),
                              score_mod=mod)
    tolerance.assert_close(out.detach().double().numpy(), want.detach().numpy(), base.atol_out, name="out vs SDPA")
    tolerance.assert_close(out.detach().double().numpy(), base.out, base.atol_out, name="out vs the reference")
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    want.backward(dout.double())
    assert not leaves[0].grad[dead].any() and not wide[0].grad[dead].any()
    bb = tolerance_backward.baseline_backward(q.numpy(), k.numpy(), v.numpy(), dout.numpy(),
                                              mask=fa_numba.masks.from_dense(visible), score_mod=mod)
    for name, ours, theirs, atol in zip("qkv", leaves, wide, (bb.atol_dq, bb.atol_dk, bb.atol_dv)):
        tolerance.assert_close(ours.grad.numpy(), theirs.grad.numpy(), atol, name=f"d{name} vs SDPA")
    # LSE (sdpa returns none): the mask and mod sdpa builds, through attention_with_lse, against logsumexp
    _, lse = fa_numba.autograd.attention_with_lse(q, k, v, mask=_rows_without_a_key(k, bias), score_mod=mod)
    want_lse = torch.logsumexp(q.double() @ k.double().transpose(-1, -2) / 2 + bias.double(), -1)
    assert torch.equal(want_lse[dead], torch.full((int(dead.sum()),), -np.inf, dtype=torch.float64))
    tolerance.assert_close(lse.numpy(), want_lse.numpy(), base.atol_lse, name="lse vs logsumexp")


def test_sdpa_takes_a_bfloat16_float_mask_as_sdpa_does():
    """SDPA's convention: a float mask in the query's dtype. The bfloat16 mask widens exactly: the same O as
    its float32 copy, within the rule of torch SDPA in float64 on the same values (a row of only -inf: 0)."""
    from fa_numba.dropins import _additive, _rows_without_a_key

    q, k, v = _tensors((1, 2, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8), seed=23, dtype=torch.bfloat16)
    bias = torch.randn(4, 5, generator=torch.Generator().manual_seed(24)).to(torch.bfloat16)
    bias[2, 1] = -np.inf
    bias[0, :] = -np.inf
    out = fa_numba.sdpa(q, k, v, attn_mask=bias)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fa_numba.sdpa(q, k, v, attn_mask=bias.float()))  # one value, one mod
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
    assert not want[:, :, 0].any() and not out[:, :, 0].any()
    visible = np.ones((4, 5), bool)
    visible[0] = False
    mod = _additive(q, k, bias)
    base = tolerance.baseline(*(x.float().numpy() for x in (q, k, v)), p_dtype="bfloat16", score_mod=mod,
                              mask=fa_numba.masks.from_dense(visible))
    wide = fa_numba.autograd.attention(q, k, v, mask=_rows_without_a_key(k, bias), score_mod=mod,
                                       out_dtype=torch.float32)
    assert torch.equal(out, wide.to(torch.bfloat16))  # O is the float32 O, rounded once
    tolerance.assert_close(wide.double().numpy(), want.numpy(), base.tolerances()[0],
                           name="bfloat16 mask out vs SDPA")


def _flash_reference(q, k, v, softcap, slopes, causal):
    """flash-attn's attention_ref as its docstring states it, float64, (B, N, H, d) inputs: softcap on the
    scaled scores, then the ALiBi bias -slope |i + N_k - N_q - j|, then the bottom-right causal mask."""
    qh, kh, vh = (x.double().transpose(1, 2) for x in (q, k, v))
    s = qh @ kh.transpose(-1, -2) / np.sqrt(q.shape[-1])
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    n_q, n_k = q.shape[1], k.shape[1]
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None]
    if slopes is not None:
        s = s - slopes.double().reshape(-1, q.shape[2])[:, :, None, None] * (i + n_k - n_q - j).abs()
    if causal:
        s = s.masked_fill(j > i + n_k - n_q, -np.inf)
    return (torch.softmax(s, -1) @ vh).transpose(1, 2), torch.logsumexp(s, -1)


# (softcap, slopes' shape): every combination with a mod (neither is the plain call the window tests cover)
FLASH_MODS = [(c, sh) for c in (0.0, 2.0) for sh in (None, (3,), (2, 3)) if (c, sh) != (0.0, None)]


@pytest.mark.parametrize("softcap, slopes_shape", FLASH_MODS)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_softcap_and_alibi_as_flash_attn_states_them(softcap, slopes_shape, causal):
    q, k, v = _tensors((2, 6, 3, 8), (2, 9, 3, 8), (2, 9, 3, 8), seed=13)
    slopes = None if slopes_shape is None else torch.rand(slopes_shape, generator=torch.Generator().manual_seed(14))
    out, lse, _ = fa_numba.flash_attn_func(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes,
                                           return_attn_probs=True)
    want, want_lse = _flash_reference(q, k, v, softcap, slopes, causal)
    from fa_numba.dropins import _cached_mod
    mod = _cached_mod("flash_attn", slopes, softcap=softcap, delta=3, batch=2, heads=3)
    _rule_check(out.transpose(1, 2), lse, want.transpose(1, 2), want_lse, *(x.transpose(1, 2) for x in (q, k, v)),
                mod, f"flash_attn_func softcap={softcap} slopes={slopes_shape}", causal=causal)


def test_flash_attn_func_takes_16_bit_alibi_slopes_and_refuses_other_dtypes_by_name():
    """Slopes in bfloat16 or float16 widen exactly: the result is the one of their float32 copy, within the
    rule of flash-attn's reference on their values. Integer and complex slopes are refused by name."""
    q, k, v = _tensors((1, 6, 2, 8), (1, 7, 2, 8), (1, 7, 2, 8), seed=25)
    slopes = torch.tensor([0.5, 0.1875], dtype=torch.bfloat16)
    out, lse, _ = fa_numba.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    wide, wide_lse, _ = fa_numba.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes.float(),
                                                 return_attn_probs=True)
    assert torch.equal(out, wide) and torch.equal(lse, wide_lse)
    assert torch.equal(fa_numba.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes.half()), out)
    want, want_lse = _flash_reference(q, k, v, 0.0, slopes, True)
    from fa_numba.dropins import _cached_mod
    mod = _cached_mod("flash_attn", slopes, softcap=0.0, delta=1, batch=1, heads=2)
    _rule_check(out.transpose(1, 2), lse, want.transpose(1, 2), want_lse, *(x.transpose(1, 2) for x in (q, k, v)),
                mod, "flash_attn_func bfloat16 slopes", causal=True)
    for bad in (torch.tensor([1, 2]), torch.tensor([0.5, 0.25], dtype=torch.complex64)):
        with pytest.raises(TypeError, match=f"alibi_slopes must be a real floating tensor .*got dtype {bad.dtype}"):
            fa_numba.flash_attn_func(q, k, v, alibi_slopes=bad)


def test_a_drop_in_mod_is_made_once_per_value_and_outlives_its_call():
    """Equal values give the same mod (one key, one compiled graph); the autograd formula holds the mod made
    for one call until its backward, however many others are made in between."""
    from fa_numba import dropins

    q, k, v = (x.requires_grad_() for x in _tensors((1, 4, 2, 4), (1, 4, 2, 4), (1, 4, 2, 4), seed=15))
    slopes = torch.tensor([0.5, 0.25])
    first = dropins._cached_mod("flash_attn", slopes, softcap=1.0, delta=0, batch=1, heads=2)
    assert dropins._cached_mod("flash_attn", slopes.clone(), softcap=1.0, delta=0, batch=1, heads=2) is first
    out = fa_numba.flash_attn_func(q, k, v, softcap=3.0)
    for t in range(dropins.CACHED_MODS + 1):  # evict the mod of the call above from the cache
        dropins._cached_mod("flash_attn", None, softcap=1.0 + t, delta=0, batch=1, heads=2)
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
