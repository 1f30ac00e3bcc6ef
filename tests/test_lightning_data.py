"""DataModules: data order and augmentation as functions of (seed, epoch); missing data messages."""

from __future__ import annotations

import pytest
import torch

from lightning_fusedsgd.lightning import ConfigError
from runner.data import (
    CIFAR10DataModule,
    DataNotFoundError,
    DigitsDataModule,
    ImageFolderDataModule,
    SyntheticDataModule,
)
from runner.sampling import EpochSampler


def _epoch(sampler: EpochSampler, epoch: int) -> list[tuple[int, int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_epoch_sampler_order_is_a_function_of_seed_and_epoch():
    data = list(range(50))
    first, again = EpochSampler(data, seed=3), EpochSampler(data, seed=3)
    assert _epoch(first, 0) != _epoch(first, 1)
    _epoch(again, 5)  # state left by other epochs does not matter
    assert _epoch(again, 1) == _epoch(first, 1)
    assert sorted(index for index, _ in _epoch(first, 2)) == data
    assert _epoch(EpochSampler(data, seed=4), 1) != _epoch(first, 1)


def test_epoch_sampler_shards_over_ranks_with_shared_augmentation_seeds():
    data = list(range(10))
    shards = [_epoch(EpochSampler(data, num_replicas=2, rank=rank, seed=0), 3) for rank in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 5
    assert sorted(index for shard in shards for index, _ in shard) == data
    single = dict(_epoch(EpochSampler(data, seed=0), 3))
    assert all(single[index] == seed for shard in shards for index, seed in shard)


def test_digits_augmentation_is_reproducible_and_evaluation_plain():
    module = DigitsDataModule(image_size=16)
    module.setup()
    assert len(module.train_set) == 1437 and len(module.val_set) == 360
    image, label = module.train_set[(7, 1234)]
    assert image.shape == (1, 16, 16) and 0 <= label < 10
    torch.manual_seed(99)  # the global RNG does not matter
    assert torch.equal(module.train_set[(7, 1234)][0], image)
    assert not torch.equal(module.train_set[(7, 1235)][0], image)
    assert torch.equal(module.val_set[0][0], module.val_set[0][0])


def test_synthetic_images_follow_the_configured_shape():
    module = SyntheticDataModule(batch_size=4, image_size=8, num_classes=3, in_channels=2, train_samples=6)
    module.setup()
    images, labels = module.on_after_batch_transfer(next(iter(module.train_dataloader())), 0)
    assert images.shape == (4, 2, 8, 8) and labels.max() < 3
    assert module.train_set[(1, 0)] == module.train_set[(1, 5)] == 1  # a pure function of index


def test_missing_imagefolder_names_path_and_layout(tmp_path):
    (tmp_path / "train" / "n01440764").mkdir(parents=True)
    module = ImageFolderDataModule(root=str(tmp_path))
    with pytest.raises(DataNotFoundError) as info:
        module.check_data()
    message = info.value.describe(recipe="resnet50")
    assert str(tmp_path / "val") in message
    assert "<root>/val/<class>/<image>" in message
    assert "python train.py recipe=resnet50 data=synthetic" in message


def test_missing_cifar10_names_path_and_download(tmp_path):
    with pytest.raises(DataNotFoundError, match="cifar-10-batches-py") as info:
        CIFAR10DataModule(root=str(tmp_path)).check_data()
    assert "data.download=true" in str(info.value)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: DigitsDataModule(num_classes=5), "DigitsDataModule has num_classes=10, the config declares "
         "data.num_classes=5: set data.num_classes=10"),
        (lambda: CIFAR10DataModule(in_channels=1), "set data.in_channels=3"),
    ],
)  # fmt: skip
def test_a_dataset_declared_with_other_classes_or_channels_is_refused(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_imagefolder_class_count_is_checked_against_the_config(tmp_path):
    for split in ("train", "val"):
        for name in ("cat", "dog", "fox"):
            (tmp_path / split / name).mkdir(parents=True)
    ImageFolderDataModule(root=str(tmp_path), num_classes=3).check_data()
    with pytest.raises(ConfigError, match="has 3 class folders, the config declares data.num_classes=1000"):
        ImageFolderDataModule(root=str(tmp_path)).check_data()
