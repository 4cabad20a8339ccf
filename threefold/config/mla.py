"""Multi-latent attention fields of the model (Megatron-LM's --multi-latent-attention and its
MLA flags; DeepSeek-V2/V3, Kimi K2).

Queries and keys/values come from low-rank latents of the hidden state: the key/value latent
(--kv-lora-rank) is up-projected to each head's key (--qk-head-dim) and value
(--v-head-dim), the query from its own latent (--q-lora-rank) or straight from the hidden
state. RoPE turns a further --qk-pos-emb-head-dim dimensions per head: the query's own, and a
key part shared by all heads, projected from the hidden state beside the key/value latent.

MLA brings its own RoPE, YaRN by default (megatron-core's MLATransformerConfig: original
context 4096, beta fast 32 and slow 1, none of which Megatron-LM's command line sets), scaled
by --rotary-scaling-factor with the attention temperature of --mscale and --mscale-all-dim.

`ModelConfig` inherits the fields; `finalize_mla` is called from the model's own finalize.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg, given_flags

GROUP = "multi-latent attention"
# megatron-core's MLATransformerConfig defaults, which Megatron-LM's command line leaves alone
YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS = 4096
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0
# The fields that mean something only with --multi-latent-attention (--rope-type rope is also
# other attention's).
_MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
# YaRN's, shared with --position-embedding-type yarn (config/model.py)
_YARN = ("rotary_scaling_factor", "mscale", "mscale_all_dim")


def yarn_mscale(scaling_factor: float, mscale: float) -> float:
    """YaRN's attention temperature for a context `scaling_factor` times the original."""
    return 1.0 if scaling_factor <= 1 else 0.1 * mscale * math.log(scaling_factor) + 1.0


@dataclass
class MLAConfig:
    multi_latent_attention: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="multi-latent attention (DeepSeek-V2/V3): keys, values and queries from "
        "low-rank latents of the hidden state",
    )
    q_lora_rank: int | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="rank of the query latent (default: queries straight from the hidden state)",
    )
    kv_lora_rank: int = arg(
        32, checkpoint=ARCHITECTURE, group=GROUP, help="rank of the key/value latent"
    )
    qk_head_dim: int = arg(
        128,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="each head's query and key dimensions RoPE leaves alone",
    )
    qk_pos_emb_head_dim: int = arg(
        64,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="each head's query and key dimensions RoPE turns (the key's shared by all heads)",
    )
    v_head_dim: int = arg(128, checkpoint=ARCHITECTURE, group=GROUP, help="each head's value size")
    rope_type: str | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        choices=("rope", "yarn"),
        help="multi-latent attention's RoPE: yarn (its default) or rope; other attention "
        "takes rope only",
    )
    rotary_scaling_factor: float = arg(
        1.0,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="YaRN's context extension over the original context (DeepSeek-V3: 40), with "
        "--multi-latent-attention or --position-embedding-type yarn",
    )
    mscale: float = arg(
        1.0, checkpoint=ARCHITECTURE, group=GROUP, help="YaRN's mscale (the RoPE tables' scale)"
    )
    mscale_all_dim: float = arg(
        0.0,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="YaRN's mscale_all_dim (the attention temperature)",
    )

    @property
    def q_head_dim(self) -> int:
        """An MLA head's query and key size: the part RoPE leaves and the part it turns."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def mla_yarn(self) -> bool:
        return self.rope_type in (None, "yarn")

    @property
    def mla_softmax_scale(self) -> float:
        """megatron-core's MLA softmax scale: YaRN's temperature squared over sqrt(q head dim),
        whichever RoPE it uses."""
        temperature = yarn_mscale(self.rotary_scaling_factor, self.mscale_all_dim)
        return temperature * temperature / math.sqrt(self.q_head_dim)

    def finalize_mla(self) -> None:
        if not self.multi_latent_attention:
            given = given_flags(self, MLAConfig, _MLA_ONLY)
            _require(
                not given,
                f"{' '.join(given)}: multi-latent attention settings of a model without it; "
                "add --multi-latent-attention or drop them",
            )
            given = given_flags(self, MLAConfig, _YARN)
            _require(
                not given or self.position_embedding_type == "yarn",
                f"{' '.join(given)}: YaRN settings of a model without YaRN; add "
                "--position-embedding-type yarn (or --multi-latent-attention) or drop them",
            )
            _require(
                self.rope_type in (None, "rope"),
                "--rope-type yarn belongs to --multi-latent-attention; other attention takes "
                "rope (--position-embedding-type rope)",
            )
            return
        _require(
            not self.group_query_attention,
            "--group-query-attention and --multi-latent-attention exclude each other (every "
            "MLA head has its own key and value); drop one",
        )
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            _require(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive")
        _require(self.q_lora_rank is None or self.q_lora_rank > 0, "--q-lora-rank must be positive")
        _require(
            self.qk_pos_emb_head_dim % 2 == 0,
            f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim}: RoPE turns pairs of dimensions; "
            "make it even",
        )
        _require(self.rotary_scaling_factor > 0, "--rotary-scaling-factor must be positive")
        yarn = [
            f"--{name.replace('_', '-')}"
            for name in (
                "yarn_original_max_position_embeddings",
                "yarn_beta_fast",
                "yarn_beta_slow",
            )
            if getattr(self, name) is not None
        ]
        _require(
            not yarn,
            f"{' '.join(yarn)} with --multi-latent-attention: MLA's YaRN keeps megatron-core's "
            "original context 4096 and betas 32/1 (Megatron-LM's flags set other attention's); "
            "drop them",
        )
        for name, given in (
            ("--rotary-interleaved", self.rotary_interleaved),
            ("--rotary-percent", self.rotary_percent != 1.0),
            ("--use-rope-scaling", self.use_rope_scaling),
            ("--add-qkv-bias", self.add_qkv_bias),
        ):
            _require(
                not given,
                f"{name} with --multi-latent-attention: MLA's RoPE turns all "
                "--qk-pos-emb-head-dim dimensions with its own scaling and its projections have "
                f"no biases; drop {name}",
            )
