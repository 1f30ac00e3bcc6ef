"""The FusedSGD behind what Lightning hands a hook or a callback."""

from __future__ import annotations

from typing import Any

from lightning_fusedsgd.optim import FusedSGD


def fused_sgd_of(optimizer: Any) -> FusedSGD | None:
    """The FusedSGD behind ``optimizer``: itself, or inside Lightning's ``LightningOptimizer`` or a DeepSpeed
    optimizer wrapper (each keeps what it wraps as ``optimizer``); None for another optimizer."""
    for _ in range(3):
        if isinstance(optimizer, FusedSGD):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None
