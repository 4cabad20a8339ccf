"""tools/convert_checkpoint.py: HF models convert to threefold and back; the converted model
computes what `transformers` computes, at TP=1 and TP=2 x PP=2."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import inference_job
from tests.tools.hf_models import TOKENS, VOCAB, build_hf_model, convert_in_process

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tests.tools.hf_checks import assert_transformers_losses, per_token_losses  # noqa: E402
from threefold.checkpoint.load import load_model  # noqa: E402
from threefold.inference import generate  # noqa: E402
from threefold.model.rope import RotaryEmbedding  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = [
    "llama",
    "llama-tied",
    "llama3",
    "llama-linear",
    "llama-yarn",
    "qwen2",
    "qwen3",
    "gpt2",
    "mistral",
    "mixtral",
    "qwen3-moe",
    "qwen3-next",
    "deepseek-v3",
    "glm4-moe",
    "llama4",
    "gpt-oss",
]


def convert(*argv: str) -> subprocess.CompletedProcess:
    """The tool as a user runs it: a process of its own, its exit code and its one-line
    refusals (`convert_in_process` spares the conversions that only make inputs the cost)."""
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (HF model, HF directory, threefold checkpoint directory)."""
    out = {}
    for kind in KINDS:
        root = tmp_path_factory.mktemp(kind)
        hf_dir, ours = str(root / "hf"), str(root / "threefold")
        model = build_hf_model(kind, hf_dir)
        convert_in_process(
            "--loader", "hf", "--saver", "threefold", "--load-dir", hf_dir, "--save-dir", ours
        )
        out[kind] = (model, hf_dir, ours)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_at_tp1(converted, kind):
    hf_model, _, ours = converted[kind]
    _, model, _ = load_model(ours)
    with torch.no_grad():
        logits = model(TOKENS)[..., :VOCAB].transpose(0, 1)
        expected = hf_model(TOKENS).logits
    error = (logits - expected).abs().max() / expected.abs().max()
    assert error < 1e-4, error


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bitwise_and_transformers_loads_the_export(converted, kind, tmp_path):
    _, hf_dir, ours = converted[kind]
    exported = str(tmp_path / "exported")
    convert_in_process(
        "--loader", "threefold", "--saver", "hf", "--load-dir", ours, "--save-dir", exported
    )
    before = {}
    for name in os.listdir(hf_dir):  # one file, or shards listed by an index
        if name.endswith(".safetensors"):
            before.update(safetensors_torch.load_file(os.path.join(hf_dir, name)))
    after = safetensors_torch.load_file(os.path.join(exported, "model.safetensors"))
    before.pop("lm_head.weight", None) if kind in ("llama-tied", "llama3", "gpt2") else None
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), (
            name
        )
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert transformers.AutoTokenizer.from_pretrained(exported).encode("To be") != []
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, converted[kind][0](TOKENS).logits)


def test_an_export_writes_over_nothing_and_appears_only_once_complete(converted, tmp_path):
    _, _, ours = converted["llama"]
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "config.json").write_text("{}")  # an earlier model, or anything else
    result = convert(
        "--loader", "threefold", "--saver", "hf", "--load-dir", ours, "--save-dir", str(exported)
    )
    assert (result.returncode, result.stderr) == (
        2,
        f"convert_checkpoint.py: error: --save-dir {exported}: exists and is not an empty "
        "directory; an export writes over nothing: choose a new directory\n",
    )
    assert (
        os.listdir(exported) == ["config.json"] and (exported / "config.json").read_text() == "{}"
    )
    # Into an empty directory (made for it): written beside it, renamed into place.
    (exported / "config.json").unlink()
    (tmp_path / "exported.partial").mkdir()  # a failed export's, cleared
    (tmp_path / "exported.partial" / "model.safetensors").write_text("half")
    convert_in_process(
        "--loader", "threefold", "--saver", "hf", "--load-dir", ours, "--save-dir", str(exported)
    )
    assert sorted(os.listdir(tmp_path)) == ["exported"]
    assert {"config.json", "model.safetensors"} <= set(os.listdir(exported))


def test_a_megatron_export_leaves_a_runs_tracker_as_it_was(converted, tmp_path):
    """(before: exported into a Megatron-LM run's --save, the export's iteration took the
    run's tracker, and the run went on from the export)"""
    _, _, ours = converted["llama"]
    run = tmp_path / "run"
    run.mkdir()
    tracker = run / "latest_checkpointed_iteration.txt"
    tracker.write_text("500")
    result = convert(
        "--loader", "threefold", "--saver", "megatron", "--load-dir", ours, "--save-dir", str(run)
    )
    assert (result.returncode, result.stderr) == (
        2,
        f"convert_checkpoint.py: error: --save-dir {run}: {tracker} exists already; an export "
        "writes over nothing: choose another directory\n",
    )
    assert os.listdir(run) == [tracker.name] and tracker.read_text() == "500"


# (gpt-oss's window of 8 and sinks, llama4's chunks and temperature: reached as the text grows)
@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral", "gpt-oss", "llama4"])
def test_greedy_generation_matches_transformers(converted, kind):
    hf_model, _, ours = converted[kind]
    _, model, tokenizer = load_model(ours)
    prompt = tokenizer.tokenize("To be, or not")
    ours_ids = generate(model, prompt, 12, 64)
    theirs = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert ours_ids == theirs


def _generate_and_score(directory: str, pipeline: int = 1, tensor: int = 1) -> tuple[list, float]:
    return inference_job(directory, pipeline, tensor, "To be, or not", TOKENS[0].tolist())


@pytest.mark.parametrize("kind", ["llama", "llama3"])  # untied, tied embeddings
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)], ids=["pp2", "tp2pp2"])
def test_pipeline_parallel_generation_and_scoring_equal_one_device(converted, kind, tp, pp):
    """tools/generate.py and tools/score.py over pipeline stages (a model that needs PP to
    fit): the same greedy tokens and the same loss as on one device."""
    _, _, ours = converted[kind]
    expected_ids, expected_loss = _generate_and_score(ours)
    for ids, loss in run_distributed(tp * pp, _generate_and_score, ours, pp, tp):
        assert ids == expected_ids
        assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_generation_tools_refuse_a_layout_the_model_cannot_take(converted):
    """llama-tied has one query group: no TP split, said in one line."""
    _, _, ours = converted["llama-tied"]
    with pytest.raises(AssertionError, match="--num-query-groups 1 is not divisible"):
        run_distributed(2, _generate_and_score, ours, 1, 2)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tp2_pp2per_token_losses_match_transformers(converted, kind):
    hf_model, _, ours = converted[kind]
    config, _, _ = load_model(ours)
    model = config.model
    argv = [
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        str(model.ffn_hidden_size),
        "--seq-length",
        "23",
        "--max-position-embeddings",
        str(model.max_position_embeddings),
        "--vocab-size",
        str(VOCAB),
        "--mock-data",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--normalization",
        model.normalization,
        "--norm-epsilon",
        str(model.norm_epsilon),
        "--position-embedding-type",
        model.position_embedding_type,
        "--rotary-base",
        str(model.rotary_base),
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    ]
    if kind == "llama":
        argv += [
            "--swiglu",
            "--disable-bias-linear",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--untie-embeddings-and-output-weights",
        ]
    else:
        argv += ["--openai-gelu"]
    results = [r for r in run_distributed(4, per_token_losses, argv, ours) if r is not None]
    assert_transformers_losses(hf_model, results)


@pytest.mark.parametrize(
    "kind,layout",
    [
        ("mixtral", []),
        ("qwen3-moe", []),
        # DeepSeek-V3's dense first layer and MoE layers on two pipeline stages x EP2
        ("deepseek-v3", ["--pipeline-model-parallel-size", "2"]),
        # gated delta nets then a dense MLP on one stage, gated attention on the other, x EP2
        ("qwen3-next", ["--pipeline-model-parallel-size", "2"]),
        # biased experts and router, sinks and windows on two stages x EP2
        ("gpt-oss", ["--pipeline-model-parallel-size", "2"]),
        # GLM-4.5's biased, normalized, half-rotated heads and grouped routing, PP2 x EP2
        ("glm4-moe", ["--pipeline-model-parallel-size", "2"]),
    ],
    ids=["mixtral", "qwen3-moe", "deepseek-v3-pp2", "qwen3-next-pp2", "gpt-oss-pp2", "glm-pp2"],
)
def test_expert_parallelper_token_losses_match_transformers(converted, kind, layout):
    hf_model, _, ours = converted[kind]
    argv = ["--use-checkpoint-args", "--load", ours, "--mock-data", "--seq-length", "23"]
    argv += ["--micro-batch-size", "2", "--global-batch-size", "4"]
    argv += ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    world = 4 if layout else 2
    results = run_distributed(world, per_token_losses, argv + layout, ours)
    assert_transformers_losses(hf_model, [r for r in results if r is not None])


@pytest.mark.parametrize(
    "scaling,named",
    [
        ({"rope_type": "dynamic", "factor": 4.0}, "rope_scaling='dynamic'"),
        (
            {"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.0},
            "rope_scaling.attention_factor=2.0",
        ),
        (  # (LongRoPE converts: Phi-4 mini's, tests/tools/test_convert_phi3.py)
            {"rope_type": "longrope", "factor": 8.0, "original_max_position_embeddings": 4096},
            "no 'short_factor' field, which LlamaForCausalLM needs",
        ),
    ],
)
def test_unsupported_config_is_refused_by_name(tmp_path, scaling, named):
    model_dir = str(tmp_path / "hf")
    build_hf_model("llama", model_dir, num_layers=1)
    import json

    config_file = os.path.join(model_dir, "config.json")
    config = json.load(open(config_file))
    config["rope_scaling"] = scaling
    config.pop("rope_parameters", None)
    json.dump(config, open(config_file, "w"))
    result = convert(
        "--loader",
        "hf",
        "--saver",
        "threefold",
        "--load-dir",
        model_dir,
        "--save-dir",
        str(tmp_path / "out"),
    )
    assert result.returncode == 2 and named in result.stderr, result.stderr


def test_sliding_windows_convert_as_transformers_computes_them(converted, tmp_path):
    """Mistral's window of 8 (its `converted` model) is --window-size 7,0 and exports back;
    Qwen2's windows in the layers from max_window_layers on are a --window-attn-skip-freq
    pattern, with transformers' logits, and export back as its layer_types, which
    transformers loads with the same logits; as Mistral, which slides in every layer, that
    pattern is refused."""
    import json

    config, _, _ = load_model(converted["mistral"][2])
    assert (config.model.window_size, config.model.window_attn_skip_freq) == ("7,0", None)
    hf_dir, ours = str(tmp_path / "hf"), str(tmp_path / "ours")
    build_hf_model("qwen2", hf_dir)
    config_file = os.path.join(hf_dir, "config.json")
    with open(config_file) as f:
        hf = json.load(f)
    hf.update(use_sliding_window=True, sliding_window=8, max_window_layers=2)
    hf.pop("layer_types", None)  # (transformers derives them from the three above)
    with open(config_file, "w") as f:
        json.dump(hf, f)
    convert_in_process(
        "--loader", "hf", "--saver", "threefold", "--load-dir", hf_dir, "--save-dir", ours
    )
    config, model, _ = load_model(ours)
    assert config.model.window_attn_skip_freq == "[0,0,1,1]"
    windowed = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = model(TOKENS)[..., :VOCAB].transpose(0, 1)
        expected = windowed(TOKENS).logits
    assert (logits - expected).abs().max() / expected.abs().max() < 1e-4
    with torch.no_grad():  # (the windows matter for these 24 tokens)
        assert (converted["qwen2"][0](TOKENS).logits - expected).abs().max() > 1e-3
    exported = str(tmp_path / "out")
    convert_in_process(
        "--loader", "threefold", "--saver", "hf", "--load-dir", ours, "--save-dir", exported
    )
    with open(os.path.join(exported, "config.json")) as f:
        written = json.load(f)
    assert written["layer_types"] == ["full_attention"] * 2 + ["sliding_attention"] * 2
    assert (written["use_sliding_window"], written["sliding_window"]) == (True, 8)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, expected)
    from threefold.checkpoint.hf import threefold_to_hf
    from threefold.config import ConfigError

    with pytest.raises(ConfigError, match="in some layers: export it as MistralForCausalLM"):
        threefold_to_hf({}, config.model, "MistralForCausalLM")


def test_linear_rope_scaling_is_megatrons_position_interpolation(converted, tmp_path):
    """transformers' `linear` rope type divides the frequencies by the factor, megatron-core's
    --rotary-seq-len-interpolation-factor the positions: the same tables, the flag in the
    checkpoint, and back in an export's rope_scaling."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding as MegatronRotaryEmbedding,
    )

    from tests.megatron_core_models import cpu_patches

    hf_model, _, ours = converted["llama-linear"]
    config, model, _ = load_model(ours)
    assert config.model.rotary_seq_len_interpolation_factor == 4.0
    cos, sin = model.rotary_pos_emb(24, torch.device("cpu"))
    positions = torch.arange(24)[None]
    their_cos, their_sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos[:, 0, 0], their_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0, 0], their_sin[0], rtol=0, atol=1e-6)
    plain = RotaryEmbedding(config.model.kv_channels, config.model.rotary_base)
    assert not torch.allclose(plain(24, torch.device("cpu"))[0], cos, atol=1e-3)
    megatron = MegatronRotaryEmbedding(
        config.model.kv_channels,
        1.0,
        seq_len_interpolation_factor=4.0,
        rotary_base=config.model.rotary_base,
        use_cpu_initialization=True,
    )
    with cpu_patches():  # (its tables are built on the current CUDA device)
        torch.testing.assert_close(megatron(24).cos(), cos, rtol=0, atol=1e-6)
    exported = str(tmp_path / "exported")
    convert_in_process(
        "--loader", "threefold", "--saver", "hf", "--load-dir", ours, "--save-dir", exported
    )
    with open(os.path.join(exported, "config.json")) as f:
        assert json.load(f)["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    megatron_dir = str(tmp_path / "megatron")  # Megatron-LM's args carry it too
    convert_in_process(
        "--loader",
        "threefold",
        "--saver",
        "megatron",
        "--load-dir",
        ours,
        "--save-dir",
        megatron_dir,
    )
    assert load_model(megatron_dir)[0].model.rotary_seq_len_interpolation_factor == 4.0


def test_llama3_rope_scaling_converts_to_the_flags(converted):
    """Over 24 positions the scaled frequencies barely move the logits, so the frequencies
    themselves are compared: transformers' llama3 ones, and not the unscaled ones."""
    hf_model, _, ours = converted["llama3"]
    config, model, _ = load_model(ours)
    assert config.model.use_rope_scaling and config.model.rope_scaling_factor == 32.0
    theirs = hf_model.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq, theirs, rtol=1e-6, atol=0)
    from threefold.model.rope import RotaryEmbedding

    plain = RotaryEmbedding(config.model.kv_channels, config.model.rotary_base).inv_freq
    ratio = plain / theirs  # one frequency kept, one interpolated, the slowest ones / 32
    assert ratio[0] == 1 and 1 < ratio[4] < 32 and torch.allclose(ratio[5:], torch.tensor(32.0))
    from threefold.checkpoint.args import model_flags

    flags = model_flags(vars(config.model))
    assert "--use-rope-scaling" in flags
    assert flags[flags.index("--rope-scaling-factor") + 1] == "32.0"
    from tests.parity import TRAINING, _setup
    from threefold.checkpoint.load import load_checkpoint
    from threefold.config import ConfigError

    unscaled = [f for f in flags if f != "--use-rope-scaling"]
    with pytest.raises(ConfigError, match="--use-rope-scaling True but this run has False"):
        load_checkpoint(ours, _setup(TRAINING + unscaled).checkpoint_components(), finetune=True)


def test_score_cli_reports_the_perplexity_transformers_computes(converted, tmp_path):
    hf_model, _, ours = converted["llama"]
    _, _, tokenizer = load_model(ours)
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind"
    (tmp_path / "text.txt").write_text(text)
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "score.py"),
            "--load",
            ours,
            "--input",
            str(tmp_path / "text.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    ids = torch.tensor([tokenizer.tokenize(text)])
    with torch.no_grad():
        expected = hf_model(ids, labels=ids).loss.item()
    reported = float(result.stdout.split("mean loss: ")[1].split(" ")[0])
    assert abs(reported - expected) < 1e-4 * expected


@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe", "qwen3-next", "deepseek-v3", "glm4-moe"])
def test_stacked_experts_of_a_live_model_convert_as_the_saved_ones(converted, kind):
    from tests.tools.hf_models import assert_live_experts_convert_as_saved

    hf_model, hf_dir, _ = converted[kind]
    assert_live_experts_convert_as_saved(hf_model, hf_dir)


@pytest.mark.parametrize(
    "change,named",
    [
        ({"rope_interleave": False}, "rope_interleave=False"),
        ({"topk_group": 1}, "n_group/topk_group=(4, 1)"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False"),
        ({"n_shared_experts": 0}, "n_shared_experts=0"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0}},
            "rope_parameters.beta_fast=16.0",
        ),
    ],
)
def test_deepseek_v3_settings_threefold_cannot_compute_are_refused(converted, change, named):
    """Each one would route or rotate differently from what threefold computes."""
    import json

    from threefold.checkpoint.hf import model_config_from_hf
    from threefold.config import ConfigError

    with open(os.path.join(converted["deepseek-v3"][1], "config.json")) as f:
        hf = {**json.load(f), **change}
    with pytest.raises(ConfigError, match=re.escape(named)):
        model_config_from_hf(hf)


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--moe-router-score-function", "softmax"], "softmax routing scores"),
        (["--moe-router-num-groups", "2", "--moe-router-group-topk", "2"], "top 2 experts"),
    ],
)
def test_an_mla_model_deepseek_v3_cannot_express_is_refused(flags, named):
    from threefold.arguments import parse_args
    from threefold.checkpoint.hf import threefold_to_hf
    from threefold.config import ConfigError

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    argv += ["--multi-latent-attention", "--qk-layernorm", "--swiglu", "--normalization"]
    argv += ["RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope"]
    argv += ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-score-function"]
    argv += ["sigmoid", "--moe-shared-expert-intermediate-size", "64", "--mock-data"]
    argv += ["--moe-ffn-hidden-size", "32", "--vocab-size", str(VOCAB), "--seq-length", "16"]
    argv += ["--micro-batch-size", "2"]
    config = parse_args(argv + flags).model
    with pytest.raises(ConfigError, match=re.escape(named)):
        threefold_to_hf({}, config, "DeepseekV3ForCausalLM")


def test_a_gated_model_exports_as_qwen3_next_only(converted):
    from threefold.checkpoint.hf import threefold_to_hf
    from threefold.config import ConfigError

    config, model, _ = load_model(converted["qwen3-next"][2], with_tokenizer=False)
    whole_rope = dataclasses.replace(config.model, rotary_percent=1.0)
    with pytest.raises(ConfigError, match="export this model as Qwen3NextForCausalLM"):
        threefold_to_hf(model.state_dict(), whole_rope, "Qwen3MoeForCausalLM")


@pytest.mark.parametrize(
    "files, line",
    [
        ({"model.safetensors": b"\xff" * 64}, "{dir}/model.safetensors: not a readable"),
        (
            {"model.safetensors.index.json": b'{"weight_map": {"x": "model-1.safetensors"}}'},
            "{dir}: 'model-1.safetensors', listed in its index, is missing",
        ),
        (
            {"model.safetensors.index.json": b'{"weight_map": 3}'},
            "{dir}/model.safetensors.index.json: not a safetensors index (AttributeError",
        ),
    ],
    ids=["not-safetensors", "shard-missing", "index-not-a-map"],
)
def test_hugging_face_weights_that_cannot_be_read_are_one_line(files, line, tmp_path):
    """(before: safetensors' SafetensorError, a FileNotFoundError or an AttributeError)"""
    from threefold.checkpoint.convert import read_hf_weights
    from threefold.config import ConfigError

    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError) as refused:
        read_hf_weights(str(tmp_path))
    assert str(refused.value).startswith(f"--load-dir {line.format(dir=tmp_path)}")
