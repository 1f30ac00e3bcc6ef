"""SimCLR (Chen et al. 2020, arXiv:2002.05709) as ``train.py recipe=simclr`` trains it, with lightly's pieces.

The backbone is a torchvision ResNet without its classifier, the projection head and the NT-Xent loss are
lightly's (``SimCLRProjectionHead``, ``NTXentLoss``), and the views come from the datamodule (``data.views``,
lightly's ``SimCLRTransform``). Progress is measured without labels in training: a weighted kNN classifier
(Wu et al. 2018, as lightly's benchmarks run it) over the backbone's features of the un-augmented training
images, scored on the validation images, beside the same classifier on a randomly initialised backbone.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightly.loss import NTXentLoss
from lightly.models.modules import SimCLRProjectionHead
from lightly.utils.benchmarking import knn_predict
from torch import nn

from lightning_fusedsgd.lightning import configure_fused_sgd
from runner.model import OptimizerFactory, build_resnet
from runner.options import check_flags

__all__ = ["SimCLR"]

_KNN_CHUNK = 1024  # validation images per similarity matrix: bounds memory for large banks


def _backbone(arch: str, in_channels: int, small_input: bool) -> tuple[nn.Module, int]:
    net = build_resnet(arch, num_classes=1, in_channels=in_channels, small_input=small_input)
    features = net.fc.in_features
    net.fc = nn.Identity()
    return net, features


class SimCLR(pl.LightningModule):
    """Contrastive pretraining of a ResNet backbone; logs the loss and the kNN accuracy of its features.

    Logs ``train/loss``, ``val/acc`` (kNN top-1 of the backbone being trained) and ``val/acc_random_init``
    (the same kNN on a randomly initialised backbone of the same architecture, built once per fit with seed
    0): what pretraining adds is their difference. Validation expects the datamodule's two loaders: the
    training images without augmentation (the memory bank) first, then the validation images.

    Args:
        arch: torchvision ResNet name (see :func:`~runner.model.build_resnet`).
        num_classes: Labels of the data, for the kNN classifier only.
        in_channels: Input image channels.
        small_input: CIFAR-style stem (see :func:`~runner.model.build_resnet`).
        hidden_dim: Width of the projection head's hidden layer; ``None``: the backbone's feature width.
        projection_dim: Output width of the projection head (128 in the paper).
        temperature: NT-Xent temperature (the paper: 0.1 on ImageNet, 0.5 on CIFAR-10).
        knn_k: Neighbours the kNN classifier weighs.
        knn_t: Temperature of the kNN weights ``exp(similarity / knn_t)``.
        channels_last: Keep the backbone and its inputs in channels-last memory format (see
            :class:`~runner.model.ImageClassifier`).
        optimizer: ``module -> configure_optimizers() result`` (see
            :class:`~runner.model.ImageClassifier`); ``None``:
            :func:`configure_fused_sgd`'s defaults.
    """

    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 10,
        in_channels: int = 3,
        small_input: bool = False,
        hidden_dim: int | None = None,
        projection_dim: int = 128,
        temperature: float = 0.5,
        knn_k: int = 200,
        knn_t: float = 0.1,
        channels_last: bool = False,
        optimizer: OptimizerFactory | None = None,
    ) -> None:
        super().__init__()
        check_flags("model", small_input=small_input, channels_last=channels_last)
        self.save_hyperparameters(ignore=["optimizer"], logger=False)  # the loggers get the resolved config
        self.backbone, features = _backbone(arch, in_channels, small_input)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.backbone.to(memory_format=self.memory_format)
        self.projection_head = SimCLRProjectionHead(features, hidden_dim or features, projection_dim)
        # gather_distributed: negatives from every rank's batch, as the paper's global batch has them.
        self.criterion = NTXentLoss(temperature=temperature, gather_distributed=True)
        self.optimizer_factory = optimizer
        self._features: dict[str, list[torch.Tensor]] = {}
        # Held in a tuple so that it is not a submodule: no parameters to train, nothing in checkpoints.
        self._random_init: tuple[nn.Module, ...] = ()
        self._random_init_acc: float | None = None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The backbone's features (what a downstream task uses), before the projection head."""
        return self.backbone(images.contiguous(memory_format=self.memory_format))

    def training_step(self, batch: tuple[list[torch.Tensor], Any], batch_idx: int) -> torch.Tensor:
        views, _ = batch
        if len(views) != 2:
            raise ValueError(f"SimCLR takes two views of each image, the data gave {len(views)}")
        # Both views in one forward pass: one set of batch-norm statistics, as the paper's global BN.
        projections = self.projection_head(self(torch.cat(views))).chunk(2)
        loss = self.criterion(*projections)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._features = {"bank": [], "bank_labels": [], "val": [], "val_labels": []}
        if self._random_init_acc is None and not self.trainer.sanity_checking:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                hparams = self.hparams
                net, _ = _backbone(hparams.arch, hparams.in_channels, hparams.small_input)
            self._random_init = (net.to(self.device).eval(),)
            for key in ("bank_random", "val_random"):
                self._features[key] = []

    def validation_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        images, labels = batch
        split = ("bank", "val")[dataloader_idx]
        self._features[split].append(F.normalize(self(images), dim=1))
        self._features[f"{split}_labels"].append(labels)
        if self._random_init:
            self._features[f"{split}_random"].append(F.normalize(self._random_init[0](images), dim=1))

    def on_validation_epoch_end(self) -> None:
        if not self._features["bank"] or not self._features["val"]:
            raise RuntimeError(
                "SimCLR's validation needs two loaders, the memory bank's then the validation images': "
                "give the datamodule views (data.views), which makes it serve both"
            )
        gathered = {key: self._gather(values) for key, values in self._features.items()}
        self._features = {}
        accuracy = self._knn_accuracy(
            gathered["bank"], gathered["bank_labels"], gathered["val"], gathered["val_labels"]
        )
        self.log("val/acc", accuracy, prog_bar=True)
        if self._random_init:
            self._random_init = ()
            self._random_init_acc = self._knn_accuracy(
                gathered["bank_random"],
                gathered["bank_labels"],
                gathered["val_random"],
                gathered["val_labels"],
            )
        if self._random_init_acc is not None:
            self.log("val/acc_random_init", self._random_init_acc)

    def _gather(self, values: list[torch.Tensor]) -> torch.Tensor:
        """One rank's batches, then every rank's (a sampler's padding repeats a few images)."""
        local = torch.cat(values)
        if self.trainer.world_size == 1:
            return local
        return self.all_gather(local).flatten(0, 1)

    def _knn_accuracy(
        self, bank: torch.Tensor, bank_labels: torch.Tensor, val: torch.Tensor, val_labels: torch.Tensor
    ) -> float:
        bank_t = bank.T.contiguous()
        k = min(self.hparams.knn_k, len(bank))  # a bank cut short (limit_val_batches) has fewer images
        correct = 0
        for start in range(0, len(val), _KNN_CHUNK):
            chunk = slice(start, start + _KNN_CHUNK)
            predicted = knn_predict(
                val[chunk], bank_t, bank_labels, self.hparams.num_classes, k, self.hparams.knn_t
            )
            correct += int((predicted[:, 0] == val_labels[chunk]).sum())
        return correct / len(val)

    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            return configure_fused_sgd(self)
        return self.optimizer_factory(self)
