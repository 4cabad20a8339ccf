"""DeepSeek-V3's and GLM-4.5's multi-token prediction layers (the Hub's model.layers.{N} after
the decoder's N: a decoder layer with enorm, hnorm, eh_proj, shared_head.norm and copies of the
embedding and output layer) and Qwen3-Next's module (`mtp.*`: its fc, norms and one layer) in
and out as threefold's depths (--mtp-num-layers).

transformers builds no such layer and ignores its tensors; the reference composes vLLM's
DeepSeek MTP (megatron-core's depth) from transformers' own parts: a one-layer model of the
family whose norm is the depth's final norm. A tiny model given one depth computes its loss in
threefold (1e-5; another with enorm and hnorm swapped), and the round trip is bitwise; a model
transformers saved, whose config names a depth its files lack, converts without it, saying
so."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tools.hf_models import build_hf_model, convert_in_process, has_transformers

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)

from tests.tools.hf_checks import TOKENS, assert_round_trip  # noqa: E402
from tests.tools.hf_family_models import shaken  # noqa: E402
from threefold.checkpoint.load import load_model  # noqa: E402

# Where each family's files keep the depth: its layer's prefix, and its final norm, enorm,
# hnorm and projection (N: the decoder's layers); the one-layer model's config changes
FILES = {
    "deepseek-v3": (
        "model.layers.{N}.",
        [
            f"model.layers.{{N}}.{n}.weight"
            for n in ("shared_head.norm", "enorm", "hnorm", "eh_proj")
        ],
        {"num_hidden_layers": 1, "first_k_dense_replace": 0},
    ),
    "qwen3-next": (
        "mtp.layers.0.",
        [f"mtp.{n}.weight" for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc")],
        {"num_hidden_layers": 1, "layer_types": ["full_attention"]},
    ),
}
FILES["glm4-moe"] = FILES["deepseek-v3"]
# DeepSeek-V3.2's layer: its indexer in the depth's attention too (left out: below)
prefix, names, changes = FILES["deepseek-v3"]
FILES["deepseek-v32"] = (
    prefix,
    names,
    {**changes, "layer_types": ["indexed_attention"], "mlp_layer_types": ["sparse"]},
)


def _add_depth(kind: str, hf_model, hf_dir: str, scratch: str) -> torch.nn.Module:
    """The Hub's depth added to the tiny model's files and config: its layer made by
    transformers (a one-layer model of the family, saved, so in the Hub's layout), where the
    family's files keep it (`FILES`)."""
    from safetensors import torch as safetensors_torch

    torch.manual_seed(1)
    layers = hf_model.config.num_hidden_layers
    prefix, (final, *parts), changes = FILES[kind]
    prefix, final, parts = (
        prefix.format(N=layers),
        final.format(N=layers),
        [p.format(N=layers) for p in parts],
    )
    config = type(hf_model.config)(**{**hf_model.config.to_dict(), **changes})
    depth = torch.nn.Module()
    depth.stack = shaken(type(hf_model.model)(config)).eval()
    norm, hidden = type(hf_model.model.norm), config.hidden_size
    depth.enorm, depth.hnorm = norm(hidden, config.rms_norm_eps), norm(hidden, config.rms_norm_eps)
    depth.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
    with torch.no_grad():
        for name, param in depth.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("weight"):  # (a layer that counts: larger than initialized)
                param.normal_(0, 0.1)
    depth.stack.save_pretrained(scratch)
    saved = safetensors_torch.load_file(os.path.join(scratch, "model.safetensors"))
    files = os.path.join(hf_dir, "model.safetensors")
    tensors = safetensors_torch.load_file(files)
    for name, tensor in saved.items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):
            tensors[prefix + name.removeprefix("layers.0.")] = tensor
    tensors[final] = saved["norm.weight"]
    for name, part in zip(("enorm", "hnorm", "eh_proj"), parts):
        tensors[part] = getattr(depth, name).weight.detach().clone()
    if prefix.startswith("model."):  # (DeepSeek-V3's layer holds copies of both ends)
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, files)
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump({**hf, "num_nextn_predict_layers": 1}, f)
    return depth


def _depth_loss(hf_model, depth, tokens, swapped: bool = False) -> float:
    """The depth's loss as vLLM's DeepSeek MTP computes it (and megatron-core's depth): the
    next token's embedding and the model's output, each normalized, concatenated and
    projected, through the depth's layer and final norm to the shared output layer, two
    tokens ahead. `swapped`: enorm and hnorm the other way round."""
    inputs = tokens[:, :-1]
    enorm, hnorm = (depth.hnorm, depth.enorm) if swapped else (depth.enorm, depth.hnorm)
    with torch.no_grad():
        main = hf_model.model(inputs).last_hidden_state[:, :-1]
        embeddings = hf_model.model.embed_tokens(inputs[:, 1:])
        both = torch.cat([enorm(embeddings), hnorm(main)], dim=-1)
        hidden = depth.stack(inputs_embeds=depth.eh_proj(both)).last_hidden_state
        logits = hf_model.lm_head(hidden)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten()).item()


@pytest.mark.parametrize("kind", ["deepseek-v3", "glm4-moe", "qwen3-next"])
def test_the_hubs_depth_is_a_depth_both_ways(kind, tmp_path, capsys):
    hf_dir, ours = str(tmp_path / "hf"), str(tmp_path / "threefold")
    hf_model = build_hf_model(kind, hf_dir).eval()
    with open(os.path.join(hf_dir, "config.json")) as f:
        named = json.load(f).get("num_nextn_predict_layers")
    if named:  # (transformers' DeepSeek-V3 and GLM-4.5 configs name a depth, the files hold none)
        without = str(tmp_path / "without")
        convert_in_process(
            "--loader", "hf", "--saver", "threefold", "--load-dir", hf_dir, "--save-dir", without
        )  # fmt: skip
        out = capsys.readouterr().out
        assert "names 1 multi-token prediction depths and the files hold 0" in out
        assert load_model(without, with_tokenizer=False)[0].model.mtp_num_layers is None
    depth = _add_depth(kind, hf_model, hf_dir, str(tmp_path / "depth"))
    convert_in_process(
        "--loader", "hf", "--saver", "threefold", "--load-dir", hf_dir, "--save-dir", ours
    )  # fmt: skip
    config, model, _ = load_model(ours, with_tokenizer=False)
    assert config.model.mtp_num_layers == 1
    with torch.no_grad():
        model.train()(TOKENS[:, :-1], labels=TOKENS[:, 1:])  # (the depths run in training)
    ours_loss, expected = model.mtp.take_losses()[0].item(), _depth_loss(hf_model, depth, TOKENS)
    assert abs(ours_loss - expected) < 1e-5 * expected
    assert abs(_depth_loss(hf_model, depth, TOKENS, swapped=True) - expected) > 1e-3
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    with open(os.path.join(tmp_path / "exported", "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1


def test_deepseek_v32s_depth_is_left_out_and_said(tmp_path, capsys):
    """Sparse attention beside multi-token prediction is not built: DeepSeek-V3.2's layer after
    the decoder's stays behind, in one line, and the model converts without depths."""
    hf_dir, ours = str(tmp_path / "hf"), str(tmp_path / "threefold")
    hf_model = build_hf_model("deepseek-v32", hf_dir).eval()
    _add_depth("deepseek-v32", hf_model, hf_dir, str(tmp_path / "depth"))
    convert_in_process(
        "--loader", "hf", "--saver", "threefold", "--load-dir", hf_dir, "--save-dir", ours
    )  # fmt: skip
    assert (
        "multi-token prediction layers (model.layers.4 on) are left out" in capsys.readouterr().out
    )
    assert load_model(ours, with_tokenizer=False)[0].model.mtp_num_layers is None
