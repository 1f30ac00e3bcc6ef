"""Two-process (gloo, CPU) runs of FusedSGD over FSDP2-sharded, DDP and ZeroRedundancyOptimizer models,
and the one-process runs that test_sharded.py compares them with. Every rank trains on the same batches, so
FSDP2's and DDP's gradient averages equal the one-process gradients exactly and the only differences left
are the optimizer's own rounding (the order in which norms are summed over shards)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from helpers import counting_calls, end_worker_process
from torch import nn

import lightning_fusedsgd.optim._step as step_path
from lightning_fusedsgd import FusedSGD, _abi
from lightning_fusedsgd.optim import _dtensor as sharding

WORLD = 2
STEPS = 5  # the first creates the buffers, the second keeps the plan, the others reuse it
INF_STEP = 2  # the step whose gradients hold an inf in the GradScaler runs
LR = 0.1
_LARS = dict(momentum=0.9, weight_decay=5e-4, lars=True, trust_coefficient=0.05)
# name -> (param dtype, FusedSGD keyword arguments besides lr)
SCENARIOS: dict[str, tuple[torch.dtype, dict[str, Any]]] = {
    "plain": (torch.float32, dict(momentum=0.9, weight_decay=1e-3)),
    "nesterov": (torch.float32, dict(momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "lars": (torch.float32, _LARS),
    "lars_decayed_grad": (torch.float32, {**_LARS, "lars_denominator": "decayed_grad"}),
    "lars_trust_clip": (torch.float32, {**_LARS, "trust_clip": True}),
    "max_grad_norm": (torch.float32, dict(momentum=0.9, weight_decay=1e-3, max_grad_norm=0.05)),
    "lars_max_grad_norm": (torch.float32, {**_LARS, "max_grad_norm": 0.05}),
    "lars_decayed_grad_max_grad_norm": (
        torch.float32,
        {**_LARS, "lars_denominator": "decayed_grad", "max_grad_norm": 0.05},
    ),
    "bf16_master_lars": (torch.bfloat16, {**_LARS, "master_weights": True}),
    # The average of the weights: a DTensor placed like its param, updated from the local shard's new weight.
    "lars_ema": (torch.float32, {**_LARS, "ema_decay": 0.9, "ema_every": 2}),
    "bf16_master_ema": (torch.bfloat16, dict(momentum=0.9, master_weights=True, ema_decay=0.8)),
    # bf16 weights without masters: Kahan compensations are DTensors too, and the norms read param + them.
    "bf16_kahan_lars": (torch.bfloat16, {**_LARS, "update_rounding": "kahan"}),
    # The reference backend's lars_sq_sums and given-sums sgd_step, under the same all-reduce.
    "reference_backend_lars_decayed_grad_max_grad_norm": (
        torch.float32,
        {**_LARS, "lars_denominator": "decayed_grad", "max_grad_norm": 0.05, "backend": "reference"},
    ),
    # Biases in a group without LARS and decay: the all-reduced vector holds only the weights' rows.
    "lars_weights_only_max_grad_norm": (torch.float32, {**_LARS, "max_grad_norm": 0.05, "split_bias": True}),
    # The biases' gradient norm reported beside the LARS rows' (no clip), in the same all-reduce.
    "lars_weights_only": (torch.float32, {**_LARS, "split_bias": True}),
    # lightly's grouping (biases: weight decay 0, lars not said) with its rules: only always_adapt=False
    # keeps LARS off the biases, whose rows still travel (zeros) in the all-reduce.
    "lars_lightly_rules_max_grad_norm": (
        torch.float32,
        {
            **_LARS,
            "max_grad_norm": 0.05,
            "undecayed_bias": True,
            "always_adapt": False,
            "lars_zero_norm": "plain_grad",
        },
    ),
}


def make_optimizer(model: nn.Module, kwargs: dict[str, Any]) -> FusedSGD:
    """FusedSGD over the model: one group, or the biases apart (``split_bias``: no LARS and no decay on them;
    ``undecayed_bias``: no decay, lars left to the optimizer, as lightly groups them)."""
    kwargs = dict(kwargs)
    split, undecayed = kwargs.pop("split_bias", False), kwargs.pop("undecayed_bias", False)
    if not (split or undecayed):
        return FusedSGD(model.parameters(), lr=LR, **kwargs)
    named = list(model.named_parameters())
    biases = {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}
    if split:
        biases["lars"] = False
    return FusedSGD([{"params": [p for n, p in named if not n.endswith("bias")]}, biases], lr=LR, **kwargs)


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """Shards over 2 ranks unevenly (the [3, 5] weight as 2 + 1 rows) and emptily (the [1, 3] weight and the
    1-element bias leave rank 1 nothing)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1)).to(dtype)


def make_tp_model() -> nn.Module:
    """Even widths, as tensor parallelism shards them: the first Linear column-wise, the second row-wise."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))


def batches(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=generator).to(dtype), torch.randn(8, 1, generator=generator).to(dtype))
        for _ in range(STEPS)
    ]


def train(model: nn.Module, optimizer: Any, data: list, counts: list[int] | None = None) -> None:
    for x, y in data:
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        with counting_calls(dist, "all_reduce") as count:
            optimizer.step()
        if counts is not None:
            counts.append(count[0])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().clone()


def snapshot(model: nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Weights (params, plus their Kahan compensations where kept), momentum buffers and masters by parameter
    name, as full tensors."""
    out: dict[str, dict[str, torch.Tensor]] = {
        "param": {},
        "momentum_buffer": {},
        "master_param": {},
        "ema": {},
    }
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        compensation = optimizer.state.get(param, {}).get("kahan_compensation")
        out["param"][name] = (
            _full(param) if compensation is None else _full(param) + _full(compensation).float()
        )
        for key in ("momentum_buffer", "master_param", "ema"):
            if key in optimizer.state.get(param, {}):
                out[key][name] = _full(optimizer.state[param][key])
    return out


def one_process(name: str) -> dict[str, Any]:
    """The snapshot of a one-process run, and its last step's ``last_grad_norm``."""
    dtype, kwargs = SCENARIOS[name]
    model = make_model(dtype)
    optimizer = make_optimizer(model, kwargs)
    train(model, optimizer, batches(dtype))
    return {**snapshot(model, optimizer), "grad_norm": optimizer.last_grad_norm}


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _state_placed_like_params(optimizer: Any) -> bool:
    """Every state tensor of a param is a DTensor placed like it, but counts (0-d, as torch's ``step``)."""
    from torch.distributed.tensor import DTensor

    counts = {slot.key for slot in _abi.SLOTS if slot.count}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if key in counts:
                continue
            if not (
                isinstance(value, DTensor)
                and value.placements == param.placements
                and value.shape == param.shape
                and value.to_local().shape == param.to_local().shape
            ):
                return False
    return True


def _sharded_runs(out: dict[str, Any], checkpoint_dir: Path) -> None:
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for name, (dtype, kwargs) in SCENARIOS.items():
        model = _shard(make_model(dtype))
        optimizer = make_optimizer(model, kwargs)
        counts: list[int] = []
        # plan_step calls: the steps that planned from scratch rather than reusing the kept plan.
        with counting_calls(step_path, "plan_step") as planned:
            train(model, optimizer, batches(dtype), counts)
        out[name] = {
            **snapshot(model, optimizer),
            "grad_norm": optimizer.last_grad_norm,
            "all_reduces": counts,
            "planned": planned[0],
            "placed": _state_placed_like_params(optimizer),
        }
    # Mid-run checkpoint: state dicts after 2 steps, into a fresh model and optimizer, one more step (fp32,
    # and bf16 whose fp32 masters must stay fp32); and the fp32 state saved with torch.distributed.checkpoint
    # for a one-process run to load.
    for name in ("lars", "lars_ema", "bf16_master_lars", "bf16_kahan_lars"):
        dtype, kwargs = SCENARIOS[name]
        data = batches(dtype)
        model = _shard(make_model(dtype))
        optimizer = FusedSGD(model.parameters(), lr=LR, **kwargs)
        train(model, optimizer, data[:2])
        model_state, optim_state = get_state_dict(model, optimizer)
        if name == "lars_ema":
            save({"model": model_state, "optim": optim_state}, checkpoint_id=str(checkpoint_dir))
        resumed = _shard(make_model(dtype))
        resumed_optimizer = FusedSGD(resumed.parameters(), lr=LR, **kwargs)
        set_state_dict(resumed, resumed_optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        train(resumed, resumed_optimizer, data[2:])
        out[f"resumed_{name}"] = snapshot(resumed, resumed_optimizer)
    data = batches()
    # A one-process state dict cannot be loaded into sharded params by load_state_dict: refused, unchanged.
    plain = make_model()
    plain_optimizer = FusedSGD(plain.parameters(), lr=LR, **_LARS)
    train(plain, plain_optimizer, data[:1])
    before = snapshot(resumed, resumed_optimizer)
    try:
        resumed_optimizer.load_state_dict(plain_optimizer.state_dict())
    except ValueError as error:
        out["plain_into_sharded"] = str(error)
    unchanged = snapshot(resumed, resumed_optimizer)
    out["plain_into_sharded_unchanged"] = all(
        torch.equal(before[k][n], unchanged[k][n]) for k in before for n in before[k]
    )
    # A Partial param (local values that add up to it) cannot be stepped: refused, unchanged.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (WORLD,))
    partial = nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Partial()]))
    partial.grad = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    try:
        FusedSGD([partial], lr=LR, momentum=0.9).step()
    except ValueError as error:
        out["partial_param"] = str(error)
    out["partial_param_unchanged"] = torch.equal(partial.to_local(), torch.ones(3))


def scaled_train(model: nn.Module, optimizer: FusedSGD, scaler: Any, inf_rank: int | None) -> dict[str, Any]:
    """An fp32 AMP-style loop with WarmupLR: at INF_STEP one element of one gradient shard is set to inf, on
    rank ``inf_rank`` only (None: one process), so only that rank's local check can see it. Returns which
    steps were applied and the schedule's counts."""
    from lightning_fusedsgd import WarmupLR

    scheduler = WarmupLR(optimizer, total_steps=STEPS, warmup_steps=2, decay="linear")
    applied = []
    for step, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        if step == INF_STEP and (inf_rank is None or dist.get_rank() == inf_rank):
            param = next(
                p for p in model.parameters() if p.grad is not None and sharding.local(p.grad).numel()
            )
            sharding.local(param.grad).view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        applied.append(bool(optimizer.last_step_applied))
    return {"applied": applied, "last_epoch": scheduler.last_epoch, "skipped_steps": scheduler.skipped_steps}


def _scaled_runs(out: dict[str, Any]) -> None:
    """FSDP2 under torch's ShardedGradScaler with an inf that only rank 1's gradient shard holds."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = _shard(make_model())
    optimizer = make_optimizer(model, SCENARIOS["lars"][1])
    counts = scaled_train(model, optimizer, ShardedGradScaler("cpu", init_scale=1024.0), inf_rank=1)
    out["sharded_grad_scaler"] = {**snapshot(model, optimizer), **counts}


def _tensor_parallel_runs(out: dict[str, Any]) -> None:
    """LARS over tensor-parallel params: weights sharded on dim 0 (column-wise) and dim 1 (row-wise), a
    replicated bias, and a last layer left plain."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = make_tp_model()
    parallelize_module(
        model, init_device_mesh("cpu", (WORLD,)), {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    optimizer = make_optimizer(model, SCENARIOS["lars_max_grad_norm"][1])
    counts: list[int] = []
    train(model, optimizer, batches(), counts)
    placements = {name: str(p.placements) for name, p in model.named_parameters() if sharding.is_sharded(p)}
    out["tensor_parallel"] = {**snapshot(model, optimizer), "all_reduces": counts, "placements": placements}


# FSDP2 over tensor parallelism on a 2 x 2 mesh (4 processes): the scenarios and the mesh's dimension names.
MESH_2D_WORLD = 4
MESH_2D_SCENARIOS = ("plain", "lars", "lars_decayed_grad_max_grad_norm")
HSDP_SCENARIO = "lars_max_grad_norm"


@contextlib.contextmanager
def gloo_worker(rank: int, port: int, world: int):
    """This spawned process as rank ``rank`` of a gloo group of ``world`` (one thread each), torn down after
    the body; a body that returns ends the process (end_worker_process), one that raises reaches mp.spawn."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        dist.destroy_process_group()
    end_worker_process()


def mesh_2d_worker(rank: int, port: int, result_path: str) -> None:
    """Tensor parallelism on the mesh's "tp" dimension, then FSDP2 on its "dp" dimension: weights sharded on
    both (FSDP2 makes the TP-sharded dimension a _StridedShard), a bias sharded on "dp" and replicated on
    "tp", and a last layer on the "dp" submesh alone. Then HSDP: FSDP2 on the whole mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with gloo_worker(rank, port, MESH_2D_WORLD):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        out: dict[str, Any] = {}
        for name in MESH_2D_SCENARIOS:
            model = make_tp_model()
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            for layer in (0, 2, 4):
                fully_shard(model[layer], mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            optimizer = make_optimizer(model, SCENARIOS[name][1])
            counts: list[int] = []
            train(model, optimizer, batches(), counts)
            placements = {n: str(p.placements) for n, p in model.named_parameters()}
            out[name] = {**snapshot(model, optimizer), "all_reduces": counts, "placements": placements}
        # HSDP: replicated over the first dimension, sharded over the second: only the second's group sums.
        model = make_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = make_optimizer(model, SCENARIOS[HSDP_SCENARIO][1])
        counts = []
        train(model, optimizer, batches(), counts)
        placements = {n: str(p.placements) for n, p in model.named_parameters()}
        out["hsdp"] = {**snapshot(model, optimizer), "all_reduces": counts, "placements": placements}
        if rank == 0:
            torch.save(out, result_path)


def _replicated_runs(out: dict[str, Any]) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model())
    optimizer = FusedSGD(model.parameters(), lr=LR, **_LARS)
    train(model, optimizer, batches())
    out["ddp"] = snapshot(model, optimizer)
    model = DistributedDataParallel(make_model())
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=FusedSGD, lr=LR, **_LARS)
    train(model, optimizer, batches())
    out["zero"] = {"param": snapshot(model, optimizer)["param"], "ranks_stepped": len(optimizer.optim.state)}


def worker(rank: int, port: int, result_path: str, checkpoint_dir: str) -> None:
    with gloo_worker(rank, port, WORLD):
        out: dict[str, Any] = {}
        _sharded_runs(out, Path(checkpoint_dir))
        _scaled_runs(out)
        _tensor_parallel_runs(out)
        _replicated_runs(out)
        scaled = out["sharded_grad_scaler"]
        per_rank = {"zero_ranks_stepped": out["zero"]["ranks_stepped"], "applied": scaled["applied"]}
        out_all = [None] * WORLD
        dist.all_gather_object(out_all, per_rank)
        out["zero"]["ranks_stepped"] = [o["zero_ranks_stepped"] for o in out_all]
        scaled["applied_per_rank"] = [o["applied"] for o in out_all]
        if rank == 0:
            torch.save(out, result_path)
