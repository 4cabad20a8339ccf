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

The parameter itself (bf16, or fp32) is kept and refilled with the dequantized FP8 copy after
each gather, so checkpoints, evaluation and conversion read the very weights the GEMMs use.
Megatron drops it and saves 2 bytes per weight; here every reader of `param.data` would have to
learn the FP8 layout first, and that is left for later.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from threefold.kernels import reference
from threefold.kernels.fp8 import FP8_MAX, WEIGHT, Fp8Linear
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
        buffer.on_gathered = self.dequantize
        # The ranks holding the other pieces of a weight: the optimizer's shards over the
        # buffer's group, and the TP x CP group every layer reduces its amaxes over.
        self.shard_group = buffer.dp
        self.amax_group = next(iter(states.values())).amax_group

    @torch.no_grad()
    def cast(self, shards: list[Shard]) -> None:
        """This rank's fp32 pieces of the weights, after an optimizer step: the scales agreed
        over every rank holding a piece, then the pieces cast into the FP8 buffer (its
        all-gather is the buffer's, started by the optimizer next)."""
        device = self.buffer.param_buffer.device
        amax = torch.zeros(len(self.states), device=device)
        for param, _, _, master in shards:
            i = self._index[param]
            amax[i] = torch.maximum(amax[i], reference.amax(master).to(device))
        self.shard_group.all_reduce(amax, op=dist.ReduceOp.MAX)
        self.amax_group.all_reduce(amax, op=dist.ReduceOp.MAX)
        scales = [
            state.set_gathered_weight_amax(amax[i]) for i, state in enumerate(self.states.values())
        ]
        for param, start, end, master in shards:
            offset = self.buffer.ranges[param][0]
            dtype = self.states[param].recipe.dtypes[WEIGHT]
            cast = reference.fp8_cast(
                master, scales[self._index[param]].to(master.device), dtype, FP8_MAX[dtype]
            )
            self.buffer.param_buffer[offset + start : offset + end].copy_(cast)

    @torch.no_grad()
    def dequantize(self, params: list[nn.Parameter]) -> None:
        """The gathered FP8 copies of `params`, back into the parameters themselves."""
        for param in params:
            state = self.states[param]
            weight8 = state.gathered[1]
            param.copy_((weight8.float() / state.gathered_scale).to(param.dtype))

    def bytes(self) -> int:
        """The FP8 copies' bytes on this rank."""
        flat = self.buffer.param_buffer
        return flat.numel() * flat.element_size()
