"""numba-cuda's IR inliner, with a callee's blocks copied in one pass: the same IR in linear time.

Every `inline=True` device function is inlined into its caller as Numba IR. At each call site numba-cuda's
`InlineWorker.inline_ir` copies the callee's IR twice (a copy to mutate, and an unmutated one it returns),
calling `copy.deepcopy` once per block. Each block and each variable refer to the function's one `Scope`,
which holds every variable of the function, so every block's copy copies the whole scope again: a copy
costs (blocks x variables) objects instead of (statements + variables). The tensor-core kernels inline
large, written-out device functions at many sites, and the copies dominated their builds (a cProfile of the
3xTF32 v1-mma build at d = 64: 155 s of its 224 s in those deep copies).

`install()` gives the blocks of one copy one shared memo, as `copy.deepcopy` of the whole block mapping
would: the scope is copied once and every copied block and variable refers to that one copy, as every
original block and variable refers to the original scope. The inliner then renames the callee's variables
into the caller's scope, so the copied scope is dropped either way. The code is the same:
`tests/test_inliner.py` builds a kernel of nested inlined functions to PTX and types a shipped kernel both
ways and compares the outputs whole, and the committed SASS table records each listing's hash
(`sass_sha256`), so the SASS of every shipped configuration can be compared across builds.

A copy's blocks share a memo while their scope is the same object; inside one `inline_ir` call the two
copies have different scopes (the second copies the first), so each copy gets its own memo, which is
dropped when the call returns. Any other deep copy is left as it was. Where numba-cuda's module does not
look as this expects, or where FA_NUMBA_PATCH_INLINER=0, `install` does nothing and the builds take the time
they took.
"""

from __future__ import annotations

import copy
import functools
import os
import threading

_state = threading.local()  # the innermost inline_ir call's [scope, memo]


class _SharedMemoCopy:
    """The `copy` module as the inliner's module sees it, with blocks of one copy sharing a memo."""

    def __init__(self, block_type):
        self._block_type = block_type

    def __getattr__(self, name):
        return getattr(copy, name)

    def deepcopy(self, x, memo=None):
        current = getattr(_state, "current", None)
        if memo is None and current is not None and isinstance(x, self._block_type):
            if current[0] is not x.scope:  # a new copy (the first, or the copy of the copy)
                current[:] = [x.scope, {}]
            memo = current[1]
        return copy.deepcopy(x, memo)


def _one_memo_per_copy(inline_ir):
    @functools.wraps(inline_ir)
    def wrapper(*args, **kwargs):
        outer = getattr(_state, "current", None)
        _state.current = [None, None]
        try:
            return inline_ir(*args, **kwargs)
        finally:
            _state.current = outer

    wrapper._fa_numba_shared_memo = True
    return wrapper


def _inliner_module():
    """numba-cuda's inliner module if it is the one this patch was written against, else None."""
    try:
        from numba.cuda.core import inline_closurecall as module
        from numba.cuda.core import ir
    except ImportError:  # the simulator, or another numba-cuda layout: nothing to patch
        return None, None
    copies = getattr(module, "copy", None)
    if copies is not copy and not isinstance(copies, _SharedMemoCopy):
        return None, None
    if not callable(getattr(getattr(module, "InlineWorker", None), "inline_ir", None)):
        return None, None
    return module, ir


def install() -> bool:
    """Patch numba-cuda's inliner (idempotent); True if it is patched. FA_NUMBA_PATCH_INLINER=0 in the
    environment leaves it as shipped."""
    module, ir = _inliner_module()
    if module is None or os.environ.get("FA_NUMBA_PATCH_INLINER") == "0":
        return False
    if not getattr(module.InlineWorker.inline_ir, "_fa_numba_shared_memo", False):
        module.copy = _SharedMemoCopy(ir.Block)
        module.InlineWorker.inline_ir = _one_memo_per_copy(module.InlineWorker.inline_ir)
    return True


def uninstall() -> None:
    """Undo `install` (tests compare the two)."""
    module, _ = _inliner_module()
    if module is None:
        return
    if isinstance(module.copy, _SharedMemoCopy):
        module.copy = copy
    patched = module.InlineWorker.inline_ir
    if getattr(patched, "_fa_numba_shared_memo", False):
        module.InlineWorker.inline_ir = patched.__wrapped__
