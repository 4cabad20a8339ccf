"""Megatron-LM's legacy `--ckpt-format torch` checkpoints, read without running code.

    DIR/latest_checkpointed_iteration.txt
    DIR/iter_0000100/mp_rank_{t:02d}[_{p:03d}][_{e:03d}]/model_optim_rng.pt
    DIR/iter_0000100/mp_rank_*/distrib_optim.pt      (the distributed optimizer's buffers)

Megatron-LM's data-parallel rank 0 of each model-parallel rank writes one torch.save file: its
tensor-parallel rank t, its pipeline rank p where PP > 1 and its expert-parallel rank e where
EP > 1 name the directory (so `mp_rank_00_001` is a stage or an EP rank as the args say). The
file holds `args`, `iteration`, `checkpoint_version`, `opt_param_scheduler`, `optimizer`,
`rng_state`, and the model: `model`, or `model0`, `model1`, ... one per virtual pipeline
stage, each megatron-core's module state dict of that model chunk — the names of a torch_dist
checkpoint's per-layer tensors (checkpoint/megatron/tensors.py), but its layers numbered from
0 within the chunk, its experts from 0 within the EP rank (`local_experts.{e}`, or Transformer
Engine's grouped `linear_fc1.weight{e}`), and each tensor the rank's TP shard.

The files are pickles; Megatron-LM opens them with `torch.load(weights_only=False)`, which runs
whatever they name. Here they go through common_file's restricted unpickler: plain data, and
each tensor a record of where its bytes lie, built from those bytes only when a parameter asks
for it. A rank renumbers the layers and experts by the saved layout (`chunk_layers_of` of the
args' TP/PP/virtual stages/EP) and joins a tensor's TP shards as megatron-core split them
(`tp_split_dim`), so a checkpoint loads at any layout as a torch_dist one does.

Read: GPT models (dense, mixture-of-experts with EP, multi-token prediction; local or
Transformer Engine spec; stages split evenly, unevenly or by --pipeline-model-parallel-layout,
a stage of prediction depths included) and hybrids of Mamba, attention, MLP and expert layers
(a Mamba mixer's TP shard holds its share of each section of in_proj and conv1d, joined
section by section), their iteration, samples and LR schedule, and Adam's state, the
distributed optimizer's or not (checkpoint/megatron/legacy_optimizer.py). Not read, each
refused in one line: gated delta nets, experts split over another TP size than the rest,
and a checkpoint_version before 3.0. The older models of `megatron/legacy` (`language_model.*`)
are read as their megatron-core twins (checkpoint/megatron/legacy_models.py), their weights
only.
"""

from __future__ import annotations

import itertools
import os
import re

from threefold.checkpoint.megatron.common_file import read_torch_file
from threefold.checkpoint.megatron.format import arg_size, described, saved_args
from threefold.checkpoint.megatron.optimizer import (
    LEGACY,
    LEGACY_DISTRIBUTED,
    MegatronOptimizer,
    find_loss_scaler,
    find_step,
)
from threefold.config import ConfigError
from threefold.config.linear_attention import GATED_DELTA_NET

FILE = "model_optim_rng.pt"
_RANK_DIRECTORY = re.compile(r"^mp_rank_\d{2}(_\d{3}){0,2}$")
MODEL = re.compile(r"^model(\d*)$")  # a model chunk's state dict
OLDER_MODELS = (
    "its model is one of Megatron-LM's older ones (megatron/legacy), whose parameters that "
    "state is not mapped to here"
)


def is_legacy_checkpoint(path: str) -> bool:
    """Whether `path` (an iter_N directory) is in Megatron-LM's legacy torch format."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "metadata.json")):
        return False
    return any(_RANK_DIRECTORY.match(name) for name in os.listdir(path))


def saved_sizes(args: dict) -> tuple[int, int, int]:
    """The saving run's TP, PP and EP sizes."""
    names = ("tensor", "pipeline", "expert")
    return tuple(arg_size(args, f"{name}_model_parallel_size") for name in names)


def _directory(tp_rank: int, pp_rank: int, ep_rank: int, sizes: tuple[int, int, int]) -> str:
    """Megatron-LM's `get_checkpoint_name` directory of a model-parallel rank."""
    name = f"mp_rank_{tp_rank:02d}"
    if sizes[1] > 1:
        name += f"_{pp_rank:03d}"
    if sizes[2] > 1:
        name += f"_{ep_rank:03d}"
    return name


def _first_file(path: str) -> str:
    """Rank 0's file (the only one whose directory sorts first: mp_rank_00[_000[_000]])."""
    names = sorted(n for n in os.listdir(path) if _RANK_DIRECTORY.match(n))
    first = os.path.join(path, names[0], FILE) if names else None
    if first is None or not os.path.isfile(first):
        raise ConfigError(f"--load {path}: {FILE} of the first model-parallel rank is missing")
    return first


def legacy_common(path: str) -> dict:
    """Rank 0's file without the model: args, iteration, scheduler, the optimizer's own state
    (its one-element tensors as numbers: the fp16 loss scale)."""
    state = read_torch_file(_first_file(path))
    if not isinstance(state, dict):
        raise ConfigError(f"--load {path}: {FILE} holds a list, not Megatron-LM's state dict")
    return {key: value for key, value in state.items() if not MODEL.match(key)}


def legacy_args(common: dict, path: str) -> dict:
    """The saving run's args in rank 0's file (`legacy_common`), else a one-line refusal."""
    root = os.path.dirname(path)
    return saved_args(common, f"--load {root}: {os.path.relpath(_first_file(path), root)}")


def legacy_files(path: str, args: dict) -> dict[tuple[int, int, int], str]:
    """{(TP, PP, EP rank): its file}, every one the args' layout has."""
    sizes = saved_sizes(args)
    files = {}
    for ranks in itertools.product(*map(range, sizes)):
        files[ranks] = os.path.join(path, _directory(*ranks, sizes), FILE)
    return files


def legacy_damage(path: str) -> str | None:
    """What a legacy checkpoint lacks of the files its args' layout has, else None (a file
    without args is no damage: `legacy_metadata` refuses it as what it is)."""
    try:
        args = legacy_common(path).get("args")
    except ConfigError as error:
        return str(error)
    if not isinstance(args, dict):
        return None
    missing = [f for f in legacy_files(path, args).values() if not os.path.isfile(f)]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"{os.path.relpath(missing[0], path)}{more} missing"
    return None


def refuse_unread_kinds(args: dict, path: str) -> None:
    """A one-line refusal of a legacy checkpoint threefold does not read."""
    what = None
    if args.get("experimental_attention_variant") in GATED_DELTA_NET or "G" in (
        args.get("hybrid_layer_pattern") or args.get("hybrid_override_pattern") or ""
    ):
        what = "gated delta nets (their parameters' order and TP split are not laid out here)"
    elif args.get("num_experts") and args.get("expert_tensor_parallel_size") not in (
        None,
        args.get("tensor_model_parallel_size") or 1,
    ):
        what = "experts split over another TP size than the rest (--expert-tensor-parallel-size)"
    if what:
        raise ConfigError(
            f"--load {path}: a Megatron-LM checkpoint in its legacy torch format of {what}, "
            "which threefold does not read; have Megatron-LM save it as torch_dist "
            "(--ckpt-convert-format torch_dist --ckpt-convert-save NEW) and load NEW/torch_dist"
        )


def legacy_metadata(path: str) -> dict:
    """A legacy checkpoint described as threefold's metadata.json describes its own: the
    distributed optimizer's state readable where its buffers are laid out (checkpoint/
    megatron/legacy_optimizer.py), the non-distributed optimizer's not."""
    common = legacy_common(path)
    args = legacy_args(common, path)
    refuse_unread_kinds(args, path)
    version = common.get("checkpoint_version")
    if not isinstance(version, (int, float)) or version < 3.0:
        # (Megatron-LM reorders an older checkpoint's query/key/value rows as it loads it)
        raise ConfigError(
            f"--load {path}: a Megatron-LM checkpoint of checkpoint_version {version}, whose "
            "attention's query, key and value rows are ordered otherwise than version 3.0's; "
            "load it in Megatron-LM once and save it again"
        )
    state = common.get("optimizer")
    if state is None:
        return described(path, common, MegatronOptimizer("none", False))
    # (torch, only here: the state's layout is rebuilt from the model's tensors)
    from threefold.checkpoint.megatron.legacy_tensors import LegacyTensors

    layout = LEGACY_DISTRIBUTED if args.get("use_distributed_optimizer") else LEGACY
    step = find_step(state)
    tensors = LegacyTensors(path, optimizer=True)
    # (the older models' parameters are not laid out in that state: their weights are read)
    reason = OLDER_MODELS if tensors.older_model else tensors.state.reason
    reason = reason or (None if step is not None else "it holds no Adam step")
    scaler = find_loss_scaler(state)
    return described(path, common, MegatronOptimizer(layout, reason is None, step, scaler, reason))
