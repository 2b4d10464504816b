"""Builds with numba-cuda's inliner as shipped and as fa_numba.kernels.inliner patches it (run by test_inliner.py).

Run as a script in a process with the real numba.cuda (NUMBA_ENABLE_CUDASIM=0), one build a process (the
names Numba gives functions count up within a process); prints one JSON object, the build's output and the
seconds it took.

    python tests/inliner_probe.py patched probe      # a small kernel: its PTX (NVVM, on the CPU)
    python tests/inliner_probe.py shipped v2 64      # a shipped CUDA-core kernel: its typed IR, as text
"""

import json
import os
import sys
import time

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

import fa_numba.kernels  # noqa: E402,F401  (installs the patch)
from numba import cuda, float32, int64  # noqa: E402

from fa_numba.kernels import inliner  # noqa: E402


@cuda.jit(device=True, inline=True)
def _leaf(x, n):
    """A callee of several blocks: a loop and branches."""
    total = 0.0
    for i in range(n):
        if i % 3 == 0:
            total += x * i
        elif i % 3 == 1:
            total -= x
        else:
            total = total * 0.5
    return total


@cuda.jit(device=True, inline=True)
def _middle(x, n):
    """Inlines _leaf twice, and is inlined itself: a copy of an IR that holds inlined code."""
    a = _leaf(x, n)
    if a > 0:
        a += _leaf(a, n + 1)
    return a


def probe(out, n):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = _middle(out[i], n) + _leaf(out[i], n) - _middle(out[i] + 1.0, n)


def _ptx():
    ptx, _ = cuda.compile_ptx(probe, (float32[::1], int64), cc=(8, 0))
    return ptx


def _typed(variant: str, head_dim: int) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import index_width
    from fa_numba import profile

    cfg = next(iter(profile.configurations([variant], (head_dim,), ("float32",), (False,))))
    built = profile._build(cfg)
    func_ir, typemap = index_width.typed_ir(built.source, built.argtypes("float32"))
    return func_ir.dump_to_string() + "\n" + "\n".join(f"{k} {typemap[k]}" for k in sorted(typemap))


def main(argv) -> int:
    way, *what = argv
    (inliner.install if way == "patched" else inliner.uninstall)()
    start = time.perf_counter()
    output = _ptx() if what == ["probe"] else _typed(what[0], int(what[1]))
    print(json.dumps({"output": output, "seconds": round(time.perf_counter() - start, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
