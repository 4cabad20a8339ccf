"""Which layers train in FP8, and their scaling state as one component.

`convert_to_fp8` is applied to a built model chunk, as torchtitan converts its linears with
torchao: the linear layers of each transformer layer's attention (QKV, output projection), of
its dense MLP or an MoE layer's shared expert (fc1, fc2), and, under rowwise scaling, of its
experts get an FP8 state (`threefold.kernels.fp8.Fp8Linear`) and run their GEMMs in FP8.
Everything else keeps the run's precision: embeddings, the output layer, norms, the attention
core, routers, the layers --first-last-layers-bf16 keeps, and experts under the recipes other
than rowwise.

Why experts only rowwise: an expert's GEMM takes the tokens routed to it from every rank of
its expert-parallel group at once, where one device meets them one micro-batch at a time, so a
per-tensor amax (tensorwise, and delayed scaling's first step) would scale them differently in
every layout. Rowwise scales do not depend on which tokens share a GEMM: the forward's and the
input gradient's are per token and per weight row, and the weight gradient's, per feature over
the tokens, are powers of two, so a micro-batch's column cast with the scale of a union of
micro-batches (its own times 2^-k) has the same FP8 values (`threefold.kernels.fp8`'s
argument for rows split over ranks): every expert-parallel layout matches one device.
Blockwise scaling's weight gradient is scaled per 128 tokens, blocks whose tokens an expert's
GEMM gathers differently in every layout (no block of one device's lies around them): its
experts stay in the run's precision too.

`Fp8Scaling` owns every FP8 state of this rank's chunks: the step-end update of delayed scales
and the tensors a checkpoint saves, named after the layer in the whole model
(`fp8.decoder.layers.3.mlp.linear_fc1.scale`), so they reshard with any layout. Under delayed
scaling every rank of a pipeline stage holds the same values (the amaxes are reduced over TP x
CP x DP), so data- and tensor-parallel ranks save the same tensor under one key.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from threefold.config.fp8 import Fp8Config, experts_in_fp8
from threefold.kernels.fp8 import Fp8Linear, update_delayed_scales
from threefold.kernels.fp8_recipe import Fp8Recipe
from threefold.model.mlp import MLP
from threefold.model.moe.layer import MoELayer
from threefold.parallel.parallel_context import ONE_DEVICE, ParallelContext

_MLP_LINEARS = ("linear_fc1", "linear_fc2")


def fp8_recipe(config: Fp8Config) -> Fp8Recipe:
    return Fp8Recipe(
        fp8_format=config.fp8,
        delayed=config.fp8_recipe == "delayed",
        rowwise=config.fp8_recipe == "rowwise",
        blockwise=config.fp8_recipe == "blockwise",
        margin=config.fp8_margin,
        amax_history_len=config.fp8_amax_history_len,
        amax_compute_algo=config.fp8_amax_compute_algo,
        fp8_wgrad=config.fp8_wgrad,
    )


def _layer_linears(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """A transformer layer's FP8 candidates: (attention's and the dense MLP's or the shared
    expert's and latent projections' linear layers, the experts' linear layers)."""
    # (a hybrid stack's layers: a Mamba mixer, or attention or an MLP alone)
    mixer = getattr(layer, "mixer", None) or getattr(layer, "self_attention", None)
    dense = mixer.linear_layers() if mixer is not None else []
    experts: list[nn.Module] = []
    mlp = getattr(layer, "mlp", None)
    if isinstance(mlp, MoELayer):
        for expert in mlp.experts.local_experts.values():
            experts += [getattr(expert, name) for name in _MLP_LINEARS]
        if mlp.fc1_latent_proj is not None:  # (Transformer Engine's linears: FP8 there too)
            dense += [mlp.fc1_latent_proj, mlp.fc2_latent_proj]
        mlp = mlp.shared_experts
    if isinstance(mlp, MLP):
        dense += [getattr(mlp, name) for name in _MLP_LINEARS]
    return dense, experts


def convert_to_fp8(
    chunk: nn.Module,
    config: Fp8Config,
    parallel: ParallelContext,
    num_layers: int,
    device: torch.device,
    per_token_loss: bool = False,
    traced: bool = False,
) -> None:
    """Give the FP8 linear layers of one model chunk their FP8 state, on `device` (the chunk's;
    its parameters may still be on the meta device: model/meta_device.py).
    `per_token_loss`: --calculate-per-token-loss (no loss divisor per micro-batch). `traced`:
    the dense ones may be traced into their compiled layer's graph (`Fp8Linear.linear`); the
    experts', between the MoE layer's all-to-alls, stay eager."""
    recipe, keep = fp8_recipe(config), config.bf16_layers(num_layers)
    # A rank's gradients are DP x CP times one device's (model/loss.py, the schedules).
    gradient_factor = parallel.cp.size * (1 if per_token_loss else parallel.dp.size)
    # Multi-token prediction's layers and projections run in FP8 too (as megatron-core's,
    # in its FP8 context), whatever --first-last-layers-bf16 keeps.
    depths = list(chunk.mtp.layers) if getattr(chunk, "mtp", None) is not None else []
    parts = [
        _layer_linears(layer) for layer in chunk.decoder.layers if layer.layer_number not in keep
    ]
    for depth in depths:
        parts += [_layer_linears(layer) for layer in depth.inner_layers()]
        parts.append(([depth.eh_proj], []))
    for dense, experts in parts:
        for module in dense:
            # Amaxes of sharded tensors are reduced over the ranks holding the shards.
            module.fp8 = Fp8Linear(recipe, parallel.tp_cp, gradient_factor).to(device)
            module.fp8.traced = traced
        for module in experts if experts_in_fp8(config) else []:
            # Rowwise scaling reduces no amax (and keeps no units: its scales are per row).
            module.fp8 = Fp8Linear(recipe, ONE_DEVICE).to(device)


def fp8_states(chunks: list[nn.Module]) -> dict[str, Fp8Linear]:
    """The chunks' FP8 states under the layout-independent names of their linear layers."""
    return {
        chunk.layout_independent_name(f"{name}.weight").removesuffix(".weight"): module.fp8
        for chunk in chunks
        for name, module in chunk.named_modules()
        if isinstance(getattr(module, "fp8", None), Fp8Linear)
    }


def fp8_layers(chunks: list[nn.Module]) -> list[nn.Module]:
    """The chunks' FP8 linear layers whose weights are trained."""
    return [
        module
        for chunk in chunks
        for module in chunk.modules()
        if isinstance(getattr(module, "fp8", None), Fp8Linear) and module.weight.requires_grad
    ]


def fp8_weights(chunks: list[nn.Module]) -> dict[nn.Parameter, Fp8Linear]:
    """The trained weights of the chunks' FP8 layers, each with its layer's FP8 state."""
    return {module.weight: module.fp8 for module in fp8_layers(chunks)}


_STATE = ("scale", "amax_history")


class Fp8Scaling:
    """This rank's FP8 states: the delayed recipe's step-end update and its checkpoint tensors."""

    def __init__(
        self,
        chunks: list[nn.Module],
        config: Fp8Config,
        parallel: ParallelContext,
        num_layers: int,
        cache_weights: bool = True,
        compile_layers: bool = False,
    ) -> None:
        """Over chunks `convert_to_fp8` has converted. `cache_weights`: see `weights_cached`;
        `compile_layers`: the layers are compiled (for the log line)."""
        self.recipe, self.parallel = fp8_recipe(config), parallel
        self.compile_layers = compile_layers
        self.cache_weights = cache_weights
        self.param_gather = config.fp8_param_gather
        self.states = fp8_states(chunks)
        # The weights whose FP8 linears may run inside a compiled graph: cast for the step
        # before it starts (`weights_cached`)
        self.traced_weights = {w: state for w, state in fp8_weights(chunks).items() if state.traced}
        self.bf16_layers = sorted(config.bf16_layers(num_layers))
        has_moe = any(isinstance(m, MoELayer) for chunk in chunks for m in chunk.modules())
        # None: no MoE layer here; else whether its experts run in FP8
        self.experts = experts_in_fp8(config) if has_moe else None

    def after_step(self) -> None:
        """Delayed scaling: this step's amaxes into the histories, the next step's scales."""
        if self.recipe.delayed:
            parallel = self.parallel
            update_delayed_scales(list(self.states.values()), [parallel.tp_cp, parallel.dp])

    @contextmanager
    def weights_cached(self) -> Iterator[None]:
        """One training step's forward and backward passes: each FP8 weight is cast (or, with
        --fp8-param-gather, transposed) by its first micro-batch, and its transposed copy is
        read by every later one and their backward passes (`Fp8Linear.weight_in_fp8`), as
        Transformer Engine caches weights for `is_first_microbatch`. Exact: no weight or scale
        changes inside a step (the optimizer and the delayed scales' update come after), so
        every micro-batch would cast the same bytes; the copies are dropped at the end, before
        the weights change. Later micro-batches transpose instead of casting (no amax, no
        reduction), and, as they share the copies, a pipeline stage holds one FP8 weight (in
        both layouts) for its micro-batches in flight instead of one each. A layer traced into
        a compiled graph cannot keep what it casts: its weights are cast here, before the
        first forward, and every micro-batch's graph reads them. (Off where
        `caches_fp8_weights` says so: then every micro-batch casts.)"""
        states = list(self.states.values()) if self.cache_weights else []
        for state in states:
            state.cache_weight = True
        for weight, state in self.traced_weights.items() if states else ():
            state.cast_step_weight(weight)
        try:
            yield
        finally:
            for state in states:
                state.cache_weight, state.weight_cache = False, None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint holds (delayed scaling only: current scaling keeps none)."""
        if not self.recipe.delayed:
            return {}
        return {
            f"fp8.{name}.{field}": getattr(state, field)
            for name, state in self.states.items()
            for field in _STATE
        }

    def after_load(self) -> None:
        """After a checkpoint's state was loaded into `state_tensors()`: a layer with a history
        uses its scales from the first step on."""
        for state in self.states.values():
            if state.amax_history.any():
                state.use_history()

    def describe(self) -> str:
        kept = f"; layers {self.bf16_layers} kept out" if self.bf16_layers else ""
        gather = (
            "; their weights cast from the fp32 masters once per step and all-gathered in FP8"
            if self.param_gather
            else ""
        )
        kinds = [
            kind
            for kind, part in (("dense MLP", ".mlp.linear_"), ("shared-expert", ".shared_experts."))
            if any(part in name for name in self.states)
        ]
        kinds = ["attention", *kinds, *(["expert"] if self.experts else [])]
        linears = " and ".join([", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)
        kept_out = "attention core and experts"
        if self.experts:
            kept_out = "attention core and routers"
        elif self.experts is not None:
            kept_out = "attention core, routers and experts (FP8 with rowwise scaling only)"
        parallel = self.parallel
        if parallel.sequence_parallel and parallel.tp.size > 1 and self.recipe.gathers_in_fp8:
            # (kernels/fp8_sequence_parallel.py)
            gather += "; sequence-parallel inputs and row-parallel gradients all-gathered in FP8"
            if parallel.tp_comm_overlap:
                gather += ", in ring steps beside their GEMMs (--tp-comm-overlap)"
        elif parallel.tp_comm_overlap:
            gather += (
                "; sequence-parallel collectives in ring steps beside their GEMMs, each "
                "slice cast as it arrives (--tp-comm-overlap)"
            )
        if any(state.traced for state in self.states.values()):
            gather += "; traced into the compiled layers' graphs where they run no collective"
        elif self.compile_layers and self.states:
            why = "pipeline parallelism" if parallel.pp.size > 1 else "--fp8-param-gather"
            gather += f"; eager between the compiled layers' graphs ({why})"
        return (
            f"> fp8: {self.recipe.describe()}; GEMMs of the {linears} linear layers via "
            f"torch._scaled_mm ({len(self.states)} layers on this rank{kept}){gather}; "
            f"embeddings, output layer, norms, {kept_out} in the run's precision"
        )
