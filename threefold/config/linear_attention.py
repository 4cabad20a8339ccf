"""Linear-attention fields of the model: Gated DeltaNet layers among the attention layers
(Megatron-LM's --experimental-attention-variant gated_delta_net and its --linear-* flags;
Qwen3-Next's hybrid), and the sigmoid gate on standard attention's output that comes with it
(--attention-output-gate).

--linear-attention-freq picks the layers: N makes N-1 of every N layers gated delta net and
every N-th standard attention (megatron-core's `get_linear_attention_pattern`), a pattern
gives one 1 (linear) or 0 (standard) per layer. A gated delta net layer has its own heads
(--linear-num-key-heads query/key heads of --linear-key-head-dim, --linear-num-value-heads
value heads of --linear-value-head-dim; each query/key head serves a group of value heads, as
in grouped query attention) and a causal convolution of --linear-conv-kernel-dim tokens over
its queries, keys and values (model/gated_delta_net.py).

`ModelConfig` inherits the fields; `finalize_linear_attention` is called from its finalize.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg, given_flags
from threefold.config.moe import parse_layer_pattern

GROUP = "linear attention"
# Megatron-LM's spelling, and the one megatron-core now prefers
GATED_DELTA_NET = ("gated_delta_net", "gdn")
# The tokens the gated delta rule solves at once (kernels/gated_delta_rule.py; megatron-core's
# and FLA's); here so the torch-free planning tools' estimate reads it too.
RULE_CHUNK_SIZE = 64
_SIZES = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


@dataclass
class LinearAttentionConfig:
    experimental_attention_variant: str | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        choices=(*GATED_DELTA_NET, "dsa"),
        help="gated_delta_net (or gdn): Gated DeltaNet linear attention in the layers "
        "--linear-attention-freq picks; dsa: DeepSeek sparse attention (config/dsa.py)",
    )
    linear_attention_freq: str | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="N: N-1 of every N layers linear attention, the N-th standard attention; or a "
        "pattern like ([1]*3+[0]*1) with 1 for linear, 0 for standard attention",
    )
    linear_conv_kernel_dim: int = arg(
        4, checkpoint=ARCHITECTURE, group=GROUP, help="tokens the causal convolution spans"
    )
    linear_key_head_dim: int = arg(
        128, checkpoint=ARCHITECTURE, group=GROUP, help="size of a query/key head"
    )
    linear_value_head_dim: int = arg(
        128, checkpoint=ARCHITECTURE, group=GROUP, help="size of a value (and output gate) head"
    )
    linear_num_key_heads: int = arg(
        16, checkpoint=ARCHITECTURE, group=GROUP, help="query/key heads"
    )
    linear_num_value_heads: int = arg(
        32,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="value heads, a multiple of the query/key heads",
    )
    attention_output_gate: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="standard attention's output times a sigmoid gate per head dimension, projected "
        "with the queries (Qwen3-Next's gated attention)",
    )

    @property
    def gated_delta_net(self) -> bool:
        return self.experimental_attention_variant in GATED_DELTA_NET

    def gated_delta_net_sections(self) -> tuple[int, ...]:
        """The row sizes of a gated delta net's in_proj over all heads, [q; k; v; z; beta;
        alpha] (megatron-core's sections; its convolution's rows are the first three)."""
        qk = self.linear_num_key_heads * self.linear_key_head_dim
        v, heads = (
            self.linear_num_value_heads * self.linear_value_head_dim,
            self.linear_num_value_heads,
        )
        return (qk, qk, v, v, heads, heads)

    def linear_attention_pattern(self, num_layers: int) -> list[int]:
        """1 for each layer whose attention is a gated delta net."""
        if not self.gated_delta_net:
            return [0] * num_layers
        text = self.linear_attention_freq.strip()
        if text.isdigit():
            every = int(text)
            _require(every >= 1, "--linear-attention-freq must be >= 1")
            return [int((i + 1) % every != 0) for i in range(num_layers)]
        return parse_layer_pattern(text, num_layers, "--linear-attention-freq")

    def finalize_linear_attention(self) -> None:
        if not self.gated_delta_net:
            given = given_flags(self, LinearAttentionConfig, ("linear_attention_freq", *_SIZES))
            _require(
                not given,
                f"{' '.join(given)}: gated delta net settings without "
                "--experimental-attention-variant gated_delta_net; add it or drop them",
            )
        else:
            _require(
                self.linear_attention_freq is not None or self.hybrid,  # (or a pattern's G)
                "--experimental-attention-variant gated_delta_net needs --linear-attention-freq "
                "(N, or a pattern of 1 for linear and 0 for standard attention per layer)",
            )
            for name in _SIZES:
                _require(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive")
            keys, values = self.linear_num_key_heads, self.linear_num_value_heads
            _require(
                values % keys == 0,
                f"--linear-num-value-heads {values} is not a multiple of --linear-num-key-heads "
                f"{keys}; each query/key head serves a group of value heads",
            )
            _require(
                self.swiglu,
                "--experimental-attention-variant gated_delta_net takes SiLU in its convolution "
                "and output gate, which megatron-core derives from --swiglu; add --swiglu",
            )
            self.linear_attention_pattern(self.num_layers)  # a pattern of the wrong length
            # A depth is the last layer's kind (megatron-core's spec: its last layer spec); a
            # hybrid pattern's depths say theirs.
            _require(
                not self.mtp_num_layers
                or self.hybrid
                or not self.linear_attention_pattern(self.num_layers)[-1],
                "--mtp-num-layers with a gated delta net as the last layer: megatron-core's "
                "depths would be gated delta nets, which threefold does not build; end the "
                "--linear-attention-freq pattern on standard attention (as Qwen3-Next's) or "
                "drop --mtp-num-layers",
            )
        _require(
            not (self.attention_output_gate and self.multi_latent_attention),
            "--attention-output-gate with --multi-latent-attention: megatron-core gates "
            "standard attention only; drop one",
        )
