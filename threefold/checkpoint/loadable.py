"""Which checkpoint a `--load` loads, and whether this run can load it, from its files and
metadata alone.

Torch-free, so that `check_inputs` (threefold/validation.py) refuses a `--load` that cannot
succeed before torch is imported, within a second (only a Megatron-LM checkpoint's common.pt
needs torch to read). That early look sees what every rank sees alike: which files are there,
the metadata, the RNG files; not the files' contents, whose sizes and checksums each rank
verifies for its own slice once the process groups exist (hashing a large checkpoint takes
minutes). checkpoint/load.py then runs both steps again with the contents verified, all
ranks agreeing on the iteration, and only then reads tensors.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable

from threefold.checkpoint.files import (
    TRACKER,
    is_release,
    read_metadata,
    read_tracker,
    saved_dir,
    tokenizer_digest,
)
from threefold.checkpoint.manifest import (
    INTEGRITY,
    MANIFEST,
    complete_iterations,
    has_iteration_directories,
    iterations,
    read_integrity,
    read_manifest,
    verify_slice,
)
from threefold.checkpoint.megatron.legacy import is_legacy_checkpoint, legacy_damage
from threefold.checkpoint.megatron.optimizer import refusal as megatron_refusal
from threefold.config import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
)
from threefold.config.fields import ARCHITECTURE, checkpoint_fields, flag_of
from threefold.config.hybrid import MTP_SEPARATOR, without_pipeline_cuts
from threefold.config.lr_schedule import resumed_lr_schedule
from threefold.parallel.rank_order import DEFAULT_ORDER, TP_PP_DP_ORDER, rank_groups


def damage(
    root: str,
    iteration: int,
    verify_integrity: bool = False,
    rank: int = 0,
    world_size: int = 1,
    contents: bool = True,
) -> str | None:
    """What is wrong with a checkpoint's files (None when they are as written): every file of
    its manifest (a Megatron-LM checkpoint's: its integrity.json) must be there and, with
    `contents`, this rank's slice of them have the sizes and SHA-256s written. Checkpoints
    with neither list are only checked for their metadata, or refused under
    `verify_integrity`."""
    path = saved_dir(root, iteration)
    if not os.path.isdir(path):
        return f"{path} does not exist"
    listed = checksums_file(path)
    if listed is None:
        if verify_integrity:
            return (
                f"{path} holds no checksums ({MANIFEST} or Megatron-LM's {INTEGRITY}) to "
                "verify, which --verify-integrity requires; drop the flag to load it unverified"
            )
        if is_legacy_checkpoint(path):  # (Megatron-LM's legacy format: its files' layout)
            return legacy_damage(path)
        return (
            None
            if os.path.isfile(os.path.join(path, "metadata.json"))
            else f"{path} has no metadata.json"
        )
    manifest = (read_manifest if listed == MANIFEST else read_integrity)(path)
    if manifest is None:
        return f"{os.path.join(path, listed)} is unreadable"
    return verify_slice(path, manifest, rank, world_size, contents)


def checksums_file(path: str) -> str | None:
    """The name of the list of checksums in a checkpoint directory (threefold's manifest, else
    Megatron-LM's integrity.json), None when it has neither."""
    return next((n for n in (MANIFEST, INTEGRITY) if os.path.isfile(os.path.join(path, n))), None)


def choose_iteration(
    root: str,
    damage_of: Callable[[int], str | None],
    all_ranks_agree: Callable[[bool], bool] = bool,
    warn: Callable[[str], None] | None = None,
    step: int | None = None,
) -> int | None:
    """The iteration to load from `root`: the tracker's, if `damage_of(iteration)` (this
    rank's verdict on its files, `damage`) finds nothing wrong; if it is damaged, the newest
    complete one before it, with a one-line `warn`ing. None when `root` holds no checkpoint at
    all; a one-line ConfigError when it holds some but none is usable (never 'start from
    scratch' over existing iterations). `all_ranks_agree(ok)`: whether `ok` holds on every
    rank, so that all ranks choose the same iteration. `step`
    (--ckpt-step, Megatron-LM's): that iteration, whole, or a one-line refusal (no fallback)."""
    warn = warn or (lambda message: None)
    if step is not None:
        if not os.path.isdir(saved_dir(root, step)):
            held = ", ".join(map(str, iterations(root)[:5])) or "none"
            raise ConfigError(
                f"--ckpt-step {step}: --load {root} holds no iteration {step} (it holds: {held})"
            )
        found = damage_of(step)
        if not all_ranks_agree(found is None):
            raise ConfigError(
                f"--ckpt-step {step}: iteration {step} of --load {root} is damaged "
                f"({found or 'on another rank'}); drop the flag to take the newest good one"
            )
        return step
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
        warn(
            f"> --load {root}: no {TRACKER}; using the newest complete checkpoint, "
            f"iteration {candidates[0]}"
        )
    problems = []
    for iteration in candidates:
        found = damage_of(iteration)
        if all_ranks_agree(found is None):
            if problems:
                warn(
                    f"> --load {root}: {problems[0]}; falling back to iteration {iteration}, "
                    "the newest complete checkpoint before it"
                )
            return iteration
        release = iteration == 0 and is_release(root)
        which = "the release checkpoint" if release else f"iteration {iteration}"
        problems.append(f"{which} is damaged ({found or 'on another rank'})")
    raise ConfigError(f"--load {root}: {problems[0]}, and no earlier complete checkpoint verifies")


def check_before_start(
    root: str, checkpoint: CheckpointConfig, world_size: int, run: Config | None
) -> int | None:
    """A one-line ConfigError when no iteration of `root` that the run could choose has all
    its files and is loadable by the run (`check_loadable`; `run`: its config, None where it
    is not settled before start-up). Alike on every rank of a `world_size`-rank job. Where the
    files' contents might still decide between iterations, only what fails on all of them is
    refused; a fallback is announced later, once, when the contents are verified. Returns
    the iteration chosen (None: `root` holds no checkpoint)."""
    step = checkpoint.ckpt_step
    newer = [i for i in iterations(root) if step is not None and i > step]
    if newer and checkpoint.save and os.path.realpath(checkpoint.save) == os.path.realpath(root):
        raise ConfigError(
            f"--ckpt-step {step}: --load {root} holds newer iterations ({newer[0]} the newest), "
            "which this run's saves into the same --save would replace; give --save another "
            "directory"
        )
    refusals: dict[int, ConfigError] = {}

    def verdict(iteration: int) -> str | None:
        found = damage(root, iteration, checkpoint.verify_integrity, contents=False)
        if found is not None or run is None:
            return found
        try:
            check_loadable(
                root,
                iteration,
                run,
                range(world_size),
                not checkpoint.no_load_optim,
                not checkpoint.no_load_rng,
                checkpoint.finetune,
            )
        except ConfigError as error:
            refusals[iteration] = error
            # With a manifest the run may find its contents damaged and load an earlier one.
            return str(error) if checksums_file(saved_dir(root, iteration)) else None
        return None

    try:
        iteration = choose_iteration(root, verdict, step=checkpoint.ckpt_step)
    except ConfigError:
        if refusals:  # every iteration the run could load refuses it
            raise next(iter(refusals.values())) from None
        raise
    if iteration in refusals:
        raise refusals[iteration]
    return iteration


@dataclasses.dataclass(frozen=True)
class Loadable:
    """A checkpoint this run can load, and how: what `check_loadable` found."""

    path: str
    metadata: dict
    megatron: bool  # a Megatron-LM torch_dist checkpoint
    same_layout: bool  # the run's tensors have exactly the checkpoint's keys and shapes
    load_optimizer: bool
    load_rng: bool
    without_adapters: bool  # LoRA fine-tuning from a checkpoint without adapters
    scheduler: dict | None  # the LR scheduler's state to resume (None: weights only)
    depths_left_out: int = 0  # the checkpoint's multi-token prediction depths this run lacks
    # this run's rank -> the saved rank whose RNG streams it resumes (empty: none apply)
    rng_sources: dict[int, int] = dataclasses.field(default_factory=dict)


def check_loadable(
    root: str,
    iteration: int,
    config: Config,
    ranks: Iterable[int],
    load_optimizer: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
) -> Loadable:
    """Whether this run (`config`) can load `iteration` of `root`: a one-line ConfigError for
    the first thing it cannot (the optimizer state or RNG streams it would need, the model,
    the tokenizer), before any tensor is read. `ranks`: the world ranks whose RNG streams must
    be there. `finetune`: weights only."""
    metadata = read_metadata(root, iteration)
    path = saved_dir(root, iteration)
    if finetune:
        load_optimizer = load_rng = False
    megatron = "megatron" in metadata
    if megatron and load_optimizer and not metadata["optimizer_saved"]:
        megatron_optimizer = metadata["megatron"]
        raise ConfigError(
            megatron_refusal(
                megatron_optimizer["optimizer"],
                f"--load {root}",
                megatron_optimizer.get("optimizer_reason"),
            )
        )
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
    optimizer = config.training.optimizer
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
    saved_model = metadata["config"]["model"]
    depths = saved_model.get("mtp_num_layers") or 0
    left_out = depths if depths and not config.model.mtp_num_layers else 0
    if left_out and load_optimizer:  # (its state holds theirs: the layouts would differ)
        raise ConfigError(
            f"--load {root}: the checkpoint's model has {depths} multi-token prediction depths "
            f"and this run none; pass --mtp-num-layers {depths} (or --finetune or "
            "--no-load-optim, which leave them out)"
        )
    if left_out:  # a run without them takes the rest, as Megatron-LM's --load does
        saved_model = _without_depths(saved_model)
    check_architecture(root, saved_model, config.model)
    _check_tokenizer(root, path, metadata, config.data)
    # A model fine-tuned with LoRA starts from a checkpoint without adapters: they keep their
    # initialization (B = 0, so the model is the checkpoint's).
    without_adapters = bool(
        config.model.lora_rank and not metadata["config"]["model"].get("lora_rank")
    )
    if without_adapters and load_optimizer:
        raise ConfigError(
            f"--load {root}: the checkpoint has no LoRA adapters; start the "
            "fine-tuning with --finetune"
        )
    # Converted (weights-only) checkpoints hold the unpadded vocabulary, and another
    # --make-vocab-size-divisible-by pads it differently: both are resharded.
    same_layout = (
        not megatron
        and _same_layout(metadata["config"]["parallel"], config.parallel, load_optimizer)
        and not metadata.get("weights_only")
        and metadata["config"]["model"].get("make_vocab_size_divisible_by", 128)
        == config.model.make_vocab_size_divisible_by
    )
    # (a torch_dist checkpoint a run saved here names its ranks' layout; Megatron-LM's own
    # streams are not read)
    saved_ranks = metadata.get("rng_layout") if megatron else metadata["config"]["parallel"]
    held = not metadata.get("weights_only")
    rng_sources = rng_source_ranks(saved_ranks, config.parallel, ranks) if held else {}
    if rng_sources and load_rng:
        if not metadata.get("rng_saved", True):
            raise ConfigError(
                f"--load {root}: iteration {iteration} was saved with --no-save-rng "
                "and holds no RNG state; pass --no-load-rng (or --finetune)"
            )
        _check_rng_files(root, path, rng_sources)
    scheduler = None if finetune else _scheduler_state(root, metadata, config.training)
    return Loadable(
        path,
        metadata,
        megatron,
        same_layout,
        load_optimizer,
        load_rng,
        without_adapters,
        scheduler,
        left_out,
        rng_sources,
    )


def _scheduler_state(root: str, metadata: dict, training: TrainingConfig) -> dict:
    """The LR scheduler's state a resumed run loads, once its schedule is settled against the
    run's flags (config/lr_schedule.py)."""
    scheduler = metadata["scheduler"]
    if "megatron" in metadata:
        scheduler = {"num_steps": _megatron_steps(metadata, training)}
    try:
        resumed_lr_schedule(scheduler, training)
    except ConfigError as error:
        raise ConfigError(f"--load {root}: {error}") from None
    return scheduler


def _megatron_steps(metadata: dict, training: TrainingConfig) -> int | float:
    """Megatron-LM's LR schedule counts the samples of the iterations that updated (an fp16
    run's skipped ones do not count) in --train-samples' units and --train-iters' alike,
    scaling its iteration counts by the global batch size; an iteration-based run here counts
    those iterations. Without the checkpoint's schedule (saved with --no-save-optim), the
    iterations."""
    samples = metadata["scheduler"].get("num_steps")
    if samples is None:
        train_state = metadata["train_state"]
        return train_state["consumed_train_samples" if training.train_samples else "iteration"]
    if training.train_samples is not None:
        return samples
    steps = samples / training.global_batch_size
    return int(steps) if steps.is_integer() else steps


# The ranks' layout a torch_dist checkpoint saved here records beside their RNG streams.
_RNG_LAYOUT = (
    "world_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "use_tp_pp_dp_mapping",
)


# What decides a rank's RNG streams (parallel/tensor_parallel/random.py seeds them by TP, PP
# and CP rank; the virtual stages and rank order decide which draws they made): runs alike
# in these are the same streams, whatever their DP and EP; the experts' own streams, seeded by
# EP and expert-TP rank too, resume only where those agree (RNGStatesTracker.resume). (name:
# its value where a checkpoint predates the field)
_RNG_GRID = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1,
    "use_tp_pp_dp_mapping": False,
}


def rng_source_ranks(
    saved: dict | None, current: ParallelConfig, ranks: Iterable[int]
) -> dict[int, int]:
    """For each of this run's `ranks`, the rank of the saved run (`saved`: its parallel
    config) whose RNG streams it resumes: the one at the same TP, CP and PP place, in the same
    data-parallel replica, or in replica 0 where the saved run had fewer (replicas are seeded
    alike and draw alike, as Megatron-LM's replicas share one saved stream). Empty where the
    saved run's ranks were seeded otherwise: their streams are not this run's."""
    if saved is None or any(
        saved.get(name, default) != getattr(current, name) for name, default in _RNG_GRID.items()
    ):
        return {}
    tp, pp = current.tensor_model_parallel_size, current.pipeline_model_parallel_size
    cp = current.context_parallel_size
    order = TP_PP_DP_ORDER if current.use_tp_pp_dp_mapping else DEFAULT_ORDER

    def replicas(world_size: int) -> list[list[int]]:  # (alike TP/CP/PP: alike group order)
        sizes = {"tp": tp, "cp": cp, "dp": world_size // (tp * cp * pp), "pp": pp}
        return rank_groups(sizes, "dp", order)

    saved_replicas = replicas(saved["world_size"])
    place = {
        rank: (group, replica)
        for group, members in enumerate(replicas(current.world_size))
        for replica, rank in enumerate(members)
    }
    sources = {}
    for rank in ranks:
        group, replica = place[rank]
        members = saved_replicas[group]
        sources[rank] = members[replica if replica < len(members) else 0]
    return sources


def rng_layout(config: Config) -> dict:
    """The ranks' layout a checkpoint's RNG streams belong to (a torch_dist checkpoint saved
    by a run here records it, as threefold's own record the whole config)."""
    return {name: getattr(config.parallel, name) for name in _RNG_LAYOUT}


def rng_file(path: str, rank: int) -> str:
    return os.path.join(path, "rng", f"rank_{rank:05d}.pt")


def _check_rng_files(root: str, path: str, sources: dict[int, int]) -> None:
    directory = os.path.dirname(rng_file(path, 0))
    present = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    for rank, source in sources.items():
        if os.path.basename(rng_file(path, source)) not in present:
            raise ConfigError(
                f"--load {root}: {rng_file(path, source)} is missing, so rank {rank}'s random "
                "streams cannot resume; pass --no-load-rng to continue with fresh "
                "ones (the losses will differ from an uninterrupted run)"
            )


def _same_layout(saved: dict, current: ParallelConfig, load_optimizer: bool) -> bool:
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
    # PyTorch DDP/FSDP2's fp32 parameters are their masters, while threefold's own strategy
    # keeps masters beside half-precision weights: across the two the tensors are read by
    # name (resharding.py), the masters first
    same = same and (saved.get("distributed_strategy", "megatron") == "megatron") == (
        current.distributed_strategy == "megatron"
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


def _without_depths(saved: dict) -> dict:
    """The checkpoint's model without its multi-token prediction depths (a hybrid pattern's
    `/` parts too)."""
    pattern = saved.get("hybrid_layer_pattern")
    return saved | {
        "mtp_num_layers": None,
        "mtp_use_repeated_layer": False,
        "hybrid_layer_pattern": pattern.split(MTP_SEPARATOR)[0] if pattern else pattern,
    }


def check_architecture(root: str, saved: dict, current: ModelConfig) -> None:
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
        before, now = saved.get(name, getattr(defaults, name)), getattr(current, name)
        if name == "hybrid_layer_pattern":  # (its `|` cut pipeline stages: the same layers)
            before, now = without_pipeline_cuts(before), without_pipeline_cuts(now)
        if before != now:
            raise ConfigError(
                f"--load {root}: the checkpoint's model has {flag_of(field)} "
                f"{saved.get(name)} but this run has {getattr(current, name)}; "
                "use the checkpoint's model flags"
            )


def _check_tokenizer(root: str, path: str, metadata: dict, data: DataConfig) -> None:
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
