"""The benchmarks' data-movement floor (``floor_step``): the bytes it moves, checked bit by bit, and the
LARS floor's extra reads leaving the same result."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import floor_ops  # noqa: E402  (bench/ builds the floor; it is not in the product extension)

# Two tensors larger than a LARS wave (1M elements), so the LARS floor runs several waves.
SHAPES = [(1_100_000,), (300, 17), (5,), (1_200_000,)]


def tensors(seed, dtype=torch.float32, master=False):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator).to(dtype) for s in SHAPES]
    grads = [torch.randn(s, generator=generator).to(dtype) for s in SHAPES]
    weights = [p.float() for p in params] if master else params
    buffers = [torch.randn(s, generator=generator).to(w.dtype) for s, w in zip(SHAPES, weights)]
    return params, grads, buffers, weights if master else []


def bits(t):
    """A tensor's bit patterns as non-negative int64s (so shifts and XORs compare exactly)."""
    if t.element_size() == 4:
        return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


@pytest.mark.parametrize("master", [False, True])
def test_floor_moves_the_bytes_of_a_momentum_step(master):
    dtype = torch.bfloat16 if master else torch.float32
    params, grads, buffers, masters = tensors(0, dtype, master)
    weights = masters if master else params
    expected_w = [bits(g) << 16 if master else bits(g) for g in grads]
    expected_b = [bits(w) ^ bits(b) for w, b in zip(weights, buffers)]
    floor_ops().floor_step(params, grads, buffers, masters, [])
    for w, b, ew, eb in zip(weights, buffers, expected_w, expected_b):
        assert torch.equal(bits(w), ew)
        assert torch.equal(bits(b), eb)
    if master:  # the low-precision param gets the rounded value written back: here, the grad's bits
        assert all(torch.equal(bits(p), bits(g)) for p, g in zip(params, grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fourth_stream_is_read_and_written_beside_the_step(dtype):
    """The floor of a step that also keeps an average of the weights (fp32) or Kahan compensations (bf16): a
    companion of the params' dtype, read and written (XOR-ed with the grad), the rest as the plain floor."""
    params, grads, buffers, _ = tensors(3, dtype)
    generator = torch.Generator().manual_seed(4)
    companions = [torch.randn(s, generator=generator).to(dtype) for s in SHAPES]
    expected_c = [bits(c) ^ bits(g) for c, g in zip(companions, grads)]
    expected_w = [bits(g) for g in grads]
    floor_ops().floor_step(params, grads, buffers, companions, [])
    for c, w, ec, ew in zip(companions, params, expected_c, expected_w):
        assert torch.equal(bits(c), ec)
        assert torch.equal(bits(w), ew)


def test_lars_floor_only_adds_reads():
    plain, lars = tensors(1), tensors(1)
    floor_ops().floor_step(*plain, [])
    floor_ops().floor_step(*lars, [True, False, True, True])
    for a, b in zip(plain[0] + plain[2], lars[0] + lars[2]):
        assert torch.equal(bits(a), bits(b))  # bit patterns: XOR-ed floats include NaNs


def test_floor_refuses_mismatched_layouts():
    params, grads, buffers, _ = tensors(2)
    grads[1] = grads[1].t().contiguous()  # (17, 300) for a (300, 17) param
    before = [p.clone() for p in params]
    with pytest.raises(RuntimeError, match="grad must match"):
        floor_ops().floor_step(params, grads, buffers, [], [])
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    with pytest.raises(RuntimeError, match="one flag per param"):
        floor_ops().floor_step(*tensors(3)[:3], [], [True])


def test_the_switch_floor_reads_the_params_and_z_and_writes_the_params():
    """floor_switch (a schedule-free train()/eval()'s 12 bytes): each param becomes its bits XOR z's, z is
    left as it was."""
    params, _, zs, _ = tensors(1)
    expected = [bits(p) ^ bits(z) for p, z in zip(params, zs)]
    before = [z.clone() for z in zs]
    floor_ops().floor_switch(params, zs)
    assert all(torch.equal(bits(p), e) for p, e in zip(params, expected))
    assert all(torch.equal(z, b) for z, b in zip(zs, before))
