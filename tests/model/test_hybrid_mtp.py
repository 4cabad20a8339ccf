"""Multi-token prediction in hybrid models (megatron-core's unified --hybrid-layer-pattern,
"main/depth/depth", and Megatron-LM's older --mtp-hybrid-override-pattern; Nemotron 3 Super's
"/*E/*E"): each depth runs its pattern's layers between its projection and final norm,
numbered after the decoder's, under megatron-core's names; the layouts train as one process;
parameters, FLOPs and the memory estimate count a depth's layers; bad patterns stop in one
line."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.model.test_mamba import LAYOUTS as MAMBA_LAYOUTS
from tests.model.test_mamba import MAMBA
from tests.parallel.test_expert_parallel import MOE
from tests.parity import LLAMA_STYLE, TRAINING, _setup, assert_matches_reference, train_job
from threefold.arguments import parse_args
from threefold.model.mamba import MambaLayer
from threefold.training.flops import training_flops_per_iteration
from threefold.training.memory_estimate import parameter_count

BASE = LLAMA_STYLE + TRAINING + [*MAMBA, *MOE]
# Mamba, attention, MLP and expert layers in two pipeline segments; two depths of a Mamba
# and an expert layer (a depth's state space scan, its experts' routing)
PATTERN = "M*|-E/ME/ME"
HYBRID = BASE + ["--hybrid-layer-pattern", PATTERN]


def test_each_depth_runs_its_patterns_layers_numbered_after_the_decoders(capsys):
    trainer = _setup(HYBRID + ["--mtp-num-layers", "3"])
    model = trainer.config.model
    assert (model.num_layers, model.mtp_num_layers) == (4, 2)  # (the pattern's, said)
    assert "--mtp-num-layers 3 and the 2 depths" in capsys.readouterr().out
    depths = trainer.model.mtp.layers
    for depth, first in zip(depths, (5, 7)):
        mamba, experts = depth.inner_layers()
        assert isinstance(mamba, MambaLayer) and mamba.layer_number == first
        assert experts.self_attention is None and experts.layer_number == first + 1
        assert type(experts.mlp).__name__ == "MoELayer"
    names = [name for name, _ in trainer.model.named_parameters() if name.startswith("mtp.")]
    assert "mtp.layers.1.mtp_model_layer.layers.0.mixer.in_proj.weight" in names
    assert "mtp.layers.1.mtp_model_layer.layers.1.mlp.router.weight" in names
    assert "mtp.layers.1.eh_proj.weight" in names and "mtp.layers.1.final_layernorm.weight" in names
    # the MoE statistics count the depths' expert layers among the model's (Megatron-LM's)
    assert trainer.moe_statistics.moe_layer_numbers == [4, 6, 8]


def test_megatron_lms_older_spelling_becomes_the_unified_pattern(capsys):
    older = BASE + ["--hybrid-layer-pattern", "M*|-E", "--mtp-num-layers", "2"]
    config = parse_args(older + ["--mtp-hybrid-override-pattern", "ME"])
    assert config.model.hybrid_layer_pattern == PATTERN
    assert config.model.mtp_hybrid_override_pattern is None


LAYOUTS = {
    # the pattern's two segments, the depths on the last stage beside the loss
    "tp2-sp-pp2": MAMBA_LAYOUTS["tp2-sp-pp2"],
    # the depths' Mamba layers' all-to-all over CP, their experts over EP
    "cp2-ep2": (2, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    "ep2-dp2-distributed-optimizer": (
        4,
        ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_train_as_one_process(layout):
    world, flags = LAYOUTS[layout]
    reference = train_job(HYBRID, 4)
    results = run_distributed(world, train_job, HYBRID + flags, 4)
    assert_matches_reference(results, reference, 1e-5)


def test_parameters_and_flops_count_a_depths_layers():
    """A depth's layers count as the decoder's same layers do; each depth adds its norms and
    projection (2 x (3h + 2h^2) FLOPs a token) and its logits (2 h V), as Megatron-LM counts."""
    trainer = _setup(HYBRID)
    model = trainer.config.model
    counted = sum(p.numel() for p in trainer.model.parameters())
    assert parameter_count(model, model.padded_vocab_size(1)) == counted
    flops = {
        pattern: training_flops_per_iteration(
            parse_args(BASE + ["--hybrid-layer-pattern", pattern]).model, 8, 1008
        )
        for pattern in (PATTERN, "M*-E", "M*-EMEME")
    }
    h, tokens = 32, 8 * 16
    depth = 3 * tokens * (2 * (3 * h + 2 * h * h) + 2 * h * 1008)
    assert flops[PATTERN] == flops["M*-EMEME"] + 2 * depth


@pytest.mark.parametrize(
    "pattern,flags,named",
    [
        ("M*-/ME/M-", [], "the multi-token prediction depths after / must be alike"),
        ("M*-/M|E/M|E", [], "must be alike and hold no |"),
        ("M*-/Mx", [], "x is none of them"),
        ("M*-E", ["--mtp-num-layers", "2"], "--mtp-num-layers 2 in a hybrid model: write"),
        ("M*-E", ["--mtp-hybrid-override-pattern", "ME"], "give --mtp-num-layers, and no /"),
    ],
)
def test_bad_depths_are_refused_in_one_line(capsys, pattern, flags, named):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--hybrid-layer-pattern", pattern, *flags])
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1, error


def test_a_pattern_without_depths_fine_tunes_from_a_checkpoint_with_them(tmp_path, capsys):
    """The decoder's part of the pattern takes the rest of a hybrid with depths (its `/` parts
    left out, said), as a GPT run without --mtp-num-layers does."""
    from threefold.checkpoint.load import load_checkpoint, load_model
    from threefold.checkpoint.save import save_checkpoint

    saved = str(tmp_path / "saved")
    with_depths = _setup(HYBRID)
    with_depths.train_step()
    save_checkpoint(saved, with_depths.checkpoint_components())
    decoder = [a if a != PATTERN else PATTERN.split("/")[0] for a in HYBRID]
    trainer = _setup(decoder)
    capsys.readouterr()
    load_checkpoint(saved, trainer.checkpoint_components(), finetune=True)
    assert "2 multi-token prediction depths are left out" in capsys.readouterr().out
    expected = dict(load_model(saved, with_tokenizer=False)[1].named_parameters())
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, expected[name]), name
