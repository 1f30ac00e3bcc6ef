"""Exact resume through train.py's runner, on the quickstart model: a run split in two is the same run.

Oracle: the same run made in one go. Both are compared through their final ``last.ckpt``: the weights,
every optimizer state tensor (momentum buffers, fp32 master weights) and the lr each optimizer step
used (RunSummary's record, which travels in the checkpoint), all bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_helpers import (
    SMALL_RUN,
    STEPS_PER_EPOCH,
    Interrupted,
    assert_identical,
    compose_train,
    final_state,
    last_checkpoint,
)

from lightning_fusedsgd.checkpoint import read_checkpoint_file
from lightning_fusedsgd.lightning import ConfigError
from runner.data import DigitsDataModule
from runner.run import train

pytestmark = [
    pytest.mark.slow,  # whole training runs: make test runs them, make test-fast not
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed:UserWarning"),
    # Resuming with a larger max_epochs changes no lr already used: WarmupLR must stay silent.
    pytest.mark.filterwarnings("error:WarmupLR"),
]

# A milestone at epoch 3 (step 9): the 2-epoch half has none (its schedule is warmup + constant), the
# resumed half passes it.
SHORT = [*SMALL_RUN, "schedule.milestones=[3]", "+trainer.enable_model_summary=false"]
# Each variant's overrides and steps per epoch. bf16 on a CPU without native bf16 takes seconds a step
# whatever the image size: that variant takes one step an epoch, at debug=tiny's 32x32 (smaller images give
# ResNet-18 1x1 maps that PyTorch's bf16 convolution backward gets wrong: docs/upstream/, and the runner
# refuses).
VARIANTS = {
    "sgd": ([], STEPS_PER_EPOCH),
    "lars": (["optim=fused_lars"], STEPS_PER_EPOCH),
    "bf16_true": (["trainer.precision=bf16-true", "trainer.limit_train_batches=1"], 1),
}
# bf16_true: a minute of bf16 convolutions on a CPU without native bf16; lars: LARS keeps no state beyond
# SGD's momentum, which sgd resumes in make test. Both with make test-all.
HEAVY = {"bf16_true", "lars"}


def run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    return train(compose_train([*SHORT, *overrides], run_dir))


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted 4-epoch run of each variant, made once per module."""
    states: dict[str, dict[str, Any]] = {}

    def get(variant: str) -> dict[str, Any]:
        if variant not in states:
            run_dir = tmp_path_factory.mktemp(f"straight_{variant}")
            run(run_dir, *VARIANTS[variant][0], "trainer.max_epochs=4")
            states[variant] = final_state(run_dir)
        return states[variant]

    return get


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=[pytest.mark.heavy] if v in HEAVY else []) for v in VARIANTS]
)
def test_two_then_four_epochs_equals_four_epochs(variant: str, straight, tmp_path: Path) -> None:
    overrides, steps_per_epoch = VARIANTS[variant]
    expected = straight(variant)
    assert expected["global_step"] == 4 * steps_per_epoch
    # The milestone at epoch 3 falls in the resumed half.
    assert expected["lrs"][-1][1] < expected["lrs"][2 * steps_per_epoch - 1][1]

    run(tmp_path / "first", *overrides, "trainer.max_epochs=2")
    assert final_state(tmp_path / "first")["global_step"] == 2 * steps_per_epoch
    resume = f"ckpt_path={last_checkpoint(tmp_path / 'first')}"
    summary = run(tmp_path / "second", *overrides, "trainer.max_epochs=4", resume)

    assert summary["global_step"] == 4 * steps_per_epoch
    resumed = final_state(tmp_path / "second")
    assert_identical(resumed, expected)
    kinds = {name.rsplit("/", 1)[1] for name in resumed["optimizer"]}
    assert kinds == ({"momentum_buffer", "master_param"} if variant == "bf16_true" else {"momentum_buffer"})
    if variant == "bf16_true":
        assert {t.dtype for t in resumed["weights"].values() if t.is_floating_point()} == {torch.bfloat16}
        assert {t.dtype for t in resumed["optimizer"].values()} == {torch.float32}
    if variant == "lars":
        groups = read_checkpoint_file(last_checkpoint(tmp_path / "second"))["optimizer_states"][0][
            "param_groups"
        ]
        assert sorted(group["lars"] for group in groups) == [False, True]


def test_mid_epoch_resume_from_a_step_checkpoint_continues_at_the_right_step(
    straight, tmp_path: Path
) -> None:
    first = tmp_path / "first"
    step_checkpoints = ["trainer.max_epochs=4", "callbacks.step_checkpoint.every_n_train_steps=2"]
    stop = ["+callbacks.stop._target_=lightning_helpers.StopAt", "+callbacks.stop.step=5"]
    with pytest.raises(Interrupted):  # stopped in epoch 1 before its last batch; last step checkpoint: 4
        run(first, *step_checkpoints, *stop)

    checkpoint = read_checkpoint_file(last_checkpoint(first))
    assert checkpoint["global_step"] == 4
    assert checkpoint["DigitsDataModule"] == {"epoch": 1, "batches": 1}  # one batch into epoch 1
    run(tmp_path / "second", *step_checkpoints, f"ckpt_path={last_checkpoint(first)}")
    assert_identical(final_state(tmp_path / "second"), straight("sgd"))


def test_a_run_stopped_by_max_steps_mid_epoch_resumes_in_that_epoch(tmp_path: Path) -> None:
    """Lightning saves a max_steps stop at on_train_epoch_end, the epoch counted done: resumed as saved, the
    epoch's last batch would never train (5 steps, not 6). No warmup and no milestone within the 2 epochs, so
    that max_steps shapes no lr the run uses: the two halves must be the run made in one go, bit for bit."""
    constant = ["schedule.warmup=0", "trainer.max_epochs=2"]
    run(tmp_path / "straight", *constant)
    expected = final_state(tmp_path / "straight")
    assert expected["global_step"] == 2 * STEPS_PER_EPOCH

    run(tmp_path / "first", *constant, "trainer.max_steps=2")  # stops one batch before epoch 0 ends
    checkpoint = read_checkpoint_file(last_checkpoint(tmp_path / "first"))
    assert checkpoint["global_step"] == 2 and checkpoint["DigitsDataModule"] == {"epoch": 0, "batches": 2}
    summary = run(tmp_path / "second", *constant, f"ckpt_path={last_checkpoint(tmp_path / 'first')}")
    assert summary["global_step"] == 2 * STEPS_PER_EPOCH and summary["epochs"] == 2
    assert_identical(final_state(tmp_path / "second"), expected)


def test_a_run_resumed_from_an_epochs_end_under_max_steps_trains_the_next_epoch(tmp_path: Path) -> None:
    """Under trainer.max_steps Lightning took an epoch-end checkpoint for a restart in the finished epoch and
    skipped the next one without a word (the resumed run trained no step). The two halves must be the run made
    in one go, bit for bit (no warmup, no milestone within the run: max_steps shapes no lr it uses)."""
    steps = ["schedule.warmup=0", "trainer.max_epochs=2", f"trainer.max_steps={2 * STEPS_PER_EPOCH}"]
    run(tmp_path / "straight", *steps)
    expected = final_state(tmp_path / "straight")
    run(tmp_path / "first", "schedule.warmup=0", "trainer.max_epochs=1")  # saved at epoch 0's end
    summary = run(tmp_path / "second", *steps, f"ckpt_path={last_checkpoint(tmp_path / 'first')}")
    assert summary["global_step"] == 2 * STEPS_PER_EPOCH and summary["epochs"] == 2
    assert_identical(final_state(tmp_path / "second"), expected)
    # The loggers' step too: the batches stepped, as the run made in one go counts them.
    stepped = [
        read_checkpoint_file(last_checkpoint(tmp_path / half))["loops"]["fit_loop"]["epoch_loop.state_dict"]
        for half in ("straight", "second")
    ]
    assert stepped[0] == stepped[1] == {"_batches_that_stepped": 2 * STEPS_PER_EPOCH}


def test_resuming_a_finished_run_is_refused_naming_the_limit_to_raise(tmp_path: Path) -> None:
    """A checkpoint of a run that reached trainer.max_epochs or max_steps would resume into a run that trains
    and validates nothing (its summary crashed on the missing val/acc): refused as the checkpoint is read,
    before any step, naming the limit to raise."""
    run(tmp_path / "first", "trainer.max_epochs=1")  # 3 steps, validated after the third
    last = last_checkpoint(tmp_path / "first")
    refusals = {
        (
            "trainer.max_epochs=1",
        ): "it trained 1 epoch(s), and trainer.max_epochs=1 ends the resumed run there, "
        "before any step; raise trainer.max_epochs to train on",
        (
            "trainer.max_epochs=2",
            "trainer.max_steps=3",
        ): "it reached step 3, and trainer.max_steps=3 ends the "
        "resumed run there, before any step; raise trainer.max_steps to train on",
    }
    for overrides, reason in refusals.items():
        with pytest.raises(ConfigError) as refused:
            run(tmp_path / "again", f"ckpt_path={last}", *overrides)
        assert str(refused.value) == f"ckpt_path={last} is of a finished run: {reason}"
        assert (
            not list((tmp_path / "again").rglob("*.ckpt"))
            and not (tmp_path / "again" / "metrics.json").exists()
        )


def test_a_resumed_run_that_validates_no_more_reports_the_runs_last_validation(
    tmp_path: Path, capsys
) -> None:
    """Resumed for one more epoch that is not validated, the fit logs no val/acc: the summary reports the
    run's last validation (the first half's), recorded in the checkpoint (it crashed formatting None)."""
    first = run(tmp_path / "first", "schedule.warmup=0", "trainer.max_epochs=1")
    last = last_checkpoint(tmp_path / "first")
    no_validation = ["schedule.warmup=0", "trainer.max_epochs=2", "trainer.check_val_every_n_epoch=3"]
    summary = run(tmp_path / "second", f"ckpt_path={last}", *no_validation)
    assert summary["global_step"] == 2 * STEPS_PER_EPOCH and "val/acc" not in summary["metrics"]
    assert summary["val/acc"] == summary["best_val/acc"] == first["val/acc"] is not None
    assert f" val_acc={first['val/acc']:.4f} " in capsys.readouterr().out.strip().splitlines()[-1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_datamodule_continues_at_its_saved_position(num_workers: int) -> None:
    def batches(datamodule: DigitsDataModule, epoch: int) -> list[torch.Tensor]:
        datamodule.setup()
        loader = datamodule.train_dataloader()
        loader.sampler.set_epoch(epoch)  # as Lightning does, after the loader exists
        return [targets for _, targets in loader]

    options = dict(batch_size=256, image_size=8, num_workers=num_workers)
    epoch_two = batches(DigitsDataModule(**options), 2)
    resumed = DigitsDataModule(**options)
    # Restored before the loader exists (as Lightning does); workers draw indices when the loader is
    # first iterated, so the position must already be in the sampler then.
    resumed.load_state_dict({"epoch": 2, "batches": 2})
    resumed.setup()
    loader = resumed.train_dataloader()
    assert loader.sampler.epoch == 2
    iterator = iter(loader)  # before set_epoch: what a worker prefetches must be from epoch 2 already
    loader.sampler.set_epoch(2)
    rest = [targets for _, targets in iterator]
    assert len(rest) == len(epoch_two) - 2
    for got, expected in zip(rest, epoch_two[2:]):
        assert torch.equal(got, expected)
    # Only the first pass is shortened; the next epoch is whole.
    loader.sampler.set_epoch(3)
    assert len([targets for _, targets in loader]) == len(epoch_two)
