"""A run stopped by a signal (Ctrl-C, SIGTERM, a SLURM job's requeue signal) saves at the end of the step the
signal arrived in and resumes exactly: the stopped and resumed halves are the run made in one go.

Each signal is sent by the process to itself in the middle of an optimizer step, after its backward and
before its update (``lightning_helpers.SignalAt``), where a checkpoint would hold a half-applied step. Oracle:
the same run made in one go, compared through the final ``last.ckpt`` bit for bit (weights, momentum, the lr
of every step) and the validation accuracies recorded.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_helpers import (
    ROOT,
    SMALL_RUN,
    assert_identical,
    compose_train,
    final_state,
    last_checkpoint,
)

from lightning_fusedsgd.checkpoint import read_checkpoint_file
from runner.run import train

pytestmark = [
    pytest.mark.slow,  # whole training runs
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed:UserWarning"),
]

RUN = [*SMALL_RUN, "+trainer.enable_model_summary=false"]  # 2 epochs of 3 steps
# A process of a one-task SLURM job, as srun starts it.
SLURM_JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_NNODES": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


def signal_at(step: int, name: str, once: Path | None = None) -> list[str]:
    """Overrides that make the run send itself signal ``name`` in the middle of optimizer step ``step``."""
    overrides = ["+callbacks.signal._target_=lightning_helpers.SignalAt", f"+callbacks.signal.step={step}"]
    overrides.append(f"+callbacks.signal.signal={name}")
    return overrides + ([f"+callbacks.signal.once={once}"] if once else [])


def outcome(run_dir: Path) -> dict[str, Any]:
    """What the oracle compares: the final last.ckpt's weights, optimizer state and lrs, and the validation
    accuracies recorded."""
    validations = read_checkpoint_file(last_checkpoint(run_dir))["callbacks"]["RunSummary"]["val_acc"]
    return {**final_state(run_dir), "val_acc": validations}


def assert_same_run(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert_identical(actual, expected)
    assert actual["val_acc"] == expected["val_acc"]


def step_of(path: Path) -> int:
    return read_checkpoint_file(path)["global_step"]


@pytest.fixture(autouse=True)
def interactive_ctrl_c():
    """Python's own Ctrl-C handler, as in a terminal: a shell starts a background job (``make test &``, a CI
    runner's) with SIGINT ignored, which a run rightly leaves ignored; Lightning ignores it too after a
    KeyboardInterrupt, and never restores it."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("straight")
    train(compose_train(RUN, run_dir))
    return outcome(run_dir)


def test_ctrl_c_and_sigterm_save_at_the_step_and_the_run_resumes_exactly(straight, tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    fixed = [f"hydra.run.dir={run_dir}", "ckpt_path=auto"]

    # 1. Ctrl-C in step 2: the step completes and is saved; the summary so far and the command that resumes.
    with pytest.raises(SystemExit) as stopped:
        train(compose_train([*RUN, *fixed, *signal_at(2, "SIGINT")], run_dir))
    assert stopped.value.code == 128 + signal.SIGINT
    assert step_of(last_checkpoint(run_dir)) == 2
    *_, stop_line, resume_line, summary_line = capsys.readouterr().out.strip().splitlines()
    assert stop_line == f"stopped by SIGINT at step 2 (epoch 0): saved {last_checkpoint(run_dir)}"
    assert summary_line.startswith("summary: name=quickstart validation=none epochs=0 steps=2 ")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["global_step"] == 2 and metrics["last_checkpoint"] == str(last_checkpoint(run_dir))
    assert (run_dir / "curves.png").stat().st_size > 0

    # 2. The printed command, run as printed: it resumes in the same run dir. SIGTERM in step 3, the epoch's
    #    last: saved before that epoch's validation, which runs (its checkpoint is saved after it).
    python, script, *overrides = shlex.split(resume_line.removeprefix("resume: "))
    assert (python, Path(script).resolve()) == ("python", ROOT / "train.py")
    assert overrides[-1] == f"ckpt_path={last_checkpoint(run_dir)}"
    with pytest.raises(SystemExit) as stopped:
        train(
            compose_train([*overrides, "callbacks.signal.step=3", "callbacks.signal.signal=SIGTERM"], run_dir)
        )
    assert stopped.value.code == 128 + signal.SIGTERM
    assert step_of(last_checkpoint(run_dir)) == 3
    assert "stopped by SIGTERM at step 3" in capsys.readouterr().out

    # 3. ckpt_path=auto in the fixed run dir once more: it continues from there to the end.
    summary = train(compose_train([*RUN, *fixed], run_dir))
    assert summary["global_step"] == 6
    assert_same_run(outcome(run_dir), straight)


def test_a_requeue_signal_saves_at_the_step_and_the_requeued_job_resumes_exactly(
    straight, tmp_path, monkeypatch
) -> None:
    """Lightning's SLURM requeue: on SIGUSR1 it saves hpc_ckpt_<n>.ckpt and calls `scontrol requeue`; SLURM
    then ends the job with SIGTERM, and the requeued job (the same job id) runs the same command. A stand-in
    scontrol records its call and sends that SIGTERM; the rest is real."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nkill -TERM $PPID\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in SLURM_JOB.items():
        monkeypatch.setenv(key, value)
    job = [*RUN, "ckpt_path=auto", f"hydra.run.dir={tmp_path}/runs/${{oc.env:SLURM_JOB_ID}}"]
    run_dir = tmp_path / "runs" / SLURM_JOB["SLURM_JOB_ID"]

    with pytest.raises(SystemExit) as stopped:  # the requeue signal in step 4, mid-epoch
        train(compose_train([*job, *signal_at(4, "SIGUSR1")], run_dir))
    assert stopped.value.code == 128 + signal.SIGTERM
    assert calls.read_text() == f"requeue {SLURM_JOB['SLURM_JOB_ID']}\n"
    assert step_of(run_dir / "hpc_ckpt_1.ckpt") == step_of(last_checkpoint(run_dir)) == 4

    train(compose_train(job, run_dir))  # the requeued job: it resumes the newest, Lightning's hpc_ckpt_1.ckpt
    assert_same_run(outcome(run_dir), straight)


@pytest.mark.heavy  # the launcher's process and two runs of the job's: about a minute on 2 cores
def test_a_submitit_job_requeued_on_its_signal_resumes_exactly(straight, tmp_path) -> None:
    """Hydra's submitit launcher, local executor: submitit's preemption signal (USR2) in step 4 makes submitit
    requeue the job (its local executor restarts it) after the run saved last.ckpt at that step; the restarted
    job, the same command, resumes it with ckpt_path=auto: in the same sweep dir, its time resolved once."""
    start = tmp_path / "start.pt"  # what the restarted job starts from
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        "hydra/launcher=submitit_local",
        f"hydra.sweep.dir={tmp_path}/sweeps/${{now:%H-%M-%S-%f}}",
        *RUN,
        "ckpt_path=auto",
        *signal_at(4, "SIGUSR2", once=tmp_path / "signalled"),
        "+callbacks.start._target_=lightning_helpers.StartProbe",
        f"+callbacks.start.path={start}",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "PYTHONWARNINGS": "ignore",
    }
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [sweep] = (tmp_path / "sweeps").iterdir()
    [log] = sweep.glob(".submitit/*/*_0_log.out")
    lines = log.read_text().splitlines()
    saved = (sweep / "0" / "checkpoints" / "last.ckpt").relative_to(tmp_path)  # shown from the cwd
    assert (
        f"requeued on SIGUSR2 at step 4 (epoch 1): saved {saved}, which the job resumes with ckpt_path=auto"
        in lines
    )
    assert torch.load(start, weights_only=False)["global_step"] == 4
    summaries = [line for line in lines if line.startswith("summary: ")]
    assert len(summaries) == 2 and " steps=6 " in summaries[-1]
    assert_same_run(outcome(sweep / "0"), straight)
