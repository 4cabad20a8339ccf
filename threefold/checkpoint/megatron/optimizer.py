"""Which of Megatron-LM's optimizer states a torch_dist checkpoint holds, and what threefold
reads of it.

megatron-core writes Adam's state in one of several layouts (Megatron-LM picks by flag and
records the choice in common.pt's `content_metadata`):

    non-distributed optimizer      `optimizer.state.{exp_avg,exp_avg_sq}.<model key>` (and
                                   `optimizer.state.fp32_param.<key>`, the fp32 masters of a
                                   bf16/fp16 model), each sharded like the parameter itself
    distributed, fully_reshardable `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`,
      (--dist-ckpt-optim-         the same model-space layout (`param`: the fp32 masters)
      fully-reshardable)
    distributed, dp_reshardable    the distributed optimizer's flat gradient-buffer shards,
      (Megatron-LM's default)      valid only at the saving run's TP/PP layout and buffer sizes
    distributed, fully_sharded_    model-space tensors flattened per rank (megatron-core's
      model_space (deprecated)     older default)

The model-space layouts are read like the weights (any saved TP/PP, one layer's slice at a
time), with the step count and (fp16) the loss scaler's state from common.pt. The other two
are refused in one line that says how to get a readable one from Megatron-LM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# threefold's optimizer fields -> the key prefixes megatron-core stores them under
FIELDS = {
    "exp_avg": ("optimizer.state.exp_avg.",),
    "exp_avg_sq": ("optimizer.state.exp_avg_sq.",),
    "master": ("optimizer.state.param.", "optimizer.state.fp32_param."),
}
_LOSS_SCALER = ("scale", "growth_tracker", "hysteresis_tracker")


@dataclass
class MegatronOptimizer:
    """What a checkpoint holds of Megatron's optimizer: its `layout` (the names above, or
    "none"), whether threefold reads it, the Adam step and the fp16 loss scaler's state."""

    layout: str
    readable: bool
    step: float | None = None
    loss_scaler: dict | None = None


def refusal(layout: str, source: str) -> str:
    """The one line for a --load that needs an optimizer state threefold cannot read."""
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


def _find_step(state: Any) -> float | None:
    """Adam's step wherever megatron-core keeps it: a shared `common_step` in the state of a
    (non-distributed) optimizer, or `step` in the param groups of the distributed one (a
    chained optimizer holds several such dicts; their steps are kept equal)."""
    if isinstance(state, dict):
        common = state.get("state", {})
        if isinstance(common, dict) and isinstance(common.get("common_step"), (int, float)):
            return float(common["common_step"])
        for group in state.get("param_groups", []) or []:
            if isinstance(group, dict) and isinstance(group.get("step"), (int, float)):
                return float(group["step"])
        for value in state.values():
            found = _find_step(value)
            if found is not None:
                return found
    elif isinstance(state, (list, tuple)):
        for value in state:
            found = _find_step(value)
            if found is not None:
                return found
    return None


def _find_loss_scaler(state: Any) -> dict | None:
    """A DynamicGradScaler's state (fp16 runs), whose fields are threefold's own."""
    if not isinstance(state, dict):
        return None
    scaler = state.get("grad_scaler")
    if isinstance(scaler, dict) and all(
        isinstance(scaler.get(k), (int, float)) for k in _LOSS_SCALER
    ):
        return {k: scaler[k] for k in _LOSS_SCALER}
    for value in state.values():
        found = _find_loss_scaler(value)
        if found is not None:
            return found
    return None


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
    else:
        layout = sharding or "dp_reshardable"
    return MegatronOptimizer(
        layout,
        model_space,
        _find_step(state) if model_space else None,
        _find_loss_scaler(state) if model_space else None,
    )
