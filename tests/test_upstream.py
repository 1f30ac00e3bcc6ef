"""PyTorch faults the project works around, each as a plain-torch repro (docs/upstream/), and the guard the
recipe runner puts in front of it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from lightning_helpers import compose_train, cpu_trainer, run_train_py

from lightning_fusedsgd.lightning import ConfigError
from runner.cpu_bf16 import check_cpu_bf16_convolutions, narrow_convolutions, onednn_runs_bf16_convolutions


def _wrong_weight_gradients() -> int:
    """The repro of docs/upstream/onednn-bf16-conv-backward.md: of 20 draws, how many weight gradients are
    wrong. Oracle: the taps that see only padding have a gradient of exactly 0, and the centre tap's is
    grad_out^T x."""
    wrong = 0
    for seed in range(20):
        torch.manual_seed(seed)
        x = torch.randn(16, 256, 1, 1).bfloat16().requires_grad_()
        w = (torch.randn(512, 256, 3, 3) * 0.05).bfloat16().requires_grad_()
        grad_out = (torch.randn(16, 512, 1, 1) * 1e-3).bfloat16()
        F.conv2d(x, w, stride=2, padding=1).backward(grad_out)
        expected = torch.zeros(512, 256, 3, 3)
        expected[:, :, 1, 1] = grad_out.float().flatten(1).T @ x.detach().float().flatten(1)
        wrong += bool(((w.grad.float() - expected).abs().nan_to_num(float("inf")) > 1e-2).any())
    return wrong


@pytest.mark.xfail(
    onednn_runs_bf16_convolutions(),
    reason="PyTorch 2.14's oneDNN bf16 conv2d backward on the CPU writes wrong weight gradients where the "
    "input is narrower than the stride (docs/upstream/onednn-bf16-conv-backward.md); passes without oneDNN",
    strict=False,
)
def test_bf16_conv_weight_gradient_where_the_input_is_narrower_than_the_stride():
    """Right where PyTorch keeps bf16 convolutions out of oneDNN (no AVX-512, or ``ONEDNN_MAX_CPU_ISA=AVX2``);
    an expected failure where oneDNN runs them."""
    assert _wrong_weight_gradients() == 0, "weight gradients wrong"


def _quickstart(tmp_path, image_size):
    cfg = compose_train(["debug=tiny", f"data.image_size={image_size}"], tmp_path)
    return instantiate(cfg.model, optimizer=None), cfg.data.in_channels


def test_narrow_convolutions_are_the_ones_of_small_images(tmp_path):
    """The quickstart's ResNet-18 on 8x8 images has 1x1 inputs at the first convolution of layer3 and layer4
    (stride 2, padding 1); on 32x32 images none is narrower than its stride. The model stays in train mode."""
    model, channels = _quickstart(tmp_path, 8)
    found = narrow_convolutions(model, torch.zeros(1, channels, 8, 8))
    assert found == [("net.layer3.0.conv1", (1, 1), 2), ("net.layer4.0.conv1", (1, 1), 2)]
    assert model.training
    assert narrow_convolutions(model, torch.zeros(1, channels, 32, 32)) == []


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed", "32-true"])
def test_the_runner_refuses_bf16_on_the_cpu_where_it_would_meet_the_fault(precision, tmp_path, monkeypatch):
    """On a CPU whose bf16 convolutions PyTorch hands to oneDNN (AVX-512; so told here, on any CPU)."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    model, channels = _quickstart(tmp_path, 8)
    trainer = cpu_trainer(precision=precision)
    if precision == "32-true":
        check_cpu_bf16_convolutions(trainer, model, channels, 8)  # fp32 convolutions are right
        return
    with pytest.raises(
        ConfigError, match=r"net.layer3.0.conv1 \(1x1 with stride 2\).*ONEDNN_MAX_CPU_ISA=AVX2"
    ):
        check_cpu_bf16_convolutions(trainer, model, channels, 8)
    check_cpu_bf16_convolutions(trainer, model, channels, 32)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN runs no bf16 convolution then
    check_cpu_bf16_convolutions(trainer, model, channels, 8)


def test_a_cpu_whose_bf16_convolutions_stay_out_of_onednn_is_not_refused(tmp_path, monkeypatch):
    """Without AVX-512, PyTorch keeps bf16 convolutions out of oneDNN (``_is_mkldnn_bf16_supported()`` is
    False), and its own kernels give 0 of 20 wrong gradients in the repro above: the guard lets such a run
    train."""
    model, channels = _quickstart(tmp_path, 8)
    trainer = cpu_trainer(precision="bf16-true")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    check_cpu_bf16_convolutions(trainer, model, channels, 8)


def test_without_onednn_the_repro_gives_right_gradients():
    """The oracle behind the guard's rule: the same repro, with oneDNN's kernels out of the way (as they are
    on a CPU where PyTorch does not hand bf16 convolutions to oneDNN), computes every gradient right."""
    with torch.backends.mkldnn.flags(enabled=False):
        assert _wrong_weight_gradients() == 0


def test_on_this_cpu_the_guard_refuses_wherever_the_fault_occurs(tmp_path):
    """This machine's own answer, against the repro: where its bf16 convolutions give wrong gradients, the
    runner refuses; where it lets bf16 through, they are right."""
    model, channels = _quickstart(tmp_path, 8)
    trainer = cpu_trainer(precision="bf16-true")
    try:
        check_cpu_bf16_convolutions(trainer, model, channels, 8)
    except ConfigError:
        return  # refused: wherever oneDNN runs bf16 convolutions, which is where the fault can occur
    assert _wrong_weight_gradients() == 0


@pytest.mark.slow
# oneDNN held to AVX2 trains 3 epochs of bf16 convolutions, which a CPU without native bf16 runs slowly:
# with the heavy tests (an AVX2 machine's this-cpu run trains so in make test).
@pytest.mark.parametrize(
    "isa", [None, pytest.param("AVX2", marks=pytest.mark.heavy)], ids=["this-cpu", "onednn-at-avx2"]
)
def test_the_reported_command_stops_with_the_fix_before_training_where_the_fault_is(isa, tmp_path):
    """The command of the report: refused with the fix where oneDNN would run its bf16 convolutions (this CPU
    with AVX-512), trained where it would not (no AVX-512, or the fix the refusal names)."""
    env = {"ONEDNN_MAX_CPU_ISA": isa} if isa else {}
    result = run_train_py(
        [
            "recipe=quickstart",
            "debug=tiny",
            "trainer.precision=bf16-true",
            "optim.update_rounding=kahan",
            "data.image_size=8",
            "trainer.limit_train_batches=1",
            "trainer.max_epochs=3",
            f"hydra.run.dir={tmp_path}",
        ],
        env=env,
    )
    isa_in_effect = isa or os.environ.get("ONEDNN_MAX_CPU_ISA")
    if not (torch.ops.mkldnn._is_mkldnn_bf16_supported() and not isa_in_effect):
        assert result.returncode == 0, result.stderr[-2000:]
        assert (tmp_path / "checkpoints").exists()
        return
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith(
        "error: trainer.precision=bf16-true on the CPU would train into garbage"
    )
    assert not (tmp_path / "checkpoints").exists()
