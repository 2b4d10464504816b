"""The kernel disk cache on a GPU: a first call in a new process, cold (empty cache) and warm (filled by the
first process), per engine, with the outputs compared bit for bit.

    python3 benchmarks/cache_gpu.py [--out DIR] [--smoke]

Each run is a process of its own with FA_NUMBA_CACHE_DIR set to one temporary folder: the first compiles and
fills it, the second should find every kernel there. Printed: one line per engine (seconds of the first call
cold and warm, same bits), and `cache.json` in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import hashlib, json, sys, time
import numpy as np
import fa_numba
from fa_numba import autograd  # noqa: F401 - the same imports a user's training script has

rng = np.random.default_rng(0)
SHAPE = tuple(json.loads(sys.argv[1]))
found = {}
for name, dtype, engine, backward in [("v2-mma float16", np.float16, "mma", False),
                                      ("v2 float32", np.float32, "simt", False),
                                      ("bwd-kv float32", np.float32, "simt", True)]:
    q, k, v = (rng.standard_normal(SHAPE).astype(dtype) for _ in range(3))
    start = time.perf_counter()
    if backward:
        out, lse = fa_numba.attention(q, k, v, engine=engine, return_lse=True)
        result = fa_numba.attention_backward(q, k, v, out, lse, np.ones_like(out, dtype=np.float32))[0]
    else:
        result = fa_numba.attention(q, k, v, engine=engine)
    seconds = time.perf_counter() - start
    found[name] = {"seconds": round(seconds, 2), "sha256": hashlib.sha256(np.asarray(result).tobytes()).hexdigest()}
from fa_numba.kernels import disk_cache
found["cache"] = {"root": str(disk_cache.cache_dir()), "off": disk_cache.why_off()}
print(json.dumps(found))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="one head of 16 x 16 (the simulator's size); default (1, 2, 512, 64)")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "FA_NUMBA_CACHE_DIR": folder, "PYTHONHASHSEED": "random"}
        for label in ("cold", "warm"):
            shape = [1, 1, 16, 16] if args.smoke else [1, 2, 512, 64]
            done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(shape)], env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                print(f"{label}: failed\n{done.stderr[-3000:]}")
                return 1
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        files = sum(len(f) for _, _, f in os.walk(folder))
    cold, warm = runs
    print(f"kernel cache: {files} files after two processes; {cold['cache']}")
    for name in cold:
        if name == "cache":
            continue
        same = cold[name]["sha256"] == warm[name]["sha256"]
        print(f"{name}: first call {cold[name]['seconds']} s cold, {warm[name]['seconds']} s warm; same bits: {same}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cache.json"), "w") as fh:
        json.dump({"cold": cold, "warm": warm, "files": files}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
