"""--saver peft (checkpoint/hf/peft.py): a LoRA fine-tune of a converted model, its adapters
written as a PEFT adapter. Loaded by `peft` over the Hugging Face base model, it computes the
fine-tuned model's logits; merged by `peft`, the merged export's. LLaMA (q, k and v cut from
linear_qkv's adapter, gate and up from linear_fc1's), Phi-3 (fused projections: one each),
Phi-2 (its own names, a bias on every projection), Nemotron (no gate) and Gemma 3 (its norms
untouched)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.parity import _setup
from tests.tools.hf_models import VOCAB, convert_in_process, converted_hf_model, has_transformers
from tests.tools.test_convert_checkpoint import TOKENS, convert
from threefold.checkpoint.hf.peft import peft_adapter
from threefold.checkpoint.load import load_checkpoint, load_model
from threefold.checkpoint.save import save_checkpoint
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)
peft = pytest.importorskip("peft")

import transformers  # noqa: E402

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "phi": "PhiForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def _lora_fine_tune(base: str, save: str) -> None:
    """Three steps of LoRA (rank 4, alpha 8) from the converted `base`, saved in `save`."""
    argv = ["--use-checkpoint-args", "--load", base, "--lora-rank", "4", "--lora-alpha", "8"]
    argv += ["--mock-data", "--seq-length", "16", "--micro-batch-size", "2"]
    argv += ["--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-2", "--save", save]
    trainer = _setup(argv)
    load_checkpoint(base, trainer.checkpoint_components(), finetune=True)
    for _ in range(3):
        trainer.train_step()
    save_checkpoint(save, trainer.checkpoint_components())


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def tuned(request, tmp_path_factory):
    """(kind, HF base directory, the LoRA checkpoint, its PEFT adapter directory)."""
    root = tmp_path_factory.mktemp(request.param)
    _, hf_dir, ours = converted_hf_model(request.param, root)
    lora, adapter = str(root / "lora"), str(root / "adapter")
    _lora_fine_tune(ours, lora)
    # (the fine-tune's config carries the architecture it was converted from: no
    # --hf-architecture needed, and Phi-3's would be guessed wrong)
    convert_in_process(
        "--loader", "threefold", "--saver", "peft", "--load-dir", lora, "--save-dir", adapter,
        "--base-model", hf_dir,
    )  # fmt: skip
    return request.param, hf_dir, lora, adapter


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def test_peft_loads_the_adapter_over_the_base_model_as_fine_tuned(tuned):
    kind, hf_dir, lora, adapter = tuned
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8.0)
    fused = {
        "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"],
        "phi": ["dense", "fc1", "fc2", "k_proj", "q_proj", "v_proj"],
        "nemotron": ["down_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
    }
    split = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert adapter_config["target_modules"] == fused.get(kind, split)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    before = _logits(base)
    tuned_model = peft.PeftModel.from_pretrained(base, adapter).eval()
    _, ours, _ = load_model(lora)
    with torch.no_grad():
        expected = ours(TOKENS)[..., :VOCAB].transpose(0, 1)
    logits = _logits(tuned_model)
    assert (logits - expected).abs().max() / expected.abs().max() < 1e-5
    assert (before - expected).abs().max() / expected.abs().max() > 1e-4  # the adapters moved


def test_peft_merged_is_the_merged_export(tuned, tmp_path):
    kind, hf_dir, lora, adapter = tuned
    merged = str(tmp_path / "merged")
    convert_in_process(
        "--loader", "threefold", "--saver", "hf", "--load-dir", lora, "--save-dir", merged,
    )  # fmt: skip
    with open(os.path.join(merged, "config.json")) as f:
        assert json.load(f)["architectures"] == [ARCHITECTURES[kind]]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    by_peft = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload()
    exported = _logits(transformers.AutoModelForCausalLM.from_pretrained(merged).eval())
    assert (_logits(by_peft) - exported).abs().max() / exported.abs().max() < 1e-5


@pytest.mark.parametrize("tuned", ["llama"], indirect=True)  # (the same for every family)
def test_what_peft_cannot_take_is_one_line(tuned, tmp_path):
    kind, hf_dir, lora, _ = tuned
    base = os.path.join(os.path.dirname(lora), "threefold")
    result = convert(
        "--loader", "threefold", "--saver", "peft", "--load-dir", base,
        "--save-dir", str(tmp_path / "none"),
    )  # fmt: skip
    assert result.returncode == 2 and "holds no LoRA adapters" in result.stderr
    assert result.stderr.count("\n") == 1 and not os.path.exists(tmp_path / "none")
    result = convert("--loader", "hf", "--saver", "peft", "--load-dir", hf_dir, "--save-dir", "x")
    assert result.returncode == 2 and "--loader threefold" in result.stderr
    result = convert(
        "--loader", "threefold", "--saver", "peft", "--load-dir", lora,
        "--save-dir", str(tmp_path / "other"), "--hf-architecture", "Phi4ForCausalLM",
    )  # fmt: skip
    assert result.returncode == 2
    assert "--hf-architecture Phi4ForCausalLM: not one of" in result.stderr
    config, _, _ = load_model(lora)
    config.model.num_experts = 4
    with pytest.raises(ConfigError, match="not MixtralForCausalLM's: export the model merged"):
        peft_adapter({}, config.model, "MixtralForCausalLM", None)
