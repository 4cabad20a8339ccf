"""tools/convert_checkpoint.py for GPT-OSS (GptOssForCausalLM: every part read into the flag
that computes it, the published checkpoints' MXFP4 experts), and what a Hugging Face export
refuses rather than drops. The other architectures: tests/tools/test_convert_checkpoint.py,
whose TOKENS and tool runner these share."""

import dataclasses
import os

import pytest
import torch

from tests.tools.hf_models import VOCAB, build_hf_model, convert_in_process
from tests.tools.test_convert_checkpoint import TOKENS, convert

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from threefold.checkpoint.load import load_model  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (HF model, HF directory, threefold checkpoint directory), as
    test_convert_checkpoint.py's, for the kinds these tests read."""
    out = {}
    for kind in ("llama", "mixtral", "gpt-oss"):
        root = tmp_path_factory.mktemp(kind)
        hf_dir, ours = str(root / "hf"), str(root / "threefold")
        model = build_hf_model(kind, hf_dir)
        convert_in_process(
            "--loader", "hf", "--saver", "threefold", "--load-dir", hf_dir, "--save-dir", ours
        )
        out[kind] = (model, hf_dir, ours)
    return out


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)[..., :VOCAB].transpose(0, 1)


def test_every_part_of_gpt_oss_converts_to_the_flag_that_computes_it(converted):
    """GptOssForCausalLM has biases on every linear layer (the router's too), --quick-geglu
    --glu-linear-offset 1 with its limit as --activation-func-clamp-value, learned sinks, its
    sliding layers as a window pattern and YaRN unrounded; without each, the same weights
    compute other logits than transformers' (so each reading is checked by the logits: the
    rounding of YaRN's range moves them least, 10x the tolerance here)."""
    hf_model, _, ours = converted["gpt-oss"]
    config, model, _ = load_model(ours)
    m = config.model
    assert (m.add_bias_linear, m.quick_geglu, m.glu_linear_offset) == (True, True, 1.0)
    assert (m.activation_func_clamp_value, m.softmax_type) == (0.1, "learnable")
    assert (m.window_size, m.window_pattern(4)) == ("7,0", [1, 0, 1, 0])
    assert (m.position_embedding_type, m.yarn_correction_range_round_to_int) == ("yarn", False)
    expected = hf_model(TOKENS).logits.detach()
    tolerance = 1e-4 * expected.abs().max()
    assert (_logits(model) - expected).abs().max() < tolerance
    for field, off in (
        ("activation_func_clamp_value", None),
        ("window_size", None),
        ("yarn_correction_range_round_to_int", True),
    ):
        other = dataclasses.replace(m, **{field: off})
        if field == "window_size":
            other.window_attn_skip_freq = None
        changed = _with_weights(other, model)
        assert (_logits(changed) - expected).abs().max() > 5 * tolerance, field
    without_router_bias = _with_weights(m, model)
    with torch.no_grad():
        for layer in without_router_bias.decoder.layers:
            layer.mlp.router.bias.zero_()
    assert (_logits(without_router_bias) - expected).abs().max() > 5 * tolerance


def _with_weights(model_config, model):
    from threefold.model import GPTModel

    other = GPTModel(model_config, model.padded_vocab_size)
    other.load_state_dict(model.state_dict())
    return other.eval()


def _mxfp4(weight: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks and exponents in the layout of a stacked expert weight [experts,
    in, out] (stored [experts, out, in / 32, 16]), near its scale."""
    experts, inputs, outputs = weight.shape
    blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=generator)
    scales = torch.randint(118, 124, (experts, outputs, inputs // 32), generator=generator)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_mxfp4_experts_of_the_published_gpt_oss_checkpoints_are_read_exactly(converted, tmp_path):
    """gpt-oss-20b and -120b store their experts' weights in MXFP4 (`*_blocks`, `*_scales`,
    config.json's quantization_config): they are read as transformers dequantizes them, bit
    for bit, and the model computes the logits of transformers' model holding those weights."""
    import json
    import shutil

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from threefold.checkpoint.hf.gpt_oss import dequantize_mxfp4

    hf_model, hf_dir, _ = converted["gpt-oss"]
    quantized = str(tmp_path / "mxfp4")
    shutil.copytree(hf_dir, quantized)
    tensors = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    reference = type(hf_model)(hf_model.config)
    reference.load_state_dict(hf_model.state_dict())
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _mxfp4(tensors.pop(name), generator)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            exact = dequantize_mxfp4(blocks, scales)  # (a bf16 holds every value)
            assert torch.equal(exact.bfloat16().float(), exact)
            with torch.no_grad():
                reference.get_parameter(name).copy_(dequantized)
    safetensors_torch.save_file(tensors, os.path.join(quantized, "model.safetensors"))
    with open(os.path.join(quantized, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(quantized, "config.json"), "w") as f:
        json.dump(config, f)
    ours = str(tmp_path / "threefold")
    convert_in_process(
        "--loader", "hf", "--saver", "threefold", "--load-dir", quantized, "--save-dir", ours
    )
    _, model, _ = load_model(ours)
    fc1 = model.decoder.layers[0].mlp.experts.local_experts["1"].linear_fc1.weight
    stacked = reference.get_parameter("model.layers.0.mlp.experts.gate_up_proj")[1].t()
    assert torch.equal(fc1, torch.cat([stacked[0::2], stacked[1::2]]))
    expected = reference.eval()(TOKENS).logits.detach()
    assert (_logits(model) - expected).abs().max() < 1e-4 * expected.abs().max()
    assert (expected - hf_model(TOKENS).logits).abs().max() > 1e-2  # (other weights)
    config["quantization_config"] = {"quant_method": "fp8"}
    with open(os.path.join(quantized, "config.json"), "w") as f:
        json.dump(config, f)
    result = convert(
        "--loader",
        "hf",
        "--saver",
        "threefold",
        "--load-dir",
        quantized,
        "--save-dir",
        str(tmp_path / "refused"),
    )
    assert result.returncode == 2, result.stderr
    assert "quantization_config.quant_method='fp8'" in result.stderr


@pytest.mark.parametrize(
    "kind,change,said",
    [
        ("llama", {"softmax_type": "learnable"}, "has no attention sinks"),
        ("mixtral", {"softmax_type": "off-by-one"}, "has no attention sinks"),
        ("mixtral", {"swiglu": False, "quick_geglu": True}, "has no quick-GELU GLU MLPs"),
        ("gpt-oss", {"softmax_type": "off-by-one"}, "no learned sinks"),
        ("gpt-oss", {"add_bias_linear": False}, "no biases"),
        ("mixtral", {"moe_expert_capacity_factor": 1.0}, "drops no tokens"),
        ("gpt-oss", {"moe_router_topk_scaling_factor": 2.5}, "does not scale its routing"),
    ],
    ids=[
        "llama-sinks",
        "mixtral-off-by-one",
        "mixtral-quick-geglu",
        "gpt-oss-off-by-one",
        "gpt-oss-no-biases",
        "mixtral-capacity",
        "gpt-oss-scaled-routing",
    ],
)
def test_what_an_architecture_cannot_hold_is_refused_not_dropped(converted, kind, change, said):
    """A model with sinks or GPT-OSS's MLP exported as an architecture without them would lose
    them silently, as would experts with a capacity or scaled routing weights exported as
    architectures that have neither: refused in one line (and GPT-OSS's own needs)."""
    from threefold.checkpoint.hf import threefold_to_hf
    from threefold.config import ConfigError

    config, _, _ = load_model(converted[kind][2])
    architecture = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}.get(
        kind, "GptOssForCausalLM"
    )
    with pytest.raises(ConfigError, match=said):
        threefold_to_hf({}, dataclasses.replace(config.model, **change), architecture)


def test_a_tensor_no_hugging_face_name_carries_is_refused_not_dropped(converted):
    """Any parameter an architecture's export does not write (a part its adapter has no name
    for) stops the export in one line naming it, where it would have been left behind."""
    from threefold.checkpoint.hf import threefold_to_hf
    from threefold.config import ConfigError

    config, model, _ = load_model(converted["llama"][2])
    state = {name: param.detach() for name, param in model.named_parameters()}
    assert threefold_to_hf(state, config.model, "LlamaForCausalLM")  # (all of it written)
    state["decoder.layers.1.self_attention.extra_scale"] = torch.ones(4)
    with pytest.raises(ConfigError, match="no place for decoder.layers.1.self_attention.extra"):
        threefold_to_hf(state, config.model, "LlamaForCausalLM")
