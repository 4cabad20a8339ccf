"""--ckpt-format torch_dist: a run saves Megatron-LM's torch_dist checkpoint itself, at any
layout (checkpoint/megatron/training_save.py).

What it writes is, tensor for tensor and bitwise, what tools/convert_checkpoint.py --saver
megatron writes from threefold's own checkpoint of the same state (which
tests/tools/test_megatron_*checkpoints.py prove against megatron-core itself): the model, Adam's
state gathered from the distributed optimizer's pieces, the extra-state objects and common.pt.
A run resumes from it exactly, its ranks' RNG streams included; a run whose state it cannot
hold saves threefold's format, said.
megatron-core's own optimizer going on from it is in tests/tools/test_megatron_checkpoints.py.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, _setup
from tests.tools.hf_models import convert_checkpoint
from threefold.arguments import parse_args
from threefold.checkpoint.files import checkpoint_dir
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.manifest import read_integrity, verify_slice
from threefold.safe_loading import SafeFileSystemReader

MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2"]
MAMBA = ["--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "4"]
GDN = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2"]
GDN += ["--linear-num-key-heads", "2", "--linear-num-value-heads", "4"]
GDN += ["--linear-key-head-dim", "8", "--linear-value-head-dim", "6", "--attention-output-gate"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
DISTRIBUTED = ["--use-distributed-optimizer"]
CASES = {
    # experts split over EP2 beside TP2 (expert-TP 2), a shared expert, a prediction depth,
    # Adam's state over DP2
    "moe-mtp-ep2-tp2-dp2": MOE
    + ["--moe-shared-expert-intermediate-size", "32", "--mtp-num-layers", "1"]
    + TP2_SP
    + ["--expert-model-parallel-size", "2", *DISTRIBUTED],
    # a hybrid's per-layer tensors, Mamba's sections split over TP, experts, stages
    "hybrid-tp2-pp2": ["--hybrid-layer-pattern", "M*E|M-", *MAMBA, *MOE, *TP2_SP, *PP2]
    + DISTRIBUTED,
    # gated delta net layers among attention layers (not stacked), their sections over TP
    "gdn-tp2-pp2": ["--num-layers", "4", *GDN, *TP2_SP, *PP2, *DISTRIBUTED],
    # for Megatron-LM's non-distributed optimizer: exactly its parameter groups, of the whole
    # model (the experts', in an optimizer of their own at EP2, on the last stage only)
    "hybrid-pp2-ep2-non-distributed": ["--hybrid-layer-pattern", "M-|M*E", *MAMBA, *MOE, *PP2]
    + ["--expert-model-parallel-size", "2"],
}
BF16 = LLAMA_STYLE + TRAINING + ["--bf16"]


def _save_both(root: str, argv: list[str]) -> None:
    """Two steps, then the same state saved in both formats."""
    from threefold.checkpoint.megatron.training_save import save_megatron_training_checkpoint
    from threefold.checkpoint.save import save_checkpoint
    from threefold.checkpoint.writer import CheckpointWriter

    trainer = _setup(argv)
    for _ in range(2):
        trainer.train_step()
    components = trainer.checkpoint_components()
    save_checkpoint(os.path.join(root, "threefold"), components)
    native = os.path.join(root, "native")
    save_megatron_training_checkpoint(native, components, CheckpointWriter(native))


def _read(path: str) -> tuple[dict, list]:
    """Every tensor of a torch_dist directory, whole, and the names of its objects."""
    metadata = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    objects = sorted(k for k, v in metadata.items() if isinstance(v, BytesStorageMetadata))
    tensors = {
        key: torch.empty(tuple(value.size), dtype=value.properties.dtype)
        for key, value in metadata.items()
        if key not in objects
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return tensors, objects


def _common(path: str) -> dict:
    """common.pt, less what a run adds for itself (its ranks' RNG streams' layout)."""
    common = torch.load(os.path.join(path, "common.pt"), weights_only=False)  # (the test's own)
    own = {k: v for k, v in common["threefold"].items() if k not in ("rng_saved", "rng_layout")}
    return {**common, "args": vars(common["args"]), "threefold": own}


@pytest.mark.parametrize("case", CASES)
def test_a_run_saves_what_the_converter_writes(case, tmp_path):
    root = str(tmp_path)
    run_distributed(4, _save_both, root, BF16 + CASES[case])
    converted = os.path.join(root, "converted")
    argv = ["--loader", "threefold", "--saver", "megatron", "--load-dir"]
    assert (
        convert_checkpoint.main(
            argv + [os.path.join(root, "threefold")] + ["--save-dir", converted]
        )
        == 0
    )
    expected_path, path = (
        checkpoint_dir(converted, 2),
        checkpoint_dir(os.path.join(root, "native"), 2),
    )
    expected, expected_objects = _read(expected_path)
    written, objects = _read(path)
    assert sorted(written) == sorted(expected) and objects == expected_objects
    assert any(key.startswith("optimizer.state.exp_avg.") for key in written)
    for key, tensor in expected.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key
    assert _common(path) == _common(expected_path)
    if case.endswith("non-distributed"):  # (bf16's fp32 masters; the experts' weights decay)
        chained = _common(path)["optimizer"]
        groups = {k: len(state["optimizer"]["param_groups"]) for k, state in chained.items()}
        assert groups == {0: 2, 1: 1}
        assert any(key.startswith("optimizer.state.fp32_param.") for key in written)
    # threefold's manifest and Megatron-LM's integrity.json, both of the files written
    assert verify_slice(path, read_integrity(path)) is None
    assert os.path.isfile(os.path.join(path, "manifest.json"))


def _resume(root: str, argv: list[str], save: bool, load_rng: bool = True) -> list[float]:
    """Two steps and an --async-save through the run's own checkpointer, then two more; or,
    resumed from that checkpoint (with its RNG streams, or not), the two more."""
    trainer = _setup(argv)
    if save:
        for _ in range(2):
            trainer.train_step()
        trainer.checkpointer.save(2)
        trainer.checkpointer.wait()
    else:
        assert load_checkpoint(root, trainer.checkpoint_components(), load_rng=load_rng) == 2
        assert trainer.state.consumed_train_samples == 2 * 8
    return [trainer.train_step()[0] for _ in range(2)]


FSDP_BF16 = LLAMA_STYLE + TRAINING + ["--bf16", "--distributed-strategy", "fsdp"]


@pytest.mark.parametrize(
    "argv",
    [
        BF16 + TP2_SP + DISTRIBUTED,
        BF16 + TP2_SP,
        FSDP_BF16 + MOE + ["--expert-model-parallel-size", "2"],
    ],
    # (FSDP2 shards the experts over expert DP 2, the rest over DP 4)
    ids=["distributed-optimizer", "non-distributed-optimizer", "fsdp-dp4-ep2"],
)
def test_a_run_resumes_from_it_as_it_went_on(argv, tmp_path):
    """Dropout draws from the ranks' streams: the resume takes them (the saved layout's);
    without them (--no-load-rng) it draws other masks. Under FSDP2 (Megatron-LM's
    --use-torch-fsdp2) the shards are gathered whole into Megatron-LM's layout, the fp32
    parameters as its masters, and read back into the shards, experts' included."""
    root = str(tmp_path / "run")
    argv = argv + ["--save", root, "--ckpt-format", "torch_dist", "--async-save"]
    argv += ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    went_on = run_distributed(4, _resume, root, argv, True)
    with open(os.path.join(checkpoint_dir(root, 2), "metadata.json")) as f:
        assert "sharded_backend" in f.read()  # (Megatron-LM's, not threefold's metadata)
    resumed = run_distributed(4, _resume, root, argv + ["--load", root], False)
    assert resumed == went_on
    if "fsdp" not in argv:  # (the streams are the same under either strategy)
        reseeded = run_distributed(4, _resume, root, argv + ["--load", root], False, False)
        assert reseeded != went_on


def _model_only(root: str, argv: list[str], save: bool) -> dict:
    """Two steps saved with --no-save-optim; or that checkpoint loaded, with and without
    the optimizer state it lacks."""
    from threefold.config import ConfigError

    trainer = _setup(argv)
    if save:
        for _ in range(2):
            trainer.train_step()
        trainer.checkpointer.save(2)
        return {}
    components = trainer.checkpoint_components()
    try:
        load_checkpoint(root, components)
        refusal = None
    except ConfigError as error:
        refusal = str(error)
    return {"refusal": refusal, "iteration": load_checkpoint(root, components, False)}


def test_without_the_optimizer_it_saves_the_model_and_says_so(tmp_path):
    """--no-save-optim: Megatron-LM's args say no_save_optim (its --load then needs
    --no-load-optim or --finetune), no optimizer tensor is written, and threefold's --load
    asks for --no-load-optim as well."""
    root = str(tmp_path / "run")
    argv = BF16 + TP2_SP + ["--save", root, "--ckpt-format", "torch_dist", "--no-save-optim"]
    run_distributed(2, _model_only, root, argv, True)
    path = checkpoint_dir(root, 2)
    written, _ = _read(path)
    assert written and not any(key.startswith("optimizer.") for key in written)
    args = _common(path)["args"]
    assert args["no_save_optim"] and not args["use_distributed_optimizer"]
    for result in run_distributed(2, _model_only, root, argv, False):
        assert "--no-load-optim" in result["refusal"] and "\n" not in result["refusal"]
        assert result["iteration"] == 2


@pytest.mark.parametrize(
    "flags,kept,reason",
    [
        ([], "torch_dist", None),
        (["--optimizer", "muon"], "threefold", "--optimizer muon"),
        (["--optimizer", "muon", "--no-save-optim"], "torch_dist", None),
        (["--lora-rank", "4"], "threefold", "LoRA"),
        (["--fp8-format", "hybrid"], "threefold", "--fp8-recipe delayed"),
        (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], "torch_dist", None),
        (["--distributed-strategy", "fsdp"], "torch_dist", None),
        (["--distributed-strategy", "ddp"], "torch_dist", None),
        (["--logit-scale", "0.5"], "threefold", "Megatron-LM builds no --logit-scale"),
    ],
)
def test_state_megatron_cannot_hold_keeps_threefolds_format_said(
    flags, kept, reason, tmp_path, capsys
):
    argv = LLAMA_STYLE + TRAINING + ["--save", str(tmp_path), "--ckpt-format", "torch_dist"]
    config = parse_args(argv + flags)
    assert config.checkpoint.ckpt_format == kept
    said = [line for line in capsys.readouterr().out.splitlines() if "--ckpt-format" in line]
    if reason is None:
        assert not said
    else:
        (line,) = said
        assert "threefold's format" in line and reason in line


@pytest.mark.parametrize("value", ["torch", "fsdp_dtensor"])
def test_megatrons_other_formats_save_threefolds_said(value, tmp_path, capsys):
    config = parse_args(LLAMA_STYLE + TRAINING + ["--ckpt-format", value])
    assert config.checkpoint.ckpt_format == value
    out = capsys.readouterr().out
    assert f"--ckpt-format {value}: checkpoints are saved in threefold's" in out
    # Megatron-LM's legacy per-rank pickles: read (checkpoint/megatron/legacy.py), never written
    assert value != "torch" or "reads (without running what it names) but never writes" in out
