"""Hugging Face's FalconForCausalLM in and out, in its three layers: Falcon-7B's (the attention
and the MLP side by side reading one norm, one key and value head), the new architecture's of
40B and 180B (a norm each, grouped queries) and the first one's one after the other (a key and
value per head, biases). Each tiny model gives transformers' logits (and other logits with its
layer changed), a bitwise round trip that transformers loads, greedy generation, and its
per-token losses at TP2 x PP2 (Falcon-7B's single key and value head: PP2); a model trained
in threefold with LayerNorm, GELU and RoPE exports as Falcon; what Falcon cannot express is
refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tools.hf_models import VOCAB, converted_hf_model, has_transformers
from threefold.arguments import parse_args
from threefold.checkpoint.hf import model_config_from_hf, threefold_to_hf
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)

import transformers  # noqa: E402

from tests.tools.hf_checks import (  # noqa: E402
    TOKENS,
    TOKENS_25,
    assert_exports_as,
    assert_greedy_generation,
    assert_layout_losses,
    assert_round_trip,
    logits_with,
    relative_error,
)

KINDS = ["falcon", "falcon-new", "falcon-seq"]
# Each layer with another one's: the checks must see the difference.
OTHER = {
    "falcon": {"parallel_attention_mlp_shared_norm": False},  # a norm of its own for the MLP
    "falcon-new": {"parallel_attention_mlp": False},  # one after the other
    "falcon-seq": {"parallel_attention_mlp": True},  # side by side
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (transformers' model, its directory, threefold's checkpoint of it)."""
    return {kind: converted_hf_model(kind, tmp_path_factory.mktemp(kind)) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("changed", [False, True], ids=["as-is", "other-layer"])
def test_logits_are_transformers_and_the_layer_does_its_part(converted, kind, changed):
    hf_model, _, ours = converted[kind]
    with torch.no_grad():
        logits = logits_with(ours, TOKENS, **(OTHER[kind] if changed else {}))
        error = relative_error(logits, hf_model(TOKENS).logits)
    assert error > 1e-3 if changed else error < 1e-5, error


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_generation_and_tp2_pp2_losses(converted, kind, tmp_path):
    hf_model, hf_dir, ours = converted[kind]
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    exported = transformers.AutoConfig.from_pretrained(str(tmp_path / "exported"))
    layer = ("new_decoder_architecture", "parallel_attn", "num_key_value_heads")
    theirs = hf_model.config  # (the layer kind written back as it was read)
    assert [getattr(exported, name) for name in layer] == [getattr(theirs, name) for name in layer]
    assert_greedy_generation(hf_model, ours)
    layout = ["--pipeline-model-parallel-size", "2"]
    if kind == "falcon":  # (one key and value head: no TP split, as in megatron-core)
        assert_layout_losses(hf_model, ours, 2, layout, TOKENS_25)
    else:
        layout += ["--tensor-model-parallel-size", "2"]
        assert_layout_losses(hf_model, ours, 4, layout, TOKENS_25)


FALCON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
FALCON += ["--group-query-attention", "--num-query-groups", "1", "--disable-bias-linear"]
FALCON += ["--position-embedding-type", "rope", "--parallel-attention-mlp"]
FALCON += ["--parallel-attention-mlp-shared-norm", "--mock-data", "--vocab-size", str(VOCAB)]
FALCON += ["--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "1"]


def test_a_model_trained_with_falcons_layer_exports_as_falcon(tmp_path):
    assert assert_exports_as(FALCON, tmp_path, "FalconForCausalLM")["multi_query"]


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--no-layernorm-bias"], "norms other than LayerNorm with a bias"),
        (["--swiglu"], "a GLU or squared-ReLU MLP"),
        (["--rotary-interleaved"], "RoPE other than plain RoPE"),
        (["--num-query-groups", "2", "--parallel-attention-mlp", "0"], "grouped queries"),
    ],
    ids=["no-norm-bias", "swiglu", "interleaved", "grouped-one-after-the-other"],
)
def test_what_falcon_cannot_express_is_refused(flags, named):
    argv = FALCON + flags
    if flags[-1] == "0":  # (the layers one after the other: without the two layer flags)
        argv = [f for f in FALCON if not f.startswith("--parallel")] + flags[:2]
    config = parse_args(argv).model
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, config, "FalconForCausalLM")


def test_alibi_is_refused_by_name(converted):
    _, hf_dir, _ = converted["falcon"]
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = {**json.load(f), "alibi": True}
    with pytest.raises(ConfigError, match="alibi=True"):
        model_config_from_hf(hf)
