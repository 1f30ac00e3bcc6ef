"""SLURM jobs: which of Lightning and submitit requeues a job at its time limit or preemption.

Two engines can requeue a SLURM job: Lightning's ``SLURMEnvironment`` (auto-requeue: on SIGUSR1 it saves
``hpc_ckpt_<n>.ckpt`` and calls ``scontrol requeue``) and submitit (on its preemption signal, USR2, it pickles
the job again, calls ``scontrol requeue`` and exits). In a submitit job Lightning finds SLURM's variables and
installs its own handlers beside submitit's, never calling submitit's, while submitit's sbatch never sends
SIGUSR1. Exactly one requeues:

* ``srun python train.py ...`` (an sbatch script): Lightning, through its ``SLURMEnvironment``
  (``#SBATCH --signal=SIGUSR1@90``);
* a job of Hydra's submitit launcher (``hydra/launcher=submitit_slurm``): submitit, with Lightning's
  ``SLURMEnvironment(auto_requeue=False)``, which takes the ranks from SLURM and handles no requeue signal.

Either requeuer's handler runs at the end of a training step, after the run saved ``last.ckpt`` there
(:class:`runner.interrupt.Interruption`); the requeued job resumes it with ``ckpt_path=auto``.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment

__all__ = ["requeue_signal", "trainer_plugins"]


def trainer_plugins(configured: list[Any] | None) -> list[Any]:
    """The Trainer's plugins: ``configured`` (``trainer.plugins``) and, in a SLURM job, Lightning's SLURM
    environment with its auto-requeue on, or off in a submitit job (see the module docstring). A cluster
    environment among ``configured`` is kept as it is."""
    plugins = list(configured or [])
    if SLURMEnvironment.detect() and not any(isinstance(p, ClusterEnvironment) for p in plugins):
        plugins.append(SLURMEnvironment(auto_requeue=not _in_submitit_job()))
    return plugins


def requeue_signal(plugins: list[Any]) -> signal.Signals | None:
    """The signal the job's requeuer acts on: submitit's in a submitit job (USR2 unless
    ``SUBMITIT_PREEMPT_SIGNAL`` names another), Lightning's SLURM environment's where it requeues (SIGUSR1
    unless set), None elsewhere."""
    if _in_submitit_job():
        from submitit import JobEnvironment

        return signal.Signals[f"SIG{JobEnvironment.USR_SIG}"]
    environments = [p for p in plugins if isinstance(p, SLURMEnvironment) and p.auto_requeue]
    return environments[0].requeue_signal if environments else None


def _in_submitit_job() -> bool:
    """Whether this process is a job submitit started (its executors set ``SUBMITIT_EXECUTOR``)."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))
