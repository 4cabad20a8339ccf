"""Hugging Face's NemotronHForCausalLM (Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano) in and
out: a hybrid stack of Mamba-2, attention, ReLU² MLP and expert layers (--hybrid-layer-pattern).
A tiny one gives transformers' logits over 24 tokens, and other logits with its Mamba layers'
skips, its experts' biases or its attention's groups changed; a bitwise round trip in the
Hub's layout that transformers loads; greedy generation; its per-token losses at TP2 + SP,
TP2 + SP x PP2 and CP2 x EP2. Nemotron 3 Super's multi-token prediction module is a depth of
the pattern both ways. A GPT model does not export as it, nor a hybrid one as another
family."""

from __future__ import annotations

import os

import pytest
import torch

from tests.tools.hf_models import VOCAB, converted_hf_model, has_transformers
from threefold.checkpoint.hf import model_config_from_hf
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)


from tests.tools.hf_checks import (  # noqa: E402
    TOKENS,
    TOKENS_25,
    assert_exports_as,
    assert_greedy_generation,
    assert_layout_losses,
    assert_round_trip,
    logits_with,
    relative_error,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, its directory, threefold's checkpoint of it)."""
    return converted_hf_model("nemotron-h", tmp_path_factory.mktemp("nemotron_h"))


def test_logits_are_transformers_and_each_part_counts(converted):
    hf_model, _, ours = converted
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        assert relative_error(logits_with(ours, TOKENS), expected) < 1e-5
        # the pattern read as it is: the same layers in another order compute other logits
        swapped = logits_with(ours, TOKENS, hybrid_layer_pattern="M*E-M*")
    assert relative_error(swapped, expected) > 1e-3


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


@pytest.mark.parametrize(
    "world,layout",
    [
        (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        (
            4,
            ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--pipeline-model-parallel-size", "2"],
        ),
        # the Mamba layers' heads over CP (all-to-all), the attention's ring; the experts
        (2, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    ],
    ids=["tp2-sp", "tp2-sp-pp2", "cp2-ep2"],
)
def test_parallel_layouts_compute_transformers_losses(converted, world, layout):
    hf_model, _, ours = converted
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


@pytest.fixture(scope="module")
def latent(tmp_path_factory):
    return converted_hf_model("nemotron-h-latent", tmp_path_factory.mktemp("latent"))


def test_latent_experts_are_transformers_both_ways(latent, tmp_path):
    """Nemotron 3 Super's experts (moe_latent_size): logits, a bitwise round trip, and the
    per-token losses at TP2 + SP x EP2 (the projections whole on each TP rank)."""
    hf_model, hf_dir, ours = latent
    assert model_config_from_hf(hf_model.config.to_dict())[1].moe_latent_size == 24
    with torch.no_grad():
        assert relative_error(logits_with(ours, TOKENS), hf_model(TOKENS).logits) < 1e-5
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    assert_layout_losses(hf_model, ours, 2, layout, TOKENS_25)


# Nemotron 3 Super's multi-token prediction module: one depth of an attention and an expert layer
MTP_KINDS = ["full_attention", "moe"]


def _add_mtp_module(hf_model, hf_dir: str):
    """The tiny model given Nemotron 3 Super's module, which transformers does not build: its
    config names the depth's layers, and its files hold the depth made of transformers' own
    parts (a NemotronHModel of those layers, whose norm_f is the depth's final norm; enorm,
    hnorm and eh_proj beside), numbered as the Hub's files number them."""
    import json
    import os

    import transformers
    from safetensors import torch as safetensors_torch

    from tests.tools.hf_family_models import shaken

    torch.manual_seed(1)
    config = transformers.NemotronHConfig(
        **{**hf_model.config.to_dict(), "layers_block_type": MTP_KINDS}
    )
    depth = torch.nn.Module()
    depth.stack = shaken(transformers.NemotronHModel(config)).eval()
    hidden = config.hidden_size
    norm = transformers.models.nemotron_h.modeling_nemotron_h.NemotronHRMSNorm
    eps = config.layer_norm_epsilon
    depth.enorm, depth.hnorm = norm(hidden, eps), norm(hidden, eps)
    depth.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
    with torch.no_grad():
        depth.enorm.weight.uniform_(0.5, 1.5)
        depth.hnorm.weight.uniform_(0.5, 1.5)
        for name, param in depth.stack.layers.named_parameters():
            if "norm" not in name and name.endswith("weight"):  # (layers that count: larger)
                param.normal_(0, 0.15)
    files = os.path.join(hf_dir, "model.safetensors")
    tensors = safetensors_torch.load_file(files)
    for name, tensor in depth.stack.layers.state_dict().items():
        if name.endswith(("experts.up_proj", "experts.down_proj")):  # (the Hub's: one a file)
            for e, expert in enumerate(tensor):
                tensors[f"mtp.layers.{name.replace('experts.', f'experts.{e}.')}.weight"] = expert
        else:
            tensors[f"mtp.layers.{name}"] = tensor
    tensors["mtp.layers.1.final_layernorm.weight"] = depth.stack.norm_f.weight.detach()
    for name in ("enorm", "hnorm", "eh_proj"):
        tensors[f"mtp.layers.0.{name}.weight"] = getattr(depth, name).weight.detach()
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, files)
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    hf.update(num_nextn_predict_layers=1, mtp_layers_block_type=MTP_KINDS)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf, f)
    return depth


def _mtp_loss(hf_model, depth, tokens) -> torch.Tensor:
    """The depth's loss as vLLM's NemotronH-MTP and megatron-core compute it: the next token's
    embedding and the model's output, each normalized, concatenated and projected, through the
    depth's layers and final norm to the shared output layer, predicting two tokens ahead."""
    inputs = tokens[:, :-1]
    with torch.no_grad():
        main = hf_model.model(inputs).last_hidden_state
        embeddings = hf_model.model.embeddings(inputs[:, 1:])
        both = torch.cat([depth.enorm(embeddings), depth.hnorm(main[:, :-1])], dim=-1)
        hidden = depth.stack(inputs_embeds=depth.eh_proj(both)).last_hidden_state
        logits = hf_model.lm_head(hidden)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), tokens[:, 2:].flatten())


def test_nemotron_3_supers_prediction_module_is_a_depth_both_ways(tmp_path):
    """Nemotron 3 Super's `mtp.*`: read as a depth of the pattern (`/*E`), its loss the one
    vLLM's module computes from transformers' parts (1e-5; with the depth's layers in the
    other order, another), and written back bitwise beside a model transformers loads."""
    from tests.tools.hf_models import build_hf_model, convert_in_process
    from threefold.checkpoint.load import load_model

    hf_dir, ours = str(tmp_path / "hf"), str(tmp_path / "threefold")
    hf_model = build_hf_model("nemotron-h", hf_dir).eval()
    depth = _add_mtp_module(hf_model, hf_dir)
    convert_in_process(
        "--loader", "hf", "--saver", "threefold", "--load-dir", hf_dir, "--save-dir", ours
    )  # fmt: skip
    config, model, _ = load_model(ours, with_tokenizer=False)
    assert config.model.hybrid_layer_pattern == "M*-EM*/*E" and config.model.mtp_num_layers == 1
    expected = _mtp_loss(hf_model, depth, TOKENS)
    with torch.no_grad():
        model.train()(TOKENS[:, :-1], labels=TOKENS[:, 1:])  # (the depths run in training)
    assert abs(model.mtp.take_losses()[0].item() - expected.item()) < 1e-5 * expected.item()
    swapped = torch.nn.ModuleList(reversed(list(depth.stack.layers)))
    depth.stack.layers, swapped = swapped, depth.stack.layers
    assert abs(_mtp_loss(hf_model, depth, TOKENS) - expected) > 1e-3
    depth.stack.layers = swapped
    hf_model.config.num_nextn_predict_layers = 1  # (the exported config's)
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)


def test_nemotron_3_super_goes_to_megatron_lm_and_back(tmp_path):
    """The Hub's Nemotron 3 Super shape (a hybrid with latent experts and its prediction
    module) through threefold to Megatron-LM's torch_dist and back, bitwise, under
    Megatron-LM's names (docs/checkpoints.md)."""
    from tests.tools.hf_models import build_hf_model, convert_in_process
    from threefold.checkpoint.load import load_model
    from threefold.safe_loading import SafeFileSystemReader

    hf_dir = str(tmp_path / "hf")
    _add_mtp_module(build_hf_model("nemotron-h-latent", hf_dir).eval(), hf_dir)
    ours, megatron, back = (str(tmp_path / name) for name in ("ours", "megatron", "back"))
    for loader, saver, source, target in (
        ("hf", "threefold", hf_dir, ours),
        ("threefold", "megatron", ours, megatron),
        ("megatron", "threefold", megatron, back),
    ):
        convert_in_process(
            "--loader", loader, "--saver", saver, "--load-dir", source, "--save-dir", target
        )  # fmt: skip
    path = os.path.join(megatron, "iter_0000000")
    keys = set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
    depth = "mtp.layers.0.mtp_model_layer.layers."
    assert {"decoder.layers.3.mlp.fc1_latent_proj.weight", "decoder.final_norm.weight"} <= keys
    assert {depth + "0.self_attention.linear_qkv.layer_norm_weight"} <= keys
    assert {depth + "1.mlp.fc2_latent_proj.weight", depth + "1.mlp.router.expert_bias"} <= keys
    original = load_model(ours, with_tokenizer=False)[1].state_dict()
    for source in (megatron, back):
        model = load_model(source, with_tokenizer=False)[1]
        assert model.state_dict().keys() == original.keys()
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, original[name]), (source, name)


def test_the_depths_layers_are_read_as_transformers_reads_them(converted):
    """`mtp_layers_block_type`, or the older files' `mtp_hybrid_override_pattern` (which
    transformers takes over the list's default), for `num_nextn_predict_layers` depths."""
    hf = {**converted[0].config.to_dict(), "num_nextn_predict_layers": 2}
    assert model_config_from_hf(hf)[1].hybrid_layer_pattern == "M*-EM*/*E/*E"
    older = {**hf, "mtp_hybrid_override_pattern": "M-"}
    assert model_config_from_hf(older)[1].hybrid_layer_pattern == "M*-EM*/M-/M-"
    listed = {**older, "mtp_layers_block_type": ["linear_attention", "moe"]}
    assert model_config_from_hf(listed)[1].mtp_num_layers == 2
    assert model_config_from_hf(listed)[1].hybrid_layer_pattern.endswith("/ME/ME")


HYBRID = ["--hybrid-layer-pattern", "M*-M", "--hidden-size", "64", "--num-attention-heads", "4"]
HYBRID += ["--group-query-attention", "--num-query-groups", "2", "--squared-relu"]
HYBRID += ["--untie-embeddings-and-output-weights"]
HYBRID += ["--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--disable-bias-linear"]
HYBRID += ["--position-embedding-type", "none", "--mock-data", "--vocab-size", str(VOCAB)]
HYBRID += ["--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "1"]
HYBRID += ["--mamba-state-dim", "8", "--mamba-head-dim", "16", "--mamba-num-groups", "2"]


def test_a_hybrid_model_exports_as_nemotron_h_and_others_are_refused(tmp_path, capsys):
    """A hybrid stack trained in threefold (no positions, ReLU²) exports as NemotronH with
    transformers' logits; a GPT model as NemotronH, or the hybrid as LLaMA, is one line."""
    from tests.tools.hf_models import convert_in_process

    exported = assert_exports_as(HYBRID, tmp_path / "hybrid", "NemotronHForCausalLM")
    assert exported["layers_block_type"][:2] == ["linear_attention", "full_attention"]
    ours = str(tmp_path / "hybrid" / "threefold")
    capsys.readouterr()  # (transformers' loading bars)
    with pytest.raises(SystemExit):
        convert_in_process(
            "--loader", "threefold", "--saver", "hf", "--load-dir", ours,
            "--save-dir", str(tmp_path / "as-llama"), "--hf-architecture", "LlamaForCausalLM",
        )  # fmt: skip
    error = capsys.readouterr().err
    assert "hybrid stack (--hybrid-layer-pattern), which LlamaForCausalLM is not" in error
    assert error.count("\n") == 1


@pytest.mark.parametrize(
    "changed,named",
    [
        ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
        ({"time_step_limit": [0.0, 0.1]}, "time_step_limit"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu'"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"layers_block_type": ["linear_attention", "gdn"]}, "layers_block_type"),
    ],
)
def test_what_threefold_cannot_build_is_refused_by_name(converted, changed, named):
    hf = {**converted[0].config.to_dict(), **changed}
    with pytest.raises(ConfigError, match=named):
        model_config_from_hf(hf)
