"""--moe-use-upcycling (Megatron-LM's flag, megatron-core's `upcycling_utils`): a dense model's
checkpoint turned into a mixture of experts, which the run then trains.

Each MoE layer's experts start from that layer's dense MLP, cut into
--moe-upcycling-granularity G pieces along its hidden dimension (the dense --ffn-hidden-size
is G x --moe-ffn-hidden-size; a GLU's gate and up halves are cut alike) and repeated over the
experts: expert e is piece e mod G, so each run of G experts (a "virtual group",
arXiv 2410.07524) holds the whole MLP. The router starts from its own initialization, its
first E / G rows each repeated G times: a virtual group's experts score alike. Both weights
of an expert are scaled so that the experts chosen add up to the dense MLP's activation: by
s^(1/3) for a GLU or squared-ReLU MLP, s^(1/2) for a GELU one, with s = G (E G G / k under
--moe-router-pre-softmax), and fc1's bias with fc1. With G = 1 and softmax weights over the
top k (which add up to 1) the upcycled model computes the dense model's function. The rest
(embeddings, attention, norms, the dense layers --moe-layer-freq keeps) is copied.

pretrain_gpt.py upcycles on rank 0 at start-up: --load's dense checkpoint (threefold's or
Megatron-LM's) read whole, the MoE model's own initialization built from --seed, the result
written to --save as a weights-only checkpoint, which every rank then loads in its own layout;
training starts from it at iteration 0 (Megatron-LM counts it as iteration 1). Later runs
leave the flag out and resume from --save, as Megatron-LM's do.
"""

from __future__ import annotations

import re

import torch

from threefold.config import Config, ConfigError, ModelConfig
from threefold.parallel.parallel_context import ParallelContext

_EXPERT = "mlp.experts.local_experts.{}."


def activation_scale(config: ModelConfig, granularity: int) -> float:
    """How much larger the upcycled experts' combined activation is to be than one piece's."""
    experts, k = config.num_experts, config.moe_router_topk
    if config.moe_router_pre_softmax:
        return experts * granularity / k
    return granularity


def weight_scale(config: ModelConfig, granularity: int) -> float:
    """The factor on each expert weight: the scale spread over the MLP's multiplications."""
    cubed = config.gated_linear_unit or config.squared_relu  # three weights, or a square
    return activation_scale(config, granularity) ** (1 / 3 if cubed else 1 / 2)


def _pieces(tensor: torch.Tensor, granularity: int, glu: bool, dim: int) -> list[torch.Tensor]:
    """`tensor` cut into `granularity` pieces along `dim`; a GLU's [gate; up] cut half by half."""
    if not glu:
        return list(torch.tensor_split(tensor, granularity, dim=dim))
    gate, up = (torch.tensor_split(half, granularity, dim=dim) for half in tensor.chunk(2, dim))
    return [torch.cat([g, u], dim=dim) for g, u in zip(gate, up)]


def upcycled_state(
    dense: dict[str, torch.Tensor],
    moe_init: dict[str, torch.Tensor],
    config: ModelConfig,
    granularity: int,
) -> dict[str, torch.Tensor]:
    """The MoE model's tensors (names as `moe_init`'s, megatron-core's) from the dense model's
    and the MoE model's own initialization."""
    experts, scale = config.num_experts, weight_scale(config, granularity)
    moe_layers = {i for i, moe in enumerate(config.moe_layer_pattern(config.num_layers)) if moe}
    out = {}
    for name, init in moe_init.items():
        layer = re.match(r"decoder\.layers\.(\d+)\.mlp\.", name)
        if layer is None or int(layer.group(1)) not in moe_layers:
            out[name] = _copied(dense, name, init)
            continue
        prefix = name[: layer.end()]
        rest = name[layer.end() :]
        if rest == "router.weight":  # the first E / G rows, each G times
            out[name] = init[: experts // granularity].repeat_interleave(granularity, dim=0)
            continue
        expert = re.match(r"experts\.local_experts\.(\d+)\.(linear_fc[12]\.(weight|bias))$", rest)
        if expert is None:  # the router's bias, the expert bias: their initialization
            out[name] = init.clone()
            continue
        piece, tensor = int(expert.group(1)) % granularity, expert.group(2)
        source = _copied(dense, prefix + tensor, None)
        if tensor == "linear_fc2.bias":  # added once per expert: whole, unscaled
            out[name] = source.clone()
            continue
        fc1 = tensor.startswith("linear_fc1")
        pieces = _pieces(
            source * scale, granularity, config.gated_linear_unit and fc1, 0 if fc1 else 1
        )
        out[name] = pieces[piece].clone()
        _check_shape(name, out[name], init)
    return out


def _copied(dense: dict[str, torch.Tensor], name: str, init: torch.Tensor | None) -> torch.Tensor:
    if name not in dense:
        raise ConfigError(
            f"--moe-use-upcycling: the dense checkpoint has no {name}; it is not this model "
            "without its experts"
        )
    tensor = dense[name]
    if init is not None:
        _check_shape(name, tensor, init)
    return tensor.clone()


def _check_shape(name: str, tensor: torch.Tensor, init: torch.Tensor) -> None:
    if tensor.shape != init.shape:
        raise ConfigError(
            f"--moe-use-upcycling: {name} is {tuple(tensor.shape)} from the dense checkpoint "
            f"and {tuple(init.shape)} in this model; the dense model must be this one without "
            "its experts, its --ffn-hidden-size --moe-upcycling-granularity x "
            "--moe-ffn-hidden-size"
        )


def upcycle(config: Config, iteration: int | None = None) -> str:
    """Write --load's dense model (its latest checkpoint, or `iteration`) upcycled into --save
    (one process, no collectives given `iteration`); returns the directory written."""
    from threefold.checkpoint.load import load_model
    from threefold.checkpoint.save import save_weights_checkpoint
    from threefold.model import GPTModel

    model_config = config.model
    load = config.checkpoint.load
    dense_config, dense_model, _ = load_model(load, iteration=iteration, with_tokenizer=False)
    if dense_config.model.is_moe:
        raise ConfigError(
            f"--moe-use-upcycling: --load {load} holds a mixture of experts; "
            "upcycling starts from a dense model"
        )
    moe = GPTModel(model_config, model_config.padded_vocab_size(1))
    moe.initialize(config.training.seed)
    dense = {name: p.detach() for name, p in dense_model.named_parameters()}
    init = {name: p.detach() for name, p in moe.named_parameters()}
    state = upcycled_state(dense, init, model_config, model_config.moe_upcycling_granularity)
    written = Config(model=model_config, data=config.data)  # (weights only, at TP = PP = 1)
    extra = {"upcycled_from": load}
    return save_weights_checkpoint(config.checkpoint.save, written, state, extra_metadata=extra)


def upcycle_on_rank_zero(config: Config, parallel: ParallelContext) -> str:
    """`upcycle` on world rank 0 while the others wait; returns the line that says so. A
    refusal there (a dense model that is not this one without experts) stops every rank."""
    from threefold.checkpoint.load import all_ranks_agree, find_checkpoint

    iteration = find_checkpoint(config.checkpoint.load)  # (every rank: it agrees over them)
    refusal = None
    if parallel.world.rank == 0:
        try:
            upcycle(config, iteration)
        except ConfigError as error:
            refusal = error
    if not all_ranks_agree(refusal is None):
        raise refusal or ConfigError("--moe-use-upcycling: rank 0 could not upcycle --load")
    model = config.model
    return (
        f"> upcycled --load {config.checkpoint.load}'s dense model into {model.num_experts} "
        f"experts (granularity {model.moe_upcycling_granularity}), written to --save "
        f"{config.checkpoint.save}; training starts from it"
    )
