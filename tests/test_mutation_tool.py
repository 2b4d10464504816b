"""tools/mutation.py: the documented way to measure whether the tests would catch a wrong line.

The tool's verdicts are only as good as its mutants and its bookkeeping, so these tests pin both: every
operator family is generated and spliced into source that parses to exactly the mutated tree, text that is not
code (docstrings, messages, reprs) is left alone, ids do not move when unrelated lines do, a test run's exit
status becomes the right verdict, and the table's exit status fails on a survivor not explained in
tests/mutation_equivalents.md."""

import argparse
import ast
import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutation", ROOT / "tools" / "mutation.py")
mutation = sys.modules["mutation"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(mutation)

SOURCE = '''"""A docstring with 1 < 2 in it."""
LIMIT = 3


def f(a, b, xs):
    """Not code: a + b."""
    if a < b and not xs:
        raise ValueError(f"a={a + 1} must be >= {b}")
    total = -a
    total += max(a, b) * 2.5
    return total if any(x == a for x in xs) else ~b


class C:
    def __repr__(self):
        return "C(" + str(1 + 1) + ")"
'''


def _kinds(mutants):
    return {m.kind.split()[0] for m in mutants}


def test_every_operator_family_is_generated_and_spliced_exactly():
    ms = mutation.mutants("shapes", SOURCE)  # shapes has no scope: every function and class is mutated
    assert _kinds(ms) == {"cmp", "arith", "unary", "bool", "const", "return", "aug", "minmax"}
    for m in ms:
        text = mutation.mutated_source(m, SOURCE)  # raises if the splice is not the mutated tree
        assert text != SOURCE and text.count("\n") == SOURCE.count("\n")  # line numbers of the rest stay
        ast.parse(text)
    assert len({m.id for m in ms}) == len(ms)


def test_text_that_is_not_code_is_not_mutated():
    """Docstrings, the message of a raise, f-strings and __repr__ are display text; the condition that
    raises is code and is mutated."""
    ms = mutation.mutants("shapes", SOURCE)
    lines = {m.line for m in ms}
    assert 1 not in lines and 6 not in lines and 8 not in lines  # docstrings and the raise's f-string
    assert not [m for m in ms if m.qualname.endswith("__repr__")]
    assert {m.kind for m in ms if m.line == 7} >= {"cmp < -> <=", "bool and -> or", "unary not x -> x"}


def test_ids_do_not_move_when_unrelated_lines_do():
    edited = SOURCE.replace("LIMIT = 3\n", "LIMIT = 3\n\n\ndef g():\n    return None\n")
    before = {m.id: m.line for m in mutation.mutants("shapes", SOURCE)}
    after = {m.id: m.line for m in mutation.mutants("shapes", edited)}
    assert set(before) <= set(after)
    assert all(after[i] == line + 4 for i, line in before.items() if line > 2)


def test_a_scope_limits_the_mutants_to_the_named_functions():
    ms = mutation.mutants("profile")
    assert ms and all(any(m.qualname == s or m.qualname.startswith(s + ".") for s in mutation.MODULES["profile"].scope)
                      for m in ms)


def test_each_module_maps_to_test_files_that_exist():
    for name, target in mutation.MODULES.items():
        assert (ROOT / target.path).is_file(), name
        missing = [t for t in target.tests if not (ROOT / t.split("::")[0]).is_file()]
        assert not missing, f"{name}: {missing}"
        for test in [t for t in (*target.tests, *target.deselect) if "::" in t]:  # a named test must exist
            path, function = test.split("::")
            assert f"def {function.split('[')[0]}(" in (ROOT / path).read_text(), test
        assert not [t for t in target.tests if "kernel" in t.split("::")[0]], name  # CPU tests only


def test_every_listed_equivalent_is_a_mutant_the_tool_generates():
    ids = {m.id for name in mutation.MODULES for m in mutation.mutants(name)}
    listed = mutation.equivalents()
    assert listed, "tests/mutation_equivalents.md lists no mutant"
    assert not [i for i in listed if i not in ids]
    assert all(": " in line.split("`", 2)[2] for line in listed.values())  # each line gives a reason


def _box(tmp_path, body):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_tiny.py").write_text(body)
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "mutation.py").write_text((ROOT / "tools" / "mutation.py").read_text())
    return mutation.Target("unused.py", ("tests/test_tiny.py",))


@pytest.mark.parametrize("body, verdict", [
    ("def test_ok():\n    assert 1 + 1 == 2\n", "survived"),
    ("def test_no():\n    assert 1 + 1 == 3\n", "killed"),
    ("import no_such_module_anywhere\n\ndef test_ok():\n    pass\n", "killed"),  # broken at import
])
def test_a_test_run_becomes_the_verdict(tmp_path, body, verdict):
    status, seconds, detail = mutation.run_tests(tmp_path, _box(tmp_path, body), timeout=120)
    assert status == verdict and seconds > 0
    if verdict == "killed":
        assert detail


def test_a_run_past_the_time_limit_counts_as_killed(tmp_path):
    target = _box(tmp_path, "import time\n\ndef test_slow():\n    time.sleep(60)\n")
    status, seconds, detail = mutation.run_tests(tmp_path, target, timeout=3)
    assert status == "timeout" and seconds < 30 and "over 3 s" in detail


def _record(m, status, module="online_softmax"):
    src, tests = mutation.fingerprints(module)
    return dict(id=m.id, module=module, line=m.line, qualname=m.qualname, kind=m.kind, before=m.before,
                after=m.after, status=status, seconds=1.0, detail="", source_sha=src, tests_sha=tests,
                commit="test", date="2026-11-29")


def _report(tmp_path, records, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code = mutation.report(["online_softmax"], argparse.Namespace(results=path, stub=False))
    return code, capsys.readouterr().out


def test_the_table_fails_on_a_survivor_that_is_not_explained(tmp_path, capsys):
    ms = mutation.mutants("online_softmax")
    listed = [m for m in ms if m.id in mutation.equivalents()]
    plain = [m for m in ms if m.id not in mutation.equivalents()]
    assert listed and plain
    killed_all = [_record(m, "survived" if m in listed else "killed") for m in ms]
    code, out = _report(tmp_path, killed_all, capsys)
    assert code == 0 and "(holes):" not in out
    row = next(line for line in out.splitlines() if line.startswith("online_softmax"))
    assert row.split()[1:7] == [str(len(ms)), str(len(plain)), str(len(listed)), str(len(listed)), "0", "0"]

    hole = [_record(m, "survived") if m is plain[0] else r for m, r in zip(ms, killed_all)]
    code, out = _report(tmp_path, hole, capsys)
    assert code == 1 and plain[0].id in out.split("(holes):")[1]

    code, out = _report(tmp_path, killed_all[1:], capsys)  # one mutant without a result
    assert code == 1 and "without a result" in out


def test_renumber_shows_each_equivalent_at_its_current_line(tmp_path):
    path = tmp_path / "equivalents.md"
    path.write_text(mutation.EQUIVALENTS.read_text())
    mutation.renumber(path)
    lines = {m.id: m.line for name in mutation.MODULES for m in mutation.mutants(name)}
    listed = mutation.equivalents(path)
    assert listed
    for mutant_id, line in listed.items():
        assert f".py:{lines[mutant_id]} " in line, line
    assert mutation.renumber(path) == 0  # a second pass changes nothing
