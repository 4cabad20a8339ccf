"""Everything a run reads from disk, checked before any process group, model or dataset exists:
tokenizer files, the data's `.bin/.idx` headers, the checkpoint to load (but for its files'
contents). Together with the configs' own checks (threefold/config/) a mistake ends the run
within a second or two, as one line naming the flag and the file, with exit code 2 — not
minutes later on hundreds of ranks.

A `--vocab-size` below the tokenizer's and token ids outside the vocabulary are checked here too,
except with a Hugging Face tokenizer (seconds to import): then when the trainer builds it, still
before the model. Each data file is scanned once per run (`check_prefix` remembers).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import os

from threefold.config import Config, ConfigError
from threefold.config.data import HF_DIRECTORY, SENTENCEPIECE


def _readable(path: str, flag: str, kind: str = "file") -> None:
    exists = os.path.isfile(path) if kind == "file" else os.path.isdir(path)
    if not exists:
        raise ConfigError(f"{flag} {path}: no such {kind}; fix the path")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{flag} {path}: not readable by this user; fix its permissions")


def data_prefixes(paths: list[str], flag: str) -> list[str]:
    """The prefixes of `PREFIX ...` or `WEIGHT PREFIX WEIGHT PREFIX ...` (Megatron's blend;
    unweighted, megatron-core draws from each in proportion to its size)."""

    def is_number(text: str) -> bool:
        try:
            float(text)
        except ValueError:
            return False
        return True

    if len(paths) == 1 or not any(map(is_number, paths)):  # (one prefix may look like a number)
        return paths
    weights, prefixes = paths[0::2], paths[1::2]
    if len(paths) % 2 or not all(map(is_number, weights)) or any(map(is_number, prefixes)):
        raise ConfigError(
            f"{flag} {' '.join(paths)}: give PREFIX [PREFIX ...], or WEIGHT PREFIX WEIGHT "
            "PREFIX ..."
        )
    numbers = [float(weight) for weight in weights]
    if not all(0 <= number < math.inf for number in numbers) or not sum(numbers) > 0:  # (NaN)
        raise ConfigError(
            f"{flag}: blending weights must be finite and non-negative with a positive sum"
        )
    return prefixes


def check_conversations(path: str, flag: str, data, whole: bool) -> None:
    """--sft's JSONL file: every line a conversation (data/conversations.py), and a line for
    each split that gets a share of it (megatron-core's ranges: round(bound x lines))."""
    from threefold.data.conversations import line_offsets
    from threefold.data.gpt_dataset import split_ranges

    lines = len(line_offsets(path, flag, data.sft_tokenizer_prompt_format != "default"))
    for name, first, last in split_ranges([1.0] if whole else data.split_weights(), lines):
        if first == last:
            raise ConfigError(
                f"--split {data.split}: the {name} split gets none of the {lines} conversation "
                f"lines of {path}; give it more lines or weight 0"
            )


def check_inputs(config: Config, indexed_data: bool = True) -> None:
    """Raise ConfigError naming the flag and file for the first input the run cannot read.
    `indexed_data`: the data paths are `.bin/.idx` prefixes (not fine-tuning's JSONL)."""
    from threefold.data.gpt_dataset import (
        check_index,
        check_index_cache,
        check_prefix,
        check_split,
        index_cache_directories,
    )
    from threefold.data.tokenizer import check_hf_directory
    from threefold.launch_environment import check_accelerate_settings

    check_accelerate_settings(config)
    if (
        config.kernels.transformer_impl == "transformer_engine"
        and importlib.util.find_spec("transformer_engine") is None
    ):
        raise ConfigError(
            "--transformer-impl transformer_engine: Transformer Engine is not "
            "installed; install it on a GPU machine or pass --transformer-impl "
            "local"
        )
    data = config.data
    if data.tokenizer_type in SENTENCEPIECE:
        _readable(data.tokenizer_model, "--tokenizer-model")
    elif data.tokenizer_type in HF_DIRECTORY:
        _readable(data.tokenizer_model, "--tokenizer-model", "directory")
        check_hf_directory(data.tokenizer_model)
    elif data.tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", data.vocab_file), ("--merge-file", data.merge_file)):
            if path is None:
                raise ConfigError(f"--tokenizer-type GPT2BPETokenizer needs {flag} FILE")
            _readable(path, flag)
    vocab_size = None
    if data.tokenizer_type not in HF_DIRECTORY:  # (those take seconds to import)
        from threefold.data.tokenizer import build_tokenizer, model_vocab_size

        if data.tokenizer_type or config.model.vocab_size is not None:
            vocab_size = model_vocab_size(
                build_tokenizer(data, config.model.vocab_size), config.model.vocab_size
            )
    sources = (
        ("--data-path", data.data_path),
        ("--train-data-path", data.train_data_path),
        ("--valid-data-path", data.valid_data_path),
        ("--test-data-path", data.test_data_path),
    )
    if not indexed_data:  # JSONL files, read whole when the datasets are built
        for flag, paths in sources:
            for path in paths or []:
                _readable(path, flag)
    elif data.sft:
        for flag, paths in sources:
            for path in data_prefixes(paths, flag) if paths else []:
                _readable(path, flag)
                check_conversations(path, flag, data, whole=flag != "--data-path")
    else:
        prefixes = []
        for flag, paths in sources:
            for prefix in data_prefixes(paths, flag) if paths else []:
                if vocab_size is None:
                    check_index(prefix, flag)
                else:
                    check_prefix(prefix, vocab_size, flag)
                # Before megatron-core can loop forever on an empty split.
                whole = flag != "--data-path"
                check_split(
                    prefix,
                    [1.0] if whole else data.split_weights(),
                    config.model.seq_length,
                    flag,
                    None if whole else "--split",
                )
                prefixes.append(prefix)
        for directory in index_cache_directories(data.data_cache_path, prefixes):
            check_index_cache(directory)
    if config.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs the wandb package: pip install wandb")
    _check_outputs(config)
    if config.model.moe_use_upcycling:
        _check_upcycling(config)
    elif config.checkpoint.load is not None:
        _check_load(config, vocab_size)


def _check_upcycling(config: Config) -> None:
    """--moe-use-upcycling's --load holds the dense checkpoint (read whole at start-up, its
    model checked then) and its --save none yet: the upcycling is a run's first start."""
    from threefold.checkpoint.loadable import choose_iteration, damage

    def holds_checkpoint(root: str) -> bool:
        def verdict(iteration: int) -> str | None:
            return damage(root, iteration, False, contents=False)

        return os.path.isdir(root) and choose_iteration(root, verdict) is not None

    load, save = config.checkpoint.load, config.checkpoint.save
    if not holds_checkpoint(load):
        raise ConfigError(f"--load {load}: holds no checkpoint of the dense model to upcycle")
    if holds_checkpoint(save):
        raise ConfigError(
            f"--moe-use-upcycling: --save {save} holds a checkpoint already (as Megatron-LM, "
            "the upcycling is the first run's); drop the flag and --load it to resume"
        )


def _check_outputs(config: Config) -> None:
    """The directories the run writes besides --save (claimed with its lock at start-up):
    before, a file in the way was a traceback after start-up, or at the first rerun."""
    from threefold.output_directory import check_creatable

    logging, tracker = config.logging, config.training.result_rejected_tracker_filename
    if logging.tensorboard_dir:
        check_creatable(logging.tensorboard_dir, "--tensorboard-dir")
    if logging.wandb_project and logging.wandb_save_dir:
        check_creatable(logging.wandb_save_dir, "--wandb-save-dir")
    if tracker:
        parent = os.path.dirname(os.path.abspath(tracker))
        check_creatable(parent, "--result-rejected-tracker-filename", tracker)


def _check_load(config: Config, vocab_size: int | None) -> None:
    """`--load`, but for its files' contents (checkpoint/loadable.py's `check_before_start`)."""
    from threefold.checkpoint.loadable import check_before_start

    load = config.checkpoint.load
    missing = (
        f"--load {load}: holds no checkpoint, and --exit-on-missing-checkpoint is on; fix the "
        "path, or drop the flag to start from scratch"
    )
    if not os.path.isdir(load):
        if config.checkpoint.exit_on_missing_checkpoint:
            raise ConfigError(missing)
        if load == config.checkpoint.save:
            return  # (the run's first start: nothing to resume yet)
        raise ConfigError(f"--load {load}: no such directory")
    settled = None  # the run's config, once the tokenizer's size and the strategy are known
    if vocab_size:  # (the rows of a Megatron-LM checkpoint, as the run's model takes them)
        from threefold.checkpoint.megatron.vocabulary import checkpoint_vocabulary

        vocab_size = checkpoint_vocabulary(load, vocab_size)[0]
    if (vocab_size or config.model.vocab_size) and config.parallel.distributed_strategy != "auto":
        settled = copy.copy(config)
        settled.model = dataclasses.replace(
            config.model, vocab_size=vocab_size or config.model.vocab_size
        )
    iteration = check_before_start(load, config.checkpoint, config.parallel.world_size, settled)
    if iteration is None and config.checkpoint.exit_on_missing_checkpoint:
        raise ConfigError(missing)
