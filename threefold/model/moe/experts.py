"""The experts one expert-parallel rank holds, and how their tokens are multiplied.

Each expert is an MLP like the dense one (GELU, or SwiGLU with [gate; up] stacked in
`linear_fc1`) on its EP rank, split over the expert-TP group (--expert-tensor-parallel-size) as
the dense MLP is over TP: `linear_fc1` by output rows (each [gate; up] block separately),
`linear_fc2` by input columns. Each expert-TP rank thus returns a partial sum of the expert's
output, which the dispatcher's combine adds up with the token's other experts (it sends each
token to every expert-TP rank of its experts). Experts are kept under their *global* index,
`local_experts.{e}`, so a parameter's name is the same at every EP size: initialization (drawn
per name), checkpoints and conversion see one model whatever the layout.

Tokens arrive grouped by expert with a count per local expert. The reference computes each
expert in turn; `--moe-grouped-gemm` runs all of them in one grouped GEMM: torch._grouped_mm
on CUDA (bf16, Hopper and later), else one batched matmul over the groups padded to the
largest (experts with LoRA adapters take the loop).

Under `--fp8-recipe rowwise` each expert's linear layers run their GEMMs in FP8 (model/fp8.py),
one expert at a time: PyTorch's FP8 grouped GEMM (`torch._scaled_grouped_mm`) has no CPU
kernel to prove it against, so --moe-grouped-gemm takes the loop too. The loop's weight
gradients go straight into the fp32 `main_grad` under --gradient-accumulation-fusion, as the
dense layers' do; the grouped GEMM's reach it through autograd (its weights are stacked).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.kernels.dispatch import KERNELS
from threefold.model.activation_offload import offload_group
from threefold.model.mlp import GLU
from threefold.model.recompute import OutputDiscardingCheckpoint
from threefold.parallel.parallel_context import Group, ParallelContext
from threefold.parallel.tensor_parallel.delayed_wgrad import when_due
from threefold.parallel.tensor_parallel.layers import linear_gemm
from threefold.parallel.tensor_parallel.sharding import InitMethod, mark_expert


class ExpertMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        expert_tp: Group,
        init_method: InitMethod,
        output_init: InitMethod,
    ) -> None:
        super().__init__()
        # (--moe-latent-size: experts between the latent projections, at their width)
        hidden, ffn = config.moe_latent_size or config.hidden_size, config.moe_ffn_hidden_size
        fc1_out = ffn * (2 if config.gated_linear_unit else 1)
        stride = 2 if config.gated_linear_unit else 1
        self.linear_fc1 = ExpertLinear(
            hidden, fc1_out, config, init_method, expert_tp, row_parallel=False, stride=stride
        )
        self.linear_fc2 = ExpertLinear(
            ffn, hidden, config, output_init, expert_tp, row_parallel=True
        )


class _FirstRankBias(torch.autograd.Function):
    """A row-parallel expert bias: added on expert-TP rank 0 only (the combine adds the other
    ranks' partial sums to it), yet its whole gradient on every rank. The output gradient
    reaching each expert-TP rank is the same (the combine's backward hands every partial sum
    the token's gradient), so each rank computes the gradient of the one bias and the
    replicas stay equal without a reduction."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, first: bool) -> torch.Tensor:
        return bias.clone() if first else torch.zeros_like(bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ExpertLinear(nn.Module):
    """weight [out, in] (and bias) of one expert, split over the expert-TP group by output rows
    (column-parallel, fc1: `stride` blocks split separately) or by input columns
    (`row_parallel`, fc2: a partial sum out, the bias whole). `adapter`: a LoRA adapter
    (model/lora.py) whose output adds to the layer's."""

    def __init__(
        self,
        fan_in: int,
        fan_out: int,
        config: ModelConfig,
        init: InitMethod,
        expert_tp: Group,
        row_parallel: bool,
        stride: int = 1,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = fan_in, fan_out
        self.row_parallel = row_parallel
        self.first_rank = expert_tp.rank == 0
        self.expert_tp_size = expert_tp.size
        local_in = fan_in // expert_tp.size if row_parallel else fan_in
        local_out = fan_out if row_parallel else fan_out // expert_tp.size
        self.weight = mark_expert(
            nn.Parameter(torch.empty(local_out, local_in)),
            init,
            partition_dim=1 if row_parallel else 0,
            master_shape=(fan_out, fan_in),
            partition_stride=stride,
        )
        self.bias = None
        if config.add_bias_linear:
            zero = lambda tensor, generator: tensor.zero_()  # noqa: E731
            bias = nn.Parameter(torch.empty(local_out))
            if row_parallel:
                self.bias = mark_expert(bias, zero)
            else:
                self.bias = mark_expert(bias, zero, 0, (fan_out,), stride)
        self.adapter: nn.Module | None = None
        self.fp8 = None  # FP8 GEMMs (threefold/model/fp8.py), with --fp8-recipe rowwise
        self.gradient_accumulation_fusion = False  # set with threefold's gradient buffer
        self.delay_wgrad_compute = False  # set with --delay-wgrad-compute

    def local_bias(self) -> torch.Tensor | None:
        """The bias this rank adds (a row-parallel one on the first expert-TP rank only)."""
        if self.bias is None or not self.row_parallel:
            return self.bias
        return _FirstRankBias.apply(self.bias, self.first_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0]:
            out = linear_gemm(self, x, self.weight, self.local_bias())
        else:  # no token reached this expert: no amax to scale an FP8 cast by, nothing to add
            out = F.linear(x, self.weight, self.local_bias())
        return out if self.adapter is None else out + self.adapter(x)


class Experts(nn.Module):
    """The local experts: `expert_offset` .. `expert_offset + num_local - 1`."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        init_method: InitMethod,
        output_init: InitMethod,
    ) -> None:
        super().__init__()
        self.num_local = config.num_experts // parallel.ep.size
        self.expert_offset = parallel.ep.rank * self.num_local
        self.glu = GLU.of(config)
        self.squared_relu = config.squared_relu
        self.gelu_approximation = "tanh" if config.openai_gelu else "none"
        self.grouped_gemm = config.moe_grouped_gemm
        # The grouped GEMM reads the experts' weights without calling them: --overlap-param-
        # gather waits for all of them before this module's forward, not at each expert's
        # (which never comes; their weights were read mid-gather, a race seen under load)
        self.reads_descendant_weights = self.grouped_gemm
        self.delay_wgrad_compute = False  # set with --delay-wgrad-compute (the grouped GEMM)
        # --recompute-modules moe_act: the activation's output freed once fc2 has kept its copy
        self.recompute_activation = config.recomputes("moe_act")
        # Fine-grained activation offloading (model/activation_offload.py)
        self.offload_fc1 = config.offloads("expert_fc1")
        self.offload_activation = config.offloads("moe_act")
        self.offload_mlp = config.offloads("fused_group_mlp")
        self.local_experts = nn.ModuleDict(
            {
                str(self.expert_offset + i): ExpertMLP(
                    config, parallel.expert_tp, init_method, output_init
                )
                for i in range(self.num_local)
            }
        )

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.glu:
            return self.glu(*x.chunk(2, dim=-1))
        if self.squared_relu:
            return KERNELS.squared_relu(x)
        return KERNELS.gelu(x, self.gelu_approximation)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """tokens [sum(counts), hidden], grouped by local expert; the experts' outputs."""
        with offload_group("fused_group_mlp", self.offload_mlp):
            return self._experts(tokens, counts)

    def _experts(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        experts = list(self.local_experts.values())
        looped = experts and (
            experts[0].linear_fc1.adapter is not None or experts[0].linear_fc1.fp8 is not None
        )
        if self.grouped_gemm and len(experts) > 1 and not looped:
            return self._grouped(tokens, counts, experts)
        outputs = []
        for expert, part in zip(experts, tokens.split(counts)):
            with offload_group("expert_fc1", self.offload_fc1):
                hidden = expert.linear_fc1(part)
            outputs.append(self._activated(expert.linear_fc2, hidden))
        return torch.cat(outputs) if outputs else tokens[:0]

    def _activated(self, fc2, hidden: torch.Tensor) -> torch.Tensor:
        """fc2(activation(hidden)), the activation's output recomputed with moe_act."""
        activation = OutputDiscardingCheckpoint(self.recompute_activation and self.training)
        with offload_group("moe_act", self.offload_activation):
            activated = activation.checkpoint(self._activation, hidden)
        out = fc2(activated)
        activation.discard_output_and_register_recompute(out)
        return out

    def _grouped(self, tokens: torch.Tensor, counts: list[int], experts: list) -> torch.Tensor:
        fc1 = [e.linear_fc1.weight for e in experts]
        fc2 = [e.linear_fc2.weight for e in experts]

        def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
            if self.delay_wgrad_compute and torch.is_grad_enabled():  # deferrable
                return _GroupedLinear.apply(x, counts, *weights)
            return _grouped_linear(x, weights, counts)

        with offload_group("expert_fc1", self.offload_fc1):
            hidden = grouped_linear(tokens, fc1)
            if experts[0].linear_fc1.bias is not None:
                biases = [e.linear_fc1.local_bias() for e in experts]
                hidden = hidden + _per_token(torch.stack(biases), counts)
        out = self._activated(lambda x: grouped_linear(x, fc2), hidden)
        if experts[0].linear_fc2.bias is not None:
            biases = [e.linear_fc2.local_bias() for e in experts]
            out = out + _per_token(torch.stack(biases), counts)
        return out


def _per_token(bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
    repeats = torch.tensor(counts, device=bias.device)
    return bias.repeat_interleave(repeats, dim=0)


class _Restack:
    """What autograd keeps of the experts' stacked weights: the parameters, and the view the
    grouped GEMM saved of their stack."""

    def __init__(self, weights: list[torch.Tensor], saved: torch.Tensor) -> None:
        self.weights = weights
        self.view = (saved.size(), saved.stride(), saved.storage_offset())

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.weights).as_strided(*self.view)


def _grouped_linear(tokens: torch.Tensor, weights: list[torch.Tensor], counts: list[int]):
    """`_grouped_matmul` over the experts' weights stacked [E, out, in], the stack not kept
    for backward (a copy of every local expert's weight per micro-batch in flight): its
    backward stacks the parameters again. Saved-tensor hooks outside (activation offloading,
    a checkpoint, a measurement) see every other tensor the GEMM saves."""
    stacked = torch.stack(weights)
    if torch.compiler.is_compiling():  # (the compiler decides what its graph keeps)
        return _grouped_matmul(tokens, stacked, counts)
    address = stacked.untyped_storage().data_ptr()
    # The hooks in force here, which take what is not the stack (torch's own accessor).
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def pack(tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() == address:
            return _Restack(weights, tensor)
        return outer[0](tensor) if outer else tensor

    def unpack(saved):
        if isinstance(saved, _Restack):
            return saved.stacked()
        return outer[1](saved) if outer else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return _grouped_matmul(tokens, stacked, counts)


class _GroupedLinear(torch.autograd.Function):
    """`_grouped_matmul` over the experts' `weights` with --delay-wgrad-compute: the tokens'
    gradient is one grouped GEMM over the weights' transposes stacked, each expert's weight
    gradient the product of its own rows, deferred while a combined step's backward collects
    (parallel/tensor_parallel/delayed_wgrad.py). It keeps the parameters, not their stack."""

    @staticmethod
    def forward(ctx, tokens, counts, *weights):
        ctx.save_for_backward(tokens)
        ctx.counts, ctx.weights = counts, weights
        return _grouped_matmul(tokens, torch.stack(weights), counts)

    @staticmethod
    def backward(ctx, grad):
        (tokens,), counts, weights = ctx.saved_tensors, ctx.counts, ctx.weights
        grad_tokens = None
        if ctx.needs_input_grad[0]:  # group g times weights[g], the transpose's transpose
            grad_tokens = _grouped_matmul(grad, torch.stack([w.t() for w in weights]), counts)
        grads: list[torch.Tensor | None] = [None] * len(weights)
        parts = zip(weights, grad.split(counts), tokens.split(counts))
        for index, (weight, rows, inputs) in enumerate(parts):
            if not ctx.needs_input_grad[2 + index]:
                continue
            grads[index] = when_due(weight, functools.partial(torch.mm, rows.t(), inputs))
        return grad_tokens, None, *grads


def _grouped_matmul(tokens: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of `tokens` in groups of `counts`, group g times weights[g].T."""
    if tokens.is_cuda and tokens.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(tokens, weights.transpose(1, 2), offs=offsets)
    width = max(counts) if counts else 0
    padded = tokens.new_zeros(len(counts), width, tokens.shape[1])
    rows = torch.cat([torch.arange(c, device=tokens.device) for c in counts])
    groups = torch.repeat_interleave(
        torch.arange(len(counts), device=tokens.device), torch.tensor(counts, device=tokens.device)
    )
    padded = padded.index_put((groups, rows), tokens)
    return torch.bmm(padded, weights.transpose(1, 2))[groups, rows]
