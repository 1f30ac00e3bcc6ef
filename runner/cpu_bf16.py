"""A guard for a PyTorch fault that bf16 runs on the CPU would train into: oneDNN's bf16 convolution backward
writes wrong weight gradients where a padded convolution's input is narrower than its stride
(docs/upstream/onednn-bf16-conv-backward.md)."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from torch import nn

from lightning_fusedsgd.lightning import ConfigError

__all__ = ["check_cpu_bf16_convolutions", "narrow_convolutions", "onednn_runs_bf16_convolutions"]

# Instruction sets at which oneDNN leaves bf16 convolutions to PyTorch's own kernels (ONEDNN_MAX_CPU_ISA).
_ONEDNN_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI")


def narrow_convolutions(model: nn.Module, images: torch.Tensor) -> list[tuple[str, tuple[int, int], int]]:
    """The padded 2-d convolutions whose input is narrower than their stride in a forward of ``images``
    (name, input height and width, stride); the model is run in eval mode, without gradients, and left as it
    was."""
    found = []

    def record(name: str, conv: nn.Conv2d, inputs: tuple[torch.Tensor, ...]) -> None:
        height, width = inputs[0].shape[-2:]
        padded = conv.padding == "same" or conv.padding[1] > 0
        if padded and width < conv.stride[1]:
            found.append((name, (height, width), conv.stride[1]))

    hooks = [
        module.register_forward_pre_hook(lambda conv, inputs, name=name: record(name, conv, inputs))
        for name, module in model.named_modules()
        if isinstance(module, nn.Conv2d)
    ]
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(images)
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    return found


def onednn_runs_bf16_convolutions() -> bool:
    """Whether PyTorch hands bf16 convolutions on the CPU to oneDNN, whose backward has the fault: oneDNN
    enabled, a CPU PyTorch deems bf16-capable for it (AVX-512; without it PyTorch keeps bf16 convolutions in
    its own kernels), and no ``ONEDNN_MAX_CPU_ISA`` below oneDNN's bf16 instruction sets."""
    return (
        torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() not in _ONEDNN_WITHOUT_BF16
    )


def check_cpu_bf16_convolutions(
    trainer: pl.Trainer, model: pl.LightningModule, in_channels: int, image_size: int
) -> None:
    """Refuses a bf16 run on the CPU (``bf16-true``; ``bf16-mixed``, which ``16-mixed`` becomes there) whose
    model has a convolution oneDNN would give wrong weight gradients, where oneDNN runs bf16 convolutions
    (:func:`onednn_runs_bf16_convolutions`); elsewhere PyTorch's own kernels compute them right.

    Raises:
        ConfigError: Naming the convolution and the fixes.
    """
    if not (
        isinstance(trainer.accelerator, CPUAccelerator)
        and trainer.precision in ("bf16-true", "bf16-mixed")
        and onednn_runs_bf16_convolutions()
    ):
        return
    narrow = narrow_convolutions(model, torch.zeros(1, in_channels, image_size, image_size))
    if not narrow:
        return
    seen = ", ".join(f"{name} ({h}x{w} with stride {stride})" for name, (h, w), stride in narrow)
    raise ConfigError(
        f"trainer.precision={trainer.precision} on the CPU would train into garbage: oneDNN's bf16 "
        "convolution backward-weights kernels (jit avx512_core_bf16 / avx512_core, AMX brgconv), which "
        "PyTorch uses on this AVX-512 CPU, write wrong weight gradients where a padded convolution's input "
        f"is narrower than its stride, as here at data.image_size={image_size}: {seen}. Use larger images "
        "(data.image_size), trainer.precision=32, or opt out of those kernels with ONEDNN_MAX_CPU_ISA=AVX2 "
        "in the environment (oneDNN then leaves bf16 convolutions to PyTorch's slower kernels). See "
        "docs/upstream/onednn-bf16-conv-backward.md."
    )
