"""What a checkpoint directory says about the run that wrote it, read without torch.

The tracker file and each checkpoint's metadata.json (threefold/checkpointing.py writes them)
are plain text, so the command line can be completed from a checkpoint before torch is
imported: Megatron-LM's `--use-checkpoint-args` takes the model's architecture and tokenizer
from the checkpoint named by `--load`; finetune.py always does.
"""

from __future__ import annotations

import json
import os

from threefold.config import ConfigError, DataConfig

TRACKER = "latest_checkpointed_iteration.txt"

# Model fields a checkpoint supplies, as flags: those its tensors depend on, those that change
# the function they compute (RoPE base, norm epsilon), and the sequence length, as Megatron-LM
# takes them. Not the TP/PP layout, which Megatron-LM also takes: threefold loads a checkpoint
# into any layout, so the layout stays the command line's.
_VALUE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings",
                 "position_embedding_type", "rotary_base", "rope_scaling_factor",
                 "normalization", "norm_epsilon",
                 "vocab_size", "make_vocab_size_divisible_by")
_TRUE_FLAGS = {"group_query_attention": "--group-query-attention", "swiglu": "--swiglu",
               "add_qkv_bias": "--add-qkv-bias", "openai_gelu": "--openai-gelu",
               "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
               "qk_layernorm": "--qk-layernorm", "apply_layernorm_1p": "--apply-layernorm-1p",
               "use_rope_scaling": "--use-rope-scaling"}
_FALSE_FLAGS = {"add_bias_linear": "--disable-bias-linear",
                "add_position_embedding": "--no-position-embedding"}


def write_atomically(path: str, text: str) -> None:
    """Replace `path` with `text` so that a crash leaves the old file or the new one, never a
    mix: write aside, fsync, rename, fsync the directory (which makes the rename durable)."""
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_directory(os.path.dirname(path) or ".")


def fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        text = f.read(64).decode("utf-8", "replace").strip()
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number")
    return int(text)


def read_metadata(root: str, iteration: int) -> dict:
    path = os.path.join(checkpoint_dir(root, iteration), "metadata.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--load {root}: {path} is missing; the checkpoint is incomplete")
    try:
        with open(path) as f:
            metadata = json.load(f)
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"--load {root}: {path} is not readable JSON ({error}); the "
                          "checkpoint is damaged") from None
    if not isinstance(metadata, dict) or not isinstance(metadata.get("config"), dict):
        raise ConfigError(f"--load {root}: {path} is not a threefold checkpoint's metadata "
                          "(no 'config'); convert other checkpoints with "
                          "tools/convert_checkpoint.py")
    return metadata


def checkpoint_tokenizer(root: str, iteration: int, data: DataConfig) -> DataConfig:
    """The run's tokenizer settings pointing at the checkpoint's own copy of the tokenizer."""
    path = checkpoint_dir(root, iteration)
    if data.tokenizer_type == "SentencePieceTokenizer":
        data.tokenizer_model = os.path.join(path, "tokenizer.model")
    elif data.tokenizer_type == "HuggingFaceTokenizer":
        data.tokenizer_model = os.path.join(path, "tokenizer")
    return data


def latest_config(root: str) -> tuple[int, dict]:
    """(iteration, the run's config as stored) of the latest complete checkpoint in `root`."""
    iteration = read_tracker(root) if os.path.isdir(root) else None
    if iteration is None:
        raise ConfigError(f"--load {root}: holds no complete checkpoint")
    return iteration, read_metadata(root, iteration)["config"]


def model_flags(model: dict) -> list[str]:
    """A stored model config as the flags that rebuild that architecture."""
    flags = []
    for name in _VALUE_FIELDS:
        if model.get(name) is not None:
            flags += ["--" + name.replace("_", "-"), str(model[name])]
    flags += [flag for name, flag in _TRUE_FLAGS.items() if model.get(name)]
    flags += [flag for name, flag in _FALSE_FLAGS.items() if not model.get(name, True)]
    return flags


def flags_for_use_checkpoint_args(load: str | None, save: str | None,
                                  with_tokenizer: bool) -> tuple[list[str], str]:
    """(flags, a start-up note) for --use-checkpoint-args. A run whose --load is its own --save
    directory and finds no checkpoint there yet (its first start) keeps its command line."""
    if load is None:
        raise ConfigError("--use-checkpoint-args needs --load DIR (the checkpoint whose model "
                          "flags to use)")
    if load == save and (not os.path.isdir(load) or read_tracker(load) is None):
        return [], f"--use-checkpoint-args: no checkpoint in --load {load} yet; using the " \
                   "command line's model flags"
    flags = checkpoint_flags(load, with_tokenizer)
    return flags, (f"--use-checkpoint-args: model flags from {load} (iteration "
                   f"{read_tracker(load)}): {' '.join(flags)}")


def checkpoint_flags(root: str, with_tokenizer: bool) -> list[str]:
    """The flags --use-checkpoint-args puts before the command line: the model's architecture
    and, when `with_tokenizer`, the checkpoint's tokenizer (its own copy of the model file)."""
    iteration, saved = latest_config(root)
    flags = model_flags(saved["model"])
    if with_tokenizer:
        data = checkpoint_tokenizer(root, iteration, DataConfig(**saved["data"]))
        if data.tokenizer_type:
            flags += ["--tokenizer-type", data.tokenizer_type]
            if data.tokenizer_model:
                flags += ["--tokenizer-model", data.tokenizer_model]
    return flags
