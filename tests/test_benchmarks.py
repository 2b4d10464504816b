"""The GPU scripts stay one command away: their --smoke mode runs the same code paths in the simulator."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import fa_numba

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIMULATOR_ONLY = pytest.mark.skipif(fa_numba.backend.name() != "simulator",
                                    reason="--smoke is the simulator's mode; on a GPU run the scripts themselves")


@SIMULATOR_ONLY
@pytest.mark.parametrize("script, report", [("gpu_check.py", "gpu_check.json"),
                                            pytest.param("compare_gpu.py", "compare_gpu.json", marks=pytest.mark.slow)])
def test_device_scripts_run_in_smoke_mode(tmp_path, script, report):
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / report).read_text())["rows"]
    variants = {r["variant"] for r in rows}
    assert {"v1", "v2", "v1-rowwise", "v2-rowwise"} <= variants
    assert all(r["passed"] for r in rows)
    assert {"v1-mma", "v2-mma"} <= variants  # on the float16 shape, beside the CUDA-core variants
    # on the float32 shape too, by 3xTF32
    assert {r["dtype"] for r in rows if r["variant"].endswith("-mma")} == {"float16", "float32"}
    if script == "gpu_check.py":
        assert {"bwd-kv", "bwd-kv-deterministic", "bwd-q"} <= variants
    else:
        assert "Targets at N=" in (tmp_path / "compare_gpu.md").read_text()


@SIMULATOR_ONLY
@pytest.mark.slow
def test_mma_gpu_script_runs_in_smoke_mode(tmp_path):
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mma_gpu.py"), "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "mma_gpu.json").read_text())["rows"]
    forward = [r for r in rows if r["order"] in ("v1", "v2")]
    wide = [r for r in rows if r["order"] in ("v2-wide", "v2-strided")]
    assert {(r["order"], r["d"], r["d_v"], r["causal"]) for r in wide} == {
        ("v2-wide", 16, 8, False), ("v2-wide", 16, 8, True), ("v2-strided", 16, 16, False),
        ("v2-strided", 16, 16, True)}
    assert all(r["passed"] for r in wide)
    assert {(r["order"], r["kind"], r["causal"]) for r in forward} == {
        (o, k, c) for o, k in (("v2", "float16"), ("v2", "bfloat16"), ("v1", "float16"), ("v2", "float32"),
                               ("v1", "float32"), ("v2", "tf32"))
        for c in (False, True)}
    assert all(r["passed"] and r["err_out"] <= r["atol_out"] for r in forward)
    backward = [r for r in rows if r["order"] == "bwd-kv-mma"]
    assert {(r["causal"], r["deterministic"]) for r in backward} == {(c, t) for c in (False, True) for t in (False, True)}
    assert all(r["passed"] and all(e <= a for e, a in zip(r["err"], r["atol"])) for r in backward)


@SIMULATOR_ONLY
@pytest.mark.slow  # a subprocess, ~9 s; compare --decode runs the same compare_decode.run in test_cli
def test_decode_gpu_script_runs_in_smoke_mode(tmp_path):
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_gpu.py"), "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "decode_gpu.json").read_text())["rows"]
    assert {r["variant"] for r in rows} == {"split", "unsplit", "split-mma", "unsplit-mma", "v2"}
    assert all(r["passed"] and r["err_out"] <= r["atol_out"] for r in rows)  # float16: the tensor cores' rows too
    assert "HBM bound" in (tmp_path / "decode_gpu.md").read_text()


@SIMULATOR_ONLY
@pytest.mark.slow  # a subprocess, ~40 s in the simulator
def test_masks_gpu_script_runs_in_smoke_mode(tmp_path):
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "masks_gpu.py"), "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "masks_gpu.json").read_text())["rows"]
    assert all(r["passed"] for r in rows)
    assert {r["order"] for r in rows if r["what"] == "mask_mod"} == {"v1", "v2", "v1-rowwise", "v2-rowwise", "kv",
                                                                     "kv-det", "q", "v1-mma", "v2-mma", "kv-mma",
                                                                     "kv-mma-det"}
    assert {r["what"] for r in rows} >= {"strided d=8", "strided d=72"}  # d = 72: v1 takes the copy path
