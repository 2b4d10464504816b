"""Masks given by each row's key interval: packed variable-length batches (`Varlen`: B sequences concatenated
along N, told apart by their offsets, flash-attn's `cu_seqlens`), and a block of any interval mask in the block's
own positions (`restrict`, `Intervals`: what one chunk pair of ring attention sees).

Sequence t holds the queries [qs_t, qs_(t+1)) and the keys [ks_t, ks_(t+1)) of the packed tensors, cu_seqlens_q =
(qs_0 = 0, ..., qs_B = total_q) and cu_seqlens_k likewise; its lengths L_t = qs_(t+1) - qs_t and M_t = ks_(t+1) -
ks_t may differ and may be 0. A query sees only keys of its own sequence, aligned bottom-right inside it (as
flash-attn does per sequence): with local positions a = i - qs_t, b = j - ks_t and delta_t = M_t - L_t,

    visible(i, j)  iff  t(i) = t(j)  and  -left <= b - (a + delta_t) <= right,

left / right None for unbounded (`causal` is right = 0). Row i therefore sees one interval of keys,
[ks_t + max(0, a + delta_t - left), ks_t + min(M_t, a + delta_t + right + 1)), empty where it sees none: the
mask's kernel form is "intervals" (each row's [lo, hi)), computed from the offsets in closed form, and a
tile's kind from its rows' intervals (SKIP iff no row's interval meets the tile's keys, FULL iff every row's
holds them), never from a scan of the pairs. `Varlen` is a `masks.Mask`, so every layer that takes a mask takes
a packed batch: both engines, forward and backward, the tiled spec, the I/O model (which then counts the tiles
a packed batch visits, not B max_L^2).

`varlen(cu_seqlens_q, cu_seqlens_k, causal=False, window=(None, None))` makes one, checking the offsets by
name; `masks.parse` reads its `spec()` back (`varlen:0,3,7;0,4,9;inf,0`), which is how it crosses the torch
operators without a dense mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from fa_numba import masks, shapes
from fa_numba.tiling import FULL, PARTIAL, SKIP


def check_offsets(name: str, offsets, batch: int | None = None) -> tuple[int, ...]:
    """cu_seqlens as a tuple of ints: 1-D, integer, starting at 0, nondecreasing, at most INDEX_MAX, with
    batch + 1 entries when batch is given. A host array, a list, or a CPU / CUDA tensor (read once to the host:
    the tile lists are built there)."""
    if hasattr(offsets, "detach"):  # a torch tensor, wherever it lives
        offsets = offsets.detach().cpu().numpy()
    elif hasattr(offsets, "copy_to_host"):  # a Numba device array
        offsets = offsets.copy_to_host()
    elif hasattr(offsets, "get") and hasattr(offsets, "__cuda_array_interface__"):  # CuPy
        offsets = offsets.get()
    array = np.asarray(offsets)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32 offsets, flash-attn's cu_seqlens), got dtype {array.dtype}")
    if array.ndim != 1 or array.size < 1:
        raise ValueError(f"{name} must be 1-D with B + 1 >= 1 offsets, got shape {array.shape}")
    if batch is not None and array.size != batch + 1:
        raise ValueError(f"{name} must have B + 1 = {batch + 1} offsets (one more than cu_seqlens_q's sequences), "
                         f"got {array.size}")
    if array[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {array[0]}")
    steps = np.diff(array.astype(np.int64))
    if (steps < 0).any():
        bad = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be nondecreasing (sequence t is [{name}[t], {name}[t + 1])), got {name}[{bad}] = "
                         f"{array[bad]} > {name}[{bad + 1}] = {array[bad + 1]}")
    if int(array[-1]) > masks.INDEX_MAX:
        raise ValueError(f"{name}[-1] (the packed length) must be at most {masks.INDEX_MAX}, got {array[-1]}")
    return tuple(int(x) for x in array)


@dataclass(frozen=True, repr=False, eq=False)
class Intervals(masks.Mask):
    """A mask given by each row's keys [lo_i, hi_i) over one size (N_q = len(lo), N_k): what a ring step's chunk
    pair sees of a global mask (`restrict`). Tiles classified from the rows' intervals as Varlen's are.
    Compared and hashed by content."""

    lo: np.ndarray
    hi: np.ndarray
    n_k: int
    kernel = "intervals"
    VALUE = True  # fixed when made: masks.fixed keeps it, the kernels' mask cache keys by its content

    def __eq__(self, other):
        return (isinstance(other, Intervals) and self.n_k == other.n_k and np.array_equal(self.lo, other.lo)
                and np.array_equal(self.hi, other.hi))

    def __hash__(self):
        return hash((self.n_k, self.lo.tobytes(), self.hi.tobytes()))

    def check(self, n_q, n_k):
        if (n_q, n_k) != (len(self.lo), self.n_k):
            raise ValueError(f"this interval mask is for N_q = {len(self.lo)}, N_k = {self.n_k}, got {n_q}, {n_k}")
        super().check(n_q, n_k)

    def visible(self, i, j, n_q, n_k):
        i = np.asarray(i)
        return (self.lo[i] <= j) & (j < self.hi[i])

    def classify_tile(self, r0, r1, c0, c1, n_q, n_k):
        self._check_tile(r0, r1, c0, c1, n_q, n_k)
        return _interval_kind(self.lo[r0:r1], self.hi[r0:r1], c0, c1)

    def row_intervals(self, n_q, n_k):
        self.check(n_q, n_k)
        return self.lo.astype(np.int32), self.hi.astype(np.int32)

    def describe(self):
        return f"intervals({len(self.lo)} rows x {self.n_k} keys)"


def _interval_kind(lo: np.ndarray, hi: np.ndarray, c0: int, c1: int):
    """SKIP iff no row's [lo, hi) meets [c0, c1); FULL iff every row's holds it."""
    if not (np.maximum(lo, c0) < np.minimum(hi, c1)).any():
        return SKIP
    return FULL if bool(((lo <= c0) & (hi >= c1)).all()) else PARTIAL


def restrict(mask, n_q: int, n_k: int, rows: tuple[int, int], keys: tuple[int, int]):
    """(kind, mask) of the block rows [r0, r1) x keys [c0, c1) of `mask` over (n_q, n_k): its tiling kind and,
    for a PARTIAL block, the block's own mask (an `Intervals` in the block's local positions, from the mask's
    row intervals: a mask without them is a ValueError naming it); None for SKIP and FULL blocks."""
    (r0, r1), (c0, c1) = rows, keys
    intervals = mask.row_intervals(n_q, n_k)
    if intervals is None:
        raise ValueError(f"mask {mask!r} has no row intervals: only interval masks (window, prefix-LM, documents, "
                         "packed sequences) can be cut into blocks")
    lo, hi = (x[r0:r1].astype(np.int64) for x in intervals)
    kind = _interval_kind(lo, hi, c0, c1)
    if kind != PARTIAL:
        return kind, None
    local_lo = np.clip(lo - c0, 0, c1 - c0)
    local_hi = np.maximum(np.clip(hi - c0, 0, c1 - c0), local_lo)
    return kind, Intervals(local_lo, local_hi, c1 - c0)


@dataclass(frozen=True, repr=False)
class Varlen(masks.Mask):
    """The mask of a packed batch (module docstring): offsets of the queries and of the keys, and the window
    inside each sequence (left, right; None unbounded)."""

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    left: int | None = None
    right: int | None = None
    kernel = "intervals"
    VALUE = True  # fixed when made (masks.fixed keeps it): its fields say all

    @property
    def sequences(self) -> int:
        return len(self.cu_q) - 1

    def check(self, n_q, n_k):
        if n_q != self.cu_q[-1] or n_k != self.cu_k[-1]:
            raise ValueError(f"{self.describe()} needs N_q = cu_seqlens_q[-1] = {self.cu_q[-1]} packed queries and "
                             f"N_k = cu_seqlens_k[-1] = {self.cu_k[-1]} packed keys, got N_q = {n_q}, N_k = {n_k}")
        if n_q and n_k:
            super().check(n_q, n_k)

    @functools.cached_property
    def _intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) int64 (N_q,): each packed row's keys, by its sequence's offsets."""
        qs, ks = np.asarray(self.cu_q, np.int64), np.asarray(self.cu_k, np.int64)
        rows = np.arange(qs[-1], dtype=np.int64)
        t = np.searchsorted(qs, rows, side="right") - 1  # a row's sequence: qs_t <= i < qs_(t+1)
        start, length = ks[t], ks[t + 1] - ks[t]
        diagonal = rows - qs[t] + length - (qs[t + 1] - qs[t])  # a + delta_t: the row's bottom-right diagonal
        lo = start + (0 if self.left is None else np.clip(diagonal - self.left, 0, length))
        hi = start + (length if self.right is None else np.clip(diagonal + self.right + 1, 0, length))
        return lo, np.maximum(hi, lo)  # lo = hi: the row sees no key

    def visible(self, i, j, n_q, n_k):
        lo, hi = self._intervals
        i = np.asarray(i)
        return (lo[i] <= j) & (j < hi[i])

    def classify_tile(self, r0, r1, c0, c1, n_q, n_k):
        self._check_tile(r0, r1, c0, c1, n_q, n_k)
        return _interval_kind(*(x[r0:r1] for x in self._intervals), c0, c1)

    def row_intervals(self, n_q, n_k):
        self.check(n_q, n_k)
        return tuple(x.astype(np.int32) for x in self._intervals)

    def _window_text(self) -> str:
        return ",".join(masks.UNBOUNDED if w is None else str(w) for w in (self.left, self.right))

    def describe(self):
        shown = lambda offsets: ",".join(map(str, offsets[:6])) + (",..." if len(offsets) > 6 else "")  # noqa: E731
        return f"varlen(q {shown(self.cu_q)}; k {shown(self.cu_k)}; window {self._window_text()})"

    def spec(self):
        return f"varlen:{','.join(map(str, self.cu_q))};{','.join(map(str, self.cu_k))};{self._window_text()}"


def varlen(cu_seqlens_q, cu_seqlens_k, *, causal: bool = False, window=(None, None)) -> Varlen:
    """The mask of a packed batch: cu_seqlens_q and cu_seqlens_k (B + 1,) offsets (`check_offsets`), causal
    (bottom-right per sequence), window (left, right) per sequence, None or -1 for unbounded (flash-attn's
    window_size); causal and a window's right must agree (causal means right = 0)."""
    cu_q = check_offsets("cu_seqlens_q", cu_seqlens_q)
    cu_k = check_offsets("cu_seqlens_k", cu_seqlens_k, batch=len(cu_q) - 1)
    causal = shapes.check_causal(causal)
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise TypeError(f"window must be a pair (left, right), None or -1 for unbounded, got {window!r}")
    left, right = (None if w is None or (isinstance(w, int) and w < 0) else
                   masks._check_count(side, w, 0) for side, w in zip(("window left", "window right"), window))
    if causal:
        if right not in (None, 0):
            raise ValueError(f"causal=True means a window's right = 0, got right = {right}")
        right = 0
    return Varlen(cu_q, cu_k, left, right)


def parse(args: str, source: str) -> Varlen:
    """The mask of a spec's arguments, "Q0,Q1,...;K0,K1,...;LEFT,RIGHT" (LEFT, RIGHT ints or "inf")."""
    parts = args.split(";")
    if len(parts) != 3:
        raise ValueError(f"mask {source!r}: varlen needs three parts, 'Q0,Q1,...;K0,K1,...;LEFT,RIGHT'")
    offsets = [[masks._parse_int(v, "an offset", source) for v in part.split(",")] for part in parts[:2]]
    window = [masks._parse_int(v, side, source, unbounded=True) for v, side in zip(parts[2].split(","),
                                                                                    ("LEFT", "RIGHT"))]
    if len(window) != 2:
        raise ValueError(f"mask {source!r}: varlen's window needs LEFT,RIGHT")
    return varlen(np.asarray(offsets[0]), np.asarray(offsets[1]), window=tuple(window))
