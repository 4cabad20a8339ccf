"""Hugging Face's GPTNeoXForCausalLM (Pythia, GPT-NeoX-20B) in and out: a tiny Pythia (the
attention and the MLP reading one input, RoPE on a quarter of each head, random biases and
norms) gives transformers' logits, and other logits with either undone; its per-token losses at
TP2 x PP2; a bitwise round trip that transformers loads; greedy generation. The parallel layer
trains over TP2+SP x PP2 as one process."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import TRAINING, assert_matches_reference, train_job
from tests.tools.hf_models import VOCAB, convert_in_process, converted_hf_model, has_transformers
from threefold.checkpoint.hf import threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.config import ConfigError
from threefold.inference import generate
from threefold.model import GPTModel

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)

import transformers  # noqa: E402
from safetensors import torch as safetensors_torch  # noqa: E402

from tests.tools.test_convert_checkpoint import (  # noqa: E402
    TOKENS,
    _assert_transformers_losses,
    _per_token_losses,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return converted_hf_model("gpt-neox", tmp_path_factory.mktemp("gpt_neox"))


@pytest.mark.parametrize(
    "undone",
    [{}, {"parallel_attention_mlp": False}, {"rotary_percent": 1.0}],
    ids=["as-is", "sequential", "whole-heads-rotated"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, model, _ = load_model(ours)
    assert (config.model.parallel_attention_mlp, config.model.rotary_percent) == (True, 0.25)
    other = GPTModel(dataclasses.replace(config.model, **undone), model.padded_vocab_size)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        logits = other(TOKENS)[..., :VOCAB].transpose(0, 1)
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error < 2e-6 if not undone else error > 1e-4, error


def test_tp2_pp2_per_token_losses_are_transformers(converted):
    hf_model, _, ours = converted
    argv = ["--use-checkpoint-args", "--load", ours, "--mock-data", "--seq-length", "23"]
    argv += ["--micro-batch-size", "2", "--global-batch-size", "2"]
    argv += ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    results = run_distributed(4, _per_token_losses, argv, ours)
    _assert_transformers_losses(hf_model, [r for r in results if r is not None])


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    exported = str(tmp_path / "exported")
    argv = ["--loader", "threefold", "--saver", "hf", "--load-dir", ours, "--save-dir", exported]
    convert_in_process(*argv)
    before = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    after = safetensors_torch.load_file(os.path.join(exported, "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(reloaded).__name__ == "GPTNeoXForCausalLM"
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, hf_model(TOKENS).logits)
    _, model, tokenizer = load_model(ours)
    prompt = tokenizer.tokenize("To be, or not")
    theirs = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert generate(model, prompt, 12, 64) == theirs


PYTHIA = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
PYTHIA += ["--seq-length", "16", "--position-embedding-type", "rope", "--rotary-percent", "0.5"]
PYTHIA += ["--parallel-attention-mlp", "--untie-embeddings-and-output-weights"]


def test_the_parallel_layer_trains_over_tp2_sp_pp2_as_one_process():
    argv = PYTHIA + TRAINING
    reference = train_job(argv, 3)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--pipeline-model-parallel-size", "2"]
    assert_matches_reference(run_distributed(4, train_job, argv + layout, 3), reference, 1e-5)


def test_other_architectures_refuse_the_parallel_layer(converted):
    config, _, _ = load_model(converted[2])
    whole_heads = dataclasses.replace(config.model, rotary_percent=1.0)
    with pytest.raises(ConfigError, match="--parallel-attention-mlp\\): export it as GPTNeoX"):
        threefold_to_hf({}, whole_heads, "LlamaForCausalLM")
