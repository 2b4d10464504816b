#!/usr/bin/env bash
# The whole device session in one command, for a lent GPU (about 15 minutes of device time in all):
#   the kernel issue's gpu_check (test tier, checks, timings, racecheck), then the compare sweep with SDPA
#   within what is left of a 9-minute budget. Outputs land in $OUT (or benchmarks/results).
# Use:  bash benchmarks/run_on_device.sh      (with a timeout of about 600 s)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/device.txt"
start=$(date +%s)
python3 benchmarks/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu_check.log"
left=$(( 540 - ($(date +%s) - start) ))
if [ "$left" -gt 60 ]; then
  python3 benchmarks/compare_gpu.py --out "$out" --budget-s "$left" 2>&1 | tee "$out/compare_gpu.log"
else
  echo "no time left for compare_gpu.py" | tee "$out/compare_gpu.log"
fi
