"""Megatron-LM torch_dist checkpoints in and out, against megatron-core itself.

megatron-core's GPTModel (local layer spec) saves a LLaMA-style and a GPT-2-style model at
TP=2 x PP=2 on four gloo ranks with `dist_checkpointing.save`, as Megatron-LM's
`save_checkpoint` does (tests/megatron_core_models.py). threefold loads it at TP1, TP2, PP2 and
TP2 x PP2 and computes megatron-core's logits (megatron-core's own one-rank load is the
reference); training goes on from it; and threefold's export loads back into megatron-core.
megatron-core also trains with its own DDP and optimizer (DistributedOptimizer included) and
saves Adam's state: threefold goes on from it at other layouts exactly as megatron-core does.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from tests import megatron_core_models as mc
from tests import megatron_core_training as mt
from tests.distributed import run_distributed
from tests.tools.hf_models import convert_checkpoint
from tests.tools.megatron_runs import (
    continue_argv,
    continue_training,
    copy_with_args,
    export_and_go_on,
    exports,
    largest_difference,
    megatron_argv,
    megatrons_integrity,
    per_token_losses,
    reference_losses,
    saved_by_megatron_core,
    train_from,
)
from threefold.checkpoint.load import load_checkpoint, load_model
from threefold.config import ConfigError

KINDS = ["llama", "gpt2"]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """kind -> (Megatron-LM checkpoint root, megatron-core's logits of TOKENS)."""
    return saved_by_megatron_core(tmp_path_factory, {kind: (2, 2, 1, 4) for kind in KINDS})


@pytest.mark.parametrize("kind", KINDS)
def test_tp1_logits_equal_megatron_cores(megatron, kind):
    root, reference = megatron[kind]
    config, model, _ = load_model(root, with_tokenizer=False)
    assert (config.model.num_layers, config.model.vocab_size) == (4, mc.PADDED_VOCAB)
    with torch.no_grad():
        logits = model(mc.TOKENS).transpose(0, 1)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2pp2"])
def test_any_layout_computes_megatron_cores_losses(megatron, kind, tp, pp):
    root, reference = megatron[kind]
    results = run_distributed(tp * pp, per_token_losses, megatron_argv(root, tp, pp), root)
    expected = reference_losses(reference)
    for losses in (r for r in results if r is not None):
        torch.testing.assert_close(torch.tensor(losses), expected, rtol=0, atol=1e-5)


def test_training_goes_on_from_a_megatron_checkpoint_as_from_its_conversion(megatron, tmp_path):
    """--load of the Megatron directory trains exactly as the converted threefold checkpoint."""
    root, _ = megatron["llama"]
    converted = str(tmp_path / "converted")
    argv = ["--loader", "megatron", "--saver", "threefold", "--load-dir", root]
    assert convert_checkpoint.main(argv + ["--save-dir", converted]) == 0
    direct, _ = train_from(megatron_argv(root, 1, 1) + ["--finetune"], root, finetune=True)
    from_conversion, _ = train_from(
        megatron_argv(root, 1, 1) + ["--finetune"], converted, finetune=True
    )
    assert direct == from_conversion
    assert all(torch.isfinite(torch.tensor(direct)))


def test_no_load_optim_resumes_megatrons_iteration_and_schedule(megatron):
    root, _ = megatron["gpt2"]
    _, trainer = train_from(
        megatron_argv(root, 1, 1) + ["--no-load-optim"], root, finetune=False, steps=1
    )
    state = trainer.checkpoint_components().train_state
    assert (state.iteration, state.consumed_train_samples) == (11, 642)
    assert state.consumed_valid_samples == 24  # where Megatron-LM's evaluations had read to
    # Megatron-LM's schedule counts samples (640 saved) and scales its iteration counts by the
    # global batch; an iteration-based run counts iterations: 640 over this run's batch of 2,
    # where Megatron-LM's schedule would stand (its run's batch was 64), then one more.
    assert trainer.checkpoint_components().scheduler.num_steps == 640 // 2 + 1


def test_a_megatron_checkpoint_without_optimizer_state_needs_no_load_optim(megatron):
    from tests.parity import _setup

    root, _ = megatron["llama"]
    trainer = _setup(megatron_argv(root, 1, 1))
    with pytest.raises(ConfigError, match="without its optimizer state; pass --no-load-optim"):
        load_checkpoint(root, trainer.checkpoint_components())


# -- Megatron-LM's optimizer state: training goes on as megatron-core's own -------------------
@pytest.fixture(scope="module")
def megatron_trained(tmp_path_factory):
    """layout -> (checkpoint root, megatron-core's weights one iteration later, its loss):
    megatron-core trained 2 iterations at TP2 x DP2 with its optimizer in that layout."""
    runs = {}
    for layout in ("fully_reshardable", "non-distributed", "dp_reshardable"):
        directory = tmp_path_factory.mktemp(f"megatron_{layout}")
        root, after = str(directory / "run"), str(directory / "after")
        optimizer = None if layout == "non-distributed" else layout
        losses = run_distributed(4, mt.train_and_save, "llama", root, after, 2, optimizer, 2)
        runs[layout] = (root, after, losses[0])
    return runs


@pytest.mark.parametrize(
    "layout,tp,pp,dp,flags",
    [
        ("fully_reshardable", 1, 1, 1, []),
        ("fully_reshardable", 2, 2, 1, []),
        ("fully_reshardable", 1, 1, 2, ["--use-distributed-optimizer"]),
        ("non-distributed", 1, 1, 1, []),
        ("dp_reshardable", 1, 1, 1, []),
        ("dp_reshardable", 2, 2, 1, []),
        ("dp_reshardable", 1, 1, 2, ["--use-distributed-optimizer"]),
        # into PyTorch's data parallelism (Megatron-LM's --use-torch-fsdp2): FSDP2's shards
        ("fully_reshardable", 2, 1, 2, ["--distributed-strategy", "fsdp"]),
        ("dp_reshardable", 1, 1, 2, ["--distributed-strategy", "ddp"]),
    ],
    ids=[
        "fully-reshardable-tp1",
        "fully-reshardable-tp2pp2",
        "fully-reshardable-dp2",
        "plain",
        "dp-reshardable-tp1",
        "dp-reshardable-tp2pp2",
        "dp-reshardable-dp2",
        "fully-reshardable-fsdp-tp2-dp2",
        "dp-reshardable-ddp-dp2",
    ],
)
def test_training_goes_on_from_megatrons_optimizer_as_in_megatron(
    megatron_trained, layout, tp, pp, dp, flags
):
    """megatron-core's Adam state (moments, fp32 masters, step) read into threefold at
    another layout: the next iteration's loss and updated weights are megatron-core's."""
    root, after, megatron_loss = megatron_trained[layout]
    argv = continue_argv(root, tp, pp, dp) + flags
    for loss, difference in run_distributed(
        tp * pp * dp, continue_training, argv, root, after, True
    ):
        assert loss == pytest.approx(megatron_loss, rel=1e-6)
        assert difference < 1e-6
    # The state is what makes it so: a fresh optimizer takes another step.
    if (tp, pp, dp) == (1, 1, 1) and layout == "fully_reshardable":
        _, difference = continue_training(argv + ["--no-load-optim"], root, after, False)
        assert difference > 1e-4


@pytest.mark.parametrize(
    "native,dp,flags",
    [
        (False, 1, []),
        (True, 1, []),
        # Megatron-LM's --use-torch-fsdp2 run: FSDP2's shards gathered, in both ways out
        (False, 2, ["--distributed-strategy", "fsdp"]),
        (True, 2, ["--distributed-strategy", "fsdp"]),
    ],
    ids=["converted", "saved-by-the-run", "fsdp-dp2-converted", "fsdp-dp2-saved-by-the-run"],
)
def test_an_export_with_adams_state_goes_on_in_megatron_core_as_megatron_core(
    megatron_trained, tmp_path, native, dp, flags
):
    """Megatron -> threefold -> Megatron with the optimizer: threefold reads megatron-core's
    checkpoint (Adam's state, TP2 x DP2) at TP1 (DP `dp`) and saves its own; the export of
    that (or the run's own --ckpt-format torch_dist save), read by megatron-core's distributed
    optimizer at TP2 x DP2 as Megatron-LM's --load reads it, takes the iteration megatron-core
    took from its own checkpoint: the same loss and weights."""
    root, after, megatron_loss = megatron_trained["fully_reshardable"]
    # (a run that steps the distributed optimizer, or FSDP2's shards, exports for it)
    argv = continue_argv(root, 1, 1, dp) + (flags or ["--use-distributed-optimizer"])
    path, loss, weights = export_and_go_on(argv, root, tmp_path, "llama", 2, 4, native, dp)
    assert loss == pytest.approx(megatron_loss, rel=1e-6)
    assert largest_difference(weights, after) < 1e-6
    # Megatron-LM's --load takes the optimizer and leaves its RNG as seeded (none saved).
    args = torch.load(os.path.join(path, "common.pt"), weights_only=False)["args"]
    assert (args.no_save_optim, args.no_save_rng, args.use_distributed_optimizer) == (
        False,
        True,
        True,
    )


@pytest.mark.parametrize(
    "native,flags,convert_flags",
    [
        (False, [], ()),
        (True, [], ()),
        (False, ["--use-distributed-optimizer"], ("--no-target-use-distributed-optimizer",)),
    ],
    ids=["converted", "saved-by-the-run", "converted-for-it"],
)
def test_an_export_goes_on_in_megatron_cores_non_distributed_optimizer(
    megatron_trained, tmp_path, native, flags, convert_flags
):
    """Without --use-distributed-optimizer megatron-core steps with torch's optimizer, whose
    --load takes its own parameter groups, exactly, and the step beside them in common.pt. A
    run without the flag exports so (the converter, and the run's own --ckpt-format
    torch_dist save; --no-target-use-distributed-optimizer asks it of another run's): read
    by megatron-core's non-distributed optimizer at TP2 x DP2, the export takes the iteration
    megatron-core took from its own checkpoint of that optimizer."""
    from threefold.checkpoint.megatron.common_file import read_common

    root, after, megatron_loss = megatron_trained["non-distributed"]
    argv = continue_argv(root, 1, 1, 1) + flags
    path, loss, weights = export_and_go_on(
        argv, root, tmp_path, "llama", 2, 4, native, distributed=False, convert_flags=convert_flags
    )
    assert loss == pytest.approx(megatron_loss, rel=1e-6)
    assert largest_difference(weights, after) < 1e-6
    common = read_common(path)
    assert "distrib_optim_sharding_type" not in common["content_metadata"]
    assert not common["args"]["use_distributed_optimizer"]
    assert common["optimizer"]["state"]["common_step"] == 2


@pytest.mark.parametrize(
    "flags,metadata,reason",
    [
        ([], {"optimizer_saved": False}, "holds none"),
        ([], {"weights_only": True}, "holds none"),
        (["--optimizer", "muon", "--use-distributed-optimizer"], {}, "not Adam's"),
        (["--lora-rank", "4"], {}, "the adapters only"),
        (["--decoupled-lr", "1e-3"], {}, "--decoupled-lr"),
        (["--use-mup"], {}, "muP"),
        ([], {}, None),
    ],
)
def test_what_optimizer_state_an_export_cannot_carry_is_said(flags, metadata, reason):
    """An export of such a checkpoint holds the model (and says why, naming the flag)."""
    from tests.parity import LLAMA_STYLE, TRAINING
    from threefold.arguments import parse_args
    from threefold.checkpoint.megatron.optimizer import unexportable

    config = parse_args(LLAMA_STYLE + TRAINING + flags)
    found = unexportable(config, metadata)
    assert found is None if reason is None else reason in found


def _with_args(root: str, tmp_path, **changes) -> str:
    """A copy of the Megatron-LM checkpoint `root` whose common.pt args say otherwise."""
    copy = str(tmp_path / "changed")
    shutil.copytree(root, copy)
    (iteration,) = [d for d in os.listdir(copy) if d.startswith("iter_")]
    common_file = os.path.join(copy, iteration, "common.pt")
    common = torch.load(common_file, weights_only=False)
    for name, value in changes.items():
        setattr(common["args"], name, value)
    torch.save(common, common_file)
    return copy


def test_megatrons_default_optimizer_layout_is_read_only_where_its_buckets_line_up(
    megatron_trained, tmp_path
):
    """The dp_reshardable buckets are laid out from the args: told Transformer Engine's layer
    spec (its input norm sits after linear_proj), the layout's masters are not the weights
    and --load refuses in one line, before any parameter changes; told of a part threefold
    does not lay out (an optimizer per model chunk), it refuses before reading. Either way
    the weights load without it."""
    from tests.parity import _setup

    root, _, _ = megatron_trained["dp_reshardable"]
    for changes, expected in (
        ({"transformer_impl": "transformer_engine"}, "are not its weights"),
        (
            {"overlap_param_gather_with_optimizer_step": True},
            "could not be laid out as megatron-core's (--overlap-param-gather-with-optimizer",
        ),
    ):
        changed = _with_args(root, tmp_path / expected.split()[0], **changes)
        trainer = _setup(continue_argv(changed, 1, 1, 1))
        before = [p.detach().clone() for _, p in trainer.checkpoint_components().parameters()]
        with pytest.raises(ConfigError) as error:
            load_checkpoint(changed, trainer.checkpoint_components())
        message = str(error.value)
        assert expected in message and "--dist-ckpt-optim-fully-reshardable" in message
        assert "--no-load-optim" in message and "\n" not in message
        if "weights" in expected:  # refused on the first parameter, which stays as it was
            after = [p for _, p in trainer.checkpoint_components().parameters()]
            assert any(torch.equal(b, a) for b, a in zip(before, after))
        assert load_checkpoint(changed, trainer.checkpoint_components(), load_optimizer=False) == 2
    # and Adam's state is no Muon momentum
    muon = _setup(continue_argv(root, 1, 1, 1) + ["--optimizer", "muon"])
    with pytest.raises(ConfigError, match="Muon optimizer state is not built; pass --no-load"):
        load_checkpoint(root, muon.checkpoint_components())


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_into_megatron_core(megatron, kind, tmp_path):
    """threefold -> Megatron: megatron-core's GPTModel reads the export (logits within 1e-5 of
    threefold's); Megatron -> threefold -> Megatron is bitwise."""
    root, reference = megatron[kind]
    _, written = exports(root, reference, tmp_path)
    for path, expected, tolerance in written:
        theirs = run_distributed(1, mc.logits, kind, path)
        torch.testing.assert_close(theirs[0], expected, rtol=0, atol=tolerance)


def test_use_checkpoint_args_takes_megatrons_model_and_tokenizer(megatron, tmp_path):
    from threefold.checkpoint.args import checkpoint_flags

    vocab, merges = tmp_path / "gpt2-vocab.json", tmp_path / "gpt2-merges.txt"
    vocab.write_text("{}")
    merges.write_text("")
    root = copy_with_args(
        megatron["llama"][0], str(tmp_path / "run"), vocab_file=str(vocab), merge_file=str(merges)
    )
    assert "--vocab-file" not in checkpoint_flags(megatron["llama"][0], with_tokenizer=True)
    text = " ".join(checkpoint_flags(root, with_tokenizer=True))
    for expected in (
        "--num-layers 4",
        "--hidden-size 64",
        "--num-query-groups 2",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--rotary-base 500000.0",
        "--normalization RMSNorm",
        "--tokenizer-type GPT2BPETokenizer",
        f"--vocab-file {vocab}",
        f"--merge-file {merges}",
    ):
        assert expected in text, (expected, text)


@pytest.mark.parametrize(
    "change,named",
    [
        ({"experimental_attention_variant": "gdn2"}, "--experimental-attention-variant gdn2"),
        ({"hybrid_attention_ratio": 0.25}, "whose layers its hybrid_attention_ratio placed"),
        ({"hybrid_layer_pattern": "M*D-"}, "DeepSeek sparse attention layers"),
        ({"heterogeneous_layers_config_path": "layers.json"}, "heterogeneous layers"),
        # (before: loaded as plain activations, the logits silently wrong)
        ({"apply_residual_connection_post_layernorm": True}, "after the norms"),
    ],
)
def test_architectures_threefold_does_not_build_are_refused_by_name(
    megatron, tmp_path, change, named
):
    root = copy_with_args(megatron["llama"][0], str(tmp_path / "changed"), **change)
    with pytest.raises(ConfigError, match=named):
        load_model(root, with_tokenizer=False)


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_tampered_common_file_runs_nothing(megatron, tmp_path):
    """Megatron-LM unpickles common.pt freely; threefold builds plain data only."""
    marker = str(tmp_path / "ran")
    root = copy_with_args(
        megatron["llama"][0], str(tmp_path / "tampered"), hidden_size=_Payload(marker)
    )
    with pytest.raises(ConfigError):
        load_model(root, with_tokenizer=False)
    common = os.path.join(root, "iter_0000010", "common.pt")
    torch.save({"args": _Payload(marker), "iteration": 1}, common)
    with pytest.raises(ConfigError, match="no Megatron-LM args"):
        load_model(root, with_tokenizer=False)
    assert not os.path.exists(marker)


def test_a_modelopt_checkpoint_is_refused_in_one_line(megatron, tmp_path):
    """Megatron-LM builds a checkpoint with modelopt_state/ by ModelOpt's builder (quantizers,
    --enable-gpt-oss's YaRN that its args do not record): not the model its args describe."""
    root = str(tmp_path / "modelopt")
    shutil.copytree(megatron["llama"][0], root)
    os.makedirs(os.path.join(root, "iter_0000010", "modelopt_state"))
    with pytest.raises(ConfigError, match="a ModelOpt checkpoint"):
        load_model(root, with_tokenizer=False)


def test_convert_refuses_a_format_mismatch_in_one_line(megatron, tmp_path, capsys):
    root, _ = megatron["gpt2"]
    argv = ["--loader", "threefold", "--saver", "hf", "--load-dir", root, "--save-dir", "x"]
    with pytest.raises(SystemExit) as exit_info:
        convert_checkpoint.main(argv)
    assert exit_info.value.code == 2
    assert "it is a megatron one: use --loader megatron" in capsys.readouterr().err
    assert not os.path.exists("x")


def test_a_hugging_face_model_goes_to_megatron_and_back_with_its_logits(tmp_path):
    """--loader hf --saver megatron, read back (as megatron-core reads it, tests above): the
    logits are transformers'."""
    from tests.tools.hf_models import VOCAB, build_hf_model, has_transformers

    if not has_transformers():
        pytest.skip("transformers is not installed")
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "megatron")
    hf_model = build_hf_model("llama", hf_dir)
    argv = ["--loader", "hf", "--saver", "megatron", "--load-dir", hf_dir, "--save-dir", out]
    assert convert_checkpoint.main(argv) == 0
    config, model, _ = load_model(out, with_tokenizer=False)
    assert config.model.vocab_size == VOCAB  # threefold's own record of the unpadded size
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)[..., :VOCAB].transpose(0, 1)
        expected = hf_model(tokens).logits
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_generate_samples_a_megatron_checkpoint_with_local_tokenizer_files(tmp_path):
    """A Megatron checkpoint's args name tokenizer files on the machine that trained it:
    generate.py takes local ones, and samples what the Hugging Face model's import does."""
    import subprocess

    from tests.tools.hf_models import build_hf_model, has_transformers

    if not has_transformers():
        pytest.skip("transformers is not installed")
    hf_dir, megatron_dir, ours = (str(tmp_path / name) for name in ("hf", "megatron", "ours"))
    build_hf_model("llama", hf_dir)
    for saver, out in (("megatron", megatron_dir), ("threefold", ours)):
        argv = ["--loader", "hf", "--saver", saver, "--load-dir", hf_dir, "--save-dir", out]
        assert convert_checkpoint.main(argv) == 0
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "generate.py")
    prompt = ["--prompt", "To be, or not", "--max-new-tokens", "8"]

    def sample(*flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, tool, *prompt, *flags]
        return subprocess.run(command, capture_output=True, text=True, timeout=240)

    without = sample("--load", megatron_dir)
    assert without.returncode == 2 and "no tokenizer" in without.stderr
    local = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir]
    from_megatron = sample("--load", megatron_dir, *local)
    assert from_megatron.returncode == 0, from_megatron.stderr[-2000:]
    from_import = sample("--load", ours)
    assert from_megatron.stdout.strip() == from_import.stdout.strip() != ""


def test_megatrons_step_and_loss_scale_are_read_from_each_optimizer_layout(tmp_path):
    """common.pt as each megatron-core optimizer leaves it (its one-element tensors decoded
    from their bytes, nothing unpickled): the step of the non-distributed fp32 and fp16
    optimizers and of the distributed one, and the fp16 DynamicGradScaler's state."""
    from threefold.checkpoint.megatron.common_file import read_torch_file
    from threefold.checkpoint.megatron.optimizer import megatron_optimizer

    groups = [{"lr": 3e-3, "params": [0, 1]}]
    scaler = {"scale": torch.tensor([4096.0]), "growth_tracker": 7, "hysteresis_tracker": 2}
    layouts = {
        "fp32": {"state": {"common_step": torch.tensor(12.0)}, "param_groups": groups},
        "fp16": {
            "optimizer": {"state": {"common_step": torch.tensor(12.0)}, "param_groups": groups},
            "grad_scaler": scaler,
        },
        "distributed": {
            "optimizer": {"param_groups": [{"lr": 3e-3, "step": 12}]},
            "param_state_sharding_type": "fully_reshardable",
        },
    }
    sizes = {"decoder.layers.mlp.linear_fc1.weight": (2, 8, 4)}
    sizes |= {f"optimizer.state.exp_avg.{key}": size for key, size in sizes.items()}
    for name, state in layouts.items():
        path = str(tmp_path / f"{name}.pt")
        torch.save({"optimizer": state, "iteration": 12}, path)
        optimizer = megatron_optimizer(read_torch_file(path), sizes)
        assert optimizer.readable and optimizer.step == 12.0, name
        expected = {"scale": 4096.0, "growth_tracker": 7, "hysteresis_tracker": 2}
        assert optimizer.loss_scaler == (expected if name == "fp16" else None), name
    # Flattened per-rank moments (not the parameter's shape) are not model space.
    flattened = {**sizes, "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight": (2, 32)}
    optimizer = megatron_optimizer({"optimizer": {}}, flattened)
    assert (optimizer.layout, optimizer.readable) == ("fully_sharded_model_space", False)


def test_megatrons_integrity_manifest_is_verified(megatron, tmp_path):
    from threefold.checkpoint.load import find_checkpoint

    root = str(tmp_path / "run")
    shutil.copytree(megatron["llama"][0], root)
    path = os.path.join(root, "iter_0000010")
    # Without integrity.json: loaded unverified, unless --verify-integrity asks for checksums.
    assert find_checkpoint(root) == 10
    from tests.parity import _setup

    trainer = _setup(megatron_argv(root, 1, 1) + ["--finetune", "--verify-integrity"])
    with pytest.raises(ConfigError, match="holds no checksums .* which --verify-integrity"):
        load_checkpoint(root, trainer.checkpoint_components(), finetune=True)
    with open(os.path.join(path, "integrity.json"), "w") as f:
        json.dump(megatrons_integrity(path), f)
    assert find_checkpoint(root, verify_integrity=True) == 10
    load_model(root, with_tokenizer=False)
    # One flipped byte in a shard, the size unchanged: refused, naming the file.
    shard = next(n for n in sorted(os.listdir(path)) if n.endswith(".distcp"))
    with open(os.path.join(path, shard), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ConfigError, match=f"{shard} does not match its checksum"):
        load_model(root, with_tokenizer=False)
