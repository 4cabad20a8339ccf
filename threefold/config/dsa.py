"""DeepSeek sparse attention fields of the model (Megatron-LM's --experimental-attention-variant
dsa and its --dsa-indexer-* flags; DeepSeek-V3.2).

Multi-latent attention in which each query attends only to the --dsa-indexer-topk earlier keys
a small "lightning indexer" scores highest: --dsa-indexer-n-heads heads of
--dsa-indexer-head-dim, scoring with ReLU(q k) weighted per head (model/dsa.py). RoPE turns the
first --qk-pos-emb-head-dim dimensions of an indexer head as halves, as DeepSeek's model and
Megatron-LM since megatron-core 0.16 do (0.16 turned the last ones, MLA's way; MLA's
interleaving of the first ones with --dsa-indexer-rope-interleaved). The indexer reads detached
activations, so the language-model loss never reaches it; it learns from a KL-divergence loss
toward the main attention's distribution, scaled by --dsa-indexer-loss-coeff (over the top-k
keys only with --dsa-indexer-use-sparse-loss), added to the gradient and logged apart as
Megatron's `indexer loss`.

Megatron-LM's other --dsa-* options (top-k shared over layers, fused kernels, indexer variants
without the Hadamard rotation or the ReLU, an fp32 key norm) are refused by name
(megatron_compat.py).

`ModelConfig` inherits the fields; `finalize_dsa` is called from its finalize.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, MODEL, arg, given_flags

GROUP = "DeepSeek sparse attention"
DSA = "dsa"
_SIZES = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")


@dataclass
class DSAConfig:
    dsa_indexer_n_heads: int | None = arg(
        None, minimum=1, checkpoint=ARCHITECTURE, group=GROUP, help="the indexer's heads"
    )
    dsa_indexer_head_dim: int | None = arg(
        None,
        minimum=1,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="the size of an indexer head (a power of 2: its queries and keys are turned by a "
        "Hadamard transform), its last --qk-pos-emb-head-dim dimensions rotated by RoPE",
    )
    dsa_indexer_topk: int | None = arg(
        None,
        minimum=1,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="the keys each query attends to: those the indexer scores highest",
    )
    dsa_indexer_loss_coeff: float | None = arg(
        None,
        minimum=0,
        checkpoint=MODEL,
        group=GROUP,
        help="weight of the indexer's KL-divergence loss toward the attention's distribution "
        "(none or 0: the indexer does not learn)",
    )
    dsa_indexer_rope_interleaved: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="RoPE on the indexer's first --qk-pos-emb-head-dim dimensions as MLA's (the even "
        "ones, then the odd ones) instead of as halves (DeepSeek-V3.2's)",
    )
    dsa_indexer_k_norm_epsilon: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="epsilon of the indexer's key LayerNorm (default: --norm-epsilon; DeepSeek-V3.2's "
        "is 1e-6)",
    )
    dsa_indexer_use_sparse_loss: bool = arg(
        False,
        checkpoint=MODEL,
        group=GROUP,
        help="the indexer's loss over each query's top-k keys only",
    )

    @property
    def sparse_attention(self) -> bool:
        return self.experimental_attention_variant == DSA

    def finalize_dsa(self) -> None:
        if not self.sparse_attention:
            given = given_flags(self, DSAConfig, tuple(DSAConfig.__dataclass_fields__))
            _require(
                not given,
                f"{' '.join(given)}: DeepSeek sparse attention settings without "
                "--experimental-attention-variant dsa; add it or drop them",
            )
            return
        _require(
            self.multi_latent_attention,
            "--experimental-attention-variant dsa is sparse multi-latent attention (its indexer "
            "reads the query latent); add --multi-latent-attention and its sizes",
        )
        missing = [f"--{name.replace('_', '-')}" for name in _SIZES if getattr(self, name) is None]
        _require(
            not missing,
            f"--experimental-attention-variant dsa needs {' '.join(missing)} (DeepSeek-V3.2: "
            "64 heads of 128, top 2048)",
        )
        head_dim = self.dsa_indexer_head_dim
        _require(
            head_dim & (head_dim - 1) == 0,
            f"--dsa-indexer-head-dim {head_dim}: the indexer's Hadamard transform takes a power "
            "of 2; use one (DeepSeek-V3.2: 128)",
        )
        _require(
            head_dim > self.qk_pos_emb_head_dim,
            f"--dsa-indexer-head-dim {head_dim} must exceed --qk-pos-emb-head-dim "
            f"{self.qk_pos_emb_head_dim}, the dimensions of it RoPE turns",
        )
        for flag, given in (
            ("--window-size", self.window_size is not None),
            ("--softmax-type", self.softmax_type != "vanilla"),
            ("--mtp-num-layers", bool(self.mtp_num_layers)),
        ):
            _require(
                not given,
                f"{flag} with --experimental-attention-variant dsa: megatron-core's sparse "
                f"attention is causal over its top-k keys alone; drop {flag}",
            )
