#!/usr/bin/env bash
# The GPU checks as one run on a lent GPU machine, results under $OUT (default gpu-results/): build the CUDA
# kernel, run every CUDA test (tests/test_cuda.py, the CUDA graph cases of tests/test_capturable.py and the
# cuda cases of the device-parametrized tests), then bench/gpu.py with the training-step rows.
# Usage: OUT=/some/dir bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1 python -m lightning_fusedsgd --verbose > "$OUT/build.log" 2>&1
echo "build: $?" | tee "$OUT/status.txt"
python -m pytest -q -p no:cacheprovider -k cuda tests/test_cuda.py tests/test_fused_sgd.py tests/test_lars.py tests/test_clipping.py \
  tests/test_ops.py tests/test_capturable.py > "$OUT/tests.log" 2>&1
echo "tests: $?" | tee -a "$OUT/status.txt"
python bench/gpu.py --train > "$OUT/bench_gpu.txt" 2>&1
echo "bench: $?" | tee -a "$OUT/status.txt"
cp bench/results/gpu.json "$OUT/" 2>/dev/null
tail -3 "$OUT/tests.log"
# The recipes at the GPU's speed (issue 45), its own stage within what is left of 9.5 minutes: the pipeline's
# CUDA tests, then bench/recipe_throughput.py's rows, most wanted first, each written to its JSON as measured.
# Needs TorchCodec built for this torch (the recipes extra; a wheel from `pip download torchcodec --no-deps`).
left=$(( 570 - SECONDS ))
if [ "$left" -gt 60 ]; then
  timeout 60 python -m pytest -q -p no:cacheprovider -k cuda tests/test_image_pipeline.py tests/test_lightning_recipes.py \
    > "$OUT/recipe_tests.log" 2>&1
  echo "recipe tests: $?" | tee -a "$OUT/status.txt"
  left=$(( 570 - SECONDS ))
  timeout "$left" python bench/recipe_throughput.py --gpu synthetic decode=gpu bare decode=cpu compiled \
    > "$OUT/recipe_throughput.txt" 2>&1
  echo "recipe throughput: $? (124: stopped at the deadline, the rows before it kept)" | tee -a "$OUT/status.txt"
  cp bench/results/recipe_throughput_gpu.json "$OUT/" 2>/dev/null
  tail -3 "$OUT/recipe_tests.log"; cat "$OUT/recipe_throughput.txt" | grep "images/s"
else
  echo "recipe stages: skipped, $left s left of the 10 minutes" | tee -a "$OUT/status.txt"
fi
