"""Run the property tests under many random Hypothesis seeds, one pytest run per seed, with progress.

CI stays derandomised (the `ci` profile draws the same examples every run, so a submission never fails by
luck); this is how the bounds are checked against other draws:

    python tools/seed_sweep.py                          # 50 random seeds of the CPU property tests
    python tools/seed_sweep.py --seeds 10 --whole       # 10 random seeds of the whole suite
    python tools/seed_sweep.py --seed-list 7,123        # these seeds (e.g. to reproduce a failure)
    python tools/seed_sweep.py --seeds 5 -- tests/test_tiled.py -k float32   # any pytest arguments

Each seed runs `python -m pytest -q -p no:cacheprovider --hypothesis-seed=S ...` with HYPOTHESIS_PROFILE=dev
(300 examples; `--profile` to change it) in the repository root. One line per seed goes to stderr as it
finishes; the summary (seeds tried, failures, the failing seeds and test ids) goes to stdout, and to
`--json PATH` if given. Exit code 1 if any seed failed. A failing seed is reproduced by running the printed
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
CPU_PROPERTY_FILES = ("tests/test_online_softmax.py", "tests/test_tiled.py", "tests/test_tiling.py",
                      "tests/test_reference.py", "tests/test_iomodel.py")
FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


@dataclass
class SeedRun:
    seed: int
    passed: bool
    seconds: float
    failed: list[str] = field(default_factory=list)
    summary: str = ""


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
                   sorted(set(FAILED_LINE.findall(done.stdout))), lines[-1] if lines else done.stderr[-500:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=50, help="how many random seeds (default 50)")
    parser.add_argument("--seed-list", help="comma-separated seeds to run instead of random ones")
    parser.add_argument("--whole", action="store_true", help="run the whole suite, not only the CPU property tests")
    parser.add_argument("--profile", default="dev", help="Hypothesis profile (default dev: 300 examples)")
    parser.add_argument("--json", help="write the runs to this path")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments replacing the default test files")
    args = parser.parse_args(argv)
    if args.profile == "ci":
        parser.error("the ci profile is derandomised: every seed would draw the same examples")
    seeds = [int(s) for s in args.seed_list.split(",")] if args.seed_list else pick_seeds(args.seeds)
    pytest_args = args.pytest_args or ([] if args.whole else list(CPU_PROPERTY_FILES))
    target = " ".join(pytest_args) or "the whole suite"
    print(f"{len(seeds)} seeds, HYPOTHESIS_PROFILE={args.profile}, {target}", file=sys.stderr)
    runs = []
    for n, seed in enumerate(seeds, 1):
        run = run_seed(seed, pytest_args, args.profile)
        runs.append(run)
        failures = sum(not r.passed for r in runs)
        verdict = "pass" if run.passed else "FAIL " + " ".join(run.failed or [run.summary])
        print(f"[{n:>3}/{len(seeds)}] seed {seed:>10}  {run.seconds:6.1f} s  {verdict}  ({failures} failed so far)",
              file=sys.stderr, flush=True)
    failed = [r for r in runs if not r.passed]
    print(f"{len(runs)} seeds tried, {len(failed)} failed (HYPOTHESIS_PROFILE={args.profile}; {target})")
    print("seeds: " + ",".join(str(r.seed) for r in runs))
    for r in failed:
        print(f"  seed {r.seed}: {', '.join(r.failed) or r.summary}")
        print(f"    reproduce: HYPOTHESIS_PROFILE={args.profile} python {' '.join(command(r.seed, pytest_args)[1:])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"profile": args.profile, "pytest_args": pytest_args, "runs": [asdict(r) for r in runs]},
                      fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
