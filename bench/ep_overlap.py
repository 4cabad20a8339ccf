"""The expert all-to-all overlap on CPU gloo ranks: step time and the time each step spends
waiting on its expert-parallel exchanges, without and with --overlap-moe-expert-parallel-comm
(and --delay-wgrad-compute), measured side by side in one pool of ranks.

    python bench/ep_overlap.py > bench/results/ep_overlap.md

A Mixtral-style MoE (the one bench/moe_throughput.py trains) over EP ranks with the alltoall
dispatcher, four micro-batches per step. The variants take turns, round after round, on the
same ranks. "Exchange wait" is the time a rank's step spends blocked in the exchanges of
tokens and their gradients: the whole synchronous all-to-all without the overlap, only the
wait for data that has not arrived with it. This machine is no GPU cluster: the ranks share
its cores, gloo's transfers take those cores too, and an exchange waits mostly on the other
rank reaching it. The numbers say what the overlap costs and hides here, not on NVLink.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_throughput import trainer_flags  # noqa: E402

VARIANTS = {
    "plain": [],
    "overlap": ["--overlap-moe-expert-parallel-comm"],
    "overlap + delayed weight gradients": [
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
    ],
}


def _timed_exchanges(waits: list[float]) -> None:
    """Each exchange's blocking time into `waits`: the synchronous all-to-all whole, the
    asynchronous one's wait."""
    from threefold.parallel.expert_parallel import dispatcher

    exchange = dispatcher._all_to_all

    def timed(x, send, recv, ep, async_op=False):
        if not async_op:
            start = time.perf_counter()
            out = exchange(x, send, recv, ep)
            waits.append(time.perf_counter() - start)
            return out
        out, work = exchange(x, send, recv, ep, True)

        class Work:
            def wait(self):
                start = time.perf_counter()
                work.wait()
                waits.append(time.perf_counter() - start)

        return out, Work()

    dispatcher._all_to_all = timed


def _worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(0, 1800)
    )
    from threefold.arguments import parse_args
    from threefold.parallel import state
    from threefold.training.trainer import Trainer

    sys.stdout = io.StringIO()  # (the trainers' start-up lines)
    waits: list[float] = []
    _timed_exchanges(waits)
    base = trainer_flags(args.batch, args.seq, grouped=False)
    base += ["--global-batch-size", str(args.batch * args.micro_batches * world)]
    base += ["--expert-model-parallel-size", str(world)]
    trainers = {}
    for name, flags in VARIANTS.items():
        config = parse_args(base + flags, world_size=world)
        trainers[name] = Trainer(
            config, torch.device("cpu"), state.initialize_layout(config.parallel)
        )
        for _ in range(args.warmup):
            trainers[name].train_step()
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            dist.barrier()
            waits.clear()
            start = time.perf_counter()
            for _ in range(args.iterations):
                trainer.train_step()
            seconds = (time.perf_counter() - start) / args.iterations
            waited = sum(waits) / args.iterations
            loss = trainer.train_step()[0]  # (untimed: the variants train alike)
            results.put((rank, name, seconds, waited, loss))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_worker, args=(rank, args.ranks, port, args, results))
        for rank in range(args.ranks)
    ]
    for process in processes:
        process.start()
    rows = [results.get() for _ in range(args.ranks * args.rounds * len(VARIANTS))]
    for process in processes:
        process.join()
    # per variant and round: the slowest rank's step (the step's time), its mean wait
    per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for name in VARIANTS:
        mine = [row for row in rows if row[1] == name]
        by_rank = {r: [row for row in mine if row[0] == r] for r in range(args.ranks)}
        for index in range(args.rounds):
            step = max(by_rank[r][index][2] for r in range(args.ranks))
            wait = statistics.mean(by_rank[r][index][3] for r in range(args.ranks))
            per_round[name].append((step, wait))
    losses = {name: [row[4] for row in rows if row[1] == name][-1] for name in VARIANTS}
    plain = statistics.median(step for step, _ in per_round["plain"])
    print(f"# Expert all-to-all overlap on CPU gloo ranks (EP{args.ranks})\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.ranks} gloo ranks of {max(1, (os.cpu_count() or 1) // args.ranks)} thread(s). "
        f"Model: bench/moe_throughput.py's Mixtral-style MoE, fp32, alltoall dispatcher, "
        f"{args.micro_batches} micro-batches of {args.batch} x {args.seq} tokens per rank per "
        f"step. {args.rounds} interleaved rounds of {args.iterations} steps after "
        f"{args.warmup} warm-up steps; median over rounds (step: the slowest rank's; wait: "
        "the ranks' mean).\n"
    )
    print("| variant | step (ms) | vs plain | exchange wait per step (ms) | loss after |")
    print("|---|---|---|---|---|")
    for name in VARIANTS:
        step = statistics.median(step for step, _ in per_round[name])
        wait = statistics.median(wait for _, wait in per_round[name])
        print(
            f"| {name} | {step * 1e3:.1f} | {step / plain:.2f} | {wait * 1e3:.1f} | "
            f"{losses[name]:.6f} |"
        )
    print("\nRe-run: `python bench/ep_overlap.py > bench/results/ep_overlap.md`.")


if __name__ == "__main__":
    main()
