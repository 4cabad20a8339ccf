"""Tensor-parallel layers with Megatron's names and semantics, device-agnostic.

megatron-core's own layers hard-code CUDA in their gather paths, so threefold owns these. At
tensor-parallel size 1 every collective is skipped and they are plain linear/embedding layers.

Shapes: activations are [sequence, batch, hidden]; under sequence parallelism the activation
between layers is this rank's slice of the sequence, [sequence / TP, batch, hidden]. Each layer
takes the `ParallelContext` it lives in: its TP group and whether sequence parallelism is on.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from threefold.parallel.parallel_context import Group, ParallelContext
from threefold.parallel.tensor_parallel.comm_overlap import all_gather_linear, linear_reduce_scatter
from threefold.parallel.tensor_parallel.delayed_wgrad import DelayableLinear, when_due
from threefold.parallel.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from threefold.parallel.tensor_parallel.sharding import (
    InitMethod,
    constant_init,
    mark_replicated,
    mark_tensor_parallel,
)
from threefold.parallel.tensor_parallel.weight_grad import (
    LinearWithGradAccumulation,
    add_weight_grad_product,
    flag_traced_accumulation,
    placeholder_grad,
)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the TP size ({denominator})")
    return numerator // denominator


def _fuses(module: nn.Module, weight: torch.Tensor) -> bool:
    """Whether the weight gradient goes into `main_grad` (--gradient-accumulation-fusion): only
    for the layer's own weight (a tied one also gets the embedding's gradient)."""
    return (
        module.gradient_accumulation_fusion
        and weight is module.weight
        and getattr(weight, "main_grad", None) is not None
        and torch.is_grad_enabled()
    )


def _delays(module: nn.Module, weight: torch.Tensor) -> bool:
    """Whether the weight gradient may wait for the combined step's next exchange
    (--delay-wgrad-compute): only the layer's own weight's. A tied one gets the embedding's
    gradient in the same pass, and would reach the gradient buffer in two parts, which
    --overlap-grad-reduce would count as two micro-batches (a bucket reduced before the
    step's last gradients)."""
    return module.delay_wgrad_compute and weight is module.weight


def _overlaps(module: nn.Module) -> bool:
    """--tp-comm-overlap applies: sequence parallel over TP > 1, without a LoRA adapter, which
    reads the gathered input (FP8 layers: kernels/fp8_sequence_parallel.py, through the
    layer's `Fp8Linear`)."""
    return module.tp_comm_overlap and module.sequence_parallel and module.adapter is None


def _gathers_in_fp8(module: nn.Module) -> bool:
    """Under sequence parallelism an FP8 layer all-gathers its input (column-parallel) or its
    output gradient (row-parallel) as FP8 bytes, cast before the gather
    (`Fp8Linear.gathers_in_fp8`): half bf16's traffic. Not with a LoRA adapter, which reads
    the gathered input, and adds its own output, in the run's dtype."""
    fp8 = module.fp8 is not None and module.fp8.gathers_in_fp8
    parallel = module.sequence_parallel and module.tp.size > 1
    return fp8 and parallel and module.adapter is None


def linear_gemm(
    module: nn.Module,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sequence_parallel: Group | None = None,
) -> torch.Tensor:
    """A parallel linear layer's GEMM: FP8 when the layer has an FP8 state (model/fp8.py),
    the weight gradient accumulated into `main_grad` with --gradient-accumulation-fusion
    (only for the layer's own weight: a tied one also gets the embedding's gradient).
    `sequence_parallel` (FP8 layers): `x` is this rank's slice of the sequence, all-gathered
    over that group by the FP8 GEMM itself (`Fp8Linear.gathers_in_fp8`)."""
    fuse = _fuses(module, weight)
    if module.fp8 is not None:
        return module.fp8.linear(x, weight, bias, fuse, sequence_parallel)
    if fuse:
        traced = flag_traced_accumulation(weight)
        return LinearWithGradAccumulation.apply(x, weight, bias, traced)
    if _delays(module, weight) and torch.is_grad_enabled():
        return DelayableLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class _LinearBlocks(torch.autograd.Function):
    """`F.linear(x, weight, bias).chunk(blocks, -1)` for a weight stacked from `blocks` row blocks
    (SwiGLU's [gate; up]), computed one block at a time: each block's output is contiguous (the
    activation that follows runs faster on it than on a strided half), and backward never
    concatenates the blocks' gradients, as autograd's backward of `chunk` would (a copy of the
    whole activation gradient); each goes straight into its rows of the weight gradient and,
    accumulated, into the input gradient. The same GEMMs as separate gate and up layers, with
    megatron-core's stacked weight. Under autocast the backward GEMMs run in the dtype the
    forward ran in, as autocast's own backward does."""

    @staticmethod
    def forward(ctx, x, weight, bias, blocks, accumulate=False, traced=False):
        biases = (None,) * blocks if bias is None else bias.chunk(blocks)
        outputs = tuple(
            F.linear(x, block, block_bias)
            for block, block_bias in zip(weight.chunk(blocks), biases)
        )
        ctx.save_for_backward(x, weight)
        ctx.blocks, ctx.has_bias, ctx.compute_dtype = blocks, bias is not None, outputs[0].dtype
        # --gradient-accumulation-fusion: into the parameter's main_grad (the parameter
        # itself: under recomputation a saved tensor comes back as another object)
        ctx.accumulate, ctx.weight, ctx.traced = accumulate, weight, traced
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        dtype = ctx.compute_dtype
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        rows = weight.shape[0] // ctx.blocks
        grads = [grad.reshape(-1, rows).to(dtype) for grad in grads]
        grad_x = grad_bias = grad_weight = None
        if needs_x:
            for grad, block_weight in zip(grads, weight.to(dtype).chunk(ctx.blocks, dim=0)):
                if grad_x is None:
                    grad_x = grad @ block_weight
                else:
                    grad_x.addmm_(grad, block_weight)
            grad_x = grad_x.view(x.shape).to(x.dtype)
        if needs_bias and ctx.has_bias:
            grad_bias = torch.empty(weight.shape[0], dtype=dtype, device=weight.device)
            for index, grad in enumerate(grads):
                torch.sum(grad, dim=0, out=grad_bias[index * rows : (index + 1) * rows])
            grad_bias = grad_bias.to(weight.dtype)
        if needs_weight:
            inputs = x.reshape(-1, x.shape[-1]).to(dtype)
            accumulate = ctx.weight if ctx.accumulate else None
            product = functools.partial(
                _blocks_weight_grad, grads, inputs, weight, accumulate, ctx.traced
            )
            grad_weight = when_due(ctx.weight, product)  # --delay-wgrad-compute
        return grad_x, grad_weight, grad_bias, None, None, None


def _blocks_weight_grad(
    grads: list[torch.Tensor],
    inputs: torch.Tensor,
    weight: torch.Tensor,
    accumulate: torch.Tensor | None,
    traced: bool,
) -> torch.Tensor:
    """`_LinearBlocks`' weight gradient, block by block: into the rows of `accumulate`'s
    main_grad (the parameter, under gradient-accumulation fusion; its placeholder returned),
    or a gradient like `weight`."""
    rows = grads[0].shape[1]
    if accumulate is not None:
        for index, grad in enumerate(grads):
            add_weight_grad_product(accumulate.main_grad, grad, inputs, traced, index * rows)
        return placeholder_grad(accumulate, flag=not traced)
    grad_weight = torch.empty(weight.shape, dtype=inputs.dtype, device=weight.device)
    for index, grad in enumerate(grads):
        torch.mm(grad.t(), inputs, out=grad_weight[index * rows : (index + 1) * rows])
    return grad_weight.to(weight.dtype)


def linear_blocks(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    blocks: int,
    accumulate_in_main_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, weight, bias).chunk(blocks, -1)`, with a cheaper backward (`_LinearBlocks`);
    `accumulate_in_main_grad`: the weight gradient goes into `weight.main_grad`."""
    traced = accumulate_in_main_grad and flag_traced_accumulation(weight)
    return _LinearBlocks.apply(x, weight, bias, blocks, accumulate_in_main_grad, traced)


def tensor_parallel_input(x: torch.Tensor, tp: Group, sequence_parallel: bool) -> torch.Tensor:
    """What a column-parallel layer reads: this rank's activations [s, b, ...], whole on every
    TP rank (their gradient, partial per rank's heads, summed over TP in backward), or under
    sequence parallelism all-gathered along the sequence (reduce-scattered back)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, tp)
    return copy_to_tensor_parallel_region(x, tp)


class DuplicatedLinear(nn.Module):
    """Y = X A, A whole on every TP rank (Transformer Engine's `parallel_mode="duplicated"`):
    each rank projects its own activations, under sequence parallelism its slice of the
    sequence, whose share of A's gradient is then summed over TP (`partial_grads`).
    `whole_sequence`: every rank projects the whole sequence (gathered first) and computes
    the whole gradient, which is not summed. `bias`: b whole too, its gradient as A's."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel: ParallelContext,
        init_method: InitMethod,
        whole_sequence: bool = False,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.fp8 = None  # FP8 GEMMs (threefold/model/fp8.py), with --fp8-format
        self.gradient_accumulation_fusion = False  # set with threefold's gradient buffer
        self.delay_wgrad_compute = False  # set with --delay-wgrad-compute
        self.weight = mark_replicated(
            nn.Parameter(torch.empty(output_size, input_size)),
            init_method,
            partial_grads=parallel.sequence_parallel and not whole_sequence,
        )
        self.bias = None
        if bias:
            self.bias = mark_replicated(
                nn.Parameter(torch.empty(output_size)),
                constant_init(0.0),
                partial_grads=self.weight.sequence_parallel,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_gemm(self, x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) across the TP group.

    The input is replicated on every TP rank (or, with sequence parallelism, all-gathered along
    the sequence); the output stays split unless `gather_output`. `partition_stride` > 1 means
    the full output is `stride` stacked blocks, each split separately (SwiGLU's [gate; up], so
    every rank holds matching gate and up columns); `partition_sizes` the same for blocks of
    unequal sizes. `forward(x, weight=...)` uses a weight owned by another module: the output
    layer tied to the word embeddings.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel: ParallelContext,
        bias: bool,
        init_method: InitMethod,
        gather_output: bool = False,
        partition_stride: int = 1,
        skip_weight_param: bool = False,
        valid_output_size: int | None = None,
        partition_sizes: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.tp = parallel.tp
        world = self.tp.size
        self.input_size, self.output_size = input_size, output_size
        self.partition_stride = partition_stride
        self.adapter = None  # a LoRA adapter (threefold/model/lora.py), when fine-tuning
        self.fp8 = None  # FP8 GEMMs (threefold/model/fp8.py), with --fp8-format
        self.gradient_accumulation_fusion = False  # set with threefold's gradient buffer
        self.delay_wgrad_compute = False  # set with --delay-wgrad-compute
        self.output_size_per_partition = _divide(output_size, world, "output size")
        self.gather_output = gather_output
        self.sequence_parallel = parallel.sequence_parallel
        self.tp_comm_overlap = parallel.tp_comm_overlap  # (parallel_context: SP and TP > 1)
        if skip_weight_param:
            self.register_parameter("weight", None)
        else:
            self.weight = mark_tensor_parallel(
                nn.Parameter(torch.empty(self.output_size_per_partition, input_size)),
                partition_dim=0,
                init_method=init_method,
                master_shape=(output_size, input_size),
                partition_stride=partition_stride,
                valid_rows=valid_output_size,
                partition_sizes=partition_sizes,
            )
        if bias:
            self.bias = mark_tensor_parallel(
                nn.Parameter(torch.empty(self.output_size_per_partition)),
                partition_dim=0,
                init_method=constant_init(0.0),
                master_shape=(output_size,),
                partition_stride=partition_stride,
                valid_rows=valid_output_size,
                partition_sizes=partition_sizes,
            )
        else:
            self.register_parameter("bias", None)

    def _parallel_input(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_parallel_input(x, self.tp, self.sequence_parallel)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if _overlaps(self):
            fuse = _fuses(self, weight)
            if self.fp8 is not None:
                output = self.fp8.all_gather_linear(x, weight, self.bias, self.tp, fuse)
            else:
                delay = _delays(self, weight)
                output = all_gather_linear(x, weight, self.bias, self.tp, fuse, delay)
        elif _gathers_in_fp8(self):
            output = linear_gemm(self, x, weight, self.bias, self.tp)
        else:
            x = self._parallel_input(x)
            output = linear_gemm(self, x, weight, self.bias)
            if self.adapter is not None:
                output = output + self.adapter(x)
        if self.gather_output:
            output = gather_from_tensor_parallel_region(output, self.tp)
        return output

    def forward_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`forward(x).chunk(partition_stride, -1)`: the stacked blocks of the output (SwiGLU's
        gate and up), each block's gradient used as it comes in backward (`linear_blocks`)."""
        if self.gather_output:
            raise ValueError("forward_blocks returns this rank's blocks; gather_output is set")
        if self.fp8 is not None or _overlaps(self):  # the blocks as chunks of one output
            return self.forward(x).chunk(self.partition_stride, -1)
        x = self._parallel_input(x)
        fuse = _fuses(self, self.weight)
        blocks = linear_blocks(x, self.weight, self.bias, self.partition_stride, fuse)
        if self.adapter is not None:
            adapter = self.adapter(x).chunk(self.partition_stride, dim=-1)
            blocks = tuple(block + extra for block, extra in zip(blocks, adapter))
        return blocks


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features) across the TP group.

    The input arrives already split along its last dimension (the output of a column-parallel
    layer); partial products are all-reduced, or reduce-scattered along the sequence under
    sequence parallelism. The bias is added once, after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel: ParallelContext,
        bias: bool,
        init_method: InitMethod,
    ) -> None:
        super().__init__()
        self.tp = parallel.tp
        sequence_parallel = parallel.sequence_parallel
        world = self.tp.size
        self.input_size, self.output_size = input_size, output_size
        self.adapter = None  # a LoRA adapter, whose partial output the reduction completes
        self.fp8 = None  # FP8 GEMMs (threefold/model/fp8.py), with --fp8-format
        self.gradient_accumulation_fusion = False  # set with threefold's gradient buffer
        self.delay_wgrad_compute = False  # set with --delay-wgrad-compute
        self.input_size_per_partition = _divide(input_size, world, "input size")
        self.sequence_parallel = sequence_parallel
        self.tp_comm_overlap = parallel.tp_comm_overlap
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(output_size, self.input_size_per_partition)),
            partition_dim=1,
            init_method=init_method,
            master_shape=(output_size, input_size),
        )
        if bias:
            self.bias = mark_replicated(
                nn.Parameter(torch.empty(output_size)),
                constant_init(0.0),
                partial_grads=sequence_parallel,
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _overlaps(self) or _gathers_in_fp8(self):
            output = self._linear_reduce_scatter(x)
            return output if self.bias is None else output + self.bias
        output = linear_gemm(self, x, self.weight, None)
        if self.adapter is not None:
            output = output + self.adapter(x)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output, self.tp)
        else:
            output = reduce_from_tensor_parallel_region(output, self.tp)
        if self.bias is not None:
            output = output + self.bias
        return output

    def _linear_reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The output (no bias) reduce-scattered over the sequence by the GEMM's own function:
        in ring steps with --tp-comm-overlap, else an FP8 layer's plain collectives, its
        gradient gathered in FP8 (`Fp8Linear.linear_reduce_scatter`)."""
        fuse, overlap = _fuses(self, self.weight), _overlaps(self)
        if self.fp8 is not None:
            return self.fp8.linear_reduce_scatter(x, self.weight, self.tp, fuse, overlap)
        return linear_reduce_scatter(x, self.weight, self.tp, fuse, _delays(self, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Word embeddings split along the (padded) vocabulary across the TP group.

    Each rank looks up the ids in its vocabulary range and contributes zeros for the others; the
    partial embeddings are summed over the group (reduce-scattered along the sequence under
    sequence parallelism). Takes ids [batch, sequence] and returns [sequence, batch, hidden].
    """

    def __init__(
        self,
        padded_vocab_size: int,
        embedding_dim: int,
        *,
        parallel: ParallelContext,
        vocab_size: int,
        init_method: InitMethod,
    ) -> None:
        super().__init__()
        self.tp = parallel.tp
        world, rank = self.tp.size, self.tp.rank
        self.num_embeddings_per_partition = _divide(padded_vocab_size, world, "padded vocabulary")
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.sequence_parallel = parallel.sequence_parallel
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim)),
            partition_dim=0,
            init_method=init_method,
            master_shape=(padded_vocab_size, embedding_dim),
            valid_rows=vocab_size,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_ids = input_ids.t()  # [s, b]: the output comes out in Megatron's layout
        if self.tp.size > 1:
            outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
            output = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            output = F.embedding(input_ids, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(output, self.tp)
        return reduce_from_tensor_parallel_region(output, self.tp)
