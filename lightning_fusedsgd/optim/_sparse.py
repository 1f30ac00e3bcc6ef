"""Params with sparse gradients (``nn.Embedding(sparse=True)``): stepped through torch.optim.SGD's own
single-tensor path, with their group's hyperparameters and momentum buffers (the plan refuses, before anything
is written, a group that asks for what only the fused kernel does)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.optim.sgd import sgd

from lightning_fusedsgd import _abi
from lightning_fusedsgd.ops import reference

# torch.optim.SGD's momentum buffer, which its sparse path reads and writes (FusedSGD's slot of that key).
_BUFFER = "momentum_buffer"


def step_sparse(
    sparse: Sequence[tuple[Tensor, int]],
    groups: Sequence[dict[str, Any]],
    state: Mapping[Tensor, dict[str, Any]],
    grad_scale: Tensor | None,
) -> None:
    """Steps each (param, group index) of ``sparse``; under a GradScaler the gradients are unscaled first, as
    GradScaler.unscale_ does."""
    inv_scale = reference.inverse_scale(grad_scale)
    for group_index in dict.fromkeys(index for _, index in sparse):
        group = groups[group_index]
        params = [param for param, index in sparse if index == group_index]
        grads = [p.grad if grad_scale is None else p.grad * inv_scale.to(p.grad.device) for p in params]
        buffers = [state.get(p, {}).get(_BUFFER) for p in params]
        sgd(
            params,
            grads,
            buffers,
            has_sparse_grad=True,
            foreach=False,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
        )
        if _abi.keeps_momentum_buffer(group):
            for param, buffer in zip(params, buffers):
                state[param][_BUFFER] = buffer
