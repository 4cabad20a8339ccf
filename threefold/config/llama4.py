"""Llama 4's attention: layers without RoPE (Megatron-LM's --no-rope-freq, Llama 4's
interleaved "NoPE" layers) and queries and keys scaled to unit RMS per head without a weight
(megatron-core's `qk_l2_norm`, which Megatron-LM sets from --export-qk-l2-norm).

--no-rope-freq N skips RoPE in every N-th layer (layers N, 2N, ...: megatron-core's
[0]*(N-1)+[1] pattern repeated); a pattern such as ([0]*3+[1]*1)*3 gives 1 (no RoPE) or 0 per
layer, read by `parse_layer_pattern`, never evaluated (Megatron-LM evaluates it as Python).
Such a layer attends by content alone; the others rotate as usual.

transformers' Llama 4 (Llama4ForCausalLM: the Hub's Scout and Maverick) differs from
megatron-core's in three places, each an option here (checkpoint/hf/llama4.py sets them):
--qk-l2-norm-rope-layers-only normalizes queries and keys in the layers with RoPE only;
--attention-chunk-size C has the layers with RoPE attend within chunks of C tokens (a query
at position p sees the keys from C * (p // C) to p); --attn-temperature-tuning scales the
queries of the layers without RoPE by 1 + scale * log(1 + floor((p + 1) / floor_scale)) at
position p of the sequence (--attn-temperature-scale, --attn-temperature-floor-scale). The
last two change nothing below C and floor_scale - 1 positions (Llama 4: 8192).

`ModelConfig` inherits the fields; `finalize_llama4` is called from its finalize.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg, given_flags
from threefold.config.moe import every_nth_layer, parse_layer_pattern

GROUP = "Llama 4 attention"


@dataclass
class Llama4Config:
    no_rope_freq: str | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="N: every N-th layer without RoPE (Llama 4: 4); or a pattern such as "
        "([0]*3+[1]*1)*3 with 1 for a layer without RoPE",
    )
    qk_l2_norm: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        aliases=("--export-qk-l2-norm",),
        help="scale each query and key head to unit RMS, without a weight (Llama 4's L2 norm; "
        "Megatron-LM's --export-qk-l2-norm)",
    )

    qk_l2_norm_rope_layers_only: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="--qk-l2-norm in the layers with RoPE only (transformers' Llama 4)",
    )
    attention_chunk_size: int | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        minimum=1,
        help="the layers with RoPE attend within chunks of this many tokens (transformers' "
        "Llama 4: 8192)",
    )
    attn_temperature_tuning: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="scale the queries of the layers without RoPE up with their position "
        "(transformers' Llama 4)",
    )
    attn_temperature_floor_scale: int = arg(
        8192,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        minimum=1,
        help="--attn-temperature-tuning: positions per step of the scale",
    )
    attn_temperature_scale: float = arg(
        0.1,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="--attn-temperature-tuning: the scale's growth per log step",
    )

    def no_rope_pattern(self, num_layers: int) -> list[int]:
        """1 for each layer without RoPE."""
        freq = self.no_rope_freq
        if freq is None:
            return [0] * num_layers
        if freq.strip().isdigit():
            return every_nth_layer(int(freq), num_layers, "--no-rope-freq")
        return parse_layer_pattern(freq, num_layers, "--no-rope-freq")

    def finalize_llama4(self) -> list[str]:
        """Validate; returns warnings to print."""
        self._check_transformers_llama4()
        freq = self.no_rope_freq
        if freq is not None:
            _require(
                self.rotary_position_embeddings,
                "--no-rope-freq picks layers that skip RoPE: it needs --position-embedding-type "
                "rope or yarn",
            )
            _require(
                not self.multi_latent_attention,
                "--no-rope-freq with --multi-latent-attention: megatron-core's MLA rotates in "
                "every layer (it ignores the flag); drop it",
            )
            _require(
                not self.mtp_num_layers,
                "--no-rope-freq with --mtp-num-layers: the pattern covers the decoder's layers "
                "and megatron-core's prediction layers are numbered past them; drop one",
            )
            if freq.strip().isdigit():
                every = int(freq)
                _require(
                    every >= 1 and self.num_layers % every == 0,
                    f"--no-rope-freq {freq} must divide --num-layers {self.num_layers} (as in "
                    "megatron-core)",
                )
            self.no_rope_freq = freq.replace(" ", "")
            self.no_rope_pattern(self.num_layers)  # (a malformed pattern: one line now)
        if not self.qk_l2_norm:
            return []
        _require(
            not self.multi_latent_attention,
            "--qk-l2-norm with --multi-latent-attention is not supported (as in megatron-core); "
            "drop one",
        )
        if not self.qk_layernorm:
            return []
        # Megatron-LM's Llama 4 Scout configuration passes both: its spec takes the L2 norm.
        self.qk_layernorm = False
        return [
            "--qk-layernorm has no effect with --qk-l2-norm: queries and keys are normalized by "
            "the L2 norm alone, without a weight (as in megatron-core)"
        ]

    def _check_transformers_llama4(self) -> None:
        """transformers' Llama 4 options: each needs the layers it acts in."""
        _require(
            not self.qk_l2_norm_rope_layers_only or (self.qk_l2_norm and self.no_rope_freq),
            "--qk-l2-norm-rope-layers-only narrows --qk-l2-norm to the layers --no-rope-freq "
            "leaves with RoPE: add both or drop it",
        )
        _require(
            not self.attn_temperature_tuning or self.no_rope_freq,
            "--attn-temperature-tuning scales the queries of the layers without RoPE: add "
            "--no-rope-freq or drop it",
        )
        given = given_flags(
            self, Llama4Config, ("attn_temperature_floor_scale", "attn_temperature_scale")
        )
        _require(
            self.attn_temperature_tuning or not given,
            f"{' '.join(given)} belong to --attn-temperature-tuning: add it or drop them",
        )
        if self.attention_chunk_size is None:
            return
        _require(
            self.rotary_position_embeddings and not self.multi_latent_attention,
            "--attention-chunk-size chunks the attention of the layers with RoPE: it needs "
            "--position-embedding-type rope, without --multi-latent-attention",
        )
        _require(
            self.window_size is None,
            "--attention-chunk-size with --window-size: one mask of the two; drop one",
        )
