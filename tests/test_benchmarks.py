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


@SIMULATOR_ONLY
@pytest.mark.slow  # ten jobs in two processes, ~75 s in the simulator
def test_device_session_runs_in_smoke_mode(tmp_path):
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_session.py"), "--smoke", "--workers", "2",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "session.jsonl").read_text().splitlines()]
    assert {r["job"] for r in rows} == {"mma-fwd", "mma-bwd", "simt", "wide", "decode"}
    assert all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    assert "| kernel | dtype |" in (tmp_path / "session.md").read_text()


def test_the_committed_h200_table_keeps_suspect_timings_out_of_the_model_comparison():
    """device_session --render on the first H200 session's runs: every row timed while other work held the GPU
    shows no measured / model ratio; the clean ones do, computed from the committed estimate."""
    runs = [ROOT / "benchmarks" / "results" / f"h200_2026-12-04_run{i}.jsonl" for i in (3, 4)]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_session.py"), "--render",
                           *map(str, runs), "--model-upto", "estimate_sm90_2026-12-04.json"],  # the code that ran
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    table = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in table[0]]
    rows = [dict(zip(header, (c.strip() for c in cells))) for cells in table[1:] if len(cells) == len(header)]
    suspect = [r for r in rows if "time suspect" in r.get("check", "")]
    assert len(suspect) == 10 and all(r["meas/model"] == "-" for r in suspect)
    v2_mma = next(r for r in rows if (r["kernel"], r["dtype"], r["d"], r["causal"]) == ("v2-mma", "float16", "64",
                                                                                        "False"))
    assert v2_mma["ms"] == "1.328" and v2_mma["meas/model"] == "1.95"  # 1.328 ms against the model's 0.683
    # the model of that code: the uncapped causal build, the one-stage 3xTF32 d = 128 before the split's clamp
    causal = next(r for r in rows if (r["kernel"], r["dtype"], r["d"], r["causal"]) == ("v2-mma", "float16", "64",
                                                                                        "True"))
    f32 = next(r for r in rows if (r["kernel"], r["dtype"], r["d"], r["causal"]) == ("v2-mma", "float32", "128",
                                                                                     "False"))
    assert causal["model TFLOP/s (limiter)"] == "408.8 (shared)"
    assert f32["model TFLOP/s (limiter)"] == "79.5 (latency)"


@SIMULATOR_ONLY
@pytest.mark.slow  # a subprocess, ~10 s in the simulator
def test_sinks_gpu_script_runs_in_smoke_mode(tmp_path):
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sinks_gpu.py"), "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "sinks_gpu.json").read_text())["rows"]
    assert all(r["passed"] for r in rows)
    assert {(r["what"], r["engine"]) for r in rows} == {
        ("forward with sinks", "simt"), ("forward with sinks", "mma"), ("backward with sinks and dLSE", "simt"),
        ("backward with sinks and dLSE", "mma"), ("decode with sinks", "auto"),
        ("packed = each alone (whole tiles)", "mma")}
