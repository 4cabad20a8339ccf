"""The LLaMA layer's kin in and out (threefold/checkpoint/hf/llama_kin.py), each one choice of
its own: ERNIE 4.5 (RoPE on adjacent pairs, use_bias), Helium (pairs), Seed-OSS (biases on q, k
and v alone), Arcee (a squared-ReLU MLP without a gate); and GLM-4 (hf/glm4.py: four norms a
layer, RoPE on pairs of half of each head, q, k, v biases, a fused gate and up). A tiny one of
each gives transformers' logits, and other logits with its choice undone; a bitwise round trip
that transformers loads; its per-token losses at TP2 + SP. A threefold model of the LLaMA layer
with --squared-relu exports as Arcee; what a family cannot express is refused in one line."""

from __future__ import annotations

import pytest
import torch

from tests.tools.hf_models import VOCAB, converted_hf_model, has_transformers
from threefold.arguments import parse_args
from threefold.checkpoint.hf import model_config_from_hf, threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)


from tests.tools.hf_checks import (  # noqa: E402
    TOKENS,
    TOKENS_25,
    assert_exports_as,
    assert_layout_losses,
    assert_round_trip,
    logits_with,
    relative_error,
)

# kind -> (what its conversion sets, its own choice undone)
KIN = {
    "ernie4_5": ({"rotary_interleaved": True, "add_bias_linear": True}, {"rotary_interleaved": 0}),
    "helium": ({"rotary_interleaved": True, "add_bias_linear": False}, {"rotary_interleaved": 0}),
    # (Seed-OSS's residual_dropout, 0.1 by default, is --hidden-dropout)
    "seed-oss": ({"add_qkv_bias": True, "hidden_dropout": 0.1}, {"add_qkv_bias": False}),
    "arcee": ({"squared_relu": True, "swiglu": False}, {"squared_relu": False}),
    # (GLM-4: hf/glm4.py; its norms after the sublayers undone)
    "glm4": ({"post_sublayer_norm": True, "rotary_percent": 0.5}, {"post_sublayer_norm": False}),
}


@pytest.fixture(scope="module", params=list(KIN))
def converted(request, tmp_path_factory):
    """(kind, transformers' model, its directory, threefold's checkpoint of it)."""
    return request.param, *converted_hf_model(request.param, tmp_path_factory.mktemp("kin"))


def test_logits_are_transformers_and_the_familys_choice_does_its_part(converted):
    kind, hf_model, _, ours = converted
    fields, undone = KIN[kind]
    config, _, _ = load_model(ours)
    assert {name: getattr(config.model, name) for name in fields} == fields
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        assert relative_error(logits_with(ours, TOKENS), expected) < 1e-5
        assert relative_error(logits_with(ours, TOKENS, **undone), expected) > 1e-3


def test_round_trip_is_bitwise_and_tp2_sp_computes_transformers_losses(converted, tmp_path):
    kind, hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert_layout_losses(hf_model, ours, 2, layout, TOKENS_25)


ARCEE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
ARCEE += ["--group-query-attention", "--num-query-groups", "2", "--squared-relu"]
ARCEE += ["--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type"]
ARCEE += ["rope", "--untie-embeddings-and-output-weights", "--mock-data"]
ARCEE += ["--vocab-size", str(VOCAB), "--seq-length", "24", "--micro-batch-size", "2"]
ARCEE += ["--train-iters", "1"]


def test_the_llama_layer_with_a_squared_relu_exports_as_arcee(tmp_path):
    assert assert_exports_as(ARCEE, tmp_path, "ArceeForCausalLM")["hidden_act"] == "relu2"


def test_what_the_kin_cannot_express_is_refused():
    config = parse_args([flag for flag in ARCEE if flag != "--squared-relu"] + ["--swiglu"]).model
    with pytest.raises(ConfigError, match="RoPE on halves"):
        threefold_to_hf({}, config, "HeliumForCausalLM")
    with pytest.raises(ConfigError, match="layers other than four norms"):
        threefold_to_hf({}, config, "Glm4ForCausalLM")
    hf = {"architectures": ["SeedOssForCausalLM"], "attention_out_bias": True}
    hf.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="attention_out_bias=True"):
        model_config_from_hf({**hf, "num_attention_heads": 4})
