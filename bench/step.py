"""Step time of FusedSGD against torch.optim.SGD (foreach, fused) and the data-movement floor.

Case (e) clips by global norm: FusedSGD(max_grad_norm=...) against its own plain step and against
``torch.nn.utils.clip_grad_norm_(foreach=True)`` followed by torch's fused SGD. Case (f) steps bf16 params
without master weights: rounded to nearest, stochastically or with Kahan compensation (``update_rounding``),
against our step with master weights and torch's fused bf16 step, with each one's optimizer state per
parameter. Cases (d) and (g) step bf16 and fp16 params with fp32 master weights. Case (h) is schedule-free
SGD: FusedSGDScheduleFree against schedulefree.SGDScheduleFree (foreach) and the same 20-byte floor (y, z and
g read, y and z written), and (i) its train()/eval() switches against their 12-byte floor (y and z read, y
written).

Usage: ``python bench/step.py [--repeats N] [--quick]``. Prints a markdown table and writes
``bench/results/step.json``. The floor is a kernel in our extension with the same reads and writes as
a momentum step and no arithmetic, run over the same tensors through the same work list.
"""

from __future__ import annotations

import argparse

import torch
from common import floor_ops, make_params, print_table, resnet50_shapes, time_interleaved, write_json

from lightning_fusedsgd import FusedSGD, FusedSGDScheduleFree

HPARAMS = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)


def clone_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    clones = []
    for p in params:
        q = p.detach().clone().requires_grad_()
        q.grad = p.grad.clone()
        clones.append(q)
    return clones


def contenders(params: list[torch.Tensor], master_weights: bool) -> dict[str, object]:
    """One step function per contender, each on its own copy of the parameters (state already seeded)."""
    floor = floor_ops()
    fused_ours = FusedSGD(clone_params(params), master_weights=master_weights, backend="compiled", **HPARAMS)
    foreach = torch.optim.SGD(clone_params(params), foreach=True, **HPARAMS)
    fused_torch = torch.optim.SGD(clone_params(params), fused=True, **HPARAMS)
    fused_ours.step()  # creates buffers and masters, so the floor can copy their layout
    ours = [p for g in fused_ours.param_groups for p in g["params"]]
    floor_params = clone_params(ours)  # the floor scribbles over its tensors: never the timed optimizer's
    floor_grads = [p.grad for p in floor_params]
    floor_bufs = [fused_ours.state[p]["momentum_buffer"].clone() for p in ours]
    floor_masters = [fused_ours.state[p]["master_param"].clone() for p in ours] if master_weights else []
    return {
        "FusedSGD": fused_ours.step,
        "torch foreach": foreach.step,
        "torch fused": fused_torch.step,
        "floor": lambda: floor.floor_step(floor_params, floor_grads, floor_bufs, floor_masters, []),
    }


def state_bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """Optimizer state (momentum buffers, masters, compensations) in bytes per parameter element, measured."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [t for p in params for t in optimizer.state[p].values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in state) / sum(p.numel() for p in params)


def rounding_contenders(params: list[torch.Tensor]) -> tuple[dict[str, object], dict[str, float]]:
    """(f): bf16 params without master weights, rounded to nearest, stochastically or with Kahan
    compensation, against our step with master weights, torch's steps (which round to nearest), the floor of a
    pure bf16 step (10 bytes per parameter) and that of a step that also reads and writes a bf16 compensation
    (14); and each one's optimizer state per parameter."""
    steps = contenders(params, master_weights=False)
    stochastic = FusedSGD(clone_params(params), backend="compiled", update_rounding="stochastic", **HPARAMS)
    kahan = FusedSGD(clone_params(params), backend="compiled", update_rounding="kahan", **HPARAMS)
    masters = FusedSGD(clone_params(params), backend="compiled", master_weights=True, **HPARAMS)
    fused_torch = steps["torch fused"].__self__  # the bound step's optimizer, as for "FusedSGD" below
    for optimizer in (stochastic, kahan, masters, fused_torch):
        optimizer.step()  # state created outside the timed steps
    floor_params = clone_params(params)
    kahan_params = [p for g in kahan.param_groups for p in g["params"]]
    floor_state = [
        [kahan.state[p][key].clone() for p in kahan_params]
        for key in ("momentum_buffer", "kahan_compensation")
    ]
    floor = floor_ops()
    state = {
        "FusedSGD stochastic": state_bytes_per_param(stochastic),
        "FusedSGD kahan": state_bytes_per_param(kahan),
        "FusedSGD": state_bytes_per_param(steps["FusedSGD"].__self__),  # the bound step's optimizer
        "FusedSGD + masters": state_bytes_per_param(masters),
        "torch fused": state_bytes_per_param(fused_torch),
    }
    return {
        "FusedSGD stochastic": stochastic.step,
        "FusedSGD kahan": kahan.step,
        "FusedSGD": steps["FusedSGD"],
        "FusedSGD + masters": masters.step,
        "torch fused": steps["torch fused"],
        "floor": steps["floor"],
        "floor kahan": lambda: floor.floor_step(
            floor_params, [p.grad for p in floor_params], *floor_state, []
        ),
    }, state


MAX_GRAD_NORM = 1.0


def clipping_contenders(params: list[torch.Tensor]) -> dict[str, object]:
    """(e): our clipped step, our plain step, and torch's clip_grad_norm_ + fused SGD pair, and the floor."""
    steps = contenders(params, master_weights=False)
    clipped = FusedSGD(clone_params(params), backend="compiled", max_grad_norm=MAX_GRAD_NORM, **HPARAMS)
    torch_params = clone_params(params)
    fused_torch = torch.optim.SGD(torch_params, fused=True, **HPARAMS)

    def torch_pair() -> None:
        torch.nn.utils.clip_grad_norm_(torch_params, MAX_GRAD_NORM, foreach=True)
        fused_torch.step()

    return {
        "FusedSGD clipped": clipped.step,
        "FusedSGD": steps["FusedSGD"],
        "torch clip_grad_norm_ + fused": torch_pair,
        "floor": steps["floor"],
    }


SCHEDULE_FREE = dict(lr=1.0, momentum=0.9, weight_decay=1e-4, warmup_steps=10)


def schedule_free_contenders(params: list[torch.Tensor]) -> tuple[dict[str, object], dict[str, object]]:
    """(h): our schedule-free step, schedulefree's foreach one and the 20-byte floor (the momentum step's,
    z where the buffer is); (i): a train/eval round trip of each (two passes) and two passes of the 12-byte
    switch floor. Each optimizer on its own copy of the tensors, in train mode with z created."""
    import schedulefree

    ours = FusedSGDScheduleFree(clone_params(params), backend="compiled", **SCHEDULE_FREE)
    peer = schedulefree.SGDScheduleFree(clone_params(params), foreach=True, **SCHEDULE_FREE)
    for optimizer in (ours, peer):
        optimizer.train()
        optimizer.step()  # creates z
    floor = floor_ops()
    ours_params = [p for g in ours.param_groups for p in g["params"]]
    floor_params = clone_params(ours_params)
    floor_z = [ours.state[p]["z"].clone() for p in ours_params]

    def round_trip(optimizer: object) -> object:
        return lambda: (optimizer.eval(), optimizer.train())

    # The switch floor runs on the optimizer's own params and z (two XORs with z leave the params as they
    # were): the same memory as the switches it is compared with, whose speed varies with where it lies.
    own_params = [p.detach() for p in ours_params]
    own_z = [ours.state[p]["z"] for p in ours_params]

    def floor_round_trip() -> None:
        floor.floor_switch(own_params, own_z)
        floor.floor_switch(own_params, own_z)

    steps = {
        "FusedSGDScheduleFree": ours.step,
        "schedulefree foreach": peer.step,
        "floor": lambda: floor.floor_step(floor_params, [p.grad for p in floor_params], floor_z, [], []),
    }
    switches = {
        "FusedSGDScheduleFree eval+train": round_trip(ours),
        "schedulefree eval+train": round_trip(peer),
        "floor": floor_round_trip,
    }
    return steps, switches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="smaller flat tensor (10M), fewer repeats")
    args = parser.parse_args()
    repeats = 5 if args.quick else args.repeats
    flat = 10_000_000 if args.quick else 100_000_000
    rn50 = resnet50_shapes()
    cases = [
        ("(a) ResNet-50, 161 tensors, fp32", rn50, torch.float32, False),
        (f"(b) one flat tensor, {flat / 1e6:.0f}M, fp32", [torch.Size([flat])], torch.float32, False),
        ("(c) 2,000 tensors x 4,096, fp32", [torch.Size([4096])] * 2000, torch.float32, False),
        ("(d) ResNet-50, bf16 + fp32 master weights", rn50, torch.bfloat16, True),
        (f"(e) ResNet-50, fp32, max_grad_norm={MAX_GRAD_NORM:g}", rn50, torch.float32, False),
        ("(f) ResNet-50, bf16, no master weights", rn50, torch.bfloat16, False),
        ("(g) ResNet-50, fp16 + fp32 master weights", rn50, torch.float16, True),
        ("(h) ResNet-50, fp32, schedule-free step", rn50, torch.float32, False),
        ("(i) ResNet-50, fp32, schedule-free eval() + train()", rn50, torch.float32, False),
    ]
    rows = []
    state_bytes = {}
    master_over_fp32 = {}
    for name, shapes, dtype, master in cases:
        params = make_params(shapes, dtype)
        if name.startswith("(h)"):
            steps, switches = schedule_free_contenders(params)
        elif name.startswith("(i)"):
            steps = switches
        elif name.startswith("(e)"):
            steps = clipping_contenders(params)
        elif name.startswith("(f)"):
            steps, state_bytes = rounding_contenders(params)
        else:
            steps = contenders(params, master)
        if master:  # (d), (g): against (a)'s fp32 step in the same interleaved loop: the machine drifts
            fp32 = FusedSGD(make_params(shapes, torch.float32), backend="compiled", **HPARAMS)
            steps["FusedSGD fp32 (a)"] = fp32.step
        times = time_interleaved(steps, repeats=repeats)
        if master:
            master_over_fp32[str(dtype).removeprefix("torch.")] = times["FusedSGD"] / times.pop(
                "FusedSGD fp32 (a)"
            )
        rows.append((name, times))
        print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items()), flush=True)
        del params
    title = (
        f"Step time, median of {repeats} (momentum 0.9, Nesterov, wd 1e-4; {torch.get_num_threads()} threads)"
    )
    print_table(title, [*rows[:4], rows[6]], "floor")
    print_table(f"Norm clipping: {title}", rows[4:5], "floor")
    print_table(f"bf16 without master weights: {title}", rows[5:6], "floor")
    for dtype, ratio in master_over_fp32.items():
        print(f"\n{dtype} + master weights / fp32 FusedSGD step on (a)'s shapes: {ratio:.2f}")
    bf16 = rows[5][1]
    print(
        f"(f) stochastic / nearest: {bf16['FusedSGD stochastic'] / bf16['FusedSGD']:.2f}; "
        f"with master weights / stochastic: {bf16['FusedSGD + masters'] / bf16['FusedSGD stochastic']:.2f}; "
        f"kahan / its floor (14 B): {bf16['FusedSGD kahan'] / bf16['floor kahan']:.2f}; "
        f"with master weights / kahan: {bf16['FusedSGD + masters'] / bf16['FusedSGD kahan']:.2f}; "
        "optimizer state, bytes per parameter: "
        + ", ".join(f"{name} {size:g}" for name, size in state_bytes.items())
    )
    print_table(f"Schedule-free SGD: median of {repeats} ({SCHEDULE_FREE})", rows[7:8], "floor")
    print_table(f"Schedule-free train()/eval(): median of {repeats}", rows[8:9], "floor")
    sf_step, sf_switch = rows[7][1], rows[8][1]
    ours = sf_step["FusedSGDScheduleFree"]
    print(
        f"(h) FusedSGDScheduleFree / its 20-byte floor: {ours / sf_step['floor']:.2f}; "
        f"schedulefree foreach / ours: {sf_step['schedulefree foreach'] / ours:.2f}; "
        f"(i) eval+train / its 12-byte floor: "
        f"{sf_switch['FusedSGDScheduleFree eval+train'] / sf_switch['floor']:.2f}; schedulefree's / ours: "
        f"{sf_switch['schedulefree eval+train'] / sf_switch['FusedSGDScheduleFree eval+train']:.2f}"
    )
    clip = rows[4][1]
    ours = clip["FusedSGD clipped"]
    print(
        f"(e) clipped / plain FusedSGD: {ours / clip['FusedSGD']:.2f}; "
        f"torch's pair / clipped FusedSGD: {clip['torch clip_grad_norm_ + fused'] / ours:.2f}"
    )
    path = write_json(
        "step",
        {
            "repeats": repeats,
            "hparams": HPARAMS,
            "cases": {n: t for n, t in rows},
            "master_over_fp32": master_over_fp32,
            "max_grad_norm": MAX_GRAD_NORM,
            "state_bytes_per_param": state_bytes,
            "schedule_free": SCHEDULE_FREE,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
