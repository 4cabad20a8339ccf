"""Megatron-LM's `--use-checkpoint-args`: the command line completed from a checkpoint.

The tracker file and each checkpoint's metadata.json (checkpoint/save.py writes them) are
plain text (checkpoint/files.py), so the command line can be completed before torch is
imported: Megatron-LM's `--use-checkpoint-args` takes the model's architecture and tokenizer
from the checkpoint named by `--load`; finetune.py always does.
"""

from __future__ import annotations

import os

from threefold.checkpoint.files import (
    checkpoint_tokenizer,
    holds_checkpoint,
    is_release,
    latest_config,
    read_metadata,
    read_tracker,
)
from threefold.config import ConfigError, DataConfig, ModelConfig
from threefold.config.fields import ARCHITECTURE, FINETUNING, MODEL, as_flags


def model_flags(model: dict) -> list[str]:
    """A stored model config as the flags that rebuild that architecture: every field the
    config declares a checkpoint carries (config/fields.py). Those its tensors depend on,
    those that change the function they compute (RoPE base, norm epsilon), and the sequence
    length, as Megatron-LM takes them. Not the TP/PP layout, which Megatron-LM also takes:
    threefold loads a checkpoint into any layout, so the layout stays the command line's."""
    return as_flags(ModelConfig, model, ARCHITECTURE, MODEL)


def flags_for_use_checkpoint_args(
    load: str | None, save: str | None, with_tokenizer: bool, pretrained: str | None = None
) -> tuple[list[str], str]:
    """(flags, a start-up note) for --use-checkpoint-args. A run whose --load is its own --save
    directory and finds no checkpoint there yet (its first start) keeps its command line, or
    takes `pretrained`'s (--pretrained-checkpoint, which it then starts from)."""
    if pretrained is not None and not holds_checkpoint(load):
        load = pretrained
    if load is None:
        raise ConfigError(
            "--use-checkpoint-args needs --load DIR (the checkpoint whose model flags to use)"
        )
    if load == save and (not os.path.isdir(load) or read_tracker(load) is None):
        return (
            [],
            f"--use-checkpoint-args: no checkpoint in --load {load} yet; using the "
            "command line's model flags",
        )
    flags = checkpoint_flags(load, with_tokenizer)
    which = "its release checkpoint" if is_release(load) else f"iteration {read_tracker(load)}"
    return flags, f"--use-checkpoint-args: model flags from {load} ({which}): {' '.join(flags)}"


def checkpoint_flags(root: str, with_tokenizer: bool, finetuning: bool = False) -> list[str]:
    """The flags --use-checkpoint-args puts before the command line: the model's architecture,
    when `finetuning` also the fields fine-tuning starts from (dropout), and when
    `with_tokenizer` the checkpoint's tokenizer (its own copy of the model file)."""
    iteration, saved = latest_config(root)
    flags = model_flags(saved["model"])
    if finetuning:
        flags += as_flags(ModelConfig, saved["model"], FINETUNING)
    if with_tokenizer:
        data = checkpoint_tokenizer(root, iteration, DataConfig(**saved["data"]))
        files = [f for f in (data.tokenizer_model, data.vocab_file, data.merge_file) if f]
        # A Megatron-LM checkpoint names its tokenizer's files on the machine that trained it:
        # where they are not here, the tokenizer stays the command line's (the note shows it).
        if data.tokenizer_type and all(os.path.exists(f) for f in files):
            flags += ["--tokenizer-type", data.tokenizer_type]
            if data.tokenizer_type == "NullTokenizer" and "--vocab-size" in flags:
                # (its --vocab-size counts the ids before its end-of-document one: Megatron-LM's
                # own, where it wrote the checkpoint, whose model rows are that padded)
                at = flags.index("--vocab-size") + 1
                given = read_metadata(root, iteration).get("megatron", {}).get("vocab_size")
                flags[at] = str(given if isinstance(given, int) else int(flags[at]) - 1)
            for flag, value in (
                ("--tokenizer-model", data.tokenizer_model),
                ("--vocab-file", data.vocab_file),  # GPT2BPETokenizer (Megatron-LM's runs)
                ("--merge-file", data.merge_file),
            ):
                if value:
                    flags += [flag, value]
            if data.tokenizer_type == "SFTTokenizer":  # (how it renders: part of it)
                flags += ["--sft-tokenizer-prompt-format", data.sft_tokenizer_prompt_format]
    return flags
