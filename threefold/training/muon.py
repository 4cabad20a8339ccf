"""Muon (Megatron-LM's --optimizer muon, after NVIDIA's Emerging-Optimizers, which it calls).

For every weight matrix W of the transformer layers, with gradient G (after clipping):

    W <- W - lr * wd * W                        (decoupled weight decay)
    M <- momentum * M + (1 - momentum) * G      (M: the momentum buffer)
    U = G + momentum * (M - G) (--muon-nesterov), else U = M
    W <- W - lr * scale * NS(U)

NS is the Newton-Schulz iteration towards the orthogonal factor of U: U normalized by its
Frobenius norm (transposed when it has more rows than columns), then X <- aX + (bA + cA^2)X
with A = XX^T, once per (a, b, c) of the coefficient set. `scale` is --muon-scale-mode's, from
the whole matrix's shape, times --muon-extra-scale-factor. With --muon-fp32-matmul-prec
medium (Megatron's default) the iteration runs in bf16.

The fused query/key/value weight is orthogonalized as three matrices, all heads' query rows,
key rows and value rows (--muon-no-split-qkv: whole). A matrix split over tensor-parallel ranks
is gathered, orthogonalized whole and cut again (--muon-tp-mode duplicated), so every TP layout
takes the same step as one device; blockwise orthogonalizes each rank's shard alone, as
Megatron-LM does. Each expert is a matrix of its own. Everything else (embeddings, output
layer, norms, biases) stays with Adam.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from threefold.config import ModelConfig, TrainingConfig
from threefold.model.gpt import is_embedding_or_output
from threefold.parallel.parallel_context import Group, ParallelContext
from threefold.parallel.tensor_parallel.sharding import is_expert

# Megatron-LM's coefficient sets (Emerging-Optimizers' values), cycled over the iterations, or
# the last one repeated where the set is a schedule (Polar Express, CANS).
COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "cans": [
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
    # cubic (c = 0), a fixed schedule of five steps
    "cubic5": [
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    ],
}
_SCHEDULES = ("polar_express", "cans", "deepseekv4")


def coefficients(kind: str, steps: int) -> list[tuple[float, float, float]]:
    sets = COEFFICIENTS[kind]
    if kind in _SCHEDULES:
        return (sets + sets[-1:] * steps)[:steps]
    return list(itertools.islice(itertools.cycle(sets), steps))


def newton_schulz(x: torch.Tensor, steps: int, kind: str, bf16: bool) -> torch.Tensor:
    """The approximate orthogonal factor of the fp32 matrix `x`."""
    transpose = x.size(0) > x.size(1)
    if transpose:
        x = x.mT
    X = torch.nn.functional.normalize(x, p=2, dim=(0, 1), eps=1e-15)
    if bf16:
        X = X.to(torch.bfloat16)
    for a, b, c in coefficients(kind, steps):
        A = X @ X.mT
        if c == 0.0:  # no A^2 to form
            X = torch.addmm(X, A, X, alpha=b, beta=a)
            continue
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def scale_factor(rows: int, columns: int, mode: str) -> float:
    """--muon-scale-mode's factor for a matrix of `rows` outputs and `columns` inputs."""
    if mode == "spectral":
        return max(rows, columns) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / columns) ** 0.5
    return max(1.0, rows / columns) ** 0.5  # shape_scaling


@dataclass
class Matrix:
    """How one weight matrix is orthogonalized: `shape`: as this rank holds it; `group`,
    `partition_dim`: the TP ranks holding
    its other shards and the dimension they split (None: orthogonalized as held here);
    `split`: rows per query group of the fused query/key/value weight, orthogonalized apart."""

    shape: tuple[int, int]  # this rank's (its master may be a flat view)
    group: Group | None = None
    partition_dim: int | None = None
    split: list[int] | None = None


def muon_matrices(
    named_parameters: list[tuple[str, nn.Parameter]],
    model: ModelConfig,
    parallel: ParallelContext,
    config: TrainingConfig,
) -> dict[nn.Parameter, Matrix]:
    """The parameters Muon steps (2-D weights, not the embeddings or the output layer, as
    Megatron-LM's `_is_nonlinear_or_embedding`), each with how it is orthogonalized."""
    heads_per_group = model.num_attention_heads // model.num_query_groups
    qkv = [heads_per_group * model.kv_channels, model.kv_channels, model.kv_channels]
    matrices = {}
    for name, param in named_parameters:
        if not param.requires_grad or param.dim() != 2 or is_embedding_or_output(name):
            continue
        matrix = Matrix(tuple(param.shape))
        if getattr(param, "tensor_model_parallel", False) and config.muon_tp_mode == "duplicated":
            group = parallel.expert_tp if is_expert(param) else parallel.tp
            if group.size > 1:
                matrix.group, matrix.partition_dim = group, param.partition_dim
        if config.muon_split_qkv and name.endswith("linear_qkv.weight"):
            matrix.split = qkv
        matrices[param] = matrix
    return matrices


def _gathered(x: torch.Tensor, matrix: Matrix) -> torch.Tensor:
    shards = [torch.empty_like(x) for _ in range(matrix.group.size)]
    dist.all_gather(shards, x.contiguous(), group=matrix.group.group)
    return torch.cat(shards, dim=matrix.partition_dim)


class Muon(torch.optim.Optimizer):
    """Muon over fp32 `params` (param groups with lr and weight_decay, as AdamW's), each
    orthogonalized as `matrices` says."""

    def __init__(self, groups: list[dict], matrices: dict, config: TrainingConfig) -> None:
        super().__init__(groups, {"lr": config.lr, "weight_decay": 0.0})
        self.matrices = matrices
        self.config = config

    def _orthogonalize_whole(self, x: torch.Tensor, matrix: Matrix) -> torch.Tensor:
        config = self.config
        shape = list(x.shape)
        if matrix.group is not None:
            x = _gathered(x, matrix)
        orthogonal = newton_schulz(
            x,
            config.muon_num_ns_steps,
            config.muon_coefficient_type,
            bf16=config.muon_fp32_matmul_prec == "medium",
        )
        scale = scale_factor(*orthogonal.shape, config.muon_scale_mode)
        if matrix.group is not None:  # this rank's shard again
            dim = matrix.partition_dim
            start = matrix.group.rank * shape[dim]
            orthogonal = orthogonal.narrow(dim, start, shape[dim])
        return orthogonal * (scale * config.muon_extra_scale_factor)

    def orthogonalize(self, update: torch.Tensor, matrix: Matrix) -> torch.Tensor:
        if matrix.split is None:
            return self._orthogonalize_whole(update, matrix)
        rows, columns = update.shape
        groups = rows // sum(matrix.split)
        parts = update.view(groups, sum(matrix.split), columns).split(matrix.split, dim=1)
        parts = [
            self._orthogonalize_whole(part.reshape(-1, columns), matrix).view(groups, -1, columns)
            for part in parts
        ]
        return torch.cat(parts, dim=1).view(rows, columns)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        config = self.config
        # "high": fp32 matmuls that may use TF32 on a GPU, as Megatron-LM sets them
        precision = (
            _matmul_precision("high")
            if config.muon_fp32_matmul_prec == "high"
            else contextlib.nullcontext()
        )
        with precision:
            for group in self.param_groups:
                lr, decay, momentum = group["lr"], group["weight_decay"], config.muon_momentum
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad
                    state = self.state[param]
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(param)
                    if decay:
                        param.add_(param, alpha=-decay * lr)
                    buffer = state["momentum_buffer"]
                    buffer.lerp_(grad, 1 - momentum)
                    update = grad.lerp(buffer, momentum) if config.muon_nesterov else buffer
                    matrix = self.matrices[param]
                    step = self.orthogonalize(update.view(matrix.shape), matrix)
                    param.add_(step.reshape(param.shape), alpha=-lr)


def describe(config: TrainingConfig, matrices: int) -> str:
    """The start-up line of --optimizer muon."""
    precision = "bf16" if config.muon_fp32_matmul_prec == "medium" else "fp32"
    qkv = ", query/key/value apart" if config.muon_split_qkv else ""
    return (
        f"> optimizer: Muon for {matrices} weight matrices (rank 0's){qkv} (Newton-Schulz "
        f"{config.muon_coefficient_type} x{config.muon_num_ns_steps} in {precision}, "
        f"{config.muon_scale_mode} scale x{config.muon_extra_scale_factor}, TP "
        f"{config.muon_tp_mode}, momentum {config.muon_momentum}"
        f"{', Nesterov' if config.muon_nesterov else ''}); AdamW for the embeddings, output "
        "layer, norms and biases"
    )


@contextlib.contextmanager
def _matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
