"""`--distributed-strategy auto`: pick the data-parallel strategy from size and memory.

The rule of thumb (model parameters N): N < 1B → PyTorch DDP (every rank holds everything, the
least communication); 1B ≤ N ≤ 7B → threefold's data parallelism with the distributed optimizer
(ZeRO-1/2: optimizer state sharded); N > 7B → FSDP (ZeRO-3: parameters sharded too). With tensor
or pipeline parallelism only threefold's own data parallelism applies, with the distributed
optimizer from 1B up; with experts, threefold's data parallelism in DDP's place. The choice is
then refined by the memory estimate: while the estimated per-device memory exceeds 90% of the
device's, the next more-sharded strategy is taken.

When even the most sharded choice does not fit, the explanation says which
--context-parallel-size would make it fit, if one would: at long sequences the activations,
which no data-parallel strategy shards, dominate, and context parallelism divides them.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from threefold.config import Config
from threefold.training.memory_estimate import estimate_memory, parameter_count

# (strategy, distributed optimizer), least to most sharded.
_LADDER = [("ddp", False), ("megatron", True), ("fsdp", False)]
# With experts DDP is out (it would average each expert's gradients with other experts'):
# threefold's own data parallelism holds everything instead.
_MOE_LADDER = [("megatron", False), ("megatron", True), ("fsdp", False)]
_MODEL_PARALLEL_LADDER = [("megatron", False), ("megatron", True)]
_USABLE_FRACTION = 0.9


def device_memory_bytes(device: torch.device) -> int:
    """The memory one rank may use: the GPU's, or the host's shared by the local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def choose_strategy(config: Config, device_memory: int) -> tuple[str, bool, str]:
    """(strategy, use the distributed optimizer, why) for a config whose strategy is auto."""
    parallel = config.parallel
    count = parameter_count(config.model, config.model.padded_vocab_size(1))
    size = f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"
    # (under --overlap-moe-expert-parallel-comm FSDP2 keeps every parameter gathered through
    # the step, which gives up what it would be chosen for)
    if parallel.model_parallel_size > 1 or parallel.overlap_moe_expert_parallel_comm:
        ladder = _MODEL_PARALLEL_LADDER
        index = int(count >= 1e9)
        rule = (
            f"{size} parameters with "
            + (
                "tensor/pipeline parallelism"
                if parallel.model_parallel_size > 1
                else "--overlap-moe-expert-parallel-comm"
            )
            + ": threefold's "
            "data parallelism" + (", distributed optimizer from 1B" if index else "")
        )
    else:
        ladder = _MOE_LADDER if config.model.is_moe else _LADDER
        index = 0 if count < 1e9 else 1 if count <= 7e9 else 2
        rule = f"{size} parameters " + (
            "< 1B" if index == 0 else "in 1B-7B" if index == 1 else "> 7B"
        )
    budget = _USABLE_FRACTION * device_memory

    def need(choice: tuple[str, bool]) -> float:
        strategy, distributed = choice
        return estimate_memory(
            config, strategy=strategy, use_distributed_optimizer=distributed
        ).total

    start = index
    while index + 1 < len(ladder) and need(ladder[index]) > budget:
        index += 1
    strategy, distributed = ladder[index]
    name = strategy + (" with the distributed optimizer" if distributed else "")
    why = (
        rule
        if index == start
        else (f"{rule}, but {ladder[start][0]} would need {need(ladder[start]) / 2**30:.1f} GiB")
    )
    fits = "" if need(ladder[index]) <= budget else ", which may still not fit"
    if fits:
        fits += _context_parallel_hint(config, ladder[index], budget)
    return (
        strategy,
        distributed,
        (
            f"{why}; estimated {need(ladder[index]) / 2**30:.1f} GiB of "
            f"{device_memory / 2**30:.1f} GiB per device{fits}"
        ).replace("; ", f" -> {name}; ", 1),
    )


def _context_parallel_hint(config: Config, choice: tuple[str, bool], budget: float) -> str:
    """The smallest context-parallel size (of the ranks now data-parallel) that would fit."""
    parallel, strategy, distributed = config.parallel, *choice
    cp = parallel.context_parallel_size * 2
    while parallel.world_size % (parallel.model_parallel_size * cp) == 0:
        if config.model.seq_length % (2 * cp):
            break
        layout = dataclasses.replace(parallel, context_parallel_size=cp)
        candidate = dataclasses.replace(config, parallel=layout)
        need = estimate_memory(candidate, strategy, distributed).total
        if need <= budget:
            return (
                f"; --context-parallel-size {cp} would need {need / 2**30:.1f} GiB "
                f"(the {config.model.seq_length}-token sequence split over {cp} ranks)"
            )
        cp *= 2
    return ""


def resolve_auto_strategy(config: Config, device: torch.device) -> str:
    """Replace `auto` in the config by the chosen strategy; returns the one-line explanation."""
    strategy, distributed, why = choose_strategy(config, device_memory_bytes(device))
    config.parallel.distributed_strategy = strategy
    config.parallel.use_distributed_optimizer = distributed
    return f"distributed strategy auto: {why}"
