"""The defaults a caller gets by leaving an argument out (most tests pass every argument explicitly):
causal masking is off everywhere, as torch SDPA's is_causal=False; the backward spec is the atomic,
skipping "kv" order; the gradients' tolerance has no recomputation floor unless one is given."""

import dataclasses

import numpy as np
import pytest

from fa_numba import masks, reference, tiled, tiling, tolerance, tolerance_backward
from strategies import Case

# N_q = N_k = 3, one-row tiles: causal masking changes every output and the upper tiles' kind.
CASE = Case(n_q=3, n_k=3, d=2, block_q=1, block_k=1, causal=False, seed=4)
Q, K, V = CASE.inputs()
DOUT = CASE.grad_output()
TILES = dict(block_q=1, block_k=1)


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b, equal_nan=True)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, tiling.BlockMask):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def _forward_of(causal):
    return tiled.attention(Q, K, V, order="v2", causal=causal, **TILES)[:2]


COMPUTED = {  # entry point: call(**maybe causal) -> a result
    "reference.attention": lambda **kw: reference.attention(Q, K, V, **kw),
    "reference.attention_naive_f32": lambda **kw: reference.attention_naive_f32(Q, K, V, **kw),
    "reference.visible_mask": lambda **kw: reference.visible_mask(3, 3, **kw),
    "tolerance.baseline": lambda **kw: tolerance.baseline(Q, K, V, **kw),
    "reference.attention_backward": lambda **kw: reference.attention_backward(Q, K, V, DOUT, **kw),
    "reference.attention_backward_naive_f32": lambda **kw: reference.attention_backward_naive_f32(Q, K, V, DOUT, **kw),
    "tolerance_backward.baseline_backward": lambda **kw: tolerance_backward.baseline_backward(Q, K, V, DOUT, **kw),
    "tiled.attention": lambda **kw: tiled.attention(Q, K, V, order="v1", **TILES, **kw),
    "tiled.attention_backward": lambda **kw: tiled.attention_backward(
        Q, K, V, *_forward_of(kw.get("causal", False)), DOUT, order="q", **TILES, **kw),
    "tiling.classify": lambda **kw: tiling.classify(3, 3, 1, 1, **kw),
    "tiling.schedule": lambda **kw: tiling.schedule("v2", 3, 3, 1, 1, **kw),
    "tiling.block_mask": lambda **kw: tiling.block_mask(3, 3, 1, 1, **kw),
    "tiling.Grid.kind": lambda **kw: tiling.Grid(3, 3, 1, 1).kind(0, 2, **kw),
    "masks.documents": lambda **kw: masks.documents([3], **kw).dense(3, 3),
}


@pytest.mark.parametrize("name", COMPUTED)
def test_causal_masking_is_off_unless_asked_for(name):
    call = COMPUTED[name]
    default = call()
    assert _same(default, call(causal=False))
    assert not _same(default, call(causal=True))


CHECKS = {  # entry point: call(**maybe causal) on non-causal results: passes iff it judges without the mask
    "tolerance.check_attention": lambda **kw: tolerance.check_attention(*reference.attention(Q, K, V), Q, K, V, **kw),
    "tolerance_backward.check_attention_backward": lambda **kw: tolerance_backward.check_attention_backward(
        *reference.attention_backward(Q, K, V, DOUT), Q, K, V, DOUT, **kw),
}


@pytest.mark.parametrize("name", CHECKS)
def test_the_checks_judge_without_the_causal_mask_unless_asked(name):
    call = CHECKS[name]
    assert call() == call(causal=False)
    with pytest.raises(AssertionError, match="beyond atol"):
        call(causal=True)


def test_the_backward_spec_defaults_to_atomic_dq_and_skipping():
    out, lse = _forward_of(True)
    run = lambda **kw: tiled.attention_backward(Q, K, V, out, lse, DOUT, order="kv", causal=True, **TILES, **kw)  # noqa: E731
    default = run()
    assert _same(default, run(deterministic=False, skip=True))
    assert default[3].reads["dQ"] > 0  # dQ accumulated in HBM: not the deterministic dQ pass
    assert not _same(default[3], run(deterministic=True)[3]) and not _same(default[3], run(skip=False)[3])
    assert tiling.schedule("v1", 3, 3, 1, 1, True).computed == 6  # skip=True: the 3 SKIP tiles are left out


def test_the_gradients_tolerance_has_no_recomputation_floor_unless_given():
    expected = np.array([1.0, -2.0, 0.5])
    naive = [expected + np.array([2.0**-20, 0.0, 0.0]), expected - np.array([0.0, 2.0**-18, 0.0])]  # exact errors
    atol = tolerance_backward.tolerance_backward(expected, naive)
    assert atol == tolerance_backward.tolerance_backward(expected, naive, 0.0)
    assert atol == 3 * 2.0**-18 + tolerance.rounding_floor(expected)
    assert tolerance_backward.tolerance_backward(expected, naive, 2.0**-10) == atol + 2.0**-10
