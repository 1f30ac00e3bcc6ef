#!/usr/bin/env bash
# The GPU checks as one run on a lent GPU machine, within 10 minutes on one H200 (the kernel build included),
# results under $OUT (default gpu-results/). Each stage has a time cap, so a slow one cannot take the others'
# results with it, and writes its own log:
#   build  the kernels (CPU and CUDA), built on first use
#   tests  every CUDA test: tests/test_cuda.py and the cuda cases of the device-parametrized tests
#   bench    bench/gpu.py --train: its sections written to $OUT/gpu.json as each ends
#   recipes  bench/recipe_throughput.py --gpu: train.py's input pipeline and step against the bare step
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
stage tests 150 python -m pytest -q -p no:cacheprovider -m "not cuda_emulated" -k cuda tests/
stage bench 130 python bench/gpu.py --train --deadline 90 --out "$OUT/gpu.json"
# The recipes at the GPU's speed: bench/recipe_throughput.py's rows, most wanted first, each written to its JSON as
# measured, in what is left of 9.5 minutes. Needs TorchCodec built for this torch (the recipes extra; a wheel from
# `pip download torchcodec --no-deps`), and for the shards row litdata (the shards extra), which converts the
# generated folder first.
left=$((570 - (SECONDS - START)))
if [ "$left" -gt 30 ]; then
  stage recipes "$left" python bench/recipe_throughput.py --gpu synthetic decode=gpu bare shards decode=cpu \
    compiled
  cp bench/results/recipe_throughput_gpu.json "$OUT/" 2>/dev/null
else
  echo "recipes: skipped, $left s left of the 10 minutes" | tee -a "$OUT/status.txt"
fi

echo "--- summary ($((SECONDS - START)) s)"
cat "$OUT/status.txt"
tail -n 1 "$OUT/tests.log"
grep "^wrote" "$OUT/bench.log"
grep "images/s" "$OUT/recipes.log"
