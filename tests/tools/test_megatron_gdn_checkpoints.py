"""A hybrid gated delta net model (Qwen3-Next's kind: gated delta net and gated attention
layers, MoE with a gated shared expert) to Megatron-LM's torch_dist and back: the keys are
megatron-core's (per layer, the projection and convolution a section at a time as its
`GatedDeltaNet.sharded_state_dict` names them, which test_gated_delta_net_megatron.py takes
from megatron-core itself), the args carry the architecture, the round trip is bitwise, and a
TP2 run reads the Megatron checkpoint into its shards."""

from __future__ import annotations

import os

import numpy as np
import torch

from tests.distributed import run_distributed
from tests.model.test_gated_delta_net import QWEN3_NEXT
from tests.parity import _full, _setup
from tests.tools.hf_models import convert_checkpoint
from threefold.checkpoint.load import load_checkpoint, load_model
from threefold.checkpoint.megatron.common_file import read_common
from threefold.checkpoint.save import save_checkpoint
from threefold.safe_loading import SafeFileSystemReader


def _loaded_parameters(argv: list[str], root: str) -> dict:
    trainer = _setup(argv)
    load_checkpoint(root, trainer.checkpoint_components(), finetune=True)
    return _full(trainer)


def _convert(loader: str, saver: str, source: str, target: str) -> str:
    argv = ["--loader", loader, "--saver", saver, "--load-dir", source, "--save-dir", target]
    assert convert_checkpoint.main(argv) == 0
    return target


def test_a_hybrid_model_goes_to_megatron_and_back(tmp_path):
    trainer = _setup(QWEN3_NEXT)
    trainer.train_step()
    ours = str(tmp_path / "ours")
    save_checkpoint(ours, trainer.checkpoint_components())
    megatron = _convert("threefold", "megatron", ours, str(tmp_path / "megatron"))
    back = _convert("megatron", "threefold", megatron, str(tmp_path / "back"))

    path = os.path.join(megatron, "iter_0000001")
    keys = set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
    gdn, attention = "decoder.layers.0.self_attention.", "decoder.layers.1.self_attention."
    for section in ("query", "key", "value", "z", "beta", "alpha"):
        assert f"{gdn}in_proj.weight.{section}" in keys
    for section in ("query", "key", "value"):
        assert f"{gdn}conv1d.weight.{section}" in keys
    expected = ("in_proj.layer_norm_weight", "A_log", "dt_bias", "out_norm.weight")
    assert {gdn + name for name in (*expected, "out_proj.weight")} <= keys
    assert attention + "linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.0.mlp.shared_experts.gate_weight" in keys
    assert not any(key.startswith("decoder.layers.self_attention") for key in keys)  # per layer
    args = read_common(path)["args"]
    assert args["experimental_attention_variant"] == "gated_delta_net"
    assert args["linear_attention_freq"] == 2 and args["linear_num_value_heads"] == 4
    assert args["attention_output_gate"] and args["moe_shared_expert_gate"]

    original = dict(load_model(ours, with_tokenizer=False)[1].state_dict())
    for source in (back, megatron):
        model = load_model(source, with_tokenizer=False)[1]
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, original[name]), (source, name)

    full = _full(trainer)
    argv = QWEN3_NEXT + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    for params in run_distributed(2, _loaded_parameters, argv, path):
        assert set(params) == set(full)
        for name, value in params.items():
            np.testing.assert_array_equal(value, full[name], err_msg=name)
