"""Writes the benchmark page (docs/benchmarks.md) and its plot (docs/img/step.png) from bench/results/*.json,
and the changelog page from CHANGELOG.md: ``python docs/gen_benchmarks.py`` (``make docs`` runs it before
MkDocs). The page and its plot are committed, so that the links to them hold outside a built site; ``python
docs/gen_benchmarks.py --check`` fails where the committed page is not the one the results give.

Every number on the page comes from a result file, with the machine, versions, commit and date it records.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
IMAGES = DOCS / "img"
PAGE = DOCS / "benchmarks.md"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _where(result: dict[str, Any]) -> str:
    machine = result["machine"]
    device = machine.get("gpu") or f"{machine.get('cpu') or 'CPU'}, {machine['threads']} threads"
    return f"{device}; torch {machine['torch']}"


def _provenance(name: str, result: dict[str, Any]) -> str:
    machine = result["machine"]
    return (
        f"`bench/results/{name}.json`: {_where(result)}, commit {machine.get('commit', 'not recorded')}, "
        f"{machine.get('date', 'date not recorded')}."
    )


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _bars(path: Path, title: str, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    figure = Figure(figsize=(8, 3.2), layout="constrained")
    axes = figure.subplots()
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        axes.bar([i + k * width for i in range(len(labels))], values, width, label=name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))], labels, fontsize=8)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend(fontsize=8)
    axes.grid(axis="y", alpha=0.3)
    figure.savefig(path, dpi=110)


def step_section(result: dict[str, Any], images: Path) -> str:
    cases = result["cases"]
    # (e), (f) and the schedule-free rows (h), (i), shown after the table
    special = (
        "FusedSGD clipped",
        "FusedSGD stochastic",
        "FusedSGDScheduleFree",
        "FusedSGDScheduleFree eval+train",
    )
    plain = {case: t for case, t in cases.items() if "floor" in t and not any(name in t for name in special)}
    rows = [
        [
            case,
            _ms(t["FusedSGD"]),
            _ms(t["torch fused"]),
            _ms(t["torch foreach"]),
            _ms(t["floor"]),
            f"{t['FusedSGD'] / t['floor']:.2f}",
            f"{t['torch fused'] / t['FusedSGD']:.2f}",
        ]
        for case, t in plain.items()
    ]
    labels = [case.split(")")[0] + ")" for case in plain]
    _bars(
        images / "step.png",
        "Step time / data-movement floor (lower is better)",
        labels,
        {
            name: [t[name] / t["floor"] for t in plain.values()]
            for name in ("FusedSGD", "torch fused", "torch foreach")
        },
        "x floor",
    )
    text = [
        "## The optimizer step on the CPU",
        "",
        "`bench/step.py`: momentum 0.9, Nesterov, weight decay 1e-4, the median of interleaved steps of "
        "every contender. The **floor** is a kernel built beside ours with the same reads, writes and "
        "prefetches as a momentum step and no arithmetic, over the same tensors and work list: 20 bytes per "
        "fp32 parameter. "
        "Times vary between runs on a shared machine; the ratios within one run are what carries over.",
        "",
        _table(
            [
                "case",
                "FusedSGD",
                "torch fused",
                "torch foreach",
                "floor",
                "FusedSGD / floor",
                "torch fused / FusedSGD",
            ],
            rows,
        ),
        "",
        "![Step time over the floor](img/step.png)",
        "",
    ]
    clipped = next((t for t in cases.values() if "FusedSGD clipped" in t), None)
    if clipped is not None:
        text += [
            f"Norm clipping on ResNet-50 (`max_grad_norm={result.get('max_grad_norm', 1.0)}`): the clipped "
            f"step takes {_ms(clipped['FusedSGD clipped'])}, "
            f"{clipped['FusedSGD clipped'] / clipped['FusedSGD']:.2f}x the plain one (one more read of the "
            f"gradients); `clip_grad_norm_(foreach=True)` and torch's fused step take "
            f"{_ms(clipped['torch clip_grad_norm_ + fused'])}, "
            f"{clipped['torch clip_grad_norm_ + fused'] / clipped['FusedSGD clipped']:.2f}x ours.",
            "",
        ]
    for dtype, ratio in result.get("master_over_fp32", {}).items():
        text += [
            f"{dtype} params with fp32 master weights: {ratio:.2f}x the fp32 step (22 bytes moved per "
            f"parameter against 20). torch's fused {dtype} step keeps {dtype} momentum and no fp32 copy: it "
            "moves 10.",
            "",
        ]
    rounding = next((t for t in cases.values() if "FusedSGD stochastic" in t), None)
    if rounding is not None:
        state = result.get("state_bytes_per_param", {})
        names = [
            n
            for n in (
                "FusedSGD stochastic",
                "FusedSGD kahan",
                "FusedSGD",
                "FusedSGD + masters",
                "torch fused",
            )
            if n in rounding
        ]
        labels = {
            "FusedSGD stochastic": 'FusedSGD, `update_rounding="stochastic"`',
            "FusedSGD kahan": 'FusedSGD, `update_rounding="kahan"`',
            "FusedSGD": "FusedSGD, rounded to nearest",
            "FusedSGD + masters": "FusedSGD, `master_weights=True`",
            "torch fused": "torch fused (rounded to nearest)",
        }
        moved = {"FusedSGD kahan": 14, "FusedSGD + masters": 22}  # bytes per parameter; 10 for the others
        text += [
            "### bf16 without master weights",
            "",
            "ResNet-50's shapes in bf16, against the floor of a pure bf16 momentum step (10 bytes per "
            "parameter). The Kahan step also reads and writes its 2-byte compensation, and the master-weight "
            "step its fp32 master and buffer.",
            "",
            _table(
                [
                    "step",
                    "time",
                    "bytes moved per parameter",
                    "/ floor",
                    "optimizer state, bytes per parameter",
                ],
                [
                    [
                        labels[name],
                        _ms(rounding[name]),
                        str(moved.get(name, 10)),
                        f"{rounding[name] / rounding['floor']:.2f}",
                        f"{state[name]:g}" if state.get(name) is not None else "",
                    ]
                    for name in names
                ],
            ),
            "",
            f"Stochastic rounding costs {rounding['FusedSGD stochastic'] / rounding['FusedSGD']:.2f}x the "
            f"step rounded to nearest; the step with master weights takes "
            f"{rounding['FusedSGD + masters'] / rounding['FusedSGD stochastic']:.2f}x the stochastic one"
            + (
                f" and {rounding['FusedSGD + masters'] / rounding['FusedSGD kahan']:.2f}x the Kahan one, "
                f"which takes {rounding['FusedSGD kahan'] / rounding['floor kahan']:.2f}x the floor of its "
                "own 14 bytes."
                if "floor kahan" in rounding
                else "."
            ),
            "",
        ]
    text += schedule_free_lines(result)
    return "\n".join([*text, _provenance("step", result), ""])


def schedule_free_lines(result: dict[str, Any]) -> list[str]:
    """The schedule-free rows, (h) the step and (i) a train/eval round trip, against their floors."""
    cases = result["cases"]
    step = next((t for t in cases.values() if "FusedSGDScheduleFree" in t), None)
    switch = next((t for t in cases.values() if "FusedSGDScheduleFree eval+train" in t), None)
    if step is None or switch is None:
        return []
    ours, peer = step["FusedSGDScheduleFree"], step["schedulefree foreach"]
    ours_switch, peer_switch = switch["FusedSGDScheduleFree eval+train"], switch["schedulefree eval+train"]
    hparams = ", ".join(f"{key} {value}" for key, value in result.get("schedule_free", {}).items())
    return [
        "### Schedule-free SGD",
        "",
        f"ResNet-50's shapes in fp32 ({hparams}). The step reads y, z and g and "
        "writes y and z: 20 bytes per parameter, the floor of a momentum step (z where the buffer is); "
        "schedulefree's foreach step makes four passes (decay into the gradient, a lerp, an add, a sub). A "
        "train/eval round trip is two passes of 12 bytes (y and z read, y written), against two of the "
        "switch floor.",
        "",
        _table(
            ["contender", "time", "/ floor", "schedulefree / FusedSGDScheduleFree"],
            [
                ["FusedSGDScheduleFree step", _ms(ours), f"{ours / step['floor']:.2f}", f"{peer / ours:.2f}"],
                ["schedulefree.SGDScheduleFree (foreach) step", _ms(peer), f"{peer / step['floor']:.2f}", ""],
                ["20-byte floor", _ms(step["floor"]), "1.00", ""],
                [
                    "FusedSGDScheduleFree eval() + train()",
                    _ms(ours_switch),
                    f"{ours_switch / switch['floor']:.2f}",
                    f"{peer_switch / ours_switch:.2f}",
                ],
                [
                    "schedulefree eval() + train()",
                    _ms(peer_switch),
                    f"{peer_switch / switch['floor']:.2f}",
                    "",
                ],
                ["2 x 12-byte floor", _ms(switch["floor"]), "1.00", ""],
            ],
        ),
        "",
    ]


def lars_section(result: dict[str, Any]) -> str:
    times, ratios = result["times"], result["ratios"]
    rows = [[name, _ms(seconds)] for name, seconds in times.items()]
    text = [
        "## LARS on ResNet-50",
        "",
        "`bench/lars.py`: LARS and decay on the 54 conv and fc weights, neither on the 107 BN and bias "
        "tensors (`param_groups`). Besides the optimizers, the same loop times two floors on copies of the "
        "tensors: the plain floor (a momentum step's traffic) and the LARS floor (the LARS step's waves: "
        "the norm pass's re-read of w and g, then the update's traffic, no math).",
        "",
        _table(["contender", "step"], rows),
        "",
        _table(["ratio", "value"], [[name, f"{value:.2f}"] for name, value in ratios.items()]),
        "",
        _provenance("lars", result),
        "",
    ]
    return "\n".join(text)


def ema_section(result: dict[str, Any]) -> str:
    text = [
        "## The average of the weights in the step",
        "",
        f"`bench/ema.py`: FusedSGD with `ema_decay={result['decay']}` against its plain step, torch's fused "
        "SGD step followed by timm's `ModelEmaV3` update (a `_foreach_lerp_` over the weights) and the "
        "floors on ResNet-50's shapes: the plain floor moves 20 bytes per fp32 parameter, `floor + average` "
        f"28 (the average read and written too); median of {result['repeats']}.",
        "",
    ]
    for case, times in result["cases"].items():
        text += [
            f"**{case}**",
            "",
            _table(["contender", "step"], [[n, _ms(t)] for n, t in times.items()]),
            "",
        ]
        ratios = result["ratios"][case]
        text += [_table(["ratio", "value"], [[name, f"{value:.2f}"] for name, value in ratios.items()]), ""]
    text += [_provenance("ema", result), ""]
    return "\n".join(text)


def sharded_section(result: dict[str, Any]) -> str:
    times, reductions = result["median_s"], result["all_reduces_per_step"]
    rows = [[name, _ms(seconds), str(reductions[name])] for name, seconds in times.items()]
    return "\n".join(
        [
            "## Sharded steps (FSDP2)",
            "",
            f"`bench/sharded.py`: ResNet-50 under FSDP2 on {result['world']} gloo ranks, one thread each; "
            "rank 0's median step and the all-reduces a step makes.",
            "",
            _table(["contender", "step", "all-reduces a step"], rows),
            "",
            _provenance("sharded", result),
            "",
        ]
    )


def _accuracy_rows(result: dict[str, Any]) -> list[list[str]]:
    """Per variant: mean validation accuracy, its range over seeds, mean final training loss."""
    rows = []
    for name, runs in result["runs"].items():
        accs = [run["val_acc"] for run in runs]
        losses = [run["train_loss"] for run in runs if run["train_loss"] is not None]
        rows.append(
            [
                name,
                f"{100 * sum(accs) / len(accs):.2f}%",
                f"{100 * min(accs):.2f}-{100 * max(accs):.2f}%",
                f"{sum(losses) / len(losses):.4f}" if losses else "not logged",
            ]
        )
    return rows


_ACCURACY_HEADER = ["params and update", "validation accuracy (mean)", "range over seeds", "final train loss"]


def rounding_section(result: dict[str, Any]) -> str:
    return "\n".join(
        [
            "## bf16 training without master weights",
            "",
            f"`bench/bf16_rounding.py`: {result['model']}, {result['epochs']} epochs, batch "
            f"{result['batch_size']}, lr {result['lr']} ({result['schedule']}), momentum "
            f"{result['momentum']}, weight decay {result['weight_decay']}; {result['seeds']} seeds. A small "
            "model: bf16 matmuls are slow on CPUs without native bf16, so the quickstart's ResNet-18 is not "
            "trained in bf16 here.",
            "",
            _table(_ACCURACY_HEADER, _accuracy_rows(result)),
            "",
            _provenance("bf16_rounding", result),
            "",
        ]
    )


def quickstart_section(result: dict[str, Any]) -> str:
    return "\n".join(
        [
            "## The quickstart in bf16",
            "",
            f"`bench/bf16_quickstart.py`: {result['model']} under `precision=bf16-true`, {result['seeds']} "
            f"seeds{', overrides ' + ' '.join(result['overrides']) if result['overrides'] else ''}.",
            "",
            _table(_ACCURACY_HEADER, _accuracy_rows(result)),
            "",
            _provenance("bf16_quickstart", result),
            "",
        ]
    )


def schedule_free_quickstart_section(result: dict[str, Any]) -> str:
    rows = [
        [*row, f"{sum(run['wall_s'] for run in runs) / len(runs):.1f} s"]
        for row, runs in zip(_accuracy_rows(result), result["runs"].values())
    ]
    return "\n".join(
        [
            "## The quickstart with schedule-free SGD",
            "",
            f"`bench/schedule_free_quickstart.py`: {result['model']}, {result['seeds']} seeds, each variant "
            "run the same way (seed by seed, interleaved): its step decay, a cosine schedule with the same "
            "warmup, and schedule-free SGD (`optim=schedule_free`: the same warmup, no decay, validated at "
            "x). 360 validation images: one image is 0.28%. The wall time is the whole run's.",
            "",
            _table([*_ACCURACY_HEADER, "wall time (mean)"], rows),
            "",
            _provenance("schedule_free_quickstart", result),
            "",
        ]
    )


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us"


def gpu_section(result: dict[str, Any]) -> str:
    """bench/gpu.py's sections: the steps on two sets of parameters, captured steps, a training step."""
    sections = result["sections"]
    text = ["## On a GPU", "", _provenance("gpu", result)]
    if result.get("source"):
        text += ["", result["source"]]
    steps = [sections[name] for name in ("resnet50", "flat") if "times" in sections.get(name, {})]
    if steps:
        names = list(steps[0]["times"])
        text += [
            "",
            "Step time per set of parameters (medians, CUDA events), and each step against the copy floor of "
            "20 bytes per parameter:",
            "",
            _table(
                ["step", *[section["title"] for section in steps]],
                [
                    [
                        name,
                        *[
                            f"{_us(s['times'][name])} ({s['times'][name] / s['times']['copy floor']:.2f}x)"
                            for s in steps
                        ],
                    ]
                    for name in names
                ],
            ),
            "",
            _table(
                ["ratio", *[section["title"] for section in steps]],
                [[key, *[f"{s['ratios'][key]:.2f}" for s in steps]] for key in steps[0]["ratios"]],
            ),
        ]
    flat_times = sections.get("flat", {}).get("ratios")
    if flat_times:
        text += [
            "",
            "On the flat tensor the average costs "
            f"{flat_times['FusedSGD + average / FusedSGD']:.2f}x the plain step where its bytes say 1.40x "
            "(28 against 20 bytes a parameter): the step with the average is not yet at its floor on a GPU.",
        ]
    captured = sections.get("captured", {})
    if "times" in captured:
        rows = captured["times"]
        names = list(next(iter(rows.values())))
        text += [
            "",
            "Captured in a CUDA graph (`capturable=True`, one step captured and replayed):",
            "",
            _table(["parameters", *names], [[case, *[_us(t[n]) for n in names]] for case, t in rows.items()]),
        ]
        for case, t in rows.items():
            if t["torch fused captured"] < t["FusedSGD captured"]:
                text += [
                    "",
                    f"{case}: captured, torch's fused step is faster than ours "
                    f"({_us(t['torch fused captured'])} against {_us(t['FusedSGD captured'])}); "
                    "eager, ours is faster, launching once.",
                ]
    training = sections.get("train", {}).get("training")
    if training:
        text += [
            "",
            f"{sections['train']['title']}, bf16 autocast, channels_last: FusedSGD "
            f"{training['FusedSGD images/s']:,.0f} images/s (the optimizer "
            f"{training['FusedSGD optimizer share']:.1%} of the step), torch's fused SGD "
            f"{training['torch fused images/s']:,.0f} images/s "
            f"({training['torch fused optimizer share']:.1%}).",
        ]
    missing = [
        name for name, section in sections.items() if "times" not in section and "training" not in section
    ]
    if missing:
        text += ["", "Not measured in this run: " + ", ".join(f"`{name}`" for name in missing) + "."]
    return "\n".join(text) + "\n"


def _read_row(read: dict[str, Any] | None) -> list[str]:
    """The read stage's lines, folder against shards (``None``: a result from before the row)."""
    if read is None:
        return [
            "The read stage, folder against shards (`bench/recipe_throughput.py`'s read row, `--read` "
            "alone): not yet measured.",
            "",
        ]
    rates = read["bytes_per_s"]
    rows = [[name, f"{rate / 1e6:.0f}", f"{rate / rates['folder']:.2f}x"] for name, rate in rates.items()]
    return [
        f"The read stage, what a loader worker does with `data.decode=gpu`: {read['images']} of the files "
        f"({read['bytes'] / 1e6:.0f} MB) in a shuffled order, each read and its crop drawn from its JPEG "
        "header, from the folder and from its shards (`python -m runner.shards`, chunks of "
        f"{read['chunk_bytes']}, so that nearly every next sample lies in another chunk, as with ImageNet's "
        f"64 MB ones), median of {read['repeats']} interleaved passes.",
        "",
        _table(["read from", "MB/s per core", "against the folder"], rows),
        "",
    ]


def recipe_throughput_section(result: dict[str, Any]) -> str:
    rates = result["images_per_s"]
    reference = rates["torchvision reference (PIL)"]
    rows = [[name, f"{rate:.0f}", f"{rate / reference:.2f}x"] for name, rate in rates.items()]
    text = [
        "## The recipes' input pipeline and training runs",
        "",
        f"`bench/recipe_throughput.py`: the image-folder pipeline alone, one thread, {result['images']} "
        f"images of the generated JPEG folder (`python -m runner.jpeg_folder`, ~500x375) to {result['size']}x"
        f"{result['size']}, median of {result['repeats']} interleaved passes. Ours reads the bytes, decodes "
        "with TorchCodec and crops, resizes and flips each image in uint8, what a loader worker does with "
        "`data.decode=cpu`; the device normalizes the batch. torchvision's reference: `ImageFolder` + PIL "
        "`RandomResizedCrop`, flip, `ToTensor`, `Normalize`.",
        "",
        _table(["pipeline", "images/s per core", "against the reference"], rows),
        "",
        *_read_row(result.get("read")),
        _provenance("recipe_throughput", result),
        "",
        "### On a GPU",
        "",
    ]
    gpu = _load("recipe_throughput_gpu")
    if gpu is None:
        text += [
            "Not yet measured on a GPU: `python train.py recipe=resnet50` on synthetic data and on the JPEG "
            "folder (`data.decode=gpu`, `data.decode=cpu`) and on its shards (`data=imagenet_shards`, "
            "`data.decode=gpu`) against the bare ResNet-50 step, eager and compiled, are "
            "`bench/recipe_throughput.py --gpu`'s rows, which `bench/gpu_check.sh` runs. "
            "The defaults they would choose (`model.compile`, the recipes' precision) are unmeasured: "
            "`model.compile` is off, the recipes keep their sources' precision, and "
            "`model.channels_last=auto` trains channels-last on a GPU on NVIDIA's advice, not on a "
            "measurement here.",
            "",
        ]
    else:
        gpu_rates = gpu["images_per_s"]
        bare = gpu_rates.get("bare")
        gpu_rows = [
            [name, f"{rate:.0f}", f"{rate / bare:.0%}" if bare else "-"] for name, rate in gpu_rates.items()
        ]
        text += [
            _table(["run", "images/s", "of the bare step"], gpu_rows),
            "",
            _provenance("recipe_throughput_gpu", gpu),
            "",
        ]
    return "\n".join(text)


def verified_section(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, result in results.items():
        machine = result["machine"]
        rows.append(
            [
                f"`{name}.json`",
                machine.get("gpu") or machine.get("cpu") or "CPU",
                machine["torch"],
                str(machine.get("cuda")),
                machine.get("commit", "not recorded"),
                machine.get("date", "not recorded"),
            ]
        )
    gpu_runs = [name for name, result in results.items() if result["machine"].get("gpu")]
    text = [
        "## Verified on",
        "",
        _table(["result", "device", "torch", "CUDA (torch's build)", "commit", "date"], rows),
        "",
    ]
    if not gpu_runs:
        text += [
            "**GPUs**: no run of this version on a GPU yet. The CUDA kernels compile with nvcc 13.0 (sm_80, "
            "sm_90) and run, host code included, on the CPU under an emulation of CUDA's execution model "
            "(`tests/test_cuda_emulated.py`, against the CPU kernel's bits): verified, not measured. Their "
            "GPU tests (`tests/test_cuda.py`, the device cases of every parity test, the CUDA graph tests) "
            "and "
            "`bench/gpu.py` run where a GPU is present, and `bench/gpu_check.sh` runs them all. The "
            "changelog records what an earlier kernel measured on an H200.",
            "",
        ]
    return "\n".join(text)


def render(images: Path) -> str:
    """The benchmark page, its plot written into ``images``."""
    images.mkdir(exist_ok=True)
    names = (
        "step",
        "lars",
        "ema",
        "sharded",
        "bf16_rounding",
        "bf16_quickstart",
        "schedule_free_quickstart",
        "recipe_throughput",
        "recipe_throughput_gpu",
        "gpu",
    )
    results = {name: result for name in names if (result := _load(name)) is not None}
    sections = [
        "# Benchmarks",
        "",
        "Generated by `docs/gen_benchmarks.py` from `bench/results/*.json`; each section names the file, "
        "machine, versions, commit and date it comes from. `make bench` reruns the CPU ones.",
        "",
    ]
    builders = {
        "step": lambda result: step_section(result, images),
        "lars": lars_section,
        "ema": ema_section,
        "sharded": sharded_section,
        "bf16_rounding": rounding_section,
        "bf16_quickstart": quickstart_section,
        "schedule_free_quickstart": schedule_free_quickstart_section,
        "gpu": gpu_section,
        "recipe_throughput": recipe_throughput_section,
    }
    sections += [builders[name](result) for name, result in results.items() if name in builders]
    sections.append(verified_section(results))
    return "\n".join(sections)


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        with tempfile.TemporaryDirectory() as images:  # the committed plot is left as it is
            current = render(Path(images))
        if PAGE.read_text() != current:
            print(
                f"{PAGE} is not the page bench/results gives: run python docs/gen_benchmarks.py",
                file=sys.stderr,
            )
            return 1
        return 0
    PAGE.write_text(render(IMAGES))
    shutil.copyfile(ROOT / "CHANGELOG.md", DOCS / "changelog.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
