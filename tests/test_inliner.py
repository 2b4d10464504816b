"""fa_numba.kernels.inliner: numba-cuda's inliner with each copy's blocks sharing one memo builds the same code.

Each build runs twice, in fresh processes with the real numba.cuda (on the CPU: PTX and typing need no GPU),
once with the patch and once with numba-cuda's inliner as shipped, under one hash seed (the order of a few
independent phi assignments follows Python's string hashing, patch or not), and the outputs are compared
whole. The shipped kernels' SASS is compared by hash in the committed table (`sass_sha256`).
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from fa_numba.kernels import inliner

HERE = pathlib.Path(__file__).resolve().parent
ENV = {**{k: v for k, v in os.environ.items() if k != "FA_NUMBA_PATCH_INLINER"}, "NUMBA_ENABLE_CUDASIM": "0",
       "PYTHONHASHSEED": "0"}


def _build(way: str, *what: str) -> dict:
    done = subprocess.run([sys.executable, str(HERE / "inliner_probe.py"), way, *what], env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    found["output"] = re.sub(r" at 0x[0-9a-f]+", " at 0x", found["output"])  # objects' addresses in the IR's text
    return found


def test_a_kernel_of_nested_inlined_functions_compiles_to_the_same_ptx_both_ways():
    patched, shipped = _build("patched", "probe"), _build("shipped", "probe")
    assert ".entry" in patched["output"] and patched["output"] == shipped["output"]


@pytest.mark.slow  # two typings of a shipped kernel, about 20 s each
def test_a_shipped_kernel_types_to_the_same_ir_both_ways():
    patched, shipped = _build("patched", "v1", "256"), _build("shipped", "v1", "256")
    assert patched["output"].count("\n") > 1000 and patched["output"] == shipped["output"]
    print(f"typed in {patched['seconds']} s patched, {shipped['seconds']} s as shipped")


def test_install_is_idempotent_and_uninstall_restores_the_shipped_inliner():
    module, _ = inliner._inliner_module()
    if module is None:
        pytest.skip("this numba-cuda has no inliner module of the expected shape: install() leaves it alone")
    if os.environ.get("FA_NUMBA_PATCH_INLINER") == "0":
        pytest.skip("FA_NUMBA_PATCH_INLINER=0: the inliner is left as shipped, on purpose")
    try:
        assert inliner.install() and inliner.install()
        patched = module.InlineWorker.inline_ir
        assert isinstance(module.copy, inliner._SharedMemoCopy) and patched._fa_numba_shared_memo
        assert not getattr(patched.__wrapped__, "_fa_numba_shared_memo", False)  # wrapped once, not twice
        inliner.uninstall()
        assert module.copy is inliner.copy and module.InlineWorker.inline_ir is patched.__wrapped__
    finally:
        inliner.install()  # as importing fa_numba.kernels left it
