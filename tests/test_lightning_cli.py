"""`python train.py` as users run it, and FusedSGD/FusedLARS by class name in LightningCLI."""

from __future__ import annotations

import inspect
import json
import time

import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning_helpers import UserModule, run_train_py

from lightning_fusedsgd import FusedLARS, FusedSGD
from runner.data import DigitsDataModule
from runner.model import ImageClassifier

pytestmark = pytest.mark.slow  # whole runs in subprocesses: make test runs them, make test-fast not

SHORT_RUN = [
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=2",
    "trainer.accelerator=cpu",
    "data.batch_size=16",
    "trainer.log_every_n_steps=1",
]


def test_train_py_writes_every_output_and_ends_with_the_summary(tmp_path):
    result = run_train_py([*SHORT_RUN, "trainer.gradient_clip_val=1.0", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("summary: name=quickstart val_acc=")
    # One fit, one summary: a second fit of the finished run would print a second one.
    assert [line for line in result.stdout.splitlines() if line.startswith("summary:")] == [last_line]
    assert "steps=6" in last_line

    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "checkpoints" / "best.ckpt").is_file()
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    header = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"step", "train/loss", "val/acc", "val/acc5"} <= set(header)
    assert any(column.startswith("lr-FusedSGD") for column in header)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 6 and metrics["epochs"] == 2 and metrics["skipped_steps"] == 0
    # Lightning's gradient_clip_val reached the fused step (it is saved with the optimizer's groups).
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert {group["max_grad_norm"] for group in saved["optimizer_states"][0]["param_groups"]} == {1.0}
    assert 0.0 <= metrics["val/acc"] <= 1.0
    assert metrics["last_checkpoint"].endswith("last.ckpt")
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    log = (tmp_path / "train.log").read_text()
    assert "configure_fused_sgd: SGD peak lr 0.0125 = base_lr 0.2 x 16/256" in log


def test_missing_data_fails_fast_with_one_clear_message(tmp_path):
    start = time.monotonic()
    result = run_train_py(["recipe=resnet50", "data.root=/nonexistent/imagenet", f"hydra.run.dir={tmp_path}"])
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    message = result.stderr.strip()
    assert message.startswith("error: recipe 'resnet50' needs ImageNet-style (ImageFolder) data")
    assert "/nonexistent/imagenet/train" in message
    assert "<root>/train/<class>/<image> and <root>/val/<class>/<image>" in message
    assert "python train.py recipe=resnet50 data=synthetic" in message
    assert elapsed < 60  # imports dominate; nothing is built before the check


def test_cfg_job_prints_the_composed_recipe():
    result = run_train_py(["recipe=resnet50_lars", "optim.base_lr=9.0", "--cfg", "job"])
    assert result.returncode == 0, result.stderr
    assert "lars: true" in result.stdout
    assert "base_lr: 9.0" in result.stdout
    assert "arch: resnet50" in result.stdout
    assert "decay: poly" in result.stdout


@pytest.mark.parametrize("class_path", ["lightning_fusedsgd.FusedLARS", "lightning_fusedsgd.optim.FusedLARS"])
def test_lightning_cli_takes_the_optimizer_by_class_name(class_path, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["train"])  # the CLI reads args=, not pytest's own arguments
    cli = LightningCLI(
        ImageClassifier,
        DigitsDataModule,
        args=[
            "fit",
            "--model.in_channels=1",
            "--data.batch_size=8",
            "--data.image_size=16",
            f"--optimizer={class_path}",
            "--optimizer.lr=0.05",
            "--optimizer.momentum=0.9",
            "--optimizer.weight_decay=1e-4",
            "--optimizer.trust_coefficient=0.002",
            "--trainer.accelerator=cpu",
            "--trainer.fast_dev_run=2",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        save_config_kwargs={"overwrite": True},
    )
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, FusedLARS)
    assert optimizer.param_groups[0]["lars"] is True and optimizer.param_groups[0]["lr"] == 0.05
    assert optimizer.defaults["trust_coefficient"] == 0.002
    assert cli.trainer.global_step == 2
    assert all(state["momentum_buffer"] is not None for state in optimizer.state.values())


def test_fused_lars_has_fused_sgds_signature_with_lars_on():
    """FusedLARS restates nothing: its signature, which LightningCLI and Hydra read, is FusedSGD's with one
    default changed."""
    sgd, lars = (inspect.signature(cls) for cls in (FusedSGD, FusedLARS))
    assert list(lars.parameters) == list(sgd.parameters)
    differing = [name for name in sgd.parameters if sgd.parameters[name] != lars.parameters[name]]
    assert differing == ["lars"] and lars.parameters["lars"].default is True


def _cli(args, tmp_path, monkeypatch):
    """LightningCLI over a user's module with no configure_optimizers, as `python main.py ARGS` runs it."""
    monkeypatch.setattr("sys.argv", ["main"])
    return LightningCLI(
        UserModule,
        args=[
            *args,
            "--trainer.accelerator=cpu",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
    )


OPTIMIZER = ["--optimizer.lr=0.5", "--optimizer.momentum=0.9", "--optimizer.weight_decay=1e-4"]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_cli_clips_inside_the_fused_step_under_mixed_precision(precision, tmp_path, monkeypatch):
    """The command a user types, with no code: `--optimizer FusedSGD` (the short name resolves once the
    package is imported), mixed precision and gradient_clip_val. It equals the same command with
    torch.optim.SGD, which Lightning clips itself (on the CPU, Lightning runs 16-mixed as bf16-mixed)."""
    runs = {}
    for optimizer in ("FusedSGD", "torch.optim.SGD"):
        cli = _cli(
            [
                "fit",
                f"--optimizer={optimizer}",
                *OPTIMIZER,
                f"--trainer.precision={precision}",
                "--trainer.gradient_clip_val=0.05",
                "--trainer.max_steps=3",
                "--trainer.enable_checkpointing=false",
            ],
            tmp_path / optimizer,
            monkeypatch,
        )
        assert cli.trainer.global_step == 3
        runs[optimizer] = cli.trainer.optimizers[0], [p.detach().clone() for p in cli.model.parameters()]
    fused, ours = runs["FusedSGD"]
    assert isinstance(fused, FusedSGD) and fused.param_groups[0]["max_grad_norm"] == 0.05
    for a, b in zip(ours, runs["torch.optim.SGD"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_cli_print_config_names_the_optimizer_with_torchs_arguments(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli(["fit", "--optimizer=FusedSGD", *OPTIMIZER, "--print_config"], tmp_path, monkeypatch)
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert "  class_path: lightning_fusedsgd.FusedSGD\n" in printed
    for line in ("lr: 0.5", "momentum: 0.9", "dampening: 0.0", "foreach: null", "differentiable: false"):
        assert f"    {line}\n" in printed, line
    # The printed config is one a run takes back.
    config = tmp_path / "config.yaml"
    config.write_text(printed)
    cli = _cli(["fit", f"--config={config}", "--trainer.max_steps=1"], tmp_path, monkeypatch)
    assert isinstance(cli.trainer.optimizers[0], FusedSGD) and cli.trainer.optimizers[0].defaults["lr"] == 0.5


def test_cli_resume_with_ckpt_path_keeps_momentum(tmp_path, monkeypatch):
    """fit for 2 epochs, or for 1 and then `fit --ckpt_path` to 2: the same weights and momentum buffers, bit
    for bit (the second run starts from the checkpoint's buffers, not from zero)."""
    common = [
        "--optimizer=lightning_fusedsgd.FusedSGD",
        *OPTIMIZER,
        "--trainer.gradient_clip_val=0.05",
        "--model.samples=32",  # 2 steps an epoch
    ]
    straight = _cli(["fit", *common, "--trainer.max_epochs=2"], tmp_path / "straight", monkeypatch)
    first = _cli(["fit", *common, "--trainer.max_epochs=1"], tmp_path / "first", monkeypatch)
    checkpoint = next((tmp_path / "first").rglob("*.ckpt"))
    resume = ["fit", *common, "--trainer.max_epochs=2", f"--ckpt_path={checkpoint}"]
    resumed = _cli(resume, tmp_path / "resumed", monkeypatch)
    assert first.trainer.global_step == 2 and resumed.trainer.global_step == straight.trainer.global_step == 4
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
        expected = straight.trainer.optimizers[0].state[a]["momentum_buffer"]
        assert torch.equal(resumed.trainer.optimizers[0].state[b]["momentum_buffer"], expected)


def test_timm_builds_fused_sgd_by_the_documented_name():
    """docs/guide/usage.md registers FusedSGD with timm as "lfsgd": create_optimizer_v2 builds it with timm's
    own grouping, and its steps give the bits of timm's "sgd" (torch.optim.SGD, Nesterov)."""
    from timm.optim import OptimInfo, create_optimizer_v2
    from timm.optim._optim_factory import default_registry

    info = OptimInfo("lfsgd", FusedSGD, "FusedSGD, Nesterov", has_momentum=True, defaults={"nesterov": True})
    default_registry.register(info)
    try:
        models = [UserModule().net for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        kwargs = dict(lr=0.1, weight_decay=1e-4, momentum=0.9)
        ours = create_optimizer_v2(models[0], opt="lfsgd", **kwargs)
        theirs = create_optimizer_v2(models[1], opt="sgd", foreach=False, **kwargs)
    finally:
        default_registry._optimizers.pop("lfsgd")
    assert isinstance(ours, FusedSGD) and [len(g["params"]) for g in ours.param_groups] == [4, 2]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
