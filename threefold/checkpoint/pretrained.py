"""Megatron-LM's `--pretrained-checkpoint DIR`: what a fine-tuning job starts from on its first
start, when `--load` (its own checkpoints, usually its `--save`) holds none yet. Then the run
loads DIR as `--finetune` does (the weights, at iteration 0, a fresh optimizer); every later
start (a requeue, a restart) finds its own checkpoint in `--load` and resumes it, with no
change to the command line. A `--load` whose tracker says "release" (Megatron-LM's release
checkpoint, checkpoint/files.py) is loaded that way too, as Megatron-LM's --load does; once the
run has saved into it, its tracker names an iteration, resumed as any. With
`--non-persistent-ckpt-type global`, the non-persistent checkpoints' directory is loaded in
--load's place where it holds --load's newest iteration or a newer one, as in Megatron-LM.
Decided before torch is imported, from the directories alone."""

from __future__ import annotations

import dataclasses
import os

from threefold.checkpoint.files import RELEASE, TRACKER, holds_checkpoint, is_release, read_tracker
from threefold.checkpoint.manifest import complete_iterations
from threefold.config import CheckpointConfig, ConfigError


def starting_checkpoint(checkpoint: CheckpointConfig) -> tuple[CheckpointConfig, str | None]:
    """The checkpoint settings the run loads with (--load swapped for --pretrained-checkpoint
    with --finetune, when --load holds nothing; --finetune for a release checkpoint), and a
    start-up note saying so."""
    newer = _non_persistent(checkpoint)
    if newer is not None:
        return newer
    pretrained = checkpoint.pretrained_checkpoint
    if pretrained is None or holds_checkpoint(checkpoint.load):
        return from_release(checkpoint)
    where = f"--load {checkpoint.load} holds none" if checkpoint.load else "no --load"
    if not holds_checkpoint(pretrained):
        raise ConfigError(
            f"--pretrained-checkpoint {pretrained}: holds no checkpoint ({where} either); fix "
            "the path"
        )
    note = (
        f"> {where}: fine-tuning from --pretrained-checkpoint {pretrained} (its weights, from "
        "iteration 0)"
    )
    return dataclasses.replace(checkpoint, load=pretrained, finetune=True), note


def _non_persistent(checkpoint: CheckpointConfig) -> tuple[CheckpointConfig, str] | None:
    """--load swapped for its non-persistent checkpoints' directory where that holds one of
    --load's newest iteration or a newer one (Megatron-LM's choice), and the note. Not where
    --ckpt-step names the iteration of --load to take."""
    where = checkpoint.non_persistent_dir(checkpoint.load)
    if where is None or not os.path.isdir(where) or checkpoint.ckpt_step is not None:
        return None
    newest = read_tracker(where)
    persistent = None
    if holds_checkpoint(checkpoint.load):  # (the tracker's, else the newest complete one)
        tracked = read_tracker(checkpoint.load)
        persistent = tracked if tracked is not None else max(complete_iterations(checkpoint.load))
    if newest is None or (persistent is not None and newest < persistent):
        return None
    note = (
        f"> loading the non-persistent checkpoint of iteration {newest} in {where} (--load "
        f"{checkpoint.load} holds {'none' if persistent is None else persistent})"
    )
    return dataclasses.replace(checkpoint, load=where), note


def from_release(checkpoint: CheckpointConfig) -> tuple[CheckpointConfig, str | None]:
    """--finetune where --load holds Megatron-LM's release checkpoint (the weights, from
    iteration 0: a release holds no iteration to resume), and a start-up note saying so."""
    if checkpoint.finetune or not is_release(checkpoint.load):
        return checkpoint, None
    note = (
        f"> --load {checkpoint.load}: a release checkpoint (its {TRACKER} says {RELEASE!r}, as "
        f"Megatron-LM's): its weights, from iteration 0, as --finetune loads them"
    )
    return dataclasses.replace(checkpoint, finetune=True), note
