"""The tensor subclasses FSDP2 all-gathers --fp8-param-gather's weights through, on their own
(tests/parallel/test_fp8_fsdp.py trains with them on gloo ranks)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, logged_losses
from threefold.kernels.fp8 import Fp8Linear
from threefold.kernels.fp8_fsdp import Fp8GatheredWeight, Fp8ShardWeight
from threefold.kernels.fp8_gemms import E4M3
from threefold.kernels.fp8_recipe import Fp8Recipe


def test_a_shard_stays_a_shard_through_fsdp2s_sharding_and_nothing_else():
    """FSDP2's chunk, narrow, padding and view keep the subclass (its hooks must survive
    sharding); anything else, the optimizer's moments and updates among them, gives plain
    tensors, and in-place updates land in the fp32 rows themselves."""
    rows = torch.arange(12.0).view(4, 3)
    shard = Fp8ShardWeight(rows)
    for kept in (
        shard.chunk(2)[1],
        shard.narrow(0, 1, 2),
        shard.new_zeros(5, 3),
        shard.view(-1),
        shard.detach(),
    ):
        assert type(kept) is Fp8ShardWeight
    for plain in (torch.zeros_like(shard), shard * 2, shard.clone(), shard.sum()):
        assert type(plain) is torch.Tensor
    assert shard.copy_(torch.ones(4, 3)) is shard
    shard.add_(1.0)
    assert torch.equal(rows, torch.full((4, 3), 2.0))


def test_the_all_gather_hooks_move_fp8_bytes_and_the_gathered_weight_reads_them():
    shard = Fp8ShardWeight(torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="before its FP8 copy was cast"):
        shard.fsdp_pre_all_gather(None, None, None, None, None)
    shard.fp8_shard = torch.tensor([[1.0, -2.0, 0.5, 448.0]] * 2).to(E4M3)
    (inputs,), metadata = shard.fsdp_pre_all_gather(None, None, None, None, None)
    assert inputs.dtype == torch.uint8 and inputs.data_ptr() == shard.fp8_shard.data_ptr()
    gathered = torch.cat([inputs, inputs])  # two ranks' rows, as FSDP2 lays them out
    weight, inner = shard.fsdp_post_all_gather((gathered,), metadata, torch.bfloat16)
    assert type(weight) is Fp8GatheredWeight and weight.dtype == torch.bfloat16
    assert weight.fp8.dtype == E4M3 and weight.fp8.data_ptr() == gathered.data_ptr()
    assert inner == (gathered,)
    assert shard.fsdp_post_all_gather((gathered,), metadata, torch.bfloat16, out=weight) is None
    # FSDP2 trims the padding rows, then makes a Parameter of it
    trimmed = torch.nn.Parameter(torch.as_strided(weight, (3, 4), (4, 1), 0))
    assert type(trimmed) is Fp8GatheredWeight and trimmed.fp8.shape == (3, 4)
    assert Fp8Linear(Fp8Recipe()).gathered_fp8(trimmed) is trimmed.fp8
    with pytest.raises(NotImplementedError, match="only its layer's FP8 GEMMs read it"):
        trimmed + 1


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 GEMMs need a GPU of compute capability 8.9 or later",
)
def test_fsdp2_fp8_param_gather_on_cuda_follows_the_run_without_it():
    """The CUDA leg (bench/gpu_session.sh tests): one torchrun rank, NCCL, FSDP2 in bf16 with
    FP8 GEMMs, with and without --fp8-param-gather: the FP8 rows cast on the device, gathered
    through NCCL as bytes, read by cuBLASLt; the losses of the two runs within 5e-4 (they
    differ only by the weights' casts, from the fp32 shards or from their bf16 copies)."""
    losses = []
    for flags in ([], ["--fp8-param-gather"]):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
        command += [os.path.join(ROOT, "pretrain_gpt.py"), *TINY_CUDA_RUN, *flags]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "all-gathered in FP8" in result.stdout or not flags
        losses.append([float(v) for v in logged_losses(result.stdout)["train"].values()])
    assert len(losses[0]) == 5 and len(losses[1]) == 5
    for without, with_flag in zip(*losses):
        assert abs(with_flag - without) <= 5e-4 * abs(without), losses


TINY_CUDA_RUN = [
    *["--distributed-strategy", "fsdp", "--bf16", "--fp8-format", "hybrid"],
    *["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4"],
    *["--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4"],
    *["--train-iters", "5", "--lr", "1e-4", "--mock-data", "--vocab-size", "512"],
    *["--log-interval", "1", "--eval-iters", "0", "--seed", "3"],
]
