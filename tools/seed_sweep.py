"""Run the property tests under many random Hypothesis seeds, one pytest run per seed, with progress.

CI stays derandomised (the `ci` profile draws the same examples every run, so a submission never fails by
luck); this is how the bounds are checked against other draws:

    python tools/seed_sweep.py                          # 50 random seeds of every property test file
    python tools/seed_sweep.py --cpu                    # 50 seeds of those that launch no kernel (minutes a seed)
    python tools/seed_sweep.py --seeds 5 --whole        # 5 random seeds of the whole default suite
    python tools/seed_sweep.py --seed-list 7,123        # these seeds (e.g. to reproduce a failure)
    python tools/seed_sweep.py --cpu --workers 0        # no pytest-xdist workers (a shared machine)
    python tools/seed_sweep.py --seeds 5 -- tests/test_tiled.py -k float32   # any pytest arguments

The property test files are computed, not listed: every tests/test_*.py that imports hypothesis
(`property_files`); `--cpu` keeps those that import no kernel (fa_numba.kernels, numba.cuda or test_kernels:
the simulator's launches are what makes a seed slow). Each seed runs `python -m pytest -q -p no:cacheprovider
--hypothesis-seed=S ...` with HYPOTHESIS_PROFILE=dev (300 examples, or a test's own max_examples; `--profile`
to change it) in the repository root. One line per seed goes to stderr as it finishes; the summary (seeds
tried, failures, the failing seeds and test ids, the time) goes to stdout; `--json PATH` gets the runs so far
after every seed. Exit code 1 if any seed failed. A failing seed is reproduced by running the printed
command, or `--seed-list S`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USES_HYPOTHESIS = re.compile(r"^(?:from|import) hypothesis\b", re.M)
LAUNCHES_KERNELS = re.compile(r"^(?:from|import) (?:fa_numba\.kernels|numba\.cuda|test_kernels)\b"
                              r"|^from numba import .*\bcuda\b", re.M)
FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)
REASON_LINE = re.compile(r"^(?:FAILED|ERROR) \S+ - (.*)$", re.M)  # pytest -ra's "id - Error: message"


def property_files(cpu_only: bool = False, root: str = ROOT) -> tuple[str, ...]:
    """Every tests/test_*.py that imports hypothesis, sorted, relative to root; cpu_only: those that import no
    kernel module either (fa_numba.kernels, numba.cuda, test_kernels), so that no test in them launches one."""
    files = []
    tests = os.path.join(root, "tests")
    for name in sorted(os.listdir(tests)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        with open(os.path.join(tests, name), encoding="utf-8") as fh:
            source = fh.read()
        if USES_HYPOTHESIS.search(source) and not (cpu_only and LAUNCHES_KERNELS.search(source)):
            files.append(f"tests/{name}")
    return tuple(files)


CPU_PROPERTY_FILES = property_files(cpu_only=True)
PROPERTY_FILES = property_files()


@dataclass
class SeedRun:
    seed: int
    passed: bool
    seconds: float
    failed: list[str] = field(default_factory=list)
    summary: str = ""
    reasons: list[str] = field(default_factory=list)  # each failure's error line, as pytest's summary gives it


def pick_seeds(count: int, rng: random.Random | None = None) -> list[int]:
    """`count` distinct random seeds in [0, 2**32)."""
    rng = rng or random.SystemRandom()
    seeds: list[int] = []
    while len(seeds) < count:
        s = rng.randrange(2**32)
        if s not in seeds:
            seeds.append(s)
    return seeds


def command(seed: int, pytest_args) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}",
            *pytest_args]


def run_seed(seed: int, pytest_args, profile: str) -> SeedRun:
    """One pytest run under `seed`; failed test ids are read from pytest's short summary (-ra)."""
    start = time.perf_counter()
    done = subprocess.run(command(seed, pytest_args), cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HYPOTHESIS_PROFILE": profile})
    lines = done.stdout.strip().splitlines()
    return SeedRun(seed, done.returncode == 0, time.perf_counter() - start,
                   sorted(set(FAILED_LINE.findall(done.stdout))), lines[-1] if lines else done.stderr[-500:],
                   [r[:500] for r in REASON_LINE.findall(done.stdout)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=50, help="how many random seeds (default 50)")
    parser.add_argument("--seed-list", help="comma-separated seeds to run instead of random ones")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--whole", action="store_true", help="run the whole default suite, not only the property tests")
    scope.add_argument("--cpu", action="store_true", help="only the property test files that launch no kernel")
    parser.add_argument("--profile", default="dev", help="Hypothesis profile (default dev: 300 examples)")
    parser.add_argument("--workers", type=int, help="pytest-xdist processes per seed (-n; default: setup.cfg's)")
    parser.add_argument("--json", help="write the runs to this path")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments replacing the default test files")
    args = parser.parse_args(argv)
    if args.profile == "ci":
        parser.error("the ci profile is derandomised: every seed would draw the same examples")
    seeds = [int(s) for s in args.seed_list.split(",")] if args.seed_list else pick_seeds(args.seeds)
    if args.pytest_args:
        pytest_args, target = args.pytest_args, " ".join(args.pytest_args)
    elif args.whole:
        pytest_args, target = [], "the whole suite"
    else:
        pytest_args = list(CPU_PROPERTY_FILES if args.cpu else PROPERTY_FILES)
        target = f"{len(pytest_args)} {'CPU ' if args.cpu else ''}property test files"
    if args.workers is not None:
        pytest_args = ["-n", str(args.workers), *pytest_args]
    print(f"{len(seeds)} seeds, HYPOTHESIS_PROFILE={args.profile}, {target}: {' '.join(pytest_args)}",
          file=sys.stderr)
    start = time.perf_counter()
    runs = []
    for n, seed in enumerate(seeds, 1):
        run = run_seed(seed, pytest_args, args.profile)
        runs.append(run)
        failures = sum(not r.passed for r in runs)
        verdict = "pass" if run.passed else "FAIL " + " ".join(run.failed or [run.summary])
        print(f"[{n:>3}/{len(seeds)}] seed {seed:>10}  {run.seconds:6.1f} s  {verdict}  ({failures} failed so far)",
              file=sys.stderr, flush=True)
        if args.json:  # after every seed: a sweep stopped halfway still leaves the seeds it ran
            _write_json(args.json, args.profile, pytest_args, runs)
    failed = [r for r in runs if not r.passed]
    total = time.perf_counter() - start
    print(f"{len(runs)} seeds tried, {len(failed)} failed (HYPOTHESIS_PROFILE={args.profile}; {target}; "
          f"{total:.0f} s, {total / max(len(runs), 1):.0f} s a seed)")
    print("seeds: " + ",".join(str(r.seed) for r in runs))
    for r in failed:
        print(f"  seed {r.seed}: {', '.join(r.failed) or r.summary}")
        for reason in r.reasons:
            print(f"    {reason}")
        print(f"    reproduce: HYPOTHESIS_PROFILE={args.profile} python {' '.join(command(r.seed, pytest_args)[1:])}")
    return 1 if failed else 0


def _write_json(path: str, profile: str, pytest_args, runs) -> None:
    with open(path, "w") as fh:
        json.dump({"profile": profile, "pytest_args": pytest_args, "runs": [asdict(r) for r in runs]}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
