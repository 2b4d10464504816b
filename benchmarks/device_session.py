"""The device session as one parallel run: every kernel checked, then timed, beside torch SDPA and the model.

    python benchmarks/device_session.py [--out DIR] [--workers 12] [--budget-s 360] [--only PREFIX,...]
                                        [--tests / --no-tests] [--list] [--smoke]

A lent GPU comes with about 15 minutes of device time, and compiling the kernels (5 to 90 s each on one CPU
core) is most of a serial session. So every job runs in a process of its own, up to --workers at once: the
compile and the check (against the float64 reference with the derived rule, at B=1, H=2, N=1024) run in
parallel, and only the timing (at B=4, H=16, N=4096: 3 warm-up calls, then CUDA events around each of 20 calls,
all enqueued before one synchronize so that a CPU busy compiling does not delay the launches; the median) holds
a file lock on the GPU, so no two timings overlap. A check's small launch (about 50 us) may land inside another job's
timed window; the median of 20 is what guards against that. Jobs marked exclusive (decoding, whose kernels
take microseconds) run alone after the others. A job that crashes takes only its own process down.

Jobs, in the order they start (the slowest compiles first):
- mma-fwd: v2-mma and v1-mma on float16, bfloat16, float32 (3xTF32) and plain TF32, d in {64, 128}, causal
  and not, at the tiles `engines.mma_tiles` gives (what `fa_numba.attention` launches), and the A / Bs:
  v2-mma float16 and bfloat16 at d = 64 in 64-row blocks of one row block a warp beside the 128-row tiles of
  two, the causal register cap, one stage beside the pipelined copies;
- mma-bwd: the tensor-core backward, atomic dQ and deterministic, float16 and float32 (3xTF32);
- simt: the CUDA-core v2, v1 (float32) and bwd-kv, d in {64, 128}, causal and not; bwd-q and bwd-kv-det at d = 64;
- sdpa: torch SDPA forward (float16, bfloat16, float32) and backward (float16, float32), backend named;
- wide: v2-mma float16 at d = 192 (d_v = 128 and 192) and on strided views;
- decode (exclusive): split-KV decoding, benchmarks/decode_gpu.py's shapes.
With --tests, the warp-primitive and tensor-core tests run first with the simulator off, beside the jobs
(pytest -n 3, the default tier of those files): the hardware against the host-side reading of the PTX ISA.

Each finished job appends one JSON line to session.jsonl under --out and rewrites session.md (the table:
check, ms, TFLOP/s, SDPA ms and backend, the whole-kernel model's estimate from the newest committed
benchmarks/results/estimate_sm90_*.json and measured / model time). What a killed run finished stays.
TFLOP/s: forward 4 B H N^2 d, backward 2.5 x that (flash-attn's count), halved for causal.
--smoke: the simulator, tiny shapes, no timing, two jobs of each kind (the script's own test).
The jobs and their lock are device_jobs.py, the table device_table.py; this file schedules them.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from device_jobs import JOBS, LOCK, name_of, plan  # noqa: E402 - the benchmarks folder, put on the path above
from device_table import render  # noqa: E402


# The jobs' compiles yield the CPU to the tests (they ran 45 of their 79 default-tier tests in 120 s beside 13
# compiling jobs on 2026-12-04) and to the timed job's launches; the GPU's work is not slowed by it.
JOB_NICENESS = 5


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def python_path() -> str:
    """The checkout first, then whatever PYTHONPATH already holds (packages carried to a device machine)."""
    return os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def header() -> dict:
    probe = ("import json, numba, numpy, fa_numba; from fa_numba import compare; m = compare.machine(); "
             "print(json.dumps(m))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": python_path()})
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"device": "unknown", "probe_error": (done.stderr or "")[-500:]}


def start_tests(out: str, smoke: bool):
    if smoke:
        return None
    files = ["tests/test_warp.py", "tests/test_fragments.py", "tests/test_mma_forward.py", "tests/test_mma_tf32.py",
             "tests/test_mma_backward.py", "tests/test_mma_backward_tf32.py", "tests/test_mma_row_blocks.py"]
    log_file = open(os.path.join(out, "tests_gpu.log"), "w")
    return subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-n", "6", "--tb=short", "-rf", "-p",
                             "no:cacheprovider", *files],
                            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "PYTHONPATH": python_path()})


def stop(proc) -> None:
    """Kill a process and its group: pytest's xdist workers outlive their controller (on 2026-12-04 they kept
    launching kernels after it was killed, and the timings of the next 25 s read up to 8x slow)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"),
                    help="folder for session.jsonl, session.md, tests_gpu.log (default: $OUT, else "
                         "benchmarks/results)")
    ap.add_argument("--workers", type=int, default=12, help="jobs at once (default: 12)")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="no job starts after this many seconds; running ones are stopped 60 s later (default 360)")
    ap.add_argument("--only", default="", help="comma list of job kinds to run (default: all): " + ",".join(JOBS))
    ap.add_argument("--tests", action=argparse.BooleanOptionalAction, default=True,
                    help="run the primitive and tensor-core tests with the simulator off (default: on)")
    ap.add_argument("--tests-s", type=float, default=150.0,
                    help="stop the tests after this many seconds (they hold the GPU meanwhile; default 150)")
    ap.add_argument("--list", action="store_true", help="print the jobs and stop")
    ap.add_argument("--smoke", action="store_true", help="in the simulator: tiny shapes, no timing")
    ap.add_argument("--render", nargs="+", metavar="JSONL",
                    help="print the table of earlier runs' session.jsonl files (rows marked 'suspect' flagged) "
                         "beside the newest committed estimate, and stop")
    ap.add_argument("--model-upto", metavar="FILE",
                    help="with --render: read the committed estimate_sm90_*.json files up to this name only (the "
                         "model of the code those runs timed; default: all, each configuration's newest)")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        rows = [json.loads(line) for path in args.render for line in open(path) if line.strip()]
        print(render(rows, {"device": "NVIDIA H200", "runs": " ".join(os.path.basename(p) for p in args.render)},
                     None, args.model_upto))
        return 0
    if args.job:  # a worker: run one job, print its row last
        import fa_numba  # noqa: F401 - first: it chooses the backend before numba.cuda is imported

        spec = json.loads(args.job)
        start = time.time()
        row = {**spec, **JOBS[spec["job"]](spec, args.smoke), "seconds": round(time.time() - start, 1)}
        print("RESULT " + json.dumps(row, default=float), flush=True)
        return 0
    jobs = plan(args.smoke)
    if args.only:
        unknown = set(args.only.split(",")) - set(JOBS)
        if unknown:
            ap.error(f"--only takes job kinds among {sorted(JOBS)}, got {sorted(unknown)}")
        jobs = [j for j in jobs if j["job"] in args.only.split(",")]
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    if args.list:
        for j in jobs:
            print(name_of(j), json.dumps(j))
        return 0
    os.makedirs(args.out, exist_ok=True)
    threads = {name: "2" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env = {**os.environ, **threads, "PYTHONPATH": python_path(), "FA_NUMBA_GPU_LOCK": LOCK, "PYTHONUNBUFFERED": "1"}
    start, rows, running = time.time(), [], {}
    info = header() if not args.smoke else {"device": "CUDA simulator (smoke)"}
    log(f"[session] {len(jobs)} jobs, {args.workers} at once, budget {args.budget_s:.0f} s; {info}")
    holder = open(LOCK, "a")  # the tests launch kernels too: they hold the GPU until they end (or --tests-s)
    if args.tests and not args.smoke:
        fcntl.flock(holder, fcntl.LOCK_EX)
    tests = start_tests(args.out, args.smoke) if args.tests else None
    tests_line = None
    pending = [j for j in jobs if not j.get("exclusive")] + [j for j in jobs if j.get("exclusive")]
    jsonl = open(os.path.join(args.out, "session.jsonl"), "a")

    def finish(j, proc, text):
        result = next((line[7:] for line in reversed(text.splitlines()) if line.startswith("RESULT ")), None)
        row = json.loads(result) if result else {**j, "passed": False, "error": f"exit {proc.returncode}: "
                                                 + text[-600:].replace("\n", " | ")}
        rows.append(row)
        jsonl.write(json.dumps(row, default=float) + "\n")
        jsonl.flush()
        log(f"[{time.time() - start:4.0f} s] {name_of(j)} {j.get('dtype')} d={j.get('d')} causal={j.get('causal')}: "
            f"{'pass' if row.get('passed') else 'FAIL'} ms={row.get('ms')} ({row.get('seconds', '-')} s)")
        with open(os.path.join(args.out, "session.md"), "w") as fh:
            fh.write(render(rows, info, tests_line))

    while pending or running:
        now = time.time() - start
        for pid, (j, proc, fh) in list(running.items()):
            if proc.poll() is not None or now > args.budget_s + 60:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                fh.seek(0)
                finish(j, proc, fh.read())
                fh.close()
                del running[pid]
        if tests is not None and tests.poll() is None and now > args.tests_s:
            stop(tests)
        if tests is not None and tests.poll() is not None and tests_line is None:
            fcntl.flock(holder, fcntl.LOCK_UN)
            with open(os.path.join(args.out, "tests_gpu.log")) as fh:
                tests_line = (fh.read().strip().splitlines() or ["(no output)"])[-1] + f" (exit {tests.returncode})"
            log(f"[{now:4.0f} s] tests: {tests_line}")
        while pending and now <= args.budget_s:
            exclusive = pending[0].get("exclusive")
            if len(running) >= args.workers or (exclusive and running):
                break
            j = pending.pop(0)
            fh = open(os.path.join("/tmp", f"fa_numba_job_{os.getpid()}_{j['id']}.log"), "w+")
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--job", json.dumps(j)]
                                    + (["--smoke"] if args.smoke else []), cwd=ROOT, stdout=fh,
                                    stderr=subprocess.STDOUT, env=env, preexec_fn=lambda: os.nice(JOB_NICENESS))
            running[proc.pid] = (j, proc, fh)
            if exclusive:
                break
        if pending and now > args.budget_s:
            for j in pending:
                rows.append({**j, "passed": None, "error": "not run: budget spent"})
            pending = []
        time.sleep(0.5)
    if tests is not None:
        try:
            tests.wait(timeout=max(1.0, args.budget_s + 60 - (time.time() - start)))
        except subprocess.TimeoutExpired:
            stop(tests)
        with open(os.path.join(args.out, "tests_gpu.log")) as fh:
            tests_line = (fh.read().strip().splitlines() or ["(no output)"])[-1] + f" (exit {tests.returncode})"
    text = render(rows, info, tests_line)
    with open(os.path.join(args.out, "session.md"), "w") as fh:
        fh.write(text)
    print(text)
    failed = [r for r in rows if r.get("passed") is False]
    return 1 if failed or (tests is not None and tests.returncode) else 0


if __name__ == "__main__":
    sys.exit(main())
