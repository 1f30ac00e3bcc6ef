"""Sharded training on 2 CPU processes (gloo): FusedSGD over FSDP2 (DTensor params, uneven and empty shards),
DDP and ZeroRedundancyOptimizer, each against a one-process run of the same model and data; collectives per
step; checkpoints through torch.distributed.checkpoint. One spawn runs every scenario (sharded_harness.py)."""

from __future__ import annotations

import pytest
import sharded_harness as h
import torch
import torch.multiprocessing as mp
from helpers import free_port
from oracles import assert_close_rel

from lightning_fusedsgd import FusedSGD

pytestmark = [
    pytest.mark.slow,  # several processes: make test runs them, make test-fast not
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]

# fp32 results differ from the one-process run only by the order in which the norms are summed; masters too.
REL_FP32 = 1e-5
# bf16 params are the rounding of masters that agree to REL_FP32: one bf16 step apart at most.
REL_BF16 = 2**-7
# Under tensor parallelism the forward and backward sum in another order too (a row-parallel layer's partial
# outputs are all-reduced), so the gradients themselves differ by fp32 rounding, most where a sum cancels (the
# last bias's momentum buffer: 1.2e-5 of its largest element on an AVX-512 Xeon, 5 steps).
REL_TP = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    mp.spawn(h.worker, args=(free_port(), str(tmp / "runs.pt"), str(tmp / "dcp")), nprocs=h.WORLD, join=True)
    return torch.load(tmp / "runs.pt"), tmp / "dcp"


def dtype_of(tensors):
    return next(iter(tensors.values())).dtype if tensors else None


def _assert_same(actual, expected, rel_param=REL_FP32, rel_fp32=REL_FP32):
    for key in ("param", "momentum_buffer", "master_param", "ema"):
        assert actual[key].keys() == expected[key].keys(), key
        names = sorted(expected[key])
        rel = rel_param if key == "param" or dtype_of(expected[key]) == torch.bfloat16 else rel_fp32
        assert_close_rel([actual[key][n] for n in names], [expected[key][n] for n in names], rel)


@pytest.mark.parametrize("name", list(h.SCENARIOS))
def test_fsdp2_equals_one_process(runs, name):
    results, _ = runs
    dtype = h.SCENARIOS[name][0]
    expected = h.one_process(name)
    _assert_same(results[name], expected, REL_BF16 if dtype == torch.bfloat16 else REL_FP32)
    assert results[name]["placed"], "optimizer state must be DTensors placed like their params"
    # The global gradient norm of the last step, which every step clipping by norm or using LARS takes.
    options = h.SCENARIOS[name][1]
    if options.get("lars") or options.get("max_grad_norm"):
        assert isinstance(expected["grad_norm"], torch.Tensor)
        torch.testing.assert_close(results[name]["grad_norm"], expected["grad_norm"], rtol=1e-5, atol=0)
    else:
        assert results[name]["grad_norm"] is None and expected["grad_norm"] is None


@pytest.mark.parametrize("name", ["plain", "nesterov"])
def test_fsdp2_equals_torch_sgd(runs, name):
    results, _ = runs
    _, kwargs = h.SCENARIOS[name]
    model = h.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=h.LR, **kwargs)
    h.train(model, optimizer, h.batches())
    _assert_same(results[name], h.snapshot(model, optimizer))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("plain", 0),
        ("lars", 1),
        ("max_grad_norm", 1),
        ("lars_decayed_grad_max_grad_norm", 1),
        ("lars_weights_only_max_grad_norm", 1),
        ("lars_weights_only", 1),
        ("reference_backend_lars_decayed_grad_max_grad_norm", 1),
    ],
)
def test_collectives_per_step(runs, name, expected):
    """The norms of every sharded tensor (and the clip norm) travel in one all-reduce per step."""
    results, _ = runs
    assert results[name]["all_reduces"] == [expected] * h.STEPS


@pytest.mark.parametrize("name", list(h.SCENARIOS))
def test_later_steps_reuse_the_kept_sharded_plan(runs, name):
    """Only the first step (which creates the momentum buffers) and the second (which keeps its plan) plan
    from scratch; the others reuse the kept plan with their new gradient shards, whose results
    test_fsdp2_equals_one_process checks. The reference backend keeps no plan."""
    results, _ = runs
    reference = h.SCENARIOS[name][1].get("backend") == "reference"
    assert results[name]["planned"] == (h.STEPS if reference else 2)


def test_sharded_grad_scaler_skips_a_step_on_every_rank(runs):
    """Under torch's ShardedGradScaler, an inf that only rank 1's gradient shard holds skips that step on both
    ranks (the check over DTensor grads is global), the schedule does not advance on either, and the run
    equals one process whose GradScaler skipped the same step."""
    results, _ = runs
    scaled = results["sharded_grad_scaler"]
    expected = [step != h.INF_STEP for step in range(h.STEPS)]
    assert scaled["applied_per_rank"] == [expected] * h.WORLD
    assert (scaled["last_epoch"], scaled["skipped_steps"]) == (h.STEPS - 1, 1)
    model = h.make_model()
    optimizer = h.make_optimizer(model, h.SCENARIOS["lars"][1])
    counts = h.scaled_train(model, optimizer, torch.amp.GradScaler("cpu", init_scale=1024.0), inf_rank=None)
    assert counts["applied"] == expected
    _assert_same(scaled, h.snapshot(model, optimizer))


def test_tensor_parallel_lars_with_clipping_equals_one_process(runs):
    """Tensor parallelism's placements (Shard(0), Shard(1), Replicate) and a plain last layer in one step:
    LARS and the clip norm in one all-reduce, equal to one process."""
    results, _ = runs
    tp = results["tensor_parallel"]
    assert tp["placements"] == {
        "0.weight": "(Shard(dim=0),)",
        "0.bias": "(Shard(dim=0),)",
        "2.weight": "(Shard(dim=1),)",
        "2.bias": "(Replicate(),)",
    }
    assert tp["all_reduces"] == [1] * h.STEPS
    model = h.make_tp_model()
    optimizer = h.make_optimizer(model, h.SCENARIOS["lars_max_grad_norm"][1])
    h.train(model, optimizer, h.batches())
    _assert_same(tp, h.snapshot(model, optimizer), REL_TP, REL_TP)


@pytest.fixture(scope="module")
def mesh_2d_runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("mesh_2d") / "runs.pt"
    mp.spawn(h.mesh_2d_worker, args=(free_port(), str(path)), nprocs=h.MESH_2D_WORLD, join=True)
    return torch.load(path)


@pytest.mark.parametrize("name", h.MESH_2D_SCENARIOS)
def test_fsdp2_over_tensor_parallel_on_a_2d_mesh_equals_one_process(mesh_2d_runs, name):
    """FSDP2 over TP on a 2 x 2 mesh: a weight sharded on both dimensions (the TP one a _StridedShard) has its
    norms summed over both, a bias sharded on one over that one; one all-reduce per process group (the "dp"
    and "tp" groups: 2 a step with norms), equal to one process."""
    run = mesh_2d_runs[name]
    assert run["placements"]["0.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert run["placements"]["2.bias"] == "(Shard(dim=0), Replicate())"
    assert run["all_reduces"] == [0 if name == "plain" else 2] * h.STEPS
    model = h.make_tp_model()
    optimizer = h.make_optimizer(model, h.SCENARIOS[name][1])
    h.train(model, optimizer, h.batches())
    _assert_same(run, h.snapshot(model, optimizer), REL_TP, REL_TP)


def test_hsdp_sums_norms_over_the_sharded_dimension_only(mesh_2d_runs):
    """HSDP (replicated over the mesh's first dimension, sharded over its second): LARS with clipping takes
    one all-reduce a step, over the shard group, and equals one process."""
    run = mesh_2d_runs["hsdp"]
    assert set(run["placements"].values()) == {"(Replicate(), Shard(dim=0))"}
    assert run["all_reduces"] == [1] * h.STEPS
    _assert_same(run, h.one_process(h.HSDP_SCENARIO))


def test_ddp_equals_one_process(runs):
    results, _ = runs
    _assert_same(results["ddp"], h.one_process("lars"))


def test_zero_redundancy_optimizer_equals_one_process(runs):
    results, _ = runs
    expected = h.one_process("lars")["param"]
    names = sorted(expected)
    assert_close_rel([results["zero"]["param"][n] for n in names], [expected[n] for n in names], REL_FP32)
    assert all(stepped > 0 for stepped in results["zero"]["ranks_stepped"]), "each rank steps its partition"


@pytest.mark.parametrize("name", ["lars", "lars_ema", "bf16_master_lars", "bf16_kahan_lars"])
def test_state_dict_round_trip_mid_run_equals_uninterrupted(runs, name):
    results, _ = runs
    resumed = results[f"resumed_{name}"]
    _assert_same(resumed, results[name])
    assert all(master.dtype == torch.float32 for master in resumed["master_param"].values())


def test_dcp_checkpoint_of_two_ranks_continues_in_one_process(runs):
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _, checkpoint_dir = runs
    model = h.make_model()
    optimizer = FusedSGD(model.parameters(), lr=h.LR, **h.SCENARIOS["lars_ema"][1])
    model_state, optim_state = get_state_dict(model, optimizer)
    load({"model": model_state, "optim": optim_state}, checkpoint_id=str(checkpoint_dir))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    h.train(model, optimizer, h.batches()[2:])
    _assert_same(h.snapshot(model, optimizer), h.one_process("lars_ema"))


def test_a_partial_param_is_refused_and_changes_nothing(runs):
    results, _ = runs
    assert "Partial placement" in results["partial_param"] and "Redistribute" in results["partial_param"]
    assert results["partial_param_unchanged"]


def test_plain_state_into_sharded_params_is_refused_and_changes_nothing(runs):
    results, _ = runs
    message = results["plain_into_sharded"]
    assert "is a plain tensor but the parameter is a DTensor" in message
    assert "set_optimizer_state_dict" in message
    assert results["plain_into_sharded_unchanged"]
