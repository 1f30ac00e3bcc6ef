"""Two-process (gloo, CPU) runs of FusedSGD under DeepSpeed's ZeRO stages 1 and 2, through
``deepspeed.initialize`` and through Lightning's ``DeepSpeedStrategy``, and the one-process runs that
test_deepspeed.py compares them with. Every rank trains on the same batches, so ZeRO's averaged gradients are
the one-process gradients exactly, and what is left to differ is the order in which the norms are summed."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from helpers import counting_calls, end_worker_process
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fusedsgd import FusedSGD, attach_deepspeed
from lightning_fusedsgd.lightning import configure_fused_sgd

WORLD = 2
STEPS = 5
LR = 0.1
CLIP = 0.05  # clips every step of these runs
_LARS = dict(momentum=0.9, weight_decay=5e-4, lars=True, trust_coefficient=0.05)
# name -> (FusedSGD keyword arguments besides lr, DeepSpeed config entries, the one-process run it equals)
SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "plain": (dict(momentum=0.9, weight_decay=1e-3), {}, "plain"),
    "lars": (_LARS, {}, "lars"),
    "max_grad_norm": (dict(momentum=0.9, weight_decay=1e-3, max_grad_norm=CLIP), {}, "max_grad_norm"),
    "lars_max_grad_norm": ({**_LARS, "max_grad_norm": CLIP}, {}, "lars_max_grad_norm"),
    # Biases in a group without LARS and decay: ZeRO steps the two groups one after the other.
    "lars_weights_only": ({**_LARS, "split_bias": True}, {}, "lars_weights_only"),
    # DeepSpeed clips (before the optimizer's step), LARS sees the clipped gradient: FusedLARS(max_grad_norm).
    "lars_deepspeed_clipping": (_LARS, {"gradient_clipping": CLIP}, "lars_max_grad_norm"),
}
STAGES = (1, 2)
RESUMED = (2, "lars_max_grad_norm")  # interrupted after 2 steps, saved, loaded into a new engine
# bf16 weights under ZeRO stage 1 with fp32 gradients: DeepSpeed's BF16_Optimizer, which steps every group in
# one call, so max_grad_norm over two groups is exact too; one process: FusedSGD's fp32 master weights.
BF16 = {**_LARS, "max_grad_norm": CLIP, "split_bias": True}
BF16_CONFIG = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}


def make_model() -> nn.Module:
    """62 elements: ZeRO's partitions of 2 ranks split the first weight between them (rank 0 holds 40 of its
    48 elements, rank 1 the rest) and leave rank 0 nothing of the other tensors."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 1))


def make_optimizer(model: nn.Module, kwargs: dict[str, Any]) -> FusedSGD:
    kwargs = dict(kwargs)
    if not kwargs.pop("split_bias", False):
        return FusedSGD(model.parameters(), lr=LR, **kwargs)
    named = list(model.named_parameters())
    biases = {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lars": False}
    return FusedSGD([{"params": [p for n, p in named if not n.endswith("bias")]}, biases], lr=LR, **kwargs)


def batches(dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 8, generator=generator).to(dtype), torch.randn(8, 1, generator=generator).to(dtype))
        for _ in range(STEPS)
    ]


def _loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def one_process(name: str) -> dict[str, dict[str, torch.Tensor]]:
    """The unsharded run: FusedSGD on the whole model, the same batches (``bf16``: the bf16 run)."""
    dtype, kwargs = (
        (torch.bfloat16, {**BF16, "master_weights": True}) if name == "bf16" else (None, SCENARIOS[name][0])
    )
    model = make_model().to(dtype)
    optimizer = make_optimizer(model, kwargs)
    for x, y in batches(dtype):
        optimizer.zero_grad()
        _loss(model, x, y).backward()
        optimizer.step()
    return {
        "param": {n: p.detach().clone() for n, p in model.named_parameters()},
        "momentum_buffer": {
            n: optimizer.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()
        },
    }


def _config(stage: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0
        **extra,
    }


def _engine(stage: int, name: str, attach: bool = True) -> tuple[Any, FusedSGD, list[int]]:
    """A DeepSpeed engine over a new model and FusedSGD, attached; the list its optimizer's steps append their
    all_reduce counts to."""
    import deepspeed

    kwargs, extra, _ = (BF16, BF16_CONFIG, "bf16") if name == "bf16" else SCENARIOS[name]
    model = make_model().to(torch.bfloat16 if name == "bf16" else None)
    optimizer = make_optimizer(model, kwargs)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_config(stage, extra))
    if attach:
        attach_deepspeed(engine)
    counts: list[int] = []
    step = optimizer.step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        with counting_calls(dist, "all_reduce") as count:
            result = step(*args, **kwargs)
        counts.append(count[0])
        return result

    optimizer.step = counted_step  # DeepSpeed calls its optimizer's step once per param group
    return engine, optimizer, counts


def _train(engine: Any, data: list) -> None:
    for x, y in data:
        engine.backward(_loss(engine, x, y))
        engine.step()


def _snapshot(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Full weights (ZeRO gathers them into the model after each step) and momentum buffers, by parameter
    name: each rank's fragments of a buffer, read from its partition's state where DeepSpeed's map says,
    summed over the ranks. (DeepSpeed's safe_get_full_optimizer_state links the state once, after the first
    group's first step, and so misses the buffers of a second group, which do not exist yet then.)"""
    wrapper, named = engine.optimizer, list(engine.module.named_parameters())
    buffers = {}
    for name, param in named:
        full = torch.zeros(param.numel())
        mapping = param._hp_mapping
        if mapping is not None:
            index = next(i for i, group in enumerate(wrapper.bit16_groups) if any(p is param for p in group))
            state = wrapper.optimizer.state[wrapper.single_partition_of_fp32_groups[index]]["momentum_buffer"]
            hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
            full.narrow(0, lp.start, lp.numel).copy_(state.narrow(0, hp.start, hp.numel))
        dist.all_reduce(full)
        buffers[name] = full.view_as(param)
    return {"param": {n: p.detach().clone() for n, p in named}, "momentum_buffer": buffers}


def _fragments(engine: Any) -> list[int]:
    """How many elements of each model tensor this rank's partition holds."""
    return [
        0 if p._hp_mapping is None else p._hp_mapping.hp_fragment_address.numel
        for p in engine.module.parameters()
    ]


def _zero_runs(out: dict[str, Any], checkpoint_dir: Path) -> None:
    for stage in STAGES:
        for name in SCENARIOS:
            engine, _, counts = _engine(stage, name)
            _train(engine, batches())
            out[f"{name}_stage{stage}"] = {
                **_snapshot(engine),
                "all_reduces": counts,
                "fragments": _fragments(engine),
                "wrapper": type(engine.optimizer).__name__,
            }
    engine, _, counts = _engine(1, "bf16")
    _train(engine, batches(torch.bfloat16))
    out["bf16"] = {
        "param": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "all_reduces": counts,
        "wrapper": type(engine.optimizer).__name__,
    }
    stage, name = RESUMED
    data = batches()
    engine, _, _ = _engine(stage, name)
    _train(engine, data[:2])
    engine.save_checkpoint(str(checkpoint_dir), tag="step2")
    resumed, _, _ = _engine(stage, name)
    resumed.load_checkpoint(str(checkpoint_dir), tag="step2")
    _train(resumed, data[2:])
    out["resumed"] = _snapshot(resumed)


def _refused_step(out: dict[str, Any], name: str, engine: Any, optimizer: FusedSGD) -> None:
    """One step of ``engine``, which must be refused: ``out[name]`` its message, ``out[name + "_unchanged"]``
    whether the first partition kept its values."""
    partition = optimizer.param_groups[0]["params"][0]
    before = partition.clone()
    x, y = batches()[0]
    engine.backward(_loss(engine, x, y))
    try:
        engine.step()
    except ValueError as error:
        out[name] = str(error)
    out[f"{name}_unchanged"] = torch.equal(partition, before)


def _refusals(out: dict[str, Any]) -> None:
    # Not attached: the step is refused before it writes the partition.
    _refused_step(out, "unattached", *_engine(2, "lars", attach=False)[:2])
    # LARS beside an average of the weights, whose counts (one per partition) its fragments cannot share.
    engine, optimizer, _ = _engine(2, "lars")
    optimizer.param_groups[0]["ema_decay"] = 0.9
    _refused_step(out, "counts_in_fragments", engine, optimizer)
    # max_grad_norm where ZeRO steps two param groups one by one: no step sees the global norm.
    engine, optimizer, _ = _engine(2, "lars_weights_only", attach=False)
    optimizer.param_groups[0]["max_grad_norm"] = optimizer.param_groups[1]["max_grad_norm"] = CLIP
    try:
        attach_deepspeed(engine)
    except ValueError as error:
        out["two_groups_max_grad_norm"] = str(error)
    # DeepSpeed's own clipping, on by default (1.0), beside the optimizer's max_grad_norm.
    import deepspeed

    model = make_model()
    optimizer = make_optimizer(model, SCENARIOS["max_grad_norm"][0])
    config = {key: value for key, value in _config(2, {}).items() if key != "gradient_clipping"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    try:
        attach_deepspeed(engine)
    except ValueError as error:
        out["two_clippers"] = str(error)
    # ZeRO stage 3 gives no map of its partitions.
    try:
        _engine(3, "lars")
    except ValueError as error:
        out["stage3"] = str(error)


class CPUDeepSpeedStrategy(pl.strategies.DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy on the CPU, without its two checks for CUDA devices (the accelerator's
    type, and device indices that match the local ranks), and with a device index for DeepSpeed's engine to
    take as its rank's (``cpu:<local rank>`` is the CPU)."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)

    def setup_environment(self) -> None:
        pl.strategies.DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class Regression(pl.LightningModule):
    """The harness's model and batches under Lightning, with configure_fused_sgd (LARS) or a FusedSGD of its
    own (``own_max_grad_norm``)."""

    def __init__(self, own_max_grad_norm: float | None = None) -> None:
        super().__init__()
        self.net = make_model()
        self.own_max_grad_norm = own_max_grad_norm

    def training_step(self, batch, batch_idx):
        return _loss(self.net, *batch)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*map(torch.cat, zip(*batches()))), batch_size=8)

    def configure_optimizers(self):
        if self.own_max_grad_norm is not None:
            return FusedSGD(self.parameters(), lr=LR, momentum=0.9, max_grad_norm=self.own_max_grad_norm)
        return configure_fused_sgd(self, lr=LR, weight_decay=5e-4, lars=True, trust_coefficient=0.05)


def lightning_trainer(**kwargs: Any) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def _lightning_runs(out: dict[str, Any]) -> None:
    """configure_fused_sgd (LARS) under DeepSpeedStrategy with Trainer(gradient_clip_val): DeepSpeed clips,
    the step does not clip again, and the callback attached the engine. Every rank reads all the data
    (use_distributed_sampler=False), as the one-process run does."""
    for stage in STAGES:
        module = Regression()
        trainer = lightning_trainer(
            strategy=CPUDeepSpeedStrategy(stage=stage, process_group_backend="gloo"),
            devices=WORLD,
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        fused = trainer.optimizers[0].optimizer
        out[f"lightning_stage{stage}"] = {
            "param": {n: p.detach().clone() for n, p in module.net.named_parameters()},
            "deepspeed_clipping": trainer.strategy.config["gradient_clipping"],
            "max_grad_norm": [group["max_grad_norm"] for group in fused.param_groups],
        }
    trainer = lightning_trainer(
        strategy=CPUDeepSpeedStrategy(stage=2, process_group_backend="gloo"),
        devices=WORLD,
        use_distributed_sampler=False,
    )
    try:
        trainer.fit(Regression(own_max_grad_norm=1.0))
    except ValueError as error:
        out["lightning_two_clippers"] = str(error)


def worker(rank: int, port: int, result_path: str, checkpoint_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        NODE_RANK="0",
    )
    import deepspeed

    # DeepSpeed builds its CPU shared-memory op (only its inference all-reduce uses it) on first use: 25 s of
    # a cold 2-core CI machine for nothing these runs call.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    _zero_runs(out, Path(checkpoint_dir))
    _refusals(out)
    _lightning_runs(out)
    fragments = {
        key: value["fragments"]
        for key, value in out.items()
        if isinstance(value, dict) and "fragments" in value
    }
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, fragments)
    out["fragments_per_rank"] = gathered
    if rank == 0:
        torch.save(out, result_path)
    dist.barrier()
    dist.destroy_process_group()
    end_worker_process()
