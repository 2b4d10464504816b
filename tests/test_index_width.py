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


def _every_kernel(every_pair: bool = False) -> list[dict]:
    """Every registered CUDA-core kernel with each masking form and with strided q, k, v, and the backward's
    preprocess (both flags) and zero kernels at every shipped head dim: the types follow the code paths, not
    the dtype.

    A kernel's head dim decides its tiles, which reach the typed IR as integer constants (int64 literals,
    whatever their value) and loop counts; the masking form and the strided layout decide its code paths.
    So each kernel's five builds (four forms, strided) take the shipped head dims in turn, starting one
    further along for each kernel: every kernel is typed at every head dim, every form at every head dim
    over the kernels, and 49 kernels are typed instead of 129. `every_pair=True` gives every kernel at every
    head dim in every form (`python tests/test_index_width.py`: 129 typings, the slow tier's 49 times 2.6)."""
    from fa_numba.kernels import backward

    configs = []
    shipped = [cfg for cfg in profile.configurations(dtypes=("float32",), causals=(False,))
               if cfg["variant"] not in profile.whole_kernel.MMA_KERNELS]
    # the tensor-core kernels (16-bit and 3xTF32) are left out: typing their written-out products took over
    # 10 min here; proofs/L9 says what its check covers
    variants = list(dict.fromkeys(cfg["variant"] for cfg in shipped))
    builds = [dict(causal=form == "causal", mask_form=form) for form in FORMS] + [dict(strided=True)]
    for turn, variant in enumerate(variants):
        mine = [cfg for cfg in shipped if cfg["variant"] == variant]
        for index, build in enumerate(builds):
            at = [mine[(turn + index) % len(mine)]] if not every_pair else mine
            configs += [dict(cfg, **build) for cfg in at]
    for d in profile.SHIPPED_HEAD_DIMS:
        block = backward.default_backward_tiles(d)[0]
        configs += [dict(kind="preprocess", block_q=block, head_dim=d, dtype="float32", flag=flag)
                    for flag in (False, True)]
        configs.append(dict(kind="zero", block_q=block, head_dim=d, dtype="float32"))
    return configs


@pytest.mark.lemma("L9")
def test_the_typed_kernels_cover_every_kernel_at_every_head_dim_and_every_form_at_every_head_dim():
    """The rotation's claim, on the list itself (no typing: default tier)."""
    configs = [cfg for cfg in _every_kernel() if "variant" in cfg]
    every = [cfg for cfg in _every_kernel(every_pair=True) if "variant" in cfg]
    dims = set(profile.SHIPPED_HEAD_DIMS)
    assert len(every) == 3 * len(configs) and all(cfg in every for cfg in configs)
    for variant in {cfg["variant"] for cfg in every}:
        assert {cfg["head_dim"] for cfg in configs if cfg["variant"] == variant} == dims, variant
        assert sum(cfg["variant"] == variant for cfg in configs) == len(FORMS) + 1
    for form in FORMS:
        assert {cfg["head_dim"] for cfg in configs if cfg.get("mask_form") == form} == dims, form
    assert {cfg["head_dim"] for cfg in configs if cfg.get("strided")} == dims


@pytest.mark.slow
@pytest.mark.lemma("L9")
def test_every_kernel_computes_its_integers_in_64_bits():
    """No integer operation of any shipped kernel is narrower than 64 bits and none converts to a narrower
    integer: the only 32-bit integers are the hardware's thread and block indices and the int32 mask
    arrays' elements, which L9 bounds. Typed in two processes (about 4 s a kernel), the kernels at the head
    dims in turn (`_every_kernel`)."""
    _assert_64_bits(_every_kernel())


def _assert_64_bits(configs: list[dict]) -> None:
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


if __name__ == "__main__":  # every kernel at every head dim in every form: the check the slow tier samples
    _assert_64_bits(_every_kernel(every_pair=True))
    print("every kernel at every head dim in every form computes its integers in 64 bits")
