"""Array libraries in and out: what `attention` (and, next, its backward) reads and gives back.

`adopt({"q": q, ...})` reads the caller's arrays without copying and says where to launch; the `Call` it
returns allocates the outputs (`empty`) and hands them back in the caller's library (`output`):

| input | the launch reads | launch stream | output |
|---|---|---|---|
| NumPy array (or other object with `__array__`) | the host array, copied to the device | default | NumPy |
| PyTorch CPU tensor | `t.detach().numpy()` (no copy), copied to the device | default | CPU tensor |
| Numba device array (also the simulator's) | the array itself | its bound stream, else default | Numba |
| PyTorch CUDA tensor | a Numba view (`__cuda_array_interface__`) | torch's current stream | CUDA tensor |
| CuPy array | a Numba view | CuPy's current stream | CuPy array |
| other `__cuda_array_interface__` object | a Numba view | the one it names, else default | Numba |

Device views are taken with sync=False: the launch goes on the stream that produced the inputs, so work
queued before it on that stream finishes first and work queued after it sees its results, with no host
synchronisation. Outputs of a PyTorch or CuPy call are allocated by that library on the input's device
(`torch.empty` / `cupy.empty`, on the current stream, from its memory pool) and returned as those very
tensors; any other Numba device array given to `output` is wrapped zero-copy (`torch.as_tensor` /
`cupy.asarray` through `__cuda_array_interface__`). torch and cupy are imported only when an input is
one of theirs (checked by `type(x).__module__`), never at `import fa_numba`.

PyTorch inputs are read through `.detach()`: the outputs carry no autograd history.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from fa_numba import shapes

LIBRARIES = ("torch", "cupy")  # inputs of these come back as the same library's arrays


def kind(x) -> str:
    """'numpy', 'torch', 'cupy', 'numba', 'cuda' (another `__cuda_array_interface__` object) or 'host'
    (anything else: read with `np.asarray` if it has `__array__`, validated later by shapes.problem)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    library = type(x).__module__.partition(".")[0]
    if library == "torch":
        import torch

        if isinstance(x, torch.Tensor):
            return "torch"
    if library == "cupy":
        import cupy

        if isinstance(x, cupy.ndarray):
            return "cupy"
    if getattr(x, "__cuda_ndarray__", False):
        return "numba"
    if hasattr(x, "__cuda_array_interface__"):
        return "cuda"
    return "host"


def on_device(x, x_kind: str) -> bool:
    if x_kind == "torch":
        return x.device.type != "cpu"
    return x_kind in ("numba", "cupy", "cuda")


def accepted(allowed, bfloat16: bool) -> str:
    """The dtypes an error message names: the allowed NumPy dtypes, and bfloat16 where it is taken."""
    return ", ".join([str(a) for a in allowed] + (["bfloat16"] if bfloat16 else []))


def _torch_dtype_ok(name: str, x, allowed, bfloat16: bool) -> None:
    """A torch dtype without a NumPy twin would fail deep in a conversion: name it here."""
    twin = getattr(np, str(x.dtype).removeprefix("torch."), None)
    if allowed is not None and (twin is None or np.dtype(twin) not in allowed):
        raise TypeError(f"{name} must have dtype in ({accepted(allowed, bfloat16)}), got {x.dtype}")


def is_bfloat16(x, x_kind: str) -> bool:
    """A bfloat16 array: a torch tensor, or an array whose NumPy dtype is named bfloat16 (ml_dtypes)."""
    if x_kind == "torch":
        import torch

        return x.dtype == torch.bfloat16
    return getattr(getattr(x, "dtype", None), "name", None) == "bfloat16"


def _bits(x, x_kind: str):
    """The 16 bits of each bfloat16 element, as an int16 / uint16 array of the same shape, without a copy:
    NumPy and Numba have no bfloat16 array type, and the kernels turn the bits into float32 exactly."""
    if x_kind == "torch":
        import torch

        return x.view(torch.int16)
    return x.view(np.uint16)


@dataclass
class Call:
    """The caller's arrays, read for one launch. `arrays`: host NumPy arrays (host call) or Numba device
    arrays (device call), in the order given to `adopt`; `stream`: the Numba stream to launch on (0: the
    default stream); `device`: the torch.device or CuPy device id of the inputs (None: numba's current)."""

    kind: str
    on_device: bool
    arrays: tuple
    stream: object = 0
    device: object = None
    bfloat16: bool = False  # the inputs were bfloat16: `arrays` hold their bits (int16 / uint16)
    _owners: dict = field(default_factory=dict, repr=False)

    def kind_of(self, array) -> str:
        """The dtype name of one of the inputs as the caller gave it: "bfloat16" for bfloat16 bits held as
        int16 / uint16, else the array's own dtype name (a float32 array, dO say, stays "float32")."""
        name = np.dtype(array.dtype).name
        return "bfloat16" if self.bfloat16 and name in ("int16", "uint16") else name

    def context(self):
        """Run allocations and launches under this: selects the inputs' GPU if it is not numba's current."""
        index = self.device if self.kind == "cupy" else getattr(self.device, "index", None)
        if index is None or index == cuda.get_current_device().id:
            return contextlib.nullcontext()
        return cuda.gpus[index]

    def empty(self, shape, dtype=np.float32):
        """An uninitialised Numba device array for an output, owned by the caller's library if it has one."""
        if self.on_device and self.kind == "torch":
            import torch

            owner = torch.empty(tuple(shape), dtype=getattr(torch, np.dtype(dtype).name), device=self.device)
        elif self.kind == "cupy":
            import cupy

            with cupy.cuda.Device(self.device):
                owner = cupy.empty(tuple(shape), dtype=dtype)
        else:
            return cuda.device_array(tuple(shape), dtype=dtype, stream=self.stream)
        view = cuda.as_cuda_array(owner, sync=False)
        self._owners[id(view)] = (view, owner)
        return view

    def output_host(self, host: np.ndarray):
        """A host call's result in the caller's library: the NumPy array, or a CPU tensor sharing it."""
        if self.kind == "torch":
            import torch

            return torch.from_numpy(host)
        return host

    def output(self, array, shape):
        """A result (a Numba device array) reshaped to `shape`, in the caller's library: the library's own
        array for one from `empty`, a zero-copy wrap for any other, a host copy for a host call."""
        owned = self._owners.get(id(array))
        if owned is not None and owned[0] is array:
            return owned[1].reshape(tuple(shape))
        if not self.on_device:
            return self.output_host(array.copy_to_host(stream=self.stream).reshape(tuple(shape)))
        array = array.reshape(tuple(shape))
        if self.kind == "torch":
            import torch

            return torch.as_tensor(array, device=self.device)
        if self.kind == "cupy":
            import cupy

            with cupy.cuda.Device(self.device):
                return cupy.asarray(array)
        return array


def _as_bits(call: Call) -> Call:
    call.bfloat16 = True
    return call


def _device_of(x, x_kind: str):
    if x_kind == "torch":
        return x.device
    if x_kind == "cupy":
        return x.device.id
    return None  # numba's current device


def _launch_stream(x_kind: str, view, device):
    """The Numba stream a launch on these inputs goes on (0: numba's default stream)."""
    if x_kind == "torch":
        import torch

        return _wrap_stream(torch.cuda.current_stream(device).cuda_stream)
    if x_kind == "cupy":
        import cupy

        with cupy.cuda.Device(device):
            return _wrap_stream(cupy.cuda.get_current_stream().ptr)
    return view.stream or 0  # numba or another interface: the stream the array is bound to, or names


def _wrap_stream(ptr: int):
    # ptr 0 is the legacy default stream; numba's stream 0 is that one only without per-thread default streams
    return cuda.external_stream(ptr) if ptr else cuda.legacy_default_stream()


def _host_view(x, x_kind: str):
    if x_kind == "torch":
        return x.detach().numpy()  # shares the tensor's memory
    return x if isinstance(x, np.ndarray) or not hasattr(x, "__array__") else np.asarray(x)


def adopt(named: dict, allowed=None, bfloat16: bool = False) -> Call:
    """Read named inputs ({"q": q, "k": k, ...}) for one launch: all host or all device, and all from one
    library if any is a PyTorch tensor or CuPy array (the outputs come back as that library's arrays); the
    first input decides the output kind and the stream. `allowed` (NumPy dtypes) lets a torch dtype NumPy
    cannot read be refused by name before any conversion. With bfloat16=True, bfloat16 inputs (torch
    tensors, ml_dtypes NumPy arrays, Numba arrays of them) are taken, all or none, and read as their bits
    (`Call.bfloat16`)."""
    names, values = list(named), list(named.values())
    listed = ", ".join(names)
    kinds = [kind(x) for x in values]
    halves = [bfloat16 and is_bfloat16(x, k) for x, k in zip(values, kinds)]
    if any(halves):
        if not all(halves):
            raise TypeError(f"{listed} must share one dtype, got "
                            + ", ".join(f"{n} {x.dtype}" for n, x in zip(names, values)))
        return _as_bits(adopt({n: _bits(x, k) for n, x, k in zip(names, values, kinds)}))
    sides = [on_device(x, k) for x, k in zip(values, kinds)]
    if len(set(sides)) > 1:
        raise TypeError(f"{listed} must be all host arrays or all device arrays, got "
                        + ", ".join(f"{n} {'device' if s else 'host'}" for n, s in zip(names, sides)))
    if set(kinds) & set(LIBRARIES) and len(set(kinds)) > 1:
        raise TypeError(f"{listed} must all come from one array library, got "
                        + ", ".join(f"{n} {k}" for n, k in zip(names, kinds)))
    first, device_side = kinds[0], sides[0]
    if first == "torch":
        for n, x in zip(names, values):
            _torch_dtype_ok(n, x, allowed, bfloat16)
        if device_side and any(x.device.type != "cuda" for x in values):
            raise TypeError(f"{listed} must be CPU or CUDA tensors, got "
                            + ", ".join(f"{n} on {x.device}" for n, x in zip(names, values)))
    if not device_side:
        return Call(first, False, tuple(_host_view(x, k) for x, k in zip(values, kinds)))
    devices = [_device_of(x, k) for x, k in zip(values, kinds)]
    if len({str(d) for d in devices}) > 1:
        raise ValueError(f"{listed} must be on one device, got "
                         + ", ".join(f"{n} on {d}" for n, d in zip(names, devices)))
    foreign = [n for n, k in zip(names, kinds) if k != "numba"]
    if foreign and not hasattr(cuda, "as_cuda_array"):  # the simulator has no view of real device memory
        raise TypeError(f"{foreign[0]} is in GPU memory, but fa_numba runs in Numba's CUDA simulator (no NVIDIA "
                        "driver, or NUMBA_ENABLE_CUDASIM=1 / FA_NUMBA_SIM=1), which cannot read it: pass host "
                        "arrays (NumPy arrays, CPU tensors)")
    call = Call(first, True, (), device=devices[0])
    with call.context():
        call.arrays = tuple(x if k == "numba" else cuda.as_cuda_array(x.detach() if k == "torch" else x, sync=False)
                            for x, k in zip(values, kinds))
        call.stream = _launch_stream(first, call.arrays[0], devices[0])
    return call


OUT_DTYPES = ("float32", "float16", "bfloat16")


def device_view_4d(name: str, x):
    """A (B, H, N, d) view of the device array x without a copy: its reshape when it is C-contiguous, x itself
    when it is 4-D (any strides), else a ValueError naming it (a strided view of another rank cannot be
    flattened in place)."""
    if x.is_c_contiguous():
        return x.reshape(shapes.batch_shape(x.shape))
    if len(x.shape) == 4:
        return x
    raise ValueError(f"{name} must be C-contiguous or a 4-D view on the device, got shape {tuple(x.shape)} with "
                     f"strides {tuple(x.strides)} bytes (make it .contiguous() first)")


def dtype_name(name: str, dtype) -> str:
    """An out_dtype argument (None, a NumPy or ml_dtypes dtype, a torch dtype, or its name) as one of
    OUT_DTYPES; None is float32, the kernels' arithmetic."""
    if dtype is None:
        return "float32"
    if isinstance(dtype, str):
        text = dtype
    elif type(dtype).__module__.partition(".")[0] == "torch":
        text = str(dtype).removeprefix("torch.")
    else:
        try:
            text = np.dtype(dtype).name
        except TypeError:
            raise TypeError(f"{name} must be a dtype or None, got {type(dtype).__name__} {dtype!r}") from None
    if text not in OUT_DTYPES:
        raise ValueError(f"{name} must be one of {OUT_DTYPES} (or None: float32), got {dtype!r}")
    return text


def cast(call: Call, result, name: str):
    """A float32 result of `call.output` in the dtype `name` (one of OUT_DTYPES): torch and CuPy results
    by their library, on their device and stream; NumPy results by NumPy (bfloat16 by ml_dtypes); a Numba
    device array by a cast kernel on the call's stream (`kernels.cast`: float16, or bfloat16 as its uint16
    bits, the form the kernels take bfloat16 in). CuPy has no bfloat16: refused by name."""
    if name == "float32":
        return result
    if call.kind == "torch":
        import torch

        return result.to(getattr(torch, name))
    if call.on_device:
        if call.kind == "cupy" and name != "bfloat16":
            return result.astype(name)
        if call.kind == "numba":
            from fa_numba.kernels.cast import cast_device

            return cast_device(result, name, call.stream)
        raise ValueError(f"out_dtype={name!r} is taken for NumPy, torch, Numba and CuPy (float16) results; a "
                         f"{call.kind} result comes back float32")
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("out_dtype='bfloat16' needs ml_dtypes for a NumPy result (NumPy has no bfloat16): "
                             "pip install ml_dtypes") from None
        return result.astype(ml_dtypes.bfloat16)
    return result.astype(np.float16)
