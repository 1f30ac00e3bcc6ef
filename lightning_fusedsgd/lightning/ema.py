"""A drop-in for Lightning's ``EMAWeightAveraging`` whose average of the params is kept in FusedSGD's step.

Lightning's callback keeps a copy of the module (``AveragedModel``) and, after each optimizer step its
schedule names, reads every weight again to update the copy: 36 bytes a parameter and a loop over tensors.
With a FusedSGD, :class:`EMAWeightAveraging` sets the same schedule on the optimizer's groups (``ema_decay``,
``ema_every``, ``ema_start``) and the kernel updates each param's average while its new weight is in
registers (8 bytes a parameter); the callback averages only what no FusedSGD steps (the buffers where
``use_buffers``, frozen params), with the same function, and without ``use_buffers`` keeps the buffers as
they were at the last update, as ``AveragedModel`` does. Validation runs on the averages, swapped into the
module and back; training ends with them in the module; checkpoints carry Lightning's keys (``state_dict`` the
averaged model, ``current_model_state``, ``averaging_state``), so either callback resumes the other's. With
another optimizer, a FusedSGDScheduleFree included (its step keeps no average of the weights), it is
Lightning's callback."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging as LightningEMAWeightAveraging
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from lightning_fusedsgd import _abi, _checks
from lightning_fusedsgd.lightning._wrapped import fused_sgd_of
from lightning_fusedsgd.optim import FusedSGD, FusedSGDScheduleFree, _average

__all__ = ["EMAWeightAveraging"]

# What Lightning's AveragedModel keeps beside the module, in a checkpoint's "averaging_state".
_COUNT = "n_averaged"


class EMAWeightAveraging(LightningEMAWeightAveraging):
    """Lightning's ``EMAWeightAveraging`` (same arguments, schedule, hooks and checkpoint keys), its average
    of the params updated inside FusedSGD's step where every optimizer is a FusedSGD.

    Args:
        device: As Lightning's: where the averaged model lives, for another optimizer (FusedSGD keeps each
            average beside its param).
        use_buffers: Average the buffers too (BatchNorm statistics), as Lightning does; else the averaged
            model's buffers are the module's as of the last update.
        decay: The decay of the average, in [0, 1).
        update_every_n_steps: Update at every n-th optimizer step; 0 for none (Lightning's callback then runs
            as it is: there is nothing to fuse).
        update_starting_at_step: The first step (0-based) that updates the average, which copies the weights.
        update_starting_at_epoch: Update at the end of every epoch from this one on, too.
        kwargs: Passed to Lightning's callback (``AveragedModel``), for another optimizer.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        **kwargs: Any,
    ) -> None:
        _checks.check_flag("use_buffers", use_buffers)
        problem = _abi.option("ema_decay").check(decay) if decay is not None else "It must be a number."
        if problem is not None:
            raise ValueError(
                f"EMAWeightAveraging(decay={decay!r}): {problem} A decay of 1 keeps the first copy of the "
                "weights for ever; 0.999 is the usual choice."
            )
        super().__init__(
            device=device,
            use_buffers=use_buffers,
            decay=decay,
            update_every_n_steps=update_every_n_steps,
            update_starting_at_step=update_starting_at_step,
            update_starting_at_epoch=update_starting_at_epoch,
            **kwargs,
        )
        self._decay = decay
        self._optimizers: list[FusedSGD] = []  # fused mode: the FusedSGDs that keep the params' averages
        self._others: list[tuple[Tensor, Tensor]] = []  # (tensor, its average) this callback keeps
        # Without use_buffers: (buffer, its value at the last update), as AveragedModel keeps its buffers.
        self._copies: list[tuple[Tensor, Tensor]] = []
        self._count = 0  # updates of the average (AveragedModel's n_averaged)
        self._stash: dict[str, Any] | None = None  # a checkpoint's average, until the state it goes in exists
        self._swapped: _average.Swapped = []  # during validation: the averages swapped into the module
        self._module: pl.LightningModule | None = None

    @property
    def fused(self) -> bool:
        return bool(self._optimizers)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Lightning's callback calls ``configure_model()`` here, before the optimizers exist, and copies the
        module; this one calls it here too (a module that builds its layers there builds them in Lightning's
        order, before the optimizer takes their params) and waits for the optimizers (on_fit_start)."""
        if stage == "fit" and is_overridden("configure_model", pl_module):
            rank_zero_warn(
                "EMAWeightAveraging calls configure_model() before the strategy does, as Lightning's "
                "WeightAveraging does: the layers it builds are not sharded then; you may run out of memory."
            )
            pl_module.configure_model()

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Puts the training weights back into the module (a checkpoint's ``state_dict`` is the averaged
        model) and keeps the average until the state it goes into exists."""
        if "current_model_state" in checkpoint and "averaging_state" in checkpoint:
            rank_zero_info(
                "Found current_model_state in the checkpoint. This will be used to initialize the model."
            )
            pl_module.load_state_dict(checkpoint["current_model_state"])
            self._stash = {"average": checkpoint["state_dict"], "averaging": checkpoint["averaging_state"]}
        else:
            rank_zero_warn(
                "The checkpoint was not created with WeightAveraging. Both the current and the average model "
                "will be initialized with state_dict."
            )
            self._stash = {"average": checkpoint["state_dict"], "averaging": None}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._module = pl_module
        optimizers = [fused_sgd_of(o) for o in trainer.optimizers]
        if (
            not optimizers
            or None in optimizers
            or any(isinstance(o, FusedSGDScheduleFree) for o in optimizers)
            or self.update_every_n_steps <= 0
        ):
            # Another optimizer (schedule-free's keeps no average in its step): Lightning's callback, whose
            # setup copies the module (configure_model() ran in setup).
            device = self._device or pl_module.device
            self._average_model = AveragedModel(
                model=pl_module, device=device, use_buffers=self._use_buffers, **self._kwargs
            )
            if self._stash is not None:
                self._lightning_load(pl_module)
            return
        self._optimizers = optimizers
        stepped = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
        others = [p for p in pl_module.parameters() if id(p) not in stepped]
        buffers = [(t, t.detach().clone()) for t in pl_module.buffers()]
        self._others = [(t, t.detach().clone()) for t in others] + (buffers if self._use_buffers else [])
        self._copies = [] if self._use_buffers else buffers
        self._set_schedule()

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restored(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restored(trainer, pl_module)

    def _restored(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once the optimizers' state is restored (before the first validation or step): the schedule on their
        groups again (a loaded state dict brings its own groups), and a checkpoint's average where the state
        has none."""
        if not self.fused:
            return
        self._set_schedule()
        if self._stash is not None:
            self._restore(trainer, pl_module)
            self._stash = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.fused:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step_idx = trainer.global_step - 1
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            self._update_others()  # the params' averages were updated in the step
            self._count += 1
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.fused:
            return super().on_train_epoch_end(trainer, pl_module)
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            for optimizer in self._optimizers:
                optimizer.update_average()
            self._update_others()
            self._count += 1
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.fused:
            return super().on_train_end(trainer, pl_module)
        with torch.no_grad():
            for param, average in self._param_averages():
                param.copy_(average)
            for tensor, average in self._kept():
                tensor.copy_(average)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.fused:
            return super().on_validation_epoch_start(trainer, pl_module)
        self._swapped = _average.swap(self._param_averages() + self._kept())

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.fused:
            return super().on_validation_epoch_end(trainer, pl_module)
        _average.unswap(self._swapped)
        self._swapped = []

    @contextlib.contextmanager
    def training_weights(self) -> Iterator[None]:
        """During validation (the averages in the module): the training weights back in the module for the
        context, e.g. to validate them too."""
        if not self.fused:
            self._swap_models(self._module)
            try:
                yield
            finally:
                self._swap_models(self._module)
            return
        swapped, self._swapped = self._swapped, []
        _average.unswap(swapped)
        try:
            yield
        finally:
            self._swapped = _average.swap([(param, average) for param, average, _ in swapped])

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self.fused:
            return super().on_save_checkpoint(trainer, pl_module, checkpoint)
        averages = {id(t): a for t, a in itertools.chain(self._param_averages(), self._kept())}
        tensors = dict(itertools.chain(pl_module.named_parameters(), pl_module.named_buffers()))
        checkpoint["current_model_state"] = checkpoint["state_dict"]
        checkpoint["state_dict"] = {
            name: averages[id(tensors[name])].to(value.dtype, copy=True)
            if id(tensors.get(name)) in averages
            else value
            for name, value in checkpoint["current_model_state"].items()
        }
        device = next(iter(checkpoint["state_dict"].values())).device
        checkpoint["averaging_state"] = {_COUNT: torch.tensor(self._count, dtype=torch.long, device=device)}

    def _kept(self) -> list[tuple[Tensor, Tensor]]:
        """What this callback keeps beside the params' averages: (tensor, its value in the averaged model)."""
        return self._others + self._copies

    def _set_schedule(self) -> None:
        """The callback's schedule on every group of the FusedSGDs (the kernel applies it). A negative start
        is Lightning's first step (its schedule compares step >= start)."""
        schedule = dict(
            ema_decay=self._decay,
            ema_every=self.update_every_n_steps,
            ema_start=max(self.update_starting_at_step or 0, 0),
            ema_warmup_gamma=None,
        )
        names = {id(p): name for name, p in self._module.named_parameters()} if self._module else {}
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                try:
                    _average.check_averaged(
                        self._decay, [(f"parameter {names.get(id(p), '?')!r}", p) for p in group["params"]]
                    )
                except ValueError as error:
                    raise ValueError(
                        f"EMAWeightAveraging keeps the average in FusedSGD's step, which averages dense real "
                        f"params only: {error} Or use lightning.pytorch.callbacks.EMAWeightAveraging, which "
                        "keeps it outside the step."
                    ) from None
                if group.get("ema_decay") not in (None, self._decay):
                    rank_zero_info(
                        f"EMAWeightAveraging: decay {self._decay} replaces the optimizer's ema_decay "
                        f"{group['ema_decay']} (the callback's schedule applies)."
                    )
                group.update(schedule)

    def _param_averages(self) -> list[tuple[Tensor, Tensor]]:
        return [pair for optimizer in self._optimizers for pair in optimizer.averaged_params()]

    def _update_others(self) -> None:
        """What no FusedSGD steps, averaged as Lightning's AveragedModel averages it (get_ema_avg_fn; the
        first update copies), and the buffers it keeps in sync (without use_buffers)."""
        update = get_ema_avg_fn(self._decay)
        with torch.no_grad():
            for tensor, average in self._others:
                average.copy_(tensor if self._count == 0 else update(average, tensor, self._count))
            for tensor, copy in self._copies:
                copy.copy_(tensor)

    def _restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A checkpoint's average into the state: the params' where a loaded optimizer state has none (a
        checkpoint of Lightning's callback), counted from the run's step; the rest into the callback's."""
        average = self._stash["average"]
        averaging = self._stash["averaging"]
        self._count = int(averaging[_COUNT]) if averaging is not None else 0
        tensors = dict(itertools.chain(pl_module.named_parameters(), pl_module.named_buffers()))
        by_id = {id(t): name for name, t in tensors.items()}
        averages = {tensor: average[name] for name, tensor in tensors.items() if name in average}
        missing = sum(o.seed_averages(averages, trainer.global_step, self._count) for o in self._optimizers)
        if missing:
            rank_zero_info(
                f"EMAWeightAveraging: {missing} params take their average from the checkpoint's state_dict "
                "(the optimizer state it carries keeps none)."
            )
        with torch.no_grad():
            for tensor, kept in self._kept():
                name = by_id.get(id(tensor))
                if name in average:
                    kept.copy_(average[name])

    def _lightning_load(self, pl_module: pl.LightningModule) -> None:
        """A checkpoint's average into Lightning's AveragedModel, as its on_load_checkpoint would have."""
        checkpoint = {"state_dict": self._stash["average"]}
        if self._stash["averaging"] is not None:
            checkpoint |= {
                "current_model_state": pl_module.state_dict(),
                "averaging_state": self._stash["averaging"],
            }
        super().on_load_checkpoint(None, pl_module, checkpoint)
        self._stash = None
