"""Input conventions shared by every layer: layout, GQA head mapping, scale, tile sizes.

Layout is (B, H, N, d) like torch SDPA; (N, d) and (H, N, d) are accepted and mean B = 1 (and H = 1), and
(B1, ..., Bm, H, N, d) any number of leading batch axes, which q, k, v share and which count as one batch
B = B1 ... Bm.
K and V may have fewer heads than Q (GQA/MQA): query head h reads K/V head h // (H_q // H_kv).
V (and O) may have a head dim of their own, d_v != d (MLA: d = 192, d_v = 128), where a caller takes it
(`problem(..., value_dim=True)`); the scale's default 1/sqrt(d) reads q's.

Every check raises before any work is done, with a message that names the argument and what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import numpy as np

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class Problem:
    """The sizes of one attention call, after validation (notation of proofs/notation.md)."""

    batch: int
    heads: int
    heads_kv: int
    n_q: int
    n_k: int
    d: int
    d_v: int = 0  # V's and O's head dim; 0 (the default) means d

    def __post_init__(self):
        if self.d_v == 0:
            object.__setattr__(self, "d_v", self.d)

    @property
    def group(self) -> int:
        """Query heads per K/V head: query head h reads K/V head h // group."""
        return self.heads // self.heads_kv


def _check_dtype(name: str, x, allowed: tuple[np.dtype, ...], names: str | None = None) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array with .shape and .dtype, got {type(x).__name__}")
    if isinstance(x, np.matrix):  # an ndarray subclass that stays 2-D under every reshape
        raise TypeError(f"{name} must be a NumPy ndarray, not np.matrix (np.asarray({name}) gives one)")
    names = names or ", ".join(str(a) for a in allowed)
    try:
        dtype = np.dtype(x.dtype)
    except TypeError:
        raise TypeError(f"{name} must have dtype in ({names}), got {x.dtype}") from None
    if dtype not in allowed:
        raise TypeError(f"{name} must have dtype in ({names}), got {x.dtype}")


def _check_array(name: str, x, allowed: tuple[np.dtype, ...], names: str | None = None) -> None:
    _check_dtype(name, x, allowed, names)
    if len(x.shape) < 2:
        raise ValueError(
            f"{name} must have shape (N, d), (H, N, d), (B, H, N, d) or (B1, ..., Bm, H, N, d), got "
            f"{len(x.shape)}-D shape {tuple(x.shape)}"
        )


def batch_shape(shape) -> tuple[int, int, int, int]:
    """(B, H, N, d) of a (N, d), (H, N, d), (B, H, N, d) or (B1, ..., Bm, H, N, d) shape, B = B1 ... Bm."""
    shape = tuple(shape)
    lead = shape[:-3]
    return (math.prod(lead) if len(shape) > 3 else 1,) + ((1,) * (3 - len(shape)) + shape)[-3:]


def problem(q, k, v, allowed: tuple[np.dtype, ...] = FLOAT_DTYPES, names: str | None = None,
            empty: bool = False, value_dim: bool = False) -> Problem:
    """Validate q, k, v against the layout convention and return their sizes (`names`: the accepted dtypes
    as an error message should name them, if not the allowed dtypes themselves). With empty=True, N_q,
    N_k and B may be 0 (the caller returns an empty, or for N_k = 0 a dead-row, result without a launch).
    With value_dim=True, v's last axis may differ from k's (Problem.d_v); without, it must not."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x, allowed, names)
    if not (len(q.shape) == len(k.shape) == len(v.shape)):
        raise ValueError(
            f"q, k, v must have the same number of dimensions, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if value_dim and tuple(k.shape[:-1]) != tuple(v.shape[:-1]):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)} but for its last axis (d_v), got "
                         f"{tuple(v.shape)}")
    if not value_dim and tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"v must have the same shape as k {tuple(k.shape)} (a value head dim of its own, "
                         f"d_v != d, is taken by fa_numba.attention and its backward), got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    batch, heads, n_q, d = batch_shape(q.shape)
    batch_kv, heads_kv, n_k, d_k = batch_shape(k.shape)
    if d_k != d:
        raise ValueError(f"k must have head dim d = {d} (the last axis of q), got {d_k}")
    if batch_kv != batch:
        raise ValueError(f"k and v must have batch {batch} (as q), got {batch_kv}")
    if tuple(k.shape[:-3]) != tuple(q.shape[:-3]):
        raise ValueError(f"k and v must have the batch axes of q {tuple(q.shape[:-3])}, got {tuple(k.shape[:-3])}")
    for name, size in (("q", n_q), ("k", n_k)):
        if size == 0 and not empty:
            raise ValueError(f"{name} must have sequence length N >= 1 (axis -2), got 0")
    if d == 0:
        raise ValueError("q must have head dim d >= 1 (axis -1), got 0")
    d_v = tuple(v.shape)[-1]
    if d_v == 0:
        raise ValueError("v must have head dim d_v >= 1 (axis -1), got 0")
    if batch == 0 and not empty:
        raise ValueError("q must have batch >= 1 (axis 0), got 0")
    if heads == 0 or heads_kv == 0:
        raise ValueError(f"q and k must have heads >= 1, got q {heads}, k {heads_kv}")
    if heads % heads_kv != 0:
        raise ValueError(
            f"k and v heads ({heads_kv}) must divide q heads ({heads}) for GQA/MQA"
        )
    return Problem(batch, heads, heads_kv, n_q, n_k, d, d_v)


def out_shape(q, v) -> tuple[int, ...]:
    """The shape of O (and of dO): q's, with v's head dim d_v as its last axis."""
    return tuple(q.shape)[:-1] + tuple(v.shape)[-1:]


def check_like(name: str, x, shape: tuple[int, ...], like: str,
               allowed: tuple[np.dtype, ...] = FLOAT_DTYPES, names: str | None = None) -> None:
    """x must be an array of exactly `shape` (described as `like`, e.g. "as q") with a dtype in `allowed`.

    For the arguments that follow q, k, v: the backward's out, lse and dout.
    """
    _check_dtype(name, x, allowed, names)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ({like}), got {tuple(x.shape)}")


def as_4d(x: np.ndarray) -> np.ndarray:
    """View a (N, d), (H, N, d), (B, H, N, d) or (B1, ..., Bm, H, N, d) array as (B, H, N, d)."""
    return x.reshape(batch_shape(x.shape))


def drop_lead(x: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    """Map a (B, H, N, ...) result back to the caller's layout, whose axes before N are `lead` (q.shape[:-2]:
    (), (H,), (B, H) or (B1, ..., Bm, H))."""
    return x.reshape(tuple(lead) + tuple(x.shape[2:]))


FLOAT32_MAX = float(np.finfo(np.float32).max)


def resolve_scale(scale, d: int) -> float:
    """`scale` defaults to 1/sqrt(d); otherwise it must be a real number that is finite in float32, the
    kernels' arithmetic (1e39 is finite in float64 but inf in float32, and would make every score inf)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    expected = f"scale must be finite in float32 (|scale| <= {FLOAT32_MAX:.8g})"
    try:
        scale = float(scale)
    except OverflowError:  # an int beyond float64's range, e.g. 10**400
        raise ValueError(f"{expected}, got an int of {len(str(abs(int(scale))))} digits") from None
    if not math.isfinite(scale) or abs(scale) > FLOAT32_MAX:
        raise ValueError(f"{expected}, got {scale}")
    return scale


def check_sinks(sinks, heads: int) -> np.ndarray:
    """Learnable sinks on the host: one logit per query head, a real (H,) array (float32, or a float type whose
    values float32 takes: they are rounded to it, the kernels' arithmetic); returns it float32. Any value is
    taken: -inf is no sink, NaN and +inf make every row of their head NaN (IEEE, as a NaN or +inf score)."""
    if isinstance(sinks, (bool, int, float)) or not hasattr(sinks, "__len__") and not hasattr(sinks, "shape"):
        raise TypeError(f"sinks must be an array of {heads} logits (one per query head), got "
                        f"{type(sinks).__name__}")
    array = np.asarray(sinks)
    if array.dtype.kind != "f":
        raise TypeError(f"sinks must be a float array (float32, one logit per query head), got dtype {array.dtype}")
    if array.shape != (heads,):
        raise ValueError(f"sinks must have shape ({heads},) (one logit per query head H = {heads}), got "
                         f"{array.shape}")
    with np.errstate(over="ignore"):
        return array.astype(np.float32)


def check_block(name: str, value) -> int:
    """Tile sizes are positive Python ints (they become compile-time constants in the kernels)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def check_causal(causal) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return bool(causal)


# What a mask object offers (fa_numba.masks); layers above masks read masks through these methods only.
MASK_METHODS = ("check", "dense", "classify_tile", "row_intervals", "kernel_form")


def check_mask(causal, mask):
    """The two ways to ask for masking, `causal=True` and `mask=...`, checked together: returns (causal, mask).

    `causal=True` is the short form of `mask=masks.causal()`, so passing both is an error; `mask` must be a
    `fa_numba.masks` mask (anything with the methods of MASK_METHODS) or None.
    """
    causal = check_causal(causal)
    if mask is None:
        return causal, None
    missing = [name for name in MASK_METHODS if not callable(getattr(mask, name, None))]
    if missing:
        raise TypeError(f"mask must be a fa_numba.masks mask (masks.causal(), masks.sliding_window(...), ...) or "
                        f"None, got {type(mask).__name__} without {', '.join(missing)}")
    if causal:
        raise ValueError(f"pass causal=True or mask=..., not both (got causal=True and mask={mask!r}): "
                         "causal=True is the short form of mask=masks.causal()")
    return False, mask
