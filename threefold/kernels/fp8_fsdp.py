"""--fp8-param-gather under FSDP2: an FP8 layer's weight all-gathered as FP8 bytes.

FSDP2 all-gathers a parameter's shards through the shard's own `fsdp_pre_all_gather` and
`fsdp_post_all_gather` when the tensor defines them (torch's all-gather extensions, which
torchao's float8 all-gather, torchtitan's `enable_fsdp_float8_all_gather`, is built on). Two
tensor subclasses use them:

    Fp8ShardWeight     FSDP2's local shard of the weight: the fp32 master rows, unchanged for
                       the optimizer, the norms and the checkpoints, plus `fp8_shard`, those
                       rows in FP8, cast once per step (threefold.model.fp8_fsdp_params). Its
                       pre-all-gather hands FSDP2 that FP8 copy, as bytes.
    Fp8GatheredWeight  the unsharded weight FSDP2 builds from the gathered bytes: the FP8
                       weight the layer's GEMMs read (`Fp8Linear.gathered_fp8`), reporting the
                       compute dtype, which its gradient, reduce-scattered as every other's,
                       comes back in.

So the all-gather moves one byte an element instead of bf16's two, and no rank casts the
whole weight: each casts its own rows. Every other op on a shard runs on the fp32 rows and
returns a plain tensor (the optimizer's moments, the norms), except the views and copies
FSDP2 makes of a parameter when it shards it, which keep the subclass.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten
# What FSDP2 does to a parameter while sharding it (chunk, narrow, pad into new zeros, view)
# and to make a Parameter of it (detach), and what `to_empty` does to a shard of a model
# built on the meta device (empty_like): the shard stays an Fp8ShardWeight through them.
_SHARDING_OPS = {
    aten.empty_like.default,
    aten.split.Tensor,
    aten.slice.Tensor,
    aten.new_zeros.default,
    aten.view.default,
    aten.detach.default,
    aten.alias.default,
}


class Fp8ShardWeight(torch.Tensor):
    """An FP8 layer's fp32 weight rows on one FSDP2 rank, all-gathered in FP8 (module doc)."""

    _tensor: torch.Tensor
    # [padded rows, columns] in FP8: this rank's rows cast with the whole weight's scale (or
    # its blocks'), zero rows where FSDP2 pads an uneven shard; set once the weight is sharded.
    fp8_shard: torch.Tensor | None

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.shape,
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor, self.fp8_shard = tensor, None

    def __repr__(self) -> str:
        return f"Fp8ShardWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(value):
            return value._tensor if isinstance(value, Fp8ShardWeight) else value

        result = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func is aten.copy_.default:  # in place: the shard itself, not a new wrapper
            return args[0]
        if func not in _SHARDING_OPS:
            return result
        return tree_map(
            lambda value: Fp8ShardWeight(value) if isinstance(value, torch.Tensor) else value,
            result,
        )

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """What FSDP2 all-gathers for this shard: its FP8 rows as bytes (every backend
        gathers uint8), padded to the shard size FSDP2 gives every rank."""
        if self.fp8_shard is None:
            raise RuntimeError(
                "an FP8 weight's shard was all-gathered before its FP8 copy was cast "
                "(threefold.model.fp8_fsdp_params.Fp8FsdpParameters casts it)"
            )
        return (self.fp8_shard.view(torch.uint8),), (self.fp8_shard.dtype,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The whole weight from every rank's bytes. On later gathers FSDP2 refills the same
        output in place (`out`): the FP8 view already reads it."""
        (gathered,) = outputs
        if out is not None:
            return None
        (dtype,) = metadata
        return Fp8GatheredWeight(gathered.view(dtype), param_dtype), (gathered,)


class Fp8GatheredWeight(torch.Tensor):
    """The whole FP8 weight FSDP2 gathered, as the unsharded parameter: its dtype is the
    compute dtype (the gradient's), its values `fp8` (read by `Fp8Linear`, with the scale the
    shards were cast with). Nothing else may read it: any other op fails, naming itself."""

    fp8: torch.Tensor

    @staticmethod
    def __new__(cls, fp8: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, fp8.shape, strides=fp8.stride(), dtype=dtype, device=fp8.device
        )

    def __init__(self, fp8: torch.Tensor, dtype: torch.dtype) -> None:
        self.fp8 = fp8

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight({tuple(self.shape)}, {self.fp8.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        weight = args[0]
        if func in (aten.detach.default, aten.alias.default):  # nn.Parameter(), autograd
            return Fp8GatheredWeight(weight.fp8, weight.dtype)
        if func is aten.as_strided.default:  # FSDP2 trims the padding rows off
            return Fp8GatheredWeight(weight.fp8.as_strided(*args[1:]), weight.dtype)
        raise NotImplementedError(
            f"{func} on an FP8 weight all-gathered by FSDP2 (--fp8-param-gather): only its "
            "layer's FP8 GEMMs read it"
        )
