"""Docs are tests: the README's Python snippets and the package's doctests run here."""

import doctest
import json
import pathlib
import re

import pytest

import fa_numba
from fa_numba import api, iomodel, masks, online_softmax, reference, tiled, tiling

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_snippets():
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.parametrize("index", range(len(_readme_snippets())))
def test_readme_python_snippet_runs(index):
    code = _readme_snippets()[index]
    if re.search(r"^import torch$", code, re.M):
        pytest.importorskip("torch", reason="this README snippet shows PyTorch use (the optional 'torch' extra)")
    namespace = {}
    exec(compile(code, f"README.md snippet {index}", "exec"), namespace)  # asserts inside the snippet
    assert namespace, "snippet defined nothing"


@pytest.mark.parametrize("module", [fa_numba, reference, online_softmax, tiling, masks, tiled, iomodel, api], ids=lambda m: m.__name__)
def test_doctests(module):
    failures, _ = doctest.testmod(module, raise_on_error=False)
    assert failures == 0


@pytest.mark.skipif(fa_numba.backend.name() != "simulator",
                    reason="the README shows the simulator's table; a GPU adds timing columns")
@pytest.mark.parametrize("argv", [[], ["--mask", "window:8,0"]], ids=["default", "mask"])
def test_readme_table_matches_compare(argv, capsys):
    """The sample tables in the README are what `compare` (and `compare --mask window:8,0`) print in the simulator."""
    from fa_numba import cli

    assert cli.main(["compare", *argv]) == 0
    printed = capsys.readouterr().out.splitlines()
    table = printed[next(i for i, line in enumerate(printed) if line.startswith("variant")):]
    readme = (ROOT / "README.md").read_text()
    assert len(table) >= 3
    for line in table:
        assert line in readme, line


def test_readme_profile_table_matches_the_shipped_profile():
    """Every row of the README's profile table is the shipped JSON's numbers for that configuration."""
    profiles = json.loads((ROOT / "benchmarks" / "results" / "profile_sm90_2026-11-29.json").read_text())["profiles"]
    by_config = {(p["name"], p["config"]["head_dim"], p["config"]["causal"]): p for p in profiles
                 if p["config"]["dtype"] == "float32"}
    section = (ROOT / "README.md").read_text().split("## profile:", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (v1|v2|v1-rowwise|v2-rowwise|bwd-kv|bwd-q)(?: \(engine\))? \| (\d+) \| (on|off) \| (.*)$",
                      section, re.M)
    assert len(rows) >= 8
    for name, d, causal, rest in rows:
        p = by_config[(name, int(d), causal == "on")]
        threads, registers, spills, _, warps, ffma, _, _, bound = (c.strip() for c in rest.split("|")[:9])
        assert (int(threads), int(registers), int(spills)) == (p["threads"], p["registers"], p["spill_stores"]), name
        assert warps.startswith(f"{p['occupancy']['warps_per_sm']} ({p['occupancy']['limiter']})"), (name, warps)
        assert ffma == f"{round(100 * p['bound']['ffma_fraction'])}%", (name, ffma)
        assert bound.startswith(f"{p['bound']['tflops']:.1f} TFLOP/s"), (name, bound)
