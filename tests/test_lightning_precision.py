"""FusedSGD under Lightning's precision plugins on CPU.

bf16-mixed, bf16-true with master weights, 16-mixed with a GradScaler, and gradient clipping.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning_helpers import ClippingTinyClassifier, TinyClassifier, cpu_trainer

from lightning_fusedsgd.lightning import Schedule

CONSTANT = Schedule(decay="constant")


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in module.parameters()]


def test_bf16_mixed_trains_fp32_weights():
    torch.manual_seed(0)
    module = TinyClassifier(schedule=CONSTANT, lr=1.0)
    before = _params(module)
    trainer = cpu_trainer(max_steps=3, precision="bf16-mixed")
    trainer.fit(module)
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, _params(module)) if a.numel() > 8)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    optimizer = trainer.optimizers[0]
    assert not optimizer.param_groups[0]["master_weights"]


def test_bf16_true_uses_fp32_master_weights():
    torch.manual_seed(0)
    module = TinyClassifier(schedule=CONSTANT, lr=1.0)
    trainer = cpu_trainer(max_steps=3, precision="bf16-true")
    trainer.fit(module)
    optimizer = trainer.optimizers[0]
    assert all(group["master_weights"] for group in optimizer.param_groups)  # turned on by the factory
    for param in module.parameters():
        assert param.dtype == torch.bfloat16
        state = optimizer.state[param]
        assert state["master_param"].dtype == torch.float32
        assert state["momentum_buffer"].dtype == torch.float32
        # The bf16 weight is the rounded master; the master holds updates bf16 would lose.
        assert torch.equal(param, state["master_param"].to(torch.bfloat16))


def _fp16_trainer(**kwargs):
    # Trainer(precision="16-mixed") on CPU is switched to bf16-mixed by Lightning; the plugin keeps
    # float16 autocast and its GradScaler, so FusedSGD's in-kernel unscaling is exercised.
    return cpu_trainer(max_steps=4, plugins=[MixedPrecision("16-mixed", "cpu")], **kwargs)


def test_16_mixed_grad_scaler_steps_through_the_kernel():
    torch.manual_seed(0)
    module = TinyClassifier(schedule=CONSTANT, lr=1.0)
    before = _params(module)
    trainer = _fp16_trainer()
    trainer.fit(module)
    scaler = trainer.precision_plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() > 1
    assert trainer.global_step == 4
    assert all(not torch.equal(a, b) for a, b in zip(before, _params(module)) if a.numel() > 8)


def test_lightning_refuses_clipping_for_self_unscaling_optimizers():
    # Documents Lightning 2.x behaviour, which is why clip_gradients exists.
    module = TinyClassifier(schedule=CONSTANT)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fp16_trainer(gradient_clip_val=1.0).fit(module)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_clip_gradients_works_under_mixed_precision(precision):
    plugins = [MixedPrecision(precision, "cpu")]
    torch.manual_seed(0)
    clipped = ClippingTinyClassifier(schedule=CONSTANT, lr=1.0)
    cpu_trainer(max_steps=4, plugins=plugins, gradient_clip_val=0.05).fit(clipped)
    assert len(clipped.clipped_norms) == 4
    assert max(clipped.clipped_norms) <= 0.05 * (1 + 1e-3)  # unscaled norms, clipped


def test_unscale_then_clip_matches_in_kernel_unscaling():
    # A threshold no gradient reaches: unscaling before the step (clip path) must give the same
    # weights as letting the kernel unscale, so nothing is unscaled twice or skipped.
    torch.manual_seed(0)
    reference = TinyClassifier(schedule=CONSTANT, lr=1.0)
    initial = _params(reference)
    torch.manual_seed(0)
    clipped = ClippingTinyClassifier(schedule=CONSTANT, lr=1.0)
    _fp16_trainer().fit(reference)
    _fp16_trainer(gradient_clip_val=1e6).fit(clipped)
    assert not torch.equal(initial[0], _params(reference)[0])  # steps were taken, not all skipped
    for a, b in zip(_params(reference), _params(clipped)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
