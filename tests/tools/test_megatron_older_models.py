"""Megatron-LM's older GPT models (megatron/legacy, --use-legacy-models) in, against Megatron-LM's
own code: tests/data/megatron_older_models holds two of them saved at TP2 x PP2 by Megatron-LM's
save_checkpoint, and the logits its GPTModel computed on one batch, written by
`python bench/megatron_older_models.py CHECKOUT` from a checkout that still has them (they left
Megatron-LM in May 2026, and with them its loader_legacy.py). threefold reads each into its
own model, which computes those logits, at any layout (checkpoint/megatron/legacy_models.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.tools.megatron_runs import megatron_argv, per_token_losses
from threefold.checkpoint.load import load_checkpoint, load_model
from threefold.config import ConfigError

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "megatron_older_models")


def _reference(name: str) -> dict:
    return torch.load(os.path.join(DATA, name, "logits.pt"), weights_only=True)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_megatron_lms_older_models_compute_their_logits_in_threefold(name):
    """llama: grouped query attention, SwiGLU, RMSNorm, RoPE, an untied output layer; gpt2:
    learned positions, LayerNorm and biases, GELU, the output layer tied to the embedding (the
    last stage's copy saved as `word_embeddings_for_head`)."""
    reference = _reference(name)
    config, model, _ = load_model(os.path.join(DATA, name), with_tokenizer=False)
    parallel = config.parallel  # (the saving run's layout; the model is whole here)
    assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size) == (2, 2)
    with torch.no_grad():
        logits = model(reference["tokens"]).transpose(0, 1)  # (as Megatron-LM's: [b, s, v])
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)


def test_args_from_before_position_embedding_type_and_norm_epsilon_read_alike(tmp_path):
    """Args of mid-2023 Megatron-LM: RoPE said by `use_rotary_position_embeddings` (no
    `position_embedding_type` yet), the epsilon as its flag `--norm-epsilon` named it."""
    import glob
    import shutil

    reference, root = _reference("llama"), str(tmp_path / "llama")
    shutil.copytree(os.path.join(DATA, "llama"), root)
    for path in glob.glob(os.path.join(root, "iter_*", "mp_rank_*", "model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)  # the test's own copy
        args = state["args"]
        del args.position_embedding_type
        args.use_rotary_position_embeddings = True
        args.norm_epsilon = args.layernorm_epsilon
        del args.layernorm_epsilon
        torch.save(state, path)
    _, model, _ = load_model(root, with_tokenizer=False)
    with torch.no_grad():
        logits = model(reference["tokens"]).transpose(0, 1)
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name,tp,pp", [("llama", 2, 1), ("gpt2", 1, 2)])
def test_their_losses_at_another_layout(name, tp, pp):
    """Read at TP2 (llama's query groups and gated MLP split anew) and at PP2 without TP
    (gpt2's tied embedding on both stages), a run computes the losses of Megatron-LM's logits."""
    reference = _reference(name)
    tokens, root = reference["tokens"], os.path.join(DATA, name)
    expected = torch.nn.functional.cross_entropy(
        reference["logits"][0, :-1].double(), tokens[0, 1:], reduction="none"
    ).float()
    length = tokens.shape[1] - 1
    argv = megatron_argv(root, tp, pp, length)
    results = run_distributed(tp * pp, per_token_losses, argv, root, length, tokens)
    for losses in (r for r in results if r is not None):
        torch.testing.assert_close(torch.tensor(losses), expected, rtol=0, atol=1e-5)


def test_a_resume_without_their_optimizer_state_is_one_line():
    """Saved with --no-save-optim: a resume says what to pass (--finetune loads them)."""
    from tests.parity import _setup

    root = os.path.join(DATA, "gpt2")
    trainer = _setup(megatron_argv(root, 1, 1, 7))
    with pytest.raises(ConfigError, match="without its optimizer state; pass --no-load-optim"):
        load_checkpoint(root, trainer.checkpoint_components())
