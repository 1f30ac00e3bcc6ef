"""Sweeps: ``python train.py -m ...`` runs a job a dir and ends with the table of their results
(``runner.sweep``), ``hparams_search=NAME`` runs Hydra's optuna sweeper; and today's Hydra: no deprecation
warning from hydra-core 1.3, the configs' targets within the runner's Hydra 1.4 whitelist."""

from __future__ import annotations

import csv
import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from hydra.types import RunMode
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_helpers import ROOT, SMALL_RUN, compose_train, run_train_py
from omegaconf import OmegaConf

from lightning_fusedsgd.lightning import ConfigError
from runner.sweep import SweepTable, check_search_installed, run_job, sweep_results
from runner.targets import TRUSTED_TARGETS

# Tiny jobs: 2 epochs of 1 step, two classes of random images (an accuracy that varies between jobs).
TINY_JOB = [*SMALL_RUN, "data=synthetic", "data.num_classes=2", "trainer.limit_train_batches=1"]
# Hydra's deprecation warnings raise (its own switch); its other warnings are shown, to be looked for.
HYDRA_STRICT = {"HYDRA_DEPRECATION_WARNINGS_AS_ERRORS": "1", "PYTHONWARNINGS": "ignore,always::UserWarning"}
# Hydra 1.3.5+'s warning for a missing or 1.1 version_base; the warning Hydra turns a callback's error into.
HYDRA_WARNING = re.compile(r"Hydra\d+MigrationWarning|HydraDeprecationError|UserWarning: Callback ")


def _sweep_dir(cwd: Path) -> Path:
    (sweep_dir,) = (cwd / "multirun").iterdir()  # multirun/<time>: the default sweep dir
    return sweep_dir


def _table(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "results.csv", newline="") as file:
        return list(csv.DictReader(file))


def _markdown_jobs(markdown: str) -> list[str]:
    """The job column of the Markdown table's rows."""
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and not line.startswith("| job ")]
    return [row.split(" | ")[0].removeprefix("| ") for row in rows]


def _check_finished_row(row: dict[str, str], sweep_dir: Path) -> None:
    """A finished job's row holds its own metrics.json's final and best val/acc."""
    metrics = json.loads((sweep_dir / row["job"] / "metrics.json").read_text())
    assert float(row["val/acc"]) == metrics["val/acc"]
    assert float(row["best_val/acc"]) == metrics["best_val/acc"]
    assert row["error"] == ""


@pytest.mark.slow
def test_a_grid_sweep_ends_with_every_jobs_result_best_first_and_failed_jobs_with_their_error(tmp_path):
    result = run_train_py(
        ["-m", *TINY_JOB, "optim.momentum=0.9,-1", "schedule=cosine,multistep"],
        cwd=tmp_path,
        env=HYDRA_STRICT,
    )
    sweep_dir = _sweep_dir(tmp_path)
    relative = sweep_dir.relative_to(tmp_path)
    # The failed jobs did not end the sweep, and they set its exit status.
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == f"2 of 4 jobs failed: see {relative}/results.md"
    assert not HYDRA_WARNING.findall(result.stderr)

    rows = _table(sweep_dir)
    for row in rows:  # each row is its job's: the overrides it names are the job's own config
        config = OmegaConf.load(sweep_dir / row["job"] / ".hydra" / "config.yaml")
        assert (row["optim.momentum"], row["schedule"]) == (str(config.optim.momentum), config.schedule.decay)
        assert (row["debug"], row["data"]) == ("tiny", "synthetic")
    assert sorted((row["optim.momentum"], row["schedule"]) for row in rows) == [
        ("-1", "cosine"),
        ("-1", "multistep"),
        ("0.9", "cosine"),
        ("0.9", "multistep"),
    ]
    finished, failed = rows[:2], rows[2:]  # the failed ones last
    for row in finished:
        _check_finished_row(row, sweep_dir)
    assert [float(row["best_val/acc"]) for row in finished] == sorted(
        (float(row["best_val/acc"]) for row in finished), reverse=True
    )
    for row in failed:
        assert row["optim.momentum"] == "-1"
        assert row["error"] == "optimizer: Invalid momentum value: -1. It must be >= 0."
        assert (row["val/acc"], row["best_val/acc"]) == ("", "")

    # The Markdown table: the same rows, the same order, the overrides all jobs share above it; printed last.
    markdown = (sweep_dir / "results.md").read_text()
    assert _markdown_jobs(markdown) == [row["job"] for row in rows]
    assert "every job: debug=tiny data=synthetic data.num_classes=2 trainer.limit_train_batches=1" in markdown
    assert result.stdout.endswith(markdown + "\n")


@pytest.mark.slow
def test_an_optuna_search_optimizes_the_value_the_table_shows(tmp_path):
    result = run_train_py(
        [*TINY_JOB, "hparams_search=quickstart_optuna", "hydra.sweeper.n_trials=3"],
        cwd=tmp_path,
        env=HYDRA_STRICT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not HYDRA_WARNING.findall(result.stderr)
    sweep_dir = _sweep_dir(tmp_path)
    rows = _table(sweep_dir)
    assert len(rows) == 3
    for row in rows:
        _check_finished_row(row, sweep_dir)
        # Each trial drew its own point of the configured search space.
        assert 0.02 <= float(row["optim.base_lr"]) <= 1.0
        assert 1e-5 <= float(row["optim.weight_decay"]) <= 1e-3
        assert 0.8 <= float(row["optim.momentum"]) <= 0.99
    assert len({row["optim.base_lr"] for row in rows}) == 3

    # Optuna's own result: its best value is the table's best, its best trial one of the rows with it.
    optuna = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert optuna["best_value"] == max(float(row["best_val/acc"]) for row in rows)
    assert optuna["best_value"] == float(rows[0]["best_val/acc"])
    best_rows = [row for row in rows if float(row["best_val/acc"]) == optuna["best_value"]]
    assert any(
        {key: float(row[key]) for key in optuna["best_params"]} == optuna["best_params"] for row in best_rows
    )
    assert result.stdout.endswith((sweep_dir / "results.md").read_text() + "\n")


def _job(
    sweep_dir: Path, job: str, overrides: list[str], metrics: dict | None, error: str | None = None
) -> None:
    job_dir = sweep_dir / job
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if metrics is not None:
        (job_dir / "metrics.json").write_text(json.dumps(metrics))
    if error is not None:
        (job_dir / "error.txt").write_text(error + "\n")


def test_sweep_results_are_best_first_then_jobs_without_validation_then_failed_and_unfinished_ones(tmp_path):
    def metrics(final, best):
        return {"name": "quickstart", "val/acc": final, "best_val/acc": best}

    _job(tmp_path, "0", ["optim.lr=0.1"], metrics(0.5, 0.75))
    _job(tmp_path, "1", ["optim.lr=0.2"], None, "optimizer: Invalid learning rate: -1")
    _job(tmp_path, "2", ["optim.lr=0.3"], metrics(0.75, 0.75))  # ties job 0's best, with a better final
    _job(tmp_path, "3", ["optim.lr=0.4"], None)  # killed: neither file
    _job(tmp_path, "10", ["optim.lr=0.5"], metrics(None, None))  # ran no validation
    _job(tmp_path, "4", ["optim.lr=0.6"], metrics(0.25, 0.875))

    rows = sweep_results(tmp_path, "val/acc")
    assert [row["job"] for row in rows] == ["4", "2", "0", "10", "1", "3"]
    assert [row["overrides"] for row in rows][:2] == [["optim.lr=0.6"], ["optim.lr=0.3"]]
    assert [row["error"] for row in rows][3:] == [
        None,
        "optimizer: Invalid learning rate: -1",
        "did not finish: no metrics.json",
    ]
    assert (rows[0]["val/acc"], rows[0]["best_val/acc"]) == (0.25, 0.875)


def test_rank_0_alone_writes_and_prints_the_table(tmp_path, monkeypatch, capsys):
    # Lightning's DDP launcher reruns the sweep's command for the other ranks: they run the sweep in step.
    _job(tmp_path, "0", ["optim.lr=-1"], None, "optimizer: Invalid learning rate: -1")
    hydra = {"mode": RunMode.MULTIRUN, "sweep": {"dir": str(tmp_path)}, "output_subdir": ".hydra"}
    config = OmegaConf.create({"hydra": hydra})
    table = SweepTable()
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    table.on_job_end(config, job_return=None)
    table.on_multirun_end(config)
    assert (list(tmp_path.glob("results.*")), capsys.readouterr().out) == ([], "")

    monkeypatch.setattr(rank_zero_only, "rank", 0)
    with pytest.raises(SystemExit, match=f"^1 of 1 jobs failed: see {tmp_path}/results.md$"):
        table.on_multirun_end(config)
    assert capsys.readouterr().out == (tmp_path / "results.md").read_text() + "\n"
    assert "| 0 |  |  | optimizer: Invalid learning rate: -1 |" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize(
    "error, line, traceback",
    [
        (ConfigError("optim.lr=-1: must be\n  positive"), "optim.lr=-1: must be positive", False),
        (RuntimeError("out of memory.\nTried"), "RuntimeError: out of memory. Tried", True),
    ],
    ids=["user_mistake", "other_error"],
)
def test_a_failed_job_returns_no_value_and_leaves_its_error_in_one_line(
    error, line, traceback, tmp_path, monkeypatch, capsys, caplog
):
    def fail(cfg):
        raise error

    cfg = compose_train(TINY_JOB, tmp_path)  # sets the run dir, as Hydra does for a job
    monkeypatch.setattr("runner.run.train", fail)
    assert run_job(cfg) is None
    assert (tmp_path / "error.txt").read_text() == line + "\n"
    assert capsys.readouterr().err == f"error: {line}\n"
    # A user mistake is its message alone; anything else leaves its traceback in the log.
    logged = [record.exc_info[1] for record in caplog.records if record.exc_info]
    assert logged == ([error] if traceback else [])


def test_hparams_search_without_the_optuna_sweeper_names_the_extra_to_install(monkeypatch, capsys):
    check_search_installed(["debug=tiny", "hparams_search=quickstart_optuna"])  # installed here: nothing
    monkeypatch.setitem(sys.modules, "hydra_plugins.hydra_optuna_sweeper", None)  # an import of it fails
    check_search_installed(["optim.lr=0.1"])  # no search asked for: nothing
    with pytest.raises(SystemExit) as stopped:
        check_search_installed(["hparams_search=quickstart_optuna"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "error: hparams_search=quickstart_optuna runs Hydra's optuna sweeper, which is not installed: "
        'pip install -e ".[sweeps]" (hydra-optuna-sweeper and optuna<3)\n'
    )


def test_composing_the_config_as_the_tests_do_raises_no_hydra_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_DEPRECATION_WARNINGS_AS_ERRORS", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compose_train([*TINY_JOB, "hparams_search=quickstart_optuna"], tmp_path)
    assert [
        str(w.message) for w in caught if "hydra" in w.filename or "Hydra" in type(w.message).__name__
    ] == []


def _targets(node) -> list[str]:
    """Every ``_target_`` in a parsed YAML file."""
    if isinstance(node, dict):
        own = [node["_target_"]] if "_target_" in node else []
        return own + [target for value in node.values() for target in _targets(value)]
    if isinstance(node, list):
        return [target for value in node for target in _targets(value)]
    return []


def test_every_target_the_configs_name_is_in_the_runners_hydra_14_whitelist():
    # Hydra 1.4's rule: an entry is a target itself or a package prefix ending in ".*".
    def whitelisted(target: str) -> bool:
        return any(
            target.startswith(entry[:-1]) if entry.endswith(".*") else target == entry
            for entry in TRUSTED_TARGETS
        )

    files = sorted((ROOT / "conf").rglob("*.yaml")) + sorted((ROOT / "recipes").glob("*.yaml"))
    targets = {target for path in files for target in _targets(yaml.safe_load(path.read_text()))}
    assert {"runner.sweep.SweepTable", "lightning.pytorch.Trainer", "runner.model.ImageClassifier"} <= targets
    assert sorted(target for target in targets if not whitelisted(target)) == []
