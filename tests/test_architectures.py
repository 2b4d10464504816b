"""Every kernel family compiles for every architecture from sm_80 to sm_120 (fa_numba.architectures): no link
error, static shared memory within 48 KB, at least one block an SM, no spill but the one stated."""

import json
import os
import subprocess
import sys

import pytest

from fa_numba import architectures, profile

REAL_CUDA = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
TENSOR_CORE = ("v1-mma", "v2-mma", "bwd-kv-mma", "bwd-kv-mma-det", "bwd-dq-mma")


def test_architecture_names_parse_to_compute_capabilities():
    assert profile.compute_capability("sm_80") == (8, 0)
    assert profile.compute_capability("sm_90a") == (9, 0, "a")
    assert profile.compute_capability("sm_100a") == (10, 0, "a")
    assert profile.compute_capability("sm_120") == (12, 0)
    for bad in ("80", "sm_8", "sm_9x", "compute_90"):
        with pytest.raises(ValueError, match="arch must look like"):
            profile.compute_capability(bad)
    with pytest.raises(ValueError, match="sm_90 only"):
        profile._cc("sm_80")  # the profile's occupancy and bound stay sm_90's


def test_the_representatives_are_every_shipped_family_once_at_its_largest_head_dim():
    shipped = list(profile.configurations())
    reps = architectures.representatives()
    assert sorted(c["variant"] for c in reps) == sorted({c["variant"] for c in shipped})
    for rep in reps:
        same = [c for c in shipped if c["variant"] == rep["variant"] and c["dtype"] == rep["dtype"]]
        assert rep in same and rep["head_dim"] == max(c["head_dim"] for c in same)
        assert rep["dtype"] == ("float16" if rep["variant"] in TENSOR_CORE else "float32")
    every = architectures.every_family_and_dtype()
    assert {(c["variant"], c["dtype"]) for c in every} == {(c["variant"], c["dtype"]) for c in shipped}


def test_an_unknown_architecture_is_named():
    with pytest.raises(ValueError, match="sm_70"):
        architectures.check(architectures.representatives()[0], "sm_70")


def test_the_command_refuses_the_simulator_with_a_message():
    done = subprocess.run([sys.executable, "-m", "fa_numba.architectures", "--arch", "sm_80"],
                          env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}, capture_output=True, text=True)
    assert done.returncode == 2 and "NUMBA_ENABLE_CUDASIM=0" in done.stderr and "Traceback" not in done.stderr


def test_an_unknown_variant_is_named():
    done = subprocess.run([sys.executable, "-m", "fa_numba.architectures", "--variant", "v3"],
                          env=REAL_CUDA, capture_output=True, text=True)
    assert done.returncode == 2 and "v3 is not a shipped kernel family" in done.stderr
    assert "Traceback" not in done.stderr


def _run(tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "fa_numba.architectures", *argv, "--jobs", "2", "--json",
                           str(out)], env=REAL_CUDA, capture_output=True, text=True, timeout=1800)
    print(done.stdout)
    return done, json.loads(out.read_text())["results"]


# The one build with a problem, stated: the float16 dQ kernel at d = 128 needs 255 registers and a few more on
# the sm_8x compilers (sm_90a and sm_100a fit it in 255 and 230, sm_120 in 210). It runs, slower; a tile
# table keyed by compute capability would choose it a smaller one (not done).
KNOWN_SPILLS = {(arch, "bwd-dq-mma", 128): (36, 44) for arch in ("sm_80", "sm_86", "sm_89")}


@pytest.mark.slow
def test_every_family_builds_for_every_architecture(tmp_path):
    """Every family on the oldest and the newest architecture (sm_80, sm_120); the tensor-core families, whose
    instructions are the ones an architecture could lack, on the three others too (sm_86, sm_89, sm_100a).
    sm_90a: the committed SASS table (tests/test_profile.py). The CUDA-core families on sm_86 / sm_89 / sm_100a
    and the 3xTF32 builds: `python -m fa_numba.architectures --all` (docs/gpus.md). Every build links, within
    the shared-memory limit and with a block an SM; none spills but KNOWN_SPILLS, by exactly those bytes."""
    done, ends = _run(tmp_path, "ends", "--arch", "sm_80", "--arch", "sm_120")
    variants = [arg for name in TENSOR_CORE for arg in ("--variant", name)]
    done_tc, middle = _run(tmp_path, "middle", "--arch", "sm_86", "--arch", "sm_89", "--arch", "sm_100a", *variants)
    results = ends + middle
    families = {c["variant"] for c in profile.configurations()}
    for arch in ("sm_80", "sm_120"):
        assert {r["config"]["variant"] for r in results if r["arch"] == arch} == families
    for arch in ("sm_86", "sm_89", "sm_100a"):
        assert {r["config"]["variant"] for r in results if r["arch"] == arch} == set(TENSOR_CORE)
    spills = {}
    for r in results:
        assert "registers" in r, architectures.line(r)  # it linked
        assert 0 < r["registers"] <= 255 and 0 < r["smem"] <= architectures.STATIC_SHARED_LIMIT
        assert r["blocks_per_sm"] >= 1
        if r["spill_stores"] or r["spill_loads"]:
            spills[r["arch"], r["config"]["variant"], r["config"]["head_dim"]] = (r["spill_stores"], r["spill_loads"])
    assert spills == KNOWN_SPILLS
    # the command exits 1 exactly when a build it made has a problem
    assert done.returncode == 1 and done_tc.returncode == 1, done.stderr + done_tc.stderr
