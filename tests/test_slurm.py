"""SLURM jobs: Lightning's SLURM environment read from SLURM's variables, one requeuer per launch, and Hydra's
submitit launcher running train.py's jobs (its local executor: there is no SLURM here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only as lightning_rank_zero_only
from lightning_helpers import ROOT, SMALL_RUN, TinyClassifier, cpu_trainer
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only

from lightning_fusedsgd.lightning import Schedule
from runner.slurm import requeue_signal, trainer_plugins

# Task 5 of a job of 2 nodes x 4 tasks, as srun starts it.
EIGHT_TASKS = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "8",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_NNODES": "2",
    "SLURM_NODELIST": "node[3-4]",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
}
ONE_TASK = {**EIGHT_TASKS, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "1"}
ONE_TASK |= {"SLURM_NODELIST": "node3", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}


def in_slurm_job(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]) -> None:
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)


def test_slurms_tasks_give_the_ranks_world_size_and_scaled_lr(monkeypatch: pytest.MonkeyPatch) -> None:
    in_slurm_job(monkeypatch, EIGHT_TASKS)
    for rank_zero_only in (lightning_rank_zero_only, utilities_rank_zero_only):  # DDP sets them: rank 5
        monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    plugins = trainer_plugins([])
    trainer = cpu_trainer(devices=4, num_nodes=2, strategy="ddp", plugins=plugins, max_epochs=1)
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank) == (8, 5, 1, 1)

    # The lr configure_fused_sgd gives this process, as in a fit (attached without starting the 8 processes).
    module = TinyClassifier(samples=512, batch_size=16, schedule=Schedule(decay="constant"))
    trainer.state.fn = TrainerFn.FITTING
    trainer.strategy.connect(module)
    trainer._data_connector.attach_data(module)
    optimizer = module.configure_optimizers()["optimizer"]
    # base_lr 0.1 per 256 images, scaled to the global batch: 16 per task x 8 tasks.
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.1 * 16 * 8 / 256] * 2)


class SignalHandlers(pl.Callback):
    """The handlers of the requeue signals while the fit trains (Lightning installs its own at fit start)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGUSR1, signal.SIGUSR2)}


@pytest.mark.parametrize("launch", ["srun", "submitit"])
def test_exactly_one_requeuer_per_launch(launch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """srun: Lightning requeues on SIGUSR1. A submitit job: submitit does on its own signal (USR2), and
    Lightning, which otherwise installs its SIGUSR1 handler and never calls submitit's, takes the ranks from
    SLURM and handles no requeue signal."""
    in_slurm_job(monkeypatch, ONE_TASK)
    if launch == "submitit":
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    plugins = trainer_plugins([])
    probe = SignalHandlers()
    cpu_trainer(max_steps=1, plugins=plugins, callbacks=[probe]).fit(TinyClassifier(samples=16))
    lightning_requeues = callable(probe.handlers[signal.SIGUSR1])
    assert lightning_requeues == (launch == "srun")
    assert requeue_signal(plugins) == (signal.SIGUSR1 if launch == "srun" else signal.SIGUSR2)


@pytest.mark.slow  # the launcher's process and the job's
def test_submitit_local_runs_a_tiny_job_to_its_summary_line(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    command = [sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=submitit_local"]
    command += [*SMALL_RUN, "data=synthetic", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [log] = sweep.glob(".submitit/*/*_0_log.out")
    summaries = [line for line in log.read_text().splitlines() if line.startswith("summary: ")]
    assert (
        summaries == [summaries[0]]
        and " steps=3 " in summaries[0]
        and summaries[0].endswith(f"out={sweep / '0'}")
    )
    assert (sweep / "0" / "metrics.json").is_file() and (sweep / "0" / "checkpoints" / "last.ckpt").is_file()
