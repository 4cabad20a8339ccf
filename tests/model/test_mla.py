"""Multi-latent attention (Megatron-LM's --multi-latent-attention): megatron-core's own
MLA model, saved by megatron-core and read by threefold, gives its logits; every parallel
layout trains as one process does; the export to Megatron-LM names the norms as Transformer
Engine's MLA spec does and reads back to the same logits."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from tests import megatron_core_models as mc
from tests.distributed import run_distributed
from tests.parity import (
    LLAMA_MHA_STYLE,
    TRAINING,
    assert_close_dicts,
    assert_losses_close,
    assert_matches_reference,
    first_step_gradients_job,
    train_job,
)
from tests.tools.hf_models import convert_checkpoint
from threefold.arguments import parse_args
from threefold.checkpoint.load import load_model
from threefold.safe_loading import SafeFileSystemReader
from threefold.training.flops import training_flops_per_iteration

MLA = LLAMA_MHA_STYLE + [
    "--multi-latent-attention",
    "--q-lora-rank",
    "24",
    "--kv-lora-rank",
    "16",
    "--qk-head-dim",
    "8",
    "--qk-pos-emb-head-dim",
    "8",
    "--v-head-dim",
    "12",
    "--qk-layernorm",
    "--rotary-scaling-factor",
    "40",
    "--mscale-all-dim",
    "1",
]


@pytest.mark.parametrize("kind,tp", [("mla", 2), ("mla_rope", 1)])
def test_megatron_cores_mla_checkpoint_gives_its_logits(tmp_path, kind, tp):
    """YaRN with its temperature, a query latent with latent norms, a value head narrower
    than the query/key head (saved by megatron-core at TP2); plain RoPE with queries from the
    hidden state and a wider value head. Without YaRN the same weights compute otherwise."""
    root = str(tmp_path / "megatron")
    run_distributed(tp, mc.save, kind, root, 10, tp, 1)
    reference = run_distributed(1, mc.logits, kind, f"{root}/iter_0000010")[0]
    config, model, _ = load_model(root, with_tokenizer=False)
    assert config.model.multi_latent_attention
    with torch.no_grad():
        logits = model(mc.TOKENS).transpose(0, 1)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    if kind != "mla":
        return
    from threefold.model import GPTModel

    config.model.rotary_scaling_factor = 1.0
    plain = GPTModel(config.model, model.padded_vocab_size)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (plain.eval()(mc.TOKENS).transpose(0, 1) - reference).abs().max() > 1e-2


LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "cp2_ring": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "cp2_ulysses": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
}


@pytest.fixture(scope="module")
def reference():
    return train_job(MLA + TRAINING, 5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_trains_as_one_process(reference, layout):
    world, extra = LAYOUTS[layout]
    results = run_distributed(world, train_job, MLA + TRAINING + extra, 5)
    assert_matches_reference(results, reference, 2e-6)


def test_lora_adapts_mlas_query_key_value_projections_as_one_process():
    """--lora-target-modules linear_qkv (the default) puts adapters on MLA's up projections;
    TP2 with sequence parallelism trains them as one process does."""
    argv = MLA + TRAINING + ["--lora-rank", "4", "--lr", "3e-2"]
    reference = train_job(argv, 5)
    adapted = {n.split(".")[4] for n in reference["params"] if ".adapter." in n}
    assert adapted == {"linear_q_up_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1"} | {
        "linear_fc2"
    }
    # Adam's first steps on B, which starts at zero, move by the sign of gradients that are
    # rounding noise here: the adapters' weights agree to 2e-4 (LLaMA's QKV adapters: 1e-5),
    # the losses to 1e-7. A missing TP reduction of A's gradient is off by 1e-1.
    world, extra = LAYOUTS["tp2_sp"]
    for result in run_distributed(world, train_job, argv + extra, 5):
        assert_losses_close(result["losses"], reference["losses"], 1e-6)
        assert_close_dicts(result["params"], reference["params"], 1e-3, "parameter")


def test_mla_flops_are_megatrons():
    """Megatron-LM's num_floating_point_operations for MLA's projections (its latents, their
    norms, the shared RoPE key part); the scores and the weighted sum counted as threefold
    counts every attention (the full s x s)."""
    config = parse_args(MLA + TRAINING).model
    h, n, s, r, c = 32, 8, 16, 24, 16
    q_term = r * (h + n * (8 + 8) + 1)
    kv_term = c * (h + n * (8 + 12) + 1) + h * 8
    projections = 2 * (q_term + kv_term + n * 12 * h)
    attention = 2 * s * n * (16 + 12)
    mlp = 2 * 3 * h * 64
    per_token = 2 * (projections + attention + mlp) + 2 * h * 1008
    expected = 3.0 * per_token * 8 * s
    assert training_flops_per_iteration(config, 8, 1008) == pytest.approx(expected)


def test_export_names_transformer_engines_mla_norms_and_reads_back(tmp_path, capsys):
    """To Megatron-LM under Transformer Engine's MLA spec names, read back bitwise; to
    Hugging Face (DeepseekV3ForCausalLM) refused in one line: this model adds learned
    position embeddings to MLA's RoPE (tests/tools/test_convert_checkpoint.py converts
    DeepSeek-V3 both ways)."""
    root = str(tmp_path / "megatron")
    run_distributed(1, mc.save, "mla", root, 10, 1, 1)
    _, model, _ = load_model(root, with_tokenizer=False)
    with torch.no_grad():
        ours = model(mc.TOKENS)
    ours_dir, out = str(tmp_path / "threefold"), str(tmp_path / "exported")
    for loader, saver, source, target in (
        ("megatron", "threefold", root, ours_dir),
        ("threefold", "megatron", ours_dir, out),
    ):
        argv = ["--loader", loader, "--saver", saver, "--load-dir", source, "--save-dir", target]
        assert convert_checkpoint.main(argv) == 0
    iteration = int(open(os.path.join(out, "latest_checkpointed_iteration.txt")).read())
    path = os.path.join(out, f"iter_{iteration:07d}")
    keys = set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
    for key in (
        "decoder.layers.input_layernorm.weight",
        "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight",
        "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
    ):
        assert key in keys, key
    _, again, _ = load_model(out, with_tokenizer=False)
    with torch.no_grad():
        assert torch.equal(again(mc.TOKENS), ours)
    hf = str(tmp_path / "hf")
    argv = ["--loader", "megatron", "--saver", "hf", "--load-dir", root, "--save-dir", hf]
    with pytest.raises(SystemExit):
        convert_checkpoint.main(argv)
    error = capsys.readouterr().err
    assert "DeepseekV3ForCausalLM cannot express this model: position embeddings" in error
    assert not os.path.exists(hf)


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--q-lora-rank", "8"], "--q-lora-rank: multi-latent attention settings"),
        (["--rope-type", "yarn"], "--rope-type yarn belongs to --multi-latent-attention"),
        (["--mscale-all-dim", "1"], "--mscale-all-dim: YaRN settings of a model without"),
        (["--yarn-beta-fast", "16"], "--yarn-beta-fast belong to --position-embedding-type yarn"),
        (
            ["--position-embedding-type", "yarn", "--rotary-interleaved"],
            "--rotary-interleaved needs --position-embedding-type rope",
        ),
        (
            MLA[len(LLAMA_MHA_STYLE) :]
            + ["--position-embedding-type", "yarn"]
            + ["--yarn-beta-fast", "16"],
            "--yarn-beta-fast with --multi-latent-attention",
        ),
        (MLA[len(LLAMA_MHA_STYLE) :] + ["--rotary-interleaved"], "--rotary-interleaved with"),
        (
            MLA[len(LLAMA_MHA_STYLE) :] + ["--group-query-attention", "--num-query-groups", "2"],
            "exclude",
        ),
    ],
)
def test_mla_settings_without_it_or_against_it_are_refused(capsys, argv, named):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_MHA_STYLE + argv + TRAINING)
    assert named in capsys.readouterr().err


def test_mla_softmax_scale_is_yarns_temperature_squared_over_the_head_size():
    """megatron-core's MLA scale: (0.1 mscale_all_dim ln(factor) + 1)^2 / sqrt(q head size);
    1 / sqrt(q head size) without YaRN scaling."""
    config = parse_args(MLA + TRAINING).model
    assert config.q_head_dim == 16
    temperature = 0.1 * math.log(40) + 1
    assert config.mla_softmax_scale == pytest.approx(temperature**2 / 4)
    config.rotary_scaling_factor = 1.0
    assert config.mla_softmax_scale == pytest.approx(1 / 4)


FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]


def test_fp8_mla_gradients_match_one_device_at_cp2():
    """Every MLA linear layer in FP8, the down projections too, their amaxes reduced over the
    CP ranks that each hold part of the sequence: the first step's loss and gradients are one
    device's to fp32 rounding."""
    argv = MLA + TRAINING + FP8
    reference = first_step_gradients_job(argv)
    assert len([name for name in reference["grads"] if "self_attention" in name]) == 2 * 7
    world, extra = LAYOUTS["cp2_ring"]
    for result in run_distributed(world, first_step_gradients_job, argv + extra):
        assert abs(result["loss"] - reference["loss"]) <= 1e-6 * reference["loss"]
        assert_close_dicts(result["grads"], reference["grads"], 2e-6, "gradient")


def _first_down_projection_input_in_fp8(argv: list[str], sabotage: bool) -> tuple:
    """The first step's FP8 cast of layer 0's key/value down projection input (this rank's
    rows) and its scale's inverse; `sabotage`: every cast scaled by its own rank's amax."""
    from tests.parity import _setup
    from threefold.kernels.fp8 import INPUT, Fp8Linear
    from threefold.parallel.parallel_context import ONE_DEVICE

    trainer = _setup(argv)
    state = trainer.model.decoder.layers[0].self_attention.linear_kv_down_proj.fp8
    for module in trainer.model.modules() if sabotage else []:
        if isinstance(module, Fp8Linear):
            module.amax_group = ONE_DEVICE
    seen, cast = [], state.cast

    def recording(index, tensor):
        result = cast(index, tensor)
        if index == INPUT and not seen:
            seen.append((result[0].float().numpy().copy(), float(result[2])))
        return result

    state.cast = recording
    trainer.train_step()
    return seen[0]


def test_fp8_mla_down_projections_cast_by_the_whole_sequences_amax():
    """TP2 with sequence parallelism: each rank's slice of the sequence is cast to FP8 with
    the amax of the whole (reduced over TP), so its FP8 bytes are one device's rows, bitwise
    (a maximum and an elementwise cast round nothing differently anywhere); cast with their
    own slice's amax, they are not. (Gradients are not compared at TP: the E5M2 casts of this
    tiny model's gradients turn TP's different summation order, 1e-7, into whole FP8 steps of
    single elements, percents of a weight's gradient; at CP2 they come out within 2e-6,
    above.)"""
    argv = MLA + TRAINING + FP8
    whole, inverse = _first_down_projection_input_in_fp8(argv, False)
    world, extra = LAYOUTS["tp2_sp"]
    for sabotage in (False, True):
        results = run_distributed(
            world, _first_down_projection_input_in_fp8, argv + extra, sabotage
        )
        rows = len(results[0][0])
        same = [
            np.array_equal(cast, whole[rank * rows : (rank + 1) * rows]) and scale == inverse
            for rank, (cast, scale) in enumerate(results)
        ]
        assert all(same) if not sabotage else not all(same), same
