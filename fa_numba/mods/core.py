"""The ScoreMod type, its errors, and the evaluation of a mod over the visible pairs of a score array
(`scores`, `derivatives`, `captured_gradients`: what `fa_numba.reference` calls). The package docstring
(`fa_numba.mods`) says what a mod is."""

from __future__ import annotations

import itertools
import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

U64 = 2.0**-53  # float64 unit roundoff: the central differences' rounding term
_LIVE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # ScoreMod.key -> the mod, while it lives
_SERIAL = itertools.count(1)


class ModError(RuntimeError):
    """A mod's own function raised, or returned something that is not a real number (the message names the
    mod, the function, the pair and the score)."""


class ModCheckError(AssertionError):
    """`check` found a derivative that disagrees with central differences.

    argument: "score" or "captured[k] (name)"; claimed: what the mod's derivative says; central: the central
    difference; tolerance: the bound they had to agree within; score, position (b, h, i, j): where; entry:
    the captured array's entry perturbed (None for the score).
    """

    def __init__(self, message, *, argument, claimed, central, tolerance, score, position, entry=None):
        super().__init__(message)
        self.argument = argument
        self.claimed = claimed
        self.central = central
        self.tolerance = tolerance
        self.score = score
        self.position = position
        self.entry = entry


# The dtypes a captured array may have. The kernels take it as a Numba array of its dtype; float16 and bfloat16
# are read as their float32 widening instead (exact: every value is a float32; Numba has no bfloat16 and its CPU
# compile check no float16 arithmetic), by the kernels and the reference alike, so both evaluate one function.
CAPTURED_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64")
WIDENED_DTYPES = ("float16", "bfloat16")


def _accepted() -> str:
    return f"{', '.join(CAPTURED_DTYPES)}, or {' and '.join(WIDENED_DTYPES)}, read as float32"


def _torch_bfloat16(name: str, x) -> np.ndarray | None:
    """A CPU torch bfloat16 tensor as an ml_dtypes bfloat16 array sharing its memory (np.asarray refuses it:
    NumPy has no bfloat16), so it is read at every call like any array; None for anything else."""
    if type(x).__module__.split(".")[0] != "torch" or str(getattr(x, "dtype", "")) != "torch.bfloat16":
        return None
    torch = sys.modules["torch"]
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"{name} is a torch bfloat16 tensor: reading it needs ml_dtypes (pip install ml_dtypes, "
                        "in the 'test' extra), or pass it as float32") from None
    try:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    except Exception as exc:  # noqa: BLE001 - on a GPU, or requiring grad: torch says which
        raise TypeError(f"{name} must be an array, got Tensor: {exc}") from None


def _is_tensor(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "requires_grad")


def _real_array(name: str, x) -> np.ndarray:
    """A captured array: anything np.asarray takes (and torch tensors), of a dtype in CAPTURED_DTYPES or
    WIDENED_DTYPES, at least 1-D; as given, without a copy (a CPU tensor's memory, detached from autograd, so an
    optimizer's update in place is read at the next call; a CUDA tensor is copied to the host, and read again at
    every call: `ScoreMod.arrays`)."""
    if _is_tensor(x):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
    array = _torch_bfloat16(name, x)
    if array is None:
        try:
            array = np.asarray(x)
        except Exception as exc:  # noqa: BLE001 - what np.asarray raises varies with the object
            raise TypeError(f"{name} must be an array, got {type(x).__name__}: {exc}") from None
    if array.dtype.name not in CAPTURED_DTYPES + WIDENED_DTYPES:
        raise TypeError(f"{name} must have an integer or floating dtype, got {array.dtype} (accepted: "
                        f"{_accepted()})")
    if array.ndim == 0:
        raise ValueError(f"{name} must be an array of at least one axis (wrap a scalar: np.array([x])), got a "
                         "0-d array")
    return array


def read_dtype(dtype) -> np.dtype:
    """The dtype a captured array of `dtype` is read in (by the functions, in the kernels and the reference):
    float32 for float16 and bfloat16, else its own in native byte order."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.name in WIDENED_DTYPES else dtype.newbyteorder("=")


def _as_read(array: np.ndarray) -> np.ndarray:
    dtype = read_dtype(array.dtype)
    return array if array.dtype == dtype else array.astype(dtype)


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """An elementwise score modification with its derivatives (module docstring): fn, grad, captured arrays,
    their gradients, a name for messages, and optionally `fits(batch, heads, n_q, n_k)`, which raises
    ValueError when the captured arrays do not fit a problem of those sizes (the built-ins give one).

    fn, grad and each captured_grad take (score, b, h, i, j, *captured): Python on scalars, as Numba compiles
    device functions (no NumPy calls on arrays; index the captured arrays with ints). grad=None makes a
    forward-only mod (the backward refuses it). captured_grad: None (no captured array takes a gradient),
    a tuple with one entry per captured array (a function or None), or a single function when there is
    exactly one captured array. captured_names: one name per captured array for messages (default: none,
    messages say "captured[k]"; "" leaves one unnamed).
    """

    fn: Callable
    grad: Callable | None = None
    captured_grad: tuple | Callable | None = None
    name: str | None = None
    captured: tuple = ()
    captured_names: tuple | None = None
    fits: Callable | None = field(default=None, repr=False)
    key: str = field(default="", init=False, repr=False)  # "name#serial": unique in this process (`lookup`)
    tensors: tuple = field(default=(), init=False, repr=False)  # per captured array: the torch tensor, or None

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"fn must be a function (score, b, h, i, j, *captured) -> score, got "
                            f"{type(self.fn).__name__}")
        if self.grad is not None and not callable(self.grad):
            raise TypeError(f"grad must be a function (score, b, h, i, j, *captured) -> d fn / d score, or None, "
                            f"got {type(self.grad).__name__}")
        name = self.name if self.name is not None else getattr(self.fn, "__name__", type(self.fn).__name__)
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {type(name).__name__} {name!r}")
        object.__setattr__(self, "name", name)
        captured = self.captured
        if isinstance(captured, np.ndarray) or not isinstance(captured, (tuple, list)):
            raise TypeError(f"captured must be a tuple of arrays (one array: captured=(x,)), got "
                            f"{type(captured).__name__}")
        names = self.captured_names
        if names is None:
            names = ("",) * len(captured)
        elif (not isinstance(names, (tuple, list)) or len(names) != len(captured)
              or not all(isinstance(n, str) for n in names)):
            raise ValueError(f"captured_names must be {len(captured)} strs, one per captured array, got {names!r}")
        names = tuple(names)
        object.__setattr__(self, "captured_names", names)
        object.__setattr__(self, "tensors", tuple(x if _is_tensor(x) else None for x in captured))
        object.__setattr__(self, "captured", tuple(_real_array(f"captured[{k}]{self._named(k)}", x)
                                                   for k, x in enumerate(captured)))
        grads = self.captured_grad
        if grads is None:
            grads = (None,) * len(captured)
        elif callable(grads):
            if len(captured) != 1:
                raise ValueError(f"captured_grad must be a tuple with one entry per captured array "
                                 f"({len(captured)}), got a single function")
            grads = (grads,)
        if not isinstance(grads, (tuple, list)) or len(grads) != len(captured):
            raise ValueError(f"captured_grad must have one entry (a function or None) per captured array "
                             f"({len(captured)}), got {grads!r}")
        for k, g in enumerate(grads):
            if g is None:
                continue
            if not callable(g):
                raise TypeError(f"captured_grad[{k}]{self._named(k)} must be a function or None, got "
                                f"{type(g).__name__}")
            if read_dtype(self.captured[k].dtype).kind != "f":
                raise ValueError(f"captured_grad[{k}] is given but captured[{k}]{self._named(k)} has dtype "
                                 f"{self.captured[k].dtype}: only a floating array takes a gradient")
        object.__setattr__(self, "captured_grad", tuple(grads))
        if self.fits is not None and not callable(self.fits):
            raise TypeError(f"fits must be a function (batch, heads, n_q, n_k) or None, got "
                            f"{type(self.fits).__name__}")
        object.__setattr__(self, "key", f"{name}#{next(_SERIAL)}")
        _LIVE[self.key] = self

    def arrays(self) -> tuple:
        """The captured arrays as fn, grad and captured_grad read them, now: float16 and bfloat16 ones as float32
        copies (exact), the others as given (in native byte order); a captured CUDA tensor read again now. What
        the reference and the kernels pass."""
        now = tuple(a if t is None or t.device.type == "cpu" else _real_array(f"captured[{k}]", t)
                    for k, (a, t) in enumerate(zip(self.captured, self.tensors)))
        return tuple(_as_read(a) for a in now)

    @property
    def learnable(self) -> tuple[int, ...]:
        """The captured arrays that are torch tensors requiring grad and take a gradient (a captured_grad):
        the ones `fa_numba.autograd` differentiates."""
        return tuple(k for k, (t, g) in enumerate(zip(self.tensors, self.captured_grad))
                     if t is not None and t.requires_grad and g is not None)

    def _named(self, k: int) -> str:
        """The suffix ' (name)' of captured array k in messages, or '' when it has no name."""
        return f" ({self.captured_names[k]})" if self.captured_names[k] else ""

    @property
    def differentiable(self) -> tuple[bool, ...]:
        """Per captured array: whether it takes a gradient (its captured_grad is not None)."""
        return tuple(g is not None for g in self.captured_grad)

    def check_sizes(self, batch: int, heads: int, n_q: int, n_k: int) -> None:
        """ValueError if the captured arrays do not fit a problem of these sizes (`fits`; nothing without it).

        Without `fits` nothing is checked: an index outside a captured array raises IndexError in the
        reference (a negative one wraps around, as in Python), and reads out of bounds in a kernel."""
        if self.fits is not None:
            self.fits(batch, heads, n_q, n_k)

    def __repr__(self) -> str:
        return f"ScoreMod({self.name})"


def lookup(key: str) -> ScoreMod:
    """The live ScoreMod whose `key` this is (what crosses an operator boundary as text: fa_numba.torch_ops);
    a RuntimeError if it is gone (a key is never reused, so it never finds another mod)."""
    mod = _LIVE.get(key)
    if mod is None:
        raise RuntimeError(f"score_mod {key!r} is no longer alive: keep the ScoreMod object referenced while a "
                           "call or a compiled graph that uses it may run")
    return mod


def check_score_mod(score_mod) -> ScoreMod | None:
    """score_mod must be a ScoreMod or None: a TypeError naming the argument otherwise."""
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    hint = " (wrap a function: fa_numba.mods.ScoreMod(fn, grad=...))" if callable(score_mod) else ""
    raise TypeError(f"score_mod must be a fa_numba.mods.ScoreMod (mods.alibi, mods.softcap, mods.relative_bias, "
                    f"mods.temperature or ScoreMod(fn, grad=...)) or None, got {type(score_mod).__name__}{hint}")


# ----------------------------------------------------------------------------------------------------
# Evaluation over the visible pairs of a (B, H, N_q, N_k) score array (what `reference` calls).


def _call(mod: ScoreMod, what: str, f, score, b, h, i, j, captured: tuple | None = None):
    """f(score, b, h, i, j, *captured), with the mod, the function, the pair and the score in any error.
    captured: mod.arrays() (taken here when None; pass it once for many calls)."""
    if captured is None:
        captured = mod.arrays()
    try:
        with np.errstate(all="ignore"):  # IEEE results (inf, NaN) where a device function has them too
            return f(score, b, h, i, j, *captured)
    except Exception as exc:  # noqa: BLE001 - a user's function may raise anything
        hint = (" (Python's math raises where a compiled device function returns inf or NaN)"
                if isinstance(exc, (OverflowError, ValueError)) else "")
        raise ModError(f"score_mod {mod.name}: {what} raised {type(exc).__name__}: {exc} at b={b}, h={h}, i={i}, "
                       f"j={j}, score={float(score)!r}{hint}") from exc


def _real(mod: ScoreMod, what: str, value, b, h, i, j, dtype):
    try:
        return dtype(value)
    except (TypeError, ValueError) as exc:
        raise ModError(f"score_mod {mod.name}: {what} must return a real number, got {type(value).__name__} "
                       f"{value!r} at b={b}, h={h}, i={i}, j={j}") from exc


def _pairs(shape, visible: np.ndarray, origin=(0, 0)):
    """(b, h, i, j) of every visible pair as Python ints, in lexicographic order (b, h, i, j): array indices,
    and the positions (b, h, r0 + i, c0 + j) the mod sees, origin = (r0, c0) the block's first row and key.
    visible: (rows, keys), the same for every slice, or (B_m, H_m, rows, keys) broadcast against shape (a
    mask per batch and head: the pairs of slice (b, h) are those visible in its own slice)."""
    batch, heads = shape[:2]
    r0, c0 = (int(x) for x in origin)
    if np.ndim(visible) > 2:
        full = np.broadcast_to(visible, (batch, heads) + np.shape(visible)[-2:])
        for b, h, i, j in zip(*(x.tolist() for x in np.nonzero(full))):  # C order: lexicographic
            yield (b, h, i, j), (b, h, r0 + i, c0 + j)
        return
    rows, cols = np.nonzero(visible)
    rows, cols = rows.tolist(), cols.tolist()
    for b in range(batch):
        for h in range(heads):
            for i, j in zip(rows, cols):
                yield (b, h, i, j), (b, h, r0 + i, c0 + j)


def scores(mod: ScoreMod, s: np.ndarray, visible: np.ndarray, dtype=np.float64, *, origin=(0, 0)) -> np.ndarray:
    """S' = fn(S) at the visible pairs, -inf at the masked ones (fn is never called there), in `dtype`.

    s: (B, H, rows, keys) scores after the scale; visible: (rows, keys) bool, or (B_m, H_m, rows, keys) for a
    mask per batch and head (broadcast against s); origin: (r0, c0), the position
    of s[..., 0, 0] in the problem (a tile's first query and key; (0, 0) for the whole problem): fn sees the
    global positions i = r0 + row, j = c0 + key (proofs/L13, claim 1). fn gets `dtype` scalars and its
    result is rounded to `dtype` (the float32 twin rounds the mod's result once)."""
    out = np.full(s.shape, -np.inf, dtype=dtype)
    f, captured = mod.fn, mod.arrays()
    for at, (b, h, i, j) in _pairs(s.shape, visible, origin):
        out[at] = _real(mod, "fn", _call(mod, "fn", f, dtype(s[at]), b, h, i, j, captured), b, h, i, j, dtype)
    return out


def derivatives(mod: ScoreMod, s: np.ndarray, visible: np.ndarray, dtype=np.float64, *, origin=(0, 0)) -> np.ndarray:
    """mod'(S) = grad(S) at the visible pairs, 0 at the masked ones (grad is never called there); s, visible,
    origin as in `scores`."""
    if mod.grad is None:
        raise ValueError(f"score_mod {mod.name} has no grad: the backward needs d fn / d score "
                         "(ScoreMod(fn, grad=...))")
    out = np.zeros(s.shape, dtype=dtype)
    g, captured = mod.grad, mod.arrays()
    for at, (b, h, i, j) in _pairs(s.shape, visible, origin):
        out[at] = _real(mod, "grad", _call(mod, "grad", g, dtype(s[at]), b, h, i, j, captured), b, h, i, j, dtype)
    return out


def _entry(mod: ScoreMod, k: int, index, b, h, i, j) -> tuple[int, ...]:
    """The index a captured_grad returned, as a tuple of ints inside captured[k] (ModError otherwise)."""
    array = mod.captured[k]
    index = index if isinstance(index, tuple) else (index,)
    try:
        index = tuple(int(x) for x in index)
    except (TypeError, ValueError):
        index = None
    if index is None or len(index) != array.ndim or not all(0 <= x < n for x, n in zip(index, array.shape)):
        raise ModError(f"score_mod {mod.name}: captured_grad[{k}]{mod._named(k)} must return an index "
                       f"of {array.ndim} non-negative ints inside shape {array.shape} and a derivative, got index "
                       f"{index!r} at b={b}, h={h}, i={i}, j={j}")
    return index


def captured_gradients(mod: ScoreMod, s: np.ndarray, ds_mod: np.ndarray, visible: np.ndarray,
                       dtype=np.float64, *, origin=(0, 0), absolute: bool = False) -> tuple:
    """The captured arrays' gradients: for each array with a captured_grad, an array like it in `dtype`,

        dcaptured[k][e] = sum over the visible pairs p = (b, h, i, j) with index_k(p) = e
                          of dS'_p * d fn / d captured[k][e],

    summed in the fixed order (b, h, i, j) lexicographic, so bitwise repeatable; None for an array without one.
    s: the scores before the mod; ds_mod: dS' = d<dO, O> / d S' (the softmax's score gradient), both
    (B, H, rows, keys); visible, origin as in `scores` (a tile's part of the sum). Masked pairs are never
    visited. absolute=True sums |dS'_p| |derivative| instead (the magnitude a bound needs: tolerance's floors)."""
    out = []
    captured = mod.arrays()
    for k, cg in enumerate(mod.captured_grad):
        if cg is None:
            out.append(None)
            continue
        total = np.zeros(mod.captured[k].shape, dtype=dtype)
        what = f"captured_grad[{k}]{mod._named(k)}"
        for at, (b, h, i, j) in _pairs(s.shape, visible, origin):
            result = _call(mod, what, cg, dtype(s[at]), b, h, i, j, captured)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise ModError(f"score_mod {mod.name}: {what} must return (index, derivative), got "
                               f"{result!r} at b={b}, h={h}, i={i}, j={j}")
            entry = _entry(mod, k, result[0], b, h, i, j)
            with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf where the inputs hold them
                term = ds_mod[at] * _real(mod, what, result[1], b, h, i, j, dtype)
                total[entry] += abs(term) if absolute else term
        out.append(total)
    return tuple(out)
