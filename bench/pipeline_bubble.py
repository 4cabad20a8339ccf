"""Measured pipeline bubble of threefold's schedules next to the theory.

Runs the real schedule executor and point-to-point code on P gloo ranks, with model chunks
whose forward takes t_f / V and backward 2 t_f / V (sleeps), so the timeline reflects the
schedule rather than the CPU. Bubble fraction = idle time / compute time of a rank over the
whole step (first start to last end), averaged over ranks; the theory is (P - 1) / m for
1F1B and (P - 1) / (V m) for interleaved 1F1B.

    python bench/pipeline_bubble.py                       # writes bench/results/pipeline_bubble.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.parallel import state  # noqa: E402
from threefold.parallel.pipeline_parallel.schedules import (  # noqa: E402
    ScheduleTrace,
    forward_backward_pipelining,
)

HIDDEN = 8


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, grad.sum().reshape(1), None, None


class SleepChunk(torch.nn.Module):
    def __init__(self, pre_process: bool, post_process: bool, forward_s: float):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.forward_s = forward_s
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, batch, hidden_states):
        x = batch if self.pre_process else hidden_states
        return _Sleep.apply(x, self.weight, self.forward_s, 2 * self.forward_s)


def _forward_step(batch, model, input_tensor):
    output = model(batch, input_tensor)
    return output, lambda out: (out.mean(), out.mean().detach())


def _worker(rank, world, port, configs, forward_ms, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=2)
    )
    state.initialize_model_parallel(1, world)
    for micro_batches, virtual in configs:
        chunks = [
            SleepChunk(
                rank == 0 and v == 0,
                rank == world - 1 and v == virtual - 1,
                forward_ms / 1e3 / virtual,
            )
            for v in range(virtual)
        ]
        batches = iter([torch.ones(1, 1, HIDDEN) for _ in range(micro_batches)])
        trace = ScheduleTrace()
        dist.barrier()
        start = time.perf_counter()
        forward_backward_pipelining(
            _forward_step,
            batches,
            chunks,
            micro_batches,
            pp=state.parallel_context().pp,
            tensor_shape=(1, 1, HIDDEN),
            dtype=torch.float32,
            trace=trace,
        )
        end = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
        busy = sum(e - b for what, _, _, b, e in trace.events if what in ("F", "B"))
        results.put((micro_batches, virtual, rank, start, end, busy))
    state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--virtual-stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument(
        "--output", default=os.path.join(os.path.dirname(__file__), "results", "pipeline_bubble.md")
    )
    args = parser.parse_args()
    rows = []
    for pipeline_size in args.pipeline_sizes:
        configs = [
            (m, v)
            for v in args.virtual_stages
            for m in args.micro_batches
            if v == 1 or m % pipeline_size == 0
        ]
        context = mp.get_context("spawn")
        results = context.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        processes = [
            context.Process(
                target=_worker, args=(r, pipeline_size, port, configs, args.forward_ms, results)
            )
            for r in range(pipeline_size)
        ]
        for process in processes:
            process.start()
        measured: dict = {}
        for _ in range(len(configs) * pipeline_size):
            m, v, _rank, start, end, busy = results.get(timeout=600)
            measured.setdefault((m, v), []).append((start, end, busy))
        for process in processes:
            process.join()
        for m, v in configs:
            # The step lasts from the common start to the last rank's end; every rank is idle
            # for that span minus its own compute.
            ranks = measured[(m, v)]
            span = max(e for _, e, _ in ranks) - min(s for s, _, _ in ranks)
            bubble = sum((span - busy) / busy for _, _, busy in ranks) / pipeline_size
            theory = (pipeline_size - 1) / (v * m)
            rows.append((pipeline_size, v, m, theory, bubble))
    lines = [
        "| P | V | micro-batches | theory (P-1)/(V m) | measured |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {p} | {v} | {m} | {t:.3f} | {b:.3f} |" for p, v, m, t, b in rows]
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(
            f"# Pipeline bubble, threefold schedules on gloo (CPU)\n\nforward {args.forward_ms}"
            f" ms, backward 2x, per micro-batch and stage; command: `python "
            f"bench/pipeline_bubble.py`\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
