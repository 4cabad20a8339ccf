"""The GPT model: GPT-2 style (LayerNorm, GELU, learned positions, biases) through LLaMA style
(RMSNorm, SwiGLU, RoPE, grouped query attention, no biases, untied output) by configuration.

Parameter names follow megatron-core's `GPTModel` with the local layer spec, so state dicts can
be exchanged with Megatron-LM: `embedding.word_embeddings.weight`,
`decoder.layers.N.self_attention.linear_qkv.weight`, `decoder.final_layernorm.weight`,
`output_layer.weight`, ... The model asks for parallel layers and never calls a collective; at
tensor-parallel size 1 it is an ordinary single-device model.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.kernels.dispatch import KERNELS
from threefold.model.activation_offload import ActivationOffload
from threefold.model.mtp import MultiTokenPredictionBlock
from threefold.model.rope import RotaryEmbedding, rotary_embedding
from threefold.model.spec import LayerSpec, layer_spec
from threefold.model.transformer import TransformerBlock
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from threefold.parallel.tensor_parallel.random import get_rng_tracker
from threefold.parallel.tensor_parallel.sharding import (
    initialize_parameters,
    mark_replicated,
    normal_init,
    xavier_uniform_init,
)

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.")


def is_embedding_or_output(name: str) -> bool:
    """Megatron's `is_embedding_or_output_parameter`: the word embeddings and the output layer
    (tied or not), by their names in a model chunk."""
    return name.endswith(("word_embeddings.weight", "output_layer.weight"))


def _tables(
    embedding: nn.Module, seq_length: int, position_ids: torch.Tensor | None, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (cos, sin) of positions 0..s-1, or of `position_ids` (packed documents, context
    parallelism) gathered to [s, b, 1, head_dim]."""
    if position_ids is None:
        return embedding(seq_length, device)
    cos, sin = embedding(int(position_ids.max()) + 1, device)
    index = position_ids.t()
    return cos[index].squeeze(2), sin[index].squeeze(2)


def _softcapped(layer, cap: float, hidden_states: torch.Tensor) -> torch.Tensor:
    """--final-logit-softcapping: cap * tanh(logits / cap), each vocabulary shard's own."""
    return torch.tanh(layer(hidden_states) / cap) * cap


def _scaled(layer, factor: float, hidden_states: torch.Tensor) -> torch.Tensor:
    return layer(hidden_states) * factor


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext, padded_vocab_size: int):
        super().__init__()
        # Megatron-LM's rule: an --embedding-init-method-std of its own is a normal
        # initialization of that width, whatever the layers' initialization
        own_std = config.embedding_init_method_std
        if own_std is not None and own_std != config.init_method_std:
            init = normal_init(own_std)
        elif config.init_method_xavier_uniform:
            init = xavier_uniform_init()
        else:
            init = normal_init(config.init_method_std)
        self.tp = parallel.tp
        sequence_parallel = self.sequence_parallel = parallel.sequence_parallel
        self.hidden_dropout = config.hidden_dropout
        # muP's multiplier, and --embedding-multiplier's (Gemma's sqrt(hidden))
        mup = config.mup_embedding_mult if config.use_mup else 1.0
        self.embedding_mult = mup * config.embedding_multiplier
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size,
            config.hidden_size,
            parallel=parallel,
            vocab_size=config.vocab_size,
            init_method=init,
        )
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size
            )
            mark_replicated(self.position_embeddings.weight, init, sequence_parallel)
        else:
            self.position_embeddings = None

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids)  # [s (/ TP under SP), b, h]
        if self.position_embeddings is not None:
            # This rank's positions: all of them, or its slice of the sequence under SP (whose
            # partial gradient the SP all-reduce of replicated parameters completes).
            local = embeddings.shape[0]
            start = self.tp.rank * local if self.sequence_parallel else 0
            if position_ids is None:
                positions = self.position_embeddings.weight[start : start + local].unsqueeze(1)
            else:  # packed documents: each restarts at position 0
                positions = self.position_embeddings(position_ids.t()[start : start + local])
            embeddings = embeddings + positions.to(embeddings.dtype)
        if self.embedding_mult != 1.0:
            embeddings = embeddings * self.embedding_mult
        if self.training and self.hidden_dropout > 0:
            fork = get_rng_tracker().fork() if self.sequence_parallel else contextlib.nullcontext()
            with fork:
                embeddings = F.dropout(embeddings, p=self.hidden_dropout, training=True)
        return embeddings


class GPTModel(nn.Module):
    """`parallel`: the layout the model is built for (one device when not given).
    `pre_process` / `post_process` say whether this pipeline stage holds the embedding /
    the output layer and loss; `num_layers` and `layer_offset` select its transformer layers;
    `spec` what each layer is made of (model/spec.py; by default what the config asks for)."""

    def __init__(
        self,
        config: ModelConfig,
        padded_vocab_size: int,
        *,
        parallel: ParallelContext | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        num_layers: int | None = None,
        layer_offset: int = 0,
        spec: LayerSpec | None = None,
    ) -> None:
        super().__init__()
        parallel = parallel or ParallelContext()
        self.config = config
        self.parallel = parallel
        self.tp = parallel.tp
        self.vocab_size = config.vocab_size
        self.padded_vocab_size = padded_vocab_size
        self.sequence_parallel = parallel.sequence_parallel
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        # muP (config/mup.py) narrows the hidden matrices' init by the width multiplier.
        width = config.mup_width_mult
        init = normal_init(config.init_method_std / math.sqrt(width))
        # Megatron's scaled init for the projections that write into the residual stream.
        scaled_init = normal_init(
            config.init_method_std / math.sqrt(2.0 * config.num_layers * width)
        )
        if config.init_method_xavier_uniform:  # (Megatron-LM's: for both)
            init = scaled_init = xavier_uniform_init()
        self.logits_mult = config.mup_logits_mult * config.logit_scale  # (Cohere's scale)
        self.final_logit_softcapping = config.final_logit_softcapping

        tied = self.share_embeddings_and_output_weights
        mtp_here = post_process and bool(config.mtp_num_layers)
        if pre_process or mtp_here:
            self.embedding = LanguageModelEmbedding(config, parallel, padded_vocab_size)
            # Multi-token prediction embeds the input again after the decoder: a last stage
            # without the embedding holds a copy of it, kept equal to the first stage's as a
            # tied output layer's weight is (their gradients summed over the embedding group).
            for name, param in self.embedding.named_parameters():
                if config.mtp_num_layers or (tied and name.startswith("word_embeddings.")):
                    param.shared_embedding = True
                    param.embedding_copy = not pre_process
        self.rotary_pos_emb = rotary_embedding(config)
        # --window-rotary-base (Gemma 3): the windowed layers' own tables, after the others'
        self.window_rotary_pos_emb = None
        if config.window_rotary_base is not None:
            self.window_rotary_pos_emb = RotaryEmbedding(
                config.rotary_dim, config.window_rotary_base
            )
        spec = spec or layer_spec(config, parallel)
        self.decoder = TransformerBlock(
            config,
            parallel,
            spec,
            config.num_layers if num_layers is None else num_layers,
            layer_offset,
            init,
            scaled_init,
            final_layernorm=post_process,
        )
        self.mtp = None
        if mtp_here:
            self.mtp = MultiTokenPredictionBlock(config, parallel, spec, init, scaled_init)
        self.activation_offload = None
        if config.fine_grained_activation_offloading:
            self.activation_offload = ActivationOffload(
                config.offload_modules,
                config.min_offloaded_tensor_size,
                config.activation_offload_fraction,
                parallel.pp.rank * config.delta_offload_bytes_across_pp_ranks,
                config.fine_grained_offloading_max_inflight_offloads,
            )
        elif config.offloads_layers():  # every layer a group, the first N offloaded
            layers = config.cpu_offloading_num_layers
            self.activation_offload = ActivationOffload(["layer"], 0, first_groups=layers)
        if post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                padded_vocab_size,
                parallel=parallel,
                bias=config.output_layer_bias,  # (Phi's)
                # (muP: an untied output layer is initialized as the embeddings are)
                init_method=normal_init(config.init_method_std) if config.use_mup else init,
                skip_weight_param=tied and (pre_process or mtp_here),
                valid_output_size=config.vocab_size,
            )
        if config.lora_rank:
            from threefold.model.lora import apply_lora

            apply_lora(
                self,
                config.lora_rank,
                config.lora_alpha,
                config.lora_dropout,
                config.lora_target_modules,
                config.lora_freeze_experts,
            )
        if post_process and tied and not (pre_process or mtp_here):
            # Under pipeline parallelism the last stage holds a copy of the tied weight; its
            # gradient is summed with the first stage's so the copies stay equal.
            self.output_layer.weight.shared_embedding = True
            self.output_layer.weight.embedding_copy = True

    def layout_independent_name(self, name: str) -> str:
        """The parameter's name in the whole single-device model (global layer numbers)."""
        match = _LAYER_NAME.match(name)
        if match:
            name = (
                f"decoder.layers.{int(match.group(1)) + self.decoder.layer_offset}."
                + name[match.end() :]
            )
        if name == "output_layer.weight" and self.share_embeddings_and_output_weights:
            # A last pipeline stage's copy of the tied embedding starts equal to the first's.
            name = "embedding.word_embeddings.weight"
        return name

    def initialize(self, seed: int) -> None:
        initialize_parameters(
            [(self.layout_independent_name(n), p) for n, p in self.named_parameters()],
            seed,
            self.parallel,
        )

    def output_weight(self) -> torch.Tensor:
        if self.share_embeddings_and_output_weights and (self.pre_process or self.mtp is not None):
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def _offloading(self, rotary: tuple | None, attention_mask: torch.Tensor | None):
        """The micro-batch's forward pass through the layers, offloading what --offload-modules
        name (model/activation_offload.py); the rotary tables and the mask, which every layer
        saves, stay."""
        if self.activation_offload is None or not (self.training and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        # (under CP the mask is `Documents`, which no layer saves: each block's is recomputed)
        mask = (attention_mask,) if isinstance(attention_mask, torch.Tensor) else ()
        return self.activation_offload.forward_pass(keep=(*(rotary or ()), *mask))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """From token ids [b, s] (first stage) or incoming hidden states [s, b, h] (later
        stages). Returns the per-token loss [b, s] when `labels` are given on the last stage,
        vocabulary-parallel logits [s, b, padded_vocab / TP] otherwise, or the hidden states
        for the next stage when this is not the last stage.

        Packed sequences (fine-tuning) pass `attention_mask` [b, 1, s, s] (True: may attend;
        block-diagonal causal, one block per document) and `position_ids` [b, s]; without
        them attention is causal over the whole sequence and positions are 0..s-1.

        With --mtp-num-layers, training also runs the multi-token prediction depths on the
        labels (and `loss_mask`, all ones if not given), whose losses join the backward pass
        (model/mtp.py)."""
        if self.pre_process:
            hidden_states = self.embedding(input_ids, position_ids)
        seq_length = hidden_states.shape[0] * (self.tp.size if self.sequence_parallel else 1)
        rotary = None
        if self.rotary_pos_emb is not None:
            rotary = _tables(self.rotary_pos_emb, seq_length, position_ids, hidden_states.device)
        if self.window_rotary_pos_emb is not None:  # (SelfAttention takes its pair)
            emb = self.window_rotary_pos_emb
            rotary += _tables(emb, seq_length, position_ids, hidden_states.device)
        with self._offloading(rotary, attention_mask):
            hidden_states = self.decoder(hidden_states, rotary, attention_mask)
            if not self.post_process:
                return hidden_states
            output_layer = functools.partial(self.output_layer, weight=self.output_weight())
            if self.logits_mult != 1.0:  # muP's multiplier, --logit-scale; the MTP depths' too
                output_layer = functools.partial(_scaled, output_layer, self.logits_mult)
            if self.final_logit_softcapping is not None:  # (Gemma 2's)
                cap = self.final_logit_softcapping
                output_layer = functools.partial(_softcapped, output_layer, cap)
            if self.mtp is not None and self.training and labels is not None:
                batch = {
                    "tokens": input_ids,
                    "labels": labels,
                    "loss_mask": loss_mask,
                    "position_ids": position_ids,
                    "attention_mask": attention_mask,
                }
                hidden_states = self.mtp(hidden_states, batch, self.embedding, output_layer, rotary)
        logits = output_layer(hidden_states)
        if labels is None:
            return logits
        # Contiguous: a view returned from an FSDP2 root would be fragile under in-place ops.
        return KERNELS.cross_entropy(logits, labels.t(), self.vocab_size, self.tp).t().contiguous()
