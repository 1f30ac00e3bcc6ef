"""The ops in plain PyTorch: the oracle in tests and the fallback where nothing compiles.

``clip_coef``, ``make_coeffs``, ``clipped_grad``, ``sgd_element``, ``lars_norm_term``, ``trust_ratio``,
``lars_adapts``, ``lars_trust``, ``apply_lars``, ``clipped_term_sq_sum``, ``synced_master``,
``apply_schedule_free`` and ``schedule_free_element`` mirror ``csrc/sgd_math.h`` function for function,
``kahan_compensation``, ``mix32``, ``rounding_key``, ``element_random_bits`` and ``stochastic_bf16``
``csrc/rounding.h``, ``advance_schedule_free`` and ``switch_weight`` ``csrc/schedule_free.h``, with ATen's ops
where the kernel rounds as they do (``x.add(y, alpha=a)`` is the kernel's ``mul_add``, ``x.lerp(y, w)`` its
``lerp``); ``sgd_step``, ``grad_sq_sum``, ``lars_sq_sums``, ``schedule_lrs``, ``schedule_free_scalars`` and
``schedule_free_switch`` implement the contract documented with the ops' schemas in ``ops/__init__.py``, so
either implementation can run a bucket. Unlike the kernels, these read device values on the host
(``found_inf``, the lrs, the schedule position and the schedule-free scalars): they are not capturable.

Longer than 400 lines because it mirrors three C++ headers function for function, so that the mirror is
checked by reading them side by side."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_fusedsgd._abi import (
    LARS_DENOMINATORS,
    LARS_SUMS,
    LARS_ZERO_NORMS,
    SCHEDULE_FREE_SCALARS,
    SCHEDULE_HEADER,
    hparam_names,
    keeps_momentum_buffer,
    slot_keys,
    slots_in,
    step_row_names,
)
from lightning_fusedsgd.schedule.function import WarmupSchedule


@dataclass
class Coeffs:
    """Everything the element update needs, resolved once per tensor (``Coeffs`` in sgd_math.h)."""

    grad_mul: float | Tensor
    clip_value: float
    clip_coef: float | Tensor
    wd_coupled: float
    trust: float | Tensor
    momentum: float
    one_minus_dampening: float
    wd_after: float
    lr: float
    has_momentum_buffer: bool
    first: bool
    nesterov: bool
    ckp1: float = 0.0
    y_grad: float = 0.0


def clipped_grad(g: Tensor, c: Coeffs) -> Tensor:
    """The unscaled, sign-corrected gradient, clipped by value or by norm (``clipped_grad`` in sgd_math.h)."""
    g = g * c.grad_mul
    g = torch.clamp(g, -c.clip_value, c.clip_value)
    return g * c.clip_coef


def sgd_element(w: Tensor, g: Tensor, b: Tensor | None, c: Coeffs) -> tuple[Tensor, Tensor | None]:
    """One SGD/LARS update in opmath with torch.optim.SGD's ops in its order; returns the new weights and
    momentum buffer."""
    g = clipped_grad(g, c)
    if c.wd_coupled != 0:
        g = g.add(w, alpha=c.wd_coupled)
    g = g * c.trust
    if c.has_momentum_buffer:
        b = g.clone() if c.first else b.mul(c.momentum).add_(g, alpha=c.one_minus_dampening)
        g = g.add(b, alpha=c.momentum) if c.nesterov else b
    if c.wd_after != 0:
        g = g.add(w, alpha=c.wd_after)
    return w.add(g, alpha=-c.lr), b


def interpolation(h: dict[str, float]) -> float:
    """Schedule-free SGD's interpolation between the average x and the SGD sequence z, which its groups hold
    in the momentum column (``interpolation`` in sgd_math.h)."""
    return h["momentum"]


def apply_schedule_free(c: Coeffs, h: dict[str, float], ckp1: float) -> None:
    """A schedule-free tensor's coefficients from the step's lr (after warmup) and ckp1
    (``apply_schedule_free`` in sgd_math.h)."""
    c.ckp1 = ckp1
    c.y_grad = h["lr"] * (interpolation(h) * (1.0 - ckp1) - 1.0)


def schedule_free_element(y: Tensor, g: Tensor, z: Tensor, c: Coeffs) -> tuple[Tensor, Tensor]:
    """One schedule-free step in opmath, schedulefree.SGDScheduleFree's foreach ops in its order; returns the
    new y and z (``schedule_free_element`` in sgd_math.h)."""
    g = clipped_grad(g, c)
    if c.wd_coupled != 0:
        g = g.add(y, alpha=c.wd_coupled)
    return y.lerp(z, c.ckp1).add(g, alpha=c.y_grad), z.add(g, alpha=-c.lr)


def trust_ratio(
    w_norm: Tensor,
    g_norm: Tensor,
    weight_decay: float,
    trust_coefficient: float,
    eps: float,
    decayed_grad: bool,
    trust_clip: bool,
    lr: float,
) -> Tensor:
    """LARS trust ratio from 0-d float64 norms, with no host sync."""
    denominator = g_norm + eps if decayed_grad else g_norm + weight_decay * w_norm + eps
    r = trust_coefficient * w_norm / denominator
    if trust_clip:
        r = torch.clamp(r / lr, max=1.0) if lr != 0 else torch.ones_like(r)
    return torch.where((w_norm == 0) | (g_norm == 0), torch.ones_like(r), r)


def synced_master(master: Tensor, param: Tensor) -> Tensor:
    """The fp32 master, taking the param's value wherever the param no longer holds the master's rounding
    (it was written outside the optimizer). Compared bit for bit, as ``synced_master`` in sgd_math.h."""
    same = master.to(param.dtype).view(torch.int16) == param.view(torch.int16)
    return torch.where(same, master, param.float())


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def load_weight(param: Tensor, slots: dict[str, Tensor | None]) -> Tensor:
    """The weight in opmath (``load_weight`` in the kernels): the param, its fp32 master re-synced with it,
    or the param plus its bf16 Kahan compensation."""
    if slots["master_param"] is not None:
        return synced_master(slots["master_param"], param)
    if slots["kahan_compensation"] is not None:
        return param.float() + slots["kahan_compensation"].float()
    return param.to(_opmath(param.dtype))


def store_weight(
    param: Tensor, slots: dict[str, Tensor | None], w_new: Tensor, random_bits: Tensor | None = None
) -> None:
    """Stores the new weight (opmath) as ``store_update`` in elements.h does: into the fp32 master and its
    rounding into the param, rounded to bf16 with what that dropped kept as the Kahan compensation, rounded
    stochastically with each element's ``random_bits`` (bf16 params alone), or rounded to nearest."""
    if slots["kahan_compensation"] is not None:
        rounded = w_new.to(torch.bfloat16)
        slots["kahan_compensation"].copy_(kahan_compensation(w_new, rounded))
        w_new = rounded
    elif slots["master_param"] is not None:
        slots["master_param"].copy_(w_new)
    elif random_bits is not None:
        w_new = stochastic_bf16(w_new, random_bits)
    param.copy_(w_new)


def kahan_compensation(weight: Tensor, rounded: Tensor) -> Tensor:
    """What rounding the fp32 ``weight`` to the bf16 ``rounded`` dropped, 0 where that is not finite (where
    ``rounded`` is inf or NaN) (``kahan_compensation`` in rounding.h); rounded to bf16 by the caller."""
    dropped = weight - rounded.float()
    return torch.where(dropped.isfinite(), dropped, 0.0)


def inverse_scale(grad_scale: Tensor | None) -> float | Tensor:
    """1 / grad_scale rounded as GradScaler.unscale_ rounds it (reciprocal in float64, then float32)."""
    if grad_scale is None:
        return 1.0
    return grad_scale.double().reciprocal().float()


def clip_coef(grad_sq_sum: Tensor, max_norm: float, inv_scale: float | Tensor) -> Tensor:
    """clip_grad_norm_'s ``min(1, max_norm / (||g|| + 1e-6))`` from the still scaled gradients' sum of
    squares, in float64 (``clip_coef`` in sgd_math.h)."""
    inv_scale = inv_scale.double() if isinstance(inv_scale, Tensor) else inv_scale
    coef = max_norm / (grad_sq_sum.sqrt() * abs(inv_scale) + 1e-6)
    return torch.clamp(coef, max=1.0)


def make_coeffs(h: dict[str, float], inv_scale: float | Tensor, clip: float | Tensor, first: bool) -> Coeffs:
    """A tensor's coefficients from its group's hyperparameters and the step's clip coefficient (1 where it
    does not clip by norm) (``make_coeffs`` in sgd_math.h)."""
    wd_after = bool(h["wd_after_momentum"])
    return Coeffs(
        grad_mul=-inv_scale if h["maximize"] else inv_scale,
        clip_value=h["max_grad_value"],
        clip_coef=clip,
        wd_coupled=0.0 if wd_after else h["weight_decay"],
        trust=1.0,
        momentum=h["momentum"],
        one_minus_dampening=1.0 - h["dampening"],
        wd_after=h["weight_decay"] if wd_after else 0.0,
        lr=h["lr"],
        has_momentum_buffer=keeps_momentum_buffer(h),
        first=first,
        nesterov=bool(h["nesterov"]),
    )


def lars_norm_term(w: Tensor, g: Tensor, c: Coeffs, weight_decay: float, decayed: bool) -> Tensor:
    """The gradient term whose norm the LARS denominator takes (``lars_norm_term`` in sgd_math.h)."""
    raw = clipped_grad(g, c)
    return raw.add(w, alpha=weight_decay) if decayed else raw


@dataclass
class AverageCoeffs:
    """This step's update of the average of the weights (``AverageCoeffs`` in sgd_math.h)."""

    update: bool
    copy: bool
    decay: float
    one_minus_decay: float


def average_coeffs(h: dict[str, float], steps: int, updates: int) -> AverageCoeffs:
    """The average's update after ``steps`` applied steps and ``updates`` updates (``average_coeffs`` in
    sgd_math.h)."""
    decay = h["ema_decay"]
    if h["ema_warmup_gamma"] > 0 and updates > 0:
        decay = min(decay, 1.0 - (1.0 + updates / h["ema_warmup_gamma"]) ** -h["ema_warmup_power"])
    update = steps >= h["ema_start"] and steps % int(h["ema_every"]) == 0
    return AverageCoeffs(update, updates == 0, decay, 1.0 - decay)


def averaged(average: Tensor, w: Tensor, a: AverageCoeffs) -> Tensor:
    """The average after an update with the new weight ``w`` (``averaged`` in sgd_math.h): get_ema_avg_fn's
    ``decay * average + (1 - decay) * w``, or ``w`` at the first update."""
    return w.clone() if a.copy else average.mul(a.decay) + w.mul(a.one_minus_decay)


def decayed_grad(h: dict[str, float]) -> bool:
    """Whether the LARS denominator is ``||g + lambda w||`` (``decayed_grad`` in sgd_math.h)."""
    return LARS_DENOMINATORS[int(h["lars_denominator"])] == "decayed_grad"


def lars_adapts(h: dict[str, float]) -> bool:
    """Whether LARS adapts a group's tensors (``lars_adapts`` in sgd_math.h)."""
    return bool(h["lars"]) and (bool(h["always_adapt"]) or h["weight_decay"] != 0)


def lars_trust(sum_w: Tensor, sum_g: Tensor, h: dict[str, float]) -> Tensor:
    """The trust ratio from a tensor's float64 sums of squares (``lars_trust`` in sgd_math.h)."""
    return trust_ratio(
        sum_w.sqrt(),
        sum_g.sqrt(),
        h["weight_decay"],
        h["trust_coefficient"],
        h["lars_eps"],
        decayed_grad(h),
        bool(h["trust_clip"]),
        h["lr"],
    )


def apply_lars(c: Coeffs, sum_w: Tensor, sum_g: Tensor, h: dict[str, float], opmath: torch.dtype) -> None:
    """A LARS tensor's coefficients from its sums of squares (``apply_lars`` in sgd_math.h). Reads whether a
    norm is 0 on the host: the reference is not capturable."""
    c.trust = lars_trust(sum_w, sum_g, h).to(opmath)
    if LARS_ZERO_NORMS[int(h["lars_zero_norm"])] == "plain_grad" and bool((sum_w == 0) | (sum_g == 0)):
        c.wd_coupled = 0.0


def lars_row(w: Tensor, g: Tensor, h: dict[str, float], inv_scale: float | Tensor) -> Tensor:
    """A LARS tensor's float64 sums of w^2, of its norm term squared, of w times it and of its gradient
    (``clipped_grad``) squared, the term and the gradient taken before the norm clip (a row of
    ``lars_sq_sums``; the kernels' norm pass)."""
    coeffs = make_coeffs(h, inv_scale, 1.0, False)
    term = lars_norm_term(w, g.to(w.dtype), coeffs, h["weight_decay"], decayed_grad(h))
    w, term = w.double(), term.double()
    return torch.stack(
        [(w * w).sum(), (term * term).sum(), (w * term).sum(), grad_sq(g.to(w.dtype), h, inv_scale)]
    )


def grad_sq(g: Tensor, h: dict[str, float], inv_scale: float | Tensor) -> Tensor:
    """The float64 sum of squares of the gradient as ``clipped_grad`` leaves it before the norm clip (in the
    opmath type ``g`` is in): a row's ``grad_sq``, and what a step reporting its gradient norm sums."""
    raw = clipped_grad(g, make_coeffs(h, inv_scale, 1.0, False)).double()
    return (raw * raw).sum()


def clipped_term_sq_sum(sum_w: Tensor, sum_t: Tensor, sum_wt: Tensor, c: float | Tensor, h: dict) -> Tensor:
    """The LARS norm term's sum of squares under norm clipping by ``c``, from ``lars_sq_sums``'s sums taken
    before that clip (``clipped_term_sq_sum`` in sgd_math.h)."""
    c = c.double() if isinstance(c, Tensor) else c
    if not decayed_grad(h):
        return c * c * sum_t
    d = (1.0 - c) * h["weight_decay"]
    return torch.clamp(c * c * sum_t + 2.0 * c * d * sum_wt + d * d * sum_w, min=0.0)


def aux(slots: dict[str, Tensor | None]) -> Tensor | None:
    """The update's aux stream, which it reads and writes beside the weight: SGD's momentum buffer, or
    schedule-free SGD's z (``SlotPointers::aux`` in slots.h)."""
    return slots["z"] if slots["z"] is not None else slots["momentum_buffer"]


def _slots(state: list[Tensor], state_slots: list[int]) -> list[dict[str, Tensor | None]]:
    """Each tensor's state by slot key (None where it holds no such state), and whether this is its first
    step, on which the kernel seeds its ``"gradient"`` slots, from the ops' ``state`` and ``state_slots``."""
    entries, slots, keys = iter(state), [], slot_keys()
    for mask in state_slots:
        held, fresh = slots_in(mask)
        slots.append(
            {key: next(entries) if holds else None for key, holds in zip(keys, held)}
            | {"first_step": any(fresh)}
        )
    return slots


def sgd_step(
    params: list[Tensor],
    grads: list[Tensor],
    state: list[Tensor],
    state_slots: list[int],
    group_hparams: Tensor,
    tensor_group: list[int],
    step: list[Tensor | None],
    unscaled_grad_sq_sum: Tensor | None = None,
) -> None:
    """``torch.ops.lightning_fusedsgd.sgd_step`` (arguments documented with its schema): updates params and
    their state in place, and adds the gradients' sums of squares to ``unscaled_grad_sq_sum`` where given."""
    row = dict(zip(step_row_names(), step, strict=True))
    reported = unscaled_grad_sq_sum
    if reported is not None and row["lars_sq_sums"] is not None:
        raise RuntimeError(
            "lightning_fusedsgd::sgd_step: unscaled_grad_sq_sum takes the sums of the kernel's own norm pass,"
            " which given lars_sq_sums replace: a sharded step sums their grad_sq column instead"
        )
    if not params or (row["found_inf"] is not None and bool(row["found_inf"].item())):
        return
    hparams = group_hparams.tolist()
    if any(hparams[g][hparam_names().index("schedule_free")] for g in tensor_group) and (
        row["ckp1"] is None or row["lrs"] is None
    ):
        raise RuntimeError(
            "lightning_fusedsgd::sgd_step: a schedule-free step takes the step row's ckp1 and lrs, which the "
            "schedule_free_scalars op gives (FusedSGDScheduleFree)"
        )
    ckp1s = None if row["ckp1"] is None else row["ckp1"].tolist()
    if row["lrs"] is not None:
        for hparam_row, lr in zip(hparams, row["lrs"].tolist(), strict=True):
            hparam_row[hparam_names().index("lr")] = lr
    inv_scale = inverse_scale(row["grad_scale"])
    max_norm = row["max_grad_norm"]
    clip = 1.0 if max_norm is None else clip_coef(row["grad_sq_sum"], float(max_norm), inv_scale)
    counts = []
    names = hparam_names()
    grad_sqs = []
    for i, (param, slots) in enumerate(zip(params, _slots(state, state_slots), strict=True)):
        h = dict(zip(names, hparams[tensor_group[i]]))
        opmath = _opmath(param.dtype)
        w = load_weight(param, slots)
        g = grads[i].to(opmath)
        aux_stream = aux(slots)
        coeffs = make_coeffs(h, inv_scale, clip, slots["first_step"])
        if isinstance(coeffs.clip_coef, Tensor):
            coeffs.clip_coef = coeffs.clip_coef.to(opmath)
        if lars_adapts(h):
            # Sums reduced across shards replace the norm pass; either is taken before the norm clip.
            sums = row["lars_sq_sums"]
            sum_w, sum_t, sum_wt, sum_g = sums[i] if sums is not None else lars_row(w, g, h, inv_scale)
            apply_lars(coeffs, sum_w, clipped_term_sq_sum(sum_w, sum_t, sum_wt, clip, h), h, opmath)
            grad_sqs.append(sum_g)
        elif reported is not None:
            grad_sqs.append(grad_sq(g, h, inv_scale))
        if h["schedule_free"]:
            apply_schedule_free(coeffs, h, ckp1s[tensor_group[i]])
            w_new, aux_new = schedule_free_element(w, g, aux_stream.to(opmath), coeffs)
        else:
            momentum_buffer = None if aux_stream is None or coeffs.first else aux_stream.to(opmath)
            w_new, aux_new = sgd_element(w, g, momentum_buffer, coeffs)
        if slots["ema"] is not None:  # of the step's result in opmath, before it is rounded to the param
            steps, updates = slots["ema_step"], slots["ema_updates"]
            a = average_coeffs(h, int(steps), int(updates))
            if a.update:
                slots["ema"].copy_(averaged(slots["ema"], w_new, a))
                updates += 1
            steps += 1
        weight_bits = None
        if slots["rounding_step"] is not None:
            counts.append(slots["rounding_step"])
            random = element_random_bits(rounding_key(h, slots["rounding_step"], i), param)
            weight_bits = random >> 16
            if aux_stream is not None:
                aux_new = stochastic_bf16(aux_new, random & 0xFFFF)  # the aux stream has the param's layout
        store_weight(param, slots, w_new, weight_bits)
        if aux_stream is not None:
            aux_stream.copy_(aux_new)
    for count in counts:  # after every tensor read its count
        count += 1
    if reported is not None and grad_sqs:
        reported += torch.stack(grad_sqs).sum().to(reported.device)


_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor | int, constant: int) -> Tensor | int:
    """``x * constant`` modulo 2^32 (uint32 arithmetic) for an int, or for an int64 tensor of uint32 values
    without overflowing int64."""
    if isinstance(x, int):
        return (x * constant) & _MASK32
    return (x * (constant & 0xFFFF) + ((x * (constant >> 16)) & 0xFFFF) * 65536) & _MASK32


def mix32(x: Tensor | int) -> Tensor | int:
    """murmur3's 32-bit finalizer (``mix32`` in rounding.h)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def rounding_key(h: dict[str, float], rounding_step: Tensor, tensor: int) -> int:
    """The key of one tensor's draws at its step (``rounding_key`` in rounding.h)."""
    seed, step = int(h["rounding_seed"]), int(rounding_step)
    key = mix32((seed & _MASK32) ^ 0x9E3779B9)
    for word in (seed >> 32, step & _MASK32, step >> 32, tensor & _MASK32):
        key = mix32(key ^ word)
    return key


def element_random_bits(key: int, param: Tensor) -> Tensor:
    """32 random bits per element of a dense ``param``, element i of its memory order taking index i
    (``element_random_bits`` in rounding.h); shaped and strided as ``param``, int64."""
    index = torch.arange(param.numel(), dtype=torch.int64, device=param.device)
    bits = mix32((key + _mul32(index & _MASK32, 0x9E3779B9) + (index >> 32)) & _MASK32)
    return bits.as_strided(param.shape, param.stride())


def stochastic_bf16(value: Tensor, random16: Tensor) -> Tensor:
    """fp32 ``value`` rounded to bf16 with 16 random bits per element (``stochastic_bf16_bits`` in
    rounding.h): rounded up with probability (dropped bits) / 2^16, so unbiased; a NaN as ``kBf16NanBits``."""
    bits = value.view(torch.int32).to(torch.int64) & _MASK32
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = torch.where(nan, 0xFFFF, (bits + random16) >> 16)
    return (rounded - (rounded >= 0x8000).long() * 0x10000).to(torch.int16).view(torch.bfloat16)


def grad_sq_sum(grads: list[Tensor]) -> Tensor:
    """Same contract as ``torch.ops.lightning_fusedsgd.grad_sq_sum``: the sum of squares of every gradient,
    a float64 scalar on their device."""
    return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in grads]).sum()


def lars_sq_sums(
    params: list[Tensor],
    grads: list[Tensor],
    state: list[Tensor],
    state_slots: list[int],
    group_hparams: Tensor,
    tensor_group: list[int],
    step: list[Tensor | None],
) -> Tensor:
    """Same contract as ``torch.ops.lightning_fusedsgd.lars_sq_sums``: float64 [n, LARS_SUMS], each LARS
    tensor's sums of w^2, of its norm term squared and of w times that term, before norm clipping; zeros
    elsewhere."""
    hparams = group_hparams.tolist()
    inv_scale = inverse_scale(dict(zip(step_row_names(), step, strict=True))["grad_scale"])
    rows = []
    names = hparam_names()
    for i, (param, slots) in enumerate(zip(params, _slots(state, state_slots), strict=True)):
        h = dict(zip(names, hparams[tensor_group[i]]))
        if not lars_adapts(h):
            rows.append(torch.zeros(LARS_SUMS, dtype=torch.float64, device=param.device))
            continue
        rows.append(lars_row(load_weight(param, slots), grads[i], h, inv_scale))
    if not rows:
        return torch.zeros(0, LARS_SUMS, dtype=torch.float64)
    return torch.stack(rows)


def advance_schedule_free(scalars: dict[str, float], lr: float, h: dict[str, float]) -> None:
    """One applied step of a group's schedule-free scalars (by ``SCHEDULE_FREE_SCALARS`` name), as
    schedulefree.SGDScheduleFree.step computes them (``advance_schedule_free`` in schedule_free.h)."""
    k = scalars["k"]
    sched = (k + 1) / h["warmup_steps"] if k < h["warmup_steps"] else 1.0
    scheduled = lr * sched
    lr_max = scalars["lr_max"] = max(scheduled, scalars["lr_max"])
    weight = ((k + 1) ** h["r"]) * (lr_max ** h["weight_lr_power"])
    weight_sum = scalars["weight_sum"] = scalars["weight_sum"] + weight
    scalars["scheduled_lr"] = scheduled
    scalars["ckp1"] = 0.0 if weight_sum == 0 else weight / weight_sum
    scalars["k"] = k + 1


def switch_weight(h: dict[str, float], train: bool) -> float:
    """The weight of z that moves a param from x to y (``train``) or from y to x (``switch_weight`` in
    schedule_free.h)."""
    return 1.0 - interpolation(h) if train else 1.0 - 1.0 / interpolation(h)


def schedule_free_scalars(scalars: Tensor, group_hparams: Tensor, step: list[Tensor | None]) -> None:
    """Same contract as ``torch.ops.lightning_fusedsgd.schedule_free_scalars``: every group's scalars advanced
    one applied step, nothing where the step was skipped."""
    row = dict(zip(step_row_names(), step, strict=True))
    if row["found_inf"] is not None and bool(row["found_inf"].item()):
        return
    names = hparam_names()
    lrs = None if row["lrs"] is None else row["lrs"].tolist()
    columns = scalars.T.tolist()
    for g, hparam_row in enumerate(group_hparams.tolist()):
        h = dict(zip(names, hparam_row))
        values = dict(zip(SCHEDULE_FREE_SCALARS, columns[g]))
        advance_schedule_free(values, h["lr"] if lrs is None else lrs[g], h)
        columns[g] = [values[name] for name in SCHEDULE_FREE_SCALARS]
    scalars.copy_(torch.tensor(columns, dtype=torch.float64).T)


def schedule_free_switch(
    params: list[Tensor],
    state: list[Tensor],
    state_slots: list[int],
    group_hparams: Tensor,
    tensor_group: list[int],
    train: bool,
) -> None:
    """Same contract as ``torch.ops.lightning_fusedsgd.schedule_free_switch``: each param's weight moved to y
    (``train``) or to x on its line through z, rounded to nearest into the param and its master or
    compensation."""
    names = hparam_names()
    hparams = group_hparams.tolist()
    for i, (param, slots) in enumerate(zip(params, _slots(state, state_slots), strict=True)):
        h = dict(zip(names, hparams[tensor_group[i]]))
        opmath = _opmath(param.dtype)
        store_weight(
            param, slots, load_weight(param, slots).lerp(slots["z"].to(opmath), switch_weight(h, train))
        )


def schedule_lrs(
    lrs: Tensor, position: Tensor, schedule: Tensor, peaks: Tensor, applied: Tensor | None, advance: bool
) -> None:
    """Same contract as ``torch.ops.lightning_fusedsgd.schedule_lrs`` (``schedule_step`` in csrc/schedule.h):
    after an applied step one more applied step in ``position`` and every lr at f(applied steps), after a
    skipped one one more skip; ``advance`` false only sets the lrs."""
    if advance:
        if applied is not None and not bool(applied):
            position[1] += 1
            return
        position[0] += 1
    milestones = int(schedule[SCHEDULE_HEADER.index("milestone_count")])
    # The header and the milestones: the factors that follow are lr_at's own.
    function = WarmupSchedule.from_row(schedule[: len(SCHEDULE_HEADER) + milestones].tolist())
    step = int(position[0])
    lrs.copy_(torch.tensor([function.lr_at(step, peak) for peak in peaks.tolist()], dtype=torch.float64))
