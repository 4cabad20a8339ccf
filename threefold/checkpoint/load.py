"""Loading a checkpoint: the tracker's iteration, verified, into any layout.

The tracker's iteration is verified against its manifest (or a Megatron-LM checkpoint against
its integrity.json); a damaged one falls back to the newest complete checkpoint before it,
with a one-line warning. `--verify-integrity` (Megatron-LM's flag) also counts a checkpoint
without either list as unusable instead of loading it unverified. A checkpoint of the same layout
loads directly (torch.distributed.checkpoint); any other TP/PP/DP layout, with or without the
distributed optimizer, goes through checkpoint/resharding.py, optimizer state included. Nothing
read from a checkpoint is unpickled freely (threefold/safe_loading.py). The architecture and
the tokenizer are checked against the run's before any tensor is read.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from threefold.checkpoint.components import CheckpointComponents
from threefold.checkpoint.files import (
    TRACKER,
    checkpoint_dir,
    checkpoint_tokenizer,
    read_metadata,
    read_tracker,
)
from threefold.checkpoint.manifest import (
    INTEGRITY,
    MANIFEST,
    complete_iterations,
    has_iteration_directories,
    read_integrity,
    read_manifest,
    verify_slice,
)
from threefold.checkpoint.megatron.optimizer import refusal as megatron_refusal
from threefold.checkpoint.resharding import load_resharded, load_weights
from threefold.checkpoint.save import set_rng_state, tensor_state, tokenizer_digest
from threefold.config import Config, ConfigError, ModelConfig
from threefold.config.fields import ARCHITECTURE, checkpoint_fields, flag_of
from threefold.config.parallel import check_tensor_parallel_split
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.pipeline_parallel.layout import model_chunk_layers
from threefold.safe_loading import SafeFileSystemReader, load_tensors_file


def _same_layout(saved: dict, current, load_optimizer: bool) -> bool:
    """Whether the checkpoint's tensors have exactly this run's keys and shapes."""
    same = all(
        saved[name] == getattr(current, name)
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
        )
    ) and all(
        saved.get(name, False) == getattr(current, name)
        for name in (
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
        )
    )
    # (older checkpoints have no layout string)
    same = same and saved.get("pipeline_model_parallel_layout") == (
        current.pipeline_model_parallel_layout
    )
    # an expert's shapes (and keys) follow expert TP
    same = same and (saved.get("expert_tensor_parallel_size") or 1) == (
        current.expert_tensor_parallel_size or 1
    )
    if load_optimizer and (saved["use_distributed_optimizer"] or current.use_distributed_optimizer):
        saved_dp = saved["world_size"] // (
            saved["tensor_model_parallel_size"] * saved["pipeline_model_parallel_size"]
        )
        same = same and (
            saved["use_distributed_optimizer"] == current.use_distributed_optimizer
            and saved_dp == current.data_parallel_size
            # expert weights are sharded over expert-DP, which EP changes
            and saved.get("expert_model_parallel_size", 1) == current.expert_model_parallel_size
            and (saved.get("ddp_bucket_size") or 40_000_000) == current.bucket_size
            # each instance shards over its own ranks
            and saved.get("num_distributed_optimizer_instances", 1)
            == current.num_distributed_optimizer_instances
        )
    return same


def _check_architecture(root: str, saved: dict, current: ModelConfig) -> None:
    """The run's model must be the checkpoint's in every field declared ARCHITECTURE
    (config/fields.py), and in the position table's rows with learned positions."""
    defaults = ModelConfig()
    fields = checkpoint_fields(ModelConfig, ARCHITECTURE)
    if current.position_embedding_type == "learned_absolute":
        fields += [
            f for f in dataclasses.fields(ModelConfig) if f.name == "max_position_embeddings"
        ]
    for field in fields:
        name = field.name
        if saved.get(name, getattr(defaults, name)) != getattr(current, name):
            raise ConfigError(
                f"--load {root}: the checkpoint's model has {flag_of(field)} "
                f"{saved.get(name)} but this run has {getattr(current, name)}; "
                "use the checkpoint's model flags"
            )


def _all_ranks_agree(ok: bool) -> bool:
    """Whether `ok` holds on every rank (a load chooses the same checkpoint everywhere)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _damage(root: str, iteration: int, verify_integrity: bool = False) -> str | None:
    """What is wrong with a checkpoint's files (None when they are as written). This rank
    verifies its slice of the files against the manifest (a Megatron-LM checkpoint's: its
    integrity.json); checkpoints with neither are only checked for their metadata, or refused
    under `verify_integrity`."""
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        return f"{path} does not exist"
    manifest = None
    for name, read in ((MANIFEST, read_manifest), (INTEGRITY, read_integrity)):
        if os.path.isfile(os.path.join(path, name)):
            manifest = read(path)
            if manifest is None:
                return f"{os.path.join(path, name)} is unreadable"
            break
    if manifest is None:
        if verify_integrity:
            return (
                f"{path} holds no checksums ({MANIFEST} or Megatron-LM's {INTEGRITY}) to "
                "verify, which --verify-integrity requires; drop the flag to load it unverified"
            )
        return (
            None
            if os.path.isfile(os.path.join(path, "metadata.json"))
            else f"{path} has no metadata.json"
        )
    distributed = dist.is_initialized()
    return verify_slice(
        path,
        manifest,
        dist.get_rank() if distributed else 0,
        dist.get_world_size() if distributed else 1,
    )


def find_checkpoint(root: str, verify_integrity: bool = False) -> int | None:
    """The iteration to load from `root`: the tracker's, verified (`verify_integrity`: one
    without checksums counts as damaged); if it is damaged, the newest complete one before
    it, with a one-line warning. None when `root` holds no
    checkpoint at all; a one-line ConfigError when it holds some but none is usable (never
    'start from scratch' over existing iterations)."""
    tracked = read_tracker(root)
    complete = complete_iterations(root)
    candidates = ([tracked] if tracked is not None else []) + [
        i for i in complete if i != tracked and (tracked is None or i < tracked)
    ]
    if tracked is None and not candidates:
        if has_iteration_directories(root):
            raise ConfigError(
                f"--load {root}: holds iter_* directories but no {TRACKER} and "
                "none of them is complete; refusing to start from scratch over "
                f"them: write the iteration to resume into {root}/{TRACKER}, or "
                "use another directory"
            )
        return None
    if tracked is None:
        _warn(
            f"> --load {root}: no {TRACKER}; using the newest complete checkpoint, "
            f"iteration {candidates[0]}"
        )
    problems = []
    for iteration in candidates:
        damage = _damage(root, iteration, verify_integrity)
        if _all_ranks_agree(damage is None):
            if problems:
                _warn(
                    f"> --load {root}: {problems[0]}; falling back to iteration {iteration}, "
                    "the newest complete checkpoint before it"
                )
            return iteration
        problems.append(f"iteration {iteration} is damaged ({damage or 'on another rank'})")
    raise ConfigError(f"--load {root}: {problems[0]}, and no earlier complete checkpoint verifies")


def _warn(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def load_checkpoint(
    root: str,
    components: CheckpointComponents,
    load_optimizer: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
) -> int | None:
    """Restore the latest complete checkpoint under `root` into the components, from any
    TP/PP/DP layout. Returns its iteration, or None (and changes nothing) when `root` holds no
    checkpoint yet (or, as the run's own --save, does not exist yet). `finetune`: weights only,
    and training starts again from iteration 0."""
    if not os.path.isdir(root):
        if root == components.config.checkpoint.save:
            return None
        raise ConfigError(f"--load {root}: no such directory")
    iteration = find_checkpoint(root, components.config.checkpoint.verify_integrity)
    if iteration is None:
        return None
    metadata = read_metadata(root, iteration)
    path = checkpoint_dir(root, iteration)
    if finetune:
        load_optimizer = load_rng = False
    megatron = "megatron" in metadata
    if megatron and load_optimizer and not metadata["optimizer_saved"]:
        raise ConfigError(megatron_refusal(metadata["megatron"]["optimizer"], f"--load {root}"))
    if metadata.get("weights_only") and load_optimizer:
        raise ConfigError(
            f"--load {root}: the checkpoint holds weights only (a converted "
            "model); pass --finetune (or --no-load-optim)"
        )
    if not metadata.get("optimizer_saved", True) and load_optimizer:
        raise ConfigError(
            f"--load {root}: iteration {iteration} was saved with "
            "--no-save-optim and holds no optimizer state; pass --no-load-optim "
            "(or --finetune)"
        )
    saved_optimizer = metadata["config"].get("training", {}).get("optimizer", "adam")
    optimizer = components.config.training.optimizer
    if megatron and load_optimizer and optimizer == "muon":
        raise ConfigError(
            f"--load {root}: reading Megatron-LM's Muon optimizer state is not built; pass "
            "--no-load-optim (or --finetune) to start the momentum afresh"
        )
    if load_optimizer and saved_optimizer != optimizer:
        raise ConfigError(
            f"--load {root}: the checkpoint holds {saved_optimizer}'s optimizer state and this "
            f"run has --optimizer {optimizer}; pass --no-load-optim "
            "(or --finetune) to start its state afresh"
        )
    _check_architecture(root, metadata["config"]["model"], components.config.model)
    _check_tokenizer(root, path, metadata, components.config.data)
    # A model fine-tuned with LoRA starts from a checkpoint without adapters: they keep their
    # initialization (B = 0, so the model is the checkpoint's).
    without_adapters = bool(
        components.config.model.lora_rank and not metadata["config"]["model"].get("lora_rank")
    )
    if without_adapters and load_optimizer:
        raise ConfigError(
            f"--load {root}: the checkpoint has no LoRA adapters; start the "
            "fine-tuning with --finetune"
        )
    saved = metadata["config"]["parallel"]
    # Converted (weights-only) checkpoints hold the unpadded vocabulary, and another
    # --make-vocab-size-divisible-by pads it differently: both are resharded.
    same_layout = (
        not megatron
        and _same_layout(saved, components.config.parallel, load_optimizer)
        and not metadata.get("weights_only")
        and metadata["config"]["model"].get("make_vocab_size_divisible_by", 128)
        == components.config.model.make_vocab_size_divisible_by
    )
    if same_layout and load_rng and not metadata.get("rng_saved", True):
        raise ConfigError(
            f"--load {root}: iteration {iteration} was saved with --no-save-rng "
            "and holds no RNG state; pass --no-load-rng (or --finetune)"
        )
    rng_file = os.path.join(path, "rng", f"rank_{components.parallel.world.rank:05d}.pt")
    if same_layout and load_rng and not os.path.isfile(rng_file):
        raise ConfigError(
            f"--load {root}: {rng_file} is missing, so this rank's random "
            "streams cannot resume; pass --no-load-rng to continue with fresh "
            "ones (the losses will differ from an uninterrupted run)"
        )
    rng = load_tensors_file(rng_file) if same_layout and load_rng else None
    # (--fp8-param-gather's FP8-stored weights: loaded in the run's dtype, cast again by the
    # optimizer's copy to the model)
    with components.parameters_in_model_dtype():
        if same_layout:
            reader = SafeFileSystemReader(path)
            reader.read_metadata()  # a refusal in one line here, not wrapped by DCP's collectives
            dcp.load(
                tensor_state(components, load_optimizer, without_adapters), storage_reader=reader
            )
        else:
            load_resharded(
                path,
                components,
                saved["tensor_model_parallel_size"],
                load_optimizer,
                without_adapters,
                metadata["megatron"]["optimizer_step"] if megatron else None,
            )
        if components.fp8 is not None and not finetune:
            load_fp8_state(path, components.fp8.state_tensors())
            components.fp8.after_load()
        # fp32 masters are the truth when they were loaded; otherwise start them from the model.
        if load_optimizer:
            if metadata["loss_scaler"] or not megatron:  # (Megatron's, for fp16 runs only)
                components.loss_scaler.load_state_dict(metadata["loss_scaler"])
            components.optimizer.copy_masters_to_model()
        else:
            components.optimizer.copy_model_to_masters()
    if not finetune:  # the run goes on where it stopped: iteration, samples, LR schedule
        components.train_state.load_state_dict(metadata["train_state"])
        scheduler = metadata["scheduler"]
        if megatron and not components.scheduler.in_samples:
            # Megatron-LM counts its LR schedule in samples; an iteration-based run here counts
            # iterations (and checks the schedule itself against its own flags).
            scheduler = {"num_steps": metadata["train_state"]["iteration"]}
        components.scheduler.load_state_dict(scheduler)
    if rng is not None:  # (per-rank streams belong to the saved layout's ranks)
        set_rng_state(rng)
    return iteration


def load_fp8_state(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """FP8 scaling state (amax histories, scales) by layout-independent key, in any layout:
    every rank reads the keys of its own layers, without collectives. A checkpoint without
    them (saved without FP8, or with tensorwise scaling) leaves the fresh state, and says so."""
    if not tensors:
        return
    reader = SafeFileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    present = {key: tensor for key, tensor in tensors.items() if key in saved}
    if len(present) < len(tensors):
        _warn(
            f"> --load {path}: no FP8 scaling state for {len(tensors) - len(present)} of "
            f"{len(tensors)} tensors (saved without --fp8-recipe delayed); those start afresh"
        )
    for key, tensor in present.items():
        if tuple(saved[key].size) != tuple(tensor.shape):
            raise ConfigError(
                f"--load {path}: {key} has shape {tuple(saved[key].size)}, this run's "
                f"{tuple(tensor.shape)}; use the checkpoint's --fp8-amax-history-len"
            )
    if present:
        dcp.load(present, storage_reader=reader, no_dist=True)


def _check_tokenizer(root: str, path: str, metadata: dict, data) -> None:
    saved = metadata.get("tokenizer_sha256")
    current = tokenizer_digest(data)
    if saved and current and saved != current:
        copy = next(
            (
                os.path.join(path, name)
                for name in ("tokenizer.model", "tokenizer")
                if os.path.exists(os.path.join(path, name))
            ),
            None,
        )
        use = f"--tokenizer-model {copy}" if copy else "the run's tokenizer files"
        mine = data.tokenizer_model or data.vocab_file
        raise ConfigError(
            f"--load {root}: this run's tokenizer ({mine}) is not the one the "
            f"checkpoint was trained with; use {use} (or --use-checkpoint-args)"
        )


def load_model(
    root: str,
    device: torch.device | None = None,
    iteration: int | None = None,
    parallel: ParallelContext | None = None,
    with_tokenizer: bool = True,
    tokenizer_files: dict | None = None,
):
    """(config, model, tokenizer) of the latest checkpoint under `root` (or of `iteration`,
    found by `find_checkpoint` already), for generation and scoring: this rank's pipeline stage
    of the model, split over the TP ranks of `parallel` (the whole model on one device when not
    given), from a checkpoint of any layout (Megatron-LM's torch_dist too). The tokenizer
    is None for mock-data runs and when not `with_tokenizer` (conversions); `tokenizer_files`
    ({field: value} of DataConfig's tokenizer fields) replaces the checkpoint's (a Megatron-LM
    checkpoint names files on the machine that trained it)."""
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
    if tokenizer_files:
        files = {"tokenizer_model": None, "vocab_file": None, "merge_file": None}
        config.data = dataclasses.replace(config.data, **(files | tokenizer_files))
        config.data.finalize_tokenizer()
    tokenizer = (
        build_tokenizer(config.data, config.model.vocab_size)
        if with_tokenizer and config.data.tokenizer_type not in (None, "NullTokenizer")
        else None
    )
    parallel = parallel or ParallelContext()
    check_tensor_parallel_split(config.model, parallel.tp.size)
    if config.model.num_layers % parallel.pp.size:
        raise ConfigError(
            f"--pipeline-model-parallel-size {parallel.pp.size} does not divide the model's "
            f"{config.model.num_layers} layers"
        )
    # This rank's pipeline stage of the model (all of it without pipeline parallelism).
    ((offset, count),) = model_chunk_layers(
        config.model.num_layers, parallel.pp.size, parallel.pp.rank, None, None, None
    )
    model = GPTModel(
        config.model,
        config.model.padded_vocab_size(parallel.tp.size),
        parallel=parallel,
        pre_process=parallel.is_first_pipeline_stage,
        post_process=parallel.is_last_pipeline_stage,
        num_layers=count,
        layer_offset=offset,
    )
    named = [(model.layout_independent_name(n), p) for n, p in model.named_parameters()]
    load_weights(
        checkpoint_dir(root, iteration),
        named,
        metadata["config"]["parallel"]["tensor_model_parallel_size"],
        parallel,
    )
    model.eval()
    return config, model.to(device or torch.device("cpu")), tokenizer
