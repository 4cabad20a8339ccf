"""Context parallelism on CPU ranks: training tokens/s and activation bytes per rank against
sequence length, for CP = 1, 2, 4 (ring attention by default).

Each CP size runs in one pool of gloo ranks (spawned once), which trains the tiny LLaMA below
at every sequence length: two warm-up steps, then the mean of three timed steps. Activation
bytes are what autograd keeps for backward over one micro-batch on a rank (saved-tensor
hooks, `threefold.training.memory.measure_activation_bytes`), next to the memory estimator's
prediction. The machine's cores are shared by the ranks (threads per rank = cores / CP), so
tokens/s compares the same total compute split differently; memory per rank is the point.

    python bench/context_parallel.py            # writes bench/results/context_parallel.md
    python bench/context_parallel.py --sequences 4096 8192 --cp 1 2 --comm-type a2a
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "8",
    "--group-query-attention",
    "--num-query-groups",
    "4",
    "--ffn-hidden-size",
    "128",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]
RUN = [
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
    "--train-iters",
    "100",
    "--lr",
    "1e-4",
    "--mock-data",
    "--vocab-size",
    "1024",
    "--eval-iters",
    "0",
    "--log-interval",
    "1000",
]
WARMUP, TIMED = 2, 3


def _measure(argv: list[str]) -> dict:
    from threefold.arguments import parse_args
    from threefold.parallel import state
    from threefold.training.activation_estimate import micro_batch_activation_bytes
    from threefold.training.memory import measure_activation_bytes
    from threefold.training.trainer import Trainer

    config = parse_args(argv, world_size=dist.get_world_size())
    trainer = Trainer(config, torch.device("cpu"), state.initialize_layout(config.parallel))
    options = trainer.pipeline_options
    batch = next(trainer.train_iterator())
    kept = measure_activation_bytes(
        trainer.model_chunks, batch, options["tensor_shape"], options["dtype"]
    )
    for _ in range(WARMUP):
        trainer.train_step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(TIMED):
        trainer.train_step()
    seconds = (time.perf_counter() - start) / TIMED
    state.destroy_model_parallel()
    return {
        "seconds": seconds,
        "tokens_per_second": config.model.seq_length * config.training.global_batch_size / seconds,
        "activation_bytes": kept,
        "estimated_bytes": micro_batch_activation_bytes(config, 0),
    }


def _worker(rank: int, world: int, port: int, jobs: list, threads: int, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
    )
    for sequence, argv in jobs:
        measured = _measure(argv)
        if rank == 0:
            results.put((sequence, measured))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cp: int, sequences: list[int], comm_type: str) -> dict[int, dict]:
    jobs = []
    for sequence in sequences:
        argv = MODEL + RUN + ["--seq-length", str(sequence)]
        argv += ["--max-position-embeddings", str(sequence)]
        argv += ["--context-parallel-size", str(cp), "--cp-comm-type", comm_type]
        jobs.append((sequence, argv))
    context = mp.get_context("spawn")
    results = context.Queue()
    threads = max(1, (os.cpu_count() or 1) // cp)
    port = _free_port()
    processes = [
        context.Process(target=_worker, args=(rank, cp, port, jobs, threads, results))
        for rank in range(cp)
    ]
    for process in processes:
        process.start()
    measured = dict(results.get() for _ in jobs)
    for process in processes:
        process.join()
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sequences", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536]
    )
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--comm-type", default="p2p", choices=("p2p", "allgather", "a2a"))
    parser.add_argument("--output", default=os.path.join(ROOT, "bench/results/context_parallel.md"))
    args = parser.parse_args()
    table = {cp: run(cp, args.sequences, args.comm_type) for cp in args.cp}
    mib = 2**20
    lines = [
        "# Context parallelism on CPU ranks",
        "",
        f"`python bench/context_parallel.py --comm-type {args.comm_type}` on "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, {datetime.date.today()}. Tiny LLaMA (2 layers, hidden 64, 8 "
        "heads, 4 query groups, vocabulary 1024), micro-batch 1, fp32, one global batch of "
        f"one sequence per step, mean of {TIMED} steps after {WARMUP} warm-up steps. "
        "Activations: bytes autograd keeps per micro-batch on one rank (measured with "
        "saved-tensor hooks) and the memory estimator's prediction.",
        "",
        "| sequence | CP | tokens/s | s/step | activations per rank (MiB) | estimated (MiB) "
        "| vs CP=1 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for sequence in args.sequences:
        base = table[args.cp[0]][sequence]["activation_bytes"]
        for cp in args.cp:
            row = table[cp][sequence]
            lines.append(
                f"| {sequence} | {cp} | {row['tokens_per_second']:.0f} | {row['seconds']:.2f} "
                f"| {row['activation_bytes'] / mib:.1f} | {row['estimated_bytes'] / mib:.1f} "
                f"| {row['activation_bytes'] / base:.3f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.output, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
