"""Megatron-LM's legacy `--ckpt-format torch` checkpoints in, against megatron-core itself.

megatron-core's GPTModel (local layer spec) saves the same weights twice, as Megatron-LM's
`save_checkpoint` writes each format (tests/megatron_core_models.py `save_both`): torch_dist,
and the legacy format, one pickled `mp_rank_*/model_optim_rng.pt` per model-parallel rank.
threefold reads the legacy one into exactly the weights of the torch_dist one (which
tests/tools/test_megatron_checkpoints.py proves compute megatron-core's logits) from TP x PP,
virtual stages, EP and multi-token prediction layouts; computes megatron-core's losses from it
at another layout; trains on from it; converts it; and refuses what it does not read in one
line, without running anything the files name.

megatron-core also trains with its DDP (several buckets per buffer) and distributed optimizer
and saves them in the legacy format, its buffers in distrib_optim.pt
(tests/megatron_core_training.py): threefold goes on from that Adam state at other layouts
exactly as megatron-core does.
"""

from __future__ import annotations

import glob
import os
import re
import shutil

import pytest
import torch

from tests import megatron_core_models as mc
from tests import megatron_core_training as mt
from tests.distributed import run_distributed
from tests.tools.hf_models import convert_checkpoint
from tests.tools.megatron_runs import (
    assert_same_weights,
    continue_argv,
    continue_training,
    copy_with_args,
    megatron_argv,
    per_token_losses,
    reference_losses,
    train_from,
)
from threefold.checkpoint.load import load_checkpoint, load_model
from threefold.config import ConfigError

# kind -> the layout megatron-core saves it at: TP, PP, EP, virtual stages, ranks
LAYOUTS = {
    "llama": (2, 2, 1, None, 4),
    "gpt2": (1, 2, 1, 2, 2),  # tied embeddings, learned positions, LayerNorm with biases
    "moe": (1, 2, 2, None, 4),  # experts on 2 EP ranks of each stage
    "moe_mtp": (2, 1, 2, None, 4),  # multi-token prediction layers with experts
    "mla": (2, 1, 1, None, 2),  # down projections split over TP in the local spec
    # a hybrid's stages ("M*", "ME"), its Mamba mixers' sections split over TP
    "hybrid4": (2, 2, 1, None, 4),
    # --pipeline-model-parallel-layout Et|tttmm|L: the depths on a stage of their own, with
    # the last layers, the final norm and a copy of the embedding
    "moe_mtp_layout": (1, 3, 1, None, 3),
}
FILE = "iter_0000010/mp_rank_00_000/model_optim_rng.pt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (torch_dist root, legacy root) of the same weights."""
    roots = {}
    for kind, (tp, pp, ep, virtual, ranks) in LAYOUTS.items():
        base = tmp_path_factory.mktemp(f"legacy_{kind}")
        roots[kind] = (str(base / "torch_dist"), str(base / "torch"))
        run_distributed(ranks, mc.save_both, kind, *roots[kind], 10, tp, pp, ep, virtual)
    return roots


@pytest.mark.parametrize("kind", LAYOUTS)
def test_the_legacy_format_loads_the_weights_of_its_torch_dist_twin(saved, kind):
    torch_dist, legacy = saved[kind]
    (config, legacy_config), _ = assert_same_weights(torch_dist, legacy)
    assert legacy_config.model == config.model


def test_megatron_cores_losses_from_the_legacy_format_at_another_layout(saved):
    torch_dist, legacy = saved["llama"]  # saved at TP2 x PP2, read at TP1 x PP2
    reference = run_distributed(1, mc.logits, "llama", os.path.join(torch_dist, "iter_0000010"))
    expected = reference_losses(reference[0])
    results = run_distributed(2, per_token_losses, megatron_argv(legacy, 1, 2), legacy)
    for losses in (r for r in results if r is not None):
        torch.testing.assert_close(torch.tensor(losses), expected, rtol=0, atol=1e-5)


def test_training_goes_on_from_the_legacy_format_without_its_optimizer_state(saved):
    """--no-load-optim: Megatron-LM's iteration, samples and schedule, and the same steps as
    from the torch_dist twin; without it, a checkpoint whose distributed optimizer's buffers
    are missing (`save_both` writes no distrib_optim.pt) says in one line what to pass."""
    from tests.parity import _setup

    torch_dist, legacy = saved["gpt2"]
    trainer = _setup(megatron_argv(legacy, 1, 1))
    with pytest.raises(ConfigError, match="no distrib_optim.pt holds its buffer .*--no-load-optim"):
        load_checkpoint(legacy, trainer.checkpoint_components())
    runs = [
        train_from(megatron_argv(root, 1, 1) + ["--no-load-optim"], root, finetune=False)
        for root in (torch_dist, legacy)
    ]
    assert runs[0][0] == runs[1][0]
    state = runs[1][1].checkpoint_components().train_state
    assert (state.iteration, state.consumed_train_samples, state.consumed_valid_samples) == (
        12,
        644,
        24,
    )


def test_a_legacy_checkpoint_converts_like_its_torch_dist_twin(saved, tmp_path):
    converted = {}
    for root in saved["moe"]:
        out = str(tmp_path / os.path.basename(root))
        argv = ["--loader", "megatron", "--saver", "threefold", "--load-dir", root]
        assert convert_checkpoint.main(argv + ["--save-dir", out]) == 0
        converted[root] = load_model(out, with_tokenizer=False)[1].state_dict()
    theirs, ours = converted.values()
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())


def _te_names(state: dict) -> None:
    """A rank's state as Transformer Engine's spec names it: the input norm fused into
    linear_qkv, the experts a GroupedMLP's `linear_fc1.weight{e}`."""
    state["args"].transformer_impl = "transformer_engine"
    renamed = {}
    for key, value in state["model"].items():
        key = key.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
        found = re.match(r"^(.+\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.(.+)$", key)
        renamed[f"{found[1]}.{found[3]}.{found[4]}{found[2]}" if found else key] = value
    state["model"] = renamed


def test_transformer_engines_names_load_the_same_weights(saved, tmp_path):
    """Megatron-LM's default spec names a layer's norms after the linear layers they are fused
    into and keeps a GroupedMLP's experts as one weight each, numbered after the name."""
    legacy = saved["moe"][1]
    root = str(tmp_path / "te")
    shutil.copytree(legacy, root)
    for path in glob.glob(os.path.join(root, "iter_*", "mp_rank_*", "model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)  # the test's own file
        _te_names(state)
        assert any(re.search(r"linear_fc1\.weight\d+$", key) for key in state["model"])
        torch.save(state, path)
    theirs = load_model(legacy, with_tokenizer=False)[1].state_dict()
    ours = load_model(root, with_tokenizer=False)[1].state_dict()
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())


# megatron-core's local spec -> the older GPT model's (megatron/legacy) module of a layer
OLDER_LAYER = {
    "input_layernorm": "input_norm",
    "self_attention.linear_qkv": "self_attention.query_key_value",
    "self_attention.linear_proj": "self_attention.dense",
    "pre_mlp_layernorm": "post_attention_norm",
    "mlp.linear_fc1": "mlp.dense_h_to_4h",
    "mlp.linear_fc2": "mlp.dense_4h_to_h",
}
# the names of runs before late 2023
OLDER_NORMS = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}


def _older_model(state: dict, norms: dict | None = None, encoder_name: str = "encoder") -> None:
    """A rank's state as Megatron-LM's older GPT model (megatron/legacy, --use-legacy-models)
    saved it: GPTModel.state_dict_for_save_checkpoint's nesting, `language_model` holding the
    embedding's modules, the encoder's flat state dict and an untied output layer, and the
    last stage's copy of a tied embedding as `word_embeddings_for_head`."""
    state["args"].use_legacy_models = True
    for name in [key for key in state if re.fullmatch(r"model\d*", key)]:
        language_model, encoder = {}, {}
        older = {"language_model": language_model}
        for key, tensor in state[name].items():
            layer = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
            if "_extra_state" in key:
                continue
            if key.startswith("embedding."):
                module, param = key.split(".")[1:]
                language_model.setdefault("embedding", {}).setdefault(module, {})[param] = tensor
            elif layer:
                module = OLDER_LAYER[layer[2]]
                module = (norms or {}).get(module, module)
                encoder[f"layers.{layer[1]}.{module}.{layer[3]}"] = tensor
            elif key.startswith("decoder.final_layernorm."):
                final = "final_layernorm" if norms else "final_norm"
                encoder[f"{final}.{key.split('.')[-1]}"] = tensor
            elif key == "output_layer.weight" and state["args"].untie_embeddings_and_output_weights:
                language_model["output_layer"] = {"weight": tensor}
            elif key == "output_layer.weight":
                older["word_embeddings_for_head"] = {"weight": tensor}
            else:
                raise AssertionError(f"no older model's name for {key}")
        if encoder:
            language_model[encoder_name] = encoder
        state[name] = older


@pytest.mark.parametrize(
    "kind,norms,encoder_name",
    [("gpt2", None, "encoder"), ("llama", None, "encoder"), ("llama", OLDER_NORMS, "transformer")],
    ids=["gpt2", "llama", "llama-2023-names"],
)
def test_megatron_lms_older_models_load_the_weights_of_their_megatron_core_twin(
    saved, tmp_path, kind, norms, encoder_name
):
    """Megatron-LM's older GPT models (megatron/legacy; no longer in Megatron-LM, nor its
    loader_legacy.py) read as the megatron-core model of the same weights, tied embeddings over
    stages and virtual stages, learned positions and biases (gpt2) and TP-split gated MLPs and
    grouped query attention (llama) alike; their optimizer state is refused in one line."""
    legacy = saved[kind][1]
    root = str(tmp_path / "older")
    shutil.copytree(legacy, root)
    for path in glob.glob(os.path.join(root, "iter_*", "mp_rank_*", "model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)  # the test's own file
        _older_model(state, norms, encoder_name)
        torch.save(state, path)
    assert_same_weights(legacy, root)
    with pytest.raises(ConfigError, match="older ones .*--no-load-optim") as error:
        load_checkpoint(root, _trainer(megatron_argv(root, 1, 1)).checkpoint_components())
    assert "\n" not in str(error.value)


def _trainer(argv: list[str]):
    from tests.parity import _setup

    return _setup(argv)


def _rewritten(root: str, destination: str, change) -> str:
    """A copy of a legacy checkpoint whose rank-0 file went through `change` (its dict)."""
    shutil.copytree(root, destination)
    path = os.path.join(destination, FILE)
    state = torch.load(path, weights_only=False)  # the test's own file
    change(state)
    torch.save(state, path)
    return destination


def _gated_delta_nets(state: dict) -> None:
    state["args"].hybrid_layer_pattern = "G*G*"


def _older_te_layers(state: dict) -> None:
    """The older models' Transformer Engine layers: a norm fused into `layernorm_qkv`."""
    _older_model(state)
    encoder = state["model"]["language_model"]["encoder"]
    for key in [k for k in encoder if ".input_norm." in k]:
        encoder[key.replace(".input_norm.", ".self_attention.layernorm_qkv.layer_norm_")] = (
            encoder.pop(key)
        )


def _older_version(state: dict) -> None:
    state["checkpoint_version"] = 2.0


def _args_of_another_model(state: dict) -> None:
    """args that describe a narrower MLP than the tensors hold (no longer cut to fit)."""
    state["args"].ffn_hidden_size //= 2


@pytest.mark.parametrize(
    "change,refusal",
    [
        (_gated_delta_nets, "legacy torch format of gated delta nets"),
        (_older_te_layers, "older models built with Transformer Engine's layers"),
        (_older_version, "checkpoint_version 2.0, whose attention's query, key and value"),
        (_args_of_another_model, r"linear_fc1.weight is stored as \(\d+, 64\), but the model"),
        (None, "mp_rank_01_001/model_optim_rng.pt missing"),
    ],
    ids=[
        "gated-delta-nets",
        "older-models-te-layers",
        "version-2",
        "args-of-another-model",
        "a-rank-missing",
    ],
)
def test_what_is_not_read_is_refused_in_one_line(saved, tmp_path, change, refusal):
    root = str(tmp_path / "changed")
    if change is None:
        shutil.copytree(saved["llama"][1], root)
        shutil.rmtree(os.path.join(root, "iter_0000010", "mp_rank_01_001"))
    else:
        _rewritten(saved["llama"][1], root, change)
    with pytest.raises(ConfigError, match=refusal) as error:
        load_model(root, with_tokenizer=False)
    assert "\n" not in str(error.value)


# -- the distributed optimizer's distrib_optim.pt: training goes on as megatron-core's own ------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(legacy checkpoint root, megatron-core's weights one iteration later, its loss):
    megatron-core trained 2 iterations at TP2 x DP2, buckets of 6000 elements."""
    directory = tmp_path_factory.mktemp("megatron_legacy_trained")
    root, after = str(directory / "run"), str(directory / "after")
    losses = run_distributed(4, mt.train_and_save, "llama", root, after, 2, "legacy", 2)
    return root, after, losses[0]


@pytest.fixture(scope="module")
def trained_more(tmp_path_factory):
    """The same for the mixture of experts "moe" at DP2 x EP2 (each EP rank's file; its
    distrib_optim.pt a list of the two chained optimizers' buffers, the rest's written by DP
    rank 0 alone), and with the non-distributed optimizer (its state in model_optim_rng.pt)
    for "llama" at TP2 x DP2 and "moe" at DP2 x EP2: (kind, optimizer) -> as `trained`."""
    runs = {}
    for kind, layout, tp, ep, ranks in (
        ("moe", "legacy", 1, 2, 2),
        ("llama", "legacy_plain", 2, 1, 4),
        ("moe", "legacy_plain", 1, 2, 2),
    ):
        directory = tmp_path_factory.mktemp(f"megatron_{layout}_{kind}")
        root, after = str(directory / "run"), str(directory / "after")
        losses = run_distributed(ranks, mt.train_and_save, kind, root, after, tp, layout, 2, ep)
        runs[(kind, layout)] = (root, after, losses[0])
    return runs


EXPERTS_DP2 = ["--use-distributed-optimizer", "--expert-model-parallel-size", "2"]


@pytest.mark.parametrize(
    "kind,layout,dp,flags",
    [
        ("llama", "legacy", 1, []),
        ("moe", "legacy", 1, []),
        ("moe", "legacy", 2, EXPERTS_DP2),  # (into the distributed optimizer's shards too)
        ("llama", "legacy_plain", 1, []),
        ("moe", "legacy_plain", 2, EXPERTS_DP2),
    ],
    ids=["tp1", "experts-one-process", "experts-dp2-ep2", "plain-tp1", "plain-experts-dp2-ep2"],
)
def test_training_goes_on_from_the_legacy_optimizer_state_as_in_megatron(
    trained, trained_more, kind, layout, dp, flags
):
    """Adam's moments, fp32 masters and step from distrib_optim.pt (its buckets as megatron-
    core's DDP formed them from --overlap-grad-reduce and --ddp-bucket-size), or from the
    non-distributed optimizer's state (its parameters numbered group by group), read at TP1:
    the next iteration's loss and weights are megatron-core's. (The experts' harness steps
    without the expert bias's update, as tests/tools/test_megatron_moe_checkpoints.py says.)"""
    run = trained if (kind, layout) == ("llama", "legacy") else trained_more[(kind, layout)]
    root, after, megatron_loss = run
    argv = continue_argv(root, 1, 1, dp) + flags
    if kind == "moe":
        argv += ["--moe-router-bias-update-rate", "0"]
    for loss, difference in run_distributed(dp, continue_training, argv, root, after, True):
        assert loss == pytest.approx(megatron_loss, rel=1e-6)
        assert difference < 1e-6


def _older_buffers(root: str) -> None:
    """TP rank 0's buffers as megatron-core before 0.7 saved them (not coalesced)."""
    path = os.path.join(root, "iter_0000002", "mp_rank_00", "distrib_optim.pt")
    state = torch.load(path, weights_only=False)  # the test's own file
    del state["buckets_coalesced"]
    torch.save(state, path)


def _shorter_buffer(root: str) -> None:
    """TP rank 1's first buffer 64 elements short (of another model than its args say)."""
    path = os.path.join(root, "iter_0000002", "mp_rank_01", "distrib_optim.pt")
    state = torch.load(path, weights_only=False)  # the test's own file
    (buffer,) = state[0].values()
    buffer.update({k: buffer[k][:-64].clone() for k in ("param", "exp_avg", "exp_avg_sq")})
    buffer["numel_unpadded"] -= 64
    torch.save(state, path)


@pytest.mark.parametrize(
    "changes,expected",
    [
        (_shorter_buffer, "is not the one megatron-core forms from its args"),
        (_older_buffers, "mp_rank_00/distrib_optim.pt is an older megatron-core's"),
        ({"transformer_impl": "transformer_engine"}, "are not its weights"),
    ],
    ids=["other-buffer", "older-buffers", "other-order"],
)
def test_a_legacy_optimizer_state_laid_out_otherwise_is_refused(
    trained, tmp_path, changes, expected
):
    """A buffer that is not what the model's parameters fill does not add up, and --load
    refuses before reading; told Transformer Engine's order, the masters are not the weights
    and it refuses on the first parameter. The weights load without it either way. (The
    bucket size itself barely matters: a bucket's end cuts only the padding before a
    parameter, none where every parameter's size is a multiple of 64.)"""
    from tests.parity import _setup

    changed = str(tmp_path / "changed")
    if callable(changes):
        shutil.copytree(trained[0], changed)
        changes(changed)
    else:
        copy_with_args(trained[0], changed, iteration=2, **changes)
    trainer = _setup(continue_argv(changed, 1, 1, 1))
    with pytest.raises(ConfigError, match=expected) as error:
        load_checkpoint(changed, trainer.checkpoint_components())
    assert "--no-load-optim" in str(error.value) and "\n" not in str(error.value)
    assert load_checkpoint(changed, trainer.checkpoint_components(), load_optimizer=False) == 2


def test_a_plain_optimizer_state_numbered_otherwise_is_refused(trained_more, tmp_path):
    """The non-distributed optimizer's groups must hold the model's parameters of their kind,
    each of its shape: one moved to another group is refused in one line, before reading."""
    from tests.parity import _setup

    root = str(tmp_path / "moved")
    shutil.copytree(trained_more[("llama", "legacy_plain")][0], root)
    path = os.path.join(root, "iter_0000002", "mp_rank_01", "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)  # the test's own file
    groups = state["optimizer"]["param_groups"]
    groups[1]["params"].append(groups[0]["params"].pop())
    torch.save(state, path)
    trainer = _setup(continue_argv(root, 1, 1, 1))
    expected = "mp_rank_01/model_optim_rng.pt: its group 0 holds 17 parameters, its model 18"
    with pytest.raises(ConfigError, match=expected) as error:
        load_checkpoint(root, trainer.checkpoint_components())
    assert "--no-load-optim" in str(error.value) and "\n" not in str(error.value)
