"""Qwen3NextForCausalLM: Gated DeltaNet layers among gated attention ones, a mixture of experts
with a gated shared expert (threefold's --experimental-attention-variant gated_delta_net,
--attention-output-gate, --moe-shared-expert-gate; model/gated_delta_net.py).

Hugging Face groups a gated delta net's projections by query/key head, threefold (as
megatron-core) by section:

    HF in_proj_qkvz   per key head g: [q_g; k_g; v of g's value heads; z of g's value heads]
    HF in_proj_ba     per key head g: [beta of g's value heads; alpha of g's value heads]
    threefold in_proj [q; k; v; z; beta; alpha], each over all heads in the same head order

and its attention's q_proj holds each head's query then its gate, where threefold's linear_qkv
holds, per query group, the group's queries, their gates, then key and value. The convolution
(over [q; k; v]), A_log, dt_bias and out_proj map as they are. Qwen3-Next's norms scale by
(1 + weight), --apply-layernorm-1p's: imported models take it and the weights as they are; the
gated delta net's output norm is the exception, a plain weight in Hugging Face (threefold's
follows --apply-layernorm-1p, as megatron-core's does). RoPE turns partial_rotary_factor of
each head (--rotary-percent). Routing and the experts are Qwen3-MoE's (hf/moe.py).

The Hub checkpoints' multi-token prediction module (`mtp.*`; num_nextn_predict_layers 1) is a
depth (--mtp-num-layers 1, model/mtp.py): `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`
and `norm` are its enorm, hnorm, eh_proj and final norm, `mtp.layers.0` its gated attention
layer with experts, the last decoder layer's kind. (With more than one, vLLM's steps share one
fc and its norms around a layer each, which threefold's depths, each with its own, are not.)
transformers computes none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import Take, refuse
from threefold.checkpoint.hf.moe import MoEAdapter
from threefold.checkpoint.hf.mtp_layers import DepthAsDecoder, RenamedSource, as_depth
from threefold.config import ModelConfig

LINEAR, FULL = "linear_attention", "full_attention"
# the depth's own tensors: threefold's under mtp.layers.0. -> the file's
_MTP_PARTS = {
    "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "eh_proj.weight": "mtp.fc.weight",
    "final_layernorm.weight": "mtp.norm.weight",
}


def _sizes(config: ModelConfig) -> tuple[int, int, int, int]:
    """(key heads, value heads per key head, key head size, value head size)."""
    keys, values = config.linear_num_key_heads, config.linear_num_value_heads
    return keys, values // keys, config.linear_key_head_dim, config.linear_value_head_dim


@dataclass(frozen=True)
class Qwen3NextAdapter(MoEAdapter):
    exports_qwen3_next: ClassVar[bool] = True
    exports_mtp: ClassVar[bool] = True  # (one depth: the module)
    partial_rope: ClassVar[bool] = True
    zero_centered_norms: ClassVar[bool] = True
    gated_shared_expert: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        config = super().model_config(hf)
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types") or [
            LINEAR if (i + 1) % hf.get("full_attention_interval", 4) else FULL
            for i in range(layers)
        ]
        refuse(set(types) - {LINEAR, FULL}, "layer_types", types, f"{LINEAR} or {FULL} only")
        pattern = [int(kind == LINEAR) for kind in types]
        parameters = hf.get("rope_parameters") or {}
        partial = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        config.experimental_attention_variant = "gated_delta_net" if any(pattern) else None
        if any(pattern):
            config.linear_attention_freq = str(pattern).replace(" ", "")
            for name in ("linear_conv_kernel_dim", "linear_key_head_dim"):
                setattr(config, name, hf[name])
            for name in ("linear_value_head_dim", "linear_num_key_heads"):
                setattr(config, name, hf[name])
            config.linear_num_value_heads = hf["linear_num_value_heads"]
        config.attention_output_gate = True
        config.apply_layernorm_1p = True
        config.rotary_percent = float(partial)
        depths = hf.get("num_nextn_predict_layers") or 0
        refuse(depths > 1, "num_nextn_predict_layers", depths, "one depth (its fc and norms)")
        refuse(
            depths and types[-1] != FULL,
            "layer_types",
            types[-1],
            "the last layer of gated attention, the kind of the depth's (as megatron-core builds "
            "a depth)",
        )
        config.mtp_num_layers = depths or None
        return config

    def depth_marker(self, config: ModelConfig, k: int) -> str | None:
        return "mtp.fc.weight" if k == 0 else None

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        problems = [
            (not config.attention_output_gate, "attention without --attention-output-gate"),
            (config.normalization != "RMSNorm", f"--normalization {config.normalization}"),
            (config.mtp_depths_built() > 1, "more than one multi-token prediction depth"),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        pattern = config.linear_attention_pattern(config.num_layers)
        hf.update(
            layer_types=[LINEAR if linear else FULL for linear in pattern],
            partial_rotary_factor=config.rotary_percent,
            linear_conv_kernel_dim=config.linear_conv_kernel_dim,
            linear_key_head_dim=config.linear_key_head_dim,
            linear_value_head_dim=config.linear_value_head_dim,
            linear_num_key_heads=config.linear_num_key_heads,
            linear_num_value_heads=config.linear_num_value_heads,
            num_nextn_predict_layers=config.mtp_depths_built(),
        )
        return hf

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = self.take_ends(take, config, used)
        linear = config.linear_attention_pattern(config.num_layers)
        for i in range(config.num_layers):
            out.update(self._take_layer(take, config, i, bool(linear[i])))
        if config.mtp_num_layers:  # the module's layer, read as a decoder layer after the last
            i = config.num_layers
            layer = self._take_layer(
                RenamedSource(take, f"model.layers.{i}.", "mtp.layers.0."), config, i, False
            )
            out.update(as_depth(layer, i, 0))
            out.update({f"mtp.layers.0.{n}": take(part) for n, part in _MTP_PARTS.items()})
        return out

    def _take_layer(self, take: Take, config: ModelConfig, i: int, linear: bool) -> dict:
        ours, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        out = {
            ours + "input_layernorm.weight": take(p + "input_layernorm.weight"),
            ours + "pre_mlp_layernorm.weight": take(p + "post_attention_layernorm.weight"),
        }
        attention = self._take_linear if linear else self._take_gated_attention
        out.update(attention(take, config, ours + "self_attention.", p))
        return out | self.take_mlp(take, config, i)

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = self.give_ends(state, config)
        linear = config.linear_attention_pattern(config.num_layers)
        for i in range(config.num_layers):
            out.update(self._give_layer(state, config, i, bool(linear[i])))
        if config.mtp_num_layers:  # (written where the module's layer is, `mtp.layers.0.`)
            i, depth = config.num_layers, "mtp.layers.0.transformer_layer."
            layer = self._give_layer(
                DepthAsDecoder(state, depth, f"decoder.layers.{i}."), config, i, False
            )
            decoder = f"model.layers.{i}."
            out.update({"mtp.layers.0." + n.removeprefix(decoder): t for n, t in layer.items()})
            out.update({part: state[f"mtp.layers.0.{n}"] for n, part in _MTP_PARTS.items()})
        return out

    def _give_layer(self, state: dict, config: ModelConfig, i: int, linear: bool) -> dict:
        ours, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        out = {
            p + "input_layernorm.weight": state[ours + "input_layernorm.weight"],
            p + "post_attention_layernorm.weight": state[ours + "pre_mlp_layernorm.weight"],
        }
        attention = self._give_linear if linear else self._give_gated_attention
        out.update(attention(state, config, ours + "self_attention.", p))
        return out | self.give_mlp(state, config, i)

    @staticmethod
    def _take_gated_attention(take: Take, config: ModelConfig, ours: str, p: str) -> dict:
        heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
        query_gate = take(p + "self_attn.q_proj.weight").view(heads, 2, d, -1)
        per_group = [t.reshape(groups, -1, d, t.shape[-1]) for t in query_gate.unbind(1)]
        key_value = [take(p + f"self_attn.{x}_proj.weight").view(groups, 1, d, -1) for x in "kv"]
        qkv = torch.cat([*per_group, *key_value], dim=1)
        return {
            ours + "linear_qkv.weight": qkv.reshape(-1, qkv.shape[-1]),
            ours + "q_layernorm.weight": take(p + "self_attn.q_norm.weight"),
            ours + "k_layernorm.weight": take(p + "self_attn.k_norm.weight"),
            ours + "linear_proj.weight": take(p + "self_attn.o_proj.weight"),
        }

    @staticmethod
    def _give_gated_attention(state: dict, config: ModelConfig, ours: str, p: str) -> dict:
        heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
        per_group = heads // groups
        qkv = state[ours + "linear_qkv.weight"].view(groups, 2 * per_group + 2, d, -1)
        query, gate, key, value = qkv.split([per_group, per_group, 1, 1], dim=1)
        query_gate = torch.stack([query.reshape(heads, d, -1), gate.reshape(heads, d, -1)], 1)
        return {
            p + "self_attn.q_proj.weight": query_gate.reshape(heads * 2 * d, -1),
            p + "self_attn.k_proj.weight": key.reshape(groups * d, -1),
            p + "self_attn.v_proj.weight": value.reshape(groups * d, -1),
            p + "self_attn.q_norm.weight": state[ours + "q_layernorm.weight"],
            p + "self_attn.k_norm.weight": state[ours + "k_layernorm.weight"],
            p + "self_attn.o_proj.weight": state[ours + "linear_proj.weight"],
        }

    @staticmethod
    def _take_linear(take: Take, config: ModelConfig, ours: str, p: str) -> dict:
        keys, group, d_k, d_v = _sizes(config)
        q = p + "linear_attn."
        qkvz = take(q + "in_proj_qkvz.weight").view(keys, 2 * d_k + 2 * group * d_v, -1)
        ba = take(q + "in_proj_ba.weight").view(keys, 2 * group, -1)
        parts = [*qkvz.split([d_k, d_k, group * d_v, group * d_v], 1), *ba.split(group, 1)]
        # the output norm: Hugging Face's plain weight, threefold's centred under 1p
        shift = 1 if config.apply_layernorm_1p else 0
        return {
            ours + "in_proj.weight": torch.cat([t.reshape(-1, t.shape[-1]) for t in parts]),
            ours + "conv1d.weight": take(q + "conv1d.weight"),
            ours + "A_log": take(q + "A_log"),
            ours + "dt_bias": take(q + "dt_bias"),
            ours + "out_norm.weight": take(q + "norm.weight") - shift,
            ours + "out_proj.weight": take(q + "out_proj.weight"),
        }

    @staticmethod
    def _give_linear(state: dict, config: ModelConfig, ours: str, p: str) -> dict:
        keys, group, d_k, d_v = _sizes(config)
        q, v = keys * d_k, keys * group * d_v
        in_proj = state[ours + "in_proj.weight"]
        parts = in_proj.split([q, q, v, v, keys * group, keys * group])
        by_head = [t.reshape(keys, -1, t.shape[-1]) for t in parts]
        shift = 1 if config.apply_layernorm_1p else 0
        p += "linear_attn."
        return {
            p + "in_proj_qkvz.weight": torch.cat(by_head[:4], 1).reshape(-1, in_proj.shape[-1]),
            p + "in_proj_ba.weight": torch.cat(by_head[4:], 1).reshape(-1, in_proj.shape[-1]),
            p + "conv1d.weight": state[ours + "conv1d.weight"],
            p + "A_log": state[ours + "A_log"],
            p + "dt_bias": state[ours + "dt_bias"],
            p + "norm.weight": state[ours + "out_norm.weight"] + shift,
            p + "out_proj.weight": state[ours + "out_proj.weight"],
        }


QWEN3_NEXT = Qwen3NextAdapter(
    "Qwen3NextForCausalLM",
    "qwen3_next",
    qk_norm=True,
    writes_biases=False,
    extra_hf_config={"attention_bias": False},
    renormalizes_always=False,
)
