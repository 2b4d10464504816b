"""The built-in score mods (alibi, softcap, relative_bias, temperature), each with its derivatives: module-level
functions reading their parameters from captured arrays, so one compiled device function serves every value."""

from __future__ import annotations

import math

import numpy as np

from fa_numba.mods.core import ScoreMod, _is_tensor, _real_array

# ----------------------------------------------------------------------------------------------------
# Built-ins. Module-level functions reading their parameters from captured arrays, so one compiled device
# function serves every value of a parameter.


def _float_param(name: str, value, *, positive: bool) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value}")
    return value


def _float_table(name: str, x, ndim: int):
    """A float64 read-only copy of a finite real array with `ndim` axes (TypeError / ValueError naming it); a
    torch tensor that requires grad is kept itself (a learnable table, read at every call, its gradient through
    `fa_numba.autograd`), checked as it is now."""
    learnable = _is_tensor(x) and x.requires_grad
    array = _real_array(name, x)
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} axis{'es' if ndim > 1 else ''}, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {array.shape}")
    array = np.array(array, dtype=np.float64)  # a copy: a built-in is a value
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite, got {array[~np.isfinite(array)][0]} in it")
    if learnable:
        return x
    array.setflags(write=False)
    return array


def _alibi(score, b, h, i, j, slopes):
    return score + slopes[h] * (j - i)


def _alibi_grad(score, b, h, i, j, slopes):
    return 1.0


def _alibi_slopes_grad(score, b, h, i, j, slopes):
    return (h,), float(j - i)


def alibi(slopes) -> ScoreMod:
    """ALiBi (Press et al.): score + slopes[h] (j - i), one slope per query head; slopes (H,) finite reals.

    d/d score = 1; d/d slopes[h] = j - i (the slopes take a gradient)."""
    slopes = _float_table("slopes", slopes, 1)

    def fits(batch, heads, n_q, n_k):
        if slopes.shape != (heads,):
            raise ValueError(f"alibi: slopes must have one entry per query head (H = {heads}), got shape "
                             f"{slopes.shape}")

    return ScoreMod(_alibi, _alibi_grad, (_alibi_slopes_grad,), "alibi", (slopes,), ("slopes",), fits)


def _softcap(score, b, h, i, j, cap):
    c = cap[0]
    return c * math.tanh(score / c)


def _softcap_grad(score, b, h, i, j, cap):
    t = math.tanh(score / cap[0])
    return 1.0 - t * t


def _softcap_cap_grad(score, b, h, i, j, cap):
    x = score / cap[0]
    t = math.tanh(x)
    return (0,), t - x * (1.0 - t * t)


def softcap(cap) -> ScoreMod:
    """Soft-capping (Gemma 2): cap tanh(score / cap), cap a finite number > 0; |S'| < cap.

    d/d score = 1 - tanh^2(score / cap); d/d cap = tanh(x) - x (1 - tanh^2(x)), x = score / cap."""
    cap = _float_param("cap", cap, positive=True)
    array = np.array([cap])
    array.setflags(write=False)
    return ScoreMod(_softcap, _softcap_grad, (_softcap_cap_grad,), "softcap", (array,), ("cap",))


def _relative_bias(score, b, h, i, j, table, offset):
    return score + table[h, i - j + offset[0]]


def _relative_bias_grad(score, b, h, i, j, table, offset):
    return 1.0


def _relative_bias_table_grad(score, b, h, i, j, table, offset):
    return (h, i - j + offset[0]), 1.0


def relative_bias(table, *, n_k: int | None = None) -> ScoreMod:
    """A learned relative-position bias: score + table[h, i - j + N_k - 1], table (H, N_q + N_k - 1) finite reals
    (column N_k - 1 + t holds the bias of offset i - j = t, from -(N_k - 1) to N_q - 1).

    The mod reads N_k - 1 from a captured int array ("offset"); n_k defaults to (width + 1) // 2, the square
    case N_q = N_k, and must be given otherwise. d/d score = 1; d/d table[h, i - j + N_k - 1] = 1."""
    table = _float_table("table", table, 2)
    width = table.shape[1]
    if n_k is None:
        if width % 2 == 0:
            raise ValueError(f"relative_bias: table has {width} columns (N_q + N_k - 1), even, so N_q != N_k: "
                             "pass n_k=")
        n_k = (width + 1) // 2
    if isinstance(n_k, (bool, np.bool_)) or not isinstance(n_k, (int, np.integer)):
        raise TypeError(f"n_k must be an int, got {type(n_k).__name__} {n_k!r}")
    if not 1 <= n_k <= width:
        raise ValueError(f"n_k must be in [1, {width}] (the table's columns are N_q + N_k - 1), got {n_k}")
    n_k = int(n_k)
    offset = np.array([n_k - 1], dtype=np.int64)
    offset.setflags(write=False)
    heads = table.shape[0]

    def fits(batch, heads_q, n_q, n_k_):
        if (heads, width, n_k) != (heads_q, n_q + n_k_ - 1, n_k_):
            raise ValueError(f"relative_bias: table must have shape (H, N_q + N_k - 1) = ({heads_q}, "
                             f"{n_q + n_k_ - 1}) for N_k = {n_k_}, got shape {table.shape} made for N_k = {n_k}")

    return ScoreMod(_relative_bias, _relative_bias_grad, (_relative_bias_table_grad, None), "relative_bias",
                    (table, offset), ("table", "offset"), fits)


def _temperature(score, b, h, i, j, t):
    return score / t[0]


def _temperature_grad(score, b, h, i, j, t):
    return 1.0 / t[0]


def _temperature_t_grad(score, b, h, i, j, t):
    tt = t[0]
    return (0,), -score / (tt * tt)


def temperature(t) -> ScoreMod:
    """Temperature: score / t, t a finite number > 0. d/d score = 1 / t; d/d t = -score / t^2.

    (A temperature is a scale: attention(..., scale=s, score_mod=temperature(t)) is attention(..., scale=s / t)
    up to the rounding of the division.)"""
    t = _float_param("t", t, positive=True)
    array = np.array([t])
    array.setflags(write=False)
    return ScoreMod(_temperature, _temperature_grad, (_temperature_t_grad,), "temperature", (array,), ("t",))
