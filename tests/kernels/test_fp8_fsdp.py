"""The tensor subclasses FSDP2 all-gathers --fp8-param-gather's weights through, on their own
(tests/parallel/test_fp8_fsdp.py trains with them on gloo ranks)."""

import pytest
import torch

from threefold.kernels.fp8 import Fp8Linear, Fp8Recipe
from threefold.kernels.fp8_fsdp import Fp8GatheredWeight, Fp8ShardWeight
from threefold.kernels.fp8_gemms import E4M3


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
