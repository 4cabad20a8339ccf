"""Megatron-LM torch_dist checkpoints of hybrid models in and out, against megatron-core itself.

megatron-core's MambaModel (tests/megatron_core_hybrid.py: a Mamba, an attention, a Mamba, an
MLP and an expert layer, "M*M-E") saves at TP2 on two gloo ranks as Megatron-LM does: each
layer's tensors apart, a Mamba mixer's in_proj a section at a time (z, x, B, C, dt, each split
over TP by heads and groups), its convolution's weight and bias likewise (x, B, C), the norms
under Transformer Engine's names. threefold reads it at TP1, TP2 with sequence parallelism and
EP2 and computes megatron-core's logits; its export loads back into megatron-core with the
same logits; multi-token prediction depths of a hybrid go out under Megatron-LM's names and
come back bitwise.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import megatron_core_hybrid as mh
from tests import megatron_core_models as mc
from tests.distributed import run_distributed
from tests.model.test_hybrid_mtp import BASE as HYBRID_BASE
from tests.model.test_hybrid_mtp import HYBRID as HYBRID_MTP
from tests.model.test_mamba import WITH_GDN
from tests.model.test_mtp_repeated import GPT as GPT_MTP
from tests.parity import _setup
from tests.tools.hf_models import convert_checkpoint
from tests.tools.megatron_runs import (
    copy_with_args,
    exports,
    megatron_argv,
    per_token_losses,
    reference_losses,
    saved_by_megatron_core,
)
from threefold.checkpoint.load import load_checkpoint, load_model
from threefold.checkpoint.megatron.common_file import read_common
from threefold.checkpoint.save import save_checkpoint
from threefold.config import ConfigError
from threefold.safe_loading import SafeFileSystemReader


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """(Megatron-LM checkpoint root, megatron-core's logits of TOKENS), saved at TP2."""
    return saved_by_megatron_core(tmp_path_factory, {"hybrid": (2, 1, 1, 2)}, mh)["hybrid"]


def _keys(path: str) -> set[str]:
    return set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)


def test_one_process_computes_megatron_cores_logits(megatron):
    root, reference = megatron
    keys = _keys(os.path.join(root, "iter_0000010"))
    mamba = "decoder.layers.2.mixer."
    assert {mamba + f"in_proj.weight.{s}" for s in ("z", "x", "B", "C", "dt")} <= keys
    assert {mamba + f"conv1d.{p}.{s}" for p in ("weight", "bias") for s in "xBC"} <= keys
    assert mamba + "in_proj.layer_norm_weight" in keys and "decoder.final_norm.weight" in keys
    config, model, _ = load_model(root, with_tokenizer=False)
    assert (config.model.hybrid_layer_pattern, config.model.num_layers) == ("M*M-E", 5)
    assert (config.model.mamba_head_dim, config.model.mamba_num_groups) == (16, 2)
    with torch.no_grad():
        logits = model(mc.TOKENS).transpose(0, 1)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "flags,ranks",
    [
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "14"], 2),
        (["--expert-model-parallel-size", "2", "--global-batch-size", "4"], 2),
        # the pattern cut into two pipeline stages (Megatron-LM takes it from the command line)
        (["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "M*|M-E"], 2),
    ],
    ids=["tp2-sp", "ep2", "pp2"],
)
def test_any_layout_computes_megatron_cores_losses(megatron, flags, ranks):
    root, reference = megatron
    # Sequence parallelism splits the sequence over TP: 14 of the causal model's 15 tokens.
    length = 14 if "--sequence-parallel" in flags else mc.SEQ - 1
    argv = megatron_argv(root, 1, 1) + flags
    results = run_distributed(ranks, per_token_losses, argv, root, length)
    expected = reference_losses(reference)[:length]
    for losses in (r for r in results if r is not None):
        torch.testing.assert_close(torch.tensor(losses), expected, rtol=0, atol=1e-5)


def test_export_loads_into_megatron_core(megatron, tmp_path):
    """threefold -> Megatron: megatron-core's MambaModel reads the export of a model trained
    on and computes threefold's logits; Megatron -> threefold -> Megatron gives
    megatron-core's own logits bitwise, under the keys megatron-core wrote."""
    root, reference = megatron
    ours, written = exports(root, reference, tmp_path)
    assert (ours - reference).abs().max() > 1e-3  # training moved it
    saved = {key for key in _keys(os.path.join(root, "iter_0000010")) if "_extra_state" not in key}
    for path, expected, tolerance in written:
        assert saved <= _keys(path)
        args = read_common(path)["args"]
        assert (args["hybrid_layer_pattern"], args["num_layers"]) == ("M*M-E", 5)
        assert (args["mamba_state_dim"], args["mamba_head_dim"]) == (8, 16)
        theirs = run_distributed(1, mh.logits, "hybrid", path)
        torch.testing.assert_close(theirs[0], expected, rtol=0, atol=tolerance)


def test_older_args_name_the_pattern_hybrid_override_pattern(megatron, tmp_path):
    root, reference = megatron
    older = copy_with_args(
        root, str(tmp_path / "older"), hybrid_layer_pattern=None, hybrid_override_pattern="M*M-E"
    )
    config, model, _ = load_model(older, with_tokenizer=False)
    assert config.model.hybrid_layer_pattern == "M*M-E"
    with torch.no_grad():
        torch.testing.assert_close(model(mc.TOKENS).transpose(0, 1), reference, rtol=0, atol=1e-5)
    by_ratio = copy_with_args(
        root, str(tmp_path / "ratio"), hybrid_layer_pattern=None, hybrid_attention_ratio=0.2
    )
    with pytest.raises(ConfigError, match="its hybrid_attention_ratio placed; threefold"):
        load_model(by_ratio, with_tokenizer=False)


def _round_trip(argv: list[str], directory) -> tuple[str, set[str], dict]:
    """threefold -> Megatron -> threefold of a model trained a step, each model (the older
    pattern spelling's too, where the model has depths) bitwise the first; returns the
    export's iter_N directory, its keys and its args."""
    trainer = _setup(argv)
    trainer.train_step()
    ours = str(directory / "ours")
    save_checkpoint(ours, trainer.checkpoint_components())
    megatron, back = str(directory / "megatron"), str(directory / "back")
    for loader, saver, source, target in (
        ("threefold", "megatron", ours, megatron),
        ("megatron", "threefold", megatron, back),
    ):
        flags = ["--loader", loader, "--saver", saver, "--load-dir", source]
        assert convert_checkpoint.main(flags + ["--save-dir", target]) == 0
    path = os.path.join(megatron, "iter_0000001")
    args = read_common(path)["args"]
    sources = [back, megatron]
    decoder, *depths = (args["hybrid_layer_pattern"] or "").split("/")
    if depths:  # Megatron-LM's older spelling: the decoder's pattern, and a depth's repeated
        changes = dict(hybrid_layer_pattern=decoder, mtp_hybrid_override_pattern=depths[0])
        sources.append(copy_with_args(megatron, str(directory / "legacy"), 1, **changes))
    original = dict(load_model(ours, with_tokenizer=False)[1].state_dict())
    for source in sources:
        model = load_model(source, with_tokenizer=False)[1]
        assert model.state_dict().keys() == original.keys()
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, original[name]), (source, name)
    return path, _keys(path), args


def test_hybrid_depths_go_out_under_megatrons_names_and_come_back(tmp_path):
    """Multi-token prediction depths of a hybrid (megatron-core's HybridStack inside each
    depth, `mtp.layers.{k}.mtp_model_layer.layers.{j}`, as Megatron-LM names them; megatron-core
    0.16.1 predates them, so the names are Megatron-LM's source's, not a run's)."""
    _, keys, args = _round_trip(HYBRID_MTP, tmp_path)
    depth = "mtp.layers.1.mtp_model_layer.layers."
    assert depth + "0.mixer.in_proj.layer_norm_weight" in keys
    assert depth + "0.mixer.in_proj.weight.dt" in keys
    assert depth + "1.mlp.experts.experts.linear_fc1.weight" in keys
    assert "mtp.layers.1.eh_proj.weight" in keys and "decoder.final_norm.weight" in keys
    assert (args["hybrid_layer_pattern"], args["mtp_num_layers"]) == ("M*|-E/ME/ME", 2)


def test_gated_delta_nets_in_a_hybrid_go_out_as_megatron_core_keeps_them(tmp_path):
    """A pattern's G layers: megatron-core's gated delta net keys (as a GPT model's with
    --experimental-attention-variant gated_delta_net), the pattern alone marking them."""
    _, keys, args = _round_trip(WITH_GDN, tmp_path)
    gdn = "decoder.layers.1.self_attention."
    assert {gdn + f"in_proj.weight.{s}" for s in ("query", "key", "value", "z", "beta")} <= keys
    assert gdn + "in_proj.layer_norm_weight" in keys and gdn + "out_norm.weight" in keys
    assert args["hybrid_layer_pattern"] == "MG*-G-" and args["linear_attention_freq"] is None


# Latent experts (fc1_latent_proj down to 16 before the dispatch, fc2_latent_proj up after the
# combine) and one multi-token prediction depth's layers repeated for every depth
LATENT_REPEATED = ["--moe-latent-size", "16", "--mtp-use-repeated-layer"]


def test_nemotron_3_supers_kind_goes_out_and_comes_back(tmp_path):
    """Nemotron 3 Super's parts: a hybrid's latent experts, and depths of a hybrid pattern
    sharing one depth's layers. megatron-core builds the projections as Transformer Engine's
    duplicated linears only (whole on every rank, with their extra state) and 0.16.1 predates
    the shared hybrid depth, so these names are Megatron-LM's source's: `mlp.fc{1,2}_latent_proj`
    beside the router, and the one depth built as `mtp.layers.0`."""
    argv = HYBRID_BASE + ["--hybrid-layer-pattern", "M*E/*E/*E", *LATENT_REPEATED]
    _, keys, args = _round_trip(argv, tmp_path)
    for name in ("fc1_latent_proj", "fc2_latent_proj"):
        assert {
            f"decoder.layers.2.mlp.{name}.weight",
            f"decoder.layers.2.mlp.{name}._extra_state/shard_0_1",
        } <= keys
        assert f"mtp.layers.0.mtp_model_layer.layers.1.mlp.{name}.weight" in keys
    assert not any(key.startswith("mtp.layers.1.") for key in keys)  # (one depth, shared)
    assert (args["moe_latent_size"], args["mtp_num_layers"]) == (16, 2)
    assert args["mtp_use_repeated_layer"]


def test_a_gpt_models_latent_experts_are_stacked_as_its_layers(tmp_path):
    """Every layer MoE: the projections stacked with the layers, [layers, out, in]."""
    _, keys, args = _round_trip(GPT_MTP + LATENT_REPEATED, tmp_path)
    assert "decoder.layers.mlp.fc1_latent_proj.weight" in keys
    assert "decoder.layers.mlp.fc2_latent_proj._extra_state/shard_1_2" in keys
    assert "mtp.layers.0.transformer_layer.mlp.fc1_latent_proj.weight" in keys
    assert (args["mtp_num_layers"], args["mtp_use_repeated_layer"]) == (3, True)


def test_a_hybrid_goes_on_from_its_export_with_adams_state_as_uninterrupted(tmp_path):
    """Adam's moments and fp32 masters of the Mamba mixers' sections (and of the depths'
    layers) go out in Megatron-LM's model-space layout and come back: the next step from the
    export is the uninterrupted run's."""
    trainer = _setup(HYBRID_MTP)
    trainer.train_step()
    ours, megatron = str(tmp_path / "ours"), str(tmp_path / "megatron")
    save_checkpoint(ours, trainer.checkpoint_components())
    flags = ["--loader", "threefold", "--saver", "megatron", "--load-dir", ours]
    flags += ["--target-use-distributed-optimizer"]  # (whose state holds the fp32 masters)
    assert convert_checkpoint.main(flags + ["--save-dir", megatron]) == 0
    assert _keys(os.path.join(megatron, "iter_0000001")) >= {
        "optimizer.state.exp_avg.decoder.layers.0.mixer.in_proj.weight.z",
        "optimizer.state.param.mtp.layers.1.mtp_model_layer.layers.0.mixer.A_log",
    }
    expected = trainer.train_step()[0]
    resumed = _setup(HYBRID_MTP + ["--load", megatron])
    assert load_checkpoint(megatron, resumed.checkpoint_components()) == 1
    assert resumed.train_step()[0] == pytest.approx(expected, rel=1e-6)
    for (name, ran), (_, again) in zip(
        trainer.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(again, ran, rtol=0, atol=1e-6, msg=name)
