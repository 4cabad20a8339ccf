"""--fp8-param-gather under FSDP2 (--distributed-strategy fsdp): the FP8 layers' weights
all-gathered as FP8 bytes, cast once per step from FSDP2's fp32 shards.

Without it FSDP2 all-gathers each layer's fp32 shards in the compute dtype (bf16: 2 bytes an
element) before every forward, and again before the backward, and each micro-batch's forward
casts the gathered weight to FP8. With it, as torchtitan's float8 all-gather
(`enable_fsdp_float8_all_gather` with `precompute_float8_dynamic_scale_for_fsdp`), each rank
casts its own rows of each weight once per optimizer step, with the scale of the whole weight,
and FSDP2 all-gathers those FP8 bytes (`kernels/fp8_fsdp.py`'s tensor subclasses): 1 byte an
element on the wire, and the GEMMs read the gathered bytes as they are.

The scales are those of threefold.model.fp8_params (the distributed optimizer's version of
the flag), from the same code (`Fp8ShardCasts`): the amax of each rank's rows reduced (max)
over FSDP2's group and the layer's TP x CP group, in one message for all weights, then the
tensorwise scale or the delayed history's (the amax recorded as the step's weight amax);
blockwise, the amaxes of each 128 x 128 block reduced over FSDP2's group. In fp32 the
gathered bytes are exactly what one device casting the whole weight gets.

The fp32 shards stay FSDP2's parameters and the optimizer's masters, and checkpoints hold
them as without the flag; FP8 costs 1 byte per element of each rank's shard on top.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from threefold.kernels.fp8_fsdp import Fp8ShardWeight
from threefold.model.fp8_params import Fp8ShardCasts
from threefold.parallel.parallel_context import Group


def shard_in_fp8(layers: list[nn.Module]) -> None:
    """Before FSDP2 shards the model: each FP8 layer's weight becomes an Fp8ShardWeight,
    which FSDP2's sharding keeps (its attributes, the tensor-parallel ones, carried over)."""
    for layer in layers:
        weight = layer.weight
        wrapped = nn.Parameter(Fp8ShardWeight(weight.data), requires_grad=weight.requires_grad)
        wrapped.__dict__.update(weight.__dict__)
        layer.weight = wrapped


class Fp8FsdpParameters(Fp8ShardCasts):
    """The FP8 copies of this rank's rows of the weights of `layers` (prepared by
    `shard_in_fp8`, then sharded by FSDP2 over `shard_group`), cast by `cast` after each
    optimizer step and after a checkpoint load (`NativeOptimizer.copy_masters_to_model`)."""

    def __init__(self, layers: list[nn.Module], shard_group: Group, roots: list[nn.Module]) -> None:
        """`roots`: the modules FSDP2 wrapped last (the model chunks)."""
        # FSDP2 re-pads an unevenly cut shard into a new tensor when it initializes lazily,
        # at the first forward: done now, so the shards held here are the ones it trains.
        for root in roots:
            root._get_fsdp_state()._lazy_init()
        weights = [layer.weight for layer in layers]
        states = [layer.fp8 for layer in layers]
        super().__init__(states, [weight.shape for weight in weights], shard_group)
        # FSDP2's own local shard object, whose all-gather hooks FSDP2 calls (`to_local()`
        # would return a view of it, a new object).
        self._shards = [weight._local_tensor for weight in weights]
        self._weights = weights
        pieces = []
        for index, (weight, shard) in enumerate(zip(weights, self._shards)):
            rows, columns = weight.shape
            # FSDP2 cuts dim 0 into chunks of ceil(rows / ranks), the last ones short or empty
            padded = -(-rows // shard_group.size)
            shard.fp8_shard = torch.zeros(padded, columns, dtype=self._dtype, device=shard.device)
            master = shard._tensor.view(-1)
            if master.numel():
                start = shard_group.rank * padded * columns
                target = shard.fp8_shard.view(-1)[: master.numel()]
                pieces.append((index, start, start + master.numel(), master, target))
        self.set_pieces(pieces)
        self.cast()

    @contextmanager
    def in_model_dtype(self) -> Iterator[None]:
        """While open, the FP8 layers' weights hold their fp32 rows as plain tensors, which
        checkpoints save and load as any other parameter's (after a load, the optimizer's
        copy to the model casts them again)."""
        for weight, shard in zip(self._weights, self._shards):
            weight._local_tensor = shard._tensor
        try:
            yield
        finally:
            for weight, shard in zip(self._weights, self._shards):
                weight._local_tensor = shard

    def fp8_bytes(self) -> int:
        """The FP8 copies of this rank's rows (padded as FSDP2's shards)."""
        return sum(shard.fp8_shard.numel() for shard in self._shards)
