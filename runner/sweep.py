"""Sweeps (``python train.py -m ...``): one job of a multirun (:func:`run_job`) and the table of every job's
result that ends it (:class:`SweepTable`, a Hydra callback that ``conf/train.yaml`` registers).

A job's record is three files in its run dir: Hydra's ``.hydra/overrides.yaml`` (written before the job
starts), :class:`~runner.summary.RunSummary`'s ``metrics.json`` (written when it ends) and, where it failed,
``error.txt`` (its error, one line). The table is built from them alone, so it reads the same whichever
launcher ran the jobs, in this process or elsewhere.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

__all__ = ["ERROR_FILE", "SweepTable", "check_search_installed", "run_job", "sweep_results"]

ERROR_FILE = "error.txt"
TABLE_FILES = ("results.csv", "results.md")
log = logging.getLogger(__name__)


def check_search_installed(overrides: list[str]) -> None:
    """Exit with the fix where the command line asks for ``hparams_search=NAME`` and Hydra's optuna sweeper
    is not installed (Hydra's own message would only say that ``hydra/sweeper/optuna`` is not among its
    options)."""
    search = next((arg for arg in overrides if arg.startswith("hparams_search=")), None)
    if search is None:
        return
    try:
        import hydra_plugins.hydra_optuna_sweeper  # noqa: F401
    except ImportError:
        print(
            f"error: {search} runs Hydra's optuna sweeper, which is not installed: "
            'pip install -e ".[sweeps]" (hydra-optuna-sweeper and optuna<3)',
            file=sys.stderr,
        )
        sys.exit(2)


def run_job(cfg: DictConfig) -> float | None:
    """Train one job of a sweep; a job that fails is recorded in its run dir and the sweep goes on.

    Hydra's basic sweeper raises the first failed job's error once its batch has run, which would end the
    sweep before its table, and train.py's ``sys.exit(2)`` on a user mistake would end it at once: here an
    error is printed (``error: ...``; its traceback is logged where it is not a user mistake),
    written to ``<run dir>/error.txt``, and the job returns.

    Returns:
        The job's best monitored metric (``callbacks.summary.monitor``, ``val/acc``): the value the optuna
        sweeper optimizes. None where the job failed or ran no validation (the optuna sweeper records such a
        trial as failed).
    """
    from lightning_fusedsgd.checkpoint import CheckpointError
    from lightning_fusedsgd.lightning import ConfigError
    from runner.run import train

    try:
        summary = train(cfg)
    except (ConfigError, CheckpointError) as err:  # a user mistake or a bad file: its message
        message = str(err)
    except Exception as err:  # anything else: its traceback is logged (and in the job's log), one line here
        log.exception("the job failed")
        message = f"{type(err).__name__}: {err}"
    else:
        monitor = OmegaConf.select(cfg, "callbacks.summary.monitor")
        return summary.get(f"best_{monitor}")
    message = " ".join(message.split())  # one line, for the table
    print(f"error: {message}", file=sys.stderr, flush=True)
    (Path(HydraConfig.get().runtime.output_dir) / ERROR_FILE).write_text(message + "\n")
    return None


class SweepTable(Callback):
    """Ends a multirun with the table of its jobs: each job's overrides, its final and best monitored metric
    and, for a failed one, its error, best first. Written to ``<sweep dir>/results.csv`` and ``results.md``
    after every job (so a sweep stopped midway still has one) and printed at the end; the command's exit
    status is 1 when a job failed.

    Args:
        monitor: The metric :class:`~runner.summary.RunSummary` monitors (its ``metrics.json`` has it and
            ``best_<monitor>``); higher is better.
    """

    def __init__(self, monitor: str = "val/acc") -> None:
        self.monitor = monitor

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN and _global_rank() == 0:
            self._write(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if _global_rank() != 0:
            return
        markdown, failed, total = self._write(config)
        print(markdown, flush=True)
        if failed:
            # Hydra turns a callback's exception into a warning: only SystemExit sets the exit status.
            raise SystemExit(
                f"{failed} of {total} jobs failed: see {Path(config.hydra.sweep.dir) / TABLE_FILES[1]}"
            )

    def _write(self, config: DictConfig) -> tuple[str, int, int]:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = sweep_results(sweep_dir, self.monitor, config.hydra.output_subdir)
        csv_text, markdown = _tables(rows, self.monitor, sweep_dir)
        for name, text in zip(TABLE_FILES, (csv_text, markdown)):
            temporary = sweep_dir / f".{name}.tmp"  # replaced whole: jobs of a parallel launcher may race
            temporary.write_text(text)
            temporary.replace(sweep_dir / name)
        return markdown, sum(row["error"] is not None for row in rows), len(rows)


def _global_rank() -> int:
    """This process's rank in its jobs' DDP runs: where the sweep runs in every rank (Lightning's DDP launcher
    restarts the sweep's command for the other ranks, without a record of each job's overrides; srun starts
    it in each), rank 0 alone writes the table."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return rank_zero_only.rank


def sweep_results(
    sweep_dir: Path, monitor: str, output_subdir: str | None = ".hydra"
) -> list[dict[str, Any]]:
    """Every job under ``sweep_dir``, best first (by ``best_<monitor>``, then the final value; jobs without a
    value after those with one, failed jobs last), each ``{"job", "overrides", monitor, "best_" + monitor,
    "error"}``: ``job`` is its run dir relative to ``sweep_dir``, ``overrides`` its ``key=value`` list, and
    ``error`` None for a job that finished."""
    if output_subdir is None:
        raise ValueError(
            "hydra.output_subdir=null: the jobs' overrides are not recorded, so no table is made"
        )
    rows = []
    for record in sweep_dir.rglob(f"{output_subdir}/overrides.yaml"):
        job_dir = record.parent.parent
        metrics_file, error_file = job_dir / "metrics.json", job_dir / ERROR_FILE
        metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
        if error_file.is_file():
            error = error_file.read_text().strip()
        elif not metrics:
            error = "did not finish: no metrics.json"
        else:
            error = None
        rows.append(
            {
                "job": job_dir.relative_to(sweep_dir).as_posix(),
                "overrides": list(OmegaConf.load(record)),
                monitor: metrics.get(monitor),
                f"best_{monitor}": metrics.get(f"best_{monitor}"),
                "error": error,
            }
        )
    rows.sort(key=lambda row: _job_order(row["job"]))
    return sorted(rows, key=lambda row: _rank(row, monitor))


def _job_order(job: str) -> tuple[tuple[int, int | str], ...]:
    """Job dirs in launch order: ``2`` before ``10``."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in job.split("/"))


def _rank(row: dict[str, Any], monitor: str) -> tuple[int, float, float]:
    best, final = row[f"best_{monitor}"], row[monitor]
    if row["error"] is not None:
        return (2, 0.0, 0.0)
    if best is None:
        return (1, 0.0, 0.0)
    return (0, -best, -(final if final is not None else best))


def _tables(rows: list[dict[str, Any]], monitor: str, sweep_dir: Path) -> tuple[str, str]:
    """The CSV (every override a column) and the Markdown table (the overrides that differ between jobs as
    columns, those every job shares in the line above it)."""
    overrides = [dict(item.split("=", 1) for item in row["overrides"]) for row in rows]
    keys = list(dict.fromkeys(key for job in overrides for key in job))
    shared = [key for key in keys if len({job.get(key) for job in overrides}) == 1]
    swept = [key for key in keys if key not in shared]
    metric_keys = [monitor, f"best_{monitor}"]

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["job", *keys, *metric_keys, "error"])
    for row, job in zip(rows, overrides):
        metrics = ["" if row[key] is None else repr(row[key]) for key in metric_keys]  # every digit
        writer.writerow([row["job"], *(job.get(key, "") for key in keys), *metrics, row["error"] or ""])

    failed = sum(row["error"] is not None for row in rows)
    lines = [
        f"sweep {sweep_dir}: {len(rows)} jobs, {failed} failed, best {monitor} first"
        + (f"; every job: {' '.join(f'{key}={overrides[0][key]}' for key in shared)}" if shared else ""),
        "",
        "| " + " | ".join(["job", *swept, *metric_keys, "error"]) + " |",
        "|" + "---|" * (len(swept) + 4),
    ]
    for row, job in zip(rows, overrides):
        metrics = ["" if row[key] is None else f"{row[key]:.4f}" for key in metric_keys]
        cells = [row["job"], *(job.get(key, "") for key in swept), *metrics, row["error"] or ""]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return out.getvalue(), "\n".join(lines) + "\n"
