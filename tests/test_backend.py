"""`fa_numba.backend`: the simulator is chosen at import; numba.cuda imported first, without a driver, is
named at import (a warning) and at the first call (a RuntimeError), with both fixes."""

import os
import pathlib
import subprocess
import sys

import pytest

from fa_numba import backend

ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_DRIVER = "needs a machine without an NVIDIA driver (with one, numba.cuda imported first works)"
CALL = "q = np.ones((4, 2), np.float32)\nout = fa_numba.attention(q, q, q, block_q=4, block_k=4)\n"


def _python(code: str, **env_changes) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter on this checkout, NUMBA_ENABLE_CUDASIM and FA_NUMBA_SIM unset."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "FA_NUMBA_SIM")}
    env.update(PYTHONPATH=str(ROOT), **env_changes)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(backend.gpu_driver_visible(), reason=NO_DRIVER)
def test_numba_cuda_imported_first_is_named_at_import_and_at_the_first_call():
    done = _python("import warnings\nwarnings.simplefilter('always')\nimport numpy as np\n"
                   "from numba import cuda\nimport fa_numba\n"
                   "print('backend', fa_numba.backend.name(), fa_numba.backend.stranded())\n"
                   "try:\n"
                   "    " + CALL.replace("\n", "\n    ") + "\n"
                   "except RuntimeError as err:\n"
                   "    print('RuntimeError:', err)\n"
                   "    print('cause:', type(err.__cause__).__name__)\n")
    assert done.returncode == 0, done.stderr
    assert "backend gpu True" in done.stdout
    assert f"RuntimeError: {backend.IMPORT_ORDER_FIX}\n" in done.stdout
    assert "cause: CudaSupportError" in done.stdout  # numba's own error stays attached
    assert f"RuntimeWarning: {backend.IMPORT_ORDER_FIX}" in done.stderr
    assert "<string>:5: RuntimeWarning" in done.stderr  # pointed at the `import fa_numba` line
    for fix in ("import fa_numba before numba", "set NUMBA_ENABLE_CUDASIM=1 before numba is imported"):
        assert fix in backend.IMPORT_ORDER_FIX


@pytest.mark.skipif(backend.gpu_driver_visible(), reason=NO_DRIVER)
@pytest.mark.parametrize("first, env", [
    ("import fa_numba\nfrom numba import cuda\n", {}),  # fix 1: fa_numba first
    ("from numba import cuda\nimport fa_numba\n", {"NUMBA_ENABLE_CUDASIM": "1"}),  # fix 2: the variable first
], ids=["fa_numba-first", "NUMBA_ENABLE_CUDASIM=1"])
def test_both_fixes_work(first, env):
    done = _python("import warnings\nwarnings.simplefilter('error')\nimport numpy as np\n" + first + CALL
                   + "print(fa_numba.backend.name(), fa_numba.backend.stranded(), out.shape)\n", **env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "simulator False (4, 2)"


def test_name_reads_what_numba_cuda_uses():
    """Once numba.cuda is imported, name() reports it, whatever NUMBA_ENABLE_CUDASIM says afterwards."""
    assert "numba.cuda" in sys.modules  # conftest imported fa_numba, the tests imported numba.cuda
    expected = "simulator" if "numba.cuda.simulator_init" in sys.modules else "gpu"
    saved = os.environ.get("NUMBA_ENABLE_CUDASIM")
    try:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if expected == "simulator" else "1"
        assert backend.name() == expected
    finally:
        if saved is None:
            os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
        else:
            os.environ["NUMBA_ENABLE_CUDASIM"] = saved
    assert not backend.stranded()  # this session imported fa_numba first


def _cuda_error(name: str, message: str) -> Exception:
    """An exception of the given class name from a numba module, as numba-cuda's driver and compilers raise."""
    return type(name, (Exception,), {"__module__": "numba.cuda.cudadrv.driver"})(message)


@pytest.mark.parametrize("err, driver, toolkit, words", [
    (_cuda_error("CudaAPIError", "[222] Call to cuModuleLoadDataEx results in CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
     (12, 4), (13, 0), "the driver runs CUDA 12.4, the toolkit is CUDA 13.0"),
    (_cuda_error("LinkerError", "the provided PTX was compiled with an unsupported toolchain"), None, None,
     "newer than the NVIDIA driver"),
    (_cuda_error("CudaAPIError", "[1] CUDA_ERROR_INVALID_VALUE"), (12, 8), (13, 1), "newer than the NVIDIA driver"),
    (_cuda_error("NvvmSupportError", "libNVVM cannot be found. Do `conda install cudatoolkit`"), (13, 0), None,
     "no CUDA toolkit for compiling kernels"),
])
def test_a_toolkit_newer_than_the_driver_or_none_is_named_with_its_fix(err, driver, toolkit, words):
    advice = backend.driver_advice(err, driver, toolkit)
    assert words in advice and 'pip install "fa_numba[cu12]"' in advice and 'fa_numba[cu13]' in advice
    assert str(err) in advice  # the driver's own words are kept


def test_other_errors_get_no_driver_advice():
    assert backend.driver_advice(ValueError("q must have 4 axes"), (12, 4), (13, 0)) is None  # not a CUDA error
    assert backend.driver_advice(_cuda_error("CudaAPIError", "[700] CUDA_ERROR_ILLEGAL_ADDRESS"), (13, 0),
                                 (13, 0)) is None


def test_the_extras_offer_both_cuda_majors_and_the_base_needs_neither():
    import configparser
    import pathlib

    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).resolve().parents[1] / "setup.cfg")
    requires = config["options"]["install_requires"]
    extras = config["options.extras_require"]
    assert "numba-cuda>=" in requires and "[cu1" not in requires  # the simulator needs no CUDA wheels
    assert "numba-cuda[cu12]" in extras["cu12"] and "numba-cuda[cu13]" in extras["cu13"]
    assert "numba-cuda[cu13]" in extras["profile"]  # the sm_90a builds the test command's slow tier makes
