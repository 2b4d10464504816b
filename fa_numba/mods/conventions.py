"""The score mods behind the drop-ins' arguments (`fa_numba.dropins`), in those libraries' conventions:

    flash_attn(slopes, softcap=, delta=)  flash-attn 2's alibi_slopes and softcap:
        S' = c tanh(S / c) (c = softcap > 0; S itself for c = 0), then - slopes[b, h] |i + delta - j|
        with delta = N_k - N_q (its bottom-right alignment) and slopes (H,) or (B, H)
    additive(bias)                        torch SDPA's float attn_mask: S' = S + bias[b, h, i, j], the bias
        broadcast over batch and heads from (B_m, H_m, N_q, N_k), B_m in {1, B}, H_m in {1, H}

Both are ScoreMods like the built-ins (module-level functions, parameters in captured arrays, so one
compiled kernel serves every value), with the derivative with respect to the score; their captured arrays
take no gradient, but for flash-attn's slopes given as a torch tensor that requires grad (learnable ALiBi). Parameters that do not fit (a negative softcap, slopes of the wrong shape) are
ValueErrors naming the argument. Imports NumPy only, as the package does.
"""

from __future__ import annotations

import math

import numpy as np

from fa_numba.mods.builtins import _float_param
from fa_numba.mods.core import ScoreMod, _is_tensor


def _flash(score, b, h, i, j, slopes, params):
    cap = params[0]
    s = score * 1.0
    if cap > 0.0:
        s = cap * math.tanh(score / cap)
    row = b if params[2] > 0.0 else 0
    return s - slopes[row, h] * abs(i + params[1] - j)


def _flash_grad(score, b, h, i, j, slopes, params):
    cap = params[0]
    if cap > 0.0:
        t = math.tanh(score / cap)
        return 1.0 - t * t
    return 1.0


def _flash_slopes_grad(score, b, h, i, j, slopes, params):
    row = b if params[2] > 0.0 else 0
    return (row, h), -1.0 * abs(i + params[1] - j)


def flash_attn(slopes, *, softcap: float, delta: int, batch: int, heads: int) -> ScoreMod:
    """flash-attn 2's softcap and ALiBi as one mod (module docstring). slopes: None, (heads,) or (batch, heads)
    finite reals; softcap: 0 (none) or > 0; delta: N_k - N_q. Slopes that are a torch tensor requiring grad are
    learnable: the mod keeps the tensor (as (1, heads) or (batch, heads)) and gives their gradient,
    d S' / d slopes[b, h] = -|i + delta - j| (`ScoreMod.learnable`, through `fa_numba.autograd`)."""
    cap = _float_param("softcap", softcap, positive=False)
    if cap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no soft cap), got {softcap}")
    learnable = _is_tensor(slopes) and slopes.requires_grad
    if slopes is None:
        table = np.zeros((1, heads))
    else:
        table = np.array(slopes.detach().cpu().numpy() if learnable else slopes, dtype=np.float64)
        if table.shape == (heads,):
            table = table[None]
        if table.shape not in ((1, heads), (batch, heads)):
            raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}), got "
                             f"{np.shape(slopes)}")
        if not np.isfinite(table).all():
            raise ValueError("alibi_slopes must be finite")
    per_batch = float(table.shape[0] > 1)
    params = np.array([cap, float(delta), per_batch])
    for x in (table, params):
        x.setflags(write=False)
    name = "+".join(n for n, on in (("softcap", cap > 0), ("alibi", slopes is not None)) if on) or "flash_attn"
    if learnable:  # the tensor itself, in the table's shape (a view: its gradient reaches the slopes)
        return ScoreMod(_flash, _flash_grad, (_flash_slopes_grad, None), name=name,
                        captured=(slopes.reshape(table.shape), params), captured_names=("slopes", "params"))
    return ScoreMod(_flash, _flash_grad, name=name, captured=(table, params), captured_names=("slopes", "params"))


def _additive(score, b, h, i, j, bias, params):
    return score + bias[b if params[0] > 0.0 else 0, h if params[1] > 0.0 else 0, i, j]


def _additive_grad(score, b, h, i, j, bias, params):
    return 1.0


def additive(bias, *, batch: int, heads: int, n_q: int, n_k: int) -> ScoreMod:
    """torch SDPA's float attn_mask as a mod (module docstring): bias (B_m, H_m, N_q, N_k), B_m in {1, batch},
    H_m in {1, heads}, real (-inf allowed: that pair's weight is 0). A mod is not a mask: a row whose every S' is
    -inf gets O = NaN through this mod alone (exp(-inf - (-inf))). torch SDPA gives such a row O = 0, and so does
    `fa_numba.sdpa`, which passes the rows of bias with no finite entry as masked rows besides the mod (no
    visible key: O = 0, LSE = -inf, zero gradients); a caller of fa_numba.attention does the same with a mask."""
    table = np.array(bias, dtype=np.float64)
    if table.ndim != 4 or table.shape[2:] != (n_q, n_k) or table.shape[0] not in (1, batch) \
            or table.shape[1] not in (1, heads):
        raise ValueError(f"attn_mask must broadcast to ({batch}, {heads}, {n_q}, {n_k}) from (B_m, H_m, N_q, N_k) "
                         f"with B_m in (1, {batch}) and H_m in (1, {heads}), got {table.shape}")
    if np.isnan(table).any() or (table == np.inf).any():
        raise ValueError("attn_mask must hold no NaN or +inf (-inf masks a pair)")
    params = np.array([float(table.shape[0] > 1), float(table.shape[1] > 1)])
    for x in (table, params):
        x.setflags(write=False)
    return ScoreMod(_additive, _additive_grad, name="attn_mask", captured=(table, params),
                    captured_names=("attn_mask", "params"))


__all__ = ["additive", "flash_attn"]
