"""`fa_numba.arrays` through `fa_numba.attention`: the result comes back in the caller's array library, on
its device, launched on its current stream; torch and cupy are imported only for their own inputs."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from numba import cuda

import fa_numba
from fa_numba import arrays, backend, tolerance
from fa_numba.kernels import default_tiles
from strategies import Case

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = dict(block_q=4, block_k=4)
ON_GPU = backend.name() == "gpu"
NO_TORCH = "needs PyTorch (pip install torch==2.13.0, the CPU build, or the 'torch' extra)"


def _inputs(dtype=np.float32):
    return Case(n_q=7, n_k=9, d=4, block_q=4, block_k=4, causal=True, heads_kv=1, group=2).inputs(dtype)


def _torch_cuda():
    if not ON_GPU:
        pytest.skip("needs a GPU: the simulator cannot read GPU memory and runs every launch synchronously")
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of PyTorch")
    return torch


def _kinds():
    """(name, to_library, to_numpy, is_library_type) for every array kind this machine has."""
    kinds = [("numpy", lambda x: x, lambda x: x, lambda out: type(out) is np.ndarray),
             ("numba", cuda.to_device, lambda x: x.copy_to_host(),
              lambda out: type(out) is type(cuda.to_device(np.zeros(1))))]
    try:
        import torch
    except ImportError:
        return kinds
    kinds.append(("torch-cpu", torch.from_numpy, lambda x: x.numpy(),
                  lambda out: type(out) is torch.Tensor and out.device.type == "cpu"))
    if ON_GPU and torch.cuda.is_available():
        kinds.append(("torch-cuda", lambda x: torch.from_numpy(x).cuda(), lambda x: x.cpu().numpy(),
                      lambda out: type(out) is torch.Tensor and out.device == torch.device("cuda", 0)))
    try:
        import cupy
    except ImportError:
        return kinds
    if ON_GPU:
        kinds.append(("cupy", cupy.asarray, cupy.asnumpy, lambda out: type(out) is cupy.ndarray))
    return kinds


@pytest.mark.parametrize("name, to_library, to_numpy, is_library_type", _kinds(), ids=[k[0] for k in _kinds()])
@pytest.mark.parametrize("order", ["v1", "v2"])
def test_the_result_comes_back_in_the_input_library(name, to_library, to_numpy, is_library_type, order):
    q, k, v = _inputs()
    out, lse = fa_numba.attention(*(to_library(x) for x in (q, k, v)), causal=True, order=order,
                                  return_lse=True, **SMALL)
    assert is_library_type(out) and is_library_type(lse), (type(out), type(lse))
    assert tuple(out.shape) == q.shape and tuple(lse.shape) == q.shape[:-1]
    tolerance.check_attention(to_numpy(out), to_numpy(lse), q, k, v, causal=True, order=order, **SMALL)
    out3 = fa_numba.attention(*(to_library(np.ascontiguousarray(x[0])) for x in (q, k, v)), causal=True,
                              order=order, **SMALL)
    assert is_library_type(out3) and tuple(out3.shape) == q.shape[1:]
    np.testing.assert_array_equal(to_numpy(out3), to_numpy(out)[0])


def test_torch_cpu_tensors_float16_grad_and_strides():
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v = _inputs(np.float16)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    tq.requires_grad_(True)  # read through .detach(): no autograd history on the result
    out, lse = fa_numba.attention(tq, tk, tv, causal=True, return_lse=True, **SMALL)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and not out.requires_grad
    tolerance.check_attention(out.numpy(), lse.numpy(), q, k, v, causal=True, order="v2", **SMALL)
    wide = torch.from_numpy(np.concatenate([q, q], axis=-1).astype(np.float32))[..., ::2]  # non-contiguous
    assert not wide.is_contiguous()
    out, lse = fa_numba.attention(wide, tk.float(), tv.float(), causal=True, return_lse=True, **SMALL)
    tolerance.check_attention(out.numpy(), lse.numpy(), wide.numpy(), k.astype(np.float32), v.astype(np.float32),
                              causal=True, order="v2", **SMALL)


def test_torch_dtypes_and_mixed_libraries_are_named():
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v = (torch.from_numpy(x) for x in _inputs())
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype, got q torch.bfloat16, k torch.float32"):
        fa_numba.attention(q.bfloat16(), k, v)
    with pytest.raises(TypeError, match=r"k must have dtype in \(float32, float16, bfloat16\), got torch.float64"):
        fa_numba.attention(q, k.double(), v)
    with pytest.raises(TypeError, match=r"q, k, v must all come from one array library, got q torch, k numpy, v torch"):
        fa_numba.attention(q, k.numpy(), v)


def test_output_wraps_any_numba_array_into_the_callers_library():
    """The part a backward API reuses: a Numba result it allocated itself comes back as the caller's kind."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    call = arrays.adopt({"q": torch.zeros(2, 3), "k": torch.zeros(2, 3)})
    assert call.kind == "torch" and not call.on_device and call.stream == 0
    assert all(type(a) is np.ndarray for a in call.arrays)
    got = call.output(cuda.to_device(np.arange(6, dtype=np.float32)), (2, 3))
    assert type(got) is torch.Tensor and got.tolist() == [[0, 1, 2], [3, 4, 5]]
    numba_call = arrays.adopt({"q": cuda.to_device(np.zeros(3))})
    same = numba_call.output(cuda.to_device(np.arange(6.0)), (3, 2))
    assert getattr(same, "__cuda_ndarray__", False) and tuple(same.shape) == (3, 2)


def test_numba_arrays_launch_on_their_bound_stream():
    stream = cuda.stream()
    call = arrays.adopt({"q": cuda.to_device(np.zeros(3)).bind(stream), "k": cuda.to_device(np.zeros(3))})
    assert call.stream is stream and call.kind == "numba" and call.on_device
    assert arrays.adopt({"q": cuda.to_device(np.zeros(3))}).stream == 0


@pytest.mark.skipif(ON_GPU, reason="the simulator's refusal; a GPU reads __cuda_array_interface__ objects")
def test_gpu_memory_in_the_simulator_is_refused_by_name():
    class Foreign:  # a device array of another library, as the simulator sees one
        shape, dtype = (4, 2), np.dtype(np.float32)
        __cuda_array_interface__ = {"shape": (4, 2), "typestr": "<f4", "data": (0, False), "version": 3}

    with pytest.raises(TypeError, match=r"q is in GPU memory, but fa_numba runs in Numba's CUDA simulator"):
        fa_numba.attention(Foreign(), Foreign(), Foreign())


def test_torch_and_cupy_are_imported_only_for_their_inputs():
    code = ("import sys, numpy as np, fa_numba\n"
            "q = np.ones((4, 2), np.float32)\n"
            "fa_numba.attention(q, q, q, block_q=4, block_k=4)\n"
            "print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_torch_cuda_launch_is_ordered_on_the_current_stream():
    """Work queued before the call on torch's current stream (a sleep, then the copy that fills q) finishes
    before the kernel reads q, and work queued after reads the finished output; on another stream the
    kernel would read zeros (torch's side streams do not wait for the legacy default stream)."""
    torch = _torch_cuda()
    q_host, k_host, v_host = (np.ascontiguousarray(x) for x in
                              Case(n_q=300, n_k=300, d=64, block_q=64, block_k=64, causal=True).inputs(np.float32))
    sources = [torch.from_numpy(x).cuda() for x in (q_host, k_host, v_host)]
    q, k, v = (torch.zeros_like(x) for x in sources)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the inputs are filled
        for dst, src in zip((q, k, v), sources):
            dst.copy_(src)
        out, lse = fa_numba.attention(q, k, v, causal=True, return_lse=True)
        after_out, after_lse = out * 1, lse * 1  # queued after the kernel on the same stream
    side.synchronize()
    assert type(out) is torch.Tensor and out.device == q.device and out.dtype == torch.float32
    tolerance.check_attention(after_out.cpu().numpy(), after_lse.cpu().numpy(), q_host, k_host, v_host, causal=True,
                              order="v2", block_q=default_tiles(64)[0], block_k=default_tiles(64)[1])


def test_cupy_arrays_launch_on_cupys_current_stream():
    if not ON_GPU:
        pytest.skip("needs a GPU: the simulator cannot read GPU memory and runs every launch synchronously")
    cupy = pytest.importorskip("cupy", reason="needs CuPy")
    q_host, k_host, v_host = _inputs()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v = (cupy.asarray(x) for x in (q_host, k_host, v_host))
        call = arrays.adopt({"q": q, "k": k, "v": v})
        assert int(call.stream) == stream.ptr  # numba wraps CuPy's current stream
        out, lse = fa_numba.attention(q, k, v, causal=True, return_lse=True, **SMALL)
        after_out, after_lse = out * 1, lse * 1
    stream.synchronize()
    assert type(out) is cupy.ndarray and out.device.id == q.device.id
    tolerance.check_attention(cupy.asnumpy(after_out), cupy.asnumpy(after_lse), q_host, k_host, v_host, causal=True,
                              order="v2", **SMALL)
