"""Run by torchrun (2 CPU processes) from test_model_parallel.py: Lightning's ModelParallelStrategy with FSDP2
applied in configure_model and configure_fused_sgd (LARS, warmup, gradient_clip_val). Fits to ``max_steps``,
resuming from ``ckpt_path`` when given, saves a distributed checkpoint, and writes from rank 0 what the
optimizer, the schedule and the weights held when training started and when it ended (full tensors).

Usage: ``torchrun --nproc_per_node=2 model_parallel_run.py OUT MAX_STEPS [CKPT_PATH]``
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from helpers import end_worker_process
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_fusedsgd.lightning import Schedule, configure_fused_sgd


class ShardedMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # 33 rows: uneven shards over 2 ranks
        self.net = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 3))
        generator = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randn(64, 16, generator=generator), torch.arange(64) % 3)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.cross_entropy(self.net(inputs), targets)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)

    def configure_optimizers(self):
        schedule = Schedule(decay="constant", warmup=3, unit="step")
        return configure_fused_sgd(self, lr=0.5, lars=True, schedule=schedule)


def snapshot(trainer: pl.Trainer, module: pl.LightningModule) -> dict:
    optimizer = trainer.optimizers[0]
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    names = {p: n for n, p in module.named_parameters()}
    return {
        "global_step": trainer.global_step,
        "weights": {n: p.full_tensor() for p, n in names.items()},
        "momentum": {names[p]: s["momentum_buffer"].full_tensor() for p, s in optimizer.state.items()},
        "state_is_dtensor": all(
            type(s["momentum_buffer"]).__name__ == "DTensor" for s in optimizer.state.values()
        ),
        "lr": [group["lr"] for group in optimizer.param_groups],
        "max_grad_norm": [group["max_grad_norm"] for group in optimizer.param_groups],
        "schedule_position": scheduler.last_epoch,
        "backends": dict(optimizer.last_backends),
    }


class Snapshots(pl.Callback):
    def __init__(self) -> None:
        self.taken: dict[str, dict] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.taken["start"] = snapshot(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.taken["end"] = snapshot(trainer, pl_module)


def main() -> None:
    out, max_steps = Path(sys.argv[1]), int(sys.argv[2])
    ckpt_path = sys.argv[3] if len(sys.argv) > 3 else None
    snapshots = Snapshots()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=max_steps,
        gradient_clip_val=0.5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[snapshots],
    )
    module = ShardedMLP()
    trainer.fit(module, ckpt_path=ckpt_path)
    trainer.save_checkpoint(out / f"step{max_steps}.ckpt")
    if trainer.global_rank == 0:
        torch.save(snapshots.taken, out / f"snapshots{max_steps}.pt")


if __name__ == "__main__":
    main()
    end_worker_process()
