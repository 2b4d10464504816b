"""The shared timing helper: warm-up, repeats, the slow-call fallback, and the FLOP count."""

import numpy as np
import pytest

from fa_numba import masks
from fa_numba.timing import attention_flops, time_call


def test_repeats_warmup_and_slow_fallback():
    calls = []
    t = time_call(lambda: calls.append(1), warmup=2, repeats=7)
    assert len(calls) == 2 + 7 and t.repeats == 7 and t.p10_ms <= t.median_ms <= t.p90_ms
    calls.clear()
    slow = time_call(lambda: calls.append(1), warmup=1, repeats=20, slow_ms=-1.0, slow_repeats=3)
    assert len(calls) == 1 + 3 and slow.repeats == 3  # every call counts as slow: 3 repeats, not 20
    with pytest.raises(ValueError, match="must be >= 1"):
        time_call(lambda: None, repeats=0)


def test_attention_flops():
    assert attention_flops(2, 3, 5, 7, 11, causal=False) == 4 * 2 * 3 * 5 * 7 * 11
    assert attention_flops(2, 3, 5, 7, 11, causal=True) == 2 * 2 * 3 * 5 * 7 * 11


@pytest.mark.parametrize("mask, n_q, n_k", [
    (masks.sliding_window(3, 1), 10, 13),
    (masks.documents([4, 1, 5]), 10, 10),
    (masks.prefix_lm(4), 9, 7),
    (masks.from_function(lambda i, j: (i + j) % 3 == 0), 6, 8),  # no row intervals: counted from dense
])
def test_attention_flops_of_a_mask_count_its_visible_pairs_exactly(mask, n_q, n_k):
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    delta = n_k - n_q
    visible = {  # each mask's definition written out here, independently of fa_numba.masks
        masks.SlidingWindow: (j >= i + delta - 3) & (j <= i + delta + 1),
        masks.Documents: np.equal.outer(np.repeat([0, 1, 2], [4, 1, 5]), np.repeat([0, 1, 2], [4, 1, 5])),
        masks.PrefixLM: (j < 4) | (j <= i + delta),
        masks.FromFunction: (i + j) % 3 == 0,
    }[type(mask)]
    assert attention_flops(2, 3, n_q, n_k, 5, mask=mask) == 4 * 2 * 3 * 5 * int(visible.sum())
    with pytest.raises(ValueError, match="not both"):
        attention_flops(2, 3, n_q, n_k, 5, causal=True, mask=mask)
