"""Which pairs a tensor-core kernel's warps see and which tiles its blocks visit: no mask, causal (closed
forms), or a block mask's lists (kernels.block_lists: intervals, dense bytes or a mask_mod's function; one
(N_q, N_k) mask or one per (batch, head)).

    M = make(causal, form, kmod)

M.LISTS: the kernel walks the block mask's lists (form in LIST_FORMS). M.GUARDED: some tile may hide a pair
between a row and a key that both hold data (causal or lists), so the kernel carries the exact CUDA-core path
for tiles whose staged data holds inf or NaN (a masked pair is never multiplied, proofs/L7.8; without a mask the
hidden pairs involve padded rows or keys, staged as zeros).

    M.visible(row, key, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured) -> bool

whether query row `row` sees key `key`: both in range (the row's test left out of a forward's closed forms,
`make(rows=False)`) and, causal, key <= row + N_k - N_q (bottom-right); with
lists, key inside the row's interval [lo, hi) and, for the "dense" form, the mask's byte, for "function" the
mask_mod's fn(b, h, row, key, *its arrays) (h the query head). The kernels ask only inside a tile the lists call
PARTIAL or a tail tile, so fn is never called in a SKIP or FULL tile nor past N_q or N_k.

    M.slot(x, b, h) -> (sb, sh)

The slice a block reads in the mask arrays' leading (B_m, H_m) axes: (min(b, B_m - 1), min(h, H_m - 1)), an axis
of length 1 broadcast. The tensor-core kernels index the 3-D and 4-D arrays with it instead of taking a view of
the slice, as the CUDA-core kernels do (kernels.mask_mod.mask_slice): a view holds its pointer, shape and strides
in registers, which these kernels have none to spare for (the backward's kv kernel compiles to 254 of 255 at
d = 128), where two integers and the arguments' constant-bank shapes cost two registers.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import cuda

from fa_numba.kernels.block_lists import LIST_FORMS
from fa_numba.kernels.mask_mod import mask_caller

FORMS = ("none", "causal") + LIST_FORMS


@cuda.jit(device=True, inline=True)
def slot(x, b, h):
    """(sb, sh): the (batch, head) slice of a per-slice mask array x (B_m, H_m, ...), an axis of length 1 broadcast."""
    return min(b, x.shape[0] - 1), min(h, x.shape[1] - 1)


@cuda.jit(device=True, inline=True)
def _no_fn(b, h, i, j, captured):
    return True


@functools.lru_cache(maxsize=None)
def make(causal: bool, form: str, kmod=None, rows: bool = True) -> SimpleNamespace:
    """The masking of a kernel compiled for `causal` and block-mask `form` (module docstring); kmod: the
    kernel's KernelMod, whose `mask` is the mask_mod's fn for the "function" form. rows: whether the closed
    forms test row < N_q too (the backward's products reach padded rows; the forward never writes a padded
    row, so its closed form leaves the test out: one compare per masked score fewer)."""
    if form not in FORMS:
        raise ValueError(f"mask form must be one of {FORMS}, got {form!r}")
    lists = form in LIST_FORMS
    if lists and causal:
        raise ValueError("a block mask's lists and causal=True are exclusive: a causal block mask is masks.causal()")
    if form == "function" and (kmod is None or kmod.mask is None):
        raise ValueError("the 'function' mask form needs the mask_mod's function in the kernel's KernelMod")
    CAUSAL, LISTS, DENSE, FN, ROWS = bool(causal), lists, form == "dense", form == "function", bool(rows)
    call = mask_caller(kmod.mask, len(kmod.captured), len(kmod.mask_captured)) if FN else _no_fn

    @cuda.jit(device=True, inline=True)
    def visible(row, key, n_q, n_k, delta, lohis, denses, sb, sh, b, h, captured):
        if LISTS:
            if row >= n_q or key >= n_k or key < lohis[sb, sh, row, 0] or key >= lohis[sb, sh, row, 1]:
                return False
            if DENSE:
                return denses[sb, sh, row, key] != 0
            if FN:
                return call(b, h, row, key, captured)
            return True
        return (not ROWS or row < n_q) and key < n_k and (not CAUSAL or key <= row + delta)

    return SimpleNamespace(LISTS=LISTS, GUARDED=CAUSAL or LISTS, visible=visible, slot=slot)


__all__ = ["FORMS", "make", "slot"]
