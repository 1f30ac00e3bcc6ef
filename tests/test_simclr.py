"""The SimCLR recipe's pieces: views from the datamodules, the NT-Xent pairing, the kNN monitor."""

from __future__ import annotations

import pytest
import torch
from lightly.transforms import SimCLRTransform

from lightning_fusedsgd.lightning import ConfigError
from runner import simclr
from runner.data import DigitsDataModule, SyntheticDataModule
from runner.simclr import SimCLR


def _views(size: int = 16) -> SimCLRTransform:
    return SimCLRTransform(input_size=size, cj_sat=0.0, cj_hue=0.0, random_gray_scale=0.0, normalize=None)


def test_views_give_two_reproducible_views_and_an_unaugmented_bank():
    module = DigitsDataModule(image_size=16, views=_views())
    module.setup()
    plain = DigitsDataModule(image_size=16, augment=False)  # the oracle: evaluation images, no views
    plain.setup()
    views, label = module.train_set[(7, 1234)]
    assert len(views) == 2 and all(view.shape == (1, 16, 16) for view in views)
    assert not torch.equal(views[0], views[1])
    torch.manual_seed(99)  # the global RNG does not matter
    assert all(torch.equal(a, b) for a, b in zip(module.train_set[(7, 1234)][0], views))
    # Each view is normalized as the evaluation images are: identity views give the evaluation image.
    identity = DigitsDataModule(image_size=16, views=lambda image: [image, image])
    identity.setup()
    assert all(torch.equal(view, plain.train_set[(7, 0)][0]) for view in identity.train_set[(7, 1234)][0])
    assert torch.equal(module.bank_set[7][0], plain.train_set[(7, 0)][0]) and module.bank_set[7][1] == label
    assert len(module.bank_set) == 1437
    bank, val = module.val_dataloader()
    assert len(bank.dataset) == 1437 and len(val.dataset) == 360


def test_bank_size_keeps_a_fixed_subset():
    first = SyntheticDataModule(image_size=8, num_classes=3, train_samples=50, views=_views(8), bank_size=20)
    again = SyntheticDataModule(image_size=8, num_classes=3, train_samples=50, views=_views(8), bank_size=20)
    first.setup()
    again.setup()
    assert len(first.bank_set) == 20 and first.bank_set.indices == again.bank_set.indices
    assert len(set(first.bank_set.indices)) == 20
    with pytest.raises(ConfigError, match="data.bank_size=0"):
        SyntheticDataModule(views=_views(), bank_size=0)


def _nt_xent_float64(z0: torch.Tensor, z1: torch.Tensor, temperature: float) -> float:
    """Chen et al.'s loss, eq. (1), averaged over all 2N anchors: the positive of i is its other view."""
    z = torch.nn.functional.normalize(torch.cat([z0, z1]).double(), dim=1)
    n = len(z0)
    similarity = z @ z.T / temperature
    similarity.fill_diagonal_(float("-inf"))
    positive = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return float(torch.nn.functional.cross_entropy(similarity, positive))


def test_training_loss_pairs_each_image_with_its_other_view():
    torch.manual_seed(0)
    model = SimCLR(arch="resnet18", in_channels=1, small_input=True, hidden_dim=32, projection_dim=8)
    model.eval()  # fixed batch-norm statistics, so the two views' projections can be taken apart
    views = [torch.randn(6, 1, 16, 16), torch.randn(6, 1, 16, 16)]
    model.log = lambda *args, **kwargs: None  # no trainer attached
    with torch.no_grad():
        loss = model.training_step((views, torch.zeros(6)), 0)
        z0, z1 = (model.projection_head(model(view)) for view in views)
    assert float(loss) == pytest.approx(_nt_xent_float64(z0, z1, 0.5), rel=1e-5)
    assert float(loss) != pytest.approx(_nt_xent_float64(z0, z1.roll(1, 0), 0.5), rel=1e-3)


def _weighted_knn_float64(bank, bank_labels, val, num_classes, k, t):
    """Wu et al. 2018's vote: each of the k most similar bank images adds exp(similarity / t) to its class."""
    predictions = []
    for feature in val.double():
        similarity = bank.double() @ feature
        top = similarity.topk(k)
        votes = torch.zeros(num_classes, dtype=torch.float64)
        votes.index_add_(0, bank_labels[top.indices], (top.values / t).exp())
        predictions.append(int(votes.argmax()))
    return predictions


@pytest.mark.parametrize("chunk", [7, 1024])
def test_knn_accuracy_is_the_weighted_vote(monkeypatch, chunk):
    monkeypatch.setattr(simclr, "_KNN_CHUNK", chunk)
    generator = torch.Generator().manual_seed(0)
    centers = torch.nn.functional.normalize(torch.randn(4, 16, generator=generator), dim=1)

    def sample(n):
        labels = torch.randint(4, (n,), generator=generator)
        points = centers[labels] + 0.6 * torch.randn(n, 16, generator=generator)
        return torch.nn.functional.normalize(points, dim=1), labels

    (bank, bank_labels), (val, val_labels) = sample(60), sample(30)
    model = SimCLR(num_classes=4, knn_k=9, knn_t=0.1)
    predicted = torch.tensor(_weighted_knn_float64(bank, bank_labels, val, 4, 9, 0.1))
    expected = float((predicted == val_labels).double().mean())
    assert 0.3 < expected < 1.0  # neither trivial nor hopeless: the vote matters
    assert model._knn_accuracy(bank, bank_labels, val, val_labels) == pytest.approx(expected)
