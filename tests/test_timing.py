"""The shared timing helper: warm-up, repeats, the slow-call fallback, and the FLOP count."""

import pytest

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
