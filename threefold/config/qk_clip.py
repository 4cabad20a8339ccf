"""QK-clip (Megatron-LM's --qk-clip: Kimi K2's MuonClip) and the largest attention logit.

After each optimizer step, an attention layer whose largest pre-softmax score of the step
(scaled q . k over every micro-batch, data-parallel replica and allowed key: the maximum a
head reached) exceeds --qk-clip-threshold has its query and key weights scaled down, a head's
(a query group's, with grouped-query attention: its key is shared) by eta = threshold / max:
the queries by eta^alpha, the keys by eta^(1 - alpha), so that its scores shrink by eta
(model/qk_clip.py). With multi-latent attention each head's own part of the queries scales by
eta^alpha and its rotary part by eta, the keys' per-head part by eta^(1 - alpha) (the shared
rotary key is left). --log-max-attention-logit writes the largest score to TensorBoard
(`max_attention_logit`), as Megatron-LM does; --qk-clip implies it.

`ModelConfig` inherits the fields; `finalize_qk_clip` is called from its finalize and
`check_qk_clip_layout` from the run config's, where the layout is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from threefold.config.errors import require as _require
from threefold.config.fields import arg

if TYPE_CHECKING:
    from threefold.config.run import Config

GROUP = "QK-clip"


@dataclass
class QKClipConfig:
    qk_clip: bool = arg(
        False,
        group=GROUP,
        help="after each step, scale down the query and key weights of attention heads whose "
        "largest score exceeded --qk-clip-threshold (MuonClip)",
    )
    qk_clip_alpha: float = arg(
        0.5, group=GROUP, help="the share of the rescaling the queries take, in (0, 1)"
    )
    qk_clip_threshold: float = arg(
        100.0, group=GROUP, help="the attention score above which a head is scaled down"
    )
    log_max_attention_logit: bool = arg(
        False,
        group=GROUP,
        help="write the largest attention score of each step to TensorBoard (max_attention_logit)",
    )

    def observes_attention_logits(self) -> bool:
        return self.qk_clip or self.log_max_attention_logit

    def finalize_qk_clip(self) -> None:
        if not self.qk_clip:
            return
        _require(
            0.0 < self.qk_clip_alpha < 1.0,
            f"--qk-clip-alpha {self.qk_clip_alpha} must be between 0 and 1 (exclusive)",
        )
        _require(
            self.qk_clip_threshold > 0,
            f"--qk-clip-threshold {self.qk_clip_threshold} must be greater than 0",
        )
        _require(
            not (self.qk_layernorm and not self.multi_latent_attention) and not self.qk_l2_norm,
            "--qk-clip with --qk-layernorm or --qk-l2-norm: the norm of the queries and keys "
            "undoes the rescaling of their weights; drop one of them",
        )
        _require(
            self.lora_rank is None,
            "--qk-clip with --lora-rank: the query and key weights it rescales are frozen; "
            "drop one of them",
        )


def check_qk_clip_layout(config: Config) -> None:
    """Where the largest score is not computed (DeepSeek's sparse attention: a query reads
    only the keys its indexer picks) or the weights not rescaled (kept in FP8)."""
    model = config.model
    if not model.observes_attention_logits():
        return
    flag = "--qk-clip" if model.qk_clip else "--log-max-attention-logit"
    _require(
        not model.sparse_attention,
        f"{flag} with --experimental-attention-variant dsa is not built (a query reads only "
        "the keys its indexer picks)",
    )
    _require(
        not (model.qk_clip and config.fp8.fp8_param_gather),
        "--qk-clip with --fp8-param-gather is not built (the weights it rescales are kept in "
        "FP8); drop --fp8-param-gather",
    )
