"""AdamW with fp32 master weights, global-norm clipping and loss-scale handling.

`MixedPrecisionOptimizer`: every data-parallel rank keeps the whole optimizer state. For fp32
models it updates the parameters themselves; for bf16/fp16 models it keeps fp32 master copies,
steps them with fp32 gradients and copies the result into the half-precision parameters
(Megatron's Float16OptimizerWithFloat16Params).

`DistributedOptimizer` (`--use-distributed-optimizer`, ZeRO-1/2): training/distrib_optimizer.py.

`NativeOptimizer`: for PyTorch DDP/FSDP (`--distributed-strategy ddp|fsdp`), whose fp32
parameters are their own masters and whose gradients are in `param.grad` (sharded DTensors
under FSDP).

`--optimizer-cpu-offload` keeps the masters and Adam moments in CPU memory and steps there;
gradients go to the CPU and updated weights come back every step (DeepSpeed's ZeRO-Offload).

Weight decay applies to matrices only: biases and norm weights (1-D) are excluded, as in
Megatron (with --apply-wd-to-qk-layernorm the query and key norms decay too, Qwen3-Next's
rule). With --decoupled-lr the word embeddings and the output layer form groups of their own,
which the scheduler gives --decoupled-lr / --decoupled-min-lr. Under --optimizer muon the weight
matrices are Muon's (training/muon.py), in the same schedule, and AdamW steps the rest.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from threefold.config import TrainingConfig
from threefold.config.weight_decay import decays
from threefold.model.fp8_fsdp_params import Fp8FsdpParameters
from threefold.model.gpt import is_embedding_or_output
from threefold.parallel.data_parallel.torch_native import copy_whole, full, local
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.sharding import is_expert
from threefold.training.muon import Muon
from threefold.training.precision_aware import DTYPES, PrecisionAwareAdamW

OFFLOAD_DEVICE = torch.device("cpu")


def _counts_towards_norm(param: nn.Parameter, tensor_model_parallel_rank: int) -> bool:
    """Each distinct parameter counts once across the model-parallel group: TP shards on every
    rank, replicated parameters only on TP rank 0, tied embeddings only on the first stage."""
    if getattr(param, "embedding_copy", False):  # the last stage's copy of tied embeddings
        return False
    return getattr(param, "tensor_model_parallel", False) or tensor_model_parallel_rank == 0


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(())
    # (in fp32 whatever the tensors' dtype: --main-grads-dtype bf16's gradients)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).pow(2).sum()


def _zeros(tensors: list[torch.Tensor]) -> torch.Tensor:
    return sum((t == 0).sum() for t in tensors) if tensors else torch.zeros((), dtype=torch.int64)


def _all_reduce(tensor: torch.Tensor, groups: list) -> torch.Tensor:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, group=group)
    return tensor


@dataclass
class Piece:
    """The part [start, end) of a flattened model parameter that an fp32 master stands for.
    `separate`: the master is a copy, not the parameter (or a view of it). The precision-aware
    optimizer steps 16-bit views and keeps their fp32 values in its own state."""

    param: nn.Parameter
    start: int
    end: int
    master: nn.Parameter
    separate: bool = False


class AdamWithMasters:
    """What all optimizers share: masters in `pieces`, AdamW (and Muon) over them, the step.

    `separate_masters`: the fp32 masters are copies (bf16/fp16 models, or offloaded to the CPU)
    that are written back into the model after each step, rather than the parameters (or views
    of them) themselves."""

    # Groups whose members hold disjoint parts of the gradients, which the norm sums over: the
    # model-parallel group always, the DP group when gradients are sharded.
    reduction_groups: list
    # The groups over which expert weights are summed; None in a model without experts.
    expert_reduction_groups: list | None = None
    separate_masters: bool

    def _build(
        self,
        pieces: list[Piece],
        config: TrainingConfig,
        named_parameters: list[tuple[str, nn.Parameter]],
        matrices: dict | None = None,
        lr_scales: dict | None = None,
        precision_aware: bool = False,
    ) -> None:
        """`matrices` (--optimizer muon): the parameters Muon steps (training/muon.py), each
        with how it is orthogonalized; Adam steps the rest. `lr_scales` (--use-mup): the
        factor on a parameter's learning rate and Adam eps (training/mup.py).
        `precision_aware`: training/precision_aware.py's AdamW, which keeps the masters of
        16-bit pieces itself."""
        self.pieces = pieces
        self.precision_aware = precision_aware
        self._state_keys: dict[str, tuple[Piece, str]] = {}
        matrices, lr_scales = matrices or {}, lr_scales or {}
        self.clip_grad = config.clip_grad
        self.count_zeros = False  # --log-num-zeros-in-grad: the trainer turns it on
        self.num_zeros_in_grad: int | None = None
        decoupled = (
            {param for name, param in named_parameters if is_embedding_or_output(name)}
            if config.decoupled_lr is not None
            else set()
        )
        decaying = {param for name, param in named_parameters if decays(name, param, config)}
        groups = []
        scales = sorted(set(lr_scales.values()) | {1.0})
        for is_decoupled, decay, scale in itertools.product((False, True), (True, False), scales):
            params = [
                p.master
                for p in pieces
                if (p.param in decoupled) == is_decoupled
                and (p.param in decaying) == decay
                and p.param not in matrices
                and lr_scales.get(p.param, 1.0) == scale
            ]
            if params:
                # wd_mult: the scheduler sets weight_decay = its value x wd_mult; lr_mult:
                # lr = its value x lr_mult.
                groups.append(
                    {
                        "params": params,
                        "decoupled_lr": is_decoupled,
                        "wd_mult": 1.0 if decay else 0.0,
                        "weight_decay": config.weight_decay if decay else 0.0,
                        "lr_mult": scale,
                        "eps": config.adam_eps * scale,
                    }
                )
        masters = [p.master for p in pieces if p.param not in matrices]
        # PyTorch's fused AdamW: one vectorized pass per tensor instead of a chain of
        # elementwise ops (4.8x faster on a 4M-parameter model on CPU). Plain tensors only:
        # FSDP's DTensor shards take the default implementation.
        fused = bool(masters) and all(
            type(m.data) is torch.Tensor and m.device.type in ("cpu", "cuda") for m in masters
        )
        # A rank can own no piece at all (a tiny model over many DP ranks).
        groups = groups or [{"params": [nn.Parameter(torch.zeros(1))]}]
        betas = (config.adam_beta1, config.adam_beta2)
        if precision_aware:
            dtypes = {
                "exp_avg": DTYPES[config.exp_avg_dtype],
                "exp_avg_sq": DTYPES[config.exp_avg_sq_dtype],
                "master_param": DTYPES[config.main_params_dtype],
            }
            self.optimizer = PrecisionAwareAdamW(
                groups, lr=config.lr, betas=betas, eps=config.adam_eps, dtypes=dtypes, fused=fused
            )
        else:
            self.optimizer = torch.optim.AdamW(
                groups, lr=config.lr, betas=betas, eps=config.adam_eps, fused=fused or None
            )
        stepped = [p for p in pieces if p.param in matrices]
        self.muon = None
        if stepped:  # matrices only: weight decay for all, none in the decoupled-LR groups
            group = {"params": [p.master for p in stepped], "decoupled_lr": False, "wd_mult": 1.0}
            group["weight_decay"] = config.weight_decay
            self.muon = Muon([group], {p.master: matrices[p.param] for p in stepped}, config)
        self._muon_masters = {p.master for p in stepped}

    def _master(self, value: torch.Tensor, offload: bool) -> nn.Parameter:
        """A separate fp32 master initialized from `value`, on the CPU when offloading."""
        device = OFFLOAD_DEVICE if offload else value.device
        return nn.Parameter(value.detach().to(device=device, dtype=torch.float32, copy=True))

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups + (self.muon.param_groups if self.muon else [])

    @property
    def master_params(self) -> list[nn.Parameter]:
        return [p.master for p in self.pieces]

    def _attach_grads(self) -> list[torch.Tensor]:
        """Point each master's `.grad` at its fp32 gradient; returns those gradients."""
        raise NotImplementedError

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def copy_model_to_masters(self) -> None:
        raise NotImplementedError

    def _fp32_grad(self, grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """A view of an fp32 gradient on the master's device, else an fp32 copy there."""
        return grad.to(device=master.device, dtype=torch.float32)

    def _counted(self, tensors: list[torch.Tensor], experts: bool = False) -> list[torch.Tensor]:
        """This rank's local parts of `tensors` (one per piece) that count towards model-wide
        sums: each distinct parameter element once over all ranks. Expert weights (`experts`)
        are summed over their own group, where every rank holds different experts (or different
        expert-TP shards of them; a whole one counts on expert-TP rank 0)."""
        rank = self.expert_tp_rank if experts else self.tp_rank
        return [
            local(t)
            for piece, t in zip(self.pieces, tensors)
            if is_expert(piece.param) == experts and _counts_towards_norm(piece.param, rank)
        ]

    def _global_sum(self, value: torch.Tensor, groups: list) -> float | int:
        # The reduction runs where the process groups' backend works (NCCL: on the GPU).
        return _all_reduce(value.to(self.reduction_device), groups).item()

    def _model_sum(self, tensors: list[torch.Tensor], per_rank: Callable) -> float:
        """The sum over all ranks of `per_rank(counted tensors)`, dense and expert parts each
        over the ranks that hold them."""
        total = self._global_sum(per_rank(self._counted(tensors)), self.reduction_groups)
        if self.expert_reduction_groups is not None:
            experts = per_rank(self._counted(tensors, experts=True))
            total += self._global_sum(experts, self.expert_reduction_groups)
        return total

    def _global_norm(self, tensors: list[torch.Tensor]) -> float:
        return math.sqrt(self._model_sum(tensors, _sum_of_squares))

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """The global gradient norm over all ranks holding parts of the model; inf or nan when
        any gradient holds inf or nan (uncounted replicas are copies of counted ones), so one
        pass and one reduction also serve as the overflow check."""
        return self._global_norm(grads)

    @torch.no_grad()
    def params_norm(self) -> float:
        """The L2 norm of all parameters (their fp32 masters), each counted once
        (--log-params-norm)."""
        if self.precision_aware:  # each master in fp32 in turn: a norm per piece
            unscaled = self.optimizer.unscaled
            return self._global_norm([unscaled(p.master, "master").norm() for p in self.pieces])
        return self._global_norm(self.master_params)

    def _count_zeros(self, grads: list[torch.Tensor]) -> int:
        return int(self._model_sum(grads, _zeros))

    @torch.no_grad()
    def step(
        self, divisor: float, row_factors: dict[nn.Parameter, torch.Tensor] | None = None
    ) -> tuple[bool, float | None]:
        """Unscale (divide the gradients by `divisor`: the loss scale, times the token count
        under --calculate-per-token-loss), check, clip and update. Returns (updated, grad norm);
        a step whose gradients hold inf or nan is skipped (updated False, norm None).
        `row_factors`: QK-clip's (training/qk_clip.py), multiplied into the rows of those
        parameters after the update, or in place of a skipped one (as Megatron-LM clips
        after every step)."""
        grads = self._attach_grads()
        local_grads = [local(g) for g in grads]
        if divisor != 1.0 and grads:
            torch._foreach_mul_(local_grads, 1.0 / divisor)
        norm = self.grad_norm(grads)
        if self.count_zeros:  # before clipping, as Megatron (clipping keeps zeros anyway)
            self.num_zeros_in_grad = self._count_zeros(grads)
        if not math.isfinite(norm):
            if row_factors:
                self._scale_rows(row_factors)
                self.copy_masters_to_model()
            return False, None
        if self.clip_grad > 0 and norm > self.clip_grad and grads:
            torch._foreach_mul_(local_grads, self.clip_grad / (norm + 1e-6))
        if self.pieces:
            self.optimizer.step()
        if self.muon is not None:
            self.muon.step()
        if row_factors:
            self._scale_rows(row_factors)
        self.copy_masters_to_model()
        self._release_grads()
        return True, norm

    @torch.no_grad()
    def _scale_rows(self, row_factors: dict[nn.Parameter, torch.Tensor]) -> None:
        """Multiply each parameter's rows (of this rank's TP shard) by its factors, in the
        masters of its pieces here (where they are the parameter, in the parameter); the
        model's weights are written from them after (`copy_masters_to_model`)."""
        pieces = self.pieces_of()
        for param, factors in row_factors.items():
            per_element = factors.float().repeat_interleave(param.numel() // factors.numel())
            for piece in pieces.get(param, []):
                master = full(self._state_value(piece, "master")).reshape(-1)
                factor = per_element[piece.start : piece.end].to(master.device)
                self._store(piece, "master", master * factor)

    def _release_grads(self) -> None:
        for piece in self.pieces:
            piece.master.grad = piece.master.decoupled_grad = None

    def initialize_state(self) -> None:
        """Create the Adam moments now rather than at the first step (AdamW creates the same
        zeros lazily), so memory can be measured at start-up and checkpoints loaded into."""
        fused = self.optimizer.defaults.get("fused")
        for piece in self.pieces:
            if self.precision_aware:
                self.optimizer.initialize_state(piece.master)
                continue
            if piece.master in self._muon_masters:
                muon = self.muon.state[piece.master]
                if not muon:
                    muon["momentum_buffer"] = torch.zeros_like(piece.master)
                continue
            adam = self.optimizer.state[piece.master]
            if not adam:
                # Where AdamW itself would put it: the fused kernel reads the step count on
                # the parameters' device, the for-loop one on the CPU.
                step_device = piece.master.device if fused else "cpu"
                adam.update(
                    step=torch.zeros((), dtype=torch.float32, device=step_device),
                    exp_avg=torch.zeros_like(piece.master),
                    exp_avg_sq=torch.zeros_like(piece.master),
                )

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: Adam moments and separate masters."""
        states = list(self.optimizer.state.values())
        states += list(self.muon.state.values()) if self.muon is not None else []
        total = sum(
            local(t).numel() * t.element_size() for s in states for k, t in s.items() if k != "step"
        )
        masters = [p.master for p in self.pieces if p.separate]
        return total + sum(local(m).numel() * m.element_size() for m in masters)

    def state_tensors(self, names: dict[nn.Parameter, str]) -> dict[str, torch.Tensor]:
        """The optimizer's tensors for a checkpoint, keyed by parameter name (and piece)."""
        self.initialize_state()
        tensors = {}
        for piece in self.pieces:
            key = self._piece_key(names[piece.param], piece)
            fields = self._fields(piece) + (("step",) if "step" in self._state(piece) else ())
            for field in fields + (("master",) if self.separate_masters else ()):
                tensors[f"optimizer.{field}.{key}"] = self._state_value(piece, field)
                self._state_keys[f"optimizer.{field}.{key}"] = (piece, field)
        return tensors

    def pieces_of(self) -> dict[nn.Parameter, list[Piece]]:
        """Each parameter's pieces on this rank (none where another rank steps all of it)."""
        pieces: dict[nn.Parameter, list[Piece]] = {}
        for piece in self.pieces:
            pieces.setdefault(piece.param, []).append(piece)
        return pieces

    @torch.no_grad()
    def whole_state(self, field: str, param: nn.Parameter, pieces: list[Piece]) -> torch.Tensor:
        """A parameter's `field` ("exp_avg", "exp_avg_sq" or "master") in fp32, shaped as the
        parameter (this rank's TP shard of it), from its `pieces` here (`pieces_of`) and, where
        the distributed optimizer spreads them (or FSDP2 shards them), from the other ranks of
        the parameter's buffer (`_assembled`; FSDP2: its mesh), which call it for the same
        parameters in the same order."""
        flat = torch.zeros(param.numel(), dtype=torch.float32, device=local(param).device)
        for piece in pieces:
            flat[piece.start : piece.end] = full(self._state_value(piece, field)).reshape(-1)
        return self._assembled(param, flat).view(param.shape)

    def _assembled(self, param: nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
        """A parameter's flattened state from this rank's pieces: all of it, here."""
        return flat

    def adam_step(self) -> float:
        """Adam's step count (the same on every piece: the first one's; 0 on a rank with
        none)."""
        steps = (self._state(piece).get("step") for piece in self.pieces)
        return next((float(step) for step in steps if step is not None), 0.0)

    def store_loaded(self, tensors: dict[str, torch.Tensor]) -> None:
        """After a checkpoint was read into `state_tensors()`'s tensors: store those that were
        fp32 copies of the state (the precision-aware optimizer's); the others are the state."""
        if self.precision_aware:
            for key, (piece, field) in self._state_keys.items():
                if key in tensors:
                    self._store(piece, field, tensors[key])

    def _state_value(self, piece: Piece, field: str) -> torch.Tensor:
        """A piece's `field` (an optimizer state, or "master") in fp32: the state itself, or
        (the precision-aware optimizer's 16-bit or 8-bit state) a copy."""
        if self.precision_aware and field != "step":
            return self.optimizer.unscaled(piece.master, field)
        return piece.master.data if field == "master" else self._state(piece)[field]

    def _store(self, piece: Piece, field: str, value: torch.Tensor) -> None:
        """Set a piece's `field` (as `_state_value` names it) from fp32 `value`."""
        if self.precision_aware and field != "step":
            self.optimizer.store(piece.master, field, value)
            return
        stored = piece.master if field == "master" else self._state(piece)[field]
        copy_whole(stored.data, value)  # (FSDP2's shard keeps its part)

    @staticmethod
    def _piece_key(name: str, piece: Piece) -> str:
        return name

    def _state(self, piece: Piece) -> dict:
        muon = piece.master in self._muon_masters
        return (self.muon if muon else self.optimizer).state[piece.master]

    def _fields(self, piece: Piece) -> tuple[str, ...]:
        """The state a piece's optimizer keeps beside the step count."""
        muon = piece.master in self._muon_masters
        return ("momentum_buffer",) if muon else ("exp_avg", "exp_avg_sq")

    @torch.no_grad()
    def load_resharded(
        self,
        named_parameters: list[tuple[str, nn.Parameter]],
        full_shard: Callable[[str, str, nn.Parameter], torch.Tensor],
        loaded: dict[nn.Parameter, torch.Tensor],
        step: torch.Tensor | None,
    ) -> None:
        """Optimizer state from a checkpoint of another layout: `full_shard(field, name, param)`
        is this layout's TP shard of a parameter's saved `exp_avg`/`exp_avg_sq` (Muon's
        `momentum_buffer`), `loaded` the fp32 weights the parameters were filled from; each
        piece of this rank takes its slice."""
        pieces = self.pieces_of()
        for name, param in named_parameters:
            for piece in pieces.get(param, []):
                for field in self._fields(piece):
                    values = full_shard(field, name, param).reshape(-1)[piece.start : piece.end]
                    self._store(piece, field, values)
                if step is not None and "step" in self._state(piece):
                    self._store(piece, "step", step)
                if self.separate_masters:
                    self._store(piece, "master", loaded[param].reshape(-1)[piece.start : piece.end])


class MixedPrecisionOptimizer(AdamWithMasters):
    def __init__(
        self,
        named_parameters: list[tuple[str, nn.Parameter]],
        config: TrainingConfig,
        parallel: ParallelContext,
        offload: bool = False,
        experts: bool = False,
        matrices: dict | None = None,
        lr_scales: dict | None = None,
    ) -> None:
        """`experts`: the model has expert weights (on any pipeline stage: every rank joins
        the reduction of their norms); `matrices`: those Muon steps (--optimizer muon);
        `lr_scales`: muP's (training/mup.py)."""
        self.reduction_groups = [parallel.model_parallel_group]
        if experts:
            self.expert_reduction_groups = [parallel.expert_model_parallel_group]
        self.tp_rank, self.expert_tp_rank = parallel.tp.rank, parallel.expert_tp.rank
        self.separate_masters = config.bf16 or config.fp16 or offload
        self.model_params = [p for _, p in named_parameters if p.requires_grad]
        self.reduction_device = self.model_params[0].device
        self._build(
            [
                Piece(p, 0, p.numel(), self._master(p, offload), separate=True)
                if self.separate_masters
                else Piece(p, 0, p.numel(), p)
                for p in self.model_params
            ],
            config,
            named_parameters,
            matrices,
            lr_scales,
        )

    def _attach_grads(self) -> list[torch.Tensor]:
        for piece in self.pieces:
            piece.master.grad = self._fp32_grad(piece.param.main_grad, piece.master)
        return [piece.master.grad for piece in self.pieces]

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        if self.separate_masters:
            for piece in self.pieces:
                piece.param.copy_(piece.master)

    @torch.no_grad()
    def copy_model_to_masters(self) -> None:
        if self.separate_masters:
            for piece in self.pieces:
                piece.master.copy_(piece.param)


class NativeOptimizer(AdamWithMasters):
    """For PyTorch DDP/FSDP models: the fp32 parameters are the masters (FSDP: their shards),
    and their `.grad`s are kept between steps (DDP's bucket views must stay in place); the
    trainer zeroes them at the start of each step."""

    def __init__(
        self,
        named_parameters: list[tuple[str, nn.Parameter]],
        config: TrainingConfig,
        parallel: ParallelContext,
        sharded: bool,
        experts: bool = False,
        fp8_parameters: Fp8FsdpParameters | None = None,
        lr_scales: dict | None = None,
    ) -> None:
        """`experts`: the model has expert weights (FSDP2 shards them over expert DP; every
        rank joins the reduction of their norms); `fp8_parameters` (FSDP2 with
        --fp8-param-gather): the FP8 copies of the FP8 layers' shards, cast again whenever the
        parameters change; `lr_scales`: muP's."""
        self.fp8_parameters = fp8_parameters
        # FSDP shards over DP; TP shards (and counts TP-replicated weights once) and pipeline
        # stages hold different layers either way.
        self.reduction_groups = ([parallel.dp_cp.group] if sharded else []) + (
            [parallel.model_parallel_group] if parallel.tp.size * parallel.pp.size > 1 else []
        )
        if experts:
            self.expert_reduction_groups = ([parallel.expert_dp.group] if sharded else []) + [
                parallel.expert_model_parallel_group
            ]
        self.tp_rank, self.expert_tp_rank = parallel.tp.rank, parallel.expert_tp.rank
        self.separate_masters = False
        self.model_params = [p for _, p in named_parameters if p.requires_grad]
        self.reduction_device = local(self.model_params[0]).device
        pieces = [Piece(p, 0, p.numel(), p) for p in self.model_params]
        self._build(pieces, config, named_parameters, lr_scales=lr_scales)

    def _attach_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model_params]

    def zero_grad(self) -> None:
        for param in self.model_params:
            if param.grad is not None:
                param.grad.zero_()

    def _release_grads(self) -> None:
        pass

    def copy_masters_to_model(self) -> None:
        if self.fp8_parameters is not None:
            self.fp8_parameters.cast()

    def copy_model_to_masters(self) -> None:
        self.copy_masters_to_model()
