"""Megatron-LM's architecture flags against megatron-core itself: its model built with each
(tests/megatron_core_models.py), saved, read by threefold and exported to Hugging Face or back
to Megatron-LM, computes megatron-core's logits everywhere it goes."""

from __future__ import annotations

import os

import pytest
import torch

from tests import megatron_core_models as mc
from tests.distributed import run_distributed
from tests.tools.hf_models import convert_checkpoint
from threefold.checkpoint.load import load_model


@pytest.mark.parametrize(
    "kind,field,off,refusal",
    [
        ("llama_interleaved", "rotary_interleaved", False, None),
        ("llama_partial_rotary", "rotary_percent", 1.0, "this model's --rotary-percent 0.5"),
        ("gpt2_squared_relu", "squared_relu", False, "has no squared-ReLU MLPs (--squared-relu)"),
        ("nemotron", "squared_relu", False, None),
        ("llama_yarn", "position_embedding_type", "rope", None),
        ("llama_window", "window_size", None, "has no sliding window in every layer"),
        ("quick_geglu", "glu_linear_offset", 0.0, "matches no Hugging Face architecture"),
    ],
    ids=[
        "rotary-interleaved",
        "rotary-percent",
        "squared-relu",
        "nemotron",
        "yarn",
        "window",
        "quick-geglu",
    ],
)
def test_megatron_architecture_flags_compute_megatron_cores_logits(
    tmp_path, capsys, kind, field, off, refusal
):
    """Megatron-LM's --rotary-interleaved (RoPE on adjacent pairs), --rotary-percent 0.5,
    --squared-relu, --position-embedding-type yarn (4x over an original context of 8, its
    temperature on the tables), --window-size 3,0 --window-attn-skip-freq 2 (a sliding
    window in layers 1 and 3) and GPT-OSS's MLP (--quick-geglu --glu-linear-offset 1.0
    --activation-func-clamp-value 0.05, a clamp the activations reach): megatron-core's model,
    saved and read back by threefold, gives its logits.
    The Hugging Face export of the first (rotate-half RoPE, each head's query and key rows
    regrouped), of YaRN (LLaMA's rope_scaling of type yarn) and of Nemotron's layer (LayerNorm,
    --squared-relu, --rotary-percent 0.5: NemotronForCausalLM, its norm weights less 1) gives
    them too; the others have no Hugging Face architecture among those threefold writes, and
    their export is refused in one line."""
    from tests.tools.hf_models import has_transformers

    root = str(tmp_path / "megatron")
    run_distributed(1, mc.save, kind, root, 10, 1, 1)
    reference = run_distributed(1, mc.logits, kind, f"{root}/iter_0000010")[0]
    config, model, _ = load_model(root, with_tokenizer=False)
    assert getattr(config.model, field)
    with torch.no_grad():
        logits = model(mc.TOKENS).transpose(0, 1)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    # Without the flag, the same weights compute something else: the flag matters.
    setattr(config.model, field, off)
    with torch.no_grad():
        plain = _model_with(config, model)(mc.TOKENS).transpose(0, 1)
    assert (plain - reference).abs().max() > 1e-2
    hf = str(tmp_path / "hf")
    argv = ["--loader", "megatron", "--saver", "hf", "--load-dir", root, "--save-dir", hf]
    if refusal is not None:
        with pytest.raises(SystemExit):
            convert_checkpoint.main(argv)
        assert refusal in capsys.readouterr().err
        assert not os.path.exists(hf)
        return
    if not has_transformers():
        return
    from transformers import AutoModelForCausalLM

    assert convert_checkpoint.main(argv) == 0
    hf_model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf_model(mc.TOKENS).logits
    torch.testing.assert_close(theirs, reference[..., : theirs.shape[-1]], rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "kind,args",
    [
        ("llama_window", {"window_size": (3, 0), "window_attn_skip_freq": 2}),
        ("llama_sinks", {"softmax_type": "learnable"}),
        ("llama_off_by_one", {"softmax_type": "off-by-one"}),
    ],
    ids=["window", "learnable-sinks", "off-by-one"],
)
def test_gpt_oss_attention_goes_to_megatron_lm_and_back(tmp_path, kind, args):
    """Megatron -> threefold -> Megatron of GPT-OSS's attention: a sliding window in every
    other layer (--window-size 3,0 --window-attn-skip-freq 2), and a softmax with one more
    logit, learned per head (its `core_attention.softmax_offset`) or 0 (--softmax-type):
    threefold computes megatron-core's logits, the export's args hold the flags as
    Megatron-LM's do, and megatron-core computes the same logits from it."""
    root, trained = str(tmp_path / "megatron"), str(tmp_path / "threefold")
    run_distributed(1, mc.save, kind, root, 10, 1, 1)
    reference = run_distributed(1, mc.logits, kind, f"{root}/iter_0000010")[0]
    _, model, _ = load_model(root, with_tokenizer=False)
    with torch.no_grad():
        logits = model(mc.TOKENS).transpose(0, 1)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    for loader, saver, load, save in (
        ("megatron", "threefold", root, trained),
        ("threefold", "megatron", trained, str(tmp_path / "back")),
    ):
        argv = ["--loader", loader, "--saver", saver, "--load-dir", load, "--save-dir", save]
        assert convert_checkpoint.main(argv) == 0
    with open(tmp_path / "back" / "latest_checkpointed_iteration.txt") as f:
        path = str(tmp_path / "back" / f"iter_{int(f.read()):07d}")
    saved = torch.load(f"{path}/common.pt", weights_only=False)["args"]
    assert {name: getattr(saved, name) for name in args} == args
    theirs = run_distributed(1, mc.logits, kind, path)[0]
    torch.testing.assert_close(theirs, reference, rtol=0, atol=0)


def _model_with(config, model):
    """A GPTModel of `config` holding `model`'s weights."""
    from threefold.model import GPTModel

    other = GPTModel(config.model, model.padded_vocab_size)
    other.load_state_dict(model.state_dict())
    return other.eval()
