"""Hugging Face's NemotronForCausalLM (Nemotron-4, Minitron) in and out: LayerNorm1P with a
bias, a squared-ReLU MLP without a gate, RoPE on half of each head, grouped queries of a head
size of their own, biases. A tiny one gives transformers' logits, and other logits with each of
its choices undone; a bitwise round trip that transformers loads; greedy generation; its
per-token losses at TP2 + SP and TP2 x PP2. A model trained in threefold with Megatron's flags
for Nemotron's layer exports as Nemotron, with --apply-layernorm-1p or without (its norm weights
less 1); what Nemotron cannot express is refused in one line. (A megatron-core checkpoint of
that layer exports too: tests/tools/test_megatron_checkpoints.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.tools.hf_models import VOCAB, converted_hf_model, has_transformers
from threefold.arguments import parse_args
from threefold.checkpoint.hf import threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.config import ConfigError
from threefold.training.memory_estimate import parameter_count

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)


from tests.tools.hf_checks import (  # noqa: E402
    TOKENS,
    TOKENS_25,
    TP2_SP_AND_TP2_PP2,
    assert_exports_as,
    assert_greedy_generation,
    assert_layout_losses,
    assert_round_trip,
    logits_with,
    relative_error,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, its directory, threefold's checkpoint of it)."""
    return converted_hf_model("nemotron", tmp_path_factory.mktemp("nemotron"))


@pytest.mark.parametrize(
    "undone",
    [
        {},
        {"apply_layernorm_1p": False},
        {"squared_relu": False},
        {"rotary_percent": 1.0},
        {"add_bias_linear": False},
    ],
    ids=["as-is", "norms-by-weight", "gelu", "rope-everywhere", "no-biases"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, model, _ = load_model(ours)
    assert (config.model.rotary_percent, config.model.kv_channels) == (0.5, 24)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error
    count = sum(p.numel() for p in model.parameters())
    assert parameter_count(config.model, model.padded_vocab_size) == count


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


@TP2_SP_AND_TP2_PP2
def test_parallel_layouts_compute_transformers_losses(converted, world, layout):
    hf_model, _, ours = converted
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


# Megatron-LM's flags for Nemotron's layer (Nemotron-4's and Minitron's launch scripts)
NEMOTRON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
NEMOTRON += ["--group-query-attention", "--num-query-groups", "2", "--squared-relu"]
NEMOTRON += ["--normalization", "LayerNorm", "--position-embedding-type", "rope"]
NEMOTRON += ["--rotary-percent", "0.5", "--disable-bias-linear"]
NEMOTRON += ["--untie-embeddings-and-output-weights", "--mock-data", "--vocab-size", str(VOCAB)]
NEMOTRON += ["--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "1"]


@pytest.mark.parametrize("one_p", [True, False], ids=["layernorm-1p", "layernorm"])
def test_a_model_trained_with_megatrons_nemotron_flags_exports_as_nemotron(tmp_path, one_p):
    argv = NEMOTRON + (["--apply-layernorm-1p"] if one_p else [])
    exported = assert_exports_as(argv, tmp_path, "NemotronForCausalLM")
    assert (exported["hidden_act"], exported["attention_bias"]) == ("relu2", False)


@pytest.mark.parametrize(
    "remove,add,architecture,named",
    [
        # (RoPE on every dimension: LLaMA refuses a part first)
        (["--rotary-percent", "0.5"], [], "LlamaForCausalLM", "as NemotronForCausalLM"),
        (["--squared-relu"], [], "NemotronForCausalLM", "an MLP other than ReLU²"),
        (
            ["--rotary-percent", "0.5"],
            ["--rotary-interleaved"],
            "NemotronForCausalLM",
            "RoPE other",
        ),
        ([], ["--add-qkv-bias"], "NemotronForCausalLM", "biases on the query, key and value"),
    ],
    ids=["as-llama", "gelu", "interleaved", "qkv-bias-only"],
)
def test_what_nemotron_cannot_express_is_refused(remove, add, architecture, named):
    config = parse_args([flag for flag in NEMOTRON if flag not in remove] + add).model
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, config, architecture)
