"""The experts one expert-parallel rank holds, and how their tokens are multiplied.

Each expert is an MLP like the dense one (GELU, or SwiGLU with [gate; up] stacked in
`linear_fc1`), whole on its rank. Experts are kept under their *global* index,
`local_experts.{e}`, so a parameter's name is the same at every EP size: initialization (drawn
per name), checkpoints and conversion see one model whatever the layout.

Tokens arrive grouped by expert with a count per local expert. The reference computes each
expert in turn; `--moe-grouped-gemm` runs all of them in one grouped GEMM: torch._grouped_mm
on CUDA (bf16, Hopper and later), else one batched matmul over the groups padded to the
largest (experts with LoRA adapters take the loop).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.kernels.dispatch import KERNELS
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.sharding import InitMethod, mark_expert


class ExpertMLP(nn.Module):
    def __init__(
        self, config: ModelConfig, init_method: InitMethod, output_init: InitMethod
    ) -> None:
        super().__init__()
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        self.linear_fc1 = ExpertLinear(
            hidden, ffn * (2 if config.swiglu else 1), config, init_method
        )
        self.linear_fc2 = ExpertLinear(ffn, hidden, config, output_init)


class ExpertLinear(nn.Module):
    """weight [out, in] (and bias) of one expert; no parallelism inside it. `adapter`: a LoRA
    adapter (model/lora.py) whose output adds to the layer's."""

    def __init__(self, fan_in: int, fan_out: int, config: ModelConfig, init: InitMethod) -> None:
        super().__init__()
        self.input_size, self.output_size = fan_in, fan_out
        self.weight = mark_expert(nn.Parameter(torch.empty(fan_out, fan_in)), init)
        self.bias = None
        if config.add_bias_linear:
            zero = lambda tensor, generator: tensor.zero_()  # noqa: E731
            self.bias = mark_expert(nn.Parameter(torch.empty(fan_out)), zero)
        self.adapter: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
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
        self.swiglu = config.swiglu
        self.gelu_approximation = "tanh" if config.openai_gelu else "none"
        self.grouped_gemm = config.moe_grouped_gemm
        self.local_experts = nn.ModuleDict(
            {
                str(self.expert_offset + i): ExpertMLP(config, init_method, output_init)
                for i in range(self.num_local)
            }
        )

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return KERNELS.swiglu(*x.chunk(2, dim=-1))
        return KERNELS.gelu(x, self.gelu_approximation)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """tokens [sum(counts), hidden], grouped by local expert; the experts' outputs."""
        experts = list(self.local_experts.values())
        adapted = experts and experts[0].linear_fc1.adapter is not None
        if self.grouped_gemm and len(experts) > 1 and not adapted:
            return self._grouped(tokens, counts, experts)
        outputs = []
        for expert, part in zip(experts, tokens.split(counts)):
            outputs.append(expert.linear_fc2(self._activation(expert.linear_fc1(part))))
        return torch.cat(outputs) if outputs else tokens[:0]

    def _grouped(self, tokens: torch.Tensor, counts: list[int], experts: list) -> torch.Tensor:
        fc1 = torch.stack([e.linear_fc1.weight for e in experts])  # [E, out, in]
        fc2 = torch.stack([e.linear_fc2.weight for e in experts])
        hidden = _grouped_matmul(tokens, fc1, counts)
        if experts[0].linear_fc1.bias is not None:
            hidden = hidden + _per_token(torch.stack([e.linear_fc1.bias for e in experts]), counts)
        out = _grouped_matmul(self._activation(hidden), fc2, counts)
        if experts[0].linear_fc2.bias is not None:
            out = out + _per_token(torch.stack([e.linear_fc2.bias for e in experts]), counts)
        return out


def _per_token(bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
    repeats = torch.tensor(counts, device=bias.device)
    return bias.repeat_interleave(repeats, dim=0)


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
