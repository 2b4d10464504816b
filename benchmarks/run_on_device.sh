#!/usr/bin/env bash
# The device session for a lent GPU (about 15 minutes of device time in all, a machine's start included), in two
# stages, each one command:
#   stage 1 (default; timeout about 480 s): benchmarks/device_session.py: every tensor-core and CUDA-core kernel
#     (v2-mma, v1-mma on float16, bfloat16, float32 by 3xTF32 and TF32, v2-mma at d = 64 in its 128-row tiles of
#     two row blocks a warp beside 64 rows of one (float16, bfloat16, causal and not); the tensor-core backward,
#     atomic and deterministic, float16 and float32, and float16 at d = 72; v2, v1, bwd-kv on the CUDA cores; d = 192 and
#     strided views; the causal float16 v2-mma at d = 64 with and without its register cap; the float16 v2-mma
#     with its copies pipelined and in one stage, at d = 64 and 128 and causal d = 64; the CUDA-core v2 on 128
#     threads (layout.V2_MICRO) and on 256 as before, at d = 64 and 128; split-KV decoding)
#     checked against the float64 reference with its rule, then timed beside torch SDPA and the
#     whole-kernel model's estimate, compiles in parallel and timings one at a time; beside them the
#     warp-primitive and tensor-core tests with the simulator off (two row blocks against one, bit for bit:
#     tests/test_mma_row_blocks.py). BUDGET (default 300) seconds to start jobs.
#   stage 2 (STAGE=2; timeout about 300 s): the kernel disk cache's first call cold and warm in new processes
#     (cache_gpu), the score mods and mask_mods on every kernel family (mods_gpu, masks_gpu), the sinks' merge,
#     gradient and dLSE kernels and packed batches against padded (sinks_gpu), then gpu_check
#     (the GPU test tier, racecheck) within what is left of BUDGET (default 240).
# Not yet run on hardware (2026-12-05), so read first: tests/test_warp.py's conversion and min.NaN / max.NaN
# probes and tests/test_mma_tf32.py's device split (the 3xTF32 split's cvt.rn.tf32 and NaN-keeping clamp), then
# the CUDA-core v2 and decoding rows (V read at compile-time offsets, kernels.tile_loads.rows_from) and bwd-kv
# (bank-free layout, loads and atomic adds at compile-time offsets: timed at 49.4 ms, d = 64, on the old code).
# The machine's python3 runs it (PYTHONPATH: the checkout). On the H200 image of 2026-12-04 numpy 2.5.2 stopped
# numba-cuda 0.30.4 at import (np.row_stack is gone): carry a numpy 2.4 wheel, install it with
# `pip install --no-deps --target /tmp/site` and put /tmp/site on PYTHONPATH before running this.
# Outputs land in $OUT (or benchmarks/results): device.txt, session.{md,jsonl,log}, tests_gpu.log (stage 1);
# cache.log, mods_gpu.log, masks_gpu.log, sinks_gpu.log, gpu_check.log (stage 2; their .json beside).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout itself, not installed
out=${OUT:-benchmarks/results}
mkdir -p "$out"
if [ "${STAGE:-1}" = 1 ]; then
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import sys, numpy, numba, torch; from importlib.metadata import version as v; print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', v('numba-cuda'), 'torch', torch.__version__)"
  } 2>&1 | tee "$out/device.txt"
  python3 benchmarks/device_session.py --out "$out" --budget-s "${BUDGET:-300}" ${SESSION_ARGS:-} 2>&1 | tee "$out/session.log"
else
  start=$(date +%s)
  timeout 120 python3 benchmarks/cache_gpu.py --out "$out" 2>&1 | tee "$out/cache.log"
  timeout 90 python3 benchmarks/mods_gpu.py --out "$out" 2>&1 | tee "$out/mods_gpu.log"
  timeout 60 python3 benchmarks/masks_gpu.py --out "$out" 2>&1 | tee "$out/masks_gpu.log"
  timeout 60 python3 benchmarks/sinks_gpu.py --out "$out" 2>&1 | tee "$out/sinks_gpu.log"
  left=$(( ${BUDGET:-240} - ($(date +%s) - start) ))
  if [ "$left" -gt 60 ]; then
    timeout "$left" python3 benchmarks/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu_check.log"
  else
    echo "no time left for gpu_check.py" | tee "$out/gpu_check.log"
  fi
fi
