"""`check`: a mod's derivatives against central differences over Hypothesis-drawn scores and positions."""

from __future__ import annotations

import math

import numpy as np

from fa_numba.mods.builtins import _float_param
from fa_numba.mods.core import U64, ModCheckError, ScoreMod, _call, _entry

# ----------------------------------------------------------------------------------------------------
# check: the derivatives against central differences.


def _central(f, x: float, claimed: float, magnitude: float, rtol: float):
    """(central difference, tolerance) of f at x: d2 = (f(x + h/2) - f(x - h/2)) / step at h = 2^-17 max(1, |x|),
    the step being the actual (x + h/2) - (x - h/2). Its error is bounded by
    4 |d1 - d2| (d1 the same at step h: the truncation of d2 is a third of |d1 - d2| to leading order), plus
    the rounding of the two values divided by the step, 8 u64 (|f+| + |f-| + magnitude) / step (magnitude:
    |x| (|claimed| + 1), the size of what f adds and may cancel), plus rtol (|claimed| + |d2|)."""
    def quotient(h):
        hi, lo = x + h, x - h
        f_hi, f_lo = float(f(hi)), float(f(lo))
        return (f_hi - f_lo) / (hi - lo), abs(f_hi) + abs(f_lo), hi - lo

    h = 2.0**-17 * max(1.0, abs(x))
    d1, _, _ = quotient(h)
    d2, size, step = quotient(h / 2)
    tol = 4 * abs(d1 - d2) + 8 * U64 * (size + magnitude) / step + rtol * (abs(claimed) + abs(d2))
    return d2, tol


def _disagreements(mod: ScoreMod, example, rtol: float):
    """The first ModCheckError of one drawn example (score, b, h, i, j, other entries), or None."""
    s, b, h, i, j, others = example
    position = (b, h, i, j)
    where = f"score={s!r}, b={b}, h={h}, i={i}, j={j}"
    read = mod.arrays()  # as the reference and the kernels read them

    def fail(argument, claimed, central, tol, entry=None, named=None):
        at = f" entry {entry}" if entry is not None else ""
        said = ("grad gives" if argument == "score" else "captured_grad gives" if named is None else
                f"captured_grad names entry {named}, so this one must have derivative")
        return ModCheckError(
            f"score_mod {mod.name}: d fn / d {argument}{at} disagrees with central differences at {where}: "
            f"{said} {claimed!r}, central difference {central!r} (they must agree within {tol:.3g})",
            argument=argument, claimed=claimed, central=central, tolerance=tol, score=s, position=position,
            entry=entry)

    def value(x):
        return float(_call(mod, "fn", mod.fn, np.float64(x), b, h, i, j, read))

    claimed = float(_call(mod, "grad", mod.grad, np.float64(s), b, h, i, j, read))
    central, tol = _central(value, s, claimed, abs(s) * (abs(claimed) + 1), rtol)
    if not (math.isfinite(claimed) and math.isfinite(central) and abs(claimed - central) <= tol):
        return fail("score", claimed, central, tol)
    for (k, cg), other in zip(((k, cg) for k, cg in enumerate(mod.captured_grad) if cg is not None), others):
        argument = f"captured[{k}]{mod._named(k)}"
        index, claimed = _call(mod, f"captured_grad[{k}]", cg, np.float64(s), b, h, i, j, read)
        entry = _entry(mod, k, index, b, h, i, j)
        claimed = float(claimed)
        other = tuple(int(x) for x in np.unravel_index(other, mod.captured[k].shape))
        checks = [(entry, claimed, None)] + ([(other, 0.0, entry)] if other != entry else [])
        for at, want, named in checks:
            base = np.array(read[k], dtype=np.float64)

            def with_entry(x, at=at, base=base):
                arrays = list(read)
                moved = base.copy()
                moved[at] = x
                arrays[k] = moved
                with np.errstate(all="ignore"):
                    return float(mod.fn(np.float64(s), b, h, i, j, *arrays))

            x0 = float(base[at])
            central, tol = _central(with_entry, x0, want, abs(x0) * (abs(want) + 1) + abs(value(s)), rtol)
            if not (math.isfinite(want) and math.isfinite(central) and abs(want - central) <= tol):
                return fail(argument, want, central, tol, at, named)
    return None


def check(mod: ScoreMod, *, n_q: int, n_k: int, heads: int, batch: int = 1, examples: int = 100,
          scores_strategy=None, mask=None, rtol: float = 2.0**-30) -> None:
    """Test mod.grad and every captured_grad against central differences; raise ModCheckError naming the
    argument that disagrees (with the values), or ModError if a function raises; return None if all agree.

    Draws `examples` Hypothesis examples (derandomised: the same draws every run; the failing one shrunk to
    a minimal one) of a score (default: floats in [-100, 100]; `scores_strategy` to draw others), a position
    b < batch, h < heads, (i, j) < (n_q, n_k) (a visible pair of `mask` if given, a fa_numba.masks mask, for a
    mod defined only where the mask lets it be evaluated) and, per captured array with a gradient, one more
    entry. After pinned scores (0, +-1, +-30) at the first and last positions, for each example: grad against
    the central difference in the score; captured_grad's derivative against the central difference in the
    entry it names; and the derivative in the other drawn entry, 0 unless it is the one named (so a
    captured_grad naming the wrong entry fails). The tolerance is in `_central`: the difference's own error
    estimated from two steps, float64 rounding, and rtol relative (a guard, 2^-30 by default).
    Needs Hypothesis (the `test` extra: pip install 'fa_numba[test]')."""
    try:
        from hypothesis import HealthCheck, find, settings
        from hypothesis import strategies as st
        from hypothesis.errors import NoSuchExample
    except ImportError as exc:
        raise ImportError("fa_numba.mods.check needs Hypothesis, a test dependency: pip install 'fa_numba[test]' "
                          "(or pip install hypothesis)") from exc
    if not isinstance(mod, ScoreMod):
        raise TypeError(f"mod must be a fa_numba.mods.ScoreMod, got {type(mod).__name__}")
    if mod.grad is None:
        raise ValueError(f"score_mod {mod.name} has no grad to check (ScoreMod(fn, grad=...))")
    for name, value in (("n_q", n_q), ("n_k", n_k), ("heads", heads), ("batch", batch), ("examples", examples)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    rtol = _float_param("rtol", rtol, positive=False)
    mod.check_sizes(batch, heads, n_q, n_k)
    if mask is None:
        pairs = [(0, 0), (n_q - 1, n_k - 1)]
        pair_strategy = st.tuples(st.integers(0, n_q - 1), st.integers(0, n_k - 1))
    else:
        visible = np.asarray(mask.dense(n_q, n_k))
        if not visible.any():
            raise ValueError(f"mask {mask!r} hides every pair of {n_q} x {n_k}: nothing to check")
        found = [tuple(int(x) for x in p) for p in np.argwhere(visible)]
        pairs = [found[0], found[-1]]
        pair_strategy = st.sampled_from(found)
    sizes = [a.size for a, g in zip(mod.captured, mod.captured_grad) if g is not None]
    for s in (0.0, 1.0, -1.0, 30.0, -30.0):
        for (i, j), (b, h) in zip(pairs, ((0, 0), (batch - 1, heads - 1))):
            error = _disagreements(mod, (s, b, h, i, j, tuple(size - 1 for size in sizes)), rtol)
            if error is not None:
                raise error
    score_strategy = scores_strategy if scores_strategy is not None else st.floats(-100.0, 100.0)
    example = st.tuples(score_strategy, st.integers(0, batch - 1), st.integers(0, heads - 1), pair_strategy,
                        st.tuples(*(st.integers(0, size - 1) for size in sizes)))
    flat = example.map(lambda e: (float(e[0]), e[1], e[2], e[3][0], e[3][1], e[4]))
    try:
        bad = find(flat, lambda e: _disagreements(mod, e, rtol) is not None,
                   settings=settings(max_examples=examples, database=None, derandomize=True, deadline=None,
                                     suppress_health_check=list(HealthCheck)))
    except NoSuchExample:
        return None
    raise _disagreements(mod, bad, rtol)
