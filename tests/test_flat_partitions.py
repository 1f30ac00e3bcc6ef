"""Tensors an engine puts in the optimizer's groups in place of the model's (DeepSpeed's flat partitions),
without DeepSpeed: what a step that needs no norms does with them, and that the optimizer's own tensors stay
its own.
Under DeepSpeed itself: test_deepspeed.py; the refusals: tests/cases.py."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import torch
from helpers import make_params
from torch import nn

from lightning_fusedsgd import FusedLARS, FusedSGD
from lightning_fusedsgd.optim import _plan, _zero


def test_a_partition_is_split_over_every_list_of_a_bucket():
    """_zero.split rewrites a bucket's lists one by one: a list added to Bucket must be known to it."""
    assert {f.name for f in dataclasses.fields(_plan.Bucket)} == set(_zero.SPLIT_FIELDS)


def test_plain_sgd_steps_an_engines_flat_buffer_as_it_is():
    """Elementwise math needs no norms: a flat buffer put in the group steps as torch.optim.SGD steps it."""
    flats = [
        nn.Parameter(torch.cat([p.detach().reshape(-1) for p in make_params([(30, 7), (5,)])])) for _ in "ab"
    ]
    ours = FusedSGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9, weight_decay=1e-3)
    theirs = torch.optim.SGD([flats[1]], lr=0.1, momentum=0.9, weight_decay=1e-3)
    ours.param_groups[0]["params"] = [flats[0]]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        grad = torch.randn(flats[0].shape, generator=generator)
        flats[0].grad, flats[1].grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    assert torch.equal(flats[0], flats[1])


def test_a_copied_or_unpickled_optimizers_own_params_step_with_lars():
    for clone in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        params = make_params([(30, 7), (5,)])
        optimizer = clone(FusedLARS(params, lr=0.1, momentum=0.9, weight_decay=1e-4))
        copied = optimizer.param_groups[0]["params"]
        before = [p.detach().clone() for p in copied]
        for p in copied:
            p.grad = torch.ones_like(p)
        optimizer.step()
        assert all(not torch.equal(p, b) for p, b in zip(copied, before))
