"""GptOssForCausalLM (OpenAI's gpt-oss-20b and -120b): a mixture of experts whose every
linear layer, the router's included, carries a bias (no --disable-bias-linear), with megatron-core's
names for its parts:

    MLP        quick_gelu(gate) x (up + 1), the gate clamped above at swiglu_limit and up to
               [-limit, limit] (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value)
    attention  a learned sink logit per head beside each row's scores (--softmax-type
               learnable: `self_attn.sinks` = `self_attention.core_attention.softmax_offset`),
               a sliding window in the layers `layer_types` names (--window-size W-1,0 with a
               --window-attn-skip-freq pattern), YaRN with its range unrounded (truncate false)
    routing    the softmax over the top-k logits of `router` (weight and bias), as Mixtral's

Its experts are stacked and transposed, gate and up interleaved by column:

    gate_up_proj [experts, hidden, 2 x ffn]  columns 0, 2, 4 ... gate, 1, 3, 5 ... up
    down_proj    [experts, ffn, hidden]
    threefold    mlp.experts.local_experts.{e}.linear_fc1 = [gate; up] rows, linear_fc2 = down

The published checkpoints store the experts' weights in MXFP4 (`*_blocks`: two 4-bit E2M1
values a byte, low nibble first; `*_scales`: one power-of-two exponent, biased by 127, per 32
values along the input dimension); they are read exactly, in the biases' dtype (every such
value is a bf16). An export writes plain weights, which transformers loads without a
quantization_config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.checkpoint.hf.common import Take, refuse
from threefold.checkpoint.hf.moe import MoEAdapter
from threefold.config import ConfigError, ModelConfig

QUICK_GELU_ALPHA = 1.702  # x * sigmoid(1.702 x): megatron-core's quick_gelu
# E2M1's sixteen values by their 4 bits (sign, 2 exponent bits, 1 mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = FP4_VALUES + tuple(-v for v in FP4_VALUES)
MXFP4_BLOCK = 32  # values per shared exponent


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, groups, 16] bytes and [..., rows, groups] exponents -> [..., rows, groups x
    32] fp32 (each byte's low nibble first)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ConfigError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
            f"({MXFP4_BLOCK // 2} bytes per scale)"
        )
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values.flatten(-2), exponents.unsqueeze(-1)).flatten(-2)


@dataclass(frozen=True)
class GptOssAdapter(MoEAdapter):
    sinks = True

    def model_config(self, hf: dict) -> ModelConfig:
        alpha = hf.get("swiglu_alpha", QUICK_GELU_ALPHA)
        refuse(
            alpha != QUICK_GELU_ALPHA,
            "swiglu_alpha",
            alpha,
            f"threefold's --quick-geglu is x * sigmoid({QUICK_GELU_ALPHA} x)",
        )
        refuse(
            not hf.get("attention_bias", True),
            "attention_bias",
            hf.get("attention_bias"),
            "threefold puts biases on every linear layer or none (--disable-bias-linear), and "
            "GPT-OSS's experts and router have them",
        )
        quantization = (hf.get("quantization_config") or {}).get("quant_method")
        refuse(
            quantization not in (None, "mxfp4"),
            "quantization_config.quant_method",
            quantization,
            "threefold reads plain and MXFP4 weights",
        )
        limit = hf.get("swiglu_limit", 7.0)
        refuse(limit is None or limit <= 0, "swiglu_limit", limit, "must be a positive clamp")
        # The LLaMA family's reading of the rest, biases everywhere and the windows read below.
        plain = {**hf, "mlp_bias": True, "attention_bias": True, "sliding_window": None}
        config = super().model_config(plain)
        config.swiglu, config.quick_geglu = False, True
        config.glu_linear_offset, config.activation_func_clamp_value = 1.0, float(limit)
        config.softmax_type = "learnable"
        kinds = hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]
        pattern = [int(kind == "sliding_attention") for kind in kinds]
        if any(pattern):
            config.window_size = f"{hf['sliding_window'] - 1},0"  # the query's own key counts
            if not all(pattern):
                config.window_attn_skip_freq = "[" + ",".join(map(str, pattern)) + "]"
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        problems = [
            (not config.add_bias_linear, "no biases (GPT-OSS's linear layers all have them)"),
            (
                not config.quick_geglu or config.glu_linear_offset != 1.0,
                "another MLP (GPT-OSS's is --quick-geglu --glu-linear-offset 1)",
            ),
            (
                config.activation_func_clamp_value is None,
                "no --activation-func-clamp-value (GPT-OSS clamps at swiglu_limit)",
            ),
            (config.softmax_type != "learnable", "no learned sinks (--softmax-type learnable)"),
            (config.moe_router_score_function != "softmax", "--moe-router-score-function"),
            (config.moe_router_pre_softmax, "--moe-router-pre-softmax"),
            (config.moe_shared_expert_intermediate_size, "a shared expert"),
            (not all(self._pattern(config)), "dense layers (--moe-layer-freq)"),
            (config.qk_layernorm or config.add_qkv_bias, "--qk-layernorm or --add-qkv-bias"),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        for key in ("router_jitter_noise", "hidden_act"):
            hf.pop(key, None)
        pattern = config.window_pattern(config.num_layers)
        window = config.attention_window()
        hf.update(
            attention_bias=True,
            swiglu_alpha=QUICK_GELU_ALPHA,
            swiglu_limit=config.activation_func_clamp_value,
            layer_types=["sliding_attention" if w else "full_attention" for w in pattern],
            # (read only by sliding layers; transformers wants a number all the same)
            sliding_window=128 if window is None else window + 1,
        )
        return hf

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = super().take_weights(take, config, used)
        for i in range(config.num_layers):
            sinks = take(f"model.layers.{i}.self_attn.sinks")
            out[f"decoder.layers.{i}.self_attention.core_attention.softmax_offset"] = sinks
        return out

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = super().give_weights(state, config)
        for i in range(config.num_layers):
            sinks = state[f"decoder.layers.{i}.self_attention.core_attention.softmax_offset"]
            out[f"model.layers.{i}.self_attn.sinks"] = sinks
        return out

    @staticmethod
    def _experts(take: Take, p: str, name: str) -> torch.Tensor:
        """A stacked expert weight as transformers holds it ([experts, in, out]), from plain
        or MXFP4 weights (stored [experts, out, in / 32, 16]), these in the dtype of the
        expert's biases: every MXFP4 value is a bf16 too, and a 20B model's experts take
        half the memory in it. One expert at a time in fp32."""
        if p + name + "_blocks" not in take:
            return take(p + name)
        blocks, scales = take(p + name + "_blocks"), take(p + name + "_scales")
        dtype = take(p + name + "_bias").dtype
        experts = [dequantize_mxfp4(b, s).to(dtype).t() for b, s in zip(blocks, scales)]
        return torch.stack(experts)

    def take_mlp(self, take: Take, config: ModelConfig, i: int) -> dict:
        ours, p = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        out = {ours + "router.weight": take(p + "router.weight")}
        out[ours + "router.bias"] = take(p + "router.bias")
        gate_up = self._experts(take, p, "experts.gate_up_proj")
        down = self._experts(take, p, "experts.down_proj")
        gate_up_bias = take(p + "experts.gate_up_proj_bias")
        down_bias = take(p + "experts.down_proj_bias")
        for e in range(config.num_experts):
            expert = f"{ours}experts.local_experts.{e}."
            rows = gate_up[e].t()  # [2 x ffn, hidden], gate and up interleaved
            out[expert + "linear_fc1.weight"] = torch.cat([rows[0::2], rows[1::2]])
            bias = gate_up_bias[e]
            out[expert + "linear_fc1.bias"] = torch.cat([bias[0::2], bias[1::2]])
            out[expert + "linear_fc2.weight"] = down[e].t()
            out[expert + "linear_fc2.bias"] = down_bias[e]
        return out

    def give_mlp(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        ours, p = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        experts = [f"{ours}experts.local_experts.{e}." for e in range(config.num_experts)]

        def interleaved(name: str) -> torch.Tensor:
            stacked = torch.stack([state[expert + name] for expert in experts])
            gate, up = stacked.chunk(2, dim=1)
            return torch.stack([gate, up], dim=2).flatten(1, 2)  # rows gate0, up0, gate1 ...

        return {
            p + "router.weight": state[ours + "router.weight"],
            p + "router.bias": state[ours + "router.bias"],
            p + "experts.gate_up_proj": interleaved("linear_fc1.weight").transpose(1, 2),
            p + "experts.gate_up_proj_bias": interleaved("linear_fc1.bias"),
            p + "experts.down_proj": torch.stack(
                [state[expert + "linear_fc2.weight"].t() for expert in experts]
            ),
            p + "experts.down_proj_bias": torch.stack(
                [state[expert + "linear_fc2.bias"] for expert in experts]
            ),
        }


GPT_OSS = GptOssAdapter("GptOssForCausalLM", "gpt_oss", windows_by_layer=True, writes_biases=False)
