"""A score mod as the kernels call it (issue 27, proofs/L13): the user's Python function compiled into the
kernel as an inlined device function, and its captured arrays passed as one tuple argument.

    S'_bhij = fn(S_bhij, b, h, i, j, *captured)        S = scale Q K^T, in float32

Where the kernels apply it: after the scale, at the visible pairs only (in bounds, and not masked: the causal
rule or the block mask's, decided exactly as the kernel's own mask), before the row max. The function's
result is rounded to float32 once, as the reference's float32 twin does (`reference.attention_float32`), so
the forward's rule takes the mod through `tolerance.baseline(score_mod=)`. A masked pair never calls fn: a
mod that is undefined or reads out of bounds there (log(i - j + 1) above a causal diagonal, a table index
past its end for a key past N_k) is never evaluated.

Compile-time identity (`KernelMod`): the function objects (fn, and grad for the backward) and the dtype each
captured array is read in (float32 for a float16 or bfloat16 one: `mods.core.read_dtype`) and its number of
axes; the array values are runtime arguments. So the built-ins (module-level functions) compile once per
kind, whatever slopes or cap they hold, and a kernel is cached per KernelMod beside its tiles (`Config.mod`).

Numba limits this module works around: a kernel cannot call an inlined device function with *args, so the
call is spelled out per number of captured arrays (`MAX_CAPTURED`); a device function that is not inlined
needs a GPU to be compiled (numba-cuda asks the current device for its compute capability), so every device
function here is `inline=True`, which also lets `fa_numba.profile` compile a modded kernel for sm_90a on a
machine without one.

`check_compiles(mod)` compiles fn and grad for the CPU with the kernel's argument types before any launch,
so a function Numba cannot compile raises `ModCompileError` naming the mod and the function, not a Numba
traceback from inside the kernel's compilation (the simulator never compiles: this is its only check).

In the simulator, which runs the functions as Python, an exception one raises in a kernel is a `ModError`
naming the mod, the function, the pair and the score, chained to it (`_guarded`); a GPU has no such report
(fa_numba.mods says what happens there).
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32

from fa_numba.mods.core import ModError, read_dtype

MAX_CAPTURED = 4  # captured arrays a kernel takes (the spelled-out calls below)
NO_CAPTURED = ()  # the captured-array argument of a kernel without a mod


class ModCompileError(TypeError):
    """Numba cannot compile a score mod's function (the message names the mod, the function and Numba's
    first line of explanation)."""


class SimulatedModError(ModError):
    """A mod's function raised in a kernel the CUDA simulator runs (`_guarded`). The simulator re-raises a
    thread's exception as a new one, type(e)("tid=[..] ctaid=[..]: " + message), without __cause__: the
    original exception waits in _PENDING, by message, for that copy, which takes it back as its __cause__."""

    def __init__(self, message, cause=None):
        prefix, _, inner = message.partition(": ")
        if cause is None and prefix.startswith("tid="):
            with _PENDING_LOCK:
                cause = _PENDING.pop(inner, None)
            if cause is not None:
                message = f"{inner} (simulator thread {prefix})"
        elif cause is not None:
            with _PENDING_LOCK:
                _PENDING[message] = cause
                while len(_PENDING) > 64:  # threads the simulator aborted leave theirs: keep a few
                    _PENDING.pop(next(iter(_PENDING)))
        super().__init__(message)
        if cause is not None:
            self.__cause__ = cause


_PENDING: dict = {}  # message -> the exception a mod's function raised, until the simulator re-raises it
_PENDING_LOCK = threading.Lock()
# function -> (the name of the ScoreMod last passed to device_arrays, the function's role there): what a raise in
# it reports in the simulator, which launches one kernel at a time (a kernel is compiled per function, not per mod)
_LAUNCHING: dict = {}


def _simulated() -> bool:
    """Whether numba.cuda is the CUDA simulator (kernels run as Python, a Python thread per CUDA thread)."""
    return "numba.cuda.simulator_init" in sys.modules


def _guarded(f, what: str):
    """f as the simulator runs it, an exception it raises turned into a ModError naming the mod, the function,
    the pair and the score, chained to it. (A GPU compiles no such report: fa_numba.mods says what it does.)"""
    function = getattr(f, "__name__", type(f).__name__)

    def guarded(score, b, h, i, j, *captured):
        try:
            return f(score, b, h, i, j, *captured)
        except Exception as exc:  # noqa: BLE001 - a user's function may raise anything
            name, role = _LAUNCHING.get(f, (function, what))
            role = role if what == "captured_grad" else what  # fn and grad: the call site knows
            hint = (" (Python's math raises where a compiled device function returns inf or NaN)"
                    if isinstance(exc, (OverflowError, ValueError)) else "")
            error = SimulatedModError(
                f"score_mod {name}: {role} ({function}) raised {type(exc).__name__}: {exc} at b={int(b)}, "
                f"h={int(h)}, i={int(i)}, j={int(j)}, score={float(score)!r}{hint}", cause=exc)
            raise error from exc

    guarded.__name__ = function
    return guarded


@dataclass(frozen=True)
class KernelMod:
    """What a kernel compiles from a ScoreMod and a mask_mod: fn, grad (None for a forward-only mod; both None
    without a score mod), the (dtype name, number of axes) of each captured array, and the mask_mod's function
    with its arrays' kinds (`kernels.mask_mod`; None and ()). Equal for the same functions and array kinds.
    A kernel's captured-array tuple holds the score mod's arrays, then the mask_mod's."""

    fn: object
    grad: object
    captured: tuple  # ((dtype name, ndim), ...) of the score mod's arrays
    mask: object = None  # the mask_mod's fn(b, h, i, j, *mask arrays) -> bool
    mask_captured: tuple = ()  # ((dtype name, ndim), ...) of its arrays, after the score mod's in the tuple

    @classmethod
    def of(cls, mod, mask_mod=None) -> "KernelMod | None":
        """The KernelMod of a ScoreMod and a slice_masks.MaskMod (None when both are None); ValueError for more
        than MAX_CAPTURED score-mod arrays."""
        if mod is None and mask_mod is None:
            return None
        if mod is not None and len(mod.captured) > MAX_CAPTURED:
            raise ValueError(f"score_mod {mod.name}: the kernels take at most {MAX_CAPTURED} captured arrays, got "
                             f"{len(mod.captured)} (stack arrays of one dtype into one)")
        fn, grad, kinds = (None, None, ()) if mod is None else (
            mod.fn, mod.grad, tuple((read_dtype(a.dtype).name, a.ndim) for a in mod.captured))
        if mask_mod is None:
            return cls(fn, grad, kinds)
        return cls(fn, grad, kinds, mask_mod.fn, mask_mod.kinds)

    @property
    def scores(self) -> bool:
        """Whether a score mod is compiled in (a KernelMod may carry a mask_mod alone)."""
        return self.fn is not None

    def numba_types(self) -> tuple:
        """The Numba types of the captured arrays as a kernel receives them (C-contiguous device arrays): the
        score mod's, then the mask_mod's."""
        return _array_types(self.captured + self.mask_captured)

    def tuple_type(self):
        """The Numba type of the kernel's captured-array argument (fa_numba.profile's argtypes)."""
        from numba import types

        return types.Tuple(self.numba_types())


def tuple_type(kmod: KernelMod | None):
    """The captured-array argument's Numba type for a kernel with `kmod` (the empty tuple without a mod)."""
    from numba import types

    return types.Tuple(()) if kmod is None else kmod.tuple_type()


def device_arrays(mod, stream=0, mask=None) -> tuple:
    """The captured arrays of a ScoreMod (None: none), then those of a mask_mod (`mask`, a slice_masks.MaskMod;
    any other mask or None adds none), as C-contiguous device arrays copied at this call (a hand-built mod
    reads its arrays as they are now, like q, k, v; float16 and bfloat16 as float32: `ScoreMod.arrays`)."""
    if mod is not None and _simulated():  # the names a raise in the mod's functions reports (`_guarded`)
        roles = [(mod.fn, "fn"), (mod.grad, "grad")] + [(cg, f"captured_grad[{k}]{mod._named(k)}")
                                                        for k, cg in enumerate(mod.captured_grad)]
        _LAUNCHING.update({f: (mod.name, role) for f, role in roles if f is not None})
    arrays = (() if mod is None else mod.arrays()) + tuple(getattr(mask, "captured", ()) if has_mask_fn(mask) else ())
    return tuple(cuda.to_device(np.ascontiguousarray(a), stream=stream) for a in arrays)


def has_mask_fn(mask) -> bool:
    """Whether `mask` is a mask_mod (its function is compiled into the kernels: kernel form "function")."""
    return mask is not None and getattr(mask, "kernel", None) == "function"


def has_scores(kmod: "KernelMod | None") -> bool:
    """Whether a kernel compiled with `kmod` applies a score mod."""
    return kmod is not None and kmod.scores


@functools.lru_cache(maxsize=None)
def _caller(f, n: int, cast: bool = True, what: str | None = None):
    """An inlined device function call(score, b, h, i, j, captured) -> f(score, b, h, i, j, *captured) for n
    captured arrays (spelled out: an inlined call takes no *args), as float32 with cast (a score or a
    derivative), as f returns it without (a captured_grad's (index, derivative): kernels.captured_grad).
    what: the function's role in messages ("fn", "grad"; default "fn" with cast, else "captured_grad"); in
    the simulator an exception f raises is a ModError naming it and the pair (`_guarded`)."""
    if what is None:
        what = "fn" if cast else "captured_grad"
    g = cuda.jit(device=True, inline=True)(_guarded(f, what) if _simulated() else f)
    if n == 0:
        def raw(score, b, h, i, j, captured):
            return g(score, b, h, i, j)
    elif n == 1:
        def raw(score, b, h, i, j, captured):
            return g(score, b, h, i, j, captured[0])
    elif n == 2:
        def raw(score, b, h, i, j, captured):
            return g(score, b, h, i, j, captured[0], captured[1])
    elif n == 3:
        def raw(score, b, h, i, j, captured):
            return g(score, b, h, i, j, captured[0], captured[1], captured[2])
    else:
        def raw(score, b, h, i, j, captured):
            return g(score, b, h, i, j, captured[0], captured[1], captured[2], captured[3])
    raw = cuda.jit(device=True, inline=True)(raw)
    if not cast:
        return raw

    @cuda.jit(device=True, inline=True)
    def call(score, b, h, i, j, captured):
        return float32(raw(score, b, h, i, j, captured))

    return call


@cuda.jit(device=True, inline=True)
def _identity(score, b, h, i, j, captured):
    return score


@cuda.jit(device=True, inline=True)
def _one(score, b, h, i, j, captured):
    return float32(1.0)


def apply_fn(kmod: KernelMod | None):
    """fn as a device function call(score, b, h, i, j, captured) -> float32 (the identity without a mod)."""
    return _caller(kmod.fn, len(kmod.captured)) if has_scores(kmod) else _identity


def apply_grad(kmod: KernelMod | None):
    """grad (d fn / d score) as a device function like `apply_fn`'s (1 without a mod); a forward-only mod
    has none, and a backward kernel is never built for it (`check_backward`)."""
    if not has_scores(kmod):
        return _one
    if kmod.grad is None:
        raise ValueError("a score_mod without grad has no backward (ScoreMod(fn, grad=...))")
    return _caller(kmod.grad, len(kmod.captured), what="grad")


@functools.lru_cache(maxsize=None)
def tile_mod(kmod: KernelMod | None, TM: int, TN: int):
    """The mod on a TM x TN micro-tile of S (the tile engine's): a device function

        tile_mod(s, dead, b, h, row, col, n_q, n_k, delta, partial, causal, lists, captured)

    s[a, c] := fn(s[a, c], b, h, row + a, col + c) at the visible pairs (row + a < N_q, col + c < N_k and, in a
    PARTIAL tile, not masked: causal col + c <= row + a + delta, or for a block mask not dead[a, c], which
    the kernel's mask step has set). Called after the mask, whose -inf it leaves at the masked pairs."""
    apply = apply_fn(kmod)

    @cuda.jit(device=True, inline=True)
    def modded_tile(s, dead, b, h, row, col, n_q, n_k, delta, partial, causal, lists, captured):
        for a in range(TM):
            r = row + a
            for c in range(TN):
                key = col + c
                visible = r < n_q and key < n_k
                if partial:
                    if lists:
                        visible = visible and not dead[a, c]
                    elif causal:
                        visible = visible and key <= r + delta
                if visible:
                    s[a, c] = apply(s[a, c], b, h, r, key, captured)

    return modded_tile


@functools.lru_cache(maxsize=None)
def row_mod(kmod: KernelMod | None):
    """The mod on one query row's scores (the one-thread-per-row kernels'): a device function

        row_mod(s, c_lo, c_hi, b, h, row, c0, use_dense, dense, captured)

    s[c] := fn(s[c], b, h, row, c0 + c) for the visible keys c in [c_lo, c_hi) (those `visible_range` gives,
    less the pairs a dense block mask or a mask_mod hides, whose -inf it leaves)."""
    from fa_numba.kernels.mask_mod import pair_visible

    apply = apply_fn(kmod)
    pair = pair_visible(kmod)

    @cuda.jit(device=True, inline=True)
    def modded_row(s, c_lo, c_hi, b, h, row, c0, use_dense, dense, captured):
        for c in range(c_lo, c_hi):
            if not use_dense or pair(dense, b, h, row, c0 + c, captured):
                s[c] = apply(s[c], b, h, row, c0 + c, captured)

    return modded_row


# ----------------------------------------------------------------------------------------------------
# Before any launch: does Numba compile the mod?


def _array_types(kinds: tuple) -> tuple:
    """Numba types of C-contiguous arrays of these (dtype name, ndim) kinds."""
    from numba import types

    return tuple(types.Array(getattr(types, dtype), ndim, "C") for dtype, ndim in kinds)


@functools.lru_cache(maxsize=None)
def _compiled(f, kinds: tuple):
    """(None, f's return type) if Numba compiles f for the CPU with (float32, int64 x 4, *captured) arguments,
    else (the first line of its explanation, None)."""
    from numba import types

    from fa_numba.slice_masks import compile_for_cpu

    return compile_for_cpu(f, (types.float32,) + (types.int64,) * 4 + _array_types(kinds))


def _index_pair(result, ndim: int) -> str | None:
    """None if a captured_grad's return type is (a tuple of ndim ints, a number), else what it is."""
    from numba import types

    ok = (isinstance(result, types.BaseTuple) and len(result) == 2 and isinstance(result[0], types.BaseTuple)
          and len(result[0]) == ndim and all(isinstance(t, types.Integer) for t in result[0])
          and isinstance(result[1], types.Number))
    return None if ok else (f"it must return (a tuple of {ndim} ints, a number) for the kernels, returns {result} "
                            "(a single int index: wrap it, (i,))")


def check_compiles(mod, *, backward: bool = False, captured: bool = False) -> None:
    """ModCompileError if Numba cannot compile the mod's fn (and grad, for the backward; and each captured_grad,
    for the captured arrays' gradients, which must return (a tuple of one int per axis, a number)) with the
    types a kernel calls it with: score float32; b, h, i, j int64; the captured arrays as they are. Checked on
    the CPU target, which compiles what a CUDA device function can and somewhat more (NumPy calls on arrays,
    allocation): those few still fail on a GPU, at the kernel's compilation."""
    kmod = KernelMod.of(mod)
    functions = [("fn", mod.fn)] + ([("grad", mod.grad)] if backward else [])
    if captured:
        functions += [(f"captured_grad[{k}]", cg) for k, cg in enumerate(mod.captured_grad) if cg is not None]
    for what, f in functions:
        why, result = _compiled(f, kmod.captured)
        if why is None and what.startswith("captured_grad"):
            why = _index_pair(result, kmod.captured[int(what[len("captured_grad["):-1])][1])
        if why is not None:
            name = getattr(f, "__name__", type(f).__name__)
            raise ModCompileError(f"score_mod {mod.name}: Numba cannot compile {what} ({name}) into the kernels: "
                                  f"{why} (a mod must be plain Python on scalars: fa_numba.mods says what "
                                  f"compiles)")


__all__ = ["KernelMod", "MAX_CAPTURED", "ModCompileError", "NO_CAPTURED", "apply_fn", "apply_grad",
           "check_compiles", "device_arrays", "has_mask_fn", "has_scores", "row_mod", "tile_mod", "tuple_type"]
