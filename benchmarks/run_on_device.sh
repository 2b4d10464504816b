#!/usr/bin/env bash
# The whole device session in one command, for a lent GPU (about 15 minutes of device time in all):
#   0. mma_gpu: the warp-primitive and tensor-core tests with the simulator off, then v2-mma checked and timed
#      beside torch SDPA (float16, bfloat16, float32 by 3xTF32 and TF32), v1-mma, the tensor-core backward beside
#      SDPA's (float16, and float32 by 3xTF32), and v2-mma at d = 192 (MLA's d_v = 128, native) and on strided
#      views, within 200 s;
#   0b. mods_gpu: score mods (ALiBi, softcap, a relative bias) on every kernel family checked with the rules,
#      then v2 and v2-mma timed with and without them beside torch SDPA, within 90 s;
#   0c. masks_gpu: a document mask_mod and strided (B, N, H, d) inputs on every CUDA-core kernel, checked, then
#      v2 timed with causal=True, a mask_mod, a 4-D dense mask and strided inputs, within 60 s;
#   1. decode_gpu: split-KV decoding (B=1, 8; H=32, H_kv=8; N_k=32k, 128k; d=128; float16) on both engines
#      (the CUDA-core and the tensor-core split kernels) checked, then timed beside the unsplit calls, the v2
#      kernel and torch SDPA, within 100 s;
#   2. compare_gpu: the fast-kernel issue's targets first (B=4, H=16, N=4096, d=64, float32: every variant
#      checked, then timed, beside torch SDPA), then the other sizes, within 150 s;
#   3. gpu_check: the GPU test tier (kernels, engine, backward, API, array libraries), the paths that take a
#      value head dim of their own natively checked (v1, v2, the CUDA-core backward and v2-mma at d = 192,
#      d_v = 128; the tensor-core backward and both decode kernels at d = 128, d_v = 64), the checks and
#      timings of every forward and backward variant at B=2, H=8, and racecheck, within what is left of 540 s.
# Outputs land in $OUT (or benchmarks/results). Use:  bash benchmarks/run_on_device.sh   (timeout about 600 s)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/device.txt"
start=$(date +%s)
timeout 200 python3 benchmarks/mma_gpu.py --out "$out" 2>&1 | tee "$out/mma_gpu.log"
timeout 90 python3 benchmarks/mods_gpu.py --out "$out" 2>&1 | tee "$out/mods_gpu.log"
timeout 60 python3 benchmarks/masks_gpu.py --out "$out" 2>&1 | tee "$out/masks_gpu.log"
timeout 120 python3 benchmarks/decode_gpu.py --out "$out" --budget-s 100 2>&1 | tee "$out/decode_gpu.log"
python3 benchmarks/compare_gpu.py --out "$out" --budget-s 150 --n 4096,1024,8192 2>&1 | tee "$out/compare_gpu.log"
left=$(( 540 - ($(date +%s) - start) ))
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 benchmarks/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu_check.log"
else
  echo "no time left for gpu_check.py" | tee "$out/gpu_check.log"
fi
