"""Independent oracles the tests share, written apart from the package: closeness relative to the largest
expected value, and the LARS formula of You et al. (docs/design.md) in float64."""

from __future__ import annotations


def assert_close_rel(actual, expected, rel):
    for a, e in zip(actual, expected):
        scale = e.detach().abs().max().clamp_min(1e-12)
        assert ((a.detach().float() - e.detach().float()).abs().max() / scale).item() <= rel


def lars_oracle_step(
    weights,
    buffers,
    grads,
    *,
    lars_mask,
    lr,
    nesterov,
    trust_clip,
    decayed_grad,
    maximize,
    eta=1e-3,
    eps=0.0,
    dampening=0.0,
    weight_decay=5e-4,
    momentum=0.9,
):
    """One step of the LARS formula in float64; ``weights`` and ``buffers`` (lists) are updated in place.
    ``lars_mask`` marks the tensors the trust ratio applies to; the others get plain SGD."""
    for i, (w, g) in enumerate(zip(weights, grads)):
        g = -g if maximize else g
        if lars_mask[i]:
            w_norm = w.norm().item()
            raw_norm = g.norm().item()
            if decayed_grad:
                denominator_norm = (g + weight_decay * w).norm().item()
                ratio = (
                    eta * w_norm / (denominator_norm + eps) if w_norm > 0 and denominator_norm > 0 else 1.0
                )
            else:
                ratio = (
                    eta * w_norm / (raw_norm + weight_decay * w_norm + eps)
                    if w_norm > 0 and raw_norm > 0
                    else 1.0
                )
            if trust_clip:
                ratio = min(ratio / lr, 1.0)
            d = ratio * (g + weight_decay * w)
        else:
            d = g + weight_decay * w
        buffers[i] = d.clone() if buffers[i] is None else momentum * buffers[i] + (1 - dampening) * d
        step = d + momentum * buffers[i] if nesterov else buffers[i]
        weights[i] = w - lr * step
