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
    num_microbatches: int,
    pipeline_size: int,
    rank: int,
    virtual_size: int,
    group_size: int | None = None,
    combined: bool = False,
) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: micro-batches in groups of `group_size` (its
    --microbatch-group-size-per-virtual-pipeline-stage; default the pipeline size), each group
    through every model chunk before the next group starts, the last group taking the rest.
    `combined`: the order of `combined_interleaved_steps`."""
    steps = combined_interleaved_steps(
        num_microbatches, pipeline_size, rank, virtual_size, group_size, combined
    )
    return [action for step in steps for action in step]


def combined_interleaved_steps(
    num_microbatches: int,
    pipeline_size: int,
    rank: int,
    virtual_size: int,
    group_size: int | None = None,
    combined: bool = True,
) -> list[list[Action]]:
    """The interleaved order as steps: with `combined` (--overlap-moe-expert-parallel-comm)
    each steady-state forward and the backward after it one combined step, run together
    (combined_1f1b.py), after one more warm-up forward than without, as Megatron-LM
    schedules it. The extra forward makes each step's two actions independent (the last stage
    would otherwise pair a micro-batch's forward with its own backward) and keeps the stages
    from waiting on each other: no combined step needs a forward output that its neighbour
    sends only after a combined step of its own. Every other action is a step of its own."""
    p, v, m = pipeline_size, virtual_size, num_microbatches
    n = group_size or p
    table = []  # (micro-batch, chunk) in the order chunks run forward
    for start in range(0, m, n):
        stop = m if start + n >= m else start + n
        table += [(mb, c) for c in range(v) for mb in range(start, stop)]
    total = len(table)
    forwards = [("F", mb, c) for mb, c in table]
    backwards = [("B", mb, v - 1 - c) for mb, c in table]
    warmup = total if m == p else min((p - rank - 1) * 2 + (v - 1) * n + combined, total)
    steps = [[action] for action in forwards[:warmup]]
    for i in range(total - warmup):
        pair = [forwards[warmup + i], backwards[i]]
        steps += [pair] if combined else [[action] for action in pair]
    return steps + [[action] for action in backwards[total - warmup :]]


def forward_only_order(num_microbatches: int, virtual_size: int) -> list[Action]:
    return [("F", i, c) for i in range(num_microbatches) for c in range(virtual_size)]
