"""Masks that differ by batch and head: a dense (B_m, H_m, N_q, N_k) bool array, and `mask_mod(b, h, i, j)`, a
Python predicate Numba compiles into the kernels (issue 27; SDPA's 4-D attn_mask and FlexAttention's mask_mod).

    mask                          visible(b, h, i, j)                slices (B_m, H_m)
    from_dense(array 4-D)         array[b, h, i, j] (broadcast)     array.shape[:2], each 1 or B, 1 or H
    mask_mod(fn, *captured)       fn(b, h, i, j, *captured)          (B, H): every slice evaluated

h is the query head (under GQA several query heads share a K/V head, each with its own mask slice).

How the kernels take them: one tile list per slice (`kernels.block_lists.kernel_mask` stacks the lists of the
(B_m, H_m) slices; a block reads its own slice, broadcast along an axis of length 1), so a tile is SKIP, FULL
or PARTIAL exactly for its own (batch, head). Inside a PARTIAL tile a dense mask reads its bytes, and a
mask_mod calls fn at the pair, compiled into the kernel as an inlined device function ("function" form: no
(N_q, N_k) array in HBM).

How a mask_mod is classified: on the host, by a Numba-compiled (CPU) scan of every pair of every slice,
which gives each tile's SKIP / FULL / PARTIAL and each row's first and last visible key (`scan`); O(B H N_q
N_k) calls of fn (about 2 ns a pair for a document mask on this project's 2-core CPU). The result is
cached by content: the compiled function (Numba freezes its globals and closure when it compiles) and a
digest of the captured arrays' bytes, with the sizes and tiles, never by the function object alone, so new
document ids in the same array object are seen. A global NumPy array read by fn is refused (Numba would
freeze a copy of it: pass it as a captured array).

Where they are taken: `fa_numba.attention`, `attention_backward`, `autograd.attention` on both engines' kernels
(the CUDA-core ones and the tensor-core ones, `kernels/mma/masking.py`), and `reference` (dense, on every slice).
Not taken (a ValueError naming the alternative): `tiling` / `tiled` / `iomodel` / `compare` (one (N_q, N_k)
mask), decoding and ring attention.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import types as pytypes
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fa_numba import shapes

MAX_MASK_CAPTURED = 4  # captured arrays a mask_mod takes (the spelled-out calls of kernels.mask_mod)
KEY_PREFIX = "mask_mod:"  # how a MaskMod's key starts (fa_numba.torch_ops tells it from a mask's text by it)
_LIVE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # MaskMod.key -> the mask, while it lives
_SERIAL = itertools.count(1)


class SlicedMask:
    """What a mask that differs by batch and head offers. The (N_q, N_k) methods of a mask (shapes.MASK_METHODS)
    refuse it, naming what takes it; `dense_slices` is its brute force."""

    sliced = True
    kernel = "dense"

    def slices(self, batch: int, heads: int) -> tuple[int, int]:
        """(B_m, H_m): the slice axes, each 1 (broadcast) or the problem's."""
        raise NotImplementedError

    def check_slices(self, batch: int, heads: int, n_q: int, n_k: int) -> None:
        """ValueError if this mask does not fit a (batch, heads, N_q, N_k) problem."""
        raise NotImplementedError

    def dense_slices(self, batch: int, heads: int, n_q: int, n_k: int) -> np.ndarray:
        """(B_m, H_m, N_q, N_k) bool, a new array: every pair of every slice."""
        raise NotImplementedError

    def kernel_form(self) -> str:
        return self.kernel

    def _refuse(self, *args, **kwargs):
        raise ValueError(f"mask {self!r} differs by batch and head: this path takes one (N_q, N_k) mask "
                         "(fa_numba.attention, attention_backward, autograd.attention and reference take it)")

    check = dense = classify_tile = row_intervals = kernel_arrays = _refuse

    def describe(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.describe()


def _check_slice_axis(name: str, got: int, full: int) -> None:
    if got not in (1, full):
        raise ValueError(f"mask: its {name} axis has length {got}, expected 1 (the same for every {name}) or "
                         f"{full} (the problem's)")


@dataclass(frozen=True, repr=False)
class DenseSlices(SlicedMask):
    """visible(b, h, i, j) = array[b, h, i, j] (an axis of length 1 broadcast), stored as bytes (hashable)."""

    shape: tuple[int, int, int, int]
    data: bytes = field(repr=False)

    def __post_init__(self):
        if (not isinstance(self.shape, tuple) or len(self.shape) != 4
                or not all(isinstance(n, int) and n >= 1 for n in self.shape)):
            raise ValueError(f"shape must be (B_m, H_m, N_q, N_k) with ints >= 1, got {self.shape!r}")
        if not isinstance(self.data, bytes) or len(self.data) != int(np.prod(self.shape)):
            raise ValueError(f"data must be {int(np.prod(self.shape))} bytes (one bool per pair), got "
                             f"{type(self.data).__name__} of length {len(self.data)}")

    @functools.cached_property
    def array(self) -> np.ndarray:
        """The (B_m, H_m, N_q, N_k) bool array, read-only (a view of `data`)."""
        return np.frombuffer(self.data, dtype=np.bool_).reshape(self.shape)

    def slices(self, batch, heads):
        return self.shape[0], self.shape[1]

    def check_slices(self, batch, heads, n_q, n_k):
        _check_slice_axis("batch", self.shape[0], batch)
        _check_slice_axis("head", self.shape[1], heads)
        if (n_q, n_k) != self.shape[2:]:
            raise ValueError(f"from_dense mask of shape {self.shape} (B_m, H_m, N_q, N_k) does not fit n_q={n_q}, "
                             f"n_k={n_k}")

    def dense_slices(self, batch, heads, n_q, n_k):
        self.check_slices(batch, heads, n_q, n_k)
        return self.array.copy()

    def describe(self):
        return f"dense({'x'.join(map(str, self.shape))}, {int(self.array.sum())} visible)"

    def __repr__(self):
        return f"from_dense(<{'x'.join(map(str, self.shape))} bool, {int(self.array.sum())} visible>)"


def dense_slices(array) -> DenseSlices:
    """A (B_m, H_m, N_q, N_k) bool array (copied) as a mask; masks.from_dense calls it for 4-D arrays."""
    array = np.asarray(array)
    if array.ndim != 4 or 0 in array.shape:
        raise ValueError(f"array must be a 4-D (B_m, H_m, N_q, N_k) bool array with every axis >= 1, got shape "
                         f"{array.shape}")
    if array.dtype != np.bool_:
        raise TypeError(f"array must be a bool array (True = visible), got dtype {array.dtype}")
    return DenseSlices(tuple(int(n) for n in array.shape), np.ascontiguousarray(array).tobytes())


# ----------------------------------------------------------------------------------------------------
# mask_mod: a compiled predicate.


class MaskModError(TypeError):
    """Numba cannot compile a mask_mod's function, or it reads a global array (the message names the mod)."""


def _captured_array(name: str, x) -> np.ndarray:
    array = np.asarray(x)
    if array.dtype == np.bool_:
        array = array.astype(np.uint8)  # Numba's CUDA target takes no bool arrays as arguments of device code
    if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)) or array.ndim == 0:
        raise TypeError(f"{name} must be an integer, floating or bool array of at least one axis, got "
                        f"{array.dtype} with {array.ndim} axes")
    return np.ascontiguousarray(array)


def _global_arrays(fn) -> list[str]:
    """Names of the global NumPy arrays fn's code reads (Numba would compile a frozen copy of each)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions and comprehensions
        if isinstance(const, pytypes.CodeType):
            names |= set(const.co_names)
    g = getattr(fn, "__globals__", {})
    return sorted(n for n in names if isinstance(g.get(n), np.ndarray))


@dataclass(frozen=True, eq=False, repr=False)
class MaskMod(SlicedMask):
    """visible(b, h, i, j) = fn(b, h, i, j, *captured): plain Python on ints (and the captured arrays,
    indexed with ints) returning a bool, as Numba compiles device functions. Compared by identity."""

    fn: Callable
    captured: tuple = ()
    name: str | None = None
    key: str = field(default="", init=False)  # "mask_mod:label#serial": unique in this process (`lookup`)

    kernel = "function"

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"fn must be a callable fn(b, h, i, j, *captured) -> bool, got {type(self.fn).__name__}")
        captured = tuple(_captured_array(f"mask_mod captured[{k}]", a) for k, a in enumerate(self.captured))
        if len(captured) > MAX_MASK_CAPTURED:
            raise ValueError(f"mask_mod {self.label}: the kernels take at most {MAX_MASK_CAPTURED} captured arrays, "
                             f"got {len(captured)} (stack arrays of one dtype into one)")
        object.__setattr__(self, "captured", captured)
        object.__setattr__(self, "key", f"{KEY_PREFIX}{self.label}#{next(_SERIAL)}")
        _LIVE[self.key] = self
        arrays = _global_arrays(self.fn)
        if arrays:
            raise MaskModError(f"mask_mod {self.label} reads the global array(s) {', '.join(arrays)}: Numba compiles "
                               "a frozen copy of a global array, so later changes would not be seen; pass each as a "
                               "captured array (masks.mask_mod(fn, array) calls fn(b, h, i, j, array))")

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__qualname__", None) or repr(self.fn)

    @property
    def kinds(self) -> tuple:
        """((dtype name, ndim), ...) of the captured arrays: what a kernel compiles against."""
        return tuple((a.dtype.name, a.ndim) for a in self.captured)

    def digest(self) -> str:
        """A digest of the captured arrays' dtypes, shapes and bytes: with fn, the mask's content."""
        h = hashlib.blake2b(digest_size=16)
        for a in self.captured:
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        return h.hexdigest()

    def slices(self, batch, heads):
        return batch, heads

    def check_slices(self, batch, heads, n_q, n_k):
        for name, n in (("batch", batch), ("heads", heads), ("n_q", n_q), ("n_k", n_k)):
            shapes.check_block(name, n)
        check_compiles(self)

    def dense_slices(self, batch, heads, n_q, n_k):
        self.check_slices(batch, heads, n_q, n_k)
        out = np.zeros((batch, heads, n_q, n_k), dtype=np.bool_)
        _evaluators(self.fn, len(self.captured))[0](batch, heads, n_q, n_k, self.captured, out)
        return out

    def scan(self, batch: int, heads: int, n_q: int, n_k: int, block_q: int, block_k: int):
        """(kinds (B, H, T_r, T_c) int8 as tiling.Kind, lohi (B, H, N_q, 2) int32): each tile's kind in its own
        slice, and each row's first visible key and last visible key + 1 (0, 0 on a row that sees none).
        Cached by content (module docstring)."""
        self.check_slices(batch, heads, n_q, n_k)
        return _scan_cached(self.fn, self.digest(), self.captured, batch, heads, n_q, n_k, block_q, block_k)

    def describe(self):
        return f"mask_mod({self.label})"

    def __repr__(self):
        return self.describe()


def lookup(key: str) -> MaskMod:
    """The live MaskMod whose `key` this is (how a mask_mod crosses fa_numba.torch_ops' operators, as a
    ScoreMod does); a RuntimeError if it is gone (a key is never reused)."""
    mod = _LIVE.get(key)
    if mod is None:
        raise RuntimeError(f"mask_mod {key!r} is no longer alive: keep the mask object referenced while a call or "
                           "a compiled graph that uses it may run")
    return mod


def mask_mod(fn: Callable, *captured, name: str | None = None) -> MaskMod:
    """A mask as a Python predicate fn(b, h, i, j, *captured) -> bool that Numba compiles: into the kernels
    (evaluated inside PARTIAL tiles only) and, for the tile lists, into a CPU scan of every pair (module
    docstring). captured: arrays fn reads (at most MAX_MASK_CAPTURED; bool arrays travel as uint8)."""
    return MaskMod(fn, tuple(captured), name)


# ----------------------------------------------------------------------------------------------------
# The host's compiled evaluation.


@functools.lru_cache(maxsize=None)
def _evaluators(fn, n: int):
    """(evaluate, scan) compiled for the CPU for fn with n captured arrays (the call spelled out per n, as
    kernels.mask_mod does for the GPU)."""
    import numba

    f = numba.njit(fn)
    if n == 0:
        def call(b, h, i, j, c):
            return f(b, h, i, j)
    elif n == 1:
        def call(b, h, i, j, c):
            return f(b, h, i, j, c[0])
    elif n == 2:
        def call(b, h, i, j, c):
            return f(b, h, i, j, c[0], c[1])
    elif n == 3:
        def call(b, h, i, j, c):
            return f(b, h, i, j, c[0], c[1], c[2])
    else:
        def call(b, h, i, j, c):
            return f(b, h, i, j, c[0], c[1], c[2], c[3])
    call = numba.njit(call)

    @numba.njit
    def evaluate(batch, heads, n_q, n_k, captured, out):
        for b in range(batch):
            for h in range(heads):
                for i in range(n_q):
                    for j in range(n_k):
                        out[b, h, i, j] = bool(call(b, h, i, j, captured))

    @numba.njit
    def scan(batch, heads, n_q, n_k, block_q, block_k, captured, seen, full, lohi):
        for b in range(batch):
            for h in range(heads):
                for i in range(n_q):
                    r = i // block_q
                    lo = n_k
                    hi = 0
                    for j in range(n_k):
                        c = j // block_k
                        if bool(call(b, h, i, j, captured)):
                            seen[b, h, r, c] = True
                            if j < lo:
                                lo = j
                            hi = j + 1
                        else:
                            full[b, h, r, c] = False
                    if hi == 0:
                        lo = 0
                    lohi[b, h, i, 0] = lo
                    lohi[b, h, i, 1] = hi

    return evaluate, scan


_SCANS: "collections.OrderedDict" = collections.OrderedDict()  # (fn, digest, sizes, tiles) -> (kinds, lohi)
SCAN_CACHE = 32  # scans kept (least recently used dropped)


def _scan_cached(fn, digest, captured, batch, heads, n_q, n_k, block_q, block_k):
    """The scan of `MaskMod.scan`, keyed by (fn, the captured arrays' digest, sizes, tiles): content, so two
    mods of one function over equal arrays share an entry and an array changed in place misses."""
    from fa_numba.tiling import FULL, PARTIAL, SKIP

    key = (fn, digest, batch, heads, n_q, n_k, block_q, block_k)
    if key in _SCANS:
        _SCANS.move_to_end(key)
        return _SCANS[key]
    t_r, t_c = -(-n_q // block_q), -(-n_k // block_k)
    seen = np.zeros((batch, heads, t_r, t_c), dtype=np.bool_)
    full = np.ones((batch, heads, t_r, t_c), dtype=np.bool_)
    lohi = np.zeros((batch, heads, n_q, 2), dtype=np.int32)
    _evaluators(fn, len(captured))[1](batch, heads, n_q, n_k, block_q, block_k, captured, seen, full, lohi)
    kinds = np.where(full, np.int8(FULL), np.where(seen, np.int8(PARTIAL), np.int8(SKIP))).astype(np.int8)
    kinds.flags.writeable = False
    lohi.flags.writeable = False
    _SCANS[key] = (kinds, lohi)
    while len(_SCANS) > SCAN_CACHE:
        _SCANS.popitem(last=False)
    return kinds, lohi


def compile_for_cpu(f, argtypes: tuple):
    """(None, f's return type) if Numba compiles f for the CPU with these argument types, else (the first
    line of its explanation, None): the check a user's function (a mask_mod here, a score mod in
    kernels.score_mod) gets before any launch, so an error names the function, not a kernel's compilation."""
    import numba

    dispatcher = numba.njit(f)
    try:
        dispatcher.compile(argtypes)
    except Exception as exc:  # noqa: BLE001 - Numba raises several kinds (TypingError, UnsupportedError, ...)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = next((line for line in lines if not line.startswith("Failed in")), lines[0] if lines else repr(exc))
        return why, None
    return None, dispatcher.nopython_signatures[-1].return_type


@functools.lru_cache(maxsize=None)
def _compile_error(fn, kinds: tuple) -> str | None:
    """None if Numba compiles fn for the CPU with (int64 x 4, *captured) arguments to a bool-convertible
    result, else what is wrong."""
    from numba import types

    arrays = tuple(types.Array(getattr(types, dtype), ndim, "C") for dtype, ndim in kinds)
    why, result = compile_for_cpu(fn, (types.int64,) * 4 + arrays)
    if why is None and not isinstance(result, (types.Boolean, types.Integer)):
        return f"it must return a bool, returns {result}"
    return why


def check_compiles(mod: MaskMod) -> None:
    """MaskModError naming the mod if Numba cannot compile its fn with the kernels' argument types."""
    why = _compile_error(mod.fn, mod.kinds)
    if why is not None:
        raise MaskModError(f"mask_mod {mod.label}: Numba cannot compile it into the kernels: {why} (a mask_mod must "
                           "be plain Python on ints returning a bool; arrays come as captured arguments)")


__all__ = ["DenseSlices", "MAX_MASK_CAPTURED", "MaskMod", "MaskModError", "SlicedMask", "check_compiles",
           "compile_for_cpu", "dense_slices", "lookup", "mask_mod"]
