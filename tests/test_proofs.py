"""proofs/ and the tests stay tied: every "Checked by" id exists, every lemma mark has a proof file,
and every test marked with a lemma is listed by that lemma."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROOFS = ROOT / "proofs"
LEMMA_FILE = re.compile(r"^(L\d+)_\w+\.md$")


def lemma_files() -> dict[str, pathlib.Path]:
    return {m.group(1): p for p in PROOFS.iterdir() if (m := LEMMA_FILE.match(p.name))}


def checked_by(path: pathlib.Path) -> list[str]:
    """Test ids listed after '**Checked by:**' as `tests/...::name` in backticks."""
    text = path.read_text()
    assert "**Checked by:**" in text, f"{path.name} has no 'Checked by' section"
    section = text.split("**Checked by:**", 1)[1]
    return re.findall(r"`(tests/[\w/]+\.py::[\w:]+)`", section)


@pytest.fixture(scope="module")
def collected(request, tmp_path_factory) -> dict[str, set[str]]:
    """{test id without parameters: lemmas marked}: this session's own collection when it collected the whole
    suite (conftest keeps it, slow tests included), else a --collect-only run of the whole suite."""
    found = getattr(request.config, "fa_numba_lemmas", None)
    if found is None:
        out = tmp_path_factory.mktemp("lemmas") / "map.json"
        env = {**os.environ, "FA_NUMBA_LEMMA_MAP": str(out)}
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p",
                               "no:cacheprovider", "tests"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        found = json.loads(out.read_text())
    ids: dict[str, set[str]] = {}
    for node, lemmas in found.items():
        ids.setdefault(re.sub(r"\[.*\]$", "", node), set()).update(lemmas)
    return ids


def test_the_six_lemmas_and_the_index_exist():
    assert set(lemma_files()) >= {f"L{k}" for k in range(1, 7)}
    readme = (PROOFS / "README.md").read_text()
    for name, path in lemma_files().items():
        assert path.name in readme, f"proofs/README.md does not link {path.name}"
    assert (PROOFS / "notation.md").exists()


def test_every_checked_by_id_exists_and_carries_the_mark(collected):
    for lemma, path in lemma_files().items():
        ids = checked_by(path)
        assert ids, f"{path.name} lists no test"
        for test_id in ids:
            assert test_id in collected, f"{path.name} lists {test_id}, which the suite does not collect"
            assert lemma in collected[test_id], f"{test_id} is listed by {path.name} but not marked lemma({lemma!r})"


def test_every_mark_names_a_lemma_that_lists_it(collected):
    files = lemma_files()
    for test_id, lemmas in collected.items():
        for lemma in lemmas:
            assert lemma in files, f"{test_id} is marked lemma({lemma!r}), which has no file in proofs/"
            assert test_id in checked_by(files[lemma]), f"{test_id} is marked {lemma} but {files[lemma].name} does not list it"


def test_checked_by_parser(tmp_path):
    proof = tmp_path / "L9_x.md"
    proof.write_text("Claim.\n\n**Checked by:**\n- `tests/test_a.py::test_b` (why)\n- `tests/test_c.py::TestM::runTest`\n")
    assert checked_by(proof) == ["tests/test_a.py::test_b", "tests/test_c.py::TestM::runTest"]
    proof.write_text("Claim without tests.")
    with pytest.raises(AssertionError, match="no 'Checked by' section"):
        checked_by(proof)
