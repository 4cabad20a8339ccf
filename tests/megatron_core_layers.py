"""Stand-ins for megatron-core layers its local (no Transformer Engine) spec lacks on a CPU,
each computing what the layer it replaces computes (tests/megatron_core_models.py builds
megatron-core's models with them):
- MLA's core attention with its own key and value head sizes (megatron-core's local
  DotProductAttention takes one head size; Transformer Engine's takes both);
- DSA's indexer's whole ("duplicated") linear layers, which megatron-core takes from
  Transformer Engine's spec, and its Hadamard rotation (fast_hadamard_transform, a CUDA
  extension for bf16 only) as Sylvester's matrix;
- and one that computes something else on purpose: the indexer's RoPE as Megatron-LM turns it
  since megatron-core 0.16 (the first dimensions, as halves or with
  `dsa_indexer_rope_interleaved` MLA's way: DeepSeek-V3.2's, transformers'), where 0.16 turned
  the last ones MLA's way.
"""

from __future__ import annotations

import torch


def hadamard_by_matrix(x: torch.Tensor) -> torch.Tensor:
    """x H / sqrt(d), H Sylvester's d x d Hadamard matrix ([[H, H], [H, -H]], d a power of 2)."""
    d = x.shape[-1]
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < d:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return torch.nn.functional.linear(x, matrix.to(x.dtype)) * d**-0.5


class DuplicatedLinear(torch.nn.Module):
    """The whole linear layer megatron-core's DSA indexer takes from Transformer Engine's
    spec (`backend.linear()`, a TELinear with parallel_mode="duplicated"), which its local
    spec lacks: x W^T, every rank holding W."""

    def __init__(self, input_size, output_size, *, config, init_method, bias, **kwargs) -> None:
        super().__init__()
        assert not bias
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size))
        init_method(self.weight)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


def dsa_core_attention():
    """megatron-core's DSAttention spec with the stand-ins for its indexer's layers."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexer,
        DSAIndexerSubmodules,
        DSAttention,
        DSAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    indexer = DSAIndexerSubmodules(
        linear_wq_b=DuplicatedLinear,
        linear_wk=DuplicatedLinear,
        k_norm=LocalSpecProvider().layer_norm(rms_norm=False, for_qk=True),
        linear_weights_proj=DuplicatedLinear,
    )
    indexer = ModuleSpec(module=DSAIndexer, submodules=indexer)
    return ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer))


class MLACoreAttention(torch.nn.Module):
    """The core attention of megatron-core's MLA on a CPU: its local DotProductAttention takes
    no key and value head sizes of their own (Transformer Engine's does). softmax(q k^T x
    megatron-core's softmax scale, masked where the mask is True) v, in fp32."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs) -> None:
        super().__init__()
        self.softmax_scale = kwargs["softmax_scale"]

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        scores = torch.einsum("sbnd,tbnd->bnst", query.float(), key.float())
        scores = (scores * self.softmax_scale).masked_fill(attention_mask, float("-inf"))
        context = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), value.float())
        return context.flatten(2).to(query.dtype)


def indexer_rope_as_megatron_lm(self, x, rotary_pos_emb, mscale):
    """megatron-core's DSAIndexer._apply_rope as Megatron-LM has it since 0.16."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    rope = self.qk_pos_emb_head_dim
    turned, kept = torch.split(x, [rope, self.index_head_dim - rope], dim=-1)
    interleaved = getattr(self.config, "dsa_indexer_rope_interleaved", False)
    turned = _apply_rotary_pos_emb_bshd(
        turned, rotary_pos_emb, multi_latent_attention=interleaved, mscale=mscale
    )
    return torch.cat([turned, kept], dim=-1)
