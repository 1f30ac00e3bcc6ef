"""Parameter groups that keep biases and normalization parameters out of weight decay and LARS.

Large-batch recipes (Goyal et al. 2017; You et al. 2017; the MLPerf ResNet-50 LARS references) do
not decay biases and BatchNorm parameters, and do not LARS-adapt them: their norms carry no scale
information worth preserving, and a zero-initialized gamma would get a degenerate trust ratio.
:func:`param_groups` sorts a model's trainable parameters into at most four groups along those two
axes, with named parameters so a checkpoint can be remapped by name.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import numbers
import warnings
from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from lightning_fusedsgd._checks import check_flag

__all__ = ["NORM_MODULE_TYPES", "param_groups"]

logger = logging.getLogger(__name__)

#: Modules whose every parameter counts as a normalization parameter, whatever its shape.
#: ``_NormBase`` covers BatchNorm1d/2d/3d, SyncBatchNorm, the lazy variants and InstanceNorm1d/2d/3d.
#: LocalResponseNorm and CrossMapLRN2d hold no parameters today; they are listed so a subclass that
#: adds some is still classified as a norm.
NORM_MODULE_TYPES: tuple[type[nn.Module], ...] = (
    _NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
    nn.CrossMapLRN2d,
)

# (decay, lars) of each group, in emission order: the order is part of the checkpoint layout.
_GROUP_ORDER: tuple[tuple[bool, bool], ...] = (
    (True, True),
    (True, False),
    (False, True),
    (False, False),
)


def _group_name(decay: bool, lars: bool) -> str:
    """Name shown by Lightning's LearningRateMonitor, e.g. ``lr-FusedSGD/decay_lars``."""
    return f"{'decay' if decay else 'no_decay'}_{'lars' if lars else 'no_lars'}"


def _matches_any(names: Iterable[str], patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)


def _validate_patterns(extra_no_decay: Iterable[str]) -> tuple[str, ...]:
    # A bare string would be iterated character by character and match almost everything.
    if isinstance(extra_no_decay, str):
        raise TypeError(
            f"extra_no_decay must be a collection of patterns, got the string {extra_no_decay!r}; "
            f"write ({extra_no_decay!r},) instead"
        )
    patterns = tuple(extra_no_decay)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"extra_no_decay patterns must be strings, got {pattern!r}")
    return patterns


def _declared_no_decay(model: nn.Module) -> tuple[str, ...]:
    """The names ``model.no_weight_decay()`` declares (timm's convention); ``None`` declares none."""
    no_weight_decay = getattr(model, "no_weight_decay", None)
    declared = no_weight_decay() if callable(no_weight_decay) else None
    if declared is None:
        return ()
    if isinstance(declared, str):
        return (declared,)
    if not isinstance(declared, Iterable):
        raise TypeError(
            f"{type(model).__name__}.no_weight_decay() must return a collection of parameter names, got "
            f"{type(declared).__name__}: return e.g. {{'pos_embed', 'cls_token'}}"
        )
    names = tuple(declared)
    wrong = [name for name in names if not isinstance(name, str)]
    if wrong:
        raise TypeError(
            f"{type(model).__name__}.no_weight_decay() must return parameter names (strings), got "
            f"{wrong[:3]!r}: return the names, e.g. {{'pos_embed', 'cls_token'}}"
        )
    return names


def _warn_unmatched(
    model: nn.Module, aliases: dict[int, list[str]], patterns: tuple[str, ...], declared: tuple[str, ...]
) -> None:
    """Warns about patterns and declared names that match no parameter: most likely typos."""
    all_names = [name for names in aliases.values() for name in names]
    for source, names in (("extra_no_decay pattern", patterns), ("no_weight_decay() name", declared)):
        for pattern in names:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in all_names):
                warnings.warn(
                    f"param_groups: {source} {pattern!r} matches no parameter of {type(model).__name__}; "
                    "check its spelling against model.named_parameters()",
                    UserWarning,
                    stacklevel=3,
                )


def _sort_members(
    model: nn.Module,
    aliases: dict[int, list[str]],
    explicit_patterns: tuple[str, ...],
    no_decay_bias: bool,
    no_decay_norm: bool,
    no_lars_bias: bool,
    no_lars_norm: bool,
) -> dict[tuple[bool, bool], list[tuple[str, nn.Parameter]]]:
    """Each trainable parameter under its (decay, lars) key, by the categories of :func:`param_groups`."""
    norm_param_ids = {
        id(param)
        for module in model.modules()
        if isinstance(module, NORM_MODULE_TYPES)
        for param in module.parameters(recurse=False)
    }
    members: dict[tuple[bool, bool], list[tuple[str, nn.Parameter]]] = {key: [] for key in _GROUP_ORDER}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"parameter {name!r} is an uninitialized lazy parameter; run one forward pass "
                "before building parameter groups"
            )
        names = aliases[id(param)]
        if _matches_any(names, explicit_patterns):
            key = (False, False)
        elif id(param) in norm_param_ids:
            key = (not no_decay_norm, not no_lars_norm)
        elif any(alias.rpartition(".")[2] == "bias" for alias in names):
            key = (not no_decay_bias, not no_lars_bias)
        elif param.ndim <= 1:
            key = (not no_decay_norm, not no_lars_norm)
        else:
            key = (True, True)
        members[key].append((name, param))
    return members


def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    no_decay_bias: bool = True,
    no_decay_norm: bool = True,
    no_lars_bias: bool = True,
    no_lars_norm: bool = True,
    extra_no_decay: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """Split a model's trainable parameters into weight-decay / LARS groups.

    Each parameter falls in one category, checked in this order:

    * explicit: its name matches ``model.no_weight_decay()`` (timm convention, a collection of
      names) or an fnmatch pattern in ``extra_no_decay``. These get no decay **and** no LARS: they
      are embeddings and tokens (``pos_embed``, ``cls_token``) whose norm is meaningful and which
      a trust ratio tied to weight decay should leave alone, as timm's ``Lars`` also does for
      undecayed groups.
    * norm: any parameter of a normalization module (:data:`NORM_MODULE_TYPES`), whatever its
      shape, so a LayerNorm over a 2-D shape is still caught. Governed by ``no_decay_norm`` and
      ``no_lars_norm``.
    * bias: registered under the attribute name ``bias`` on a non-norm module. Governed by
      ``no_decay_bias`` and ``no_lars_bias``.
    * other scale: any remaining parameter with ``ndim <= 1`` (layer-scale gains, PReLU slopes,
      scalar gates). These behave like a norm's gamma, so they follow the norm switches.
    * everything else keeps ``weight_decay`` and is eligible for LARS.

    Only exclusions are written into the groups: an excluded group says ``lars=False``, an eligible one
    has no ``lars`` key, so the optimizer's own ``lars`` argument decides whether LARS runs on it
    (``FusedSGD(param_groups(model, 1e-4), lars=False)`` is plain SGD on every tensor;
    ``FusedLARS(param_groups(model, 1e-4))`` adapts the eligible ones).

    Frozen parameters (``requires_grad=False``) are left out; a parameter shared by several modules
    appears once, under its first name in ``model.named_parameters()``, and counts as a norm or bias
    parameter if any of the modules holding it says so.

    Args:
        model: The model whose parameters to group.
        weight_decay: Weight decay of the decayed groups; must be finite and >= 0.
        no_decay_bias: Give biases ``weight_decay=0``.
        no_decay_norm: Give normalization (and other ndim <= 1) parameters ``weight_decay=0``.
        no_lars_bias: Give biases ``lars=False``.
        no_lars_norm: Give normalization (and other ndim <= 1) parameters ``lars=False``.
        extra_no_decay: fnmatch patterns over parameter names (e.g. ``"*.pos_embed"``,
            ``"cls_token"``) for parameters with neither decay nor LARS. A pattern matching no
            parameter of the model triggers a warning, since it is most likely a typo.

    Returns:
        The non-empty groups among (decay, LARS), (decay only), (LARS only), (neither), in that
        order. Each is a dict with ``params`` (a list of ``(name, parameter)`` tuples in
        ``model.named_parameters()`` order, which ``torch.optim.Optimizer`` splits into ``params``
        and ``param_names``), ``weight_decay``, ``lars=False`` for groups excluded from LARS, and
        ``name`` (used by Lightning's LearningRateMonitor; ``lars`` in a name means eligible). A group
        layout is the same run to run for the same model and flags.

    Raises:
        TypeError: If ``model`` is not an ``nn.Module`` or ``extra_no_decay`` is not a collection
            of strings.
        ValueError: If ``weight_decay`` is negative or not finite, a switch is a string (a config's
            ``"false"``), the model has no trainable
            parameters, or it still holds uninitialized lazy parameters.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"param_groups expects an nn.Module, got {type(model).__name__}")
    is_number = isinstance(weight_decay, numbers.Real) and not isinstance(weight_decay, bool)
    if not (is_number and math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    switches = dict(
        no_decay_bias=no_decay_bias,
        no_decay_norm=no_decay_norm,
        no_lars_bias=no_lars_bias,
        no_lars_norm=no_lars_norm,
    )
    for key, value in switches.items():
        check_flag(key, value)
    patterns = _validate_patterns(extra_no_decay)

    declared = _declared_no_decay(model)

    # Every name under which each tensor is registered, so tied parameters are judged by all aliases.
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    _warn_unmatched(model, aliases, patterns, declared)
    members = _sort_members(
        model, aliases, patterns + declared, no_decay_bias, no_decay_norm, no_lars_bias, no_lars_norm
    )

    groups = [
        {
            "params": named_params,
            "weight_decay": float(weight_decay) if decay else 0.0,
            **({} if lars else {"lars": False}),
            "name": _group_name(decay, lars),
        }
        for (decay, lars), named_params in members.items()
        if named_params
    ]
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters (all have requires_grad=False)")
    logger.info(
        "param_groups: %s",
        "; ".join(
            f"{group['name']} (wd={group['weight_decay']:g}): {len(group['params'])} tensors, "
            f"{sum(p.numel() for _, p in group['params']):,} params"
            for group in groups
        ),
    )
    return groups
