"""A checkpoint directory's plain-text files, read and written without torch.

    DIR/latest_checkpointed_iteration.txt    the tracker: the last complete iteration
    DIR/iter_0000100/metadata.json           the run's config, train state, scheduler, ...
    DIR/release/                             Megatron-LM's release checkpoint: a tracker
                                             that says "release" names it (read only)

Everything here is torch-free, so the command line can be completed from a checkpoint before
torch is imported (checkpoint/args.py).
"""

from __future__ import annotations

import hashlib
import json
import os

from threefold.checkpoint.manifest import complete_iterations, digest
from threefold.config import ConfigError, DataConfig
from threefold.config.data import HF_DIRECTORY, SENTENCEPIECE

TRACKER = "latest_checkpointed_iteration.txt"
# Megatron-LM's tracker word, and directory, for a checkpoint of no iteration: a model
# published or converted (its ModelOpt examples' `save_checkpoint(..., release=True)`). Its
# --load reads it as iteration 0 and as --finetune does: the weights, no optimizer, no RNG.
RELEASE = "release"


def checkpoint_dir(root: str, iteration: int) -> str:
    """Where iteration `iteration` is written; `saved_dir` says where it is read from."""
    return os.path.join(root, f"iter_{iteration:07d}")


def saved_dir(root: str, iteration: int) -> str:
    """Where iteration `iteration` of `root` is read from: its iter_ directory, or for the
    iteration 0 of a tracker that says "release", Megatron-LM's release directory."""
    if iteration == 0 and is_release(root):
        return os.path.join(root, RELEASE)
    return checkpoint_dir(root, iteration)


def _tracked(root: str) -> str | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read(64).decode("utf-8", "replace").strip()


def is_release(root: str | None) -> bool:
    """Whether `root`'s tracker names Megatron-LM's release checkpoint."""
    return bool(root) and os.path.isdir(root) and _tracked(root) == RELEASE


def read_tracker(root: str) -> int | None:
    """The tracker's iteration (0 for a release checkpoint); None without a tracker."""
    text = _tracked(root)
    if text is None:
        return None
    if text == RELEASE:
        return 0
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(
            f"--load {root}: {TRACKER} holds {text!r}, not an iteration number (nor {RELEASE!r})"
        )
    return int(text)


def holds_checkpoint(root: str | None) -> bool:
    """Whether `root` holds a checkpoint to start from: a tracker or a complete iteration."""
    if not root or not os.path.isdir(root):
        return False
    return read_tracker(root) is not None or bool(complete_iterations(root))


def read_metadata(root: str, iteration: int) -> dict:
    """A checkpoint's metadata.json; for a Megatron-LM torch_dist checkpoint, its common.pt
    described the same way (checkpoint/megatron/format.py), for a legacy one its first
    model_optim_rng.pt (checkpoint/megatron/legacy.py)."""
    from threefold.checkpoint.megatron.format import is_megatron_checkpoint, megatron_metadata
    from threefold.checkpoint.megatron.legacy import is_legacy_checkpoint, legacy_metadata

    directory = saved_dir(root, iteration)
    if is_megatron_checkpoint(directory):
        return megatron_metadata(directory)
    if is_legacy_checkpoint(directory):
        return legacy_metadata(directory)
    path = os.path.join(directory, "metadata.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--load {root}: {path} is missing; the checkpoint is incomplete")
    try:
        with open(path) as f:
            metadata = json.load(f)
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"--load {root}: {path} is not readable JSON ({error}); the checkpoint is damaged"
        ) from None
    if not isinstance(metadata, dict) or not isinstance(metadata.get("config"), dict):
        raise ConfigError(
            f"--load {root}: {path} is not a threefold checkpoint's metadata "
            "(no 'config'); convert other checkpoints with "
            "tools/convert_checkpoint.py"
        )
    return metadata


def checkpoint_tokenizer(root: str, iteration: int, data: DataConfig) -> DataConfig:
    """The run's tokenizer settings pointing at the checkpoint's own copy of the tokenizer
    (Megatron-LM's checkpoints have none: their args name the files)."""
    from threefold.checkpoint.megatron.format import is_megatron_checkpoint
    from threefold.checkpoint.megatron.legacy import is_legacy_checkpoint

    path = saved_dir(root, iteration)
    if is_megatron_checkpoint(path) or is_legacy_checkpoint(path):
        return data
    if data.tokenizer_type in SENTENCEPIECE:
        data.tokenizer_model = os.path.join(path, "tokenizer.model")
    elif data.tokenizer_type in HF_DIRECTORY:
        data.tokenizer_model = os.path.join(path, "tokenizer")
    return data


def latest_config(root: str) -> tuple[int, dict]:
    """(iteration, the run's config as stored) of the latest complete checkpoint in `root`."""
    iteration = read_tracker(root) if os.path.isdir(root) else None
    if iteration is None and os.path.isfile(os.path.join(root, "config.json")):
        raise ConfigError(
            f"--load {root}: a Hugging Face model directory, not a threefold checkpoint; convert "
            "it first: python tools/convert_checkpoint.py --loader hf --saver threefold "
            f"--load-dir {root} --save-dir CHECKPOINT_DIR"
        )
    if iteration is None:
        raise ConfigError(f"--load {root}: holds no complete checkpoint")
    return iteration, read_metadata(root, iteration)["config"]


def tokenizer_digest(data: DataConfig) -> str | None:
    """SHA-256 over the files that define the run's tokenizer (None without one): a
    checkpoint refuses to resume with another tokenizer of the same vocabulary size."""
    if data.tokenizer_type in HF_DIRECTORY and data.tokenizer_model:
        files = [
            os.path.join(data.tokenizer_model, name)
            for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")
        ]
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
