#!/usr/bin/env bash
# The GPU checks as one run on a lent GPU machine, within 10 minutes on one H200 (the kernel build included),
# results under $OUT (default gpu-results/). Each stage has a time cap, so a slow one cannot take the others'
# results with it, and writes its own log:
#   build  the kernels (CPU and CUDA), built on first use
#   tests  every CUDA test: tests/test_cuda.py and the cuda cases of the device-parametrized tests
#   bench  bench/gpu.py --train: its sections written to $OUT/gpu.json as each ends
# and a summary at the end. Usage: OUT=/some/dir bash bench/gpu_check.sh (CUDA_VISIBLE_DEVICES= runs the part
# that runs without a GPU, to try the script on the CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export LIGHTNING_FUSEDSGD_CACHE=${LIGHTNING_FUSEDSGD_CACHE:-$OUT/kernel-cache}
START=$SECONDS

stage() {  # NAME SECONDS COMMAND...: the command, capped, its output in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc$([ $rc = 124 ] && echo ' (time cap)') at $((SECONDS - START)) s" | tee -a "$OUT/status.txt"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
stage build 180 env LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1 python -m lightning_fusedsgd --verbose
stage tests 170 python -m pytest -q -p no:cacheprovider -m "not cuda_emulated" -k cuda tests/
stage bench 170 python bench/gpu.py --train --deadline 120 --out "$OUT/gpu.json"

echo "--- summary ($((SECONDS - START)) s)"
cat "$OUT/status.txt"
tail -n 1 "$OUT/tests.log"
grep "^wrote" "$OUT/bench.log"
