"""Loading a FusedSGD state dict: checked before anything changes, remapped by parameter name where it is
grouped differently, state dicts of earlier versions brought up to date, and the state kept in its own dtypes
(torch's loader casts every state tensor to its param's)."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_fusedsgd import _abi, _checks
from lightning_fusedsgd.checkpoint import (
    InvalidOptimizerStateError,
    check_optimizer_state_dict,
    remap_optimizer_state_dict,
    same_param_layout,
)
from lightning_fusedsgd.optim._plan import check_state_shapes

# Earlier versions counted stochastic steps per group, under the key the per-param count's slot has now.
_GROUP_ROUNDING_STEP = "rounding_step"


def load(
    optimizer: Optimizer, state_dict: dict[str, Any], torch_load: Callable[[dict[str, Any]], None]
) -> None:
    """Loads ``state_dict`` into ``optimizer`` through ``torch_load`` (torch.optim.Optimizer's loader), with
    the optimizer's load hooks run around the whole (see ``FusedSGD.load_state_dict``)."""
    state_dict = state_dict.copy()  # shallow, as torch: a pre-hook may edit it
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    check_loadable(state_dict, optimizer.defaults)
    saved_groups = state_dict["param_groups"]
    state_dict = rounding_steps_in_state(state_dict)
    if not same_param_layout(state_dict, optimizer.param_groups):
        # A different grouping (e.g. torch.optim.SGD's one group for our two): move state by name.
        state_dict = remap_optimizer_state_dict(state_dict, optimizer.param_groups, source="optimizer state")
    kept_dtypes = state_in_its_dtypes(state_dict, optimizer.param_groups)
    current = [dict(group) for group in optimizer.param_groups]
    # torch's loader casts every state tensor to its param's dtype; the hooks ran above, and the post hooks
    # run below, once the fp32 and int64 state is back.
    pre_hooks = optimizer._optimizer_load_state_dict_pre_hooks
    post_hooks = optimizer._optimizer_load_state_dict_post_hooks
    optimizer._optimizer_load_state_dict_pre_hooks = type(pre_hooks)()
    optimizer._optimizer_load_state_dict_post_hooks = type(post_hooks)()
    try:
        torch_load(state_dict)
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks = pre_hooks
        optimizer._optimizer_load_state_dict_post_hooks = post_hooks
    for group, before in zip(optimizer.param_groups, current):
        for key, value in before.items():
            group.setdefault(key, value)
    for param, values in kept_dtypes.items():
        optimizer.state[param].update(values)
    _say_missing_state(optimizer)
    _say_missing_group_state(optimizer, saved_groups)
    for hook in post_hooks.values():
        hook(optimizer)


def _say_missing_group_state(optimizer: Optimizer, saved_groups: list[dict[str, Any]]) -> None:
    """Warns, once for the load, of the group state (``_abi.GROUP_STATE``: schedule-free SGD's) the optimizer
    keeps that saved groups lack, which the loaded groups take from the optimizer's."""
    lacking = {
        key: count
        for key in _abi.GROUP_STATE
        if key in optimizer.defaults and (count := sum(key not in group for group in saved_groups))
    }
    if lacking:
        said = ", ".join(f"{key} in {count} of {len(saved_groups)}" for key, count in lacking.items())
        warnings.warn(
            f"{type(optimizer).__name__}.load_state_dict: the loaded groups lack schedule-free SGD's state "
            f"of a group: {said} (a checkpoint of another optimizer has none). They keep this optimizer's "
            "own values (a new optimizer's are those before its first step).",
            UserWarning,
            stacklevel=4,
        )


def _say_missing_state(optimizer: Optimizer) -> None:
    """Warns, once for the load, of each slot declared ``missing_said`` that loaded params (those with an
    entry in the loaded state) lack where their groups hold it, and how many params start it anew."""
    loaded = [
        (group, param)
        for group in optimizer.param_groups
        for param in group["params"]
        if param in optimizer.state
    ]
    missing = {
        slot: count
        for slot in _abi.SLOTS
        if slot.missing_said
        and (
            count := sum(
                optimizer.state[param].get(slot.key) is None and slot.held(group, param.dtype)
                for group, param in loaded
            )
        )
    }
    if not missing:
        return
    lacking = ", ".join(
        f"no {slot.key} for {count} params whose groups keep one ({slot.option})"
        for slot, count in missing.items()
    )
    warnings.warn(
        f"{type(optimizer).__name__}.load_state_dict: the loaded state has {lacking} (a checkpoint from "
        "before they were kept, another optimizer's or an edited one): each starts anew, from the weights (a "
        "count from 0), without the history a checkpoint carries.",
        UserWarning,
        stacklevel=4,
    )


def check_loadable(state_dict: Any, defaults: Mapping[str, Any]) -> None:
    """Refuses, before anything changes, a state dict that is not an optimizer's, holds values that cannot be
    optimizer state, or whose groups have hyperparameters FusedSGD refuses or group state (schedule-free's
    mode and scalars) that is not of its kind."""
    check_optimizer_state_dict(state_dict)
    _check_state_keys(state_dict)
    for index, saved in enumerate(state_dict["param_groups"]):
        group = {**defaults, **{k: v for k, v in saved.items() if k in defaults}}
        try:
            _checks.check_group(group)
        except ValueError as error:
            raise ValueError(f"saved param_groups[{index}]: {error}") from None
        for key in (key for key in _abi.GROUP_STATE if key in defaults and key in saved):
            problem = _group_state_problem(_abi.GROUP_STATE[key], saved[key])
            if problem is not None:
                raise ValueError(
                    f"saved param_groups[{index}]: its {key} is {_shown(saved[key])}, but {problem}: the "
                    "state dict is damaged or not a schedule-free optimizer's. Load the state the run saved "
                    "(optimizer.state_dict())."
                )


def _check_state_keys(state_dict: Mapping[str, Any]) -> None:
    """Refuses per-param state under keys that are no slot of FusedSGD (``_abi.SLOTS``): another optimizer's
    (Adam's ``exp_avg``, say), which torch's loader would keep beside FusedSGD's without a word. A ``step``
    (other optimizers' count) is left to torch's loader, as ``torch.optim.SGD`` leaves it."""
    slots = set(_abi.slot_keys())
    foreign = sorted({key for entry in state_dict["state"].values() for key in entry} - slots - {"step"})
    if foreign:
        found, kept = ", ".join(map(repr, foreign)), ", ".join(sorted(slots))
        raise InvalidOptimizerStateError(
            f"the optimizer state dict holds per-parameter state {found}, which is no state of FusedSGD (it "
            f"keeps {kept}): it is another optimizer's. Load it into the optimizer that saved it, or start "
            "this one without optimizer state (weights only)."
        )


def _group_state_problem(start: Any, value: Any) -> str | None:
    """Why ``value`` cannot be a group's state whose value before the first step is ``start``
    (``_abi.GROUP_STATE``): a mode is a bool, a count (an int) an int >= 0, a scalar a finite number; a
    number may be a 0-d tensor (as a step leaves it)."""
    if isinstance(start, bool):
        return None if isinstance(value, bool) else "it is a mode, True or False"
    if isinstance(value, Tensor):
        if value.dim() != 0 or value.is_complex():
            return "it is one real number (a float, an int or a 0-d tensor)"
        value = value.item()
    if isinstance(start, int):
        whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
        return None if whole and value >= 0 and not isinstance(value, bool) else "it is a count, an int >= 0"
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return None if real and math.isfinite(value) else "it is a finite number"


def _shown(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


def rounding_steps_in_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict with the counts of stochastic steps in each param's state, where a checkpoint of an
    earlier version counts them per group (``group["rounding_step"]``, the same for each of its params). The
    input is not modified."""
    groups = state_dict["param_groups"]
    if not any(_GROUP_ROUNDING_STEP in group for group in groups):
        return state_dict
    state = dict(state_dict["state"])
    for group in (group for group in groups if _GROUP_ROUNDING_STEP in group):
        count = group[_GROUP_ROUNDING_STEP]
        for index in group["params"]:
            # Each param with state takes its count, 0 too (not missing then); one without takes a count > 0.
            saved = state.get(index)
            if (count or saved is not None) and _GROUP_ROUNDING_STEP not in (saved or {}):
                state[index] = {**(saved or {}), _GROUP_ROUNDING_STEP: torch.tensor(count, dtype=torch.int64)}
    return {
        **state_dict,
        "state": state,
        "param_groups": [{k: v for k, v in group.items() if k != _GROUP_ROUNDING_STEP} for group in groups],
    }


def state_in_its_dtypes(
    state_dict: dict[str, Any], groups: list[dict[str, Any]]
) -> dict[Tensor, dict[str, Tensor]]:
    """The state whose slot's dtype is not its param's, as it will be stored (``Slot.dtype``: the fp32
    momentum buffers and masters of master-weighted bf16/fp16 params, the int64 counts of stochastic steps);
    checks every saved slot's shape first (``check_state_shapes``: a count one number, the rest the param's
    shape). The dtypes are those of the groups as loaded (the saved ones, or the optimizer's where the state
    was remapped by name), not as constructed."""
    saved_groups = state_dict["param_groups"]
    if len(groups) != len(saved_groups) or any(
        len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)
    ):
        return {}  # torch's loader refuses it
    id_to_param = {
        saved_id: (group_index, param_index, param)
        for group_index, (group, saved) in enumerate(zip(groups, saved_groups))
        for param_index, (saved_id, param) in enumerate(zip(saved["params"], group["params"]))
    }
    kept = {}
    for saved_id, saved_state in state_dict["state"].items():
        if saved_id not in id_to_param:
            continue
        group_index, param_index, param = id_to_param[saved_id]
        # Named by the optimizer's param_names, or else the saved ones.
        named = next((g for g in (groups, saved_groups) if g[group_index].get("param_names")), groups)
        check_state_shapes(saved_state, named[group_index], group_index, param_index, param)
        loaded = {**groups[group_index], **saved_groups[group_index]}
        dtypes = {slot.key: slot.dtype(loaded, param.dtype) for slot in _abi.SLOTS}
        kept[param] = {
            key: saved_state[key].to(device=param.device, dtype=dtype, copy=True)
            for key, dtype in dtypes.items()
            if isinstance(saved_state.get(key), Tensor) and dtype != param.dtype
        }
    return kept
