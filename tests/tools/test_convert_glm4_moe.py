"""Hugging Face's Glm4MoeForCausalLM (GLM-4.5/4.6/4.7: grouped-query attention with biases on q,
k and v, head norms and RoPE on half of each head; DeepSeek-V3's routing) beside what
tests/tools/test_convert_checkpoint.py runs for every family (logits, the round trip bitwise,
the live model's stacked experts, PP2 x EP2 losses): the Hub's spelling of its config, the
half rotation doing its part, a model trained in threefold exported by its routing, and what
GLM cannot express refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tools.hf_models import VOCAB, converted_hf_model, has_transformers
from threefold.arguments import parse_args
from threefold.checkpoint.hf import model_config_from_hf, threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)


from tests.tools.hf_checks import assert_exports_as  # noqa: E402

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, its directory, threefold's checkpoint of it)."""
    return converted_hf_model("glm4-moe", tmp_path_factory.mktemp("glm4_moe"))


def test_the_hub_spelling_of_the_config_reads_the_same(converted):
    """The Hub's GLM-4.5 configs keep partial_rotary_factor and rope_theta at the top level
    (transformers 5 moves them into rope_parameters)."""
    _, hf_dir, _ = converted
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    _, expected = model_config_from_hf(hf)
    parameters = hf.pop("rope_parameters")
    hub = {**hf, "partial_rotary_factor": 0.5, "rope_theta": parameters["rope_theta"]}
    architecture, config = model_config_from_hf(hub)
    assert architecture == "Glm4MoeForCausalLM" and config == expected
    assert (config.rotary_percent, config.add_qkv_bias, config.qk_layernorm) == (0.5, True, True)
    assert (config.add_bias_linear, config.moe_router_num_groups, config.moe_layer_freq) == (
        False,
        4,
        "[0,1,1,1]",
    )


def test_rope_on_half_of_each_head_is_what_transformers_computes(converted):
    """Turning every dimension instead gives other logits: the half rotation is exercised."""
    hf_model, _, ours = converted
    config, model, _ = load_model(ours)
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        logits = model(TOKENS)[..., :VOCAB].transpose(0, 1)
        assert (logits - expected).abs().max() / expected.abs().max() < 1e-4
        from threefold.model import GPTModel

        config.model.rotary_percent = 1.0
        whole = GPTModel(config.model, model.padded_vocab_size)
        whole.load_state_dict(model.state_dict())
        other = whole(TOKENS)[..., :VOCAB].transpose(0, 1)
    assert (other - expected).abs().max() / expected.abs().max() > 1e-3


GLM = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
GLM += ["--group-query-attention", "--num-query-groups", "2", "--add-qkv-bias"]
GLM += ["--qk-layernorm", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear"]
GLM += ["--position-embedding-type", "rope", "--rotary-percent", "0.5"]
GLM += ["--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk"]
GLM += ["2", "--moe-router-score-function", "sigmoid", "--moe-ffn-hidden-size", "32"]
GLM += ["--moe-shared-expert-intermediate-size", "32", "--mock-data", "--vocab-size"]
GLM += [str(VOCAB), "--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "1"]


def test_a_model_trained_with_deepseek_routing_exports_as_glm(tmp_path):
    """A threefold model of grouped-query attention with sigmoid routing (no expert bias, no
    groups) is GLM-4.5's: the export's guess, and transformers computes threefold's logits."""
    assert_exports_as(GLM, tmp_path, "Glm4MoeForCausalLM")


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--use-rope-scaling"], "position embeddings besides plain RoPE"),
        (["--rotary-interleaved"], "regrouping part of each head is not implemented"),
        (["--moe-router-score-function", "softmax"], "softmax routing scores"),
        (["--moe-router-num-groups", "2", "--moe-router-group-topk", "2"], "top 2 experts"),
    ],
    ids=["rope-scaling", "interleaved-part", "softmax", "groups"],
)
def test_a_model_glm_cannot_express_is_refused(flags, named):
    config = parse_args(GLM + flags).model
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, config, "Glm4MoeForCausalLM")


def test_biased_mlps_are_refused_by_name(converted):
    _, hf_dir, _ = converted
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = {**json.load(f), "mlp_bias": True}
    with pytest.raises(ConfigError, match="mlp_bias=True"):
        model_config_from_hf(hf)
