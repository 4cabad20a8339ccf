"""--fp8-param-gather: the FP8 layers' weights kept for compute in FP8, all-gathered as FP8 bytes.

Without it, the distributed optimizer all-gathers each updated weight in the run's precision
(2 bytes an element in bf16) and each step's first forward casts the weight to FP8 again
(`Fp8Scaling.weights_cached`). With it, as Megatron-LM does with Transformer Engine's FP8
parameters, the optimizer casts its fp32 shard of each weight to FP8 once per step and the
all-gather moves one byte an element; the GEMMs read the gathered FP8 copy
(`Fp8Linear.weight_in_fp8`).

The weights live in a GradientBuffer of their own whose flat parameters are FP8: their
gradients are reduced like every other's, their copies gathered per bucket (and, with
--overlap-param-gather, waited for in the forward of the module that reads them).

The scale: every rank must cast with the same one, and no rank holds the whole weight (the
distributed optimizer's shards split it over DP x CP, tensor parallelism over TP). So each
rank's amax of its shards is reduced (max) over the buffer's group and the layer's TP x CP group
first, in one message for all weights: tensorwise scaling casts with the scale from that amax,
delayed scaling with its history's scale, recording the amax as the step's weight amax. The
casts start from the fp32 masters, not from a bf16 rounding of them (Megatron's "no
intermediate dtype").

The parameter keeps no copy in the run's dtype: once the optimizer has its fp32 masters, the
parameter's storage *is* its FP8 copy in the buffer (`param.dtype` is E4M3), 1 byte per weight
where a bf16 run holds 2, as Megatron-LM's FP8 parameters. Its gradient goes straight into
`main_grad` (there is no bf16 tensor to hold one: the FP8 GEMM's fp32 weight gradient is added
there, whatever --gradient-accumulation-fusion says). Readers of the values in the run's dtype
(checkpoint saves and loads, the tests) ask for them with `in_model_dtype()`, which dequantizes
the weights for as long as it is open: the very values the GEMMs use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from math import inf

import torch
import torch.distributed as dist
from torch import nn

from threefold.kernels.fp8 import WEIGHT, Fp8Linear, set_gathered_scales
from threefold.kernels.fp8_gemms import FP8_MAX
from threefold.parallel.data_parallel.gradient_buffer import GradientBuffer

# (the weight, the start and end of the master's piece in the flattened weight, the master)
Shard = tuple[nn.Parameter, int, int, torch.Tensor]


class Fp8Parameters:
    """The FP8 compute copies of the weights of `states` (weight -> its layer's FP8 state),
    held in `buffer`'s flat parameters."""

    def __init__(self, states: dict[nn.Parameter, Fp8Linear], buffer: GradientBuffer) -> None:
        self.states, self.buffer = states, buffer
        self._index = {param: i for i, param in enumerate(states)}
        for param, state in states.items():
            start, end = buffer.ranges[param]
            state.gathered = (param, buffer.param_buffer[start:end].view(param.shape))
        # The run's dtype, which `in_model_dtype` dequantizes into.
        self.model_dtype = next(iter(states)).dtype
        # The ranks holding the other pieces of a weight: the optimizer's shards over the
        # buffer's group, and the TP x CP group every layer reduces its amaxes over.
        self.shard_group = buffer.dp
        self.amax_group = next(iter(states.values())).amax_group

    def store_in_fp8(self) -> None:
        """Each parameter's storage becomes its FP8 copy, dropping the one in the run's dtype
        (after the optimizer has taken its masters from it)."""
        for param, state in self.states.items():
            param.data = state.gathered[1]

    @contextmanager
    def in_model_dtype(self) -> Iterator[None]:
        """The parameters in the run's dtype while open, the dequantized FP8 copies (what a
        checkpoint saves; what it loads, into the masters, with the optimizer's
        `copy_model_to_masters`); FP8 again after. Holds 2 bytes per weight while open."""
        self.buffer.finish_param_gather()
        with torch.no_grad():
            for param, state in self.states.items():
                weight8 = state.gathered[1]
                param.data = (weight8.float() / state.gathered_scale).to(self.model_dtype)
        try:
            yield
        finally:
            self.store_in_fp8()

    def set_shards(self, shards: list[Shard]) -> None:
        """This rank's fp32 pieces of the weights (the distributed optimizer's masters), which
        `cast` casts after each step: one piece per weight at most (a bucket holds whole
        parameters, and a rank one shard of it)."""
        flat, ranges = self.buffer.param_buffer, self.buffer.ranges
        self._masters = [master for *_, master in shards]
        # each piece's place in the FP8 buffer, and its weight's index in `states`
        self._targets = [
            flat[ranges[param][0] + start : ranges[param][0] + end]
            for param, start, end, _ in shards
        ]
        owners = [self._index[param] for param, *_ in shards]
        assert len(set(owners)) == len(owners), "a weight with two pieces on one rank"
        self._owners = torch.tensor(owners, dtype=torch.long, device=flat.device)
        states = list(self.states.values())
        dtypes = {state.recipe.dtypes[WEIGHT] for state in states}
        assert len(dtypes) == 1, "one FP8 weight format per run"
        self._dtype = dtypes.pop()

    @torch.no_grad()
    def cast(self) -> None:
        """This rank's fp32 pieces of the weights (`set_shards`), after an optimizer step:
        the scales agreed over every rank holding a piece, then the pieces cast into the FP8
        buffer (its all-gather is the buffer's, started by the optimizer next). In batches
        over the pieces: the amaxes in one multi-tensor norm, the scales of all weights at
        once (`set_gathered_scales`), the casts' multiply and clamp as multi-tensor ops; each
        piece then takes one copy into FP8 (per piece: some twenty launches before)."""
        device = self.buffer.param_buffer.device
        amax = torch.zeros(len(self.states), device=device)
        masters = self._masters
        if masters:  # max |x| of each piece, exactly (a maximum does not round)
            amax[self._owners] = torch.stack(torch._foreach_norm(masters, ord=inf)).to(device)
        self.shard_group.all_reduce(amax, op=dist.ReduceOp.MAX)
        self.amax_group.all_reduce(amax, op=dist.ReduceOp.MAX)
        scales = set_gathered_scales(list(self.states.values()), amax)
        if not masters:
            return
        # (`reference.fp8_cast`'s arithmetic: the same bytes)
        per_piece = scales[self._owners].to(masters[0].device)
        scaled = torch._foreach_mul(masters, list(per_piece.unbind(0)))
        limit = FP8_MAX[self._dtype]
        torch._foreach_clamp_min_(scaled, -limit)
        torch._foreach_clamp_max_(scaled, limit)
        for target, piece in zip(self._targets, scaled):
            target.copy_(piece)  # (not multi-tensor: CUDA's takes no FP8 destination)

    def padding_bytes(self) -> int:
        """The buffer's bytes beyond its weights' (the padding to equal shards): the FP8 copies
        themselves are the parameters' storage."""
        flat = self.buffer.param_buffer
        return (flat.numel() - sum(param.numel() for param in self.states)) * flat.element_size()
