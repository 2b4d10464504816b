"""Compile every shipped kernel configuration for sm_90 on the CPU and read its resource usage.

The CUDA simulator runs code that a GPU compiler would reject (or silently promote to float64), so the
test suite also compiles each shipped configuration to PTX with `numba.cuda.compile_ptx` and links it
with nvJitLink for sm_90 (H100/H200). The linker's log gives registers, spills, stack and shared memory.
No GPU is needed, but the real numba.cuda is: run as a separate process with NUMBA_ENABLE_CUDASIM=0:

    NUMBA_ENABLE_CUDASIM=0 python -m fa_numba.kernels.compile_check [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

SHIPPED_HEAD_DIMS = (64, 128, 256)
DTYPES = ("float32", "float16")
ARCH = "sm_90"


def configurations():
    from fa_numba.kernels import VARIANTS, default_tiles

    for name in VARIANTS:
        for head_dim in SHIPPED_HEAD_DIMS:
            block_q, block_k = default_tiles(head_dim)
            for dtype in DTYPES:
                for causal in (False, True):
                    yield dict(variant=name, block_q=block_q, block_k=block_k, head_dim=head_dim, dtype=dtype,
                               causal=causal)


def signature(order: str, dtype: str):
    from numba import types

    inp = getattr(types, dtype)
    arr4_in = types.Array(inp, 4, "C")
    o = types.Array(types.float32, 4, "C")
    stat = types.Array(types.float32, 3, "C")
    if order == "v1":
        return (arr4_in, arr4_in, arr4_in, o, stat, stat, stat, types.float32)
    return (arr4_in, arr4_in, arr4_in, o, stat, types.float32)


def link_log(ptx: str) -> str:
    """Link the PTX for ARCH with nvJitLink and return its verbose info log."""
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(2, [f"-arch={ARCH}", "-verbose"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(handle)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
    finally:
        nvjitlink.destroy(handle)
    return log.decode(errors="replace")


def parse(log: str) -> dict:
    """Registers, spill bytes, stack and shared memory of the (single) kernel in an nvJitLink log."""

    def grab(pattern, default=None):
        found = re.search(pattern, log)
        return int(found.group(1)) if found else default

    return dict(
        registers=grab(r"used (\d+) registers"),
        spill_stores=grab(r"(\d+) bytes spill stores", 0),
        spill_loads=grab(r"(\d+) bytes spill loads", 0),
        stack=grab(r"(\d+) bytes stack frame", grab(r"(\d+) stack", 0)),
        smem=grab(r"(\d+) bytes smem", 0),
    )


def check_one(cfg: dict) -> dict:
    from numba import cuda

    from fa_numba.kernels import VARIANTS

    built = VARIANTS[cfg["variant"]].make(cfg["block_q"], cfg["block_k"], cfg["head_dim"], cfg["causal"])
    start = time.perf_counter()
    ptx, _ = cuda.compile_ptx(built.source, signature(built.config.order, cfg["dtype"]), cc=(9, 0))
    info = parse(link_log(ptx))
    info["float64_in_ptx"] = bool(re.search(r"\.f64\b", ptx))
    info["seconds"] = round(time.perf_counter() - start, 2)
    return {**cfg, **info}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the table as JSON")
    args = parser.parse_args(argv)
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        parser.error("needs the real numba.cuda: run with NUMBA_ENABLE_CUDASIM=0")
    rows = []
    for cfg in configurations():
        row = check_one(cfg)
        rows.append(row)
        print(f"{row['variant']} d={row['head_dim']:3d} tiles {row['block_q']}x{row['block_k']:<2d} {row['dtype']:7s} "
              f"causal={row['causal']!s:5s} regs {row['registers']} spills {row['spill_stores']}/{row['spill_loads']} "
              f"stack {row['stack']} smem {row['smem']} f64 {row['float64_in_ptx']} ({row['seconds']} s)",
              file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
