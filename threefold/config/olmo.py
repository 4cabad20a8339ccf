"""OLMo 2's layers (transformers' Olmo2ForCausalLM; checkpoint/hf/olmo2.py sets them), beside
--post-sublayer-norm (config/gemma.py) and --qk-layernorm:

    --no-sublayer-input-norms  no norm before the attention and the MLP: with
                               --post-sublayer-norm, OLMo 2's norms after them only
    --qk-layernorm-across-heads  the query (key) norm over all heads' dimensions together, as
                               one RMSNorm of width heads x head size (OLMo 2's q_norm, k_norm);
                               under TP each rank holds its heads' share of its weight, and
                               the mean of the squares is summed over the TP group

Megatron-LM builds neither (a Megatron export is refused).

`ModelConfig` inherits the fields; `finalize_olmo` is called from its finalize.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg

GROUP = "OLMo 2's layers"


@dataclass
class OlmoConfig:
    sublayer_input_norms: bool = arg(
        True,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        flag="--no-sublayer-input-norms",
        help="no norm before the attention and the MLP (with --post-sublayer-norm: OLMo 2's "
        "norms after them only)",
    )
    qk_layernorm_across_heads: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="--qk-layernorm over all heads' dimensions together (OLMo 2's)",
    )

    def finalize_olmo(self) -> None:
        _require(
            self.sublayer_input_norms or self.post_sublayer_norm,
            "--no-sublayer-input-norms leaves the layers without norms: add --post-sublayer-norm",
        )
        _require(
            not self.qk_layernorm_across_heads
            or (self.qk_layernorm and self.normalization == "RMSNorm"),
            "--qk-layernorm-across-heads shapes --qk-layernorm's RMSNorm: add --qk-layernorm "
            "and --normalization RMSNorm",
        )
        _require(
            not self.qk_layernorm_across_heads
            or not (self.multi_latent_attention or self.apply_layernorm_1p),
            "--qk-layernorm-across-heads with multi-latent attention or --apply-layernorm-1p: "
            "not built; drop one",
        )
