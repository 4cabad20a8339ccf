"""Gated DeltaNet, the linear attention of a hybrid model's other layers (megatron-core's
`GatedDeltaNet`; Qwen3-Next), in place of a layer's self-attention:

    hidden ─ in_proj ─┬─ q, k, v ─ causal conv1d ─ SiLU ─ q, k L2-normed ─┐
                      ├─ beta ─ sigmoid (write strength) ─────────────────┤ gated delta rule
                      ├─ alpha ─ -exp(A_log) softplus(alpha + dt_bias) ───┘ (kernels/)
                      └─ z ─────────────────── out_norm(per head) x SiLU(z) ─ out_proj

`in_proj` holds megatron-core's sections [q; k; v; z; beta; alpha] in its full weight; each
is split over the TP ranks by heads (`partition_sizes`), so every rank projects, convolves and
runs the rule for its own heads, as attention does, and `out_proj` is row-parallel. A
query/key head serves --linear-num-value-heads / --linear-num-key-heads value heads. Packed
documents (the attention's mask) are convolved and solved each alone, as megatron-core's packed
sequences are. Like megatron-core it has no biases, whatever --disable-bias-linear says.

Under context parallelism each rank runs the rule for a share of the heads over the whole
sequence (model/sequence_mixing.py: megatron-core's all-to-all), and the gated norm's output
is sent back before out_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.kernels.gated_delta_rule import chunk_gated_delta_rule
from threefold.model.norms import build_norm
from threefold.model.recompute import OutputDiscardingCheckpoint
from threefold.model.sequence_mixing import (
    A_INIT_RANGE,
    causal_conv1d,
    cp_share,
    depthwise_conv,
    document_ids,
    gather_heads,
    in_projection,
    out_projection,
    split_vector,
)
from threefold.parallel.context_parallel.attention import scatter_sequence
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.sharding import InitMethod, constant_init, log_uniform_init


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the head dimension (FLA's l2norm, megatron-core's), in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
    ) -> None:
        super().__init__()
        tp, self.cp = parallel.tp.size, parallel.cp
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        # the heads this rank runs the rule for: its TP rank's, of those its CP rank's share
        self.key_heads = config.linear_num_key_heads // tp // self.cp.size
        self.value_heads = config.linear_num_value_heads // tp // self.cp.size
        sections = config.gated_delta_net_sections()
        qk, _, v, _, heads, _ = sections
        self.tp_sections = [size // tp for size in sections]  # in_proj's output on this rank
        self.local_sections = [size // self.cp.size for size in self.tp_sections]
        self.in_proj = in_projection(config, parallel, sections, init_method)
        # A depthwise causal convolution over q, k and v
        self.conv1d = depthwise_conv((qk, qk, v), config.linear_conv_kernel_dim, tp, bias=False)
        self.A_log = split_vector(heads, tp, log_uniform_init(*A_INIT_RANGE))
        self.dt_bias = split_vector(heads, tp, constant_init(1.0))
        # Over each value head: a rank sees its heads' share of the gradient.
        self.out_norm = build_norm(config, self.value_head_dim, partial_grads=True)
        self.out_proj = out_projection(v, config, parallel, output_layer_init_method)
        self.recompute_norm_out = config.recomputes("gdn_norm_out")

    def linear_layers(self) -> list[nn.Module]:
        """The layer's linear layers (those FP8 runs: model/fp8.py)."""
        return [self.in_proj, self.out_proj]

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out_norm(core) x SiLU(z) per value head, [b, s, heads, d] -> [s, b, heads * d] (this
        rank's tokens for all its TP rank's heads under CP)."""
        # SiLU of a contiguous z on every path: the recomputed norm is handed a copy, and on
        # some CPUs (AVX-512) SiLU's vectorized loop and its strided one differ by an ulp.
        gated = (self.out_norm(core) * F.silu(z.float().contiguous())).to(core.dtype)
        gated = gated.flatten(2).transpose(0, 1)
        return scatter_sequence(gated, self.cp) if self.cp.size > 1 else gated

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del rotary  # no positions: the convolution and the rule are causal
        documents = document_ids(attention_mask)  # (packed: each convolved and solved alone)
        projected = self.in_proj(hidden_states)  # [s, b, this TP rank's sections]
        projected = gather_heads(projected, self.tp_sections, self.cp)  # (CP: all tokens)
        s, b, _ = projected.shape
        q, k, v, z, beta, alpha = projected.split(self.local_sections, dim=-1)
        weight = cp_share(self.conv1d.weight, self.tp_sections[:3], self.cp)
        q, k, v = causal_conv1d(torch.cat((q, k, v), dim=-1), weight, None, documents).split(
            self.local_sections[:3], dim=-1
        )
        q = l2_normalized(q.unflatten(-1, (self.key_heads, self.key_head_dim)))
        k = l2_normalized(k.unflatten(-1, (self.key_heads, self.key_head_dim)))
        group = self.value_heads // self.key_heads
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        v = v.unflatten(-1, (self.value_heads, self.value_head_dim))
        # per value head: log decay g <= 0 and write strength, in fp32, [b, s, heads]
        a_log, dt_bias = (cp_share(t, [t.shape[0]], self.cp) for t in (self.A_log, self.dt_bias))
        g = -a_log.float().exp() * F.softplus(alpha.float() + dt_bias.float())
        g, beta = g.transpose(0, 1), beta.float().sigmoid().transpose(0, 1)
        core = chunk_gated_delta_rule(q, k, v, g, beta, documents).to(hidden_states.dtype)
        z = z.transpose(0, 1).unflatten(-1, (self.value_heads, self.value_head_dim))
        norm = OutputDiscardingCheckpoint(self.recompute_norm_out and self.training)
        if norm.enabled:  # kept for the recomputation: a copy, as a view would keep the whole
            z = z.contiguous()  # projection (autograd keeps none of it otherwise in bf16)
        output = self.out_proj(norm.checkpoint(self._gated_norm, core, z))
        norm.discard_output_and_register_recompute(output)
        return output
