"""Every shipped kernel configuration compiles for sm_90 (no GPU needed) without spills or float64.

The simulator accepts code a GPU compiler would reject or silently promote to float64, so the real
numba.cuda compiles each configuration to PTX and nvJitLink links it for sm_90 in a subprocess (the
simulator is already chosen in this one). Registers, spills and shared memory come from the link log.
"""

import json
import os
import subprocess
import sys

import pytest

from fa_numba.kernels import VARIANTS
from fa_numba.kernels.common import SHARED_BYTES_LIMIT
from fa_numba.kernels.compile_check import DTYPES, SHIPPED_HEAD_DIMS, configurations, parse


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile") / "configs.json"
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    done = subprocess.run([sys.executable, "-m", "fa_numba.kernels.compile_check", "--json", str(path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    sys.stderr.write(done.stderr)  # the per-configuration table, shown with -s or on failure
    return json.loads(path.read_text())


def test_every_shipped_configuration_is_compiled(compiled):
    expected = len(VARIANTS) * len(SHIPPED_HEAD_DIMS) * len(DTYPES) * 2
    assert len(compiled) == expected == len(list(configurations()))


def test_no_spills_no_float64_and_shared_memory_within_budget(compiled):
    for row in compiled:
        label = f"{row['variant']} d={row['head_dim']} {row['dtype']} causal={row['causal']}"
        assert row["registers"] is not None and 0 < row["registers"] <= 255, label
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, label
        assert not row["float64_in_ptx"], label
        assert 2 * row["block_k"] * row["head_dim"] * 4 <= row["smem"] <= SHARED_BYTES_LIMIT, label


def test_log_parser_reads_an_nvjitlink_log():
    log = """ptxas info    : Compiling entry function 'k' for 'sm_90'
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
info    : used 40 registers, used 1 barriers, 16 stack, 33792 bytes smem, 560 bytes cmem[0], 0 bytes lmem"""
    assert parse(log) == dict(registers=40, spill_stores=8, spill_loads=12, stack=16, smem=33792)
