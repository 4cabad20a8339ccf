"""Write a whole model as a Megatron-LM torch_dist checkpoint (tools/convert_checkpoint.py
--saver megatron): what megatron-core's `dist_checkpointing.load` reads into its GPTModel and
Megatron-LM's `--load` resumes from. With the optimizer's state (checkpoint/megatron/
optimizer.py) Megatron-LM's distributed optimizer goes on with it; without, its args say so
(`no_save_optim`) and Megatron-LM's --load takes it with --no-load-optim or --finetune. Its
args also say it holds no RNG state (`no_save_rng`), which Megatron-LM then leaves as seeded.

The directory carries Megatron-LM's integrity.json (each file's SHA-256), which its
`--verify-integrity` requires. Crash safety as for threefold's own checkpoints: the directory
is written as `iter_N.partial/`, renamed to `iter_N/` when complete, and only then does the
tracker name it; an existing `iter_N/` is never replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from threefold.checkpoint.files import TRACKER, checkpoint_dir
from threefold.checkpoint.manifest import write_integrity
from threefold.checkpoint.megatron.format import (
    BACKEND,
    CHECKPOINT_VERSION,
    linear_attention_freq,
    megatron_args,
    moe_layer_freq,
)
from threefold.checkpoint.megatron.optimizer import ExportedOptimizer
from threefold.checkpoint.megatron.param_order import SECTIONS
from threefold.checkpoint.megatron.tensors import FINAL_NORMS, extra_state, stacked_state_dict
from threefold.config import Config, ConfigError
from threefold.written_aside import fsync_directory, write_atomically

# megatron-core's GPTModel drops its output layer's extra state; its hybrid model keeps it.
HYBRID_OUTPUT_EXTRA_STATE = "output_layer._extra_state/shard_0_1"


class _PreSerializedPlanner(DefaultSavePlanner):
    """Writes the `_extra_state` objects' bytes as they are: megatron-core serializes them
    itself and reads them back with one torch.load, not DCP's default two."""

    def transform_object(self, write_item, object):
        return object


def megatron_tensor(
    config: Config, name: str, tensor: torch.Tensor, dtype: torch.dtype
) -> tuple[str, torch.Tensor]:
    """A whole tensor (threefold name, vocabulary unpadded or padded) as megatron-core holds
    it before stacking: in `dtype`, a hybrid stack's final norm under its name, and the
    embedding and output layer padded to Megatron-LM's vocabulary (zero rows past the end)."""
    model = config.model
    tensor = tensor.detach().to(dtype)
    for ours, theirs in FINAL_NORMS.items() if model.hybrid else ():
        if name.startswith(ours):
            name = theirs + name[len(ours) :]
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        padded = model.padded_vocab_size(1)
        tensor = torch.cat([tensor, tensor.new_zeros(padded - tensor.shape[0], *tensor.shape[1:])])
    return name, tensor.contiguous()


def layer_stacking(config: Config) -> tuple[bool, dict[str, list[int]]]:
    """Whether megatron-core stacks the model's layers (a hybrid's, and layers that differ,
    are kept apart), and the row sizes of the tensors it stores a section at a time: a gated
    delta net's in_proj [q; k; v; z; beta; alpha] and conv1d [q; k; v]; a Mamba mixer's
    in_proj [z; x; B; C; dt] and conv1d [x; B; C]."""
    model = config.model
    stacked = (
        not model.hybrid
        and moe_layer_freq(model) == 1
        and linear_attention_freq(model) in (None, 1)
    )
    rows = list(model.gated_delta_net_sections())
    mamba = list(model.mamba_sections()) if model.hybrid else []
    return stacked, dict(zip(SECTIONS, (rows, rows[:3], mamba, mamba[1:4], mamba[1:4])))


def _megatron_state(config: Config, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """Whole tensors by threefold name as megatron-core's state dict keys them."""
    model = config.model
    state = dict(megatron_tensor(config, name, t, dtype) for name, t in tensors.items())
    stacked, sections = layer_stacking(config)
    state = stacked_state_dict(
        state, model.num_layers, model.multi_latent_attention, stacked, sections
    )
    if model.hybrid:
        state[HYBRID_OUTPUT_EXTRA_STATE] = extra_state()
    return state


def megatron_common(
    config: Config,
    iteration: int,
    train_state: dict | None,
    dtype: torch.dtype,
    optimizer: dict | None,
    threefold: dict | None = None,
) -> dict:
    """common.pt of Megatron-LM's checkpoint of iteration `iteration`: its args (saying that
    it holds no RNG state of Megatron-LM's, and whether it holds the optimizer's),
    `optimizer`'s entries (`exported_common`'s; None without) and what threefold reads back
    beside its vocabulary size (`threefold`)."""
    args = megatron_args(config, iteration, train_state)
    args["params_dtype"] = dtype
    args["padded_vocab_size"] = config.model.padded_vocab_size(1)
    args.update(no_save_rng=True, no_save_optim=optimizer is None)
    # (the optimizer the state is for: the distributed one's layout is named in the metadata)
    metadata = (optimizer or {}).get("content_metadata", {})
    args["use_distributed_optimizer"] = "distrib_optim_sharding_type" in metadata
    return {
        "args": argparse.Namespace(**args),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
        # Megatron-LM keeps only the padded vocabulary size; threefold reads its own back.
        "threefold": {"vocab_size": config.model.vocab_size, **(threefold or {})},
        **(optimizer or {}),
    }


def check_export_directory(root: str, iteration: int | None = None) -> None:
    """A ConfigError where an export into `root` would write over something: a run's tracker
    (pointed at the export, it would lose the run its latest), or the iteration's directory."""
    paths = [os.path.join(root, TRACKER)]
    if iteration is not None:
        paths.append(checkpoint_dir(root, iteration))
    for existing in paths:
        if os.path.exists(existing):
            raise ConfigError(
                f"--save-dir {root}: {existing} exists already; an export writes over nothing: "
                "choose another directory"
            )


def save_megatron_checkpoint(
    root: str,
    config: Config,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    iteration: int = 0,
    train_state: dict | None = None,
    optimizer: ExportedOptimizer | None = None,
) -> str:
    """Write `tensors` (whole, by threefold parameter name, the vocabulary unpadded or padded)
    under `root` as Megatron-LM's iteration `iteration`, with the samples `train_state` says
    were read (none without it) and the `optimizer` state (none without it); returns the
    iter_N directory."""
    path = checkpoint_dir(root, iteration)
    check_export_directory(root, iteration)
    state = _megatron_state(config, tensors, dtype)
    for field, values in (optimizer.tensors if optimizer else {}).items():
        for key, value in _megatron_state(config, values, torch.float32).items():
            if "._extra_state" not in key:  # (the modules' objects: the model's only)
                state[f"optimizer.state.{optimizer.fields[field]}.{key}"] = value
    common = megatron_common(
        config, iteration, train_state, dtype, optimizer.common if optimizer else None
    )
    partial = f"{path}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(partial),
            planner=_PreSerializedPlanner(),
            no_dist=True,
        )
    torch.save(common, os.path.join(partial, "common.pt"))
    with open(os.path.join(partial, "metadata.json"), "w") as f:
        json.dump(BACKEND, f)
    # What Megatron-LM's --verify-integrity checks on load (and writes when it saves).
    write_integrity(partial)
    fsync_directory(partial)
    os.replace(partial, path)
    fsync_directory(root)
    write_atomically(os.path.join(root, TRACKER), str(iteration))
    return path
