"""QK-clip (--qk-clip, Megatron-LM's; Kimi K2's MuonClip) and the largest attention score.

Each attention layer keeps the largest score of each of its heads over the step's training
micro-batches (`Attention.max_logits`, model/attention_scores.py: scaled q . k over the
allowed keys, as the kernels scale them).
After the step `QKClip` takes the maximum over the data-parallel replicas, and for a head (a
query group under grouped-query attention, whose key its heads share) above the threshold
gives each row of its query and key weights a factor, eta = threshold / max:
- `SelfAttention`: linear_qkv's query rows eta^alpha, its key rows eta^(1 - alpha) (the bias's
  too, so the queries and keys scale whole; Megatron-LM scales the weight alone);
- `MLASelfAttention`: each head's rows of the query projection, eta^alpha for its own part
  and eta for its rotary part, and of linear_kv_up_proj eta^(1 - alpha) for its key part (the
  rotary key, shared by the heads, is left), as megatron-core's MLA.
A head's scores then shrink by eta. The optimizer multiplies the factors into the updated
weights (`AdamWithMasters.step`): into the fp32 masters, which the model's weights are
written from, so that a bf16 run rounds once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from threefold.config import ModelConfig
from threefold.model.attention import Attention, SelfAttention
from threefold.model.mla import MLASelfAttention
from threefold.parallel.parallel_context import ParallelContext


class QKClip:
    """The step's largest attention scores, and with --qk-clip the factors of the rows of the
    query and key weights (`factors`). Owns nothing but the layers' list: the scores live in
    the layers (`Attention.max_logits`) until `factors` reads and clears them."""

    def __init__(
        self, model_chunks: list[nn.Module], config: ModelConfig, parallel: ParallelContext
    ) -> None:
        self.layers = [
            m
            for chunk in model_chunks
            for m in chunk.modules()
            if isinstance(m, SelfAttention | MLASelfAttention)
        ]
        self.clip = config.qk_clip
        self.alpha, self.threshold = config.qk_clip_alpha, config.qk_clip_threshold
        self.parallel = parallel
        self.device = next(p for chunk in model_chunks for p in chunk.parameters()).device
        self.max_attention_logit = 0.0  # the last step's, over the whole model

    @torch.no_grad()
    def factors(self) -> dict[nn.Parameter, torch.Tensor]:
        """The step's row factors by parameter (none where no head went above the threshold,
        or without --qk-clip), the same on every data-parallel replica; sets
        `max_attention_logit`. Every rank of the run calls it after each step."""
        seen = [layer for layer in self.layers if layer.max_logits is not None]
        if seen:
            maxima = torch.cat([layer.max_logits for layer in seen])
            self.parallel.dp_cp.all_reduce(maxima, op=dist.ReduceOp.MAX)
        else:  # (a pipeline stage of other layers)
            maxima = torch.zeros(0, device=self.device)
        largest = maxima.max().reshape(1) if maxima.numel() else torch.zeros(1, device=self.device)
        if self.parallel.model_parallel_group is not None:  # (the other stages' and heads')
            dist.all_reduce(largest, dist.ReduceOp.MAX, group=self.parallel.model_parallel_group)
        self.max_attention_logit = float(largest)
        factors: dict[nn.Parameter, torch.Tensor] = {}
        per_layer = maxima.split([layer.max_logits.numel() for layer in seen])
        for layer in seen:
            layer.max_logits = None
        if not self.clip or not seen:
            return factors
        # (one look at the device for all layers: which went above the threshold)
        above = torch.stack([(m > self.threshold).any() for m in per_layer]).tolist()
        for layer, layer_max, clipped in zip(seen, per_layer, above, strict=True):
            if clipped:
                factors.update(self._rows(layer, layer_max))
        return factors

    def _eta(self, maxima: torch.Tensor) -> torch.Tensor:
        return torch.clamp(self.threshold / maxima, max=1.0)

    def _rows(self, layer: Attention, maxima: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        if isinstance(layer, MLASelfAttention):
            return self._mla_rows(layer, self._eta(maxima))
        return self._qkv_rows(layer, maxima)

    def _qkv_rows(
        self, layer: SelfAttention, maxima: torch.Tensor
    ) -> dict[nn.Parameter, torch.Tensor]:
        """linear_qkv's rows, per query group [queries, (gates,) key, value] of head_dim
        each: the group's eta from the largest score of its heads."""
        groups, per_group = layer.num_query_groups_per_partition, layer.heads_per_group
        eta = self._eta(maxima.view(groups, per_group).amax(dim=1))[:, None]
        d, gates, one = layer.head_dim, per_group if layer.output_gate else 0, torch.ones_like(eta)
        rows = _rows(
            [
                (eta**self.alpha, per_group * d),
                (one, gates * d),
                (eta ** (1 - self.alpha), d),
                (one, d),
            ]
        )
        linear = layer.linear_qkv
        return {p: rows for p in (linear.weight, linear.bias) if p is not None}

    def _mla_rows(
        self, layer: MLASelfAttention, eta: torch.Tensor
    ) -> dict[nn.Parameter, torch.Tensor]:
        """Per head: the query projection's [own part, rotary part] rows and linear_kv_up_proj's
        [key part, value] rows."""
        eta, alpha = eta[:, None], self.alpha
        query = _rows([(eta**alpha, layer.qk_head_dim), (eta, layer.rope_dim)])
        key = _rows(
            [(eta ** (1 - alpha), layer.qk_head_dim), (torch.ones_like(eta), layer.v_head_dim)]
        )
        up = layer.linear_q_up_proj if layer.q_lora else layer.linear_q_proj
        return {up.weight: query, layer.linear_kv_up_proj.weight: key}


def _rows(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The factor of every row of a weight whose heads (or query groups) each hold the parts'
    rows in order: (factor per head [heads, 1], rows of the part in each head)."""
    heads = parts[0][0].shape[0]
    return torch.cat([factor.expand(heads, n) for factor, n in parts], dim=1).reshape(-1)
