"""Count a kernel's global-memory traffic in the CUDA simulator, element by element.

Each HBM tensor is a `CountingArray` (an ndarray subclass that counts the elements read by `__getitem__`
and written by `__setitem__`; a view a kernel takes, such as one row, is a CountingArray too and counts
the elements read through it, not its size) wrapped in the simulator's FakeCUDAArray, which the simulator passes to the
kernel as-is instead of copying it. The counts land in a `tiled.Ledger`, the same type `iomodel` returns,
so a test can assert ledger == iomodel.traffic(...). Simulator only.

The tensor-core kernels stage tiles by cp.async, which the simulator's emulation (warp.emulated_tc) copies
as raw bytes from the array's buffer, past `__getitem__`: while `run_counted` launches, `warp.cp_async16` is
wrapped to add each copy's elements (nbytes / itemsize; a zero-filled copy reads none) to the ledger of its
source (`counting_async_copies`).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from fa_numba import backend
from fa_numba.tiled import Ledger


# The simulator runs each CUDA thread as a Python thread: `ledger.reads[t] += n` is a read-modify-write
# that loses counts when two threads interleave, so every update holds this lock.
_LOCK = threading.Lock()


class CountingArray(np.ndarray):
    """An ndarray that adds the number of elements each index read or write touches to a ledger."""

    def __new__(cls, array: np.ndarray, ledger: Ledger, tensor: str):
        obj = np.ascontiguousarray(array).view(cls)
        obj._ledger = ledger
        obj._tensor = tensor
        return obj

    def __array_finalize__(self, obj):
        self._ledger = getattr(obj, "_ledger", None)
        self._tensor = getattr(obj, "_tensor", None)

    def _touched(self, idx) -> int:
        return int(np.size(np.ndarray.__getitem__(self.view(np.ndarray), idx)))

    def __getitem__(self, idx):
        value = np.ndarray.__getitem__(self.view(np.ndarray), idx)
        if isinstance(value, np.ndarray):  # a view (a kernel taking a row once): its elements count when read
            view = value.view(CountingArray)
            view._ledger, view._tensor = self._ledger, self._tensor
            return view
        if self._ledger is not None:
            with _LOCK:
                self._ledger.read(self._tensor, 1)
        return value

    def __setitem__(self, idx, value):
        if self._ledger is not None:
            touched = self._touched(idx)
            with _LOCK:
                self._ledger.write(self._tensor, touched)
        np.ndarray.__setitem__(self.view(np.ndarray), idx, value)


_PATCH_LOCK = threading.Lock()  # one counted launch at a time holds the wrapped cp_async16


@contextlib.contextmanager
def counting_async_copies():
    """While inside, every cp.async copy from a CountingArray adds the elements it reads to that array's
    ledger (the emulation reads the buffer directly, so `__getitem__` never sees them)."""
    from fa_numba import warp

    original = warp.cp_async16

    def counted(smem, sidx, gmem, gidx, nbytes):
        source = getattr(gmem, "_ary", gmem)
        if isinstance(source, CountingArray) and source._ledger is not None and int(nbytes):
            with _LOCK:
                source._ledger.read(source._tensor, int(nbytes) // source.itemsize)
        return original(smem, sidx, gmem, gidx, nbytes)

    with _PATCH_LOCK:
        warp.cp_async16 = counted
        try:
            yield
        finally:
            warp.cp_async16 = original


def run_counted(kernel, q, k, v, scale, mask=None):
    """Launch a built kernel (a variant's make) on host arrays in the simulator, counting HBM traffic of the
    data tensors (a block mask's KernelMask, if any, is passed through uncounted: its cost is metadata).

    Outputs and the v1 workspace start as NaN, so an element the kernel never writes is caught. The
    tensor-core kernels' cp.async copies are counted too (counting_async_copies).
    Returns (out, lse, ledger) as plain float32 arrays.
    """
    if backend.name() != "simulator":
        raise RuntimeError("counting traffic needs the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    ledger = Ledger()
    batch, heads, n_q, _ = q.shape
    arrays = {
        "Q": q, "K": k, "V": v,
        "O": np.full((batch, heads, n_q, v.shape[-1]), np.nan, np.float32),  # V's head dim d_v
        "LSE": np.full((batch, heads, n_q), np.nan, np.float32),
        "l": np.full((batch, heads, n_q), np.nan, np.float32),
        "m": np.full((batch, heads, n_q), np.nan, np.float32),
    }
    dev = {name: FakeCUDAArray(CountingArray(a, ledger, name)) for name, a in arrays.items()}
    with counting_async_copies():
        kernel(dev["Q"], dev["K"], dev["V"], dev["O"], dev["LSE"], scale, workspace=(dev["l"], dev["m"]), mask=mask)
    plain = lambda name: np.asarray(dev[name]._ary.view(np.ndarray)).copy()  # noqa: E731
    return plain("O"), plain("LSE"), ledger


def run_counted_backward(q, k, v, out, lse, dout, scale, *, causal=False, order="kv", deterministic=False,
                         block, mask=None, engine="simt", kind=None, block_k=None):
    """Run the backward kernels (kernels.backward.run; engine "mma": kernels.mma.backward.run for `kind` inputs,
    16-bit or float32, with tiles block_q = block, block_k, their cp.async copies counted too) on host arrays in the
    simulator, counting the HBM traffic of every tensor of tiled.BACKWARD_TENSORS. mask: a KernelMask for the
    CUDA-core kernels; for engine "mma" the block mask itself (fixed for these sizes), whose lists the run builds
    for each of its kernels' tiles; passed through uncounted.

    Outputs and the D workspace start as NaN, so an element no kernel writes is caught. Returns
    (dq, dk, dv, ledger) as plain float32 arrays."""
    if backend.name() != "simulator":
        raise RuntimeError("counting traffic needs the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    from fa_numba.kernels import backward
    from fa_numba.tiled import BACKWARD_TENSORS

    ledger = Ledger.empty(BACKWARD_TENSORS)
    arrays = {
        "Q": q, "K": k, "V": v, "O": out, "LSE": lse, "dO": dout,
        "D": np.full(q.shape[:-1], np.nan, np.float32),
        "dQ": np.full(q.shape, np.nan, np.float32),
        "dK": np.full(k.shape, np.nan, np.float32),
        "dV": np.full(v.shape, np.nan, np.float32),  # V's head dim d_v
    }
    dev = {name: FakeCUDAArray(CountingArray(a, ledger, name)) for name, a in arrays.items()}
    grads = (dev["Q"], dev["K"], dev["V"], dev["O"], dev["LSE"], dev["dO"], dev["dQ"], dev["dK"], dev["dV"], dev["D"])
    if engine == "mma":
        from fa_numba.kernels.mma import backward as mma_backward

        with counting_async_copies():
            mma_backward.run(*grads, scale, kind=kind, causal=causal, deterministic=deterministic, block_q=block,
                             block_k=block_k, mask=mask, mask_form="none" if mask is None else mask.kernel_form())
    else:
        backward.run(*grads, scale, causal=causal, order=order, deterministic=deterministic, block=block, mask=mask)
    plain = lambda name: np.asarray(dev[name]._ary.view(np.ndarray)).copy()  # noqa: E731
    return plain("dQ"), plain("dK"), plain("dV"), ledger


def run_counted_decode(q, k, v, lengths, table, lohi, scale, *, layout, tiles_per_split, splits):
    """Run the decode kernels (kernels.decode.run) on host arrays in the simulator, counting the HBM traffic
    of every tensor of iomodel.DECODE_TENSORS: q (B, H_kv, R, d) packed rows, k (num_pages, H_kv, page, d), v
    (num_pages, H_kv, page, d_v);
    lengths, table and lohi (metadata) pass uncounted; layout: kernels.decode.decode_layout's, or a
    kernels.mma.decode.DecodeSplit (q, k, v then uint16 bits; its cp.async copies counted too). Outputs and
    partials start as NaN, so an element no kernel writes is caught. Returns (out, lse, ledger): out (B, H_kv,
    R, d_v) and lse (B, H_kv, R) float32."""
    if backend.name() != "simulator":
        raise RuntimeError("counting traffic needs the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    from numba import cuda
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    from fa_numba.iomodel import DECODE_TENSORS
    from fa_numba.kernels import decode

    ledger = Ledger.empty(DECODE_TENSORS)
    batch, heads_kv, rows = q.shape[:3]
    d_v = v.shape[3]
    arrays = {
        "Q": q, "K": k, "V": v,
        "O_split": np.full((batch, heads_kv * splits, rows, d_v), np.nan, np.float32),
        "LSE_split": np.full((batch, heads_kv * splits, rows), np.nan, np.float32),
        "O": np.full((batch, heads_kv, rows, d_v), np.nan, np.float32),
        "LSE": np.full((batch, heads_kv, rows), np.nan, np.float32),
    }
    dev = {name: FakeCUDAArray(CountingArray(a, ledger, name)) for name, a in arrays.items()}
    meta = [cuda.to_device(np.ascontiguousarray(x, dtype=np.int32)) for x in (lengths, table, lohi)]
    with counting_async_copies():  # the tensor-core split kernel's cp.async copies
        decode.run(dev["Q"], dev["K"], dev["V"], dev["O_split"], dev["LSE_split"], dev["O"], dev["LSE"], scale,
                   *meta, layout=layout, tiles_per_split=tiles_per_split)
    plain = lambda name: np.asarray(dev[name]._ary.view(np.ndarray)).copy()  # noqa: E731
    return plain("O"), plain("LSE"), ledger
