"""Python builtins that a compiled kernel computes differently from Python, as the device computes them, for
kernels run in the CUDA simulator.

numba-cuda lowers two-argument `max` and `min` of floats (float32 or float64, either order) to libdevice's
`__nv_fmaxf` / `__nv_fmax` and `__nv_fminf` / `__nv_fmin` (numba_cuda's cudaimpl.py), IEEE maxNum / minNum: a NaN
operand is dropped, the other returned (FMNMX in the SASS). The simulator runs kernels as Python, whose `max(a, b)`
keeps `a` unless `b > a`, so a NaN first argument survives and a NaN second one is dropped. The first H200 session
(2026-12-04) found the gap: the 3xTF32 split clamped with `min(max(x, -T), T)` and gave NaN in the simulator,
-TF32_MAX on the GPU. Every other call (integers, three or more arguments, iterables) is lowered to Python's own
algorithm (numba's do_minmax), so it is left alone.

`install()` (backend.patch_simulator) makes the simulator's kernels and device functions see `device_max` and
`device_min` under the names `max` and `min` while they run: their module's globals get the two names on the first
entrance of any simulated function of that module and lose them when the last one leaves, alongside the simulator's
own swap of the `cuda` module (kernelapi.swapped_cuda_module). A module that defines its own `max` or `min` keeps it.
"""

from __future__ import annotations

import builtins
import contextlib
import threading
from collections import defaultdict

import numpy as np

FLOATS = (float, np.floating)


def _nan_dropping(python_fn, name: str):
    """python_fn (max or min) as a kernel computes it: two floats by fmax / fmin (a NaN operand dropped, the other
    returned), anything else as Python's."""

    def device_fn(*args, **kwargs):
        if len(args) == 2 and not kwargs and isinstance(args[0], FLOATS) and isinstance(args[1], FLOATS):
            a, b = args
            if a != a:
                return b
            if b != b:
                return a
        return python_fn(*args, **kwargs)

    device_fn.__name__ = device_fn.__qualname__ = name
    return device_fn


device_max = _nan_dropping(builtins.max, "device_max")
device_min = _nan_dropping(builtins.min, "device_min")


DEVICE_BUILTINS = {"max": device_max, "min": device_min}
_lock = threading.Lock()
_inside = defaultdict(int)  # id(module globals) -> simulated functions of that module running now
_added = {}  # id(module globals) -> the names this module got


def with_device_builtins(swap):
    """swapped_cuda_module(fn, fake) wrapped: the same, and fn's module sees DEVICE_BUILTINS while it runs."""

    @contextlib.contextmanager
    def swapped(fn, fake_cuda_module):
        globs = fn.__globals__
        key = id(globs)
        with _lock:
            if _inside[key] == 0:
                _added[key] = [name for name in DEVICE_BUILTINS if name not in globs]
                for name in _added[key]:
                    globs[name] = DEVICE_BUILTINS[name]
            _inside[key] += 1
        try:
            with swap(fn, fake_cuda_module):
                yield
        finally:
            with _lock:
                _inside[key] -= 1
                if _inside[key] == 0:
                    for name in _added.pop(key):
                        globs.pop(name, None)

    swapped._fa_numba_device_builtins = True
    return swapped


def install() -> None:
    """Route the simulator's kernel and device-function calls through with_device_builtins (once)."""
    from numba.cuda.simulator import kernel

    if not getattr(kernel.swapped_cuda_module, "_fa_numba_device_builtins", False):
        kernel.swapped_cuda_module = with_device_builtins(kernel.swapped_cuda_module)


__all__ = ["DEVICE_BUILTINS", "device_max", "device_min", "install", "with_device_builtins"]
