"""Docs are tests: the Python snippets of the README and of the manual's pages (docs/*.md), the sample
tables they show, the install commands they give, and the package's doctests run here."""

import configparser
import doctest
import json
import pathlib
import re
import shlex

import pytest

import fa_numba
from fa_numba import api, decode, iomodel, masks, online_softmax, reference, split_kv, tiled, tiling, tolerance

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *PAGES]  # every file whose snippets run here


def _name(path):
    return path.relative_to(ROOT).as_posix()


def _snippets(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


SNIPPETS = [(path, index) for path in DOCS for index in range(len(_snippets(path)))]


def test_the_docs_have_snippets():
    """The README and the pages that show code keep them (a page moved or renamed drops none silently)."""
    assert len(PAGES) >= 8
    names = {_name(path) for path, _ in SNIPPETS}
    assert {"README.md", "docs/api.md", "docs/layers.md"} <= names
    assert len(SNIPPETS) >= 6


@pytest.mark.parametrize("path, index", SNIPPETS, ids=[f"{_name(p)}-{i}" for p, i in SNIPPETS])
def test_doc_python_snippet_runs(path, index):
    code = _snippets(path)[index]
    if re.search(r"^import torch$", code, re.M):
        pytest.importorskip("torch", reason="this snippet shows PyTorch use (the optional 'torch' extra)")
    namespace = {}
    exec(compile(code, f"{_name(path)} snippet {index}", "exec"), namespace)  # asserts inside the snippet
    assert namespace, "snippet defined nothing"


def test_readme_links_every_page_of_the_manual_and_every_link_resolves():
    """README is the index: each docs/ page is linked from it, and every relative link in README and the
    pages names a file that exists (a moved section leaves no dangling link)."""
    readme = README.read_text()
    for page in PAGES:
        assert f"]({_name(page)})" in readme, f"README does not link {_name(page)}"
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{_name(path)} links {target}, which does not exist"


def test_readme_first_screen_is_what_the_project_is_the_two_commands_and_an_example():
    """A newcomer sees, before any manual text, the two commands and a short example that runs."""
    lines = README.read_text().splitlines()
    first = "\n".join(lines[:50])
    assert "pip install -e . && python -m fa_numba compare" in first
    assert "&& python -m pytest" in first
    example = _snippets(README)[0]
    assert "```python\n" + example in first and len(example.strip().splitlines()) <= 12


def _readme_test_command():
    """The README's test command: the bash line that runs pytest, as a list of `&&`-separated commands."""
    (line,) = [line for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
               for line in block.splitlines() if "python -m pytest" in line]
    return [shlex.split(part) for part in line.split("&&")]


def _extras(words):
    """The extras of `pip install ... -e .[a,b]` (None when the command installs no extras)."""
    for word in words:
        found = re.fullmatch(r"\.\[([\w,-]+)\]", word)
        if found:
            return set(found.group(1).split(","))
    return None


def test_readme_test_command_installs_what_ci_installs():
    """The README's second command and .ci/run install the same extras after the same pinned torch, so the
    README's venv runs the PyTorch examples, as CI does; CI then also runs the slow tier."""
    readme = _readme_test_command()
    ci = [shlex.split(line) for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    pins = lambda commands: [w for c in commands if "install" in c for w in c if w.startswith("torch==")]
    extras = lambda commands: [_extras(c) for c in commands if "install" in c and _extras(c) is not None]
    assert pins(readme) == pins(ci) and len(pins(ci)) == 1
    assert extras(readme) == extras(ci) and len(extras(ci)) == 1
    for commands in (readme, ci):  # torch is installed before the editable install, so pip keeps the pin
        installs = [c for c in commands if "install" in c]
        assert any(w.startswith("torch==") for w in installs[-2]) and _extras(installs[-1]) is not None
    assert readme[-1] == ["python", "-m", "pytest"]
    assert ["python", "-m", "pytest"] in ci and ["python", "-m", "pytest", "-m", "slow", "-n", "2"] in ci
    assert "set -euo pipefail" in (ROOT / ".ci" / "run").read_text()  # exit 5 (no tests) stops CI too


def _setup_extras():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return {name: [re.split(r"[<>=\[ ]", line.strip())[0] for line in value.splitlines() if line.strip()]
            for name, value in cfg["options.extras_require"].items()}


def test_readme_test_command_installs_what_the_snippets_import():
    """Each optional library a snippet of the README or the manual imports comes with an extra the README's
    test command installs (the PyTorch block failed once in a venv made by the README's commands)."""
    extras, installed = _setup_extras(), _extras(_readme_test_command()[-2])
    provides = {package for name in installed for package in extras[name]}
    for path, index in SNIPPETS:
        for module in re.findall(r"^\s*(?:import|from) (\w+)", _snippets(path)[index], re.M):
            if module in ("torch", "matplotlib", "ml_dtypes"):
                assert module in provides, f"{_name(path)} snippet {index} imports {module}"


def test_notebooks_extra_can_run_jupyter_nbconvert():
    """`jupyter nbconvert --execute` (docs/testing.md) needs nbconvert and a kernel from the notebooks extra."""
    notebooks = _setup_extras()["notebooks"]
    assert {"nbconvert", "ipykernel", "nbclient", "nbformat", "matplotlib"} <= set(notebooks)
    assert "jupyter nbconvert --to notebook --execute notebooks_optional/" in (ROOT / "docs" / "testing.md").read_text()


@pytest.mark.parametrize("module", [fa_numba, reference, tolerance, online_softmax, tiling, masks, tiled, iomodel, api,
                                    split_kv, decode], ids=lambda m: m.__name__)
def test_doctests(module):
    failures, _ = doctest.testmod(module, raise_on_error=False)
    assert failures == 0


@pytest.mark.parametrize("name", ["fa_numba.autograd", "fa_numba.dropins"])
def test_torch_doctests(name):
    pytest.importorskip("torch", reason="these modules' examples use PyTorch (the optional 'torch' extra)")
    import importlib

    failures, tried = doctest.testmod(importlib.import_module(name), raise_on_error=False)
    assert failures == 0 and tried > 0


# slow tier: every kernel of both tables in the simulator, about 50 s on 2 cores (CI runs the tier too)
@pytest.mark.slow
@pytest.mark.skipif(fa_numba.backend.name() != "simulator",
                    reason="docs/compare.md shows the simulator's table; a GPU adds timing columns")
@pytest.mark.parametrize("argv", [[], ["--mask", "window:8,0"], ["--dtype", "float16", "--n-q", "32", "--heads", "1"],
                                  ["--decode", "--n-k", "40", "--heads", "2", "--heads-kv", "1", "--head-dim", "8",
                                   "--split-size", "16"]], ids=["default", "mask", "float16", "decode"])
def test_compare_page_tables_match_compare(argv, capsys):
    """The sample tables in docs/compare.md are what `compare` (and `compare --mask window:8,0`, `--dtype
    float16` with the tensor-core rows, `--decode`) print in the simulator."""
    from fa_numba import cli

    assert cli.main(["compare", *argv]) == 0
    printed = capsys.readouterr().out.splitlines()
    table = printed[next(i for i, line in enumerate(printed) if line.startswith("variant")):]
    page = (ROOT / "docs" / "compare.md").read_text()
    assert len(table) >= 3
    for line in table:
        assert line in page, line


def _profile_row(p):
    """docs/profile.md's row for one profile of the committed SASS table, as the page writes it."""
    c, hot, bound = p["config"], p["hot_loops"], p["bound"]
    issued, ffma = sum(h["issued"] for h in hot), sum(h["ffma"] for h in hot)
    kb = f"{p['smem'] / 1024:.1f}".rstrip("0").rstrip(".")
    peak = f"{100 * bound['fraction_of_peak']:.{0 if bound['fraction_of_peak'] >= 0.1 else 1}f}"
    name = p["name"] + (" (engine)" if p["name"] in ("v1", "v2") else "")
    return (f"| {name} | {c['head_dim']} | {'on' if c['causal'] else 'off'} | {p['threads']} | {p['registers']} | "
            f"{p['spill_stores']} | {kb} KB | {p['occupancy']['warps_per_sm']} ({p['occupancy']['limiter']}) | "
            f"{round(100 * bound['ffma_fraction'])}% | {issued / ffma:.1f} | "
            f"{sum(h['mix']['LDL/STL'] for h in hot)} | {bound['tflops']:.1f} TFLOP/s ({peak}%) |")


def test_profile_page_table_matches_the_shipped_profile():
    """Every row of docs/profile.md's resources table is the committed SASS table's numbers for that float32
    configuration (benchmarks/results/sass_table_sm90a.json: regenerating it means updating the page; the
    failure prints the row as it should read)."""
    profiles = json.loads((ROOT / "benchmarks" / "results" / "sass_table_sm90a.json").read_text())["profiles"]
    by_config = {(p["name"], p["config"]["head_dim"], p["config"]["causal"]): p for p in profiles
                 if p["config"]["dtype"] == "float32"}
    section = (ROOT / "docs" / "profile.md").read_text()
    rows = re.findall(r"^(\| (v1|v2|v1-rowwise|v2-rowwise|bwd-kv|bwd-q)(?: \(engine\))? \| (\d+) \| (on|off) \| .*)$",
                      section, re.M)
    assert len(rows) >= 8
    for line, name, d, causal in rows:
        expected = _profile_row(by_config[(name, int(d), causal == "on")])
        assert line == expected, f"docs/profile.md's row should read:\n{expected}"


MANUAL = [path for path in PAGES if path.name != "journal.md"]  # the journal keeps dates and long records


def test_manual_pages_state_facts_briefly_and_carry_no_dated_headings():
    """A manual page (every docs/*.md but the journal) has no table cell over 500 characters and no heading
    with a date like 2026-12-04: history, dated figures and long records go to docs/journal.md."""
    assert len(MANUAL) >= 8 and ROOT / "docs" / "journal.md" in PAGES
    for path in MANUAL:
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            fenced ^= line.startswith("```")
            if fenced:
                continue
            where = f"{_name(path)}:{number}"
            if line.startswith("#"):
                assert not re.search(r"\b\d{4}-\d{2}-\d{2}\b", line), f"{where}: a dated heading ({line})"
            if line.startswith("|"):
                for cell in line.strip().strip("|").split("|"):
                    assert len(cell.strip()) <= 500, f"{where}: a table cell of {len(cell.strip())} characters"


def _anchors(path):
    """The GitHub anchors of a Markdown file's headings (outside code fences), duplicates numbered."""
    seen, anchors, fenced = {}, set(), False
    for line in path.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"^#{1,6} (.*)$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_link_into_a_page_names_one_of_its_headings():
    """A link to a section (page.md#anchor, or #anchor within a page) of the README or the manual names a heading
    that is there, so moving a section to the journal leaves no link to nowhere."""
    for path in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#:]*\.md|)#([^)]+)\)", path.read_text()):
            page = (path.parent / target).resolve() if target else path
            assert anchor in _anchors(page), f"{_name(path)} links {target}#{anchor}, which is no heading there"
