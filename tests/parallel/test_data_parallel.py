"""Data parallelism reproduces the single-process run (real gloo ranks)."""

import pytest

from tests.distributed import run_distributed
from tests.parity import (
    DP_TOLERANCE,
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_close_dicts,
    assert_losses_close,
    assert_matches_reference,
    train_job,
)
from threefold.model.loss import gpt_forward_step
from threefold.parallel.data_parallel.gradient_buffer import finalize_model_grads
from threefold.parallel.pipeline_parallel.schedules import get_forward_backward_func


def test_data_parallel_2_matches_single_process():
    argv = GPT2_STYLE + TRAINING
    reference = train_job(argv, 10)
    # DP=2 with the same global batch of 8: 2 micro-batches of 2 per rank instead of 4.
    results = run_distributed(2, train_job, argv, 10)
    for rank_result in results:
        assert_losses_close(rank_result["losses"], reference["losses"], 1e-6)
    assert_close_dicts(results[0]["params"], reference["params"], 1e-6, "parameter")
    # Replicas stay identical.
    assert_close_dicts(results[1]["params"], results[0]["params"], 0.0, "replica parameter")


OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "2000"]


@pytest.mark.parametrize(
    "world_size,flags,tolerance",
    [
        (2, [], DP_TOLERANCE),
        (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 1e-5),
        (4, ["--pipeline-model-parallel-size", "2"], DP_TOLERANCE),
        (4, ["--use-distributed-optimizer", "--ddp-average-in-collective"], DP_TOLERANCE),
    ],
)
def test_overlapped_bucketed_reduction_matches_single_process(world_size, flags, tolerance):
    argv = LLAMA_STYLE + TRAINING
    reference = train_job(argv, 10)
    results = run_distributed(world_size, train_job, argv + OVERLAP + flags, 10)
    assert_matches_reference(results, reference, tolerance)


def _buckets_launched_in_backward(argv: list[str]) -> dict:
    trainer = _setup(argv)
    buffer = trainer.data_parallel.grad_buffer
    buffer.start_step(trainer.num_microbatches)
    get_forward_backward_func(trainer.parallel.pp)(
        gpt_forward_step, trainer.train_iterator(), trainer.model_chunks, trainer.num_microbatches
    )
    launched = len(buffer._handles)  # before finalize_model_grads is called
    finalize_model_grads(buffer, trainer.parallel)
    return {"buckets": len(buffer.buckets), "launched_during_backward": launched}


def test_overlap_launches_every_bucket_during_backward():
    result = run_distributed(2, _buckets_launched_in_backward, LLAMA_STYLE + TRAINING + OVERLAP)[0]
    assert result["buckets"] > 3
    assert result["launched_during_backward"] == result["buckets"]


def test_gradient_buffer_dies_with_its_last_reference():
    # Its hooks live in the parameters' C++ side, out of the collector's sight: a strong
    # reference there would keep the buffer, the model and the process groups alive forever.
    import weakref

    import torch

    from threefold.parallel.data_parallel.gradient_buffer import GradientBuffer
    from threefold.parallel.parallel_context import Group

    model = torch.nn.Linear(4, 4)
    buffer = GradientBuffer(list(model.parameters()), Group(None, 1, 0))
    model(torch.ones(2, 4)).sum().backward()
    assert model.weight.main_grad.abs().sum() > 0  # the hook ran
    alive = weakref.ref(buffer)
    del buffer
    assert alive() is None
    model(torch.ones(2, 4)).sum().backward()  # a hook outliving its buffer does nothing
    assert model.weight.grad is not None


def _polling_threads() -> int:
    import os

    names = [open(f"/proc/self/task/{task}/comm").read() for task in os.listdir("/proc/self/task")]
    return sum(name.startswith(("gloo", "pt_gloo")) for name in names)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs /proc")
def test_training_jobs_leave_no_process_groups_behind():
    """Each group keeps gloo threads polling; a worker that leaked one per job (the gradient
    buffer's hooks, megatron-core's context-parallel globals) slowed every later test."""
    before = run_distributed(2, _polling_threads)
    flags = ["--tensor-model-parallel-size", "2"]
    for argv in (flags, ["--context-parallel-size", "2"]):
        run_distributed(2, train_job, LLAMA_STYLE + TRAINING + argv, 1)
    assert run_distributed(2, _polling_threads) == before


def _finite_before_and_after_the_reduction() -> tuple[bool, bool]:
    """One bucket, --overlap-grad-reduce: rank 1's gradient holds a nan; the bucket's
    all-reduce starts from the gradient hook and completes before the NaN check looks."""
    import torch
    import torch.distributed as dist

    from threefold.parallel.data_parallel.gradient_buffer import GradientBuffer
    from threefold.parallel.parallel_context import Group

    param = torch.nn.Parameter(torch.ones(4))
    dp = Group(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    buffer = GradientBuffer([param], dp, overlap_grad_reduce=True)
    buffer.check_finite = True
    buffer.start_step(num_microbatches=1)
    param.grad = torch.full((4,), float("nan") if dp.rank == 1 else 1.0)
    buffer._accumulate(param)  # the gradient hook: the bucket is complete, its reduction starts
    for handle, _ in buffer._handles.values():
        handle.wait()  # the collective has written the mean (nan) into every rank's storage
    mine = bool(buffer.local_grads_finite())
    buffer.finish_grad_sync()
    return mine, bool(torch.isfinite(param.main_grad).all())


def test_nan_check_looks_at_each_bucket_before_its_overlapped_reduction():
    """Under --overlap-grad-reduce the NaN check reads what each rank computed, not storage
    the reduction is writing: rank 0 stays finite although its buffer now holds rank 1's nan."""
    (rank0, reduced0), (rank1, reduced1) = run_distributed(
        2, _finite_before_and_after_the_reduction
    )
    assert (rank0, rank1) == (True, False)
    assert not reduced0 and not reduced1


def _averaged_in_collective(scaling_factor: float | None) -> dict:
    """One bucket of this rank's gradient (rank r: r + i / 7) reduced with averaging in the
    collective, all-reduced and reduce-scattered; and the scaled sum it must equal."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from threefold.parallel.data_parallel.gradient_buffer import GradientBuffer
    from threefold.parallel.parallel_context import Group

    rank, world = dist.get_rank(), dist.get_world_size()
    dp = Group(dist.group.WORLD, world, rank)
    values = [torch.arange(12, dtype=torch.float32) / 7 + r for r in range(world)]
    out = {}
    for reduce_scatter in (False, True):
        param = nn.Parameter(torch.zeros(12))
        buffer = GradientBuffer(
            [param], dp, pad_to_multiple=world, average_in_collective=True,
            gradient_scaling_factor=scaling_factor,
        )  # fmt: skip
        buffer.reduce_scatter = reduce_scatter
        param.main_grad.copy_(values[rank])
        buffer.finish_grad_sync()
        start, end = buffer.shard_range(0) if reduce_scatter else (0, 12)
        out[reduce_scatter] = (param.main_grad.reshape(-1)[start:end].clone(), start, end)
    expected = sum(values) * (scaling_factor or 1 / world)
    return {"out": out, "expected": expected}


@pytest.mark.parametrize("scaling_factor", [None, 1 / 6], ids=["mean", "experts-of-6"])
def test_averaging_in_the_collective_scales_once(scaling_factor):
    """--ddp-average-in-collective (on gloo: NCCL's AVG for floats, each rank's values x 1/n
    on the way into the sum) gives the mean, and a scaling factor other than the mean
    (Megatron-LM's expert gradients) applied once, in both reductions."""
    import torch

    for result in run_distributed(3, _averaged_in_collective, scaling_factor):
        expected = result["expected"]
        for shard, start, end in result["out"].values():
            torch.testing.assert_close(shard, expected[start:end], rtol=1e-6, atol=0)


def _replicas_checked(argv: list[str], flip_rank: int) -> dict:
    """Two steps with --check-weight-hash-across-dp-replicas-interval 1, then one bit of one
    weight flipped on `flip_rank`: what each check says."""
    import torch

    from threefold.training.replica_check import ReplicaMismatchError

    trainer = _setup(argv + ["--check-weight-hash-across-dp-replicas-interval", "1"])
    check = trainer.replica_check
    lines = []
    for iteration in (1, 2):
        trainer.train_step()
        lines.append(check.check(iteration, trainer.layout_independent_parameters()))
    name, param = trainer.layout_independent_parameters()[3]
    if trainer.parallel.world.rank == flip_rank:
        with torch.no_grad():
            bits = param.data.view(-1)[:1].view(torch.int32)
            bits ^= 1  # the lowest mantissa bit of one element
    try:
        check.check(3, trainer.layout_independent_parameters())
    except ReplicaMismatchError as error:
        return {"lines": lines, "error": str(error), "name": name}
    return {"lines": lines, "error": None, "name": name}


@pytest.mark.parametrize(
    "flags",
    [[], ["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce"]],
    ids=["dp2", "dp2-distributed-optimizer-overlap"],
)
def test_weight_hash_check_passes_replicas_and_names_one_that_differs(flags):
    """Megatron-LM's --check-weight-hash-across-dp-replicas-interval: replicas agree after
    every step (its line), and one flipped bit on rank 1 stops every rank naming the
    parameter and the rank."""
    results = run_distributed(2, _replicas_checked, LLAMA_STYLE + TRAINING + flags, 1)
    for result in results:
        assert result["lines"] == [
            ">>> Weight hashes match after 1 iterations...",
            ">>> Weight hashes match after 2 iterations...",
        ]
        assert result["error"] == (
            "--check-weight-hash-across-dp-replicas-interval: the weights of data-parallel "
            f"replicas differ after iteration 3: {result['name']} on rank 1, against the "
            "first replica's"
        )


def _refusal_under_fsdp(argv: list[str]) -> str:
    from threefold.config import ConfigError

    try:
        _setup(argv)
    except ConfigError as error:
        return str(error)
    return "accepted"


def test_weight_hash_check_runs_from_the_command_line_and_is_refused_under_fsdp():
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    flag = ["--check-weight-hash-across-dp-replicas-interval", "2"]
    argv = LLAMA_STYLE + TRAINING + flag
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv, "--train-iters", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = [line for line in result.stdout.splitlines() if line.startswith(">>> Weight hashes")]
    assert found == [f">>> Weight hashes match after {i} iterations..." for i in (0, 2, 4)]
    (message,) = run_distributed(1, _refusal_under_fsdp, argv + ["--distributed-strategy", "fsdp"])
    assert "FSDP2 shards every weight over the data-parallel ranks" in message
