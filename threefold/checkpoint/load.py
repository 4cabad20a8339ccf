"""Loading a checkpoint: the tracker's iteration, verified, into any layout.

The tracker's iteration is verified against its manifest (or a Megatron-LM checkpoint against
its integrity.json); a damaged one falls back to the newest complete checkpoint before it,
with a one-line warning. `--verify-integrity` (Megatron-LM's flag) also counts a checkpoint
without either list as unusable instead of loading it unverified. A checkpoint of the same layout
loads directly (torch.distributed.checkpoint); any other TP/PP/DP layout, with or without the
distributed optimizer, goes through checkpoint/resharding.py, optimizer state included. Nothing
read from a checkpoint is unpickled freely (threefold/safe_loading.py). The choice of the
iteration and the checks against the run (architecture, tokenizer, the state it needs) are
checkpoint/loadable.py's, made before any tensor is read; `check_inputs` has made them once
already, without the checksums, before torch was imported.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from threefold.checkpoint.components import CheckpointComponents
from threefold.checkpoint.files import checkpoint_tokenizer, read_metadata, saved_dir
from threefold.checkpoint.loadable import check_loadable, choose_iteration, damage, rng_file
from threefold.checkpoint.resharding import load_resharded, load_weights
from threefold.checkpoint.save import set_rng_state, tensor_state
from threefold.config import Config, ConfigError
from threefold.config.parallel import check_tensor_parallel_split
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.pipeline_parallel.layout import model_chunk_layers
from threefold.safe_loading import SafeFileSystemReader, load_tensors_file


def all_ranks_agree(ok: bool) -> bool:
    """Whether `ok` holds on every rank (a load chooses the same checkpoint everywhere)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def find_checkpoint(
    root: str, verify_integrity: bool = False, step: int | None = None
) -> int | None:
    """The iteration to load from `root` (checkpoint/loadable.py's `choose_iteration`): this
    rank verifies its slice of each candidate's checksums (`verify_integrity`: one without
    checksums counts as damaged), and all ranks choose the same one (`step`: that one)."""
    distributed = dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    return choose_iteration(
        root,
        lambda iteration: damage(root, iteration, verify_integrity, rank, world_size),
        all_ranks_agree,
        _warn,
        step,
    )


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
    checkpoint = components.config.checkpoint
    iteration = find_checkpoint(root, checkpoint.verify_integrity, checkpoint.ckpt_step)
    if iteration is None:
        return None
    loadable = check_loadable(
        root,
        iteration,
        components.config,
        [components.parallel.world.rank],
        load_optimizer,
        load_rng,
        finetune,
    )
    path, metadata, megatron = loadable.path, loadable.metadata, loadable.megatron
    if loadable.depths_left_out:
        _warn(
            f"> --load {root}: the checkpoint's {loadable.depths_left_out} multi-token "
            "prediction depths are left out: this run has none (--mtp-num-layers "
            f"{loadable.depths_left_out} keeps them)"
        )
    same_layout, load_optimizer = loadable.same_layout, loadable.load_optimizer
    load_rng, without_adapters = loadable.load_rng, loadable.without_adapters
    saved = metadata["config"]["parallel"]
    sources = loadable.rng_sources
    rng = (
        load_tensors_file(rng_file(path, sources[components.parallel.world.rank]))
        if sources and load_rng
        else None
    )
    held = metadata.get("rng_saved", True) and not metadata.get("weights_only")
    if load_rng and held and not sources:  # (Megatron-LM says so, and goes on)
        _warn(
            f"> --load {root}: saved at another TP, PP or CP layout (or by Megatron-LM), so "
            "its random streams are not restored: each rank's start from --seed, and "
            "dropout draws other masks than an uninterrupted run (--no-load-rng: meant)"
        )
    # (--fp8-param-gather's FP8-stored weights: loaded in the run's dtype, cast again by the
    # optimizer's copy to the model)
    with components.parameters_in_model_dtype():
        if same_layout:
            reader = SafeFileSystemReader(path)
            reader.read_metadata()  # a refusal in one line here, not wrapped by DCP's collectives
            state = tensor_state(components, load_optimizer, without_adapters)
            dcp.load(state, storage_reader=reader)
            if load_optimizer:  # (read into fp32 copies of a precision-aware optimizer's state)
                components.optimizer.store_loaded(state)
        else:
            load_resharded(
                path,
                components,
                saved["tensor_model_parallel_size"],
                load_optimizer,
                without_adapters,
                metadata["megatron"]["optimizer_step"] if megatron else None,
                ("mtp.",) if loadable.depths_left_out else (),
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
        saved = metadata["train_state"]
        if "consumed_valid_samples" not in saved:  # (saved before they were counted)
            training = components.config.training
            saved = saved | {"consumed_valid_samples": training.validation_samples_read(iteration)}
        components.train_state.load_state_dict(saved)
        components.scheduler.load_state_dict(loadable.scheduler)
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


def load_model(
    root: str,
    device: torch.device | None = None,
    iteration: int | None = None,
    parallel: ParallelContext | None = None,
    with_tokenizer: bool = True,
    tokenizer_files: dict | None = None,
    strictness: str = "raise_unexpected",
):
    """(config, model, tokenizer) of the latest checkpoint under `root` (or of `iteration`,
    found by `find_checkpoint` already), for generation and scoring: this rank's pipeline stage
    of the model, split over the TP ranks of `parallel` (the whole model on one device when not
    given), from a checkpoint of any layout (Megatron-LM's torch_dist too). The tokenizer
    is None for mock-data runs and when not `with_tokenizer` (conversions); `tokenizer_files`
    ({field: value} of DataConfig's tokenizer fields) replaces the checkpoint's (a Megatron-LM
    checkpoint names files on the machine that trained it). `strictness`: what a Megatron-LM
    checkpoint's tensors no parameter takes do (--dist-ckpt-strictness)."""
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
        try:
            config.data.finalize_tokenizer()
        except ConfigError as error:
            if "tokenizer_type" in tokenizer_files:
                raise
            given = ", ".join("--" + name.replace("_", "-") for name in tokenizer_files)
            raise ConfigError(
                f"{error}: the type is the checkpoint's, its files replaced by {given}; give "
                "the --tokenizer-type that reads them"
            ) from None
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
        saved_dir(root, iteration),
        named,
        metadata["config"]["parallel"]["tensor_model_parallel_size"],
        parallel,
        strictness=strictness,
    )
    model.eval()
    return config, model.to(device or torch.device("cpu")), tokenizer
