"""Writing a checkpoint in Megatron-LM's directory layout with torch.distributed.checkpoint.

    DIR/latest_checkpointed_iteration.txt      the last *complete* checkpoint's iteration
    DIR/iter_0000100/                          torch.distributed.checkpoint shards (.distcp)
    DIR/iter_0000100/metadata.json             iteration, consumed samples, scheduler, loss
                                               scaler, the run's config, the tokenizer's hash
    DIR/iter_0000100/rng/rank_00000.pt         every rank's RNG states (tensors and numbers)
    DIR/iter_0000100/tokenizer.model           the tokenizer the run used, if any
    DIR/iter_0000100/manifest.json             size and SHA-256 of every file above
    DIR/.threefold.lock                        held by the run saving here

Each rank writes only what it holds; data-parallel replicas share tensor keys so
torch.distributed.checkpoint stores them once. Tensor keys carry the tensor-parallel rank and
the layout-independent parameter name, so a checkpoint loads into any layout (checkpoint/
load.py, checkpoint/resharding.py). Writing itself (checkpoint/writer.py): into
`iter_N.partial/`, renamed into place after the manifest, the tracker last; `--async-save` does
it in a background thread on a process group of its own. See docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from collections.abc import Callable

import numpy as np
import torch

from threefold.checkpoint.components import CheckpointComponents
from threefold.checkpoint.files import tokenizer_digest
from threefold.checkpoint.writer import CheckpointWriter, crash_point
from threefold.config import Config
from threefold.model.lora import is_adapter
from threefold.parallel.tensor_parallel.random import get_rng_tracker
from threefold.parallel.tensor_parallel.sharding import sharding_group
from threefold.written_aside import write_atomically


def tensor_state(
    components: CheckpointComponents,
    with_optimizer: bool = True,
    without_adapters: bool = False,
    with_fp8: bool = False,
) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds: the model's and, optionally, the optimizer's (without
    LoRA adapters when loading a checkpoint saved before they were added) and the FP8 scaling
    state (loaded on its own: checkpoint/load.py's `load_fp8_state`).

    Keys carry the TP rank and the layout-independent name, so DP replicas coincide and TP
    shards do not. Pipeline stages hold different layers, hence different names; the last
    stage's copy of tied embeddings shares the first stage's key and value. An expert's
    weights are on one rank of its EP group: their key carries the expert-TP rank."""
    parallel = components.parallel
    named = [(n, p) for n, p in components.parameters() if not (without_adapters and is_adapter(n))]
    keys = {p: f"tp{sharding_group(p, parallel).rank}.{n}" for n, p in named}
    tensors = {f"model.{keys[param]}": param.data for _, param in named}
    if with_optimizer:
        tensors.update(components.optimizer.state_tensors(keys))
    if with_fp8 and components.fp8 is not None:
        tensors.update(components.fp8.state_tensors())
    return tensors


def rng_state() -> dict:
    """Every RNG stream, as tensors, numbers and strings only (loadable with weights_only)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": dict(get_rng_tracker().states),
        "tracker_seeds": dict(get_rng_tracker().seeds),
    }


def set_rng_state(saved: dict) -> None:
    random.setstate(saved["python"])
    kind, keys, *rest = saved["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys  # (older files: ndarray)
    np.random.set_state((kind, keys.astype(np.uint32), *rest))
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])
    get_rng_tracker().resume(saved["tracker"], saved.get("tracker_seeds", {}))


def save_checkpoint(
    root: str, components: CheckpointComponents, writer: CheckpointWriter | None = None
) -> str:
    """Write the components' full state for the current iteration; returns the directory (with
    an asynchronous `writer`, complete once `writer.wait()` returns)."""
    train_state = components.train_state.state_dict()
    iteration = train_state["iteration"]
    writer = writer or CheckpointWriter(root)
    rank = writer.rank
    flags = components.config.checkpoint

    def write_rank_files(path: str) -> None:
        if not flags.no_save_rng:
            os.makedirs(os.path.join(path, "rng"), exist_ok=True)
            torch.save(rng_state(), os.path.join(path, "rng", f"rank_{rank:05d}.pt"))
        crash_point("after-rng", iteration)
        if rank == 0:
            config = components.config
            metadata = {
                "iteration": iteration,
                "train_state": train_state,
                "scheduler": components.scheduler.state_dict(),
                "loss_scaler": components.loss_scaler.state_dict(),
                "config": dataclasses.asdict(config),
                "optimizer_saved": not flags.no_save_optim,
                "rng_saved": not flags.no_save_rng,
                "tokenizer_sha256": tokenizer_digest(config.data),
            }
            write_atomically(os.path.join(path, "metadata.json"), json.dumps(metadata, indent=2))
            save_tokenizer(components.tokenizer, path)

    # (the writer has its copies of the tensors when `save` returns)
    with components.parameters_in_model_dtype():
        tensors = tensor_state(components, with_optimizer=not flags.no_save_optim, with_fp8=True)
        return writer.save(iteration, write_rank_files, tensors)


def save_tokenizer(tokenizer, path: str) -> None:
    """Copy the run's tokenizer into a checkpoint: a sentencepiece model file, or a Hugging
    Face tokenizer directory."""
    source = getattr(tokenizer, "model_file", None) if tokenizer is not None else None
    if source and os.path.isdir(source):
        shutil.copytree(source, os.path.join(path, "tokenizer"), dirs_exist_ok=True)
    elif source:
        shutil.copyfile(source, os.path.join(path, "tokenizer.model"))


def save_weights_checkpoint(
    root: str,
    config: Config,
    tensors: dict[str, torch.Tensor],
    tokenizer=None,
    add_files: Callable[[str], object] | None = None,
    extra_metadata: dict | None = None,
) -> str:
    """A weights-only checkpoint at TP = PP = 1, iteration 0, from full tensors keyed by
    parameter name (what tools/convert_checkpoint.py writes). Single process. `add_files`
    writes more files into the directory being written (before the manifest)."""

    def write_files(path: str) -> None:
        save_tokenizer(tokenizer, path)
        if add_files is not None:
            add_files(path)
        metadata = {
            "iteration": 0,
            "weights_only": True,
            "train_state": {"iteration": 0, "consumed_train_samples": 0},
            "scheduler": {"num_steps": 0},
            "loss_scaler": {},
            "config": dataclasses.asdict(config),
            **(extra_metadata or {}),
        }
        write_atomically(os.path.join(path, "metadata.json"), json.dumps(metadata, indent=2))

    os.makedirs(root, exist_ok=True)
    return CheckpointWriter(root, single_process=True).save(
        0, write_files, {f"model.tp0.{name}": t.contiguous() for name, t in tensors.items()}
    )
