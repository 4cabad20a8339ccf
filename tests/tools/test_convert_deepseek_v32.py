"""Hugging Face's DeepseekV32ForCausalLM (DeepSeek-V3.2: DeepSeek-V3's multi-latent attention
with DeepSeek sparse attention's indexer) in and out of threefold, against transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.model.test_dsa import DSA, INDEXER
from tests.parity import TRAINING
from tests.tools.hf_models import VOCAB, convert_in_process, converted_hf_model, has_transformers
from threefold.arguments import parse_args
from threefold.checkpoint.hf import threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)

import safetensors.torch as safetensors_torch  # noqa: E402
import transformers  # noqa: E402

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, its directory, threefold's checkpoint of it)."""
    return converted_hf_model("deepseek-v32", tmp_path_factory.mktemp("deepseek_v32"))


def test_logits_are_transformers_and_the_indexer_chooses(converted):
    """Each of 24 tokens attends to the 6 keys its indexer picks: transformers' logits (1e-4
    of the largest, as every conversion's); all keys (top 24) give other logits."""
    hf_model, _, ours = converted
    config, model, _ = load_model(ours)
    assert config.model.sparse_attention and config.model.dsa_indexer_topk == 6
    assert config.model.dsa_indexer_k_norm_epsilon == 1e-6
    with torch.no_grad():
        logits = model(TOKENS)[..., :VOCAB].transpose(0, 1)
        expected = hf_model(TOKENS).logits
        assert (logits - expected).abs().max() / expected.abs().max() < 1e-4
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.indexer.topk = 24
        dense = model(TOKENS)[..., :VOCAB].transpose(0, 1)
    assert (dense - expected).abs().max() / expected.abs().max() > 1e-2


def test_round_trip_is_bitwise_and_transformers_loads_the_export(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    exported = str(tmp_path / "exported")
    convert_in_process(
        "--loader", "threefold", "--saver", "hf", "--load-dir", ours, "--save-dir", exported
    )
    with open(os.path.join(exported, "config.json")) as f:
        assert json.load(f)["architectures"] == ["DeepseekV32ForCausalLM"]
    before = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    after = safetensors_torch.load_file(os.path.join(exported, "model.safetensors"))
    assert before.keys() == after.keys()
    assert sum(".self_attn.indexer." in name for name in after) == 4 * 5
    for name in before:
        assert torch.equal(before[name], after[name]), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        exported, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, hf_model(TOKENS).logits)


@pytest.mark.parametrize(
    "flags,named",
    [
        ([], "DeepseekV32ForCausalLM cannot express this model: an indexer key norm of epsilon"),
        (
            ["--dsa-indexer-k-norm-epsilon", "1e-6", "--dsa-indexer-rope-interleaved"],
            "the indexer's RoPE turned MLA's way",
        ),
    ],
)
def test_a_sparse_model_deepseek_v32_cannot_express_is_refused(flags, named):
    config = parse_args(DSA + TRAINING + flags).model
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, config, "DeepseekV32ForCausalLM")


def test_deepseek_v3_refuses_a_sparse_model_naming_v32():
    config = parse_args(DSA + TRAINING + ["--dsa-indexer-k-norm-epsilon", "1e-6"]).model
    with pytest.raises(ConfigError, match=r"sparse attention \(DeepseekV32ForCausalLM has it\)"):
        threefold_to_hf({}, config, "DeepseekV3ForCausalLM")
    assert INDEXER.startswith("self_attention.core_attention")
