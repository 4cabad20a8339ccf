"""The vocabulary a run takes from a Megatron-LM checkpoint it resumes or starts from.

Megatron-LM's checkpoints keep the padded vocabulary only: the embedding and output layer
have `args.padded_vocab_size` rows, the tokenizer's vocabulary rounded up to a multiple of
--make-vocab-size-divisible-by x TP, and its cross-entropy runs over every one of them (it
masks no padding row). A run on the same command line (the same tokenizer or --vocab-size)
has the unpadded vocabulary. When that, padded as Megatron-LM padded it at the checkpoint's
TP, is the checkpoint's row count, the run's model takes all of the checkpoint's rows as its
vocabulary, so its loss is the one Megatron-LM's run computes, at any layout (threefold masks
only the rows its own padding adds). Any other difference is the architecture check's to
refuse (threefold/checkpoint/loadable.py). A threefold checkpoint of such a run holds the
same rows, and is taken alike.
"""

from __future__ import annotations

import math
import os

from threefold.checkpoint.files import read_metadata, read_tracker
from threefold.config import ConfigError


def checkpoint_vocabulary(load: str | None, vocab_size: int) -> tuple[int, str | None]:
    """(the model's vocabulary size for a run whose tokenizer has `vocab_size` ids and which
    loads `load`, a note saying why when it is the checkpoint's padded one)."""
    if not load or not os.path.isdir(load):
        return vocab_size, None
    iteration = read_tracker(load)
    if iteration is None:
        return vocab_size, None
    # (threefold's own checkpoints too: a run that took a Megatron-LM checkpoint's rows saves
    # them, and resumes on the same command line)
    try:
        metadata = read_metadata(load, iteration)
    except (ConfigError, OSError, ValueError):  # damaged: the load's checks decide (and fall back)
        return vocab_size, None
    model, parallel = metadata["config"]["model"], metadata["config"]["parallel"]
    rows = model.get("vocab_size")
    multiple = model.get("make_vocab_size_divisible_by", 128) * parallel.get(
        "tensor_model_parallel_size", 1
    )
    if rows == vocab_size or rows != math.ceil(vocab_size / multiple) * multiple:
        return vocab_size, None
    return rows, (
        f"> --load {load}: the model's vocabulary is the checkpoint's {rows} rows (this run's "
        f"{vocab_size} padded to a multiple of {multiple}, as Megatron-LM padded it); each "
        "takes part in the loss, as in Megatron-LM"
    )
