"""Checkpoints in Megatron-LM's directory layout, written with torch.distributed.checkpoint.

    DIR/latest_checkpointed_iteration.txt      the last *complete* checkpoint's iteration
    DIR/iter_0000100/                          torch.distributed.checkpoint shards (.distcp)
    DIR/iter_0000100/metadata.json             iteration, consumed samples, scheduler, loss
                                               scaler, the run's config
    DIR/iter_0000100/rng/rank_00000.pt         every rank's RNG states
    DIR/iter_0000100/tokenizer.model           the tokenizer the run used, if any

Each rank writes only what it holds; data-parallel replicas share tensor keys so
torch.distributed.checkpoint stores them once. Tensor keys carry the tensor-parallel rank and
the layout-independent parameter name, so a checkpoint loads into any data-parallel size; a
different TP/PP layout is refused with a clear message (resharding is future work).

Crash safety: the tracker file is replaced atomically (write, fsync, rename) only after every
rank has finished writing, so `--load` never points at a partial checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from threefold.config import ConfigError
from threefold.parallel import state
from threefold.parallel.random import get_rng_tracker

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise ConfigError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number")
    return int(text)


def _write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _key(layout_independent_name: str) -> str:
    return f"tp{state.tensor_model_parallel_rank()}.{layout_independent_name}"


def model_tensors(named_parameters) -> dict[str, torch.Tensor]:
    """Model tensors keyed so DP replicas coincide and TP shards do not. Pipeline stages hold
    different layers, hence different names; the last stage's copy of tied embeddings shares
    the first stage's key and value."""
    return {f"model.{_key(name)}": param.data for name, param in named_parameters}


def _tensor_state(trainer, with_optimizer: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds: the model's and, optionally, the optimizer's."""
    named = trainer.layout_independent_parameters()
    tensors = model_tensors(named)
    if with_optimizer:
        tensors.update(trainer.optimizer.state_tensors({p: _key(n) for n, p in named}))
    return tensors


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": dict(get_rng_tracker().states)}


def _set_rng_state(saved: dict) -> None:
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])
    get_rng_tracker().states = dict(saved["tracker"])


def save_checkpoint(root: str, trainer) -> str:
    """Write the trainer's full state for its current iteration; returns the directory."""
    iteration = trainer.state.iteration
    path = checkpoint_dir(root, iteration)
    rank = state.global_rank()
    if rank == 0:
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    _barrier()
    dcp.save(_tensor_state(trainer), checkpoint_id=path)
    torch.save(_rng_state(), os.path.join(path, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        config = trainer.config
        metadata = {
            "iteration": iteration,
            "train_state": dataclasses.asdict(trainer.state),
            "scheduler": trainer.scheduler.state_dict(),
            "loss_scaler": trainer.loss_scaler.state_dict(),
            "config": dataclasses.asdict(config),
        }
        _write_atomically(os.path.join(path, "metadata.json"), json.dumps(metadata, indent=2))
        tokenizer = trainer.tokenizer
        if tokenizer is not None and getattr(tokenizer, "model_file", None):
            shutil.copyfile(tokenizer.model_file, os.path.join(path, "tokenizer.model"))
    _barrier()  # every rank's shards are on disk before the tracker names them
    if rank == 0:
        _write_atomically(os.path.join(root, TRACKER), f"{iteration}\n")
    _barrier()
    return path


def read_metadata(root: str, iteration: int) -> dict:
    path = os.path.join(checkpoint_dir(root, iteration), "metadata.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--load {root}: {path} is missing; the checkpoint is incomplete")
    with open(path) as f:
        return json.load(f)


def load_checkpoint(root: str, trainer, load_optimizer: bool = True,
                    load_rng: bool = True) -> int | None:
    """Restore the latest complete checkpoint under `root` into the trainer. Returns its
    iteration, or None (and changes nothing) when `root` holds no checkpoint yet."""
    if not os.path.isdir(root):
        raise ConfigError(f"--load {root}: no such directory")
    iteration = read_tracker(root)
    if iteration is None:
        return None
    metadata = read_metadata(root, iteration)
    saved, current = metadata["config"]["parallel"], trainer.config.parallel
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if saved[name] != getattr(current, name):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"--load {root}: the checkpoint was saved with {flag} "
                              f"{saved[name]} but this run uses {getattr(current, name)}; "
                              "load it with the same layout")
    if load_optimizer and (saved["use_distributed_optimizer"] or
                           current.use_distributed_optimizer):
        saved_dp = saved["world_size"] // (saved["tensor_model_parallel_size"]
                                           * saved["pipeline_model_parallel_size"])
        if (saved["use_distributed_optimizer"] != current.use_distributed_optimizer
                or saved_dp != current.data_parallel_size):
            raise ConfigError(
                f"--load {root}: the optimizer state was saved with "
                f"{'' if saved['use_distributed_optimizer'] else 'no '}--use-distributed-optimizer "
                f"at data-parallel size {saved_dp}; load it the same way (resharding "
                "distributed-optimizer state is not supported yet)")
    tensors = _tensor_state(trainer, with_optimizer=load_optimizer)
    dcp.load(tensors, checkpoint_id=checkpoint_dir(root, iteration))
    # fp32 masters are the truth when they were loaded; otherwise start them from the model.
    if load_optimizer:
        trainer.scheduler.load_state_dict(metadata["scheduler"])
        trainer.loss_scaler.load_state_dict(metadata["loss_scaler"])
        trainer.optimizer.copy_masters_to_model()
    else:
        trainer.optimizer.copy_model_to_masters()
    for name, value in metadata["train_state"].items():
        setattr(trainer.state, name, value)
    if load_rng:
        rng_file = os.path.join(checkpoint_dir(root, iteration), "rng",
                                f"rank_{state.global_rank():05d}.pt")
        if os.path.isfile(rng_file):
            _set_rng_state(torch.load(rng_file, weights_only=False))
    return iteration


def load_model_weights(root: str, model, iteration: int | None = None) -> int:
    """Only the model's weights (for generation and scoring); returns the iteration loaded."""
    iteration = read_tracker(root) if iteration is None else iteration
    if iteration is None:
        raise ConfigError(f"--load {root}: no {TRACKER}; it holds no complete checkpoint")
    named = [(model.layout_independent_name(n), p) for n, p in model.named_parameters()]
    dcp.load(model_tensors(named), checkpoint_id=checkpoint_dir(root, iteration))
    return iteration
