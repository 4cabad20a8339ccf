"""Multi-latent attention (DeepSeek-V2/V3), megatron-core's `MLASelfAttention`.

    hidden ─ linear_q_down_proj ─ q_layernorm ─ linear_q_up_proj ──── q [heads, nope | rope]
      │     (or linear_q_proj straight from the hidden state)
      └──── linear_kv_down_proj ─┬─ kv latent ─ kv_layernorm ─ linear_kv_up_proj ─ k_nope, v
                                 └─ k_rope: one RoPE part of the key, shared by all heads

With --experimental-attention-variant dsa the core attention is DeepSeek's sparse attention
(model/dsa.py): each query attends to the keys an indexer picks from the attention's input
and query latent.

The down projections are small and whole on every TP rank (each rank projects its own
activations: under sequence parallelism its slice of the sequence, their weights' gradients
then summed over TP); the up projections are column-parallel, split by heads, and the output
projection row-parallel, as in other attention. The norms exist with --qk-layernorm only
(megatron-core's spec: `IdentityOp` otherwise).

RoPE turns the query's rope part and the shared key part as megatron-core's MLA does: their
even dimensions, then their odd ones, rotated as halves. The core attention is the model's
(local, or spanning the CP ranks), which takes one head size for query, key and value: a
value narrower than the query/key head (DeepSeek-V3: 128 against 192) is padded with zeros,
which add nothing to the context and are cut from it after (a wider value pads the queries
and keys, which changes no score). megatron-core's softmax scale (YaRN's temperature squared
over sqrt(q head size)) is the kernels' own 1/sqrt(head size) with the queries multiplied to
make up the difference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.model.activation_offload import offload_group
from threefold.model.attention import Attention, CoreAttention, local_attention
from threefold.model.dsa import SparseAttention, sparse_mask
from threefold.model.norms import build_norm
from threefold.model.recompute import OutputDiscardingCheckpoint
from threefold.model.rope import rotate_mla
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    DuplicatedLinear,
    RowParallelLinear,
    tensor_parallel_input,
)
from threefold.parallel.tensor_parallel.sharding import InitMethod


class MLASelfAttention(Attention):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
        core_attention: Callable[[ModelConfig, ParallelContext], CoreAttention] = local_attention,
        window: int | None = None,
    ) -> None:
        super().__init__(config, parallel, core_attention, window)
        if config.sparse_attention:  # (--experimental-attention-variant dsa)
            self.core_attention = SparseAttention(
                config, parallel, init_method, self.core_attention
            )
        self.tp, self.sequence_parallel = parallel.tp, parallel.sequence_parallel
        heads = config.num_attention_heads
        self.heads_per_partition = heads // parallel.tp.size
        self.qk_head_dim, self.v_head_dim = config.qk_head_dim, config.v_head_dim
        self.rope_dim, self.q_head_dim = config.qk_pos_emb_head_dim, config.q_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        # One head size for the core attention: the wider of query/key and value heads, the
        # other padded with zeros. Megatron's softmax scale over the kernels' own
        # 1/sqrt(head size) multiplies the queries.
        self.width = max(self.q_head_dim, self.v_head_dim)
        self.query_scale = config.mla_softmax_scale * self.width**0.5
        self.q_lora = config.q_lora_rank is not None
        self.recompute_up_proj = config.recomputes("mla_up_proj")

        def column(inputs: int, outputs: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                inputs, outputs, parallel=parallel, bias=False, init_method=init_method
            )

        def latent_norm(size: int):
            # Under sequence parallelism a rank normalizes its slice of the sequence.
            if not config.qk_layernorm:
                return None
            return build_norm(config, size, partial_grads=parallel.sequence_parallel)

        h = config.hidden_size
        self.q_layernorm = None
        if config.q_lora_rank is None:
            self.linear_q_proj = column(h, heads * self.q_head_dim)
        else:
            self.linear_q_down_proj = DuplicatedLinear(
                h, config.q_lora_rank, parallel=parallel, init_method=init_method
            )
            self.q_layernorm = latent_norm(config.q_lora_rank)
            self.linear_q_up_proj = column(config.q_lora_rank, heads * self.q_head_dim)
        self.linear_kv_down_proj = DuplicatedLinear(
            h, self.kv_lora_rank + self.rope_dim, parallel=parallel, init_method=init_method
        )
        self.kv_layernorm = latent_norm(self.kv_lora_rank)
        self.linear_kv_up_proj = column(
            self.kv_lora_rank, heads * (self.qk_head_dim + self.v_head_dim)
        )
        self.linear_proj = RowParallelLinear(
            heads * self.v_head_dim,
            h,
            parallel=parallel,
            bias=config.add_bias_linear,
            init_method=output_layer_init_method,
        )

    def linear_layers(self) -> list[nn.Module]:
        """The layer's linear layers (those FP8 runs: model/fp8.py), the down projections
        included (Transformer Engine's MLA runs them in FP8 too)."""
        names = ["linear_q_down_proj", "linear_q_up_proj"] if self.q_lora else ["linear_q_proj"]
        names += ["linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
        return [getattr(self, name) for name in names]

    def _query_latent(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the query's up projection takes: the normed latent, or the hidden states
        without a query latent (linear_q_proj)."""
        if not self.q_lora:
            return hidden_states
        latent = self.linear_q_down_proj(hidden_states)
        return latent if self.q_layernorm is None else self.q_layernorm(latent)

    def _widened(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.shape[-1] == self.width else F.pad(x, (0, self.width - x.shape[-1]))

    def _up_projections(
        self,
        query_latent: torch.Tensor,
        latent: torch.Tensor,
        key_rope: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The core attention's query, key and value from the latents and the shared key
        part (all of the sequence on this rank): the up projections, RoPE, the softmax scale
        and the padding to one head size (what --recompute-modules mla_up_proj recomputes)."""
        up = self.linear_q_up_proj if self.q_lora else self.linear_q_proj
        query = up(query_latent)  # [s, b, heads/tp * q_head_dim]
        kv = self.linear_kv_up_proj(latent)  # [s, b, heads/tp * (qk_head_dim + v_head_dim)]
        s, b, _ = query.shape
        heads = self.heads_per_partition
        query_nope, query_rope = query.view(s, b, heads, -1).split(
            [self.qk_head_dim, self.rope_dim], dim=-1
        )
        key_nope, value = kv.view(s, b, heads, -1).split([self.qk_head_dim, self.v_head_dim], -1)
        query = torch.cat((query_nope, rotate_mla(query_rope, (cos, sin))), dim=-1)
        key_rope = rotate_mla(key_rope.unsqueeze(2), (cos, sin)).expand(-1, -1, heads, -1)
        key = torch.cat((key_nope, key_rope), dim=-1)
        if self.query_scale != 1.0:
            query = query * self.query_scale
        query, key, value = (self._widened(t) for t in (query, key, value))
        return query, key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with offload_group("qkv_linear", self.offload_qkv_linear):
            query_latent = self._query_latent(hidden_states)
            latent, key_rope = self.linear_kv_down_proj(hidden_states).split(
                [self.kv_lora_rank, self.rope_dim], dim=-1
            )
            if self.kv_layernorm is not None:
                latent = self.kv_layernorm(latent)
            # The shared key part reaches every head: the whole sequence, on every TP rank.
            key_rope = tensor_parallel_input(key_rope, self.tp, self.sequence_parallel)
            up = OutputDiscardingCheckpoint(self.recompute_up_proj and self.training)
            query, key, value = up.checkpoint(
                self._up_projections, query_latent, latent, key_rope, *rotary
            )
        sparse = self.core_attention if isinstance(self.core_attention, SparseAttention) else None
        documents = attention_mask
        if sparse is not None:  # each query's keys, picked by the indexer
            selection = sparse.select(hidden_states, query_latent, rotary, documents)
            attention_mask = sparse_mask(selection[1], documents)
        context = self._attend(query, key, value, attention_mask)
        if sparse is not None:  # (before the recomputed query and key are let go)
            context = sparse.with_indexer_loss(context, selection, query, key, documents)
        up.discard_output_and_register_recompute(context)
        with offload_group("attn_proj", self.offload_attn_proj):
            if self.width != self.v_head_dim:
                s, b, heads = context.shape[0], context.shape[1], self.heads_per_partition
                context = context.view(s, b, heads, self.width)[..., : self.v_head_dim]
                context = context.reshape(s, b, heads * self.v_head_dim)
            return self.linear_proj(context)
