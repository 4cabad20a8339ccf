"""Checkpoints: where they are saved and loaded, and what they hold."""

from __future__ import annotations

import os
from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import arg

# megatron-core's StrictHandling, for a Megatron-LM checkpoint's tensors no parameter takes:
# refused (raise_*), named and passed over (log_*, return_*) or passed over unchecked
# (assume_ok_unexpected, Megatron-LM's default; ignore_all). A missing tensor is always refused.
DIST_CKPT_STRICTNESS = (
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
)

# threefold's own; Megatron-LM's torch_dist; the names of Megatron-LM's other formats, which
# save threefold's (its legacy torch format, a pickle per rank, is read but never written).
CKPT_FORMATS = ("threefold", "torch_dist", "torch", "fsdp_dtensor")


# Megatron-LM's directory of the non-persistent checkpoints in --save (and --load)
NON_PERSISTENT = "non_persistent"


@dataclass
class CheckpointConfig:
    save: str | None = arg(
        None,
        help="directory to save checkpoints to (Megatron's layout; a lock keeps other runs out)",
    )
    load: str | None = arg(
        None, help="directory to resume or start from (the --save directory resumes a run)"
    )
    save_interval: int | None = arg(
        None, minimum=1, help="save every this many iterations (and at the end)"
    )
    ckpt_step: int | None = arg(
        None,
        minimum=0,
        help="load this iteration of --load instead of the latest (Megatron-LM's --ckpt-step)",
    )
    # Megatron-LM's default is torch_dist; threefold's own format stays the default here, as
    # it holds what Megatron-LM's cannot (the ranks' RNG streams, FP8 scaling state, adapters).
    ckpt_format: str = arg(
        "threefold",
        choices=CKPT_FORMATS,
        help="the format --save writes: threefold's own (docs/checkpoints.md), or torch_dist, "
        "Megatron-LM's, which its --load takes as it is (torch and fsdp_dtensor: threefold's)",
    )
    async_save: bool = arg(
        False, help="write checkpoints in the background while training continues"
    )  # write in the background; the tracker follows when complete
    pretrained_checkpoint: str | None = arg(
        None,
        help="the checkpoint to fine-tune from while --load holds none (a run's first start): "
        "its weights only, from iteration 0 (as --finetune); later starts resume from --load",
    )
    # threefold refuses by default: a tensor left behind makes the model compute something
    # other than the checkpoint's (Megatron-LM's default, assume_ok_unexpected, does not look).
    dist_ckpt_strictness: str = arg(
        "raise_unexpected",
        choices=DIST_CKPT_STRICTNESS,
        help="a Megatron-LM checkpoint's tensors no parameter of the model takes: refuse them "
        "(raise_*), name them and go on (log_*, return_*), or do not look "
        "(assume_ok_unexpected, Megatron-LM's default; ignore_all)",
    )
    exit_on_missing_checkpoint: bool = arg(
        False,
        help="refuse to start when --load holds no checkpoint (a mistyped path, a lost "
        "mount) instead of training from scratch",
    )
    no_load_optim: bool = arg(
        False, help="load weights, scheduler and iteration, but start the optimizer afresh"
    )
    no_load_rng: bool = arg(
        False, help="resume with fresh random streams instead of the checkpoint's"
    )
    no_save_optim: bool = arg(
        False,
        help=(
            "checkpoints without optimizer state (masters, Adam moments, loss "
            "scale); loading one needs --no-load-optim or --finetune"
        ),
    )  # checkpoints without optimizer state (Megatron's flag)
    no_save_rng: bool = arg(
        False, help="checkpoints without the ranks' RNG states; loading one needs --no-load-rng"
    )  # checkpoints without the ranks' RNG states
    # Retention (torchtitan's keep_latest_k; Megatron-LM keeps every checkpoint): None keeps all.
    ckpt_keep_latest: int | None = arg(
        None,
        help=(
            "after each complete save, delete all but the newest N complete "
            "checkpoints (default: keep every one)"
        ),
        metavar="N",
    )
    verify_integrity: bool = arg(
        False,
        help=(
            "refuse a --load checkpoint without checksums (threefold's manifest.json or "
            "Megatron-LM's integrity.json); those it has are verified with or without the "
            "flag, and every --save writes them"
        ),
    )
    save_retain_interval: int | None = arg(
        None,
        help="after each complete save, delete older checkpoints whose iteration is not a "
        "multiple of this (a multiple of --save-interval), as Megatron-LM does; with "
        "--ckpt-keep-latest, the newest N are kept too",
        metavar="N",
    )
    finetune: bool = arg(
        False, help="load the weights only; iteration and consumed samples start from 0"
    )  # weights only; iteration and consumed samples start at 0
    use_checkpoint_args: bool = arg(
        False,
        help=(
            "take the model's architecture (and tokenizer, unless "
            "--tokenizer-type is given) from the --load checkpoint; the "
            "command line may add to it"
        ),
    )  # model flags from --load (threefold/checkpoint/args.py)
    use_tokenizer_model_from_checkpoint_args: bool = arg(
        True,
        help="with --use-checkpoint-args: keep the command line's tokenizer, not the checkpoint's",
        flag="--no-use-tokenizer-model-from-checkpoint-args",
    )

    # Megatron-LM's non-persistent checkpoints: frequent saves of which only the newest is
    # kept, beside the persistent ones; a start takes the newer of the two
    # (checkpoint/pretrained.py)
    non_persistent_save_interval: int | None = arg(
        None,
        minimum=1,
        help="also save every this many iterations into the non-persistent directory, "
        "keeping only the newest there",
    )
    non_persistent_ckpt_type: str | None = arg(
        None,
        choices=("global", "local", "in_memory"),
        help="global: non-persistent checkpoints are checkpoints like the others, in "
        "--non-persistent-global-ckpt-dir",
    )
    non_persistent_global_ckpt_dir: str | None = arg(
        None, help="default: SAVE/non_persistent (and LOAD/non_persistent to start from)"
    )

    def non_persistent_dir(self, root: str | None) -> str | None:
        """The non-persistent checkpoints' directory beside `root` (--save or --load)."""
        if self.non_persistent_ckpt_type != "global":
            return None
        if self.non_persistent_global_ckpt_dir or root is None:
            return self.non_persistent_global_ckpt_dir
        return os.path.join(root, NON_PERSISTENT)

    def finalize(self) -> list[str]:
        warnings = []
        _require(
            self.non_persistent_ckpt_type in (None, "global"),
            f"--non-persistent-ckpt-type {self.non_persistent_ckpt_type}: Megatron-LM's local "
            "and in-memory checkpoints (NVIDIA Resiliency Extension) are not built; use global",
        )
        _require(
            self.non_persistent_save_interval is None
            or (self.non_persistent_ckpt_type == "global" and self.save is not None),
            "--non-persistent-save-interval needs --non-persistent-ckpt-type global and --save",
        )
        if self.save_interval is not None and self.save is None:
            # Megatron-LM saves only with --save, and its own configs rely on that (the
            # DeepSeek proxy's comment their --save out and keep --save-interval 25).
            warnings.append(
                f"--save-interval {self.save_interval} without --save: no checkpoint is "
                "written; give --save DIR to keep them"
            )
        _require(not self.async_save or self.save is not None, "--async-save needs --save DIR")
        if self.ckpt_keep_latest is not None:
            _require(
                self.ckpt_keep_latest >= 1,
                "--ckpt-keep-latest must be >= 1 (leave it out to keep every checkpoint)",
            )
            _require(self.save is not None, "--ckpt-keep-latest needs --save DIR")
        if self.save_retain_interval is not None:
            _require(self.save is not None, "--save-retain-interval needs --save DIR")
            _require(
                self.save_interval is not None
                and self.save_retain_interval > 0
                and self.save_retain_interval % self.save_interval == 0,
                f"--save-retain-interval {self.save_retain_interval} must be a positive "
                f"multiple of --save-interval {self.save_interval}",
            )
        # --load equal to --save is how a run resumes itself (requeues, elastic restarts): a
        # first run finds nothing there yet and starts from scratch.
        _require(
            self.load is None or self.load == self.save or os.path.isdir(self.load),
            f"--load {self.load}: no such directory; to resume a run from its own "
            "checkpoints, give --load the --save directory",
        )
        for name, value in (
            ("--exit-on-missing-checkpoint", self.exit_on_missing_checkpoint),
            ("--finetune", self.finetune),
            ("--ckpt-step", self.ckpt_step is not None),
        ):
            _require(not value or self.load is not None, f"{name} needs --load DIR")
        # What not to load, with nothing to load: Megatron-LM's launch scripts pass these
        # whether or not they load (examples/gptoss/02_train.sh), and Megatron-LM runs them.
        for name, value in (
            ("--no-load-optim", self.no_load_optim),
            ("--no-load-rng", self.no_load_rng),
        ):
            if value and self.load is None:
                warnings.append(f"{name} has no effect without --load: nothing is loaded")
        if self.ckpt_format in ("torch", "fsdp_dtensor"):
            warnings.append(
                f"--ckpt-format {self.ckpt_format}: checkpoints are saved in threefold's format "
                "(docs/checkpoints.md), not Megatron-LM's "
                + (
                    "legacy torch format, a pickle per rank, which threefold reads (without "
                    "running what it names) but never writes"
                    if self.ckpt_format == "torch"
                    else "Megatron-FSDP DTensor layout; FSDP2 runs save and load it at any layout"
                )
            )
        for name, value in (
            ("--no-save-optim", self.no_save_optim),
            ("--no-save-rng", self.no_save_rng),
        ):
            _require(not value or self.save is not None, f"{name} needs --save DIR")
        return warnings
