"""tools/seed_sweep.py: the documented way to run the property tests under many random seeds."""

import importlib.util
import pathlib
import random
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("seed_sweep", ROOT / "tools" / "seed_sweep.py")
seed_sweep = sys.modules["seed_sweep"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(seed_sweep)


def test_seeds_are_distinct_and_in_range():
    seeds = seed_sweep.pick_seeds(200, random.Random(0))
    assert len(set(seeds)) == 200 and all(0 <= s < 2**32 for s in seeds)


def test_default_files_are_every_property_test_file_and_exist():
    """The default list is computed: every tests/test_*.py that imports hypothesis (test_masks.py among them,
    which the five hand-listed files of before left out: issue 60), found here by reading each file's lines."""
    expected = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                      if any(line.startswith(("from hypothesis", "import hypothesis"))
                             for line in p.read_text().splitlines()))
    assert list(seed_sweep.PROPERTY_FILES) == expected and len(expected) >= 14
    assert all((ROOT / f).is_file() for f in seed_sweep.PROPERTY_FILES)
    assert {"tests/test_masks.py", "tests/test_kernels.py", "tests/test_tiled.py"} <= set(expected)


def test_cpu_files_are_the_property_files_that_launch_no_kernel():
    cpu = set(seed_sweep.CPU_PROPERTY_FILES)
    assert cpu < set(seed_sweep.PROPERTY_FILES)
    assert "tests/test_kernels.py" not in cpu and "tests/test_decode.py" not in cpu  # simulator launches
    assert {"tests/test_masks.py", "tests/test_online_softmax.py", "tests/test_reference.py"} <= cpu
    for f in set(seed_sweep.PROPERTY_FILES) - cpu:
        assert seed_sweep.LAUNCHES_KERNELS.search((ROOT / f).read_text()), f


def test_property_files_reads_a_tests_folder(tmp_path):
    (tmp_path / "tests").mkdir()
    files = {"test_a.py": "from hypothesis import given\n", "test_b.py": "import numpy\n",
             "test_c.py": "import hypothesis\nfrom fa_numba.kernels import engine\n",
             "helper.py": "import hypothesis\n", "test_d.py": "from hypothesis import given\nfrom numba import cuda\n"}
    for name, text in files.items():
        (tmp_path / "tests" / name).write_text(text)
    assert seed_sweep.property_files(root=str(tmp_path)) == ("tests/test_a.py", "tests/test_c.py", "tests/test_d.py")
    assert seed_sweep.property_files(cpu_only=True, root=str(tmp_path)) == ("tests/test_a.py",)


def test_failed_ids_are_read_from_the_short_summary():
    out = "F.\n=== short test summary info ===\nFAILED tests/a.py::test_x - AssertionError: no\nERROR tests/b.py::test_y\n"
    assert seed_sweep.FAILED_LINE.findall(out) == ["tests/a.py::test_x", "tests/b.py::test_y"]


def test_the_ci_profile_is_refused():
    with pytest.raises(SystemExit):
        seed_sweep.main(["--profile", "ci", "--seeds", "1"])
    with pytest.raises(SystemExit):  # --cpu and --whole name two different file sets
        seed_sweep.main(["--cpu", "--whole", "--seeds", "1"])


@pytest.mark.slow  # three pytest runs in subprocesses, about 13 s on 2 cores (CI runs the slow tier too)
def test_a_sweep_reports_passes_and_failures(capsys, tmp_path):
    """Two seeds of one quick test pass; a run that selects no test counts as failed (pytest exit code 5)."""
    quick = ["tests/test_seeds.py::test_row_1_2_then_3"]
    assert seed_sweep.main(["--seed-list", "3,17", "--json", str(tmp_path / "runs.json"), "--", *quick]) == 0
    out = capsys.readouterr()
    assert "2 seeds tried, 0 failed" in out.out and "[  2/2] seed         17" in out.err
    assert (tmp_path / "runs.json").read_text().count('"passed": true') == 2
    assert seed_sweep.main(["--seed-list", "5", "--", *quick, "-k", "no_such_test"]) == 1
    assert "1 seeds tried, 1 failed" in capsys.readouterr().out


def test_each_failures_reason_is_kept_from_the_short_summary():
    """A failure's error line (pytest -ra: "FAILED id - Error: message") goes to the run's record, so a seed that
    does not fail again when rerun still says what failed (a health check, a bound, an exception)."""
    out = ("FAILED tests/test_a.py::test_x - AssertionError: dq: max error 2e-6 vs atol 1e-6\n"
           "ERROR tests/test_b.py::test_y - hypothesis.errors.FailedHealthCheck: too slow\n1 failed, 1 error in 3s\n")
    assert seed_sweep.REASON_LINE.findall(out) == ["AssertionError: dq: max error 2e-6 vs atol 1e-6",
                                                   "hypothesis.errors.FailedHealthCheck: too slow"]
