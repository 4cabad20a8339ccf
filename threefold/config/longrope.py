"""LongRoPE (--position-embedding-type longrope): RoPE whose every frequency is divided by a
factor of its own, and whose tables are scaled by an attention factor (Phi-3's 128k-context
models, Phi-3.5 and Phi-4 mini; transformers' `longrope` rope type; model/rope.py):

    --longrope-short-factor F ...   one factor per rotated pair (--rotary-percent of the head
                                    over 2), used at sequences up to the original context
    --longrope-long-factor F ...    the same, used beyond it
    --longrope-original-max-position-embeddings N   the original context
    --longrope-attention-factor A   the tables' scale; default transformers' sqrt(1 +
                                    ln(s) / ln(N)) for s = --max-position-embeddings / N

transformers picks the factors in each forward by its longest position; a threefold run picks
them once, by --seq-length, so every rank, micro-batch and packing of documents turns by the
same table. A model converted at its original context (--seq-length up to N) reads the short
factors, as transformers does for every input that long.

Megatron-LM builds no LongRoPE (a Megatron export is refused). `ModelConfig` inherits the
fields; `finalize_longrope` is called from its finalize, after --max-position-embeddings is
set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg, given_flags

GROUP = "LongRoPE (--position-embedding-type longrope)"
FIELDS = (
    "longrope_short_factor",
    "longrope_long_factor",
    "longrope_original_max_position_embeddings",
    "longrope_attention_factor",
)


def _factors(where: str):
    return arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        nargs="+",
        metavar="F",
        help=f"one divisor per rotated pair of dimensions, at {where}",
    )


@dataclass
class LongRopeConfig:
    longrope_short_factor: list[float] | None = _factors("sequences up to the original context")
    longrope_long_factor: list[float] | None = _factors("longer sequences")
    longrope_original_max_position_embeddings: int | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        minimum=2,
        metavar="N",
        help="the context the model was pretrained at (the short factors' reach)",
    )
    longrope_attention_factor: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        minimum=0,
        metavar="A",
        help="the RoPE tables' scale (default: sqrt(1 + ln(s) / ln(original)), s the ratio of "
        "--max-position-embeddings to the original context)",
    )

    def finalize_longrope(self) -> None:
        if self.position_embedding_type != "longrope":
            given = given_flags(self, LongRopeConfig, FIELDS)
            _require(
                not given,
                f"{' '.join(given)} belong to --position-embedding-type longrope; add it or "
                "drop them",
            )
            return
        _require(
            self.longrope_short_factor is not None
            and self.longrope_long_factor is not None
            and self.longrope_original_max_position_embeddings is not None,
            "--position-embedding-type longrope takes --longrope-short-factor, "
            "--longrope-long-factor and --longrope-original-max-position-embeddings",
        )
        _require(
            not self.multi_latent_attention,
            "--position-embedding-type longrope with multi-latent attention, whose RoPE is its "
            "own (--rope-type); drop one",
        )
        pairs = self.rotary_dim // 2
        for name in ("short", "long"):
            factors = getattr(self, f"longrope_{name}_factor")
            _require(
                len(factors) == pairs and all(f > 0 for f in factors),
                f"--longrope-{name}-factor holds {len(factors)} factors; RoPE turns {pairs} "
                "pairs of dimensions here (--kv-channels x --rotary-percent / 2), each takes "
                "one above 0",
            )
        if self.longrope_attention_factor is None:
            original = self.longrope_original_max_position_embeddings
            stretch = self.max_position_embeddings / original
            self.longrope_attention_factor = (
                math.sqrt(1 + math.log(stretch) / math.log(original)) if stretch > 1 else 1.0
            )

    @property
    def longrope_factors(self) -> list[float]:
        """The factors this run turns by: the long ones beyond the original context."""
        if self.seq_length > self.longrope_original_max_position_embeddings:
            return self.longrope_long_factor
        return self.longrope_short_factor
