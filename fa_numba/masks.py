"""Attention masks beyond causal, each with a tile classification and a form a kernel can read
(proofs/L8_block_masks.md).

A mask is a predicate visible(i, j) over query i in [0, N_q) and key j in [0, N_k); the sizes come with
each call, so one mask object serves every problem size it allows. delta = N_k - N_q (bottom-right
alignment, as flash-attn >= 2.1). The built-ins:

    mask                          visible(i, j)                              row interval [lo_i, hi_i) before clipping
    causal()                      j <= i + delta                             [-inf, i + delta + 1)
    sliding_window(left, right)   i + delta - left <= j <= i + delta + right [i + delta - left, i + delta + right + 1)
    prefix_lm(prefix)             j < prefix  or  j <= i + delta             [-inf, max(prefix, i + delta + 1))
    documents(lengths)            doc(i) = doc(j)                            [s_doc(i), s_(doc(i)+1))
    documents(lengths, causal=True)  doc(i) = doc(j) and j <= i              [s_doc(i), i + 1)
    from_function(fn)             fn(i, j)                                   -
    from_dense(array)             array[i, j]                                -

`left` / `right` of None mean unbounded (-inf / +inf above); `sliding_window(None, 0)` and `prefix_lm(0)`
are `causal()` and return it. documents: s_0 = 0, s_(t+1) = s_t + lengths[t], doc(x) = the t with
s_t <= x < s_(t+1) (np.searchsorted), and N_q = N_k = sum(lengths) is required.

Every mask has
    dense(n_q, n_k)                         (N_q, N_k) bool: the brute force, the predicate on every pair
    classify_tile(r0, r1, c0, c1, n_q, n_k) tiling.Kind of rows [r0, r1) x keys [c0, c1): SKIP iff no pair
                                            is visible, FULL iff every pair is, PARTIAL otherwise
    row_intervals(n_q, n_k)                 (lo, hi) int32 (N_q,) each: row i sees exactly the keys
                                            [lo_i, hi_i), 0 <= lo_i <= hi_i <= N_k, lo_i = hi_i iff it
                                            sees none; None for from_function / from_dense
    kernel_form(), kernel_arrays(n_q, n_k)  how a kernel evaluates the mask inside a PARTIAL tile (below)
    check(n_q, n_k)                         ValueError if the mask does not fit these sizes
    describe(), spec()                      "window(128, 0)"; the text `parse` reads back ("window:128,0")
The built-ins' row intervals are their intervals above clipped to [0, N_k). Masks are frozen dataclasses,
hashable and comparable by value (from_function by the identity of fn). Their parameters are ints up to
INDEX_MAX = 2^31 - 1 (the kernels index in int32), refused beyond it when the mask is made.

When a mask means what it means: a built-in or from_dense mask is a value, fixed when it is made. A
from_function mask is a predicate, and fn may read state that changes (the document-id idiom
`lambda i, j: ids[i] == ids[j]`): it is evaluated at every call. `fixed(mask, n_q, n_k)` turns it into the
from_dense mask of its answers; attention, attention_backward and autograd's forward call it once per call
(autograd's backward reuses its forward's evaluation), and only such value masks key a cache
(kernels.block_lists.kernel_mask), so no cache can serve a predicate's old answers.

Tile classification (proofs/L8). Every built-in is a *monotone interval mask*: row i sees the keys in
[lambda_i, eta_i) (the column above, before clipping), lambda_i < eta_i, both nondecreasing in i. For such a
mask a tile is FULL iff lambda_(r1-1) <= c0 and eta_r0 >= c1, and not SKIP iff the first row i0 of the
tile with eta_i0 > c0 exists and has lambda_i0 < c1 (L8.2). Instantiated:

    causal        SKIP iff c0 > r1 - 1 + delta;          FULL iff c1 - 1 <= r0 + delta              (= L3)
    window        with diagonal offsets a_min = c0 - (r1 - 1) - delta, a_max = (c1 - 1) - r0 - delta:
                  SKIP iff a_min > right or a_max < -left; FULL iff -left <= a_min and a_max <= right
    prefix_lm     SKIP iff c0 > max(prefix - 1, r1 - 1 + delta); FULL iff c1 - 1 <= max(prefix - 1, r0 + delta)
    documents     SKIP iff doc(r1 - 1) < doc(c0) or doc(c1 - 1) < doc(r0);
                  FULL iff s_doc(r1-1) <= c0 and c1 <= s_(doc(r0)+1) (one document holds the whole tile)
    documents, causal  SKIP iff c0 >= r1 or s_doc(max(r0, c0)) >= c1;  FULL iff s_doc(r1-1) <= c0 and c1 - 1 <= r0

O(1) per tile (documents: O(log D) for the np.searchsorted of D documents). from_function and from_dense
evaluate their predicate on the tile's r x c pairs, once per tile, on the host: sound and complete by
definition.

How a kernel evaluates a mask inside a PARTIAL tile (FULL tiles need nothing, SKIP tiles are never
touched; the tile lists come from `tiling.block_mask`):

    kernel_form()  kernel_arrays(n_q, n_k)     inside a PARTIAL tile (i, j), for row r and key c
    "causal"       ()                          c <= r + delta: the closed form, delta a launch constant
    "intervals"    (lo, hi) int32, (N_q,) each  lo[r] <= c < hi[r]: the tile reads lo, hi of its r_i rows,
                                               2 int32 per row (8 r_i bytes) per PARTIAL visit
    "dense"        (dense,) uint8, (N_q, N_k)  dense[r, c] != 0: the tile reads its r_i x c_j bytes, per
                                               PARTIAL visit only

window, prefix_lm and documents are "intervals" (their closed forms need only lo and hi per row);
from_function and from_dense are "dense". The dense form is one byte per pair rather than one bit: a
bit-packed tile mask would cut the PARTIAL reads 8x (r_i c_j / 8 bytes) but needs per-tile packing
aligned to B_c and a shift per pair; the byte mask keeps the kernel's read a plain guarded load, and
only PARTIAL tiles pay it.

A row that sees no key under a mask (lo_i = hi_i; for the dense forms, a row of zeros) gets O = 0 and
LSE = -inf, decided by the mask, never by the running state (DESIGN.md, proofs/L8.5).

Layering: this module imports shapes, reference (`causal_mask`, so causal=True and mask=causal() share
one dense definition) and tiling (`Kind`, `causal_kind`); tiling and reference read masks through their
methods (shapes.MASK_METHODS) and do not import this module.

`parse(text)` reads the CLI's mask syntax: "causal", "window:LEFT,RIGHT" (each an int >= 0 or "inf" for
unbounded), "documents:L1,L2,...", "documents-causal:L1,L2,...", "prefix:P".

>>> sliding_window(2, 0).dense(4, 4).astype(int).tolist()
[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]
>>> documents([2, 1]).row_intervals(3, 3)
(array([0, 0, 2], dtype=int32), array([2, 2, 3], dtype=int32))
>>> parse("window:128,0"), sliding_window(None, 0)
(sliding_window(128, 0), causal())
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fa_numba import reference, shapes, tiling
from fa_numba import slice_masks
from fa_numba.slice_masks import SlicedMask, mask_mod  # noqa: F401 - masks.mask_mod is the public name
from fa_numba.tiling import FULL, PARTIAL, SKIP, Kind

KERNEL_FORMS = ("causal", "intervals", "dense")
UNBOUNDED = "inf"  # how `parse` and `spec` write a window side of None
DESCRIBE_MAX_DOCUMENTS = 6  # describe() lists at most this many document lengths
INDEX_MAX = 2**31 - 1  # the largest position, window side or length a mask takes (int32, as the kernels index)


def _check_count(name: str, value, minimum: int, *, allow_none: bool = False, what: str = ""):
    """An int in [minimum, INDEX_MAX] (or None when allowed): the built-ins' parameters. The kernels hold
    positions and interval ends in int32, so a larger value is refused here, when the mask is made, rather
    than overflowing inside a launch. Errors name the argument."""
    expected = f"an int >= {minimum}" + (" or None (unbounded)" if allow_none else "") + what
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {expected}, got {value}")
    if value > INDEX_MAX:
        raise ValueError(f"{name} must be at most {INDEX_MAX} (positions are int32 in the kernels"
                         + ("; None is unbounded" if allow_none else "") + f"), got {value}")
    return int(value)


def _kind(any_visible: bool, all_visible: bool) -> Kind:
    return FULL if all_visible else PARTIAL if any_visible else SKIP


class Mask:
    """What every mask offers; the built-ins and from_function / from_dense are frozen dataclasses below."""

    kernel = "dense"  # the kernel form (KERNEL_FORMS)

    # -- the predicate and its brute force ----------------------------------------------------------

    def visible(self, i: np.ndarray, j: np.ndarray, n_q: int, n_k: int) -> np.ndarray:
        """visible(i, j) for integer arrays i, j (broadcast together): a bool array."""
        raise NotImplementedError

    def check(self, n_q: int, n_k: int) -> None:
        """Raise ValueError if this mask does not fit N_q x N_k (sizes themselves must be ints >= 1)."""
        shapes.check_block("n_q", n_q)
        shapes.check_block("n_k", n_k)

    def dense(self, n_q: int, n_k: int) -> np.ndarray:
        """(N_q, N_k) bool, a new array: the predicate evaluated on every pair."""
        self.check(n_q, n_k)
        i = np.arange(n_q, dtype=np.int64)[:, None]
        j = np.arange(n_k, dtype=np.int64)[None, :]
        return np.array(np.broadcast_to(self.visible(i, j, n_q, n_k), (n_q, n_k)), dtype=bool)

    # -- tiles ------------------------------------------------------------------------------------

    def classify_tile(self, r0: int, r1: int, c0: int, c1: int, n_q: int, n_k: int) -> Kind:
        """Kind of the tile rows [r0, r1) x keys [c0, c1): by evaluating the predicate on its pairs, once."""
        self._check_tile(r0, r1, c0, c1, n_q, n_k)
        tile = np.broadcast_to(self.visible(np.arange(r0, r1, dtype=np.int64)[:, None],
                                            np.arange(c0, c1, dtype=np.int64)[None, :], n_q, n_k),
                               (r1 - r0, c1 - c0))
        return _kind(bool(tile.any()), bool(tile.all()))

    def _check_tile(self, r0, r1, c0, c1, n_q, n_k) -> None:
        self.check(n_q, n_k)
        if not (0 <= r0 < r1 <= n_q and 0 <= c0 < c1 <= n_k):
            raise ValueError(f"a tile needs 0 <= r0 < r1 <= n_q and 0 <= c0 < c1 <= n_k, got rows [{r0}, {r1}), "
                             f"keys [{c0}, {c1}) with n_q={n_q}, n_k={n_k}")

    # -- what a kernel reads ----------------------------------------------------------------------

    def row_intervals(self, n_q: int, n_k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(lo, hi) int32 (N_q,) each, row i sees exactly [lo_i, hi_i); None if the mask has no such form."""
        return None

    def kernel_form(self) -> str:
        """How a kernel evaluates the mask inside a PARTIAL tile: "causal", "intervals" or "dense"."""
        return self.kernel

    def kernel_arrays(self, n_q: int, n_k: int) -> tuple[np.ndarray, ...]:
        """The arrays of `kernel_form`, C-contiguous: () for "causal", (lo, hi) int32 for "intervals",
        (dense,) uint8 (N_q, N_k) for "dense"."""
        self.check(n_q, n_k)
        if self.kernel == "causal":
            return ()
        if self.kernel == "intervals":
            return tuple(np.ascontiguousarray(x) for x in self.row_intervals(n_q, n_k))
        return (np.ascontiguousarray(self.dense(n_q, n_k)).view(np.uint8),)

    # -- names ------------------------------------------------------------------------------------

    def describe(self) -> str:
        raise NotImplementedError

    def spec(self) -> str | None:
        """The text `parse` turns back into this mask, or None (from_function / from_dense have none)."""
        return None

    def __repr__(self) -> str:
        return self.describe()


def _clip_intervals(lo: np.ndarray, hi: np.ndarray, n_k: int) -> tuple[np.ndarray, np.ndarray]:
    """[lambda_i, eta_i) intersected with [0, N_k): clip both ends (L8.3), int32."""
    return np.clip(lo, 0, n_k).astype(np.int32), np.clip(hi, 0, n_k).astype(np.int32)


@dataclass(frozen=True, repr=False)
class Causal(Mask):
    """Bottom-right causal: j <= i + delta. Kinds and dense mask are tiling's and reference's own."""

    kernel = "causal"

    def visible(self, i, j, n_q, n_k):
        return j <= i + (n_k - n_q)

    def dense(self, n_q, n_k):
        self.check(n_q, n_k)
        return reference.causal_mask(n_q, n_k)  # the single definition causal=True uses

    def classify_tile(self, r0, r1, c0, c1, n_q, n_k):
        self._check_tile(r0, r1, c0, c1, n_q, n_k)
        return tiling.causal_kind(r0, r1, c0, c1, n_k - n_q)

    def row_intervals(self, n_q, n_k):
        self.check(n_q, n_k)
        i = np.arange(n_q, dtype=np.int64)
        return _clip_intervals(np.zeros(n_q, np.int64), i + (n_k - n_q) + 1, n_k)

    def describe(self):
        return "causal"

    def spec(self):
        return "causal"

    def __repr__(self):
        return "causal()"


@dataclass(frozen=True, repr=False)
class SlidingWindow(Mask):
    """Query i sees keys i + delta - left ... i + delta + right (None: unbounded on that side)."""

    left: int | None
    right: int | None
    kernel = "intervals"

    def __post_init__(self):
        object.__setattr__(self, "left", _check_count("left", self.left, 0, allow_none=True))
        object.__setattr__(self, "right", _check_count("right", self.right, 0, allow_none=True))

    def visible(self, i, j, n_q, n_k):
        offset = j - i - (n_k - n_q)  # the diagonal offset a = j - i - delta
        ok = np.ones(np.broadcast(i, j).shape, dtype=bool)
        if self.left is not None:
            ok &= offset >= -self.left
        if self.right is not None:
            ok &= offset <= self.right
        return ok

    def classify_tile(self, r0, r1, c0, c1, n_q, n_k):
        self._check_tile(r0, r1, c0, c1, n_q, n_k)
        delta = n_k - n_q
        a_min = c0 - (r1 - 1) - delta  # the tile's offsets j - i - delta are every integer in [a_min, a_max]
        a_max = (c1 - 1) - r0 - delta
        if (self.right is not None and a_min > self.right) or (self.left is not None and a_max < -self.left):
            return SKIP
        if (self.left is None or a_min >= -self.left) and (self.right is None or a_max <= self.right):
            return FULL
        return PARTIAL

    def row_intervals(self, n_q, n_k):
        self.check(n_q, n_k)
        diagonal = np.arange(n_q, dtype=np.int64) + (n_k - n_q)
        lo = diagonal - self.left if self.left is not None else np.zeros(n_q, np.int64)
        hi = diagonal + self.right + 1 if self.right is not None else np.full(n_q, n_k, np.int64)
        return _clip_intervals(lo, hi, n_k)

    def _side(self, value, none):
        return none if value is None else str(value)

    def describe(self):
        return f"window({self._side(self.left, UNBOUNDED)}, {self._side(self.right, UNBOUNDED)})"

    def spec(self):
        return f"window:{self._side(self.left, UNBOUNDED)},{self._side(self.right, UNBOUNDED)}"

    def __repr__(self):
        return f"sliding_window({self.left}, {self.right})"


@dataclass(frozen=True, repr=False)
class PrefixLM(Mask):
    """Keys [0, prefix) are seen by every query (a bidirectional prefix); beyond it, causal."""

    prefix: int
    kernel = "intervals"

    def __post_init__(self):
        object.__setattr__(self, "prefix", _check_count("prefix", self.prefix, 0))

    def visible(self, i, j, n_q, n_k):
        return (j < self.prefix) | (j <= i + (n_k - n_q))

    def classify_tile(self, r0, r1, c0, c1, n_q, n_k):
        self._check_tile(r0, r1, c0, c1, n_q, n_k)
        delta = n_k - n_q
        # visible iff j <= g(i) = max(prefix - 1, i + delta), g nondecreasing: L3's rule with g for i + delta.
        if c0 > max(self.prefix - 1, r1 - 1 + delta):
            return SKIP
        if c1 - 1 <= max(self.prefix - 1, r0 + delta):
            return FULL
        return PARTIAL

    def row_intervals(self, n_q, n_k):
        self.check(n_q, n_k)
        i = np.arange(n_q, dtype=np.int64)
        return _clip_intervals(np.zeros(n_q, np.int64), np.maximum(self.prefix, i + (n_k - n_q) + 1), n_k)

    def describe(self):
        return f"prefix_lm({self.prefix})"

    def spec(self):
        return f"prefix:{self.prefix}"

    def __repr__(self):
        return f"prefix_lm({self.prefix})"


@dataclass(frozen=True, repr=False)
class Documents(Mask):
    """Packed sequences for self-attention: query i sees key j iff both are in the same document (and,
    with causal, j <= i). N_q = N_k = sum(lengths)."""

    lengths: tuple[int, ...]
    causal: bool = False
    kernel = "intervals"

    def __post_init__(self):
        lengths = self.lengths
        if isinstance(lengths, np.ndarray):
            lengths = lengths.tolist()
        if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
            raise TypeError(f"lengths must be a sequence of ints >= 1 (document lengths), got "
                            f"{type(lengths).__name__} {lengths!r}")
        lengths = tuple(_check_count(f"lengths[{t}]", n, 1, what=" (a document length)")
                        for t, n in enumerate(lengths))
        if not lengths:
            raise ValueError("lengths must hold at least one document length, got an empty sequence")
        if sum(lengths) > INDEX_MAX:
            raise ValueError(f"lengths must sum to at most {INDEX_MAX} (N = sum(lengths) positions, int32 in the "
                             f"kernels), got {sum(lengths)}")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "causal", shapes.check_causal(self.causal))

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """(D + 1,) int64: s_0 = 0, s_(t+1) = s_t + lengths[t]; document t is [s_t, s_(t+1))."""
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def doc(self, x):
        """The document of position(s) x: the t with s_t <= x < s_(t+1)."""
        return np.searchsorted(self.starts, x, side="right") - 1

    def check(self, n_q, n_k):
        super().check(n_q, n_k)
        if n_q != self.total or n_k != self.total:
            raise ValueError(f"{self.describe()} is a self-attention mask: it needs n_q = n_k = sum(lengths) = "
                             f"{self.total}, got n_q={n_q}, n_k={n_k}")

    def visible(self, i, j, n_q, n_k):
        same = self.doc(i) == self.doc(j)
        return same & (j <= i) if self.causal else same

    def classify_tile(self, r0, r1, c0, c1, n_q, n_k):
        self._check_tile(r0, r1, c0, c1, n_q, n_k)
        s = self.starts
        if self.causal:  # lambda_i = s_doc(i), eta_i = i + 1: first row reaching c0 is max(r0, c0)
            first = max(r0, c0)
            if first >= r1 or s[self.doc(first)] >= c1:
                return SKIP
            full = s[self.doc(r1 - 1)] <= c0 and c1 - 1 <= r0
        else:  # lambda_i = s_doc(i), eta_i = s_doc(i)+1: SKIP iff the tile's row and key documents are disjoint
            if self.doc(r1 - 1) < self.doc(c0) or self.doc(c1 - 1) < self.doc(r0):
                return SKIP
            full = s[self.doc(r1 - 1)] <= c0 and c1 <= s[self.doc(r0) + 1]
        return FULL if full else PARTIAL

    def row_intervals(self, n_q, n_k):
        self.check(n_q, n_k)
        i = np.arange(n_q, dtype=np.int64)
        t = self.doc(i)
        return _clip_intervals(self.starts[t], i + 1 if self.causal else self.starts[t + 1], n_k)

    def _lengths_text(self, limit=None):
        shown = self.lengths if limit is None or len(self.lengths) <= limit else self.lengths[:limit]
        text = ", ".join(map(str, shown))
        if len(shown) < len(self.lengths):
            text += f", ... ({len(self.lengths)} documents, N = {self.total})"
        return text

    def describe(self):
        name = "documents-causal" if self.causal else "documents"
        return f"{name}({self._lengths_text(DESCRIBE_MAX_DOCUMENTS)})"

    def spec(self):
        return ("documents-causal:" if self.causal else "documents:") + ",".join(map(str, self.lengths))

    def __repr__(self):
        causal = ", causal=True" if self.causal else ""
        return f"documents([{self._lengths_text()}]{causal})"


@dataclass(frozen=True, repr=False)
class FromFunction(Mask):
    """visible(i, j) = fn(i, j), fn taking NumPy integer arrays (broadcast together) and returning a bool
    array of their broadcast shape (or one that broadcasts to it)."""

    fn: Callable

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"fn must be a callable fn(i, j) -> bool array, got {type(self.fn).__name__}")

    def visible(self, i, j, n_q, n_k):
        out = np.asarray(self.fn(i, j))
        if out.dtype != np.bool_:
            raise TypeError(f"fn(i, j) must return a bool array, got dtype {out.dtype} from {self.describe()}")
        shape = np.broadcast(i, j).shape
        try:
            return np.broadcast_to(out, shape)
        except ValueError:
            raise ValueError(f"fn(i, j) must return an array of the broadcast shape of i and j, {shape}, got "
                             f"shape {out.shape} from {self.describe()}") from None

    def _name(self) -> str:
        """A function's qualified name, or the repr of another callable (e.g. a dataclass instance)."""
        return getattr(self.fn, "__qualname__", None) or repr(self.fn)

    def describe(self):
        return f"function({self._name()})"

    def __repr__(self):
        return f"from_function({self._name()})"


@dataclass(frozen=True, repr=False)
class FromDense(Mask):
    """visible(i, j) = array[i, j] for one (N_q, N_k) bool array, stored as bytes (hashable)."""

    shape: tuple[int, int]
    data: bytes = field(repr=False)

    def __post_init__(self):
        if (not isinstance(self.shape, tuple) or len(self.shape) != 2
                or not all(isinstance(n, int) and n >= 1 for n in self.shape)):
            raise ValueError(f"shape must be (N_q, N_k) with ints >= 1, got {self.shape!r}")
        if not isinstance(self.data, bytes) or len(self.data) != self.shape[0] * self.shape[1]:
            raise ValueError(f"data must be {self.shape[0] * self.shape[1]} bytes (one bool per pair), "
                             f"got {type(self.data).__name__} of length {len(self.data)}")

    @functools.cached_property
    def array(self) -> np.ndarray:
        """The (N_q, N_k) bool array, read-only (a view of `data`)."""
        return np.frombuffer(self.data, dtype=np.bool_).reshape(self.shape)

    def check(self, n_q, n_k):
        super().check(n_q, n_k)
        if (n_q, n_k) != self.shape:
            raise ValueError(f"from_dense mask of shape {self.shape[0]}x{self.shape[1]} (N_q x N_k) does not fit "
                             f"n_q={n_q}, n_k={n_k}")

    def visible(self, i, j, n_q, n_k):
        return self.array[i, j]

    def dense(self, n_q, n_k):
        self.check(n_q, n_k)
        return self.array.copy()

    def describe(self):
        return f"dense({self.shape[0]}x{self.shape[1]}, {int(self.array.sum())} visible)"

    def __repr__(self):
        return f"from_dense(<{self.shape[0]}x{self.shape[1]} bool, {int(self.array.sum())} visible>)"


# ----------------------------------------------------------------------------------------------------
# Constructors (the public names).


def causal() -> Causal:
    """Bottom-right causal: query i sees key j iff j <= i + N_k - N_q (what causal=True means)."""
    return Causal()


def sliding_window(left: int | None, right: int | None) -> Mask:
    """Query i sees keys j with i + delta - left <= j <= i + delta + right, delta = N_k - N_q (bottom-right,
    like flash-attn's window_size=(left, right)); None is unbounded on that side. left, right: ints >= 0 or
    None. sliding_window(None, 0) is causal() and returns it; sliding_window(0, 0) is the diagonal only."""
    window = SlidingWindow(left, right)
    return Causal() if (window.left, window.right) == (None, 0) else window


def prefix_lm(prefix: int) -> Mask:
    """Every query sees keys [0, prefix) (a bidirectional prefix), and causally beyond: j < prefix or
    j <= i + delta. prefix: an int >= 0; prefix_lm(0) is causal() and returns it."""
    mask = PrefixLM(prefix)
    return Causal() if mask.prefix == 0 else mask


def documents(lengths, causal: bool = False) -> Documents:
    """Packed sequences (self-attention, N_q = N_k = sum(lengths)): query i sees key j iff they are in the
    same document, and with causal=True also j <= i. lengths: ints >= 1, in order."""
    return Documents(lengths, causal)


def from_function(fn: Callable) -> FromFunction:
    """Any mask as a predicate fn(i, j) -> bool array over NumPy integer arrays (broadcast together),
    evaluated on the host: once per tile to classify it, on every pair for `dense`."""
    return FromFunction(fn)


def from_dense(array) -> FromDense:
    """Any mask as an (N_q, N_k) bool array (copied): array[i, j] says whether query i sees key j. A 4-D
    (B_m, H_m, N_q, N_k) array is a mask that differs by batch and head (`slice_masks.dense_slices`)."""
    array = np.asarray(array)
    if array.ndim == 4:
        return slice_masks.dense_slices(array)
    if array.ndim != 2 or 0 in array.shape:
        raise ValueError(f"array must be a 2-D (N_q, N_k) bool array with N_q, N_k >= 1, got shape {array.shape}")
    if array.dtype != np.bool_:
        raise TypeError(f"array must be a bool array (True = visible), got dtype {array.dtype}")
    return FromDense((int(array.shape[0]), int(array.shape[1])), np.ascontiguousarray(array).tobytes())


VALUE_MASKS = (Causal, SlidingWindow, PrefixLM, Documents, FromDense)  # fixed when made: their fields say all


def fixed(mask: Mask, n_q: int, n_k: int) -> Mask:
    """The mask as a value on N_q x N_k: a built-in or from_dense mask is one already and comes back as is;
    any other (from_function, or a mask class of one's own) is evaluated now, on every pair, and comes back
    as from_dense of its answers. Call it once per launch: a predicate reading changing state is then seen
    as it is at that call, and every cache keys by content."""
    if isinstance(mask, VALUE_MASKS) or getattr(type(mask), "VALUE", False):  # VALUE: a value mask defined
        mask.check(n_q, n_k)                                                      # elsewhere (fa_numba.packed)
        return mask
    if isinstance(mask, SlicedMask):  # a 4-D from_dense is a value; a mask_mod's scan keys by content
        return mask
    return from_dense(mask.dense(n_q, n_k))


# ----------------------------------------------------------------------------------------------------
# The CLI's syntax.

SYNTAX = ('"causal", "window:LEFT,RIGHT" (ints >= 0, or "inf" for unbounded), "documents:L1,L2,...", '
          '"documents-causal:L1,L2,...", "prefix:P", "varlen:Q0,Q1,...;K0,K1,...;LEFT,RIGHT"')


def _parse_int(text: str, what: str, source: str, *, unbounded: bool = False) -> int | None:
    word = text.strip()
    if unbounded and word.lower() == UNBOUNDED:
        return None
    expected = f"an int >= 0 or {UNBOUNDED!r} (unbounded)" if unbounded else "an int"
    try:
        value = int(word)
    except ValueError:
        raise ValueError(f"mask {source!r}: {what} must be {expected}, got {word!r}") from None
    if unbounded and value < 0:
        raise ValueError(f"mask {source!r}: {what} must be {expected}, got {value} (write {UNBOUNDED!r} for unbounded)")
    return value


def parse(text: str) -> Mask:
    """A mask from its CLI text: "causal", "window:128,0", "window:inf,0", "documents:100,300,50",
    "documents-causal:100,300,50", "prefix:64". ValueError naming the expected syntax otherwise."""
    if not isinstance(text, str):
        raise TypeError(f"mask text must be a str, one of {SYNTAX}; got {type(text).__name__}")
    source = text
    name, sep, args = text.strip().partition(":")
    name = name.strip().lower()
    if name == "causal" and not sep:
        return causal()
    if not sep or name not in ("window", "documents", "documents-causal", "prefix", "varlen"):
        raise ValueError(f"mask {source!r}: expected one of {SYNTAX}")
    if name == "varlen":  # a packed batch's offsets (fa_numba.packed, which imports this module)
        from fa_numba import packed

        return packed.parse(args, source)
    values = args.split(",")
    try:
        if name == "window":
            if len(values) != 2:
                raise ValueError(f"mask {source!r}: window needs two values LEFT,RIGHT (ints >= 0 or "
                                 f"{UNBOUNDED!r}), e.g. window:128,0; got {len(values)}")
            left, right = (_parse_int(v, side, source, unbounded=True) for v, side in zip(values, ("LEFT", "RIGHT")))
            return sliding_window(left, right)
        if name == "prefix":
            if len(values) != 1:
                raise ValueError(f"mask {source!r}: prefix needs one value P (an int >= 0), e.g. prefix:64")
            return prefix_lm(_parse_int(values[0], "P", source))
        lengths = [_parse_int(v, "each document length", source) for v in values]
        return documents(lengths, causal=name == "documents-causal")
    except (TypeError, ValueError) as error:
        if str(error).startswith(f"mask {source!r}"):
            raise
        raise ValueError(f"mask {source!r}: {error}") from None
