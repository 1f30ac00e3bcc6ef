"""FusedLARS: FusedSGD with LARS on by default, for configs that name an optimizer class."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from lightning_fusedsgd.optim.sgd import FusedSGD


class FusedLARS(FusedSGD):
    """FusedSGD with LARS on by default, for configs that name an optimizer class.

    Its signature is FusedSGD's with ``lars=True`` (set as ``__signature__``, which LightningCLI, Hydra and
    ``inspect`` read), so the two cannot drift. Groups can still turn LARS off per group (``lars=False``), as
    ``param_groups`` does for biases and normalization parameters.
    """

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("lars", True)
        super().__init__(params, *args, **kwargs)


def _with_default(function: Callable[..., Any], **defaults: Any) -> inspect.Signature:
    signature = inspect.signature(function)
    return signature.replace(
        parameters=[
            parameter.replace(default=defaults[name]) if name in defaults else parameter
            for name, parameter in signature.parameters.items()
        ]
    )


FusedLARS.__init__.__signature__ = _with_default(FusedSGD.__init__, lars=True)
