"""Causal self-attention with grouped query attention, split by heads across TP ranks.

`linear_qkv` follows megatron-core's layout: rows are grouped by query group, each group
holding its query heads, then one key head, then one value head: [q0 .. q(h/g-1), k, v] per
group. Splitting the rows evenly over TP ranks therefore hands each rank whole query groups.
With --attention-output-gate each group also holds a gate head per query head, after the
queries ([q..., gate..., k, v], as megatron-core), and the context is multiplied by the
gate's sigmoid before the output projection.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.kernels.dispatch import KERNELS
from threefold.model.activation_offload import offload_group
from threefold.model.attention_scores import max_scores, over_context_parallel
from threefold.model.norms import AcrossHeadsRMSNorm, L2Norm, PerHeadNorm, build_norm
from threefold.model.recompute import checkpoint
from threefold.parallel.context_parallel.attention import (
    context_parallel_attention,
    one_block_attention,
)
from threefold.parallel.context_parallel.sequence import (
    Documents,
    chunk_mask,
    local_positions,
    window_mask,
)
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from threefold.parallel.tensor_parallel.random import get_rng_tracker
from threefold.parallel.tensor_parallel.sharding import InitMethod, mark_tensor_parallel

CoreAttention = Callable  # (query, key, value, attention_mask, dropout) -> context


def _kernel_attention(query, key, value, attention_mask, dropout) -> torch.Tensor:
    # Looked up at each call: the kernels are configured after the model is built.
    return KERNELS.attention(query, key, value, attention_mask, dropout)


def local_attention(config: ModelConfig, parallel: ParallelContext) -> CoreAttention:
    """Core attention when this rank holds whole sequences: the kernel dispatch's."""
    del config, parallel
    return _kernel_attention


def context_parallel(config: ModelConfig, parallel: ParallelContext) -> CoreAttention:
    """Core attention over a sequence split across the CP ranks, by --cp-comm-type."""
    del config
    hierarchy = (parallel.cp_a2a, parallel.cp_p2p)
    return context_parallel_attention(
        parallel.cp, parallel.cp_comm_type, _kernel_attention, hierarchy
    )


def _blockwise(
    parallel: ParallelContext, local: CoreAttention, softcap: float | None = None
) -> CoreAttention:
    """`local` (one block of the ring's, kernels that SDPA has none of) on one rank's whole
    sequences, or over the CP ranks by --cp-comm-type."""
    if parallel.cp.size == 1:
        return local
    hierarchy = (parallel.cp_a2a, parallel.cp_p2p)
    return context_parallel_attention(parallel.cp, parallel.cp_comm_type, local, hierarchy, softcap)


def softcapped_attention(config: ModelConfig, parallel: ParallelContext) -> CoreAttention:
    """Core attention whose scores are capped softly, cap * tanh(score / cap), before the
    softmax (--attn-logit-softcapping: Gemma 2's). No SDPA kernel caps: the attention runs as
    the context-parallel ring's blocks (eager, the scores recomputed in backward from the
    output and log-sum-exp, not kept), on one rank or over CP ranks by every comm type."""
    cap = config.attn_logit_softcapping
    return _blockwise(parallel, functools.partial(one_block_attention, softcap=cap), cap)


class SoftmaxOffsetAttention(nn.Module):
    """Core attention with one more softmax logit per head beside each row's scores
    (megatron-core's --softmax-type; GPT-OSS's attention sinks): 0 (off-by-one) or
    `softmax_offset`, learned per head (learnable), split over TP with the heads and named as
    megatron-core names it (`self_attention.core_attention.softmax_offset`). No SDPA kernel
    takes the logit: the attention runs as one block of the CP ring's (its scores recomputed
    in backward from the output and log-sum-exp, as flash attention's, not kept), the sinks
    merged as a last block (parallel/context_parallel/attention.py), over CP ranks by every
    comm type."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, init_method) -> None:
        super().__init__()
        heads = config.num_attention_heads // parallel.tp.size
        if config.softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.empty(heads))
            mark_tensor_parallel(self.softmax_offset, 0, init_method, (config.num_attention_heads,))
        else:  # (off-by-one: no state, as megatron-core keeps none)
            self.register_buffer("softmax_offset", torch.zeros(heads), persistent=False)
        self.attend = _blockwise(parallel, one_block_attention)

    def forward(self, query, key, value, attention_mask, dropout) -> torch.Tensor:
        return self.attend(query, key, value, attention_mask, dropout, self.softmax_offset)


class Attention(nn.Module):
    """What every attention layer shares: `core_attention(config, parallel)` builds what turns
    query, key and value into the context (the layer spec's choice: `local_attention` or
    `context_parallel`), run with its dropout and selective recomputation."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        core_attention: Callable[[ModelConfig, ParallelContext], CoreAttention],
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.core_attention = core_attention(config, parallel)
        self.attention_dropout = config.attention_dropout
        self.window = window  # --window-size: the keys back a query sees (None: all)
        self.chunk: int | None = None  # --attention-chunk-size: the chunks a query sees within
        self.cp = parallel.cp  # (a CP rank tempers, and scores, by its tokens' places)
        self.cp_size = parallel.cp.size  # (over CP ranks the window masks each block)
        # Megatron's selective recomputation: the attention scores are the activations that
        # grow with the square of the sequence, and the cheapest to recompute.
        self.recompute_core_attention = config.recomputes("core_attn")
        # Fine-grained activation offloading (model/activation_offload.py)
        self.offload_qkv_linear = config.offloads("qkv_linear")
        self.offload_core_attn = config.offloads("core_attn")
        self.offload_attn_proj = config.offloads("attn_proj")
        # --qk-clip, --log-max-attention-logit: each local head's largest score over this
        # step's training micro-batches, until training/qk_clip.py reads and clears it
        self.observe_scores = config.observes_attention_logits()
        self.max_logits: torch.Tensor | None = None

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        with offload_group("core_attn", self.offload_core_attn):
            if self.recompute_core_attention and self.training:
                return checkpoint(self._core_attention, query, key, value, attention_mask)
            return self._core_attention(query, key, value, attention_mask)

    def _core_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [s, b, heads, d], key and value [s, b, groups, d] -> context [s, b, heads*d];
        query head i reads key/value group i // heads_per_group."""
        dropout = self.attention_dropout if self.training else 0.0
        if self.window is not None and self.cp_size > 1:
            attention_mask = Documents.windowed(attention_mask, self.window, self.cp_size, query)
        elif self.window is not None:
            attention_mask = window_mask(query.shape[0], self.window, attention_mask, query.device)
        elif self.chunk is not None and self.cp_size > 1:
            attention_mask = Documents.chunked(attention_mask, self.chunk, self.cp_size, query)
        elif self.chunk is not None:
            # packed documents, or a last chunk cut short: the mask; else `_in_chunks`
            length = query.shape[0]
            if attention_mask is not None or (length > self.chunk and length % self.chunk):
                attention_mask = chunk_mask(length, self.chunk, attention_mask, query.device)
        if self.observe_scores and self.training:
            self._observe(query, key, attention_mask)
        # Each TP rank owns different heads: their dropout masks must differ.
        fork = get_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext()
        with fork:
            if self.chunk is not None and attention_mask is None:
                return self._in_chunks(query, key, value, dropout)
            return self.core_attention(query, key, value, attention_mask, dropout)

    def _observe(
        self, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> None:
        """Keep each head's largest score (`attention_mask` as the core attention takes it);
        a recomputation sees the same scores again."""
        if self.cp.size > 1:
            key, attention_mask = over_context_parallel(query, key, attention_mask, self.cp)
        elif self.chunk is not None and attention_mask is None:  # (`_in_chunks`' own mask)
            attention_mask = chunk_mask(query.shape[0], self.chunk, None, query.device)
        scores = max_scores(query, key, attention_mask)
        kept = self.max_logits
        self.max_logits = scores if kept is None else torch.maximum(kept, scores)

    def _in_chunks(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float
    ) -> torch.Tensor:
        """--attention-chunk-size over sequences of whole chunks: each chunk is causal
        attention of its own, the chunks folded into the batch, with no [s, s] mask (the work
        and memory of s x chunk scores, and the flash kernels take it)."""
        s, b = query.shape[:2]
        chunk = min(self.chunk, s)

        def fold(x: torch.Tensor) -> torch.Tensor:  # [s, b, ...] -> [chunk, s/chunk x b, ...]
            x = x.reshape(s // chunk, chunk, b, *x.shape[2:]).transpose(0, 1)
            return x.reshape(chunk, -1, *x.shape[3:])

        context = self.core_attention(fold(query), fold(key), fold(value), None, dropout)
        return context.reshape(chunk, s // chunk, b, -1).transpose(0, 1).reshape(s, b, -1)


def tempered(
    query: torch.Tensor, positions: torch.Tensor, floor_scale: int, scale: float
) -> torch.Tensor:
    """query [s, b, heads, d] scaled at each token's position p in the sequence (`positions`
    [s]) by 1 + scale * log(1 + floor((p + 1) / floor_scale)), in fp32 (transformers' Llama 4
    temperature tuning, in its layers without RoPE)."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * scale + 1.0
    return (query * scales[:, None, None, None]).to(query.dtype)


class SelfAttention(Attention):
    """Multi-head (or grouped-query) self-attention from one fused QKV projection."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
        core_attention: Callable[[ModelConfig, ParallelContext], CoreAttention] = local_attention,
        window: int | None = None,
        rope: bool = True,
    ) -> None:
        super().__init__(config, parallel, core_attention, window)
        if config.softmax_type != "vanilla":
            self.core_attention = SoftmaxOffsetAttention(config, parallel, init_method)
        elif config.attn_logit_softcapping is not None:  # (Gemma 2's)
            self.core_attention = softcapped_attention(config, parallel)
        tp = parallel.tp.size
        self.head_dim = config.kv_channels
        self.num_query_groups_per_partition = config.num_query_groups // tp
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.rotary_interleaved = config.rotary_interleaved
        # (rope False: a layer --no-rope-freq leaves without RoPE attends by content alone)
        self.rope = rope and config.rotary_position_embeddings
        # --window-rotary-base: a windowed layer rotates by the second pair of tables
        self.rotary_pair = int(window is not None and config.window_rotary_base is not None)
        self.rotary_dim = config.rotary_dim if self.rope else 0
        self.output_gate = config.attention_output_gate
        gates = config.num_attention_heads if self.output_gate else 0
        qkv_size = config.kv_channels * (
            config.num_attention_heads + gates + 2 * config.num_query_groups
        )
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_size,
            parallel=parallel,
            bias=config.add_bias_linear or config.add_qkv_bias,
            init_method=init_method,
        )
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm and config.qk_layernorm_across_heads:  # (OLMo 2's)
            d, eps = config.kv_channels, config.norm_epsilon
            self.q_layernorm = AcrossHeadsRMSNorm(config.num_attention_heads, d, eps, parallel.tp)
            self.k_layernorm = AcrossHeadsRMSNorm(config.num_query_groups, d, eps, parallel.tp)
        elif config.qk_layernorm and config.qk_layernorm_per_head:  # (Command R+'s)
            d = config.kv_channels
            self.q_layernorm = PerHeadNorm(config.num_attention_heads, d, config, parallel.tp)
            self.k_layernorm = PerHeadNorm(config.num_query_groups, d, config, parallel.tp)
        elif config.qk_layernorm:
            # One weight over the head size, shared by all heads: a TP rank sees only its
            # heads' share of the gradient, summed over the TP group after backward (as
            # Megatron does).
            self.q_layernorm = build_norm(config, config.kv_channels, partial_grads=True)
            self.k_layernorm = build_norm(config, config.kv_channels, partial_grads=True)
        elif config.qk_l2_norm and (self.rope or not config.qk_l2_norm_rope_layers_only):
            self.q_layernorm = self.k_layernorm = L2Norm(config.norm_epsilon)
        # transformers' Llama 4 (config/llama4.py): the layers with RoPE attend in chunks,
        # those without scale their queries up with the position
        if self.rope:
            self.chunk = config.attention_chunk_size
        self.temperature = None
        if not self.rope and config.attn_temperature_tuning:
            self.temperature = (config.attn_temperature_floor_scale, config.attn_temperature_scale)
        self.linear_proj = RowParallelLinear(
            config.kv_channels * config.num_attention_heads,
            config.hidden_size,
            parallel=parallel,
            bias=config.add_bias_linear,
            init_method=output_layer_init_method,
        )
        # muP's softmax scale (config/mup.py), or --softmax-scale's, on the queries: the
        # kernels take 1/sqrt(d).
        self.query_scale = config.mup_query_scale(config.kv_channels)
        if config.softmax_scale is not None:
            self.query_scale *= config.softmax_scale * math.sqrt(config.kv_channels)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with offload_group("qkv_linear", self.offload_qkv_linear):
            pair = rotary[2 * self.rotary_pair : 2 * self.rotary_pair + 2] if rotary else None
            query, key, value, gate = self._query_key_value(
                hidden_states, pair if self.rope else None
            )
        context = self._attend(query, key, value, attention_mask)
        with offload_group("attn_proj", self.offload_attn_proj):
            if gate is not None:  # megatron-core's `_apply_output_gate`: the sigmoid in fp32
                context = (context * torch.sigmoid(gate.flatten(2).float())).to(context.dtype)
            return self.linear_proj(context)

    def _query_key_value(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The QKV projection split into the rotated, scaled queries, the keys and values,
        and the output gate (None without --attention-output-gate)."""
        qkv = self.linear_qkv(hidden_states)  # [s, b, groups/tp * (heads_per_group + 2) * d]
        s, b, _ = qkv.shape
        per_group = self.heads_per_group * (2 if self.output_gate else 1) + 2
        qkv = qkv.view(s, b, self.num_query_groups_per_partition, per_group, self.head_dim)
        gate = None
        if self.output_gate:
            gate, qkv = self._split_gate(qkv)
        whole = self.rotary_dim == self.head_dim and not self.rotary_interleaved
        if self.q_layernorm is None and rotary is not None and whole:
            query, key, value = KERNELS.split_rotary(qkv, *rotary, self.heads_per_group)
        else:
            query, key, value = qkv.split([self.heads_per_group, 1, 1], dim=3)
            query = query.reshape(s, b, -1, self.head_dim)  # heads of a group stay adjacent
            key, value = key.squeeze(3), value.squeeze(3)
            if self.q_layernorm is not None:
                query, key = self.q_layernorm(query), self.k_layernorm(key)
            if rotary is not None:
                query, key = self._rotate(query, rotary), self._rotate(key, rotary)
            if self.temperature is not None:  # (by position in the whole sequence)
                positions = torch.arange(s, device=query.device)
                if self.cp.size > 1:
                    positions = local_positions(s * self.cp.size, self.cp, query.device)
                query = tempered(query, positions, *self.temperature)
        if self.query_scale != 1.0:
            query = query * self.query_scale
        return query, key, value, gate

    def _split_gate(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[s, b, groups, (2 heads_per_group + 2), d] -> the gate [s, b, heads, d] (heads of a
        group adjacent, as the queries), and [q..., k, v] per group as without a gate."""
        per_group = self.heads_per_group
        query, gate, key_value = qkv.split([per_group, per_group, 2], dim=3)
        return gate.flatten(2, 3), torch.cat((query, key_value), dim=3)

    def linear_layers(self) -> list[nn.Module]:
        """The layer's linear layers (those FP8 runs: model/fp8.py)."""
        return [self.linear_qkv, self.linear_proj]

    def _rotate(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on the first `rotary_dim` dimensions of each head (all of them unless
        --rotary-percent), the rest passed through, as megatron-core does."""
        rotate = KERNELS.rotary_interleaved if self.rotary_interleaved else KERNELS.rotary
        if self.rotary_dim == self.head_dim:
            return rotate(x, *rotary)
        turned, kept = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat((rotate(turned, *rotary), kept), dim=-1)
