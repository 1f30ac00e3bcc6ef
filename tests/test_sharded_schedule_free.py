"""FusedSGDScheduleFree over FSDP2 on 2 CPU processes (gloo): z a local shard placed like its param, the steps
and switches of the sharded run equal to one process (bit for bit where no norm is summed over shards), the
clip norm in one all-reduce a step, and a torch.distributed.checkpoint of the two ranks continuing both there
and in one process. The model, data and process group are sharded_harness.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sharded_harness as h
import torch
import torch.multiprocessing as mp
from helpers import free_port
from oracles import assert_close_rel
from torch import nn

from lightning_fusedsgd import FusedSGDScheduleFree

pytestmark = [
    pytest.mark.slow,  # several processes: make test runs them, make test-fast not
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]

HPARAMS = dict(lr=0.5, weight_decay=1e-3, warmup_steps=2, r=0.5)
# name -> (param dtype, FusedSGDScheduleFree keyword arguments besides HPARAMS, relative tolerance)
SCENARIOS: dict[str, tuple[torch.dtype, dict[str, Any], float]] = {
    "plain": (torch.float32, {}, 0.0),  # elementwise on each shard: the one-process bits
    "max_grad_norm": (torch.float32, dict(max_grad_norm=0.05), 1e-5),  # the norm summed over shards
    "bf16_masters": (torch.bfloat16, dict(master_weights=True), 0.0),
}
SAVED_AT = 2  # the DCP checkpoint's step


def run(model: nn.Module, optimizer: FusedSGDScheduleFree, steps: range, counts: list | None = None) -> None:
    """Training from the harness's batches, an eval/train round trip after SAVED_AT steps (the checkpoint's),
    eval at the end."""
    data = h.batches(next(model.parameters()).dtype)
    optimizer.train()
    for step in steps:
        h.train(model, optimizer, data[step : step + 1], counts)
        if step == SAVED_AT - 1:
            optimizer.eval()
            optimizer.train()
    optimizer.eval()


def snapshot(model: nn.Module, optimizer: FusedSGDScheduleFree) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {"param": {}, "z": {}, "master_param": {}}
    for name, param in model.named_parameters():
        out["param"][name] = h._full(param)
        for key in ("z", "master_param"):
            if key in optimizer.state.get(param, {}):
                out[key][name] = h._full(optimizer.state[param][key])
    out["k"] = optimizer.state_dict()["param_groups"][0]["k"]
    return out


def one_process(name: str) -> dict[str, Any]:
    dtype, kwargs, _ = SCENARIOS[name]
    model = h.make_model(dtype)
    optimizer = FusedSGDScheduleFree(model.parameters(), **HPARAMS, **kwargs)
    run(model, optimizer, range(h.STEPS))
    return snapshot(model, optimizer)


def worker(rank: int, port: int, result_path: str, checkpoint_dir: str) -> None:
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with h.gloo_worker(rank, port, h.WORLD):
        out: dict[str, Any] = {}
        for name, (dtype, kwargs, _) in SCENARIOS.items():
            model = h._shard(h.make_model(dtype))
            optimizer = FusedSGDScheduleFree(model.parameters(), **HPARAMS, **kwargs)
            counts: list[int] = []
            run(model, optimizer, range(h.STEPS), counts)
            out[name] = {**snapshot(model, optimizer), "all_reduces": counts}
            out[name]["placed"] = h._state_placed_like_params(optimizer)
            out[name]["backends"] = set(optimizer.last_backends.values())
        # A checkpoint at SAVED_AT in eval mode (x and z), through torch.distributed.checkpoint, loaded into a
        # fresh sharded run, which must be in train mode for DCP's initializing step.
        model = h._shard(h.make_model())
        optimizer = FusedSGDScheduleFree(model.parameters(), **HPARAMS)
        run(model, optimizer, range(SAVED_AT))
        model_state, optim_state = get_state_dict(model, optimizer)
        save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)
        resumed = h._shard(h.make_model())
        resumed_optimizer = FusedSGDScheduleFree(resumed.parameters(), **HPARAMS)
        resumed_optimizer.train()
        model_state, optim_state = get_state_dict(resumed, resumed_optimizer)
        load({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)
        set_state_dict(resumed, resumed_optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        run(resumed, resumed_optimizer, range(SAVED_AT, h.STEPS))
        out["resumed"] = snapshot(resumed, resumed_optimizer)
        if rank == 0:
            torch.save(out, result_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("sharded_schedule_free")
    mp.spawn(worker, args=(free_port(), str(tmp / "runs.pt"), str(tmp / "dcp")), nprocs=h.WORLD, join=True)
    return torch.load(tmp / "runs.pt"), tmp / "dcp"


def _assert_same(actual: dict[str, Any], expected: dict[str, Any], rel: float) -> None:
    assert actual["k"] == expected["k"]
    for key in ("param", "z", "master_param"):
        assert actual[key].keys() == expected[key].keys(), key
        names = sorted(expected[key])
        if rel == 0.0:
            assert all(torch.equal(actual[key][n], expected[key][n]) for n in names), key
        else:
            assert_close_rel([actual[key][n] for n in names], [expected[key][n] for n in names], rel)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fsdp2_equals_one_process(runs, name):
    results, _ = runs
    _assert_same(results[name], one_process(name), SCENARIOS[name][2])
    assert results[name]["placed"], "z (and the masters) must be DTensors placed like their params"
    assert results[name]["backends"] == {"compiled"}  # a sharded plan kept: its buckets run from Python


@pytest.mark.parametrize(("name", "expected"), [("plain", 0), ("max_grad_norm", 1)])
def test_collectives_per_step(runs, name, expected):
    results, _ = runs
    assert results[name]["all_reduces"] == [expected] * h.STEPS


def test_dcp_checkpoint_resumes_sharded_and_in_one_process(runs):
    """The two ranks' checkpoint continued on them, and in one process (z resharded): the uninterrupted
    run's bits."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    results, checkpoint_dir = runs
    expected = one_process("plain")
    _assert_same(results["resumed"], expected, 0.0)
    model = h.make_model()
    optimizer = FusedSGDScheduleFree(model.parameters(), **HPARAMS)
    optimizer.train()
    model_state, optim_state = get_state_dict(model, optimizer)
    load({"model": model_state, "optim": optim_state}, checkpoint_id=str(checkpoint_dir))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    assert not optimizer.training  # saved in eval mode
    run(model, optimizer, range(SAVED_AT, h.STEPS))
    _assert_same(snapshot(model, optimizer), expected, 0.0)
