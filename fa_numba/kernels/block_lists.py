"""A block mask as the kernels read it: the tile lists, row intervals and dense bytes of `tiling.BlockMask` and of
the masks that differ by batch and head (`fa_numba.slice_masks`), one slice per (batch, head) of the mask's own
(B_m, H_m) axes, copied to the device and cached; and the placeholders a kernel without a block mask takes.
Each block of a kernel reads its own slice (`kernels.mask_mod.mask_slice`).
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda

LIST_FORMS = ("intervals", "dense", "function")
PAIR_FORMS = ("dense", "function")  # the block-mask forms tested pair by pair inside a PARTIAL tile
MASK_FORMS = ("none", "causal") + LIST_FORMS


@dataclass(frozen=True)
class KernelMask:
    """A block mask as the kernels read it, device arrays (tiling.BlockMask on the device):

    row_ptr (T_r + 1,), col_idx, col_kind (nnz,): the key tiles of each query tile (v2, backward order q);
    col_ptr (T_c + 1,), row_idx, row_kind (nnz,): the query tiles of each key tile (v1, backward order kv);
    lohi (N_q, 2) int32: every key a row sees lies in [lohi[i, 0], lohi[i, 1]) (exactly those keys for
    the "intervals" form; lo = hi on a row that sees nothing); dense (N_q, N_k) uint8: the mask itself,
    read only in PARTIAL tiles ("dense" form; a placeholder otherwise: "function" calls the mask_mod).
    Each array has two leading slice axes (B_m, H_m): (1, 1) for one (N_q, N_k) mask, else the batch and
    head axes of a mask that differs by them; a block reads its slice (kernels.mask_mod.mask_slice) and
    nnz is the longest slice's (the others padded, never read past their ptr range).
    """

    form: str
    row_ptr: object
    col_idx: object
    col_kind: object
    col_ptr: object
    row_idx: object
    row_kind: object
    lohi: object
    dense: object


def kernel_mask(mask, n_q: int, n_k: int, block_q: int, block_k: int, batch: int = 1,
                heads: int = 1) -> "KernelMask":
    """The KernelMask of a block mask (a fa_numba.masks mask whose kernel_form() is "intervals" or "dense",
    or a mask that differs by batch and head: fa_numba.slice_masks, "dense" or "function") on the B_r x B_c
    grid of a (batch, heads) problem, copied to the device once per (mask, sizes, tiles) and cached.

    The cache keys by the mask's value, so it holds value masks only (masks.VALUE_MASKS: built-ins and
    from_dense, fixed when made). A from_function mask is evaluated now, masks.fixed(mask, n_q, n_k), and
    that evaluation is what is cached; a mask_mod's scan keys by its content (slice_masks.MaskMod.scan), and
    its lists are rebuilt from the scan at each call: a predicate reading changed state is never served its
    old tile lists.

    lohi: the row intervals ("intervals"), or for a dense mask or a mask_mod each row's first and last visible
    key + 1 (a superset the kernels refine pair by pair inside PARTIAL tiles; lo = hi on a row that sees none).
    Every array carries the (B_m, H_m) slice axes first ((1, 1) for one (N_q, N_k) mask).
    """
    from fa_numba import masks

    if getattr(mask, "sliced", False):
        mask.check_slices(batch, heads, n_q, n_k)
        if mask.kernel_form() == "function":
            kinds, lohi = mask.scan(batch, heads, n_q, n_k, block_q, block_k)  # cached by content
            if id(kinds) not in _FUNCTION_MASKS:  # the scan's own arrays: one device copy per scan
                _FUNCTION_MASKS[id(kinds)] = (kinds, _device_mask("function", kinds, lohi,
                                                                  np.zeros((1, 1, 1, 1), np.uint8)))
                while len(_FUNCTION_MASKS) > FUNCTION_MASKS_KEPT:
                    _FUNCTION_MASKS.popitem(last=False)
            _FUNCTION_MASKS.move_to_end(id(kinds))
            return _FUNCTION_MASKS[id(kinds)][1]
        return _kernel_mask(mask, n_q, n_k, block_q, block_k, batch, heads)
    return _kernel_mask(masks.fixed(mask, n_q, n_k), n_q, n_k, block_q, block_k, 1, 1)


# A mask_mod's device lists, keyed by the identity of its scan's kinds array (which the entry holds, so the
# id cannot be reused while it is kept): a new scan (new content) is a new array, hence a new entry.
_FUNCTION_MASKS: "collections.OrderedDict" = collections.OrderedDict()
FUNCTION_MASKS_KEPT = 16


def _dense_lohi(dense: np.ndarray) -> np.ndarray:
    """(..., N_q, 2) int32: each row's first visible key and last visible key + 1 (0, 0 on a row that sees none)."""
    n_k = dense.shape[-1]
    seen = dense.astype(bool)
    any_key = seen.any(axis=-1)
    lo = np.where(any_key, seen.argmax(axis=-1), 0)
    hi = np.where(any_key, n_k - seen[..., ::-1].argmax(axis=-1), 0)
    return np.stack([lo, hi], axis=-1).astype(np.int32)


@functools.lru_cache(maxsize=64)
def _kernel_mask(mask, n_q: int, n_k: int, block_q: int, block_k: int, batch: int, heads: int) -> "KernelMask":
    from fa_numba import tiling

    form = mask.kernel_form()
    if form not in LIST_FORMS:
        raise ValueError(f"mask {mask!r} has kernel form {form!r}: launch it with causal=True instead")
    if getattr(mask, "sliced", False):  # a (B_m, H_m, N_q, N_k) dense mask: classified slice by slice
        dense = np.ascontiguousarray(mask.dense_slices(batch, heads, n_q, n_k)).view(np.uint8)
        kinds = np.stack([np.stack([tiling.block_mask(n_q, n_k, block_q, block_k, _slice_mask(sl)).kinds
                                    for sl in row]) for row in dense])
        return _device_mask(form, kinds, _dense_lohi(dense), dense)
    kinds = tiling.block_mask(n_q, n_k, block_q, block_k, mask).kinds[None, None]
    if form == "intervals":
        lo, hi = mask.kernel_arrays(n_q, n_k)
        lohi = np.stack([lo, hi], axis=1).astype(np.int32)
        dense = np.zeros((1, 1), np.uint8)
    else:
        (dense,) = mask.kernel_arrays(n_q, n_k)
        lohi = _dense_lohi(dense)
    return _device_mask(form, kinds, lohi[None, None], dense[None, None])


def _slice_mask(dense_slice: np.ndarray):
    from fa_numba import masks

    return masks.from_dense(dense_slice.astype(bool))


def _csr_padded(kinds: np.ndarray):
    """The CSR lists (tiling.csr) of every slice of (B_m, H_m, rows, cols) kinds, stacked, the index lists
    padded to the longest slice's (a kernel reads only its slice's ptr range)."""
    from fa_numba import tiling

    b_m, h_m = kinds.shape[:2]
    per = [[tiling.csr(kinds[b, h]) for h in range(h_m)] for b in range(b_m)]
    width = max(1, max(len(idx) for row in per for _, idx, _ in row))  # a device array cannot be empty
    ptr = np.stack([np.stack([p for p, _, _ in row]) for row in per]).astype(np.int32)
    idx = np.zeros((b_m, h_m, width), np.int32)
    kind = np.zeros((b_m, h_m, width), np.int8)
    for b in range(b_m):
        for h in range(h_m):
            _, i, k = per[b][h]
            idx[b, h, :len(i)] = i
            kind[b, h, :len(k)] = k
    return ptr, idx, kind


def _device_mask(form: str, kinds: np.ndarray, lohi: np.ndarray, dense: np.ndarray) -> "KernelMask":
    """Copy the per-slice lists of (B_m, H_m, T_r, T_c) kinds, lohi (B_m, H_m, N_q, 2) and the dense bytes
    (B_m, H_m, N_q, N_k), or a (1, 1, 1, 1) placeholder, to the device."""
    rows = _csr_padded(kinds)
    cols = _csr_padded(np.swapaxes(kinds, -1, -2))
    arrays = rows + cols + (lohi, dense)
    return KernelMask(form, *(cuda.to_device(np.ascontiguousarray(x)) for x in arrays))


_PLACEHOLDERS = {}


def mask_arrays(mask: KernelMask | None) -> tuple:
    """The eight mask arguments of a kernel: the KernelMask's arrays, or one-element placeholders (never
    read) for a kernel without a block mask."""
    if mask is not None:
        return (mask.row_ptr, mask.col_idx, mask.col_kind, mask.col_ptr, mask.row_idx, mask.row_kind, mask.lohi,
                mask.dense)
    key = id(cuda.current_context()) if hasattr(cuda, "current_context") else 0
    if key not in _PLACEHOLDERS:
        i32, i8 = np.zeros((1, 1, 1), np.int32), np.zeros((1, 1, 1), np.int8)
        _PLACEHOLDERS[key] = tuple(cuda.to_device(x) for x in (i32, i32, i8, i32, i32, i8,
                                                               np.zeros((1, 1, 1, 2), np.int32),
                                                               np.zeros((1, 1, 1, 1), np.uint8)))
    return _PLACEHOLDERS[key]


def mask_types() -> tuple:
    """The Numba types of the eight mask arguments, in `mask_arrays` order (what fa_numba.profile compiles)."""
    from numba import types

    vec32, vec8 = types.Array(types.int32, 3, "C"), types.Array(types.int8, 3, "C")  # (B_m, H_m, list)
    return (vec32, vec32, vec8, vec32, vec32, vec8, types.Array(types.int32, 4, "C"),
            types.Array(types.uint8, 4, "C"))


__all__ = ["FUNCTION_MASKS_KEPT", "KernelMask", "LIST_FORMS", "MASK_FORMS", "PAIR_FORMS", "kernel_mask", "mask_arrays",
           "mask_types"]
