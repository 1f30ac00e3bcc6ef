"""Optimizer step time on ResNet-50 under FSDP2 (2 ranks, gloo, CPU): FusedSGD plain, FusedSGD + LARS,
the reference backend's LARS (``backend="reference"``) and torch.optim.SGD (foreach), with the all-reduce
calls each makes per step.

Usage: ``python bench/sharded.py [--repeats N]``. Each rank runs one thread; every bottleneck block and the
root are ``fully_shard``ed, the groups come from ``param_groups`` (LARS and decay on the 54 weight tensors),
and the gradients are random DTensors placed like the params (no backward: only the step is timed). Prints
rank 0's medians as a markdown table and writes ``bench/results/sharded.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from common import print_table, time_interleaved, write_json
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_fusedsgd import FusedSGD, param_groups

HPARAMS = dict(lr=0.1, momentum=0.9, weight_decay=5e-5)
WORLD = 2
OPTIMIZERS = {
    "FusedSGD": lambda groups: FusedSGD(groups, **HPARAMS),
    "FusedSGD LARS": lambda groups: FusedSGD(groups, **HPARAMS, lars=True),
    "reference-backend LARS": lambda groups: FusedSGD(groups, **HPARAMS, lars=True, backend="reference"),
    "torch.optim.SGD foreach": lambda groups: torch.optim.SGD(groups, **HPARAMS, foreach=True),
}


def sharded_resnet50() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    for module in model.modules():
        if isinstance(module, torchvision.models.resnet.Bottleneck):
            fully_shard(module)
    fully_shard(model)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for p in model.parameters():
        local = torch.randn(p.to_local().shape, generator=generator) * 1e-3
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return model


@contextlib.contextmanager
def counting_all_reduce():
    original = dist.all_reduce
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield count
    finally:
        dist.all_reduce = original


def worker(rank: int, port: int, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    optimizers, collectives = {}, {}
    for name, make in OPTIMIZERS.items():
        model = sharded_resnet50()
        optimizers[name] = make(param_groups(model, HPARAMS["weight_decay"]))
        with counting_all_reduce() as count:
            optimizers[name].step()  # creates the momentum buffers
        collectives[name] = count[0]
    times = time_interleaved({name: opt.step for name, opt in optimizers.items()}, repeats)
    if rank == 0:
        rows = [("ResNet-50, FSDP2 over 2 ranks (1 thread each)", times)]
        print_table("Sharded step (rank 0)", rows, baseline="FusedSGD")
        print("\nall_reduce calls per step:", collectives)
        payload = {"world": WORLD, "repeats": repeats, "median_s": times, "all_reduces_per_step": collectives}
        print(f"wrote {write_json('sharded', payload)}")
    dist.destroy_process_group()
    # Skip finalization, which a gloo thread may abort (see end_worker_process in tests/helpers.py).
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(worker, args=(port, args.repeats), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
