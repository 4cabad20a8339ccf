"""The order of actions each pipeline schedule runs on a rank: F(micro-batch, chunk) and
B(micro-batch, chunk); the schedules (schedules.py, whose docstring draws them) run these orders,
and the memory estimator walks the same ones to count the activations a stage holds. No torch
here, so the planning tools (estimate_memory.py, plan_layout.py) answer without importing it.
"""

from __future__ import annotations

Action = tuple[str, int, int]  # ("F" or "B", micro-batch, model chunk)


def one_f_one_b_order(num_microbatches: int, pipeline_size: int, rank: int) -> list[Action]:
    warmup = min(pipeline_size - rank - 1, num_microbatches)
    order = [("F", i, 0) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i, 0), ("B", i, 0)]
    order += [("B", i, 0) for i in range(num_microbatches - warmup, num_microbatches)]
    return order


def interleaved_order(
    num_microbatches: int, pipeline_size: int, rank: int, virtual_size: int
) -> list[Action]:
    p, v = pipeline_size, virtual_size
    total = num_microbatches * v

    def micro_batch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    forwards = [("F", micro_batch(k), (k // p) % v) for k in range(total)]
    backwards = [("B", micro_batch(k), v - 1 - (k // p) % v) for k in range(total)]
    warmup = total if num_microbatches == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[total - warmup :]


def forward_only_order(num_microbatches: int, virtual_size: int) -> list[Action]:
    return [("F", i, c) for i in range(num_microbatches) for c in range(virtual_size)]
