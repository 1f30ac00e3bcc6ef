"""Who clips when the Trainer and the optimizer both may: ``Trainer(gradient_clip_val=...)`` against a
FusedSGD built with clipping of its own (clipping.clip_gradients' rule), each run against torch.optim.SGD
clipped by Lightning itself."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import TinyClassifier, cpu_trainer

from lightning_fusedsgd import FusedSGD, param_groups
from lightning_fusedsgd.lightning import ConfigError

CLIP = 0.05  # clips every step of these runs


class OwnClipping(TinyClassifier):
    """A module that builds FusedSGD with its own ``max_grad_norm`` (and no clipping hook: the ClipInTheStep
    callback binds clip_gradients)."""

    def configure_optimizers(self):
        kwargs = self.factory_kwargs
        groups = param_groups(self, 1e-4)
        return FusedSGD(groups, lr=kwargs["lr"], momentum=0.9, max_grad_norm=kwargs.get("max_grad_norm"))


class TorchSGD(TinyClassifier):
    """The same module with torch.optim.SGD on the same groups: Lightning clips it itself."""

    def configure_optimizers(self):
        return torch.optim.SGD(param_groups(self, 1e-4), lr=self.factory_kwargs["lr"], momentum=0.9)


def _fit(module, steps=4, **trainer_kwargs):
    trainer = cpu_trainer(max_steps=steps, **trainer_kwargs)
    trainer.fit(module)
    return trainer


def _weights(module):
    return [p.detach().clone() for p in module.parameters()]


def _torch_clipped(clip):
    torch.manual_seed(0)
    module = TorchSGD(lr=0.5)
    _fit(module, gradient_clip_val=clip)
    return _weights(module)


@pytest.mark.parametrize("trainer_clip", [0, None, 0.0])
def test_a_trainer_that_does_not_clip_keeps_the_optimizers_own_max_grad_norm(trainer_clip):
    """gradient_clip_val 0 is Lightning's "do not clip", as common in configs as None: the optimizer's own
    max_grad_norm still clips, as torch.optim.SGD clipped by Lightning at that threshold."""
    torch.manual_seed(0)
    module = OwnClipping(lr=0.5, max_grad_norm=CLIP)
    trainer = _fit(module, gradient_clip_val=trainer_clip)
    assert all(group["max_grad_norm"] == CLIP for group in trainer.optimizers[0].param_groups)
    for ours, theirs in zip(_weights(module), _torch_clipped(CLIP)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_optimizers_own_max_grad_norm_changes_the_run():
    """The oracle above clips: unclipped, the weights differ."""
    assert not all(
        torch.allclose(a, b, 1e-3, 1e-4) for a, b in zip(_torch_clipped(CLIP), _torch_clipped(None))
    )


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_a_trainer_threshold_that_disagrees_with_the_optimizers_own_is_refused_before_the_step(algorithm):
    torch.manual_seed(0)
    module = OwnClipping(lr=0.5, max_grad_norm=1.0)
    before = _weights(module)
    with pytest.raises(ConfigError, match=r"gradient_clip_val=0.5.*max_grad_norm=1.0\) disagree: set one"):
        _fit(module, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(module)))


def test_a_trainer_threshold_equal_to_the_optimizers_own_clips_once():
    torch.manual_seed(0)
    module = OwnClipping(lr=0.5, max_grad_norm=CLIP)
    _fit(module, gradient_clip_val=CLIP)
    for ours, theirs in zip(_weights(module), _torch_clipped(CLIP)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_trainer_that_stops_clipping_takes_back_the_threshold_it_handed_over():
    """A Trainer whose gradient_clip_val goes to 0 mid-run (a callback's doing): the optimizer, which had no
    clipping of its own, stops clipping; one of its own would stay (the test above)."""

    class StopClipping(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                trainer.gradient_clip_val = 0

    torch.manual_seed(0)
    module = OwnClipping(lr=0.5)
    trainer = _fit(module, gradient_clip_val=CLIP, callbacks=[StopClipping()])
    assert all(group["max_grad_norm"] is None for group in trainer.optimizers[0].param_groups)


@pytest.mark.parametrize("resumed_clip", [None, 0.1])
def test_a_resumed_fit_tells_the_trainers_threshold_from_the_optimizers_own(resumed_clip, tmp_path):
    """The checkpoint's optimizer groups hold the threshold the Trainer handed over, which ClipInTheStep's
    state marks as the Trainer's: resumed with gradient_clip_val=None the fit stops clipping, with another
    value it clips by that one, as a fit that never stopped would."""
    torch.manual_seed(0)
    module = OwnClipping(lr=0.5)
    trainer = _fit(
        module, steps=2, gradient_clip_val=CLIP, enable_checkpointing=True, default_root_dir=tmp_path
    )
    assert trainer.optimizers[0].param_groups[0]["max_grad_norm"] == CLIP
    checkpoint = next(tmp_path.rglob("*.ckpt"))
    resumed = cpu_trainer(max_steps=4, gradient_clip_val=resumed_clip)
    resumed.fit(OwnClipping(lr=0.5), ckpt_path=checkpoint)
    assert all(group["max_grad_norm"] == resumed_clip for group in resumed.optimizers[0].param_groups)
