"""The communication terms of the step-time model (threefold/training/step_time.py) against
measured collectives: the ring cost latency + (n-1)/n x bytes / bandwidth for an all-gather
(2 (n-1)/n for an all-reduce), fitted at 2 ranks and predicted at more.

    python bench/collectives.py > bench/results/collectives.md
    python bench/collectives.py --backend nccl --ranks 2 4 8   # on a GPU node

Each point is the median of `--repeats` timed calls after a warm-up, on the given backend
(gloo CPU processes by default). The bandwidth and latency are fitted by least squares on the
first rank count; the other counts are predicted from that fit, as the planner would.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_factor(operation: str, ranks: int) -> float:
    """Bytes each rank moves per byte of the whole tensor, in the ring algorithm."""
    return (2 if operation == "all_reduce" else 1) * (ranks - 1) / ranks


def _worker(rank, ranks, port, backend, sizes, repeats, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=ranks)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    for size in sizes:
        whole = torch.ones(size // 4, device=device)
        shard = torch.ones(size // 4 // ranks, device=device)
        gathered = torch.empty(shard.numel() * ranks, device=device)
        calls = {
            "all_reduce": lambda whole=whole: dist.all_reduce(whole),
            "all_gather": lambda g=gathered, s=shard: dist.all_gather_into_tensor(g, s),
        }
        for name, call in calls.items():
            times = []
            for index in range(repeats + 2):
                dist.barrier()
                if backend == "nccl":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                if backend == "nccl":
                    torch.cuda.synchronize()
                if index >= 2:
                    times.append(time.perf_counter() - start)
            if rank == 0:
                results[(name, ranks, size)] = statistics.median(times)
    dist.destroy_process_group()


def measure(backend: str, ranks: int, sizes: list[int], repeats: int) -> dict:
    results = mp.Manager().dict()
    mp.spawn(
        _worker,
        args=(ranks, _free_port(), backend, sizes, repeats, results),
        nprocs=ranks,
        join=True,
    )
    return dict(results)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of time = latency + moved / bandwidth, least squares."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points
    )
    return max(0.0, mean_y - slope * mean_x), 1 / slope


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    sizes = [mb * MB for mb in args.sizes_mb]
    measured = {}
    for ranks in args.ranks:
        measured.update(measure(args.backend, ranks, sizes, args.repeats))
    base = args.ranks[0]
    device = (
        torch.cuda.get_device_name() if args.backend == "nccl" else f"{os.cpu_count()} CPU cores"
    )
    print("# Collectives: the ring cost model against measurements\n")
    command = ["bench/collectives.py", *(sys.argv[1:] if argv is None else argv)]
    print(f"`python {' '.join(command)}`\n")
    print(f"Backend {args.backend} on {device}; torch {torch.__version__}; fit at {base} ranks.\n")
    errors = []
    for name in ("all_reduce", "all_gather"):
        print("| collective | ranks | MB | measured ms | predicted ms | error | bus GB/s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        points = [(ring_factor(name, base) * size, measured[(name, base, size)]) for size in sizes]
        latency, bandwidth = fit(points)
        for ranks in args.ranks:
            for size in sizes:
                seconds = measured[(name, ranks, size)]
                predicted = latency + ring_factor(name, ranks) * size / bandwidth
                error = predicted / seconds - 1
                if ranks != base:
                    errors.append(error)
                bus = ring_factor(name, ranks) * size / seconds / 1e9
                print(
                    f"| {name} | {ranks} | {size // MB} | {seconds * 1e3:.2f} | "
                    f"{predicted * 1e3:.2f} | {error:+.1%} | {bus:.2f} |"
                )
        print(
            f"\n{name}: fitted latency {latency * 1e6:.0f} us, bus bandwidth "
            f"{bandwidth / 1e9:.2f} GB/s at {base} ranks.\n"
        )
    if errors:
        mean = sum(abs(e) for e in errors) / len(errors)
        print(f"Predicted rank counts: mean absolute error {mean:.1%}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
