"""Mutation check of the emulated CUDA tests: bugs injected into the CUDA kernels (``csrc/cuda_kernels.h``),
their launch machinery (``csrc/cuda_launch.h``) and the ops' host code (``csrc/fused_sgd_cuda.cu``), one at a
time, each of which ``pytest -m cuda_emulated`` must catch. A bug in what both kernels share (the update's
loads and stores, ``csrc/elements.h``) is in the CPU kernel too, which the emulated tests compare with: the
CPU tests that hold it against an independent oracle must catch it.

``make mutants`` runs it; CI does not (each mutant rebuilds the emulated library and runs the tests until
one fails: 15-60 s a mutant on 2 cores, 12-22 minutes for all). Run it after changing the kernels or the
emulation.

Each mutant replaces a snippet that must occur exactly once in its file, so that a snippet the code has
moved away from stops the run instead of being skipped. The package and the tests are copied into a temporary
directory, which also holds the kernel cache: the CPU library (which does not include the CUDA source) is
built once, each mutant's emulated library in a directory of its own, removed after it; the worktree and the
normal cache are left alone.

Usage: ``python tests/mutants.py [NAME ...]`` (no names: all of them; ``--list`` lists them). Exit status: 0
when every mutant is caught, 1 when one survives or does not build, 2 when a snippet is not found exactly
once or the tests fail without a mutant.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = Path("lightning_fusedsgd", "ops", "csrc")
TESTS = ["-m", "cuda_emulated", "-x", "-q", "-p", "no:cacheprovider", "tests/test_cuda_emulated.py"]
TIMEOUT_S = 1800  # a mutant that makes a kernel loop forever counts as caught (a GPU hangs)


@dataclass(frozen=True)
class Mutant:
    name: str
    original: str
    replacement: str
    file: str = "cuda_kernels.h"
    tests: tuple[str, ...] = ()  # for a file both kernels include: the tests that judge it against an oracle


SCRATCH = "LFSGD_SHARED(double, scratch, kThreads / 32);\n"
HALF_SCRATCH = "LFSGD_SHARED(double, scratch, kThreads / 64);\n"

MUTANTS = [
    # Out of bounds: a shared array smaller than the block writes, or read past the warps' entries.
    Mutant(
        "shared-scratch-half-size-lars-sums",
        SCRATCH + "  for (int k = 0;",
        HALF_SCRATCH + "  for (int k = 0;",
    ),
    Mutant(
        "shared-scratch-half-size-lars-rows",
        SCRATCH + "  for (int j = 0;",
        HALF_SCRATCH + "  for (int j = 0;",
    ),
    Mutant(
        "shared-scratch-half-size-grad-sq-sum",
        SCRATCH + "  const double total = block_sum(sum,",
        HALF_SCRATCH + "  const double total = block_sum(sum,",
    ),
    Mutant(
        "block-sum-reads-past-the-warps",
        "value = threadIdx.x < kThreads / 32 ? scratch[threadIdx.x] : 0.0;",
        "value = threadIdx.x < 32 ? scratch[threadIdx.x] : 0.0;",
    ),
    # Races and reductions.
    Mutant(
        "block-sum-without-its-last-barrier",
        "  __syncthreads();  // scratch is reused by the next call\n",
        "",
    ),
    Mutant(
        "block-sum-without-its-first-barrier",
        "  if (lane == 0) scratch[warp] = value;\n  __syncthreads();\n",
        "  if (lane == 0) scratch[warp] = value;\n",
    ),
    Mutant(
        "block-sum-first-shuffles-from-lane-8",
        "  for (int offset = 16; offset > 0; offset /= 2) value += "
        "__shfl_down_sync(0xffffffffu, value, offset);\n  const int warp",
        "  for (int offset = 8; offset > 0; offset /= 2) value += "
        "__shfl_down_sync(0xffffffffu, value, offset);\n  const int warp",
    ),
    # Sums in float where the kernels document double.
    Mutant(
        "lars-partial-sums-in-float",
        "  double sum[kNumLarsSums] = {0, 0, 0, 0};\n  for (int64_t i = chunk.begin",
        "  float sum[kNumLarsSums] = {0, 0, 0, 0};\n  for (int64_t i = chunk.begin",
    ),
    Mutant("lars-product-in-float", "sum[2] += static_cast<double>(wi) * ti;", "sum[2] += wi * ti;"),
    Mutant(
        "lars-rows-in-float",
        "  double sum[kNumLarsSums] = {0, 0, 0, 0};\n  for (int64_t k = t.first_chunk",
        "  float sum[kNumLarsSums] = {0, 0, 0, 0};\n  for (int64_t k = t.first_chunk",
    ),
    Mutant(
        "block-sum-in-float",
        "__device__ inline double block_sum(double value, double* scratch) {",
        "__device__ inline double block_sum(float value, double* scratch) {",
    ),
    Mutant(
        "grad-sq-sum-in-float",
        "  double sum = 0;\n  for (int64_t i = chunk.begin",
        "  float sum = 0;\n  for (int64_t i = chunk.begin",
    ),
    # Loops over elements, chunks and tensors.
    Mutant(
        "lars-rows-step-of-the-update",
        "k < t.first_chunk + t.num_chunks; k += kThreads)",
        "k < t.first_chunk + t.num_chunks; k += kThreads * kUnroll)",
    ),
    Mutant(
        "lars-rows-skip-the-first-chunk",
        "for (int64_t k = t.first_chunk + threadIdx.x;",
        "for (int64_t k = t.first_chunk + 1 + threadIdx.x;",
    ),
    Mutant(
        "lars-sums-step-of-the-update",
        "i < chunk.end; i += kThreads) {\n    const O gi = clipped_grad",
        "i < chunk.end; i += kThreads * kUnroll) {\n    const O gi = clipped_grad",
    ),
    Mutant(
        "update-chunk-end-one-short",
        "      if (i < chunk.end) update_at<",
        "      if (i < chunk.end - 1) update_at<",
    ),
    Mutant(
        "update-step-of-one-unrolled-load",
        "base < chunk.end; base += kThreads * kUnroll)",
        "base < chunk.end; base += kThreads)",
    ),
    Mutant(
        "update-loads-a-warp-apart",
        "      const int64_t i = base + u * kThreads;\n      if (i < chunk.end) operands[u]",
        "      const int64_t i = base + u * 32;\n      if (i < chunk.end) operands[u]",
    ),
    Mutant(
        "rounding-steps-grid-stride-without-the-grid",
        "t += static_cast<int64_t>(gridDim.x) * blockDim.x)",
        "t += blockDim.x)",
    ),
    Mutant(
        "rounding-steps-grid-rounded-down",
        "&advance_counts_kernel, (n + 255) / 256, 256,",
        "&advance_counts_kernel, n / 256, 256,",
        file="fused_sgd_cuda.cu",
    ),
    Mutant(
        "lars-rows-grid-of-chunks",
        "&lars_rows_kernel, n, kThreads,",
        "&lars_rows_kernel, num_chunks, kThreads,",
        file="fused_sgd_cuda.cu",
    ),
    Mutant(
        "write-bytes-every-other-pass",
        "i < count; i += blockDim.x) out[i] = in.bytes[i];",
        "i < count; i += 2 * blockDim.x) out[i] = in.bytes[i];",
        file="cuda_launch.h",
    ),
    # A launch past a kernel's declared bounds (a GPU refuses it).
    Mutant(
        "lars-rows-declared-for-half-the-block",
        "__launch_bounds__(kThreads)\n    lars_rows_kernel(",
        "__launch_bounds__(kThreads / 2)\n    lars_rows_kernel(",
    ),
    # Indices.
    Mutant(
        "update-reads-the-row-of-its-block",
        "row.lars_sq_sums + kNumLarsSums * chunk.tensor;",
        "row.lars_sq_sums + kNumLarsSums * blockIdx.x;",
    ),
    Mutant(
        "grad-sq-sum-partial-per-tensor",
        "if (threadIdx.x == 0) partials[blockIdx.x] = total;",
        "if (threadIdx.x == 0) partials[chunk.tensor] = total;",
    ),
    Mutant(
        "rounding-key-of-the-block",
        "rounding_key(h.rounding_seed, *rounding_step, chunk.tensor)",
        "rounding_key(h.rounding_seed, *rounding_step, blockIdx.x)",
    ),
    Mutant(
        "table-piece-one-byte-short",
        "const size_t count = std::min(kParamBytes, total - begin);",
        "const size_t count = std::min(kParamBytes, total - begin) - 1;",
        file="cuda_launch.h",
    ),
    # What is computed where, and when.
    Mutant(
        "rounding-step-advanced-in-the-update",
        "rounding_key(h.rounding_seed, *rounding_step, chunk.tensor)",
        "rounding_key(h.rounding_seed, (*rounding_step)++, chunk.tensor)",
    ),
    Mutant(
        "rounding-steps-advanced-on-a-skipped-step",
        "  if (skipped(found_inf)) return;\n  for (int64_t t",
        "  for (int64_t t",
    ),
    Mutant("lars-sums-of-every-tensor", "  if (!t.lars && !grads_too) return;\n", ""),
    Mutant(
        "grad-sq-total-on-a-skipped-step",
        "if (threadIdx.x == 0 && !skipped(found_inf)) *total += sum;",
        "if (threadIdx.x == 0) *total += sum;",
    ),
    Mutant(
        "lars-partials-left-unwritten",
        "at::Tensor partials = at::zeros({num_chunks, kNumLarsSums}, options);",
        "at::Tensor partials = at::empty({num_chunks, kNumLarsSums}, options);",
        file="fused_sgd_cuda.cu",
    ),
    Mutant(
        "lars-sums-ignore-the-grad-scale",
        "make_coeffs<O>(h, inverse_scale_of(grad_scale), /*clip=*/1.0, false)",
        "make_coeffs<O>(h, 1.0, /*clip=*/1.0, false)",
    ),
    Mutant(
        "lars-sums-unscale-by-a-double-inverse",
        "return grad_scale == nullptr ? 1.0 : inverse_scale(*grad_scale);",
        "return grad_scale == nullptr ? 1.0 : 1.0 / *grad_scale;",
    ),
    Mutant(
        "clip-ignores-the-grad-scale",
        "const double clip = row_clip(row, inv_scale);",
        "const double clip = row_clip(row, 1.0);",
    ),
    # The average of the weights.
    Mutant(
        "average-steps-and-updates-swapped",
        "average_coeffs<O>(h, *t.slots.count(kEmaStep), *t.slots.count(kEmaUpdates))",
        "average_coeffs<O>(h, *t.slots.count(kEmaUpdates), *t.slots.count(kEmaStep))",
    ),
    Mutant(
        "average-updates-counted-every-step",
        "      if (update) ++*updates;",
        "      ++*updates;",
    ),
    Mutant(
        "average-of-the-rounded-param",
        "if (average) store_average<P>(s.e, i, o.w, a);",
        "if (average) store_average<P>(s.e, i, load_value<P>(s.w, i, o.w), a);",
        file="elements.h",
        tests=("tests/test_ema.py",),
    ),
    # Host code reading device memory (a GPU's is not host memory), or waiting for the device.
    Mutant(
        "schedule-free-ckp1-of-the-first-group",
        "apply_schedule_free(c, h, row.ckp1[t.group]);",
        "apply_schedule_free(c, h, row.ckp1[0]);",
    ),
    Mutant(
        "schedule-free-switch-always-to-train",
        "switch_weight(groups[t.group], train)",
        "switch_weight(groups[t.group], true)",
    ),
    Mutant(
        "schedule-free-scalars-advance-on-a-skipped-step",
        "  if (skipped(row.found_inf)) return;\n  for (int64_t g = 0;",
        "  for (int64_t g = 0;",
    ),
    Mutant(
        "schedule-on-the-host",
        "device::launch(&schedule_kernel, 1, 1, device::current_stream(), lrs.data_ptr<double>(),",
        "schedule_step(lrs.data_ptr<double>(),",
        file="fused_sgd_cuda.cu",
    ),
    Mutant(
        "found-inf-read-on-the-host",
        "  StepRow row = bucket.row;\n",
        "  StepRow row = bucket.row;\n  if (row.found_inf != nullptr && *row.found_inf != 0.0f) return;\n",
        file="fused_sgd_cuda.cu",
    ),
    Mutant(
        "found-inf-synchronized",
        "  StepRow row = bucket.row;\n",
        "  StepRow row = bucket.row;\n  if (bucket.grads[0].abs().max().item<float>() > 1e30f) return;\n",
        file="fused_sgd_cuda.cu",
    ),
    Mutant(
        "grad-sq-sum-added-on-the-host",
        "  return partials.sum();\n",
        "  const double* sums = partials.data_ptr<double>();\n"
        "  return at::scalar_tensor(std::accumulate(sums, sums + num_chunks, 0.0), options);\n",
        file="fused_sgd_cuda.cu",
    ),
]


def snippet_problems(root: Path) -> list[str]:
    """Mutants whose snippet is not in their file exactly once, and names used twice."""
    problems = []
    names = [mutant.name for mutant in MUTANTS]
    problems += [
        f"{name}: two mutants have this name" for name in sorted({n for n in names if names.count(n) > 1})
    ]
    for mutant in MUTANTS:
        count = (root / CSRC / mutant.file).read_text(encoding="utf-8").count(mutant.original)
        if count != 1:
            problems.append(f"{mutant.name}: its snippet occurs {count} times in {mutant.file}, not once")
    return problems


def run(command: list[str], workdir: Path, env: dict[str, str]) -> tuple[int | str, str]:
    """The command's exit status ("timeout" past TIMEOUT_S) and its output."""
    try:
        done = subprocess.run(
            command, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as expired:
        return "timeout", str(expired.stdout or "")
    return done.returncode, done.stdout + done.stderr


def build(workdir: Path, env: dict[str, str]) -> tuple[int | str, str]:
    script = "from lightning_fusedsgd import ops; ops.load('cuda_emulated')"
    return run([sys.executable, "-c", script], workdir, env)


def first_failure(output: str) -> str:
    """The first failing test, and the first line of its error."""
    lines = output.splitlines()
    error = next((line[1:].strip() for line in lines if line.startswith("E ")), "")
    test = next(
        (line.split(" ", 1)[1].split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))),
        "",
    )
    return f"{test or 'no test named'}: {error[:160]}"


def verdict(status: int | str, output: str) -> str:
    """What pytest's exit status says about a mutant: caught (and by what) or survived."""
    if status == 0:
        return "SURVIVED"
    if status == "timeout":
        return f"caught: the tests ran past {TIMEOUT_S} s (a hang)"
    if isinstance(status, int) and status < 0:
        return f"caught: pytest died of signal {-status}"
    return f"caught by {first_failure(output)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="the mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    args = parser.parse_args(argv)
    problems = snippet_problems(ROOT)
    unknown = set(args.names) - {mutant.name for mutant in MUTANTS}
    problems += [f"{name}: no such mutant" for name in sorted(unknown)]
    if problems:
        print("mutants: fix the list in tests/mutants.py first:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    selected = [mutant for mutant in MUTANTS if not args.names or mutant.name in args.names]
    if args.list:
        print("\n".join(mutant.name for mutant in selected))
        return 0

    workdir = Path(tempfile.mkdtemp(prefix="lightning_fusedsgd-mutants-"))
    try:
        return run_mutants(selected, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_mutants(selected: list[Mutant], workdir: Path) -> int:
    skip = shutil.ignore_patterns("__pycache__", "_lib", "*.so")
    shutil.copytree(ROOT / "lightning_fusedsgd", workdir / "lightning_fusedsgd", ignore=skip)
    shutil.copytree(ROOT / "tests", workdir / "tests", ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", workdir)
    cache = workdir / "cache"
    env = {**os.environ, "PYTHONPATH": str(workdir), "LIGHTNING_FUSEDSGD_CACHE": str(cache)}

    started = time.monotonic()
    status, output = build(workdir, env)
    if status == 0:
        status, output = run([sys.executable, "-m", "pytest", *TESTS], workdir, env)
    if status != 0:
        print(output[-6000:])
        print(f"mutants: the tests fail without a mutant ({status}); fix them first", file=sys.stderr)
        return 2
    print(f"the tests pass without a mutant ({time.monotonic() - started:.0f} s); {len(selected)} mutants:")

    results = []
    for mutant in selected:
        source = workdir / CSRC / mutant.file
        pristine = source.read_text(encoding="utf-8")
        before = set(cache.iterdir())
        source.write_text(pristine.replace(mutant.original, mutant.replacement), encoding="utf-8")
        started = time.monotonic()
        status, output = build(workdir, env)
        if status != 0:
            outcome = "DID NOT BUILD: " + output.strip().splitlines()[-1][:200]
        else:
            tests = ["-x", "-q", "-p", "no:cacheprovider", *mutant.tests] if mutant.tests else TESTS
            outcome = verdict(*run([sys.executable, "-m", "pytest", *tests], workdir, env))
        source.write_text(pristine, encoding="utf-8")
        for built in set(cache.iterdir()) - before:
            shutil.rmtree(built, ignore_errors=True)
        seconds = time.monotonic() - started
        results.append((mutant.name, outcome, seconds))
        print(f"  {mutant.name:45} {seconds:5.0f} s  {outcome}", flush=True)

    caught = sum(outcome.startswith("caught") for _, outcome, _ in results)
    total = sum(seconds for _, _, seconds in results)
    print(f"{caught} of {len(results)} mutants caught, in {total:.0f} s")
    for name, outcome, _ in results:
        if not outcome.startswith("caught"):
            print(f"  {name}: {outcome}", file=sys.stderr)
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
