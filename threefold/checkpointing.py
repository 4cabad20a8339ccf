"""Checkpoints in Megatron-LM's directory layout, written with torch.distributed.checkpoint.

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
the layout-independent parameter name. A checkpoint loads directly into the same layout and
through `threefold/resharding.py` into any other TP/PP/DP layout, with or without the
distributed optimizer, optimizer state included.

Writing (threefold/checkpoint_writer.py): into `iter_N.partial/`, renamed into place after
the manifest, the tracker last; `--async-save` does it in a background thread on a process
group of its own. Loading: the tracker's iteration is verified against its manifest; a damaged
one falls back to the newest complete checkpoint before it, with a one-line warning. Nothing
read from a checkpoint is unpickled freely (threefold/safe_loading.py). See
docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from threefold.checkpoint_args import (
    TRACKER,
    checkpoint_dir,
    checkpoint_tokenizer,
    read_metadata,
    read_tracker,
    write_atomically,
)
from threefold.checkpoint_manifest import (
    MANIFEST,
    complete_iterations,
    digest,
    has_iteration_directories,
    read_manifest,
    verify_slice,
)
from threefold.checkpoint_writer import CheckpointWriter, crash_point
from threefold.config import Config, ConfigError, ModelConfig
from threefold.config import flag as flag_of
from threefold.model.lora import is_adapter
from threefold.parallel import state
from threefold.parallel.random import get_rng_tracker
from threefold.resharding import load_resharded, load_weights
from threefold.safe_loading import SafeFileSystemReader, load_tensors_file


def _key(layout_independent_name: str) -> str:
    return f"tp{state.tensor_model_parallel_rank()}.{layout_independent_name}"


def model_tensors(named_parameters) -> dict[str, torch.Tensor]:
    """Model tensors keyed so DP replicas coincide and TP shards do not. Pipeline stages hold
    different layers, hence different names; the last stage's copy of tied embeddings shares
    the first stage's key and value."""
    return {f"model.{_key(name)}": param.data for name, param in named_parameters}


def _tensor_state(trainer, with_optimizer: bool = True,
                  without_adapters: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds: the model's and, optionally, the optimizer's (without
    LoRA adapters when loading a checkpoint saved before they were added)."""
    named = [(n, p) for n, p in trainer.layout_independent_parameters()
             if not (without_adapters and is_adapter(n))]
    tensors = model_tensors(named)
    if with_optimizer:
        tensors.update(trainer.optimizer.state_tensors({p: _key(n) for n, p in named}))
    return tensors


def _rng_state() -> dict:
    """Every RNG stream, as tensors, numbers and strings only (loadable with weights_only)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss,
                      cached),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": dict(get_rng_tracker().states)}


def _set_rng_state(saved: dict) -> None:
    random.setstate(saved["python"])
    kind, keys, *rest = saved["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys  # (older files: ndarray)
    np.random.set_state((kind, keys.astype(np.uint32), *rest))
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])
    get_rng_tracker().states = dict(saved["tracker"])


def tokenizer_digest(data) -> str | None:
    """SHA-256 over the files that define the run's tokenizer (None without one): a
    checkpoint refuses to resume with another tokenizer of the same vocabulary size."""
    if data.tokenizer_type == "HuggingFaceTokenizer" and data.tokenizer_model:
        files = [os.path.join(data.tokenizer_model, name)
                 for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")]
    elif data.tokenizer_type == "GPT2BPETokenizer":
        files = [data.vocab_file, data.merge_file]
    else:
        files = [data.tokenizer_model] if data.tokenizer_model else []
    files = [f for f in files if f and os.path.isfile(f)]
    if not files:
        return None
    sha = hashlib.sha256()
    for name in files:
        sha.update(bytes.fromhex(digest(name)[1]))
    return sha.hexdigest()


def save_checkpoint(root: str, trainer, writer: CheckpointWriter | None = None) -> str:
    """Write the trainer's full state for its current iteration; returns the directory (with
    an asynchronous `writer`, complete once `writer.wait()` returns)."""
    iteration = trainer.state.iteration
    writer = writer or CheckpointWriter(root)
    rank = writer.rank
    flags = trainer.config.checkpoint

    def write_rank_files(path: str) -> None:
        if not flags.no_save_rng:
            os.makedirs(os.path.join(path, "rng"), exist_ok=True)
            torch.save(_rng_state(), os.path.join(path, "rng", f"rank_{rank:05d}.pt"))
        crash_point("after-rng", iteration)
        if rank == 0:
            config = trainer.config
            metadata = {
                "iteration": iteration,
                "train_state": dataclasses.asdict(trainer.state),
                "scheduler": trainer.scheduler.state_dict(),
                "loss_scaler": trainer.loss_scaler.state_dict(),
                "config": dataclasses.asdict(config),
                "optimizer_saved": not flags.no_save_optim,
                "rng_saved": not flags.no_save_rng,
                "tokenizer_sha256": tokenizer_digest(config.data),
            }
            write_atomically(os.path.join(path, "metadata.json"),
                             json.dumps(metadata, indent=2))
            save_tokenizer(trainer.tokenizer, path)

    tensors = _tensor_state(trainer, with_optimizer=not flags.no_save_optim)
    return writer.save(iteration, write_rank_files, tensors)


def save_tokenizer(tokenizer, path: str) -> None:
    """Copy the run's tokenizer into a checkpoint: a sentencepiece model file, or a Hugging
    Face tokenizer directory."""
    source = getattr(tokenizer, "model_file", None) if tokenizer is not None else None
    if source and os.path.isdir(source):
        shutil.copytree(source, os.path.join(path, "tokenizer"), dirs_exist_ok=True)
    elif source:
        shutil.copyfile(source, os.path.join(path, "tokenizer.model"))


def save_weights_checkpoint(root: str, config: Config, tensors: dict[str, torch.Tensor],
                            tokenizer=None, add_files: Callable[[str], object] | None = None,
                            extra_metadata: dict | None = None) -> str:
    """A weights-only checkpoint at TP = PP = 1, iteration 0, from full tensors keyed by
    parameter name (what tools/convert_checkpoint.py writes). Single process. `add_files`
    writes more files into the directory being written (before the manifest)."""
    def write_files(path: str) -> None:
        save_tokenizer(tokenizer, path)
        if add_files is not None:
            add_files(path)
        metadata = {"iteration": 0, "weights_only": True,
                    "train_state": {"iteration": 0, "consumed_train_samples": 0},
                    "scheduler": {"num_steps": 0}, "loss_scaler": {},
                    "config": dataclasses.asdict(config), **(extra_metadata or {})}
        write_atomically(os.path.join(path, "metadata.json"), json.dumps(metadata, indent=2))

    os.makedirs(root, exist_ok=True)
    return CheckpointWriter(root, single_process=True).save(
        0, write_files, {f"model.tp0.{name}": t.contiguous() for name, t in tensors.items()})


def _same_layout(saved: dict, current, load_optimizer: bool) -> bool:
    """Whether the checkpoint's tensors have exactly this run's keys and shapes."""
    same = all(saved[name] == getattr(current, name) for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers"))
    if load_optimizer and (saved["use_distributed_optimizer"]
                           or current.use_distributed_optimizer):
        saved_dp = saved["world_size"] // (saved["tensor_model_parallel_size"]
                                           * saved["pipeline_model_parallel_size"])
        same = same and (saved["use_distributed_optimizer"] == current.use_distributed_optimizer
                         and saved_dp == current.data_parallel_size
                         and (saved.get("ddp_bucket_size") or 40_000_000) == current.bucket_size)
    return same


# The model fields a checkpoint's tensors depend on, or that change what they compute.
_ARCHITECTURE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "kv_channels", "normalization", "swiglu",
                 "position_embedding_type", "add_bias_linear", "add_qkv_bias", "openai_gelu",
                 "untie_embeddings_and_output_weights", "vocab_size", "qk_layernorm",
                 "apply_layernorm_1p", "use_rope_scaling", "rope_scaling_factor")


def _check_architecture(root: str, saved: dict, current) -> None:
    defaults = ModelConfig()
    names = _ARCHITECTURE
    if current.position_embedding_type == "learned_absolute":  # the position table's rows
        names += ("max_position_embeddings",)
    for name in names:
        if saved.get(name, getattr(defaults, name)) != getattr(current, name):
            flag = {"add_bias_linear": "--disable-bias-linear"}.get(name, flag_of(name))
            raise ConfigError(f"--load {root}: the checkpoint's model has {flag} "
                              f"{saved.get(name)} but this run has {getattr(current, name)}; "
                              "use the checkpoint's model flags")


def _all_ranks_agree(ok: bool) -> bool:
    """Whether `ok` holds on every rank (a load chooses the same checkpoint everywhere)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _damage(root: str, iteration: int) -> str | None:
    """What is wrong with a checkpoint's files (None when they are as written). This rank
    verifies its slice of the files against the manifest; checkpoints from before manifests
    are only checked for their metadata."""
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        return f"{path} does not exist"
    manifest = read_manifest(path)
    if manifest is None:
        if os.path.isfile(os.path.join(path, MANIFEST)):
            return f"{os.path.join(path, MANIFEST)} is unreadable"
        return None if os.path.isfile(os.path.join(path, "metadata.json")) else \
            f"{path} has no metadata.json"
    distributed = dist.is_initialized()
    return verify_slice(path, manifest, dist.get_rank() if distributed else 0,
                        dist.get_world_size() if distributed else 1)


def find_checkpoint(root: str) -> int | None:
    """The iteration to load from `root`: the tracker's, verified; if it is damaged, the
    newest complete one before it, with a one-line warning. None when `root` holds no
    checkpoint at all; a one-line ConfigError when it holds some but none is usable (never
    'start from scratch' over existing iterations)."""
    tracked = read_tracker(root)
    complete = complete_iterations(root)
    candidates = ([tracked] if tracked is not None else []) + [
        i for i in complete if i != tracked and (tracked is None or i < tracked)]
    if tracked is None and not candidates:
        if has_iteration_directories(root):
            raise ConfigError(f"--load {root}: holds iter_* directories but no {TRACKER} and "
                              "none of them is complete; refusing to start from scratch over "
                              f"them: write the iteration to resume into {root}/{TRACKER}, or "
                              "use another directory")
        return None
    if tracked is None:
        _warn(f"> --load {root}: no {TRACKER}; using the newest complete checkpoint, "
              f"iteration {candidates[0]}")
    problems = []
    for iteration in candidates:
        damage = _damage(root, iteration)
        if _all_ranks_agree(damage is None):
            if problems:
                _warn(f"> --load {root}: {problems[0]}; falling back to iteration {iteration}, "
                      "the newest complete checkpoint before it")
            return iteration
        problems.append(f"iteration {iteration} is damaged ({damage or 'on another rank'})")
    raise ConfigError(f"--load {root}: {problems[0]}, and no earlier complete checkpoint "
                      "verifies")


def _warn(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def load_checkpoint(root: str, trainer, load_optimizer: bool = True, load_rng: bool = True,
                    finetune: bool = False) -> int | None:
    """Restore the latest complete checkpoint under `root` into the trainer, from any
    TP/PP/DP layout. Returns its iteration, or None (and changes nothing) when `root` holds no
    checkpoint yet (or, as the run's own --save, does not exist yet). `finetune`: weights only,
    and training starts again from iteration 0."""
    if not os.path.isdir(root):
        if root == trainer.config.checkpoint.save:
            return None
        raise ConfigError(f"--load {root}: no such directory")
    iteration = find_checkpoint(root)
    if iteration is None:
        return None
    metadata = read_metadata(root, iteration)
    path = checkpoint_dir(root, iteration)
    if finetune:
        load_optimizer = load_rng = False
    if metadata.get("weights_only") and load_optimizer:
        raise ConfigError(f"--load {root}: the checkpoint holds weights only (a converted "
                          "model); pass --finetune (or --no-load-optim)")
    if not metadata.get("optimizer_saved", True) and load_optimizer:
        raise ConfigError(f"--load {root}: iteration {iteration} was saved with "
                          "--no-save-optim and holds no optimizer state; pass --no-load-optim "
                          "(or --finetune)")
    _check_architecture(root, metadata["config"]["model"], trainer.config.model)
    _check_tokenizer(root, path, metadata, trainer.config.data)
    # A model fine-tuned with LoRA starts from a checkpoint without adapters: they keep their
    # initialization (B = 0, so the model is the checkpoint's).
    without_adapters = bool(trainer.config.model.lora_rank
                            and not metadata["config"]["model"].get("lora_rank"))
    if without_adapters and load_optimizer:
        raise ConfigError(f"--load {root}: the checkpoint has no LoRA adapters; start the "
                          "fine-tuning with --finetune")
    saved = metadata["config"]["parallel"]
    # Converted (weights-only) checkpoints hold the unpadded vocabulary, and another
    # --make-vocab-size-divisible-by pads it differently: both are resharded.
    same_layout = (_same_layout(saved, trainer.config.parallel, load_optimizer)
                   and not metadata.get("weights_only")
                   and metadata["config"]["model"].get("make_vocab_size_divisible_by", 128)
                   == trainer.config.model.make_vocab_size_divisible_by)
    if same_layout and load_rng and not metadata.get("rng_saved", True):
        raise ConfigError(f"--load {root}: iteration {iteration} was saved with --no-save-rng "
                          "and holds no RNG state; pass --no-load-rng (or --finetune)")
    rng_file = os.path.join(path, "rng", f"rank_{state.global_rank():05d}.pt")
    if same_layout and load_rng and not os.path.isfile(rng_file):
        raise ConfigError(f"--load {root}: {rng_file} is missing, so this rank's random "
                          "streams cannot resume; pass --no-load-rng to continue with fresh "
                          "ones (the losses will differ from an uninterrupted run)")
    rng = load_tensors_file(rng_file) if same_layout and load_rng else None
    if same_layout:
        reader = SafeFileSystemReader(path)
        reader.read_metadata()  # a refusal in one line here, not wrapped by DCP's collectives
        dcp.load(_tensor_state(trainer, load_optimizer, without_adapters),
                 storage_reader=reader)
    else:
        load_resharded(path, trainer, saved["tensor_model_parallel_size"], load_optimizer,
                       without_adapters)
    # fp32 masters are the truth when they were loaded; otherwise start them from the model.
    if load_optimizer:
        trainer.loss_scaler.load_state_dict(metadata["loss_scaler"])
        trainer.optimizer.copy_masters_to_model()
    else:
        trainer.optimizer.copy_model_to_masters()
    if not finetune:  # the run goes on where it stopped: iteration, samples, LR schedule
        for name, value in metadata["train_state"].items():
            setattr(trainer.state, name, value)
        trainer.scheduler.load_state_dict(metadata["scheduler"])
    if rng is not None:  # (per-rank streams belong to the saved layout's ranks)
        _set_rng_state(rng)
    return iteration


def _check_tokenizer(root: str, path: str, metadata: dict, data) -> None:
    saved = metadata.get("tokenizer_sha256")
    current = tokenizer_digest(data)
    if saved and current and saved != current:
        copy = next((os.path.join(path, name) for name in ("tokenizer.model", "tokenizer")
                     if os.path.exists(os.path.join(path, name))), None)
        use = f"--tokenizer-model {copy}" if copy else "the run's tokenizer files"
        mine = data.tokenizer_model or data.vocab_file
        raise ConfigError(f"--load {root}: this run's tokenizer ({mine}) is not the one the "
                          f"checkpoint was trained with; use {use} (or --use-checkpoint-args)")


def load_model(root: str, device: torch.device | None = None, iteration: int | None = None):
    """(config, model, tokenizer) of the latest checkpoint under `root` (or of `iteration`,
    found by `find_checkpoint` already), for generation and scoring: the whole model on every
    pipeline rank, split over this process group's TP ranks (the tools run at TP = number of
    processes), from a checkpoint of any layout."""
    from threefold.data.tokenizer import build_tokenizer
    from threefold.model import GPTModel

    if not os.path.isdir(root):
        raise ConfigError(f"--load {root}: no such directory")
    iteration = find_checkpoint(root) if iteration is None else iteration
    if iteration is None:
        raise ConfigError(f"--load {root}: holds no checkpoint")
    metadata = read_metadata(root, iteration)
    config = Config.from_dict(metadata["config"])
    checkpoint_tokenizer(root, iteration, config.data)
    tokenizer = (build_tokenizer(config.data, config.model.vocab_size)
                 if config.data.tokenizer_type not in (None, "NullTokenizer") else None)
    tp = state.tensor_model_parallel_world_size()
    model = GPTModel(config.model, config.model.padded_vocab_size(tp))
    named = [(model.layout_independent_name(n), p) for n, p in model.named_parameters()]
    load_weights(checkpoint_dir(root, iteration), named,
                 metadata["config"]["parallel"]["tensor_model_parallel_size"])
    model.eval()
    return config, model.to(device or torch.device("cpu")), tokenizer
