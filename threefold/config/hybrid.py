"""Hybrid models: Mamba-2 layers among attention, MLP and mixture-of-experts layers
(Megatron-LM's `pretrain_hybrid.py` / `pretrain_mamba.py` and its --hybrid-layer-pattern;
Nemotron-H's stack).

The pattern names each layer by one symbol, as megatron-core's `hybrid_layer_allocation` does:
M a Mamba layer (norm and Mamba-2 mixer, model/mamba.py), * an attention layer (norm and
self-attention), - an MLP layer (norm and MLP), E a mixture-of-experts layer (norm and the
experts of --num-experts), G a gated delta net layer (a norm and megatron-core's
GatedDeltaNet, its sizes the --linear-* flags: config/linear_attention.py). Unlike a GPT
layer, each holds one sublayer: "M-M*-" is five layers. `|` cuts the pattern into pipeline
segments, one model chunk each (more segments than --pipeline-model-parallel-size: virtual
stages), which threefold runs as the --pipeline-model-parallel-layout of the same chunks. `/`
begins the multi-token prediction depths, one pattern each, all alike ("M*M*/*E/*E": two
depths of an attention and an MoE layer; megatron-core's unified pattern, Nemotron 3 Super's):
it sets --mtp-num-layers, and each depth's layers run between its projection and final norm
(model/mtp.py), numbered after the decoder's.

A Mamba mixer projects each token to z, x, B, C and dt (`mamba_sections`): x and the gate z
are --mamba-num-heads heads of --mamba-head-dim (default: twice the hidden size's worth of
heads), B and C --mamba-num-groups groups of --mamba-state-dim, shared by the heads of a group
as keys are in grouped query attention, dt one step size per head.

`ModelConfig` inherits the fields; `finalize_hybrid` is called from its finalize, first: the
pattern sets --num-layers, which the rest checks against.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg, given_flags

GROUP = "hybrid models"
MAMBA, ATTENTION, MLP, MOE, GDN = "M", "*", "-", "E", "G"
PIPE, MTP_SEPARATOR = "|", "/"
# megatron-core's other symbols, each a layer threefold does not build in a hybrid stack
_MISSING = {"D": "DeepSeek sparse attention layers", "+": "multi-latent attention layers"}
# megatron-core's MambaMixer: expand (d_inner = 2 x hidden), d_conv
MAMBA_EXPAND = 2
MAMBA_CONV_KERNEL = 4
_SIZES = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")


def without_pipeline_cuts(pattern: str | None) -> str | None:
    """A pattern's layers and depths without its `|`: the model, whatever its pipeline."""
    return pattern if pattern is None else "".join(pattern.split()).replace(PIPE, "")


@dataclass
class HybridConfig:
    hybrid_layer_pattern: str | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        aliases=["--hybrid-override-pattern"],
        help="one symbol a layer: M Mamba, * attention, G gated delta net, - MLP, E mixture of "
        'experts; | between pipeline segments (e.g. "M-M*-|M-M*-"); sets --num-layers; / '
        'before each multi-token prediction depth\'s layers ("M*M*/*E/*E")',
    )
    mtp_hybrid_override_pattern: str | None = arg(
        None,
        group=GROUP,
        help="Megatron-LM's older spelling of a depth's pattern, repeated --mtp-num-layers "
        "times after / in --hybrid-layer-pattern",
    )
    mamba_state_dim: int = arg(
        128, checkpoint=ARCHITECTURE, group=GROUP, help="size of a Mamba head's state (N)"
    )
    mamba_head_dim: int = arg(64, checkpoint=ARCHITECTURE, group=GROUP, help="size of a head")
    mamba_num_groups: int = arg(
        8, checkpoint=ARCHITECTURE, group=GROUP, help="groups of heads that share B and C"
    )
    mamba_num_heads: int | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="Mamba heads (default: 2 x --hidden-size / --mamba-head-dim)",
    )

    @property
    def hybrid(self) -> bool:
        return self.hybrid_layer_pattern is not None

    def _hybrid_parts(self) -> list[str]:
        """The decoder's pattern, then each multi-token prediction depth's."""
        return [part.strip() for part in self.hybrid_layer_pattern.split(MTP_SEPARATOR)]

    def hybrid_layers(self) -> str:
        """One symbol a decoder layer (the pattern without its pipeline cuts and depths)."""
        return self._hybrid_parts()[0].replace(PIPE, "")

    def hybrid_mtp_layers(self) -> str:
        """One symbol a layer of each multi-token prediction depth ("": none)."""
        depths = [part for part in self._hybrid_parts()[1:] if part]
        return depths[0] if depths else ""

    def hybrid_layers_with_mtp(self, depths: int | None = None) -> str:
        """The decoder's symbols, then each built depth's (`depths`: that many): one a layer
        number (1-based; model/mtp.py numbers a depth's layers after the decoder's and the
        earlier depths')."""
        depths = self.mtp_depths_built() if depths is None else depths
        return self.hybrid_layers() + self.hybrid_mtp_layers() * depths

    def layer_pattern_with_mtp(self, depths: int | None = None) -> list[int]:
        """In a hybrid model the E layers of the decoder and of each depth."""
        if not self.hybrid:
            return super().layer_pattern_with_mtp(depths)
        return [int(symbol == MOE) for symbol in self.hybrid_layers_with_mtp(depths)]

    def hybrid_segments(self) -> list[int]:
        """The layers of each pipeline segment the pattern's `|` cut (one: no cut)."""
        return [len(segment.strip()) for segment in self._hybrid_parts()[0].split(PIPE)]

    def hybrid_pipeline_layout(self, pipeline_size: int) -> str | None:
        """The pattern's pipeline segments as a --pipeline-model-parallel-layout, a chunk
        each (None: the pattern has no cut, or there is no pipeline to cut: one process runs
        a model trained in segments as one chunk)."""
        segments = self.hybrid_segments() if self.hybrid else [0]
        if len(segments) == 1 or pipeline_size == 1:
            return None
        chunks = ["t" * count for count in segments]
        depths = "m" * (self.mtp_num_layers or 0)  # (beside the loss, as megatron-core's)
        chunks[0], chunks[-1] = "E" + chunks[0], chunks[-1] + depths + "L"
        return "|".join(chunks)

    @property
    def gated_delta_net(self) -> bool:
        """(a hybrid stack's G layers are gated delta nets too)"""
        return super().gated_delta_net or (self.hybrid and GDN in self.hybrid_layers_with_mtp())

    def linear_attention_pattern(self, num_layers: int) -> list[int]:
        """In a hybrid model the G layers are the gated delta nets."""
        if not self.hybrid:
            return super().linear_attention_pattern(num_layers)
        return [int(symbol == GDN) for symbol in self.hybrid_layers()]

    def moe_layer_pattern(self, num_layers: int) -> list[int]:
        """In a hybrid model the E layers are the mixture-of-experts ones."""
        if not self.hybrid:
            return super().moe_layer_pattern(num_layers)
        return [int(symbol == MOE) for symbol in self.hybrid_layers()]

    def mamba_heads(self) -> int:
        if self.mamba_num_heads is not None:
            return self.mamba_num_heads
        return MAMBA_EXPAND * self.hidden_size // self.mamba_head_dim

    def mamba_sections(self) -> tuple[int, ...]:
        """The row sizes of a Mamba mixer's in_proj, [z; x; B; C; dt] (megatron-core's order;
        its convolution's channels are x, B and C)."""
        inner = self.mamba_heads() * self.mamba_head_dim
        states = self.mamba_num_groups * self.mamba_state_dim
        return (inner, inner, states, states, self.mamba_heads())

    def finalize_hybrid(self) -> list[str]:
        """Validate; sets --num-layers (and --mtp-num-layers) from the pattern; returns
        warnings to print."""
        if not self.hybrid:
            given = given_flags(self, HybridConfig, (*_SIZES, "mtp_hybrid_override_pattern"))
            _require(
                not given,
                f"{' '.join(given)}: hybrid settings without --hybrid-layer-pattern; add it "
                "(M marks a Mamba layer) or drop them",
            )
            return []
        warnings = self._unify_mtp_pattern()
        pattern = self.hybrid_layer_pattern
        for symbol, what in _MISSING.items():
            _require(
                symbol not in pattern,
                f"--hybrid-layer-pattern {pattern}: {symbol} marks {what}, which threefold's "
                "hybrid models do not have; use M, *, G, - and E",
            )
        warnings += self._check_mtp_depths(pattern)
        layers = self.hybrid_layers()
        unknown = sorted(set(layers + self.hybrid_mtp_layers()) - {MAMBA, ATTENTION, MLP, MOE, GDN})
        _require(
            layers and not unknown and all(self.hybrid_segments()),
            f"--hybrid-layer-pattern {pattern}: one symbol a layer, M (Mamba), * (attention), "
            "G (gated delta net), - (MLP) or E (mixture of experts), and | between pipeline "
            "segments that each hold a layer"
            + (f"; {' '.join(unknown)} is none of them" if unknown else ""),
        )
        layers = self.hybrid_layers_with_mtp()
        _require(
            MOE not in layers or self.is_moe,
            f"--hybrid-layer-pattern {pattern} has mixture-of-experts layers (E): add "
            "--num-experts",
        )
        _require(
            not self.is_moe or MOE in layers,
            "--num-experts in a hybrid model without mixture-of-experts layers: mark them E in "
            "--hybrid-layer-pattern or drop it",
        )
        _require(
            not self.is_moe or self.moe_layer_freq in (1, "1"),
            "--moe-layer-freq in a hybrid model: --hybrid-layer-pattern's E marks the "
            "mixture-of-experts layers; drop it",
        )
        _require(
            self.experimental_attention_variant is None and self.linear_attention_freq is None,
            "--experimental-attention-variant and --linear-attention-freq in a hybrid model: "
            "--hybrid-layer-pattern's G marks the gated delta net layers; drop them",
        )
        for given, what in (
            (self.post_sublayer_norm, "--post-sublayer-norm: norms after a hybrid layer's part"),
            (
                self.parallel_attention_mlp,
                "--parallel-attention-mlp: attention and MLP side by side (a hybrid stack "
                "keeps them in layers of their own)",
            ),
            (
                not self.sublayer_input_norms,
                "--no-sublayer-input-norms: hybrid layers without their norms",
            ),
        ):
            _require(not given, f"{what} are not built here; drop it")
        decoder = len(self.hybrid_layers())
        if self.num_layers != decoder:
            if given_flags(self, type(self), ("num_layers",)):
                warnings.append(
                    f"--hybrid-layer-pattern {pattern} has {decoder} layers: --num-layers "
                    f"{self.num_layers} is replaced by that, as Megatron-LM does"
                )
            self.num_layers = decoder
        if MAMBA in layers:
            self._check_mamba_sizes()
        return warnings

    def _unify_mtp_pattern(self) -> list[str]:
        """--mtp-hybrid-override-pattern (Megatron-LM's older spelling) into the pattern's
        depths, as Megatron-LM converts it."""
        depth = self.mtp_hybrid_override_pattern
        if depth is None:
            return []
        _require(
            MTP_SEPARATOR not in self.hybrid_layer_pattern and bool(self.mtp_num_layers),
            "--mtp-hybrid-override-pattern is a depth's pattern for --mtp-num-layers depths: "
            "give --mtp-num-layers, and no / in --hybrid-layer-pattern (or write the depths "
            f"there: {self.hybrid_layer_pattern}/{depth}, ... and drop this flag)",
        )
        self.hybrid_layer_pattern += (MTP_SEPARATOR + depth) * self.mtp_num_layers
        self.mtp_hybrid_override_pattern = None
        return [
            f"--mtp-hybrid-override-pattern {depth}: {self.hybrid_layer_pattern} (as Megatron-LM)"
        ]

    def _check_mtp_depths(self, pattern: str) -> list[str]:
        """The depths after `/`: alike, without pipeline cuts; they set --mtp-num-layers (a
        different one is replaced, with Megatron-LM's warning: `finalize_hybrid`)."""
        parts = self._hybrid_parts()[1:]
        depth = self.hybrid_mtp_layers()
        _require(
            all(part == depth for part in parts) and PIPE not in depth,
            f"--hybrid-layer-pattern {pattern}: the multi-token prediction depths after / must "
            "be alike and hold no | (they run on the last pipeline stage)",
        )
        depths = len(parts) if depth else 0
        given = self.mtp_num_layers
        _require(
            depths or not given,
            f"--mtp-num-layers {given} in a hybrid model: write each depth's layers after / in "
            f"--hybrid-layer-pattern ({pattern}/*E/..., one pattern a depth) or drop it",
        )
        self.mtp_num_layers = depths or None
        if given in (None, depths):
            return []
        return [
            f"--mtp-num-layers {given} and the {depths} depths of --hybrid-layer-pattern "
            f"{pattern}: the pattern's {depths} are taken, as Megatron-LM does"
        ]

    def _check_mamba_sizes(self) -> None:
        for name in _SIZES:
            value = getattr(self, name)
            _require(value is None or value > 0, f"--{name.replace('_', '-')} must be positive")
        heads, groups = self.mamba_heads(), self.mamba_num_groups
        _require(
            heads > 0,
            f"--hidden-size {self.hidden_size} makes no Mamba head of --mamba-head-dim "
            f"{self.mamba_head_dim}; set --mamba-num-heads",
        )
        _require(
            heads % groups == 0,
            f"--mamba-num-groups {groups} must divide the {heads} Mamba heads: each group's B "
            "and C serve its heads",
        )
