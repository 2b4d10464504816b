"""Hand-written kernels whose loop bodies are known, profiled by fa_numba.profile (run by test_profile.py).

Run as a script in a process with the real numba.cuda (NUMBA_ENABLE_CUDASIM=0); prints one JSON object.
Each loop's exit depends on the data it computes, so the compiler cannot unroll it: one iteration of the
SASS loop is one iteration of the Python loop, and its FFMA and LDL counts are those of the source.
"""

import json
import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

from numba import cuda, float32, types  # noqa: E402

from fa_numba import profile  # noqa: E402

LIVE = 32


def three_fmas(x):
    """One loop of exactly 3 float32 FMAs on registers and nothing from memory."""
    a, b, acc, limit = x[0], x[1], x[2], x[3]
    while acc < limit:
        acc = acc * a + b
        acc = acc * a + b
        acc = acc * a + b
    x[4] = acc


def reads_a_local_array(x, idx):
    """One loop that reads a local array at a data-dependent index: exactly 1 LDL and 1 FFMA per iteration."""
    buf = cuda.local.array(64, float32)
    for t in range(64):
        buf[t] = x[t]
    acc, limit = x[0], x[1]
    i = 0
    while acc < limit:
        acc = acc * buf[idx[i]] + x[2]
        i = idx[i + 1]
    x[0] = acc


def many_live_values(x):
    """LIVE values live across a loop: registers when allowed, spills under a 24-register cap."""
    t = cuda.threadIdx.x
    r = cuda.local.array(LIVE, float32)  # constant indices once unrolled: kept in registers
    for k in range(LIVE):
        r[k] = x[t + 32 * k]
    while r[0] < x[0]:
        for k in range(LIVE):
            r[k] = r[k] * r[(k + 1) % LIVE] + x[1]
    for k in range(LIVE):
        x[t + 32 * k] = r[k]


def main() -> int:
    floats = types.Array(types.float32, 1, "C")
    ints = types.Array(types.int32, 1, "C")
    found = {}
    for name, fn, argtypes, cap in (("three_fmas", three_fmas, (floats,), None),
                                    ("reads_a_local_array", reads_a_local_array, (floats, ints), None),
                                    ("many_live_values", many_live_values, (floats,), None),
                                    ("many_live_values_capped", many_live_values, (floats,), 24)):
        found[name] = profile.profile_kernel(fn, argtypes, 32, name=name, max_registers=cap).as_dict()
    # The SASS profiled is the SASS Numba itself links for a launch (its get_cubin, without -verbose).
    cubin, _, library = profile.compile_for_launch(three_fmas, (floats,))
    launch_cubin = library.get_cubin(cc=(9, 0, "a"))
    found["same_sass_as_numba_launch_path"] = (profile.disassemble(cubin)
                                               == profile.disassemble(bytes(getattr(launch_cubin, "code", launch_cubin))))
    json.dump(found, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
