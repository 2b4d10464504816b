"""Mutation testing of fa_numba's CPU layers: change one operator or constant, run the fast tests, repeat.

    python tools/mutation.py [MODULE ...]          run the mutants of these modules (default: all), resuming
    python tools/mutation.py --list [MODULE ...]   list the mutants (id, line, what changes); run nothing
    python tools/mutation.py --show ID             the diff of one mutant
    python tools/mutation.py --only ID [ID ...]    run these mutants (again), whatever is recorded
    python tools/mutation.py --report [MODULE ...] the per-module table and every survivor, from the results
    python tools/mutation.py --renumber            refresh the line numbers shown in the equivalents file

MODULE is a key of MODULES below (shapes, reference, tolerance, tolerance_backward, online_softmax, tiling, masks,
tiled, iomodel, profile). Exit status: 0 when every mutant of the modules asked for has a result and every survivor is
listed in tests/mutation_equivalents.md, 1 otherwise (2: a baseline run failed, nothing was mutated).

Why a small tool of our own rather than mutmut: mutmut 3 rewrites every function of a module into a
trampoline and runs the whole suite in a `mutants/` copy it manages, which fights this layout (the package
is imported by path from the repository root, kernels are selected at import, the CPU tests are a subset
of tests/ mapped per module) and its ids are not stable across edits. Here the standard library's `ast`
gives the mutation sites, a mutant is one spliced edit of one file in a throw-away copy of the repository,
and its id is a hash of (module, enclosing function, what changes), so ids survive edits elsewhere in the
file and tests/mutation_equivalents.md keeps meaning the same mutants while line numbers move.

Mutation operators, one site at a time:
    cmp     < <=, <= <, > >=, >= >, == !=, != ==, is / is not, in / not in
    arith   + -, - +, * /, / *, // /, % /, ** *, & |, | &, ^ &, << >>, >> <<
    unary   -x -> x, not x -> x, ~x -> x
    bool    and <-> or;  True <-> False;  any() <-> all(), .any() <-> .all()
    const   int n -> n + 1, float x -> x + 1
    return  return expr -> return None
    aug     x op= y -> x = y (the augmentation dropped), and op swapped as in arith
    minmax  max <-> min, np.maximum <-> np.minimum, .max() <-> .min(), argmax <-> argmin
Not mutated: docstrings, f-strings and the arguments of `raise` (error messages: their text is checked by
the message tests, and their condition is mutated where it is computed), string constants (here they are
names: a tensor, a dict key, an order, a numpy option, where a changed name is a KeyError or ValueError at
once, or is read by a comparison that the cmp operator mutates; or message text), annotations, `__repr__`
(a display form), `None`, and anything outside a module's `scope` when it has one (profile: the pure
functions the issue names; its opcode tables and the compile / CLI code are not in scope).

Each mutant runs `pytest -x -q -p no:cacheprovider` over the module's fast tests (CPU only; never a kernel
test) in a copy of the repository under a temporary directory, with Hypothesis' `ci` profile minus
shrinking (a failure is found before shrinking starts, so the verdict is the same, only faster), under
`nice -n 19`, with a per-mutant time limit (default: 5x the module's clean run + 30 s; a mutant that runs
into it counts as killed: it changed behaviour). The working tree is never written. Results go to
.mutation/results.jsonl (one JSON object per mutant run, appended as each finishes), so a run that is
stopped resumes where it was: a recorded result is reused while the module's source and its tests
(their files, conftest, strategies) are unchanged; --survivors reuses the killed ones of an older test set
and runs the survivors only; --fresh ignores the record.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import datetime
import difflib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / ".mutation" / "results.jsonl"
EQUIVALENTS = ROOT / "tests" / "mutation_equivalents.md"
# What a test run reads besides the test files themselves: a change here invalidates recorded results.
TEST_SUPPORT = ("tests/conftest.py", "tests/strategies.py", "tests/bounds.py", "tests/float64_bounds.py",
               "setup.cfg")

# ----------------------------------------------------------------------------------------------------
# Which tests each module's mutants run (the fast CPU tests that exercise it, the most direct first: -x
# stops at the first failure). A test id may name one test; `deselect` drops the kernel tests of a file.

NONFINITE_KERNELS = "tests/test_nonfinite.py::test_a_nan_poisons_exactly_the_rows_that_see_it_in_every_kernel"
BACKWARD_FLOORS = "tests/test_backward_nonfinite.py::test_the_reference_floors_do_not_see_what_the_mask_hides"


def _doctests(module: str) -> str:
    return f"tests/test_docs.py::test_doctests[fa_numba.{module}]"


PROFILE_PURE_TESTS = tuple(f"tests/test_profile.py::{name}" for name in (
    "test_innermost_loops_depth_and_mix_of_a_known_listing", "test_instruction_categories",
    "test_no_loop_and_self_branch_only", "test_float64_instructions_are_found", "test_ptxas_log_is_parsed",
    "test_occupancy_by_the_sm90_table", "test_bound_arithmetic"))


@dataclasses.dataclass(frozen=True)
class Target:
    path: str
    tests: tuple[str, ...]
    deselect: tuple[str, ...] = ()
    scope: tuple[str, ...] = ()  # qualified names (functions, classes, methods) to mutate; empty: everything


def _files(*names: str) -> tuple[str, ...]:
    return tuple(n if "::" in n else f"tests/test_{n}.py" for n in names)


MODULES = {
    "shapes": Target("fa_numba/shapes.py", _files(
        "inputs", "contracts_shapes", "reference", "tiled", "tiling", "iomodel", "masks", "backward_reference",
        "backward_tiled", "nonfinite"), (NONFINITE_KERNELS,)),
    "reference": Target("fa_numba/reference.py", _files(
        "reference", "contracts_reference", "backward_reference", "contracts_defaults", "contracts_tiled",
        _doctests("reference"), "nonfinite", "inputs", "masks", "tiled", "backward_tiled", "online_softmax",
        "slice_masks_reference"), (NONFINITE_KERNELS,)),
    "tolerance": Target("fa_numba/tolerance.py", _files(
        "reference", "contracts_reference", "backward_reference", "contracts_defaults", _doctests("tolerance"),
        "nonfinite", BACKWARD_FLOORS, "masks", "tiled", "backward_tiled", "slice_masks_reference"),
        (NONFINITE_KERNELS,)),
    "tolerance_backward": Target("fa_numba/tolerance_backward.py", _files(
        "backward_reference", "tolerance_grad16", "contracts_defaults", "contracts_reference", BACKWARD_FLOORS,
        "backward_tiled", "masks", "slice_masks_reference")),
    "online_softmax": Target("fa_numba/online_softmax.py", _files(
        "online_softmax", "seeds", "contracts_online_softmax", "contracts_tiled", "contracts_reference", "nonfinite",
        "tiled", "tiling", "masks", "backward_tiled"), (NONFINITE_KERNELS,)),
    "tiling": Target("fa_numba/tiling.py", _files(
        "tiling", "seeds", "contracts_tiling", "contracts_defaults", "masks", _doctests("tiling"), "inputs", "tiled",
        "iomodel", "backward_tiled")),
    "masks": Target("fa_numba/masks.py", _files(
        "masks", "contracts_masks", "contracts_defaults", _doctests("masks"))),
    "tiled": Target("fa_numba/tiled.py", _files(
        "tiled", "contracts_tiled", "contracts_reference", "contracts_defaults", "tiling", "iomodel", "backward_tiled",
        "nonfinite", "inputs"), (NONFINITE_KERNELS,)),
    "iomodel": Target("fa_numba/iomodel.py", _files(
        "iomodel", "contracts_iomodel", "contracts_tiled", "backward_tiled", "seeds", "inputs")),
    "profile": Target("fa_numba/profile.py", PROFILE_PURE_TESTS + _files("contracts_profile"), scope=(
        "parse_ptxas", "_round_up", "occupancy", "bound")),
    "sass": Target("fa_numba/sass.py", PROFILE_PURE_TESTS + _files("contracts_profile", "sass"),
                   ("tests/test_sass.py::test_real_kernels_round_trips_and_tile_loop",), scope=(
        "parse_sass", "_loop_spans", "innermost_loops", "hot_loops", "float64_instructions", "loop_tree",
        "enclosing_loop", "global_load_waits", "load_destination", "touched_registers", "_operands", "_width",
        "_registers", "_is_register", "_inside", "Instruction.base", "Instruction.category", "Loop.mix",
        "Loop.opcodes", "Loop.ffma", "Loop.issued", "Loop.issued_per_ffma")),
    "cycle_model": Target("fa_numba/cycle_model.py", _files("cycle_model")),
}


def test_args(target: Target, root: Path = ROOT) -> list[str]:
    """The target's tests that exist (a file named in the table may not have landed yet)."""
    return [t for t in target.tests if (root / t.split("::")[0]).exists()]


# ----------------------------------------------------------------------------------------------------
# Mutation sites.

CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
ARITH_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
              ast.Mod: ast.Div, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
              ast.BitXor: ast.BitAnd, ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.MatMult: ast.Mult}
CALL_SWAP = {"max": "min", "min": "max", "maximum": "minimum", "minimum": "maximum", "amax": "amin",
             "amin": "amax", "argmax": "argmin", "argmin": "argmax", "fmax": "fmin", "fmin": "fmax",
             "any": "all", "all": "any"}
OP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
           ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
           ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|",
           ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@", ast.And: "and", ast.Or: "or"}


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    module: str
    line: int
    qualname: str
    kind: str
    before: str
    after: str
    index: int  # position of the mutated node in ast.walk order
    new: ast.AST = dataclasses.field(compare=False, repr=False)

    def describe(self, width: int = 110) -> str:
        text = f"{MODULES[self.module].path}:{self.line} {self.qualname}: {self.kind}: {self.before} -> {self.after}"
        return text if len(text) <= width else text[: width - 3] + "..."


def _one_line(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _is_docstring(node: ast.AST, parent: ast.AST | None) -> bool:
    return (isinstance(parent, ast.Expr) and isinstance(node, ast.Constant) and isinstance(node.value, str))


class _Sites(ast.NodeVisitor):
    """Collects (node index, qualname, kind, new node) for every mutation site outside the skipped contexts."""

    def __init__(self, tree: ast.AST, scope: tuple[str, ...]):
        self.index = {id(n): k for k, n in enumerate(ast.walk(tree))}
        self.scope = scope
        self.stack: list[str] = []
        self.skip = 0
        self.sites: list[tuple[int, str, str, ast.AST, ast.AST]] = []

    # -- context -----------------------------------------------------------------------------------

    def _in_scope(self) -> bool:
        if not self.scope:
            return True
        name = ".".join(self.stack)
        return any(name == s or name.startswith(s + ".") for s in self.scope)

    def _named(self, node):
        self.stack.append(node.name)
        skip = node.name == "__repr__"
        self.skip += skip
        for decorator in getattr(node, "decorator_list", []):
            self.visit(decorator)
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                self.visit(base)
        else:
            self._arguments(node.args)
        for stmt in node.body:
            self.visit(stmt)
        self.skip -= skip
        self.stack.pop()

    def _arguments(self, args: ast.arguments):  # defaults only: annotations are not code
        for default in [*args.defaults, *[d for d in args.kw_defaults if d is not None]]:
            self.visit(default)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _named

    def visit_Lambda(self, node):
        self._arguments(node.args)
        self.visit(node.body)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)

    def visit_Raise(self, node):  # the message; the condition that raises is mutated where it is computed
        pass

    def visit_JoinedStr(self, node):  # f-strings: message and display text
        pass

    def visit_If(self, node):
        test = node.test
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"):
            return  # the `if __name__ == "__main__":` block
        self.generic_visit(node)

    def visit_Expr(self, node):
        if _is_docstring(node.value, node):
            return
        self.generic_visit(node)

    def _add(self, node, kind, new):
        if self.skip or not self._in_scope():
            return
        new = ast.fix_missing_locations(ast.copy_location(new, node))
        self.sites.append((self.index[id(node)], ".".join(self.stack) or "<module>", kind, node, new))

    # -- operators -----------------------------------------------------------------------------------

    def visit_Compare(self, node):
        for k, op in enumerate(node.ops):
            new = copy.deepcopy(node)
            new.ops[k] = CMP_SWAP[type(op)]()
            self._add(node, f"cmp {OP_TEXT[type(op)]} -> {OP_TEXT[CMP_SWAP[type(op)]]}", new)
        self.generic_visit(node)

    def visit_BinOp(self, node):
        if type(node.op) in ARITH_SWAP:
            new = copy.deepcopy(node)
            new.op = ARITH_SWAP[type(node.op)]()
            self._add(node, f"arith {OP_TEXT[type(node.op)]} -> {OP_TEXT[type(new.op)]}", new)
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if not isinstance(node.op, ast.UAdd):
            name = {ast.USub: "-x -> x", ast.Not: "not x -> x", ast.Invert: "~x -> x"}[type(node.op)]
            self._add(node, f"unary {name}", copy.deepcopy(node.operand))
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self._add(node, f"bool {OP_TEXT[type(node.op)]} -> {OP_TEXT[type(new.op)]}", new)
        self.generic_visit(node)

    def visit_Constant(self, node):
        value = node.value
        if isinstance(value, bool):
            self._add(node, f"bool {value} -> {not value}", ast.Constant(not value))
        elif isinstance(value, int):
            self._add(node, f"const {value} -> {value + 1}", ast.Constant(value + 1))
        elif isinstance(value, float):
            self._add(node, f"const {value!r} -> {value + 1.0!r}", ast.Constant(value + 1.0))

    def visit_Call(self, node):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in CALL_SWAP:
            new = copy.deepcopy(node)
            if isinstance(func, ast.Name):
                new.func.id = CALL_SWAP[name]
            else:
                new.func.attr = CALL_SWAP[name]
            kind = "bool" if name in ("any", "all") else "minmax"
            self._add(node, f"{kind} {name} -> {CALL_SWAP[name]}", new)
        self.generic_visit(node)

    def visit_Return(self, node):
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            self._add(node, "return expr -> return None", ast.Return(ast.Constant(None)))
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._add(node, f"aug {OP_TEXT[type(node.op)]}= -> =",
                  ast.Assign([copy.deepcopy(node.target)], copy.deepcopy(node.value), type_comment=None))
        if type(node.op) in ARITH_SWAP:
            new = copy.deepcopy(node)
            new.op = ARITH_SWAP[type(node.op)]()
            self._add(node, f"aug {OP_TEXT[type(node.op)]}= -> {OP_TEXT[type(new.op)]}=", new)
        self.generic_visit(node)


def _offsets(source: str) -> list[int]:
    starts, total = [], 0
    for line in source.splitlines(keepends=True):
        starts.append(total)
        total += len(line)
    starts.append(total)
    return starts


def _span(source: str, node: ast.AST) -> tuple[int, int]:
    """Character offsets [start, end) of a node (ast columns are UTF-8 byte offsets: convert per line)."""
    lines = source.splitlines(keepends=True)
    starts = _offsets(source)

    def char(line, col):
        return starts[line - 1] + len(lines[line - 1].encode()[:col].decode())

    return char(node.lineno, node.col_offset), char(node.end_lineno, node.end_col_offset)


def splice(source: str, node: ast.AST, new: ast.AST) -> str:
    """The source with `node` replaced by `new`, on the same lines (padding keeps later line numbers)."""
    start, end = _span(source, node)
    text = ast.unparse(new)
    pad = source[start:end].count("\n")
    if isinstance(node, ast.stmt):
        rest = source[end:].split("\n", 1)[0]
        replacement = text + ("\n" * pad if pad and not rest.strip(" \t").strip("#") else "")
    else:
        replacement = "(" + text + "\n" * pad + ")"
    return source[:start] + replacement + source[end:]


def _replace(tree: ast.AST, index: int, new: ast.AST) -> ast.AST:
    """tree with its index-th node (ast.walk order) replaced by `new`, in place (the self-check of splice)."""
    target = list(ast.walk(tree))[index]
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, new)
                return tree
            if isinstance(value, list):
                for k, item in enumerate(value):
                    if item is target:
                        value[k] = new
                        return tree
    raise AssertionError("node not found")


def mutants(module: str, source: str | None = None) -> list[Mutant]:
    """Every mutant of one module, in source order, with stable ids."""
    target = MODULES[module]
    source = (ROOT / target.path).read_text() if source is None else source
    tree = ast.parse(source)
    sites = _Sites(tree, target.scope)
    sites.visit(tree)
    out, seen = [], {}
    for index, qualname, kind, node, new in sorted(sites.sites, key=lambda s: (s[3].lineno, s[3].col_offset, s[0])):
        before, after = ast.unparse(node), ast.unparse(new)
        key = f"{module}|{qualname}|{kind}|{ast.dump(node)}|{ast.dump(new)}"
        seen[key] = seen.get(key, 0) + 1
        digest = hashlib.sha1(f"{key}|{seen[key]}".encode()).hexdigest()[:8]
        out.append(Mutant(f"{module}-{digest}", module, node.lineno, qualname, kind, _one_line(before),
                          _one_line(after), index, new))
    return out


def mutated_source(mutant: Mutant, source: str) -> str:
    tree = ast.parse(source)
    node = list(ast.walk(tree))[mutant.index]
    text = splice(source, node, mutant.new)
    if ast.dump(ast.parse(text)) != ast.dump(_replace(ast.parse(source), mutant.index, mutant.new)):
        raise AssertionError(f"{mutant.id}: the spliced source is not the mutated tree")
    return text


# ----------------------------------------------------------------------------------------------------
# Running.


def _sha(root: Path, *names: str) -> str:
    h = hashlib.sha1()
    for name in names:
        h.update(name.encode())
        h.update((root / name).read_bytes() if (root / name).exists() else b"<missing>")
    return h.hexdigest()[:12]


def fingerprints(module: str, root: Path = ROOT) -> tuple[str, str]:
    """(source sha, tests sha): a recorded result stands while both are unchanged."""
    target = MODULES[module]
    tests = test_args(target, root)
    files = sorted({t.split("::")[0] for t in tests} | set(TEST_SUPPORT))
    return _sha(root, target.path), _sha(root, *files) + ":" + ",".join(tests)


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_results(path: Path = RESULTS) -> dict[str, dict]:
    """The latest record per mutant id."""
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                records[record["id"]] = record
    return records


def make_sandbox() -> Path:
    """A copy of what the tests need, without caches; the working tree is never written."""
    box = Path(tempfile.mkdtemp(prefix="fa_numba_mutation_"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    for name in ("fa_numba", "tests", "tools", "proofs"):
        if (ROOT / name).exists():
            shutil.copytree(ROOT / name, box / name, ignore=ignore)
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, box / name)
    return box


def run_tests(box: Path, target: Target, timeout: float) -> tuple[str, float, str]:
    """Run the target's tests in the sandbox: (status, seconds, first failing test or the tail of the output)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "mutation",
           "--no-header", "-rf", *test_args(target, box)]
    for node in target.deselect:
        cmd += ["--deselect", node]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(box / "tools"),
           "FA_NUMBA_MUTATION": "1", "HYPOTHESIS_PROFILE": "ci"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=box, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", time.perf_counter() - start, f"over {timeout:.0f} s"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    seconds = time.perf_counter() - start
    if proc.returncode == 0:
        return "survived", seconds, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    if proc.returncode == 1 and failed:
        return "killed", seconds, failed[0]
    # pytest could not run the tests at all (import or collection error, usage): the mutant broke the
    # module at import time, which every test would see.
    return "killed", seconds, f"pytest exit {proc.returncode}: " + _one_line(out[-300:], 200)


def pytest_sessionstart(session):
    """Used as a pytest plugin by the mutant runs (-p mutation): Hypothesis' loaded profile without shrinking."""
    if os.environ.get("FA_NUMBA_MUTATION") != "1":
        return
    from hypothesis import Phase, settings

    phases = [p for p in settings.default.phases if p not in (Phase.shrink, Phase.explain)]
    settings.register_profile("mutation", settings(settings.default, phases=phases, report_multiple_bugs=False))
    settings.load_profile("mutation")


def run(modules: list[str], only: list[str], args) -> int:
    results = {} if args.fresh else load_results(args.results)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    commit, date = _commit(), datetime.date.today().isoformat()
    box = make_sandbox()
    stop = False

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        for module in modules:
            target = MODULES[module]
            source = (box / target.path).read_text()  # the copy: edits to the tree during a run do not leak in
            src_sha, tests_sha = fingerprints(module, box)
            todo = []
            for m in mutants(module, source):
                if only and m.id not in only:
                    continue
                old = results.get(m.id)
                fresh = old and old.get("source_sha") == src_sha
                if not only and fresh and (old.get("tests_sha") == tests_sha
                                           or (args.survivors and old["status"] != "survived")):
                    continue
                todo.append(m)
            print(f"{module}: {len(todo)} mutants to run", flush=True)
            if not todo:
                continue
            status, base_seconds, detail = run_tests(box, target, args.baseline_timeout)
            if status != "survived":
                print(f"{module}: the clean run fails ({status}: {detail}); not mutating it", flush=True)
                return 2
            timeout = args.timeout or 5 * base_seconds + 30
            print(f"{module}: clean run {base_seconds:.1f} s, limit {timeout:.0f} s per mutant", flush=True)
            module_file = box / target.path
            for n, m in enumerate(todo, 1):
                module_file.write_text(mutated_source(m, source))
                try:
                    status, seconds, detail = run_tests(box, target, timeout)
                finally:
                    module_file.write_text(source)
                record = dict(id=m.id, module=module, line=m.line, qualname=m.qualname, kind=m.kind, before=m.before,
                              after=m.after, status=status, seconds=round(seconds, 1), detail=detail,
                              source_sha=src_sha, tests_sha=tests_sha, commit=commit, date=date)
                with args.results.open("a") as fh:
                    fh.write(json.dumps(record) + "\n")
                results[m.id] = record
                mark = {"killed": "k", "timeout": "t", "survived": "SURVIVED"}[status]
                print(f"[{module} {n}/{len(todo)}] {mark:8} {seconds:5.1f} s  {m.describe(90)}"
                      + (f"  <- {detail}" if status == "killed" and args.verbose else ""), flush=True)
    except KeyboardInterrupt:
        stop = True
        print("stopped; the results so far are recorded, run again to resume", flush=True)
    finally:
        shutil.rmtree(box, ignore_errors=True)
    if stop:
        return 1
    return report(modules, args)


# ----------------------------------------------------------------------------------------------------
# The table.


def equivalents(path: Path = EQUIVALENTS) -> dict[str, str]:
    """{id: the line} of tests/mutation_equivalents.md: lines "- `ID` ...: reason"."""
    found = {}
    if path.exists():
        for line in path.read_text().splitlines():
            hit = re.match(r"^- `([a-z_]+-[0-9a-f]{8})`", line)
            if hit:
                found[hit.group(1)] = line
    return found


def renumber(path: Path = EQUIVALENTS) -> int:
    """Rewrite the `file.py:LINE` after each id in the equivalents file to the mutant's current line (ids do
    not move with edits elsewhere; the line numbers shown to the reader do). Returns how many changed."""
    lines = {m.id: m.line for module in MODULES for m in mutants(module)}
    changed = 0

    def fix(hit):
        nonlocal changed
        line = lines.get(hit.group(2))
        if line is None or int(hit.group(3)) == line:
            return hit.group(0)
        changed += 1
        return f"{hit.group(1)}{line}"

    text = re.sub(r"^(- `([a-z_]+-[0-9a-f]{8})` [\w.]+\.py:)(\d+)", fix, path.read_text(), flags=re.M)
    path.write_text(text)
    return changed


def report(modules: list[str], args) -> int:
    results = load_results(args.results)
    listed = equivalents()
    rows, holes, missing, stale, dates, commits = [], [], [], [], set(), set()
    for module in modules:
        src_sha, tests_sha = fingerprints(module)
        ms = mutants(module)
        ids = {m.id for m in ms}
        count = dict(generated=len(ms), killed=0, survived=0, equivalent=0, not_run=0, outdated=0)
        for m in ms:
            r = results.get(m.id)
            if r is None or r.get("source_sha") != src_sha:
                count["not_run"] += 1
                missing.append(m)
                continue
            if r.get("tests_sha") != tests_sha:
                count["outdated"] += 1
            dates.add(r["date"])
            commits.add(r["commit"])
            if r["status"] in ("killed", "timeout"):
                count["killed"] += 1
                if m.id in listed:
                    stale.append((m.id, "killed"))
            else:
                count["survived"] += 1
                if m.id in listed:
                    count["equivalent"] += 1
                else:
                    holes.append(m)
        stale += [(i, "no such mutant") for i in listed if i.split("-")[0] == module and i not in ids]
        rows.append((module, count))
    header = f"{'module':16}{'generated':>10}{'killed':>8}{'survived':>9}{'equivalent':>11}{'holes':>7}{'not run':>8}  score"
    print(header)
    total = dict(generated=0, killed=0, survived=0, equivalent=0, not_run=0, outdated=0)
    for module, c in rows + [("total", None)]:
        if c is None:
            c = total
        else:
            for k in total:
                total[k] += c[k]
        judged = c["generated"] - c["equivalent"] - c["not_run"]
        score = f"{100 * c['killed'] / judged:.1f}%" if judged else "-"
        print(f"{module:16}{c['generated']:>10}{c['killed']:>8}{c['survived']:>9}{c['equivalent']:>11}"
              f"{c['survived'] - c['equivalent']:>7}{c['not_run']:>8}  {score}"
              + (f"  ({c['outdated']} recorded with other tests)" if c["outdated"] else ""))
    print(f"score = killed / (generated - equivalent); results of {', '.join(sorted(dates)) or '-'}, "
          f"commit {', '.join(sorted(commits)) or '-'}")
    if holes:
        print(f"\n{len(holes)} survivors not in {EQUIVALENTS.relative_to(ROOT)} (holes):")
        for m in holes:
            print(f"  {m.id}  {m.describe()}")
    if args.stub and holes:
        print("\nstub lines for the equivalents file:")
        for m in holes:
            print(f"- `{m.id}` {MODULES[m.module].path.split('/')[-1]}:{m.line} {m.qualname}: "
                  f"`{m.before}` -> `{m.after}`: REASON")
    if stale:
        print(f"\n{len(stale)} entries of the equivalents file that are not survivors:")
        for i, why in stale:
            print(f"  {i}: {why}")
    if missing:
        print(f"\n{len(missing)} mutants without a result for the current source (run them).")
    return 1 if holes or missing or stale else 0


# ----------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/mutation.py", description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="*", help=f"modules (default: all): {', '.join(MODULES)}")
    p.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    p.add_argument("--show", metavar="ID", help="print the diff of one mutant")
    p.add_argument("--only", nargs="+", metavar="ID", default=[], help="run these mutants, whatever is recorded")
    p.add_argument("--report", action="store_true", help="the table from the recorded results, run nothing")
    p.add_argument("--stub", action="store_true", help="with --report: equivalents-file lines for each hole")
    p.add_argument("--survivors", action="store_true",
                   help="keep killed results recorded with other tests; run survivors and unrecorded mutants")
    p.add_argument("--fresh", action="store_true", help="ignore recorded results")
    p.add_argument("--renumber", action="store_true",
                   help="update the line numbers shown in tests/mutation_equivalents.md, run nothing")
    p.add_argument("--timeout", type=float, default=0, help="seconds per mutant (default: 5x the clean run + 30)")
    p.add_argument("--baseline-timeout", type=float, default=900, help=argparse.SUPPRESS)
    p.add_argument("--results", type=Path, default=RESULTS, help="the JSON-lines record (default: %(default)s)")
    p.add_argument("--no-nice", action="store_true", help="do not lower this process' priority to nice 19")
    p.add_argument("-v", "--verbose", action="store_true", help="name the test that killed each mutant")
    args = p.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        p.error(f"unknown modules {unknown}; choose from {', '.join(MODULES)}")
    modules = args.modules or list(MODULES)
    if args.only:
        modules = [m for m in MODULES if any(i.startswith(m + "-") for i in args.only)]
    if args.show:
        module = args.show.split("-")[0]
        found = [m for m in mutants(module) if m.id == args.show] if module in MODULES else []
        if not found:
            p.error(f"no mutant {args.show}")
        source = (ROOT / MODULES[module].path).read_text()
        print(found[0].describe(200))
        sys.stdout.writelines(difflib.unified_diff(source.splitlines(True), mutated_source(found[0], source).splitlines(True),
                                                   MODULES[module].path, MODULES[module].path + " (mutant)"))
        return 0
    if args.list:
        for module in modules:
            source = (ROOT / MODULES[module].path).read_text()
            for m in mutants(module, source):
                mutated_source(m, source)  # the splice's self-check
                print(f"{m.id}  {m.describe()}")
        return 0
    if args.report:
        return report(modules, args)
    if args.renumber:
        print(f"{renumber()} line numbers updated in {EQUIVALENTS.relative_to(ROOT)}")
        return 0
    if not args.no_nice:
        os.nice(19 - os.nice(0))
    return run(modules, args.only, args)


if __name__ == "__main__":
    sys.exit(main())
