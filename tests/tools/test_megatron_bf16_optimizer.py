"""A bf16 run's Adam state from Megatron-LM's checkpoints, against megatron-core itself.

Megatron-LM trains in bf16 (--bf16): bf16 weights, gradients reduced in fp32, and fp32
masters beside Adam's moments in the optimizer. megatron-core's GPTModel trains so two
iterations at TP2 x DP2 (tests/megatron_core_training.py), and saves the same optimizer state
in each of Megatron-LM's layouts: with the distributed optimizer, model space
(--dist-ckpt-optim-fully-reshardable), its default dp_reshardable buckets and the legacy
format's distrib_optim.pt; with the non-distributed optimizer, torch_dist's model space and the
legacy model_optim_rng.pt (its masters in `fp32_from_fp16_params`, tensors that keep
megatron-core's TP attributes). Read at TP1, each layout's masters and moments are bitwise
those of the model-space layout saved beside it.

megatron-core 0.16's own model-space save (--dist-ckpt-optim-fully-reshardable) misplaces the
state after a gradient buffer's first bucket when there are several (--overlap-grad-reduce):
its masters are then not its weights, and the load refuses it in one line.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import megatron_core_training as mt
from tests.distributed import run_distributed
from tests.parity import _setup
from tests.tools.megatron_runs import continue_argv
from threefold.checkpoint.load import load_checkpoint, load_model
from threefold.checkpoint.resharding import saved_tensors
from threefold.config import ConfigError

# the layouts read, each against the model-space one saved from the same optimizer
LAYOUTS = {"dp_reshardable": "fully_reshardable", "legacy": "fully_reshardable"}
LAYOUTS |= {"legacy_plain": "torch_dist"}
FIELDS = ("master", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """layout -> its checkpoint root."""
    base = tmp_path_factory.mktemp("megatron_bf16")
    paths = {}
    for group in (
        ("fully_reshardable", "dp_reshardable", "legacy"),
        ("torch_dist", "legacy_plain"),
    ):
        roots = {layout: str(base / layout) for layout in group}
        run_distributed(4, mt.save_layouts, "llama", roots, 2, 2, True)
        paths |= roots
    return paths


def _state(root: str, model) -> dict:
    reader = saved_tensors(os.path.join(root, "iter_0000002"), optimizer=True)
    return {
        (field, model.layout_independent_name(name)): reader.full(field, name, param, 2)
        for name, param in model.named_parameters()
        for field in FIELDS
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_bf16_runs_optimizer_state_reads_as_its_model_space_layout(saved, layout):
    _, model, _ = load_model(saved[layout], with_tokenizer=False)
    reference, ours = _state(saved[LAYOUTS[layout]], model), _state(saved[layout], model)
    assert ours.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(ours[key], tensor), key
    # (bf16 weights and fp32 masters: the masters hold what the weights round away)
    masters = [t for (field, _), t in ours.items() if field == "master"]
    assert any(not torch.equal(t, t.bfloat16().float()) for t in masters)


def test_a_misplaced_model_space_state_is_refused_in_one_line(tmp_path):
    root = str(tmp_path / "several_buckets")
    buckets = mt.LEGACY_BUCKET_SIZE  # (several per buffer)
    run_distributed(4, mt.save_layouts, "llama", {"fully_reshardable": root}, 2, 2, True, buckets)
    trainer = _setup(continue_argv(root, 1, 1, 1) + ["--bf16"])
    with pytest.raises(ConfigError, match="not the state saved with them") as error:
        load_checkpoint(root, trainer.checkpoint_components())
    assert "\n" not in str(error.value)
    assert "--no-load-optim" in str(error.value)


def test_a_checkpoint_saved_before_adams_first_step_resumes_a_fresh_adam(tmp_path):
    """Megatron-LM's non-distributed optimizer saved before its first step (an fp16 run's
    first iterations are skipped until its loss scale fits): torch's Adam has no state yet,
    so only the fp32 masters are saved. threefold resumes it with them, Adam at step 0 with
    zero moments, instead of refusing it as the distributed optimizer's buckets; the legacy
    format's such state it refuses, said."""
    roots = {layout: str(tmp_path / layout) for layout in ("torch_dist", "legacy_plain")}
    run_distributed(4, mt.save_layouts, "llama", roots, 2, 0, True)
    root = roots["torch_dist"]
    path = os.path.join(root, "iter_0000000")
    reader = saved_tensors(path, megatron_step=0.0, optimizer=True)
    assert not any(key.startswith("optimizer.state.exp_avg") for key in reader.sizes)
    trainer = _setup(continue_argv(root, 1, 1, 1) + ["--bf16"])
    assert load_checkpoint(root, trainer.checkpoint_components()) == 0
    optimizer = trainer.optimizer
    assert optimizer.adam_step() == 0
    named = dict(trainer.model_chunks[0].named_parameters())
    for piece in optimizer.pieces:
        name = next(n for n, p in named.items() if p is piece.param)
        saved = reader.full("master", name, piece.param, 2).reshape(-1)[piece.start : piece.end]
        assert torch.equal(piece.master.detach().reshape(-1), saved), name
        state = optimizer.optimizer.state.get(piece.master, {})
        assert all(not state.get(f, torch.zeros(1)).any() for f in ("exp_avg", "exp_avg_sq"))
    assert trainer.train_step()[2] is False  # (and trains on)
    # The legacy format's, saved beside it, is refused in one line that says why.
    trainer = _setup(continue_argv(roots["legacy_plain"], 1, 1, 1) + ["--bf16"])
    with pytest.raises(ConfigError, match="before Adam's first step") as error:
        load_checkpoint(roots["legacy_plain"], trainer.checkpoint_components())
    assert "\n" not in str(error.value) and "--no-load-optim" in str(error.value)
