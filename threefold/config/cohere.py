"""Cohere's layers (transformers' CohereForCausalLM: Command R, Aya 23 and Aya Expanse;
checkpoint/hf/cohere.py sets them), beside --parallel-attention-mlp and --rotary-interleaved:

    --parallel-attention-mlp-shared-norm  with --parallel-attention-mlp, the attention and the
                               MLP read one norm's output (Cohere's layer, as GPT-J's and
                               Falcon-7B's; GPT-NeoX's has a norm for each)
    --no-layernorm-bias        every LayerNorm a weight without a bias (Cohere's)
    --logit-scale S            the logits multiplied by S (Command R: 0.0625)
    --qk-layernorm-per-head    --qk-layernorm with a weight of its own for each query and
                               key head (Command R+'s use_qk_norm); under TP each rank holds
                               its heads' weights

Megatron-LM builds none of them (a Megatron export is refused).

`ModelConfig` inherits the fields; `finalize_cohere` is called from its finalize.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg

GROUP = "Cohere's layers"


@dataclass
class CohereConfig:
    parallel_attention_mlp_shared_norm: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="with --parallel-attention-mlp, the attention and the MLP read one norm's output "
        "(Cohere's layer; GPT-NeoX's has a norm for each)",
    )
    layernorm_bias: bool = arg(
        True,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        flag="--no-layernorm-bias",
        help="every LayerNorm a weight without a bias (Cohere's)",
    )
    logit_scale: float = arg(
        1.0,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="the output logits multiplied by this (Command R: 0.0625)",
    )

    qk_layernorm_per_head: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="--qk-layernorm with a weight of its own for each query and key head (Command R+'s)",
    )

    def finalize_cohere(self) -> None:
        _require(
            not self.qk_layernorm_per_head
            or (self.qk_layernorm and not self.qk_layernorm_across_heads),
            "--qk-layernorm-per-head shapes --qk-layernorm's weights: add --qk-layernorm (and "
            "drop --qk-layernorm-across-heads)",
        )
        _require(
            not self.qk_layernorm_per_head
            or not (self.multi_latent_attention or self.apply_layernorm_1p),
            "--qk-layernorm-per-head with multi-latent attention or --apply-layernorm-1p: not "
            "built; drop one",
        )
        _require(self.logit_scale > 0, f"--logit-scale {self.logit_scale} must be positive")
        _require(
            self.layernorm_bias or self.normalization == "LayerNorm",
            "--no-layernorm-bias drops LayerNorm's bias; RMSNorm has none: drop the flag or "
            "use --normalization LayerNorm",
        )
        if not self.parallel_attention_mlp_shared_norm:
            return
        _require(
            self.parallel_attention_mlp and self.sublayer_input_norms,
            "--parallel-attention-mlp-shared-norm shares the attention's input norm with the "
            "MLP: add --parallel-attention-mlp (and keep the input norms)",
        )
        _require(
            not self.recomputes("layernorm"),
            "--recompute-modules layernorm frees the attention's norm output, which the MLP "
            "reads too with --parallel-attention-mlp-shared-norm: drop layernorm from it",
        )
        _require(
            not self.offloads("mlp_norm"),
            "--offload-modules mlp_norm offloads the MLP's norm, and with "
            "--parallel-attention-mlp-shared-norm the MLP has none: drop mlp_norm from it",
        )
