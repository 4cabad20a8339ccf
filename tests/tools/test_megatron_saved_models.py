"""Megatron-LM's checkpoints in, against Megatron-LM's own code: tests/data/megatron_saved_models
holds models saved at TP2 x PP2 by Megatron-LM's save_checkpoint, with the logits its model
computed on one batch (`python bench/megatron_saved_models.py ERA CHECKOUT`):

- `current`: megatron-core's GPTModel in torch_dist, from Megatron-LM of 2026-08 (megatron-core
  0.19 and later keep the common state, args included, inside the .distcp files: no common.pt);
- `older`: its older GPT models (megatron/legacy, --use-legacy-models) in the legacy torch
  format, from the last checkout that had them (they left Megatron-LM in May 2026, and with them
  its loader_legacy.py; checkpoint/megatron/legacy_models.py reads them).

Each is a LLaMA-like model (grouped query attention, SwiGLU, RMSNorm, RoPE, an untied output
layer) and a GPT-2-like one (learned positions, LayerNorm and biases, GELU, the output layer tied
to the embedding over the stages); the current ones mixtures of experts too (4 experts, 2
routed, a shared expert, split over TP; and DeepSeek-V3's sigmoid router with its expert bias
after a dense first layer). threefold reads each into its own model, which computes
those logits, and at other layouts their losses.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from tests.distributed import run_distributed
from tests.tools.megatron_runs import megatron_argv, per_token_losses
from threefold.checkpoint.load import load_checkpoint, load_model
from threefold.config import ConfigError

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "megatron_saved_models")
SAVED = [(era, name) for era in ("current", "older") for name in ("llama", "gpt2")]
SAVED += [("current", "moe"), ("current", "deepseek")]


def _reference(era: str, name: str) -> dict:
    return torch.load(os.path.join(DATA, era, name, "logits.pt"), weights_only=True)


def _logits(root: str, tokens: torch.Tensor) -> torch.Tensor:
    _, model, _ = load_model(root, with_tokenizer=False)
    with torch.no_grad():
        return model(tokens).transpose(0, 1)  # (as Megatron-LM's: [b, s, vocabulary])


@pytest.mark.parametrize("era,name", SAVED)
def test_megatron_lms_own_checkpoints_compute_its_logits_in_threefold(era, name):
    """Their norms' epsilons are not the default (llama 1e-3, gpt2 1e-4): Megatron-LM's args
    name the flag --norm-epsilon `layernorm_epsilon`; gpt2 has no --group-query-attention and
    Megatron-LM's default --num-query-groups 1 in its args (one key/value head per query head)."""
    reference, root = _reference(era, name), os.path.join(DATA, era, name)
    config = load_model(root, with_tokenizer=False)[0]
    saved = config.parallel  # (the saving run's layout; the model is whole here)
    assert (saved.tensor_model_parallel_size, saved.pipeline_model_parallel_size) == (2, 2)
    logits = _logits(root, reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)


def test_args_from_before_position_embedding_type_and_norm_epsilon_read_alike(tmp_path):
    """Args of mid-2023 Megatron-LM: RoPE said by `use_rotary_position_embeddings` (no
    `position_embedding_type` yet), the epsilon as its flag `--norm-epsilon` named it."""
    reference, root = _reference("older", "llama"), str(tmp_path / "llama")
    shutil.copytree(os.path.join(DATA, "older", "llama"), root)
    for path in glob.glob(os.path.join(root, "iter_*", "mp_rank_*", "model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)  # the test's own copy
        args = state["args"]
        del args.position_embedding_type
        args.use_rotary_position_embeddings = True
        args.norm_epsilon = args.layernorm_epsilon
        del args.layernorm_epsilon
        torch.save(state, path)
    logits = _logits(root, reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "era,name,tp,pp",
    [("current", "llama", 2, 1), ("current", "moe", 1, 2), ("older", "gpt2", 1, 2)],
)
def test_their_losses_at_another_layout(era, name, tp, pp):
    """Read at TP2 (llama's query groups and gated MLP split anew) and at PP2 without TP
    (gpt2's tied embedding on both stages; the experts' stages), a run computes the losses of
    Megatron-LM's logits; its --use-checkpoint-args takes the checkpoint's NullTokenizer at its
    vocabulary."""
    reference, root = _reference(era, name), os.path.join(DATA, era, name)
    tokens = reference["tokens"]
    expected = torch.nn.functional.cross_entropy(
        reference["logits"][0, :-1].double(), tokens[0, 1:], reduction="none"
    ).float()
    length = tokens.shape[1] - 1
    argv = megatron_argv(root, tp, pp, length)
    results = run_distributed(tp * pp, per_token_losses, argv, root, length, tokens)
    for losses in (r for r in results if r is not None):
        torch.testing.assert_close(torch.tensor(losses), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("era", ["current", "older"])
def test_a_resume_without_their_optimizer_state_is_one_line(era):
    """Saved with --no-save-optim: a resume says what to pass (--finetune loads them)."""
    from tests.parity import _setup

    root = os.path.join(DATA, era, "gpt2")
    trainer = _setup(megatron_argv(root, 1, 1, 7))
    with pytest.raises(ConfigError, match="without its optimizer state; pass --no-load-optim"):
        load_checkpoint(root, trainer.checkpoint_components())


def test_a_missing_embedded_common_state_is_one_line(tmp_path):
    """No common.pt and no `common_state` among the sharded objects: incomplete, in one line."""
    root = str(tmp_path / "llama")
    shutil.copytree(os.path.join(DATA, "current", "llama"), root)
    os.remove(os.path.join(root, "iter_0000007", ".metadata"))
    with pytest.raises(ConfigError, match="holds neither common.pt nor megatron-core's embedded"):
        load_model(root, with_tokenizer=False)
