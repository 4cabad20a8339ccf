"""Loading a checkpoint into another layout: the checkpoint's index read once, or per parameter.

    python bench/checkpoint_load.py > bench/results/checkpoint_load.md

A resharded load (checkpoint/resharding.py, also `load_model` of the tools) reads one
parameter at a time through torch.distributed.checkpoint. Each `dcp.load` asks its reader for
the checkpoint's index (`.metadata`, an unpickled table of every tensor chunk); a fresh reader
per parameter reads and unpickles it again each time, so the load grows as parameters x index
size. threefold's reader keeps the index it read. This script saves a GPT model of a few
depths (with Adam state, so the index is the full one a training run writes) and times
`load_model` both ways, side by side, in one run.
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.safe_loading import SafeFileSystemReader  # noqa: E402

DEPTHS = (12, 48)


class _RereadingReader(SafeFileSystemReader):
    """The reader as it was: the index read and unpickled on every call."""

    def read_metadata(self, *args, **kwargs):
        self.__dict__.pop("_threefold_metadata", None)
        return super().read_metadata(*args, **kwargs)


def _saved_checkpoint(layers: int, directory: str) -> int:
    from tests.parity import _setup
    from threefold.checkpoint.save import save_checkpoint

    argv = [
        "--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4",
        "--ffn-hidden-size", "128", "--seq-length", "16", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "1", "--mock-data", "--vocab-size", "256",
        "--lr", "1e-3",
    ]  # fmt: skip
    trainer = _setup(argv)
    trainer.train_step()
    save_checkpoint(directory, trainer.checkpoint_components())
    return sum(1 for _ in trainer.layout_independent_parameters())


def _timed_load(directory: str, reader: type) -> float:
    from threefold.checkpoint import resharding
    from threefold.checkpoint.load import load_model

    saved = resharding.SafeFileSystemReader
    resharding.SafeFileSystemReader = reader
    try:
        start = time.perf_counter()
        load_model(directory, with_tokenizer=False)
        return time.perf_counter() - start
    finally:
        resharding.SafeFileSystemReader = saved


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    print("# Resharded checkpoint load: the index read once vs per parameter\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}. "
        "GPT model, hidden 64, FFN 128, vocabulary 256, saved after one step (weights and "
        "Adam state); `load_model` (the resharding path), best of 3, both readers alternating.\n"
    )
    print("| layers | parameters | index size | index read per parameter | read once | speed-up |")
    print("|---|---|---|---|---|---|")
    for layers in DEPTHS:
        with tempfile.TemporaryDirectory() as directory:
            with contextlib.redirect_stdout(io.StringIO()):  # the trainer's start-up lines
                count = _saved_checkpoint(layers, directory)
            index = os.path.getsize(os.path.join(directory, "iter_0000001", ".metadata"))
            times = {_RereadingReader: [], SafeFileSystemReader: []}
            for _ in range(3):
                for reader in times:
                    times[reader].append(_timed_load(directory, reader))
            before, after = min(times[_RereadingReader]), min(times[SafeFileSystemReader])
            print(
                f"| {layers} | {count} | {index / 1e3:.0f} kB | {before:.2f} s | {after:.2f} s "
                f"| {before / after:.0f}x |"
            )
    print(
        "\nReading: the index grows with the parameters (with Adam state, four entries each), "
        "so reading it per parameter grows with their square; read once, the load is the "
        "tensors' reading alone. Megatron-LM checkpoints go through the same reader "
        "(checkpoint/megatron/tensors.py)."
    )


if __name__ == "__main__":
    main()
