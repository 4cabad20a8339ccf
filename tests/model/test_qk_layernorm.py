"""--qk-layernorm (a norm over each query and key head, shared by all heads) and
--apply-layernorm-1p (norm weights stored centred on zero): the same training in every layout,
and exports that compute the same function in `transformers`."""

import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import (
    DP_TOLERANCE,
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_matches_reference,
    train_job,
)
from threefold.model.norms import Norm

VARIANT = ["--qk-layernorm", "--apply-layernorm-1p"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_zero_centred_norm_is_the_norm_with_one_plus_its_weight(normalization):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16)
    centred = Norm(16, normalization, 1e-5, zero_centered_gamma=True)
    plain = Norm(16, normalization, 1e-5)
    for norm in (centred, plain):
        for param in norm.parameters():
            with torch.no_grad():
                param.init_method(param, torch.Generator())
    assert torch.equal(centred.weight, torch.zeros(16))  # starts as the plain norm's ones
    with torch.no_grad():
        centred.weight.normal_()
        plain.weight.copy_(centred.weight + 1)
    torch.testing.assert_close(centred(x), plain(x), rtol=0, atol=0)


def test_query_and_key_norms_are_per_head_and_counted():
    from threefold.training.memory_estimate import parameter_count

    trainer = _setup(LLAMA_STYLE + TRAINING + VARIANT)
    attention = trainer.model.decoder.layers[0].self_attention
    assert (
        attention.q_layernorm.weight.shape
        == attention.k_layernorm.weight.shape
        == (trainer.config.model.kv_channels,)
    )
    assert parameter_count(trainer.config.model, trainer.model.padded_vocab_size) == sum(
        p.numel() for p in trainer.model.parameters()
    )


@pytest.mark.parametrize(
    "style,flags,tolerance",
    [
        (LLAMA_STYLE, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 1e-5),
        (GPT2_STYLE, ["--tensor-model-parallel-size", "2"], 1e-5),
        (LLAMA_STYLE, ["--pipeline-model-parallel-size", "2"], DP_TOLERANCE),
    ],
    ids=["llama-tp2-sp", "gpt2-tp2", "llama-pp2"],
)
def test_variant_layouts_match_single_process(style, flags, tolerance):
    argv = style + TRAINING + VARIANT
    reference = train_job(argv, 5)
    results = run_distributed(2, train_job, argv + flags, 5)
    assert_matches_reference(results, reference, tolerance)


@pytest.mark.parametrize(
    "flags,architecture",
    [(["--apply-layernorm-1p"], "LlamaForCausalLM"), (VARIANT, "Qwen3ForCausalLM")],
)
def test_trained_variants_export_to_transformers(flags, architecture, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.tools.hf_models import convert_in_process
    from threefold.checkpoint.save import save_checkpoint

    argv = LLAMA_STYLE + TRAINING + flags + ["--vocab-size", "1008", "--save", str(tmp_path)]
    trainer = _setup(argv)
    for _ in range(3):  # moves the norm weights away from their initial values
        trainer.train_step()
    save_checkpoint(str(tmp_path), trainer.checkpoint_components())
    exported = str(tmp_path / "hf")
    convert_in_process(
        "--loader",
        "threefold",
        "--saver",
        "hf",
        "--load-dir",
        str(tmp_path),
        "--save-dir",
        exported,
    )
    assert json.load(open(os.path.join(exported, "config.json")))["architectures"] == [architecture]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    tokens = torch.randint(0, 1008, (2, 16), generator=torch.Generator().manual_seed(0))
    model = trainer.model.eval()
    with torch.no_grad():
        ours = model(tokens).transpose(0, 1)
        theirs = hf_model(tokens).logits
    error = (ours - theirs).abs().max() / theirs.abs().max()
    assert error < 1e-5, error


def test_exporting_query_key_norms_as_llama_is_refused():
    from threefold.checkpoint.hf import threefold_to_hf
    from threefold.config import ConfigError

    trainer = _setup(LLAMA_STYLE + TRAINING + ["--qk-layernorm"])
    state = dict(trainer.model.state_dict())
    with pytest.raises(ConfigError, match="export it as Qwen3ForCausalLM"):
        threefold_to_hf(state, trainer.config.model, "LlamaForCausalLM")


def test_checkpoints_remember_the_variant(tmp_path):
    from threefold.checkpoint.args import model_flags
    from threefold.checkpoint.load import load_checkpoint
    from threefold.checkpoint.save import save_checkpoint
    from threefold.config import ConfigError

    assert {"--qk-layernorm", "--apply-layernorm-1p"} <= set(
        model_flags({"qk_layernorm": True, "apply_layernorm_1p": True})
    )
    plain = _setup(LLAMA_STYLE + TRAINING + ["--save", str(tmp_path)])
    save_checkpoint(str(tmp_path), plain.checkpoint_components())
    centred = _setup(LLAMA_STYLE + TRAINING + ["--apply-layernorm-1p"])
    with pytest.raises(ConfigError, match="--apply-layernorm-1p"):
        load_checkpoint(str(tmp_path), centred.checkpoint_components(), finetune=True)
