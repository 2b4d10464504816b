"""Docs are tests: the README's Python snippets and the package's doctests run here."""

import doctest
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
