"""Gemma's layers (transformers' Gemma 2 and 3; checkpoint/hf/gemma.py sets them), beside
what threefold has already (--apply-layernorm-1p's norms scaling by 1 + weight, --qk-layernorm,
--window-size with --window-attn-skip-freq):

    --embedding-multiplier X   the word embeddings scaled by X (Gemma: sqrt(--hidden-size))
    --post-sublayer-norm       a norm on the attention's output and on the MLP's before each
                               residual add (Gemma 2/3's post_attention_layernorm and
                               post_feedforward_layernorm), beside the norms before them
    --geglu                    the MLP gated by GELU, gelu(gate) * up (with --openai-gelu its
                               tanh approximation: Gemma's gelu_pytorch_tanh)
    --softmax-scale S          the attention scores scaled by S, not 1/sqrt(--kv-channels)
                               (Gemma 3: query_pre_attn_scalar^-1/2)
    --window-rotary-base B     the layers with a window rotate by RoPE base B, unscaled (Gemma
                               3's local layers: 10000), the others by --rotary-base
    --attn-logit-softcapping C the attention scores capped softly: C tanh(score / C), before
                               the softmax (Gemma 2: 50; eager blocks, any CP layout)
    --final-logit-softcapping C  the logits capped softly likewise (Gemma 2: 30)

Megatron-LM builds none of them (a Megatron export is refused).

`ModelConfig` inherits the fields; `finalize_gemma` is called from its finalize.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg

GROUP = "Gemma's layers"


@dataclass
class GemmaConfig:
    embedding_multiplier: float = arg(
        1.0,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="the word embeddings scaled by this (Gemma: the square root of --hidden-size)",
    )
    post_sublayer_norm: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="a norm on the attention's and the MLP's output before each residual add "
        "(Gemma 2 and 3)",
    )
    geglu: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="the MLP gated by GELU: gelu(gate) * up (with --openai-gelu its tanh "
        "approximation, Gemma's)",
    )
    softmax_scale: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="the attention scores' scale (default 1/sqrt(--kv-channels); Gemma 3: "
        "query_pre_attn_scalar^-1/2)",
    )
    window_rotary_base: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        minimum=1,
        help="the RoPE base of the layers with --window-size's window, without RoPE scaling "
        "or YaRN (Gemma 3's local layers: 10000; OLMo 3's, beside YaRN in the others)",
    )

    attn_logit_softcapping: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="cap the attention scores softly at this, cap * tanh(score / cap) (Gemma 2: 50); "
        "attention by eager blocks, recomputed in backward",
    )
    final_logit_softcapping: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="cap the output logits softly at this (Gemma 2: 30)",
    )

    def finalize_gemma(self) -> None:
        _require(
            self.embedding_multiplier > 0,
            f"--embedding-multiplier {self.embedding_multiplier} must be positive",
        )
        _require(
            self.softmax_scale is None or self.softmax_scale > 0,
            f"--softmax-scale {self.softmax_scale} must be positive",
        )
        _require(
            not self.geglu or not (self.swiglu or self.quick_geglu or self.squared_relu),
            "--geglu is the MLP's activation: drop --swiglu, --quick-geglu and --squared-relu",
        )
        for flag, cap in (
            ("--attn-logit-softcapping", self.attn_logit_softcapping),
            ("--final-logit-softcapping", self.final_logit_softcapping),
        ):
            _require(cap is None or cap > 0, f"{flag} {cap} must be positive")
        _require(
            not self.attn_logit_softcapping
            or not (self.multi_latent_attention or self.softmax_type != "vanilla"),
            "--attn-logit-softcapping with multi-latent attention or --softmax-type: not built; "
            "drop one",
        )
        _require(
            not (self.softmax_scale and self.multi_latent_attention),
            "--softmax-scale with --multi-latent-attention, whose scale is YaRN's: drop it",
        )
        if self.window_rotary_base is None:
            return
        _require(
            self.window_size is not None and self.position_embedding_type in ("rope", "yarn"),
            "--window-rotary-base is the RoPE base of the layers with a window: it needs "
            "--window-size and --position-embedding-type rope (or yarn, for the other layers)",
        )
        _require(
            not (self.multi_latent_attention or self.gated_delta_net or self.mtp_num_layers),
            "--window-rotary-base with multi-latent attention, gated delta nets or "
            "--mtp-num-layers: not built; drop one",
        )
