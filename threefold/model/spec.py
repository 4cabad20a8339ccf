"""What a transformer layer is built from: a spec of module factories, megatron-core's
`ModuleSpec` idea in a dozen lines.

`TransformerLayer` never names its parts: it asks its `LayerSpec` for the self-attention, the
MLP and the norms (in a hybrid stack one of the two may be None: an attention-only or an MLP-
only layer; its Mamba layers are `mamba_layer`'s). A new variant is a new module and one line
in `layer_spec`: the layers --moe-layer-freq picks take the mixture-of-experts MLP (`moe_mlp`)
instead of `mlp`, those --linear-attention-freq picks a gated delta net (`linear_attention`)
instead of `self_attention`, those --window-attn-skip-freq leaves windowed get
`self_attention` with --window-size's window, those --no-rope-freq picks `self_attention`
without RoPE; under context parallelism `self_attention` is built with the core attention that
spans the CP ranks; the layer itself does not change. Every factory takes the model config,
the parallel context and the two init methods (the norm: the config, its size and whether its
gradient is partial over TP), so a part reads its options from the config, not from threaded
keywords.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from threefold.config import ModelConfig
from threefold.config.hybrid import ATTENTION, GDN, MAMBA, MOE
from threefold.config.hybrid import MLP as MLP_SYMBOL
from threefold.model.attention import SelfAttention, context_parallel
from threefold.model.gated_delta_net import GatedDeltaNet
from threefold.model.mamba import MambaLayer
from threefold.model.mla import MLASelfAttention
from threefold.model.mlp import MLP
from threefold.model.moe import MoELayer
from threefold.model.norms import build_norm
from threefold.parallel.parallel_context import ParallelContext


@dataclass(frozen=True)
class LayerSpec:
    self_attention: Callable = SelfAttention  # (config, parallel, init, output_init) -> module
    mlp: Callable = MLP  # (config, parallel, init, output_init) -> module
    norm: Callable = build_norm  # (config, size, partial_grads) -> module
    moe_mlp: Callable = MoELayer  # as `mlp`, for the layers in `moe_layers`
    moe_layers: frozenset[int] = frozenset()  # 1-based global layer numbers
    linear_attention: Callable = GatedDeltaNet  # as `self_attention`, for `linear_layers`
    linear_layers: frozenset[int] = frozenset()  # 1-based global layer numbers
    window: int | None = None  # --window-size's keys back, in `window_layers`
    window_layers: frozenset[int] = frozenset()  # 1-based global layer numbers
    no_rope_layers: frozenset[int] = frozenset()  # 1-based: --no-rope-freq's, without RoPE
    # --hybrid-layer-pattern's symbol for each layer (None: GPT layers, attention and MLP each)
    hybrid: str | None = None
    mamba_layer: Callable = MambaLayer  # the M layers': (config, parallel, spec, n, init, ...)

    def is_mamba(self, layer_number: int) -> bool:
        """Whether the layer is `mamba_layer`'s (else a transformer layer of one or both
        parts, as `attention_of` and `mlp_of` say)."""
        return self._symbol(layer_number) == MAMBA

    def _symbol(self, layer_number: int) -> str | None:
        return self.hybrid[layer_number - 1] if self.hybrid else None

    def mlp_of(self, layer_number: int) -> Callable | None:
        if self._symbol(layer_number) in (ATTENTION, GDN):  # (a hybrid stack's mixer alone)
            return None
        return self.moe_mlp if layer_number in self.moe_layers else self.mlp

    def attention_of(self, layer_number: int) -> Callable | None:
        if self._symbol(layer_number) in (MLP_SYMBOL, MOE):  # (an MLP-only layer)
            return None
        if layer_number in self.linear_layers:
            return self.linear_attention
        options = {}
        if layer_number in self.window_layers:
            options["window"] = self.window
        if layer_number in self.no_rope_layers:
            options["rope"] = False
        return functools.partial(self.self_attention, **options) if options else self.self_attention


def layer_spec(config: ModelConfig, parallel: ParallelContext) -> LayerSpec:
    """The parts a model config and layout ask for: the GPT layer, its attention multi-latent
    with --multi-latent-attention, its core attention spanning the context-parallel ranks when
    the sequence is split over them, its MLP a mixture of experts in the layers
    --moe-layer-freq picks, its attention a gated delta net in those --linear-attention-freq
    picks."""

    def layers(pattern: list[int]) -> frozenset[int]:
        return frozenset(i + 1 for i, chosen in enumerate(pattern) if chosen)

    parts = {
        "hybrid": None,
        "moe_layers": layers(config.moe_layer_pattern(config.num_layers)),
        "linear_layers": layers(config.linear_attention_pattern(config.num_layers)),
        "window": config.attention_window(),
        "window_layers": layers(config.window_pattern(config.num_layers)),
        "no_rope_layers": layers(config.no_rope_pattern(config.num_layers)),
    }
    if config.hybrid:  # (the symbols of the multi-token prediction depths' layers too)
        symbols = config.hybrid_layers_with_mtp()
        parts["hybrid"] = symbols
        parts["moe_layers"] = layers([symbol == MOE for symbol in symbols])
        parts["linear_layers"] = layers([symbol == GDN for symbol in symbols])
    attention = MLASelfAttention if config.multi_latent_attention else SelfAttention
    if parallel.cp.size > 1:
        attention = functools.partial(attention, core_attention=context_parallel)
    return LayerSpec(**parts, self_attention=attention)
