"""Schedule-free SGD under Lightning with no user code: :class:`ScheduleFreeModes` switches every
FusedSGDScheduleFree of a Trainer between ``train()`` and ``eval()`` at the hooks where its parameters must
hold ``y`` (training steps) or their average ``x`` (validation, test, predict, checkpoints, the module after a
fit).

schedulefree's optimizers need those calls wherever the model is (its README: "the optimizer should also be
placed in eval mode when saving checkpoints"), and Lightning has no hook for them (Lightning #20441): users
write a LightningModule base class of their own. Every Trainer gets this callback through the package's
``lightning.pytorch.callbacks_factory`` entry point; with no FusedSGDScheduleFree it does nothing."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.seed import isolate_rng
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_fusedsgd.lightning._wrapped import fused_sgd_of
from lightning_fusedsgd.lightning.errors import ConfigError
from lightning_fusedsgd.optim import FusedSGDScheduleFree

__all__ = ["ScheduleFreeModes"]


class ScheduleFreeModes(pl.Callback):
    """Puts every FusedSGDScheduleFree of the Trainer in train mode for training, in eval mode otherwise.

    - train: when a fit starts, when training starts (after a resumed checkpoint's optimizer state is
      loaded), at each training epoch and batch;
    - eval: for validation, test and predict, when the fit ends (the module then holds ``x``, the weights to
      evaluate or export), and for a checkpoint (``trainer.save_checkpoint``: the checkpoint holds ``x`` and
      the optimizer in eval mode, as schedulefree asks).

    Between two training batches the optimizer switches to eval once, for whatever needs ``x`` there (a
    validation, the checkpoints written after it, at the batch's end or the epoch's), and back to train at
    the next batch: every checkpoint of that interval holds the ``x`` that was validated, and a fit resumed
    from any of them switches to train from the same ``x`` as the uninterrupted fit did, so it continues
    exactly. (The switch there and back rounds: a fit that writes checkpoints where it would not switch
    otherwise is not bit for bit one that does not.) A checkpoint written during a training batch (from
    ``training_step``) switches back at once.

    A checkpoint is written in eval mode by wrapping the Trainer's ``save_checkpoint`` for the fit (every
    writer calls it: ModelCheckpoint, OnExceptionCheckpoint, the SLURM requeue handler, a user), since
    Lightning calls no hook between writing a checkpoint and training on; the wrapper is removed at teardown.

    Args:
        bn_recalibration_batches: Before each validation inside a fit, recompute BatchNorm running
            statistics at ``x`` from this many training batches (0: off): BatchNorm's statistics were
            gathered at ``y``. Each batch goes through the strategy's ``batch_to_device`` and
            ``module(batch[0])`` (a tuple or list batch) or ``module(batch)``, as
            ``torch.optim.swa_utils.update_bn`` does, with running statistics reset and averaged over the
            batches; the global RNG and the loader's generators are left as they were, so the training data
            and augmentation do not change. With persistent workers, validate at the ends of epochs.

    Lightning's lr and batch size finders (``Tuner.lr_find``, ``Tuner.scale_batch_size``) run a trial fit with
    their own callback in place of the Trainer's: each runs with the optimizers in train mode, and leaves them
    in the mode it found them in.

    Of several instances in a Trainer (the entry point's and one passed in ``callbacks``), the first acts.
    """

    def __init__(self, bn_recalibration_batches: int = 0) -> None:
        if isinstance(bn_recalibration_batches, bool) or not (
            isinstance(bn_recalibration_batches, int) and bn_recalibration_batches >= 0
        ):
            raise ValueError(
                f"bn_recalibration_batches must be an int >= 0 (0: off), got {bn_recalibration_batches!r}"
            )
        self.bn_recalibration_batches = bn_recalibration_batches
        self.in_training_batch = False  # between on_train_batch_start and on_train_batch_end
        self.in_tuner_trial = False  # while one of Lightning's finders runs its trial fit

    def _optimizers(self, trainer: pl.Trainer) -> list[FusedSGDScheduleFree]:
        first = next(cb for cb in trainer.callbacks if isinstance(cb, ScheduleFreeModes))
        if first is not self:
            return []
        return [o for o in map(fused_sgd_of, trainer.optimizers) if isinstance(o, FusedSGDScheduleFree)]

    def _switch(self, trainer: pl.Trainer, train: bool) -> None:
        for optimizer in self._optimizers(trainer):
            optimizer.train() if train else optimizer.eval()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning's lr and batch size finders fit with their own callbacks in place of the Trainer's, so
        # nothing of ours switches there: each finder runs with the optimizers in train mode.
        for finder in trainer.callbacks:
            method = next((m for kind, m in _TUNER_TRIALS.items() if isinstance(finder, kind)), None)
            if method is not None and method not in vars(finder):
                setattr(finder, method, _in_train_mode(getattr(finder, method), self, trainer))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._optimizers(trainer) and "save_checkpoint" not in vars(trainer):
            trainer.save_checkpoint = _saved_in_eval_mode(trainer.save_checkpoint, self, trainer)
        # Before a resumed checkpoint's optimizer state is loaded, which torch.distributed.checkpoint does
        # through a step (of a fresh optimizer, with zero lrs) that eval mode would refuse.
        self._switch(trainer, train=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if getattr(vars(trainer).get("save_checkpoint"), "schedule_free_modes", None) is self:
            del trainer.save_checkpoint
        for finder in trainer.callbacks:
            for method in _TUNER_TRIALS.values():
                if getattr(vars(finder).get(method), "schedule_free_modes", None) is self:
                    delattr(finder, method)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._switch(trainer, train=True)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._switch(trainer, train=True)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._switch(trainer, train=True)  # after a validation or checkpoint since the last batch
        self.in_training_batch = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.in_training_batch = False

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._switch(trainer, train=False)
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        if fitting and self.bn_recalibration_batches and self._optimizers(trainer):
            self._recalibrate(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._switch(trainer, train=False)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._switch(trainer, train=False)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._switch(trainer, train=False)

    @torch.no_grad()
    def _recalibrate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """BatchNorm running statistics at ``x``: reset, then averaged over the first training batches."""
        norms = [m for m in pl_module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
        loader = trainer.train_dataloader
        if not norms or loader is None:
            return
        if (
            getattr(loader, "persistent_workers", False)
            and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        ):
            raise ConfigError(
                "bn_recalibration_batches draws batches from a new iterator of the training DataLoader, and "
                "a DataLoader with persistent workers has one iterator, which the running epoch holds: "
                "validate at the ends of epochs, or set persistent_workers=False"
            )
        momenta = [m.momentum for m in norms]
        was_training = pl_module.training
        # An iterator draws its order and seeds from the loader's generators, or the global RNG without them.
        generators = _generators(loader)
        states = [generator.get_state() for generator in generators]
        with isolate_rng():
            for m in norms:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average over the batches
            pl_module.train()
            for batch in itertools.islice(loader, self.bn_recalibration_batches):
                batch = trainer.strategy.batch_to_device(batch)
                pl_module(batch[0] if isinstance(batch, (list, tuple)) else batch)
        for generator, state in zip(generators, states):
            generator.set_state(state)
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        pl_module.train(was_training)


def _generators(loader: Any) -> list[torch.Generator]:
    """The torch generators a DataLoader's iterators draw from: its own, its sampler's, its batch sampler's
    sampler's (each once)."""
    holders = [
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ]
    generators = {
        id(g): g for h in holders if isinstance(g := getattr(h, "generator", None), torch.Generator)
    }
    return list(generators.values())


def _saved_in_eval_mode(save_checkpoint: Any, callback: ScheduleFreeModes, trainer: pl.Trainer) -> Any:
    """``trainer.save_checkpoint`` writing with every FusedSGDScheduleFree in eval mode; they stay there until
    the next training batch, unless the checkpoint is written during one."""

    @functools.wraps(save_checkpoint)
    def saved(*args: Any, **kwargs: Any) -> None:
        training = [o for o in callback._optimizers(trainer) if o.training]
        for optimizer in training:
            optimizer.eval()
        try:
            save_checkpoint(*args, **kwargs)
        finally:
            if callback.in_training_batch or callback.in_tuner_trial:
                for optimizer in training:
                    optimizer.train()

    saved.schedule_free_modes = callback  # type: ignore[attr-defined]
    return saved


# Lightning's finders and their methods that run a trial fit (with the finder's callbacks only) and then
# restore the checkpoint written before it.
_TUNER_TRIALS = {LearningRateFinder: "lr_find", BatchSizeFinder: "scale_batch_size"}


def _in_train_mode(trial: Any, callback: ScheduleFreeModes, trainer: pl.Trainer) -> Any:
    """A finder's trial run with every FusedSGDScheduleFree in train mode (a checkpoint it writes first is
    written in eval mode, as every checkpoint is); after it, each in the mode it was found in."""

    @functools.wraps(trial)
    def in_train_mode(*args: Any, **kwargs: Any) -> Any:
        optimizers = callback._optimizers(trainer)
        modes = [optimizer.training for optimizer in optimizers]
        for optimizer in optimizers:
            optimizer.train()
        callback.in_tuner_trial = True
        try:
            return trial(*args, **kwargs)
        finally:
            callback.in_tuner_trial = False
            for optimizer, training in zip(optimizers, modes):
                optimizer.train() if training else optimizer.eval()

    in_train_mode.schedule_free_modes = callback  # type: ignore[attr-defined]
    return in_train_mode
