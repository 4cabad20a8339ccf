"""How long a checkpoint save stops training, and how fast it writes.

One process trains a GPT of --num-layers x --hidden-size (fp32, Adam) and saves it --saves
times, synchronously and with --async-save, into --directory, in threefold's format and in
Megatron-LM's (--ckpt-format torch_dist: the same state re-keyed as megatron-core stores it).
Per save:

    blocked   seconds the training loop waited (synchronous: the whole save; async: setting up
              the directory and staging the tensors into CPU memory)
    complete  seconds from the start of the save until its tracker was written
    GB/s      checkpoint bytes / complete
and, for scale, one training step's time and the disk's own speed (the same number of bytes
written with write + fsync, no checkpoint logic).

    python bench/checkpoint_save.py > bench/results/checkpoint_save.md
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import parse_args  # noqa: E402
from threefold.checkpoint.megatron import training_save  # noqa: E402
from threefold.checkpoint.save import save_checkpoint  # noqa: E402
from threefold.checkpoint.writer import CheckpointWriter  # noqa: E402
from threefold.parallel.parallel_context import ParallelContext  # noqa: E402
from threefold.training.trainer import Trainer  # noqa: E402


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def _disk_speed(directory: str, size: int) -> float:
    """GB/s of plain sequential writes with fsync, in 64 MiB blocks."""
    block = os.urandom(64 << 20)
    path = os.path.join(directory, "disk-speed.bin")
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(size // len(block), 1)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    written = os.path.getsize(path)
    os.remove(path)
    return written / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--directory", default="/tmp/threefold-checkpoint-bench")
    args = parser.parse_args()
    shutil.rmtree(args.directory, ignore_errors=True)
    os.makedirs(args.directory)
    argv = [
        "--num-layers",
        str(args.num_layers),
        "--hidden-size",
        str(args.hidden_size),
        "--num-attention-heads",
        str(args.hidden_size // 64),
        "--seq-length",
        "256",
        "--max-position-embeddings",
        "256",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--mock-data",
        "--vocab-size",
        "32000",
        "--train-iters",
        "1000",
        "--eval-iters",
        "0",
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--disable-bias-linear",
    ]
    rows, totals = [], []
    steps = []
    formats, modes = ("threefold", "torch_dist"), ("synchronous", "async")
    for ckpt_format, mode in itertools.product(formats, modes):
        root = os.path.join(args.directory, f"{ckpt_format}-{mode}")
        flags = ["--save", root, "--ckpt-format", ckpt_format]
        config = parse_args(argv + flags + (["--async-save"] if mode == "async" else []))
        save = save_checkpoint
        if ckpt_format == "torch_dist":
            save = training_save.save_megatron_training_checkpoint
        with contextlib.redirect_stdout(sys.stderr):  # start-up lines: not part of the table
            trainer = Trainer(config, torch.device("cpu"), ParallelContext())
        writer = CheckpointWriter(root, asynchronous=mode == "async")
        blocked, complete, sizes = [], [], []
        for _ in range(args.saves):
            start = time.perf_counter()
            trainer.train_step()
            steps.append(time.perf_counter() - start)
            start = time.perf_counter()
            path = save(root, trainer.checkpoint_components(), writer)
            blocked.append(time.perf_counter() - start)
            writer.wait()
            complete.append(time.perf_counter() - start)
            sizes.append(_bytes(path))
        writer.close()
        size = statistics.median(sizes)
        rows.append(
            f"| {ckpt_format} | {mode} | {size / 1e9:.2f} | {statistics.median(blocked):.2f} | "
            f"{statistics.median(complete):.2f} | "
            f"{size / statistics.median(complete) / 1e9:.2f} |"
        )
        totals.append(size)
        shutil.rmtree(root)
    disk = _disk_speed(args.directory, int(statistics.median(totals)))
    shutil.rmtree(args.directory, ignore_errors=True)
    print(
        "\n".join(
            [
                f"# python bench/checkpoint_save.py {' '.join(sys.argv[1:])}".rstrip(),
                "",
                f"Checkpoint saves of a {args.num_layers}-layer, hidden-{args.hidden_size} GPT "
                f"(fp32 weights and Adam state), median of {args.saves} saves each, on "
                f"{os.cpu_count()} CPU cores; one training step takes "
                f"{statistics.median(steps):.2f} s; the disk writes {disk:.2f} GB/s (plain "
                "write + fsync).",
                "",
                "| format | save | GB | blocked s | complete s | GB/s |",
                "|---|---|---|---|---|---|",
                *rows,
            ]
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
