"""Which of Megatron-LM's optimizer states a torch_dist checkpoint holds, what threefold
reads of it, and what it writes into one (`exported_common`, `ExportedOptimizer`).

megatron-core writes Adam's state in one of several layouts (Megatron-LM picks by flag and
records the choice in common.pt's `content_metadata`):

    non-distributed optimizer      `optimizer.state.{exp_avg,exp_avg_sq}.<model key>` (and
                                   `optimizer.state.fp32_param.<key>`, the fp32 masters of a
                                   bf16/fp16 model), each sharded like the parameter itself
    distributed, fully_reshardable `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`,
      (--dist-ckpt-optim-         the same model-space layout (`param`: the fp32 masters)
      fully-reshardable)
    distributed, dp_reshardable    the distributed optimizer's flat gradient-buffer buckets,
      (Megatron-LM's default)      laid out as the saving run's TP/PP/EP layout fills them
    distributed, fully_sharded_    model-space tensors flattened per rank (megatron-core's
      model_space (deprecated)     older default)

The model-space layouts are read like the weights (any saved TP/PP, one layer's slice at a
time), with the step count and (fp16) the loss scaler's state from common.pt. dp_reshardable
is read where checkpoint/megatron/buckets.py rebuilds the buckets' layout (GPT and mixture-of-
experts models), its step and loss scaler from the optimizer's own saved state. The rest is
refused in one line that says how to get a readable one from Megatron-LM.

An export is shaped for the Megatron-LM run that goes on from it (`ExportShape`), whose
--load takes the state only as its own optimizer saves it. For the distributed optimizer: the
fully_reshardable layout, which it reads at any TP/PP/DP, and in common.pt the parameter groups
(the step count and hyperparameters megatron-core's `load_state_dict` looks each of its groups
up in, by weight-decay and LR multipliers, expert parallelism and decoupled LR). For the
non-distributed one: the same model-space moments, the fp32 masters of a bf16/fp16 run under
`fp32_param`, and in common.pt its torch optimizer's state (`common_step`, the step it hands
every parameter back) with exactly its own groups. Either way the LR scheduler's state in
Megatron-LM's units (samples) and the content metadata naming the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from threefold.config.lr_schedule import lr_schedule
from threefold.config.weight_decay import decays

if TYPE_CHECKING:
    from torch import nn

    from threefold.config import Config

# threefold's optimizer fields -> the key prefixes megatron-core stores them under
FIELDS = {
    "exp_avg": ("optimizer.state.exp_avg.",),
    "exp_avg_sq": ("optimizer.state.exp_avg_sq.",),
    "master": ("optimizer.state.param.", "optimizer.state.fp32_param."),
}
_LOSS_SCALER = ("scale", "growth_tracker", "hysteresis_tracker")
# Megatron-LM's legacy torch format's optimizer state (checkpoint/megatron/legacy.py): the
# non-distributed optimizer's in model_optim_rng.pt, the distributed optimizer's distrib_optim.pt
LEGACY = "legacy torch format"
LEGACY_DISTRIBUTED = "legacy distrib_optim.pt"


@dataclass
class MegatronOptimizer:
    """What a checkpoint holds of Megatron's optimizer: its `layout` (the names above, or
    "none"), whether threefold reads it, the Adam step and the fp16 loss scaler's state."""

    layout: str
    readable: bool
    step: float | None = None
    loss_scaler: dict | None = None
    reason: str | None = None  # why a layout threefold reads is not read here


def refusal(layout: str, source: str, reason: str | None = None) -> str:
    """The one line for a --load that needs an optimizer state threefold cannot read."""
    if reason is not None:
        return (
            f"{source}: a Megatron-LM checkpoint whose optimizer state is in the {layout} "
            f"layout, and {reason}; pass --no-load-optim / --finetune, or load it in "
            "Megatron-LM once and save with --dist-ckpt-optim-fully-reshardable"
        )
    if layout == "none":
        return (
            f"{source}: a Megatron-LM checkpoint saved without its optimizer state; pass "
            "--no-load-optim (or --finetune)"
        )
    return (
        f"{source}: a Megatron-LM checkpoint whose distributed-optimizer state is in the "
        f"{layout} layout, which only Megatron-LM at the saving layout reads; load it there "
        "once and save with --dist-ckpt-optim-fully-reshardable (threefold reads that, and the "
        "non-distributed optimizer's), or pass --no-load-optim / --finetune"
    )


def find_step(state: Any) -> float | None:
    """Adam's step wherever megatron-core keeps it: a shared `common_step` in the state of a
    (non-distributed) optimizer, or `step` in the param groups of the distributed one (a
    chained optimizer holds several such dicts; their steps are kept equal)."""
    if isinstance(state, dict):
        common = state.get("state", {})
        if isinstance(common, dict) and isinstance(common.get("common_step"), (int, float)):
            return float(common["common_step"])
        for each in common.values() if isinstance(common, dict) else ():
            if isinstance(each, dict) and isinstance(each.get("step"), (int, float)):
                return float(each["step"])  # (torch's Adam: each parameter's own, all equal)
        for group in state.get("param_groups", []) or []:
            if isinstance(group, dict) and isinstance(group.get("step"), (int, float)):
                return float(group["step"])
        for value in state.values():
            found = find_step(value)
            if found is not None:
                return found
    elif isinstance(state, (list, tuple)):
        for value in state:
            found = find_step(value)
            if found is not None:
                return found
    return None


def find_loss_scaler(state: Any) -> dict | None:
    """A DynamicGradScaler's state (fp16 runs), whose fields are threefold's own: its scale a
    one-element tensor where it was read as one (a ShardedObject's), else its number."""
    if not isinstance(state, dict):
        return None
    scaler = state.get("grad_scaler")
    if isinstance(scaler, dict):
        numbers = {k: _number(scaler.get(k)) for k in _LOSS_SCALER}
        if all(value is not None for value in numbers.values()):
            return numbers
    for value in state.values():
        found = find_loss_scaler(value)
        if found is not None:
            return found
    return None


def _number(value: Any) -> int | float | None:
    if isinstance(value, (int, float)):
        return value
    if getattr(value, "shape", None) is not None and value.numel() == 1:
        return float(value.item())
    return None


def grad_scaler_state(loss_scaler: dict) -> dict:
    """threefold's dynamic loss scale as megatron-core's DynamicGradScaler saves it: its scale
    a one-element fp32 tensor, which its load moves to the GPU (`.cuda()`: a number there
    stopped Megatron-LM's --load with "'float' object has no attribute 'cuda'")."""
    import torch

    scale = torch.tensor([float(loss_scaler["scale"])], dtype=torch.float32)
    trackers = {k: int(loss_scaler[k]) for k in _LOSS_SCALER if k != "scale"}
    return {"scale": scale, **trackers}


def megatron_optimizer(common: dict, sizes: dict[str, tuple]) -> MegatronOptimizer:
    """The optimizer state of a checkpoint given its common.pt (plain data) and the global
    sizes of its sharded tensors."""
    state = common.get("optimizer")
    metadata = common.get("content_metadata")
    sharding = metadata.get("distrib_optim_sharding_type") if isinstance(metadata, dict) else None
    moments = [k for k in sizes if k.startswith(FIELDS["exp_avg"][0])]
    # Model-space tensors have their parameter's shape; flattened ones do not.
    model_space = bool(moments) and all(
        sizes.get(k[len(FIELDS["exp_avg"][0]) :]) == sizes[k] for k in moments
    )
    if model_space:
        layout = sharding or "non-distributed"
    elif moments:
        layout = sharding or "fully_sharded_model_space"
    elif state is None:
        layout = "none"
    elif not sharding and _unstepped(common, state, sizes):
        return MegatronOptimizer("non-distributed", True, 0.0, find_loss_scaler(state))
    else:
        layout = sharding or "dp_reshardable"
    return MegatronOptimizer(
        layout,
        model_space,
        find_step(state) if model_space else None,
        find_loss_scaler(state) if model_space else None,
    )


def _unstepped(common: dict, state: Any, sizes: dict[str, tuple]) -> bool:
    """Megatron-LM's non-distributed optimizer before its first step: torch's Adam has no
    state yet (no step, no moments), only the fp32 masters (bf16/fp16) are saved. An fp16
    run is there for its first iterations, each skipped while its loss scale (2^32 by
    default) overflows; Adam then starts from zero moments at step 0."""
    args = common.get("args")
    if not isinstance(args, dict) or args.get("use_distributed_optimizer"):
        return False
    master = FIELDS["master"][1]
    tensors = [k for k in sizes if k.startswith("optimizer.")]
    return find_step(state) is None and all(
        k.startswith(master) and sizes.get(k[len(master) :]) == sizes[k] for k in tensors
    )


# What Megatron-LM's save records beside an export's optimizer state (its `content_metadata`);
# the distributed optimizer's also names its layout.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
SHARDING_TYPE = "fully_reshardable"
# Megatron-LM's names for the state an export writes for its distributed optimizer: `param`
# holds the fp32 masters.
EXPORTED_FIELDS = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


@dataclass(frozen=True)
class ExportShape:
    """How an export's optimizer state is shaped: for the Megatron-LM run that goes on from it.

    `distributed`: its --use-distributed-optimizer; without it megatron-core steps with its
    FP32Optimizer, or in bf16/fp16 (`half`) with Float16OptimizerWithFloat16Params, which
    keeps fp32 masters. `experts_apart`: it steps the experts with an optimizer of their own
    (`experts_own_optimizer`). `kinds`: the (weight decay applies, the experts' own optimizer)
    of the parameters that have state, from `group_kinds`: the non-distributed optimizer takes
    exactly its own parameter groups, one per kind, where the distributed one looks its up."""

    distributed: bool = True
    experts_apart: bool = False
    half: bool = False
    kinds: frozenset[tuple[bool, bool]] = frozenset()

    @property
    def fields(self) -> dict[str, str]:
        """threefold's optimizer fields -> the names this run's optimizer reads them under (an
        fp32 run's non-distributed optimizer steps the weights themselves: no masters)."""
        if self.distributed:
            return dict(EXPORTED_FIELDS)
        moments = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
        return {"master": "fp32_param", **moments} if self.half else moments

    def describe(self) -> str:
        if self.distributed:
            return "Megatron-LM's distributed optimizer (--use-distributed-optimizer)"
        return "Megatron-LM's non-distributed optimizer (no --use-distributed-optimizer)"


@dataclass
class ExportedOptimizer:
    """What an export writes of the optimizer: the whole fp32 tensors by threefold field (the
    keys of `fields`, which maps them to Megatron-LM's names) and name, and common.pt's
    entries."""

    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    common: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=lambda: dict(EXPORTED_FIELDS))


def steps_distributed(use_distributed_optimizer: bool, distributed_strategy: str) -> bool:
    """Whether Megatron-LM resumes a run of this layout with its distributed optimizer: where
    the run's flag says so, and for FSDP2's shards (Megatron-LM's --use-torch-fsdp2 saves in
    another format); a run that keeps the whole state on each rank (DDP) steps the
    non-distributed one, as Megatron-LM does without the flag."""
    return use_distributed_optimizer or distributed_strategy == "fsdp"


def group_kinds(
    named: Iterable[tuple[str, nn.Parameter]], config: Config, experts_apart: bool
) -> frozenset[tuple[bool, bool]]:
    """megatron-core's parameter groups of these parameters (`ExportShape.kinds`): its
    weight-decay rule is threefold's, and the experts' group apart where `experts_apart`.
    Parameters without state (DeepSeek-V3's expert bias) are in none."""
    # (here, not above: reading a checkpoint's optimizer layout imports no torch)
    from threefold.parallel.tensor_parallel.sharding import is_expert

    return frozenset(
        (decays(name, param, config.training), experts_apart and is_expert(param))
        for name, param in named
        if param.requires_grad
    )


def export_shape(
    named: Iterable[tuple[str, nn.Parameter]],
    config: Config,
    distributed: bool,
    layout: tuple[int, int, int],
    half: bool,
    union: Callable[[frozenset], frozenset] = lambda kinds: kinds,
) -> ExportShape:
    """The shape for a Megatron-LM run of `layout` (TP, EP, expert TP), with its distributed
    optimizer or not, in bf16/fp16 (`half`) or fp32, of the model whose parameters `named` are
    (`union`: the kinds of every rank's, where each holds a stage's)."""
    tp, ep, etp = layout
    apart = experts_own_optimizer(ep, etp, tp)
    return ExportShape(distributed, apart, half, union(group_kinds(named, config, apart)))


def unexportable(config: Config, metadata: dict) -> str | None:
    """Why a threefold checkpoint's optimizer state cannot go into a Megatron-LM one, or None."""
    training = config.training
    reasons = [
        (
            metadata.get("weights_only") or not metadata.get("optimizer_saved", True),
            "the checkpoint holds none",
        ),
        (training.optimizer != "adam", f"--optimizer {training.optimizer}'s state is not Adam's"),
        (bool(config.model.lora_rank), "a LoRA run's optimizer holds the adapters only"),
        # megatron-core looks its groups up without their learning rates, so a group of its
        # own LR would take another's
        (training.decoupled_lr is not None, "--decoupled-lr's groups"),
        (config.model.use_mup, "muP's per-group learning rates"),
    ]
    return next((reason for applies, reason in reasons if applies), None)


def experts_own_optimizer(expert_parallel: int, expert_tensor_parallel: int, tp: int) -> bool:
    """Whether Megatron-LM at this layout steps the experts with an optimizer of their own:
    their parameters are reduced over the expert groups (`allreduce` False) where EP > 1 or
    ETP differs from TP, and get_megatron_optimizer then chains a second one for them. Its
    --load takes only the optimizer state shaped as its own (one state, or one per optimizer),
    so an export is shaped for a layout: a Megatron-LM run at EP 2 refuses its own
    checkpoint's state at EP 1 (KeyError 'optimizer'), and one at EP 1 this at EP 2
    ("Expected 2 entries in state dict, but got 4")."""
    return expert_parallel > 1 or expert_tensor_parallel != tp


def exported_common(
    config: Config, schedule: dict, step: float, shape: ExportShape, loss_scaler: dict | None = None
) -> dict:
    """common.pt's optimizer entries, shaped by `shape`: `schedule` is threefold's scheduler
    state, `step` Adam's step count, `loss_scaler` fp16's dynamic scale. Where the experts
    have an optimizer of their own, its chained optimizer's states, the rest's and the
    experts'. Megatron-LM's scheduler counts samples (one global batch an updated iteration,
    under --train-iters too): an fp16 run's skipped iterations consumed samples it does not
    count."""
    import torch

    training = config.training
    schedule = {**lr_schedule(training), **schedule}  # (older checkpoints: the step only)
    scale = 1 if training.train_samples is not None else training.global_batch_size
    if shape.distributed:  # (it looks its groups up: every one it may have)
        experts = (False, True) if config.model.is_moe else (False,)
        kinds = [(decay, expert) for expert in experts for decay in (True, False)]
    else:
        kinds = sorted(shape.kinds, key=lambda kind: (kind[1], not kind[0]))
    groups = [
        {
            # torch's AdamW's keys and Transformer Engine's/Apex's FusedAdam's: whichever
            # Megatron-LM steps with finds its own
            "lr": schedule["max_lr"],
            "betas": (training.adam_beta1, training.adam_beta2),
            "eps": training.adam_eps,
            "weight_decay": schedule["end_wd"] * float(decay),
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
            "bias_correction": True,
            "wd_mult": float(decay),
            "lr_mult": 1.0,
            "is_expert_parallel": is_expert_parallel,
            "is_decoupled_lr": False,
            "default_config": True,
            "max_lr": schedule["max_lr"],
            "min_lr": schedule["min_lr"],
            "step": float(step),
        }
        for decay, is_expert_parallel in kinds
    ]
    scheduler = {
        "max_lr": schedule["max_lr"],
        "lr_warmup_steps": schedule["warmup_steps"] * scale,
        "num_steps": schedule["num_steps"] * scale,
        "lr_decay_style": schedule["decay_style"],
        "lr_decay_steps": schedule["decay_steps"] * scale,
        "min_lr": schedule["min_lr"],
        "start_wd": schedule["start_wd"],
        "end_wd": schedule["end_wd"],
        "wd_incr_style": schedule["wd_incr_style"],
        "wd_incr_steps": schedule["wd_incr_steps"] * scale,
    }

    def state(groups: list[dict]) -> dict:
        if shape.distributed:
            entries = {"optimizer": {"param_groups": groups}}
            entries["param_state_sharding_type"] = SHARDING_TYPE
        else:
            # torch's optimizer state, less the tensors: one step for all parameters, which
            # megatron-core hands each back (FP32Optimizer's is torch's own state dict)
            inner = {"state": {"common_step": torch.tensor(float(step))}, "param_groups": groups}
            entries = {"optimizer": inner} if shape.half else inner
        if training.fp16 and loss_scaler:
            entries["grad_scaler"] = grad_scaler_state(loss_scaler)
        return entries

    if config.model.is_moe and shape.experts_apart:  # (keyed by the chained optimizer's index)
        optimizer = {
            index: state([g for g in groups if g["is_expert_parallel"] == apart])
            for index, apart in enumerate((False, True))
        }
    else:
        optimizer = state(groups)
    metadata = dict(CONTENT_METADATA)
    if shape.distributed:
        metadata["distrib_optim_sharding_type"] = SHARDING_TYPE
    return {"optimizer": optimizer, "opt_param_scheduler": scheduler, "content_metadata": metadata}
