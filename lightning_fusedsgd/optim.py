"""FusedSGD and FusedLARS: drop-in ``torch.optim.SGD`` whose update runs in one compiled call per bucket."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_fusedsgd import kernels, reference
from lightning_fusedsgd.checkpoint import (
    check_optimizer_state_dict,
    remap_optimizer_state_dict,
    same_param_layout,
)
from lightning_fusedsgd.reference import HPARAM_COLUMNS

LARS_DENOMINATORS = ("grad_plus_decay", "decayed_grad")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Complex params are stepped as their real views, as torch.optim.SGD does.
_SUPPORTED_DTYPES = (torch.float32, torch.float64, *_LOW_PRECISION, torch.complex64, torch.complex128)
_NO_STATE: dict[str, Any] = {}


@dataclass
class _Bucket:
    """The tensors of one (device, dtype, master weights) bucket, in the kernel's argument order."""

    params: list[Tensor] = field(default_factory=list)  # dense views: real views of complex params
    sources: list[Tensor] = field(default_factory=list)  # the optimizer's params behind them
    grads: list[Tensor] = field(default_factory=list)
    momentum_buffers: list[Tensor | None] = field(default_factory=list)
    master_params: list[Tensor] = field(default_factory=list)
    tensor_group: list[int] = field(default_factory=list)
    first_step: list[bool] = field(default_factory=list)


def _is_dense(tensor: Tensor) -> bool:
    """Whether the kernel can walk the tensor's storage as a flat array (contiguous or channels_last)."""
    return (
        tensor.is_contiguous()
        or (tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last))
        or (tensor.dim() == 5 and tensor.is_contiguous(memory_format=torch.channels_last_3d))
    )


def _param_label(group: dict[str, Any], group_index: int, param_index: int, param: Tensor) -> str:
    names = group.get("param_names")
    if names:
        return f"'{names[param_index]}'"
    return f"parameter {param_index} of group {group_index} (shape {tuple(param.shape)})"


def _has_internal_overlap(tensor: Tensor) -> bool:
    """Whether elements of ``tensor`` share memory (an ``expand()``ed tensor): no step can write it."""
    return any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride()))


def _element_offsets(tensor: Tensor) -> Tensor:
    """The storage offset of every element of ``tensor``."""
    offsets = torch.full((), tensor.storage_offset(), dtype=torch.int64)
    for size, stride in zip(tensor.shape, tensor.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return offsets.flatten()


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors whose address ranges intersect share an element (exactly, for one dtype)."""
    if a.dtype != b.dtype or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True
    return bool(torch.isin(_element_offsets(a), _element_offsets(b)).any())


def _check_no_overlap(stepped: list[tuple[Tensor, str]]) -> None:
    """Refuses params that are overlapping views of one storage: one fused call would update the shared
    elements from two threads at once, where torch.optim.SGD updates them one param after the other."""
    spans = []  # (device, first byte, end byte, label, param), sorted by device and first byte
    for param, label in stepped:
        if param.numel():
            extent = 1 + sum((size - 1) * stride for size, stride in zip(param.shape, param.stride()))
            start = param.data_ptr()
            spans.append((str(param.device), start, start + extent * param.element_size(), label, param))
    spans.sort(key=lambda span: span[:2])
    for i, (device, _, end, label, param) in enumerate(spans):
        for next_device, next_start, _, next_label, next_param in spans[i + 1 :]:
            if next_device != device or next_start >= end:
                break
            if not _overlap(param, next_param):
                continue
            raise ValueError(
                f"{label} and {next_label} are overlapping views of one tensor's memory, so one step would "
                "update the shared elements twice: pass parameters that do not overlap (e.g. the base tensor "
                "once, or views that split it), or use torch.optim.SGD for this case."
            )


def _real(tensor: Tensor) -> Tensor:
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _check_steppable(param: Tensor, label: str) -> None:
    """Refuses, before anything is written, a param that no step of ours can update."""
    if param.grad.is_sparse:
        raise RuntimeError(
            f"FusedSGD does not support sparse gradients ({label}): use torch.optim.SparseAdam "
            "for it, or dense gradients (e.g. nn.Embedding(sparse=False))."
        )
    if param.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"FusedSGD cannot step {label}: its dtype is {param.dtype}. Parameters must be floating point "
            "(float32, float64, bfloat16, float16) or complex64/complex128; convert it, or leave it out of "
            "the optimizer."
        )
    if param.grad.shape != param.shape:
        raise ValueError(
            f"The gradient of {label} has shape {tuple(param.grad.shape)} but the parameter has shape "
            f"{tuple(param.shape)}: assign a gradient of the parameter's shape."
        )
    if _has_internal_overlap(param):
        raise ValueError(
            f"FusedSGD cannot step {label}: it is an expand()ed view whose elements share memory "
            f"(strides {param.stride()}), so no in-place update can write it. Make it a real tensor, e.g. "
            "nn.Parameter(tensor.clone()), or leave it out of the optimizer."
        )


def _check_hyperparameters(group: dict[str, Any]) -> None:
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"lr as a Tensor must have one element, got shape {tuple(lr.shape)}")
    for name in ("lr", "momentum", "weight_decay"):
        if group[name] < 0:
            raise ValueError(f"Invalid {name}: {float(group[name])}. It must be >= 0.")
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError(
            "Nesterov momentum requires momentum > 0 and dampening = 0 "
            f"(got momentum={group['momentum']}, dampening={group['dampening']}): "
            "set nesterov=False or choose a positive momentum with zero dampening."
        )
    if group["lars_denominator"] not in LARS_DENOMINATORS:
        raise ValueError(
            f"Unknown lars_denominator {group['lars_denominator']!r}; choose one of {LARS_DENOMINATORS}."
        )
    if group["trust_coefficient"] <= 0 or group["lars_eps"] < 0:
        raise ValueError(
            f"LARS needs trust_coefficient > 0 and lars_eps >= 0 "
            f"(got {group['trust_coefficient']} and {group['lars_eps']})."
        )


class FusedSGD(Optimizer):
    """SGD with momentum whose update runs in one compiled multi-tensor call per (device, dtype).

    The semantics are those of ``torch.optim.SGD`` (per-parameter first-step seeding of the momentum
    buffer, no buffer when momentum is 0, per-group hyperparameters, closures, named parameters), plus
    TransformerEngine's ``wd_after_momentum``, fp32 master weights for bf16/fp16 params, in-kernel
    GradScaler unscaling, and LARS (You et al. 2017) fused into the same call. State is stored as torch
    stores it (``state[p]["momentum_buffer"]``), with master weights in ``state[p]["master_param"]``, so
    checkpoints move both ways between ``torch.optim.SGD`` and this class.

    Args:
        params: Parameters, named parameters, or parameter-group dicts.
        lr: Learning rate (float or 0-d tensor). The default, 0.1, is TransformerEngine's FusedSGD's;
            ``torch.optim.SGD``'s is 1e-3, so pass ``lr`` when replacing it.
        momentum: Momentum factor mu.
        dampening: Dampening tau for momentum.
        weight_decay: Coupled L2 penalty lambda.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening = 0).
        maximize: Maximize the objective instead of minimizing it.
        wd_after_momentum: Add ``lambda * w`` after the momentum update instead of to the gradient, so
            the decay stays out of the buffer (TransformerEngine's option).
        master_weights: Keep an fp32 copy and fp32 momentum for bf16/fp16 params; the kernel updates the
            copy and writes the rounded value back to the param. A param written outside the optimizer
            (``load_state_dict``, ``p.data.copy_``, EMA swaps) no longer holds its copy's rounding: the
            kernel then takes the param's value as the copy, element by element.
        set_grad_none: Default of ``zero_grad(set_to_none=...)``.
        backend: ``"auto"``, ``"compiled"``, ``"torch"`` or ``"torch_fused"`` (see ``kernels``).
        lars: Apply the LARS trust ratio (a per-group key too: ``param_groups`` sets ``lars=False`` on the
            groups it excludes, and this argument decides for the others).
        trust_coefficient: LARS eta.
        lars_eps: LARS epsilon in the denominator.
        trust_clip: LARC's clip, ``r <- min(r / lr, 1)``.
        lars_denominator: ``"grad_plus_decay"`` (``||g|| + lambda ||w||``, You et al., MLPerf) or
            ``"decayed_grad"`` (``||g + lambda w||``).
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 0.1,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        wd_after_momentum: bool = False,
        master_weights: bool = False,
        set_grad_none: bool = True,
        backend: str = "auto",
        lars: bool = False,
        trust_coefficient: float = 0.001,
        lars_eps: float = 0.0,
        trust_clip: bool = False,
        lars_denominator: str = "grad_plus_decay",
    ) -> None:
        if backend not in kernels.BACKENDS:
            raise ValueError(f"Unknown backend {backend!r}; choose one of {kernels.BACKENDS}.")
        params = list(params) if not isinstance(params, Tensor) else [params]
        if not params:
            raise ValueError(
                "FusedSGD got an empty parameter list: pass model.parameters() (or parameter groups) "
                "containing at least one tensor; check that not every parameter is frozen or filtered out."
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            wd_after_momentum=wd_after_momentum,
            master_weights=master_weights,
            lars=lars,
            trust_coefficient=trust_coefficient,
            lars_eps=lars_eps,
            trust_clip=trust_clip,
            lars_denominator=lars_denominator,
        )
        _check_hyperparameters(defaults)
        self.set_grad_none = set_grad_none
        self.backend = backend
        self._cached_plan: _CachedPlan | None = None
        self._checked_hparams: list[tuple[Any, ...]] | None = None
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validates the group's hyperparameters and devices before adding it (nothing added on error)."""
        merged = {**self.defaults, **param_group}
        _check_hyperparameters(merged)
        params = param_group["params"]
        # Materialized once: a generator (model.parameters()) would be used up by the checks below.
        params = param_group["params"] = [params] if isinstance(params, Tensor) else list(params)
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        devices = {p.device for p in tensors if isinstance(p, Tensor)}
        if len(devices) > 1:
            raise ValueError(
                f"All parameters of one group must be on one device, got {sorted(map(str, devices))}: "
                "move the model to one device before building the optimizer, or use one group per device."
            )
        if len({id(p) for p in tensors}) != len(tensors):
            # torch.optim only warns; in one fused call a repeated tensor would be updated twice at once.
            raise ValueError("A parameter group lists the same parameter twice: pass each parameter once.")
        super().add_param_group(param_group)
        self._cached_plan = None

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer pickles only defaults, state and groups; keep our settings too.
        return {**super().__getstate__(), "set_grad_none": self.set_grad_none, "backend": self.backend}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._cached_plan = None
        self._checked_hparams = None

    def _check_groups(self) -> None:
        """Validates the groups' hyperparameters when they changed since the last check: a group dict can
        be edited at any time, and a bad value must fail before anything is written."""
        values = [tuple(map(group.get, self.defaults)) for group in self.param_groups]
        if values == self._checked_hparams:
            return
        for index, group in enumerate(self.param_groups):
            try:
                _check_hyperparameters(group)
            except ValueError as error:
                raise ValueError(f"param_groups[{index}]: {error}") from None
        self._checked_hparams = values

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clears gradients; ``set_to_none`` defaults to the constructor's ``set_grad_none``."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs one optimization step.

        Under a GradScaler (``optimizer.grad_scale`` / ``optimizer.found_inf`` set by it), gradients are
        unscaled inside the kernel and a step with ``found_inf`` changes nothing at all.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf: Tensor | None = getattr(self, "found_inf", None)

        cached = self._cached_plan
        if cached is not None and cached.matches(self):
            # On CUDA the kernel reads found_inf itself: reading it here would synchronize.
            if found_inf is not None and found_inf.device.type == "cpu" and bool(found_inf.item()):
                return loss
            if cached.step.run(
                self._hparam_table(),
                None if grad_scale is None else grad_scale.to(cached.device),
                None if found_inf is None else found_inf.to(cached.device),
            ):
                return loss
        buckets, new_state, staged = self._plan()
        if found_inf is not None and (found_inf.device.type == "cpu" or new_state) and bool(found_inf.item()):
            # Skipped step: nothing is written, and no (uninitialized) buffer is stored. On CUDA this syncs
            # only on steps that would create state; otherwise the kernels skip on found_inf themselves.
            return loss
        table = self._hparam_table()
        # Resolve every backend before running any, so a refusal leaves all buckets untouched.
        step_functions = [
            (device, bucket, self._step_function(device, bucket, table))
            for (device, _, _), bucket in buckets.items()
        ]
        for device, bucket, step_fn in step_functions:
            step_fn(
                bucket.params,
                bucket.grads,
                bucket.momentum_buffers,
                bucket.master_params,
                table,
                bucket.tensor_group,
                bucket.first_step,
                None if grad_scale is None else grad_scale.to(device),
                None if found_inf is None else found_inf.to(device),
            )
        for param, dense in staged:
            param.copy_(dense)
        for param, key, value in new_state:
            if value is None:
                del self.state[param][key]
            else:
                self.state[param][key] = value
        devices = {device for device, _, _ in buckets}
        device = devices.pop() if len(devices) == 1 else None  # one device: the scalars move once
        reusable = (
            device is not None
            and not new_state
            and not staged
            and device.type in kernels.EXTENSIONS
            and self.backend in ("auto", "compiled")
            and kernels.compiled_or_fallback(self.backend, device.type) == "compiled"
        )
        self._cached_plan = _CachedPlan.capture(self, buckets, device) if reusable else None
        return loss

    def _hparam_table(self) -> Tensor:
        rows = []
        for group in self.param_groups:
            values = {
                **group,
                "lr": float(group["lr"]),
                "lars_decayed_grad": group["lars_denominator"] == "decayed_grad",
            }
            rows.append([float(values[name]) for name in HPARAM_COLUMNS])
        return torch.tensor(rows, dtype=torch.float64)

    def _plan(
        self,
    ) -> tuple[dict[tuple, _Bucket], list[tuple[Tensor, str, Tensor | None]], list[tuple[Tensor, Tensor]]]:
        """Validates every parameter and gathers the kernel inputs, changing nothing.

        Returns the buckets, the state entries to store once the kernels ran (new buffers and masters,
        buffers converted to the param's layout or to fp32, and ``None`` for a master to drop because its
        group turned master weights off), and the (param, dense copy) pairs of params that are not dense
        and are updated through a copy.
        """
        buckets: dict[tuple, _Bucket] = {}
        new_state: list[tuple[Tensor, str, Tensor | None]] = []
        staged: list[tuple[Tensor, Tensor]] = []
        stepped: list[tuple[Tensor, str]] = []
        for group_index, group in enumerate(self.param_groups):
            for param_index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                label = _param_label(group, group_index, param_index, param)
                _check_steppable(param, label)
                stepped.append((param, label))
                self._plan_param(param, group, group_index, param_index, buckets, new_state, staged)
        _check_no_overlap(stepped)
        return buckets, new_state, staged

    def _plan_param(
        self,
        param: Tensor,
        group: dict[str, Any],
        group_index: int,
        param_index: int,
        buckets: dict[tuple, _Bucket],
        new_state: list[tuple[Tensor, str, Tensor | None]],
        staged: list[tuple[Tensor, Tensor]],
    ) -> None:
        """Adds one param to its bucket: dense views of param and grad (real views of complex ones), and
        its momentum buffer and master, converted to the param's layout where needed."""
        state = self.state.get(param, _NO_STATE)
        has_momentum = group["momentum"] != 0
        use_master = bool(group["master_weights"]) and param.dtype in _LOW_PRECISION
        dense = param if _is_dense(param) else param.contiguous()
        if dense is not param:
            staged.append((param, dense))
        stride = dense.stride()
        grad = param.grad
        if grad.dtype != param.dtype or grad.stride() != stride:
            grad = torch.empty_like(dense).copy_(grad)

        bucket = buckets.setdefault((param.device, param.dtype, use_master), _Bucket())
        bucket.params.append(_real(dense))
        bucket.sources.append(param)
        bucket.grads.append(_real(grad))
        bucket.tensor_group.append(group_index)
        buffer = state.get("momentum_buffer") if has_momentum else None
        bucket.first_step.append(has_momentum and buffer is None)
        if has_momentum:
            buffer_dtype = torch.float32 if use_master else param.dtype
            if buffer is None:
                buffer = torch.empty_like(dense, dtype=buffer_dtype)
                new_state.append((param, "momentum_buffer", buffer))
            elif (
                buffer.shape != param.shape
                or buffer.dtype != buffer_dtype
                or buffer.stride() != stride
                or buffer.device != param.device
            ):
                self._check_state_shapes(state, group, group_index, param_index, param)
                buffer = torch.empty_like(dense, dtype=buffer_dtype).copy_(buffer)
                new_state.append((param, "momentum_buffer", buffer))
            buffer = _real(buffer)
        bucket.momentum_buffers.append(buffer)
        master = state.get("master_param")
        if not use_master:
            if master is not None:  # stale once the param steps without it: seeded anew if turned back on
                new_state.append((param, "master_param", None))
            return
        if (
            master is None
            or master.shape != param.shape
            or master.dtype != torch.float32
            or master.stride() != stride
        ):
            self._check_state_shapes(state, group, group_index, param_index, param)
            master = torch.empty_like(dense, dtype=torch.float32).copy_(dense if master is None else master)
            new_state.append((param, "master_param", master))
        bucket.master_params.append(master)

    @staticmethod
    def _check_state_shapes(
        state: dict[str, Any], group: dict[str, Any], group_index: int, param_index: int, param: Tensor
    ) -> None:
        for key in ("momentum_buffer", "master_param"):
            value = state.get(key)
            if value is not None and value.shape != param.shape:
                raise ValueError(
                    f"The {key} of {_param_label(group, group_index, param_index, param)} has shape "
                    f"{tuple(value.shape)} but the parameter has shape {tuple(param.shape)}: the optimizer "
                    "state belongs to a different model. Load a matching checkpoint, or drop the optimizer "
                    "state to restart momentum from zero."
                )

    def _step_function(self, device: torch.device, bucket: _Bucket, table: Tensor) -> Callable[..., None]:
        groups = [self.param_groups[i] for i in set(bucket.tensor_group)]
        backend = self.backend
        if backend == "auto":
            backend = kernels.compiled_or_fallback("auto", device.type)
            if backend == "torch" and device.type == "cuda" and _torch_fused_eligible(groups, bucket):
                backend = "torch_fused"
        if backend == "compiled":
            if device.type not in kernels.EXTENSIONS:
                raise RuntimeError(
                    f"backend='compiled' runs on CPU and CUDA tensors; these are on {device}. "
                    "Use backend='auto'."
                )
            kernels.compiled_or_fallback("compiled", device.type)
            return kernels.load_extension(device.type).sgd_step
        if backend == "torch_fused":
            if not _torch_fused_eligible(groups, bucket):
                raise ValueError(
                    "backend='torch_fused' cannot run master weights, wd_after_momentum or LARS: "
                    "use backend='auto'."
                )
            return _torch_fused_step
        return reference.sgd_step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads optimizer state, validating shapes first (nothing changes on error).

        A state dict grouped differently from this optimizer (for example ``torch.optim.SGD``'s single
        group where ``param_groups`` makes two) is remapped by parameter name; this optimizer's group
        hyperparameters are kept in that case.

        Keeps fp32 master weights and fp32 momentum of master-weighted params in fp32 (torch's loader
        would cast them to the param's dtype), and fills hyperparameters that a ``torch.optim.SGD``
        checkpoint lacks (``lars``, ``master_weights``, ...) from the current groups.
        """
        self._check_loadable(state_dict)
        if not same_param_layout(state_dict, self.param_groups):
            # A different grouping (e.g. torch.optim.SGD's one group for our two): move state by name.
            state_dict = remap_optimizer_state_dict(state_dict, self.param_groups, source="optimizer state")
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) == len(saved_groups) and all(
            len(g["params"]) == len(s["params"]) for g, s in zip(groups, saved_groups)
        ):
            id_to_param = {
                saved_id: (group_index, param_index, param)
                for group_index, (group, saved) in enumerate(zip(groups, saved_groups))
                for param_index, (saved_id, param) in enumerate(zip(saved["params"], group["params"]))
            }
            keep_fp32 = {}
            for saved_id, saved_state in state_dict["state"].items():
                if saved_id not in id_to_param:
                    continue
                group_index, param_index, param = id_to_param[saved_id]
                self._check_state_shapes(saved_state, groups[group_index], group_index, param_index, param)
                if groups[group_index]["master_weights"] and param.dtype in _LOW_PRECISION:
                    keep_fp32[param] = {
                        key: saved_state[key].to(device=param.device, dtype=torch.float32, copy=True)
                        for key in ("momentum_buffer", "master_param")
                        if isinstance(saved_state.get(key), Tensor)
                    }
        else:
            keep_fp32 = {}
        current = [dict(group) for group in groups]
        super().load_state_dict(state_dict)
        self._cached_plan = None
        for group, before in zip(self.param_groups, current):
            for key, value in before.items():
                group.setdefault(key, value)
        for param, values in keep_fp32.items():
            self.state[param].update(values)
        self._checked_hparams = None

    def _check_loadable(self, state_dict: Any) -> None:
        """Refuses, before anything changes, a state dict that is not an optimizer's, holds values that
        cannot be optimizer state, or whose groups have hyperparameters FusedSGD refuses."""
        check_optimizer_state_dict(state_dict)
        for index, group in enumerate(state_dict["param_groups"]):
            try:
                _check_hyperparameters(
                    {**self.defaults, **{k: v for k, v in group.items() if k in self.defaults}}
                )
            except ValueError as error:
                raise ValueError(f"saved param_groups[{index}]: {error}") from None


@dataclass
class _CachedPlan:
    """A validated step, reused while the parameters, their state and the group structure are unchanged.

    Building a plan costs a few microseconds of Python per parameter, which on models with thousands of
    small tensors is as much as the update itself. Reuse is checked in bulk: here, with C-level ``map``
    only, the same params (by identity) and momentum/master-weights switches, the same state mapping
    (keys and per-param dicts by identity, in order) and the same state tensors (by identity); in C++
    (``CachedStep.run``), the same grad/no-grad pattern and params and grads laid out as recorded
    (dtype, device, shape, strides). The C++ side keeps the kernel arguments, so a step converts no
    tensor lists.
    """

    group_key: list[tuple[int, bool, bool]]
    params: list[Tensor]
    state_keys: list[Tensor]
    state_dicts: list[dict[str, Any]]
    stepped_dicts: list[dict[str, Any]]
    buffers: list[Tensor | None]
    masters: list[Tensor | None]  # empty when no bucket keeps master weights
    device: torch.device
    step: Any  # the extension's CachedStep

    @staticmethod
    def _group_key(optimizer: FusedSGD) -> list[tuple[int, bool, bool]]:
        return [
            (len(g["params"]), g["momentum"] != 0, bool(g["master_weights"])) for g in optimizer.param_groups
        ]

    @classmethod
    def capture(cls, optimizer: FusedSGD, buckets: dict[tuple, _Bucket], device: torch.device) -> _CachedPlan:
        """Keeps the step just planned (buckets on one device, no new state) for the next steps."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        stepped = [p for p in params if p.grad is not None]
        position = {id(p): i for i, p in enumerate(stepped)}
        step = kernels.load_extension(device.type).CachedStep(
            params, [p.grad is not None for p in params], [p.detach() for p in stepped]
        )
        for bucket in buckets.values():
            step.add_bucket(
                bucket.params,
                bucket.momentum_buffers,
                bucket.master_params,
                bucket.tensor_group,
                [position[id(p)] for p in bucket.sources],
            )
        stepped_dicts = [optimizer.state.get(p, _NO_STATE) for p in stepped]  # momentum 0: no state, as torch
        return cls(
            group_key=cls._group_key(optimizer),
            params=params,
            state_keys=list(optimizer.state),
            state_dicts=list(optimizer.state.values()),
            stepped_dicts=stepped_dicts,
            buffers=list(map(_get_buffer, stepped_dicts)),
            masters=list(map(_get_master, stepped_dicts)) if any(key[2] for key in buckets) else [],
            device=device,
            step=step,
        )

    def matches(self, optimizer: FusedSGD) -> bool:
        """Whether params, groups and state are those the cached step was validated for."""
        state = optimizer.state
        return (
            self._group_key(optimizer) == self.group_key
            and all(
                map(
                    operator.is_,
                    itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups),
                    self.params,
                )
            )
            and len(state) == len(self.state_keys)
            and all(map(operator.is_, state, self.state_keys))
            and all(map(operator.is_, state.values(), self.state_dicts))
            and all(map(operator.is_, map(_get_buffer, self.stepped_dicts), self.buffers))
            and all(map(operator.is_, map(_get_master, self.stepped_dicts), self.masters))
        )


_get_buffer = operator.methodcaller("get", "momentum_buffer")
_get_master = operator.methodcaller("get", "master_param")


class FusedLARS(FusedSGD):
    """FusedSGD with LARS on by default, for configs that name an optimizer class.

    The signature is spelled out (not ``**kwargs``) because LightningCLI and Hydra read it.

    Groups can still turn it off per group (``lars=False``), as ``param_groups`` does for biases and
    normalization parameters. Arguments are those of :class:`FusedSGD`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 0.1,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        wd_after_momentum: bool = False,
        master_weights: bool = False,
        set_grad_none: bool = True,
        backend: str = "auto",
        lars: bool = True,
        trust_coefficient: float = 0.001,
        lars_eps: float = 0.0,
        trust_clip: bool = False,
        lars_denominator: str = "grad_plus_decay",
    ) -> None:
        super().__init__(
            params,
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize=maximize,
            wd_after_momentum=wd_after_momentum,
            master_weights=master_weights,
            set_grad_none=set_grad_none,
            backend=backend,
            lars=lars,
            trust_coefficient=trust_coefficient,
            lars_eps=lars_eps,
            trust_clip=trust_clip,
            lars_denominator=lars_denominator,
        )


def _torch_fused_eligible(groups: list[dict[str, Any]], bucket: _Bucket) -> bool:
    """torch's fused SGD has our semantics when no master weights, wd_after_momentum or LARS are used."""
    return not bucket.master_params and not any(g["wd_after_momentum"] or g["lars"] for g in groups)


def _torch_fused_step(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None],
    master_params: list[Tensor],
    group_hparams: Tensor,
    tensor_group: list[int],
    first_step: list[bool],
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
) -> None:
    """Runs a bucket through ``torch._fused_sgd_``, one call per (group, first step) subset."""
    del master_params  # never present: see _torch_fused_eligible
    rows = group_hparams.tolist()
    h = {name: i for i, name in enumerate(HPARAM_COLUMNS)}
    subsets: dict[tuple[int, bool], list[int]] = {}
    for i, (group, first) in enumerate(zip(tensor_group, first_step)):
        subsets.setdefault((group, first), []).append(i)
    for (group, first), indices in subsets.items():
        row = rows[group]
        torch._fused_sgd_(
            [params[i] for i in indices],
            [grads[i] for i in indices],
            [momentum_buffers[i] for i in indices] if row[h["momentum"]] != 0 else [],
            weight_decay=row[h["weight_decay"]],
            momentum=row[h["momentum"]],
            lr=row[h["lr"]],
            dampening=row[h["dampening"]],
            nesterov=bool(row[h["nesterov"]]),
            maximize=bool(row[h["maximize"]]),
            is_first_step=first,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
