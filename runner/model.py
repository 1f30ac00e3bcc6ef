"""The image-classification LightningModule used by ``train.py``: a torchvision ResNet by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchvision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.types import LRSchedulerTypeUnion
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_fusedsgd.lightning import ConfigError, EMAWeightAveraging, configure_fused_sgd
from runner.options import check_flags

__all__ = ["ImageClassifier", "build_resnet"]

OptimizerFactory = Callable[[pl.LightningModule], Any]


def build_resnet(
    arch: str,
    num_classes: int,
    *,
    in_channels: int = 3,
    small_input: bool = False,
    zero_init_residual: bool = False,
) -> nn.Module:
    """A torchvision ResNet (``resnet18`` ... ``resnet152``, ``resnext*``, ``wide_resnet*``), untrained.

    Args:
        arch: torchvision model name.
        num_classes: Output classes.
        in_channels: Input channels (the stem is rebuilt when not 3).
        small_input: CIFAR-style stem for 32x32 images: 3x3 stride-1 first conv and no max-pool.
        zero_init_residual: Zero the last BatchNorm gamma of every residual block, so each block
            starts as the identity (Goyal et al. 2017, section 5.1).

    Raises:
        ConfigError: If ``arch`` is not a torchvision ResNet.
    """
    resnets = sorted(
        name
        for name in torchvision.models.list_models(torchvision.models)
        if name.startswith(("resnet", "resnext", "wide_resnet"))
    )
    if arch not in resnets:
        raise ConfigError(
            f"model.arch={arch!r} is not a torchvision ResNet; choose one of {', '.join(resnets)}"
        )
    net = torchvision.models.get_model(
        arch, weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual
    )
    if small_input or in_channels != 3:
        kernel, stride, padding = (3, 1, 1) if small_input else (7, 2, 3)
        net.conv1 = nn.Conv2d(in_channels, net.conv1.out_channels, kernel, stride, padding, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision
    if small_input:
        net.maxpool = nn.Identity()
    return net


class ImageClassifier(pl.LightningModule):
    """Cross-entropy classification with top-1/top-5 accuracy and the FusedSGD factory.

    Logs ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc`` and ``val/acc5``.

    Args:
        arch: torchvision ResNet name (see :func:`build_resnet`).
        num_classes: Output classes.
        in_channels: Input image channels.
        small_input: CIFAR-style stem (see :func:`build_resnet`).
        zero_init_residual: Zero-init each block's last BatchNorm gamma.
        label_smoothing: Label smoothing of the training loss (validation loss uses none).
        channels_last: Keep weights and inputs in channels-last memory format (faster convolutions
            under mixed precision on recent GPUs, NVIDIA's advice for Tensor Cores); ``"auto"``: where
            training runs on a GPU (the CPU's convolutions keep the contiguous format they ran in before).
        compile: Compile the network with ``torch.compile`` (in place: the state dict keeps its names).
        optimizer: ``module -> configure_optimizers() result``, typically
            ``functools.partial(configure_fused_sgd, lr=..., ...)`` (a Hydra ``_partial_`` node);
            ``None`` uses :func:`configure_fused_sgd`'s defaults.
    """

    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 10,
        in_channels: int = 3,
        small_input: bool = False,
        zero_init_residual: bool = False,
        label_smoothing: float = 0.0,
        channels_last: bool | str = False,
        compile: bool = False,
        optimizer: OptimizerFactory | None = None,
    ) -> None:
        super().__init__()
        check_flags("model", small_input=small_input, zero_init_residual=zero_init_residual, compile=compile)
        if channels_last not in (True, False, "auto"):
            raise ConfigError(f"model.channels_last={channels_last!r}: choose true, false or auto")
        # The optimizer factory is code, not a hyperparameter. The loggers get the resolved config, whose
        # model node these are (runner.loggers.log_config), not a second copy.
        self.save_hyperparameters(ignore=["optimizer"], logger=False)
        self.net = build_resnet(
            arch,
            num_classes,
            in_channels=in_channels,
            small_input=small_input,
            zero_init_residual=zero_init_residual,
        )
        self.channels_last = channels_last
        self.compile_net = compile  # not self.compile: nn.Module.compile is a method
        self.memory_format = torch.contiguous_format  # setup() decides, once the device is known
        self.label_smoothing = label_smoothing
        self.optimizer_factory = optimizer
        self._step_skipped = False  # the last training batch was empty and stepped nothing
        # Validation's metrics, each rank's batches gathered (a rank may score no image: see
        # on_validation_epoch_end), and this rank's images scored in the pass.
        self._scored_images = 0
        self.val_loss = MeanMetric()
        self.val_acc = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")
        self.val_loss_raw = MeanMetric()
        self.val_acc_raw = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        # The average of the weights (train.py's ema), whose validation runs on the averages: the training
        # weights are validated too, swapped in for the batch.
        self.average: EMAWeightAveraging | None = None

    def setup(self, stage: str) -> None:
        on_gpu = self.trainer.strategy.root_device.type == "cuda"
        if self.channels_last is True or (self.channels_last == "auto" and on_gpu):
            self.memory_format = torch.channels_last
            self.net.to(memory_format=self.memory_format)  # before the optimizer holds the params
        if self.compile_net:
            self.net.compile()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images.contiguous(memory_format=self.memory_format))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        images, targets = batch
        self._step_skipped = not len(targets) and self._skips_empty_steps()
        if not len(targets):  # every file of the batch unreadable (data.skip_unreadable): nothing to learn
            return None if self._step_skipped else self(images).sum()  # zero gradients
        logits = self(images)
        loss = F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(dim=1) == targets).float().mean())
        return loss

    def _skips_empty_steps(self) -> bool:
        """Whether a batch left with no image skips its optimizer step (``training_step`` returns None, and
        Lightning steps no gradient): on one device, without gradient accumulation. Under DDP every rank must
        reduce its gradients; with accumulation the gradients of the window's other batches must still be
        applied (under a GradScaler Lightning skips the whole step after a None); DeepSpeed refuses None.
        There the empty batch's gradients are zero, and its step is taken."""
        trainer = self.trainer
        return (
            trainer.world_size == 1
            and trainer.accumulate_grad_batches == 1
            and not isinstance(trainer.strategy, DeepSpeedStrategy)
        )

    def lr_scheduler_step(self, scheduler: LRSchedulerTypeUnion, metric: Any | None) -> None:
        """Steps a per-step lr scheduler after each optimizer step taken, not after one an empty batch skipped
        (Lightning steps it after every batch): the schedule's position counts the steps taken, so warmup and
        milestones are not used up by steps that never happened."""
        if self._step_skipped and self._is_per_step(scheduler):
            return
        super().lr_scheduler_step(scheduler, metric)

    def _is_per_step(self, scheduler: LRSchedulerTypeUnion) -> bool:
        return any(
            config.scheduler is scheduler and config.interval == "step"
            for config in self.trainer.lr_scheduler_configs
        )

    def on_validation_epoch_start(self) -> None:
        self._scored_images = 0

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, targets = batch
        if not len(targets):  # every file of the batch was unreadable: nothing to score
            return
        logits = self(images)
        self._scored_images += len(targets)
        self.val_loss.update(F.cross_entropy(logits, targets), weight=len(targets))
        self.val_acc.update(logits, targets)
        self.val_acc5.update(logits, targets)
        if self._validates_training_weights():
            with self.average.training_weights():
                raw = self(images)
            self.val_loss_raw.update(F.cross_entropy(raw, targets), weight=len(targets))
            self.val_acc_raw.update(raw, targets)

    def on_validation_epoch_end(self) -> None:
        """Logs the pass's metrics, every rank's images together, where it scored an image.

        The metrics are logged here, not per batch: a rank whose every batch was empty would log nothing, and
        the ranks' reductions of what they logged would no longer pair up (a hang under DDP).

        Raises:
            ConfigError: the pass scored no image (every file it read unreadable, left out under
                ``data.skip_unreadable``): nothing can be validated or monitored. Raised by the sanity check
                where it read the whole pass, before any training.
        """
        # Every rank's count: each rank reduces it, whatever it scored.
        scored = self.trainer.strategy.reduce(
            torch.tensor(self._scored_images, device=self.device), reduce_op="sum"
        )
        if not scored:
            sanity_checking = self.trainer.sanity_checking
            if not sanity_checking or self.trainer.num_sanity_val_batches == self.trainer.num_val_batches:
                raise ConfigError(_nothing_scored(self.trainer))
            return
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)
        self.log("val/acc5", self.val_acc5)
        if self._validates_training_weights():
            self.log("val/loss_raw", self.val_loss_raw)
            self.log("val/acc_raw", self.val_acc_raw)

    def _validates_training_weights(self) -> bool:
        """Whether validation scores the training weights too (beside their average; not in the sanity
        check, before any step)."""
        return self.average is not None and not self.trainer.sanity_checking

    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            return configure_fused_sgd(self)
        return self.optimizer_factory(self)


def _nothing_scored(trainer: pl.Trainer) -> str:
    """Why a validation pass scored no image, and the fix: the image folder's unreadable validation files
    (this rank's), or, for data that records none, its empty batches."""
    unreadable_in = getattr(trainer.datamodule, "unreadable_in", None)
    files = unreadable_in("val") if unreadable_in is not None else {}
    limit = trainer.limit_val_batches
    more = (
        ", or let it read more files (trainer.limit_val_batches; it reads "
        f"{trainer.num_val_batches[0]} batch(es) now)"
        if not (isinstance(limit, float) and limit == 1.0)
        else ""
    )
    if not files:
        return f"validation scored no image: every batch it read was empty{more}"
    path, reason = next(iter(files.items()))
    return (
        f"validation scored no image: each of the {len(files)} validation file(s) it read is unreadable and "
        f"was left out (data.skip_unreadable=true), e.g. {path}: {reason}; remove or re-encode them{more}"
    )
