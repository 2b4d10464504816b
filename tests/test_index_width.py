"""The kernels compute every integer in 64 bits (L9), read from Numba's typed IR (tests/index_width.py).

The typing runs in a subprocess with the real numba.cuda (the simulator types nothing: it runs Python), on
the CPU. Both tests are marked `slow` (`.ci/run` runs them as its second tier): the probes (two small
kernels with known answers) take a few seconds, every shipped kernel at every shipped head dim's tiles and
every masking form takes minutes.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from fa_numba import profile

HERE = pathlib.Path(__file__).resolve().parent
REAL_CUDA = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
FORMS = ("none", "causal", "intervals", "dense")


def _typed(argument: str, timeout: int = 900) -> dict:
    done = subprocess.run([sys.executable, str(HERE / "index_width.py"), argument], env=REAL_CUDA,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow  # a real numba.cuda process, ~4 s: the default tier has no seconds to spare (README)
@pytest.mark.lemma("L9")
def test_the_checker_sees_a_narrowing_conversion_and_numba_widens_int32_arithmetic():
    """blockIdx.x * blockDim.x + threadIdx.x (int32 registers) is typed int64 twice over (Numba's integer
    rule), and int32() of it is the one narrowing conversion of the second probe."""
    found = _typed("--probes", timeout=300)
    for probe in ("wide", "narrowing"):
        assert found[probe]["operations"] == {"int64": 2}, found[probe]
        assert found[probe]["narrow_operations"] == []
    assert found["wide"]["narrowing_conversions"] == []
    assert len(found["narrowing"]["narrowing_conversions"]) == 1
    assert found["narrowing"]["narrowing_conversions"][0].endswith("-> int32")


def _every_kernel() -> list[dict]:
    """Every registered kernel at the tiles of every shipped head dim, with each masking form, and the
    backward's preprocess (both flags) and zero kernels: the types follow the code paths, not the dtype."""
    from fa_numba.kernels import backward

    configs = []
    for cfg in profile.configurations(dtypes=("float32",), causals=(False,)):
        if cfg["variant"] in profile.whole_kernel.MMA_KERNELS:  # float32 by 3xTF32 (forwards and the kv backward):
            continue  # left out, as the 16-bit tensor-core kernels are (typing their written-out products took
            # over 10 min here: not run; proofs/L9 says what its check covers)
        configs += [dict(cfg, causal=form == "causal", mask_form=form) for form in FORMS]
        if cfg["variant"] not in profile.whole_kernel.MMA_KERNELS:  # strided q, k, v: the CUDA-core kernels
            configs.append(dict(cfg, strided=True))
    for d in profile.SHIPPED_HEAD_DIMS:
        block = backward.default_backward_tiles(d)[0]
        configs += [dict(kind="preprocess", block_q=block, head_dim=d, dtype="float32", flag=flag)
                    for flag in (False, True)]
        configs.append(dict(kind="zero", block_q=block, head_dim=d, dtype="float32"))
    return configs


@pytest.mark.slow
@pytest.mark.lemma("L9")
def test_every_kernel_computes_its_integers_in_64_bits():
    """No integer operation of any shipped kernel is narrower than 64 bits and none converts to a narrower
    integer: the only 32-bit integers are the hardware's thread and block indices and the int32 mask
    arrays' elements, which L9 bounds. Typed in two processes (about 4 s a kernel)."""
    configs = _every_kernel()
    halves = [configs[0::2], configs[1::2]]
    procs = [subprocess.Popen([sys.executable, str(HERE / "index_width.py"), json.dumps(part)], env=REAL_CUDA,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for part in halves]
    found = {}
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        assert proc.returncode == 0, err[-3000:]
        found.update(json.loads(out))
    assert len(found) == len(configs)
    for cfg, widths in found.items():
        assert widths["operations"] and set(widths["operations"]) <= {"int64", "uint64"}, (cfg, widths)
        assert widths["narrow_operations"] == [] and widths["narrowing_conversions"] == [], (cfg, widths)
