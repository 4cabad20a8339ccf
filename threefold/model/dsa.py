"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): megatron-core's `DSAttention` and its
`DSAIndexer`, the core attention of multi-latent attention (--experimental-attention-variant
dsa, config/dsa.py).

    hidden ─┬─ linear_wk ─ k_norm (LayerNorm) ─ RoPE ─ Hadamard ─ key k [s, d]  (one head)
            └─ linear_weights_proj ─ w [s, H] / sqrt(H d)
    query latent ─ linear_wq_b ─ RoPE ─ Hadamard ─ queries q [s, H, d]

    index score I(t, u) = sum_j w(t, j) ReLU(q(t, j) . k(u)), for u <= t

Each query attends to the keys of its --dsa-indexer-topk highest index scores (and never to
later ones, nor, with packed documents, to another document's, as Megatron-LM's packed
sequences since megatron-core 0.16): the MLA's own attention under a [b, 1, s, s] mask, scores
and all, as megatron-core 0.16's unfused kernel computes it (its fused ones are CUDA kernels of
later versions). RoPE turns an indexer head's first --qk-pos-emb-head-dim dimensions with the
MLA's tables, as halves (DeepSeek-V3.2's and Megatron-LM's since megatron-core 0.16, which
turned the last ones as MLA does; --dsa-indexer-rope-interleaved: as MLA does); the Hadamard
transform is fast_hadamard_transform's (Sylvester's matrix over sqrt(d)), computed here in fp32
on any device.

The indexer reads the attention's input and query latent detached: the language-model loss
never reaches it, nor its loss the rest of the model. It learns from the KL divergence of its
softmax from the attention's distribution (the attention probabilities summed over every
head, the TP ranks' included, and normalized per query), averaged over the queries, times
--dsa-indexer-loss-coeff; with --dsa-indexer-use-sparse-loss both are taken over each
query's top-k keys only. The loss rides on the attention's output into backward
(model/aux_loss.py) and is kept for the log (Megatron's `indexer loss`,
training/indexer_losses.py).

Tensor parallelism: every TP rank holds the whole indexer (megatron-core's "duplicated"
linear layers) and runs it on the whole sequence (gathered under sequence parallelism), so
every rank picks the same keys and computes the indexer's whole gradient; the attention
probabilities are summed over TP before the loss. Attention dropout does not apply (as in
megatron-core's sparse attention).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.kernels.dispatch import KERNELS
from threefold.model.aux_loss import attach_losses
from threefold.model.norms import Norm
from threefold.model.recompute import is_recomputing
from threefold.model.rope import rotate_mla
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.layers import DuplicatedLinear, tensor_parallel_input
from threefold.parallel.tensor_parallel.sharding import InitMethod


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x H / sqrt(d) over the last dimension (a power of 2), H Sylvester's Hadamard matrix
    ([[H, H], [H, -H]] recursively): a butterfly per bit of the index, in fp32."""
    d = x.shape[-1]
    y, width = x.float().reshape(-1, d), 1
    while width < d:
        pairs = y.view(-1, d // (2 * width), 2, width)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), 2)
        width *= 2
    return (y.reshape(x.shape) * d**-0.5).to(x.dtype)


def _causal(scores: torch.Tensor) -> torch.Tensor:
    """-inf above the diagonal of the last two dimensions [s, s], 0 elsewhere."""
    s = scores.shape[-1]
    return torch.full((s, s), float("-inf"), device=scores.device).triu(1)


def _masked(scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """`scores` [b, (heads,) s, s] with -inf at later keys, and where `allowed` [b, 1, s, s]
    (packed documents: each query's own document) is False."""
    scores = scores + _causal(scores)
    if allowed is None:
        return scores
    return scores.masked_fill(~(allowed if scores.dim() == 4 else allowed[:, 0]), float("-inf"))


class DSAIndexer(nn.Module):
    def __init__(
        self, config: ModelConfig, parallel: ParallelContext, init_method: InitMethod
    ) -> None:
        super().__init__()
        self.heads, self.head_dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.topk, self.rope_dim = config.dsa_indexer_topk, config.qk_pos_emb_head_dim
        self.rope_interleaved = config.dsa_indexer_rope_interleaved
        self.tp, self.sequence_parallel = parallel.tp, parallel.sequence_parallel
        self.softmax_scale = self.head_dim**-0.5

        def linear(inputs: int, outputs: int) -> DuplicatedLinear:
            return DuplicatedLinear(
                inputs, outputs, parallel=parallel, init_method=init_method, whole_sequence=True
            )

        h = config.hidden_size
        self.linear_wq_b = linear(config.q_lora_rank or h, self.heads * self.head_dim)
        self.linear_wk = linear(h, self.head_dim)
        # (a LayerNorm whatever --normalization says, as megatron-core's)
        epsilon = config.dsa_indexer_k_norm_epsilon or config.norm_epsilon
        self.k_norm = Norm(self.head_dim, "LayerNorm", epsilon, False, config.apply_layernorm_1p)
        self.linear_weights_proj = linear(h, self.heads)

    def _rope(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        turned, kept = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        turned = (
            rotate_mla(turned, rotary) if self.rope_interleaved else KERNELS.rotary(turned, *rotary)
        )
        return torch.cat((turned, kept), dim=-1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        query_latent: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(index scores [b, s, s] in fp32, -inf for later keys and outside `allowed`; each
        query's top-k keys [b, s, k]) from this rank's attention input and query latent
        [s(/TP), b, ...]."""
        x, latent = (
            tensor_parallel_input(t.detach(), self.tp, self.sequence_parallel)
            for t in (hidden_states, query_latent)
        )
        s, b, _ = x.shape
        q = self.linear_wq_b(latent).view(s, b, self.heads, self.head_dim)
        q = hadamard_transform(self._rope(q, rotary))
        k = self.k_norm(self.linear_wk(x)).unsqueeze(2)
        k = hadamard_transform(self._rope(k, rotary)).squeeze(2)
        # (multiplied in megatron-core's order, so that ties between keys break alike)
        weights = self.linear_weights_proj(x) * self.heads**-0.5 * self.softmax_scale
        scores = torch.einsum("sbhd,tbd->sbht", q.float(), k.float()).relu()
        scores = _masked((scores * weights.unsqueeze(-1)).sum(dim=2).transpose(0, 1), allowed)
        return scores, scores.topk(min(self.topk, s), dim=-1).indices


def sparse_mask(topk: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[b, 1, s, s], True where a query may attend: its top-k keys, none later than itself
    (nor outside `allowed`)."""
    b, s, _ = topk.shape
    chosen = torch.zeros(b, s, s, dtype=torch.bool, device=topk.device).scatter_(-1, topk, True)
    chosen = (chosen & torch.ones(s, s, dtype=torch.bool, device=topk.device).tril())[:, None]
    return chosen if allowed is None else chosen & allowed


def indexer_loss(
    index_scores: torch.Tensor,
    topk: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    sparse: bool,
    parallel: ParallelContext,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The KL divergence of the indexer's softmax from the attention's distribution (from
    this rank's heads of query and key [s, b, heads, d], already scaled for a softmax scale of
    1/sqrt(d), summed over the TP ranks' heads), per query [b, s]; both over each query's
    earlier keys of `allowed` (index_scores are masked already)."""
    scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key.float()) / math.sqrt(
        query.shape[-1]
    )
    scores = _masked(scores, allowed)
    if sparse:
        outside = torch.full_like(index_scores, float("-inf")).scatter_(-1, topk, 0.0)
        scores, index_scores = scores + outside[:, None], index_scores + outside
    target = torch.softmax(scores, dim=-1).sum(dim=1)
    parallel.tp.all_reduce(target)
    target = target / target.sum(dim=-1, keepdim=True)
    predicted = torch.softmax(index_scores, dim=-1)
    divergence = target * (torch.log(target + 1e-10) - torch.log(predicted + 1e-10))
    return divergence.sum(dim=-1)


class SparseAttention(nn.Module):
    """The MLA's core attention under DSA: the kernel dispatch's attention under the indexer's
    mask, holding the indexer where megatron-core does
    (`self_attention.core_attention.indexer`), its loss attached to the context."""

    def __init__(
        self, config: ModelConfig, parallel: ParallelContext, init_method: InitMethod, attend
    ) -> None:
        super().__init__()
        self.indexer = DSAIndexer(config, parallel, init_method)
        self.attend, self.parallel = attend, parallel
        self.loss_coeff = config.dsa_indexer_loss_coeff or 0.0
        self.sparse_loss = config.dsa_indexer_use_sparse_loss
        # set by the trainer each step (training/indexer_losses.py): the gradient's factor,
        # and --calculate-per-token-loss's sum over the queries (Megatron-LM's since
        # megatron-core 0.16, as the main loss's over the tokens) instead of their mean
        self.aux_loss_scale, self.per_token_loss = 1.0, False
        self._loss_sum: torch.Tensor | None = None

    def forward(self, query, key, value, attention_mask, dropout) -> torch.Tensor:
        del dropout  # (none in megatron-core's sparse attention)
        return self.attend(query, key, value, attention_mask, 0.0)

    def _learns(self) -> bool:
        return self.training and torch.is_grad_enabled() and self.loss_coeff > 0

    def select(
        self,
        hidden_states: torch.Tensor,
        query_latent: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's (scores, top-k), without a graph unless its loss will need one."""
        with contextlib.nullcontext() if self._learns() else torch.no_grad():
            return self.indexer(hidden_states, query_latent, rotary, allowed)

    def with_indexer_loss(
        self,
        context: torch.Tensor,
        selection: tuple[torch.Tensor, torch.Tensor],
        query: torch.Tensor,
        key: torch.Tensor,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`context` carrying the indexer's loss for `selection` (index scores, top-k) into
        backward (when training with a coefficient), the loss kept for the log."""
        if not self._learns():
            return context
        index_scores, topk = selection
        detached = (query.detach(), key.detach())
        divergence = indexer_loss(
            index_scores, topk, *detached, self.sparse_loss, self.parallel, allowed
        )
        reduced = divergence.sum() if self.per_token_loss else divergence.mean()
        loss = reduced * self.loss_coeff
        if not is_recomputing():  # (recorded by the first forward)
            kept = loss.detach()
            self._loss_sum = kept if self._loss_sum is None else self._loss_sum + kept
        return attach_losses(context, self.aux_loss_scale, loss)

    def take_losses(self) -> torch.Tensor | None:
        """The indexer losses (with their coefficient) since the last call, summed over
        micro-batches on this rank."""
        loss, self._loss_sum = self._loss_sum, None
        return loss
