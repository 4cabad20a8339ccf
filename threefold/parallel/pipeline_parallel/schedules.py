"""Forward/backward schedules over the micro-batches of one global batch.

A forward step is `forward_step(batch, model, input_tensor) -> (output, loss_func)`, and
`loss_func(output) -> (loss, reported)` gives the micro-batch's loss and the detached value
to report, as in Megatron-LM. Every schedule returns the reported losses (on the last pipeline
stage; other stages return an empty list). It divides each loss by the number of micro-batches,
so the accumulated gradient is the mean over the global batch, unless `per_token_loss`: then
the loss is a sum over tokens, and the caller divides the gradients by the global batch's token
count once it is known (Megatron's --calculate-per-token-loss).

Pipeline schedules are written as an *order of actions* per rank, F(micro-batch, chunk) and
B(micro-batch, chunk), run by one executor (`run_actions`) in steps of one action, or of a
forward and a backward run together under --overlap-moe-expert-parallel-comm (order.py's
`combined_interleaved_steps`):

    1F1B (PipeDream-flush), P stages, stage r, m micro-batches:
      warm-up: F for min(P - r - 1, m) micro-batches; steady: F(i + warm-up), B(i) pairs;
      cool-down: the remaining B. Stage r never holds more than P - r activations.

    stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 ...        (P = 4)
    stage 3:          F0 B0 F1 B1 F2 B2 ...

    Interleaved 1F1B, V model chunks per rank: forward k runs chunk (k // P) % V on micro-batch
    (k // (P V)) P + k % P; backward k runs the chunks in reverse; warm-up is
    (P - r - 1) * 2 + (V - 1) * P forwards (all of them when m == P). Needs m % P == 0.

The executor receives an input only when the action needs it and sends without waiting, so
it cannot deadlock on an order in which every action's inputs are produced earlier.

`timers` (threefold/training/timers.py) times the level-2 phases under Megatron's names:
batch-generator, forward-compute, backward-compute, forward/backward-recv/send.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from threefold.parallel.parallel_context import Group
from threefold.parallel.pipeline_parallel.combined_1f1b import run_together
from threefold.parallel.pipeline_parallel.order import (
    Action,
    combined_interleaved_steps,
    forward_only_order,
    one_f_one_b_order,
)
from threefold.parallel.pipeline_parallel.p2p import P2P

ForwardStep = Callable[..., tuple[torch.Tensor, Callable]]
# training/timers.Timers: timers(name, level) is a context manager timing its block.
TimerFactory = Callable[[str, int], contextlib.AbstractContextManager]
_TIMER_NAMES = {
    "F": "forward-compute",
    "B": "backward-compute",
    "recv-forward": "forward-recv",
    "send-forward": "forward-send",
    "recv-backward": "backward-recv",
    "send-backward": "backward-send",
}


@dataclass
class ScheduleTrace:
    """Per-rank record of one schedule: (what, micro-batch, chunk, start, end) per event, where
    `what` is F, B, recv-forward, recv-backward (time spent waiting for the data),
    send-forward or send-backward (time to post the asynchronous send); and the most
    micro-batches' activations held at once."""

    events: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    max_activations_in_flight: int = 0


def forward_backward_no_pipelining(
    forward_step: ForwardStep,
    data_iterator: Iterator[dict],
    model_chunks: list,
    num_microbatches: int,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    no_sync_func: Callable | None = None,
    per_token_loss: bool = False,
    timers: TimerFactory | None = None,
    **_unused,
) -> list[torch.Tensor]:
    """`no_sync_func` (PyTorch DDP/FSDP): a context that holds back gradient reduction, entered
    for every micro-batch but the last, as Megatron's `config.no_sync_func`."""
    (model,) = model_chunks
    divisor = 1 if per_token_loss else num_microbatches
    reported = []
    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        with (
            no_sync_func()
            if no_sync_func and not last and not forward_only
            else contextlib.nullcontext()
        ):
            with _timed(timers, "batch-generator"):
                batch = next(data_iterator)
            with _timed(timers, "forward-compute"):
                output, loss_func = forward_step(batch, model, None)
                loss, value = loss_func(output)
            if not forward_only:
                with _timed(timers, "backward-compute"):
                    (loss * (loss_scale / divisor)).backward()
        reported.append(value)
    return reported


def forward_backward_combined(
    forward_step: ForwardStep,
    data_iterator: Iterator[dict],
    model_chunks: list,
    num_microbatches: int,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    no_sync_func: Callable | None = None,
    per_token_loss: bool = False,
    timers: TimerFactory | None = None,
    delay_wgrad_compute: bool = False,
    gathered_func: Callable | None = None,
    **_unused,
) -> list[torch.Tensor]:
    """--overlap-moe-expert-parallel-comm without pipeline stages (Megatron-LM's
    combined_1f1b_schedule_for_no_pipelining): the first micro-batch's forward alone, then the
    forward of each next one together with the backward of the one before (combined_1f1b.py),
    and the last backward alone, outside `no_sync_func`. A combined step is timed as
    forward-compute, as Megatron-LM times it. `delay_wgrad_compute`: the combined steps'
    weight gradients wait for their exchanges (tensor_parallel/delayed_wgrad.py).
    `gathered_func` (FSDP2): a context that keeps the parameters gathered through it, which
    the two passes of a combined step read at once."""
    if forward_only:
        return forward_backward_no_pipelining(
            forward_step, data_iterator, model_chunks, num_microbatches, True, timers=timers
        )
    (model,) = model_chunks
    factor = loss_scale / (1 if per_token_loss else num_microbatches)
    reported = []

    def forward() -> torch.Tensor:
        with _timed(timers, "batch-generator"):
            batch = next(data_iterator)
        output, loss_func = forward_step(batch, model, None)
        loss, value = loss_func(output)
        reported.append(value)
        return loss * factor

    with gathered_func() if gathered_func else contextlib.nullcontext():
        with no_sync_func() if no_sync_func else contextlib.nullcontext():
            with _timed(timers, "forward-compute"):
                loss = forward()
            for _ in range(num_microbatches - 1):
                with _timed(timers, "forward-compute"):
                    loss, _ = run_together(forward, loss.backward, delay_wgrad_compute)
        with _timed(timers, "backward-compute"):
            loss.backward()
    return reported


def _timed(timers: TimerFactory | None, name: str) -> contextlib.AbstractContextManager:
    return timers(name, 2) if timers is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _recorded(
    trace: ScheduleTrace | None,
    timers: TimerFactory | None,
    what: str,
    micro_batch: int,
    chunk: int,
):
    start = time.perf_counter()
    with _timed(timers, _TIMER_NAMES[what]):
        yield
    if trace is not None:
        trace.events.append((what, micro_batch, chunk, start, time.perf_counter()))


def run_actions(
    steps: list[list[Action]],
    forward_step: ForwardStep,
    batches: list[dict],
    model_chunks: list,
    pp: Group,
    tensor_shape: tuple[int, ...],
    dtype: torch.dtype,
    forward_only: bool,
    loss_scale: float,
    trace: ScheduleTrace | None = None,
    per_token_loss: bool = False,
    timers: TimerFactory | None = None,
    no_sync_func: Callable | None = None,
    delay_wgrad_compute: bool = False,
) -> list[torch.Tensor]:
    """Each step is one action, or a forward and a backward run together
    (--overlap-moe-expert-parallel-comm, combined_1f1b.py): both inputs received, the two
    passes run taking turns (`delay_wgrad_compute`: see forward_backward_combined), both
    outputs sent.

    `no_sync_func` (PyTorch DDP/FSDP2 around the stage; a list of one per model chunk under
    virtual stages, as Megatron's): gradient reduction held back for every step but the one
    of a chunk's last backward, which reduces what all micro-batches accumulated (FSDP2;
    DDP, which cannot have several forwards in flight, reduces nothing here and the
    data-parallel wrapper reduces after the schedule)."""
    device = next(model_chunks[0].parameters()).device
    p2p = P2P(pp, tensor_shape, dtype, device)
    divisor = 1 if per_token_loss else len(batches)
    held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    reported = []
    syncs = no_sync_func if isinstance(no_sync_func, list) else [no_sync_func] * len(model_chunks)
    last_backward = {}  # chunk -> the step of its last backward
    for index, step in enumerate(steps if not forward_only else ()):
        last_backward.update({chunk: index for kind, _, chunk in step if kind == "B"})

    def held_back(index: int) -> contextlib.ExitStack:
        """Reduction held back for every chunk whose last backward is not in this step."""
        stack = contextlib.ExitStack()
        for chunk, sync in enumerate(syncs):
            if sync is not None and last_backward.get(chunk) != index:
                stack.enter_context(sync())
        return stack

    def stage_of(chunk: int) -> nn.Module:
        # (PyTorch DDP keeps the stage as `.module`; FSDP2 wraps it in place)
        return getattr(model_chunks[chunk], "module", model_chunks[chunk])

    def receive(kind: str, micro_batch: int, chunk: int) -> torch.Tensor | None:
        """The action's input from a neighbouring stage, if it has one."""
        if kind == "F" and not stage_of(chunk).pre_process:
            with _recorded(trace, timers, "recv-forward", micro_batch, chunk):
                input_tensor = p2p.recv_forward()
            return input_tensor.requires_grad_(not forward_only)
        if kind == "B" and not stage_of(chunk).post_process:
            with _recorded(trace, timers, "recv-backward", micro_batch, chunk):
                return p2p.recv_backward()
        return None

    def compute(kind: str, micro_batch: int, chunk: int, received) -> torch.Tensor | None:
        if kind == "B":
            torch.autograd.backward(held[(micro_batch, chunk)][1], grad_tensors=received)
            return None
        output, loss_func = forward_step(batches[micro_batch], model_chunks[chunk], received)
        if stage_of(chunk).post_process:
            loss, value = loss_func(output)
            reported.append(value)
            output = loss * (loss_scale / divisor)
        return output

    def send(kind: str, micro_batch: int, chunk: int, received, output) -> None:
        stage = stage_of(chunk)
        if kind == "F":
            if not stage.post_process:
                with _recorded(trace, timers, "send-forward", micro_batch, chunk):
                    p2p.send_forward(output)
            if not forward_only:
                held[(micro_batch, chunk)] = (received, output)
                if trace is not None:
                    trace.max_activations_in_flight = max(
                        trace.max_activations_in_flight, len(held)
                    )
            return
        input_tensor, _ = held.pop((micro_batch, chunk))
        if not stage.pre_process:
            with _recorded(trace, timers, "send-backward", micro_batch, chunk):
                p2p.send_backward(input_tensor.grad)

    for index, step in enumerate(steps):
        with held_back(index):
            received = [receive(*action) for action in step]
            if len(step) == 1:
                with _recorded(trace, timers, *step[0]):
                    outputs = [compute(*step[0], received[0])]
            else:  # a combined step, timed as forward-compute (as Megatron-LM)
                (forward, backward), start = step, time.perf_counter()
                with _timed(timers, "forward-compute"):
                    output, _ = run_together(
                        functools.partial(compute, *forward, received[0]),
                        functools.partial(compute, *backward, received[1]),
                        delay_wgrad_compute,
                    )
                outputs = [output, None]
                if trace is not None:
                    end = time.perf_counter()
                    trace.events += [(*action, start, end) for action in step]
            for action, inputs, output in zip(step, received, outputs):
                send(*action, inputs, output)
    p2p.wait_all()
    return reported


def forward_backward_pipelining(
    forward_step: ForwardStep,
    data_iterator: Iterator[dict],
    model_chunks: list,
    num_microbatches: int,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    *,
    pp: Group,
    tensor_shape: tuple[int, ...],
    dtype: torch.dtype,
    trace: ScheduleTrace | None = None,
    per_token_loss: bool = False,
    timers: TimerFactory | None = None,
    no_sync_func: Callable | None = None,
    microbatch_group_size: int | None = None,
    combined: bool = False,
    delay_wgrad_compute: bool = False,
    gathered_func: Callable | None = None,
) -> list[torch.Tensor]:
    """1F1B with one model chunk per rank, interleaved 1F1B with several, over the stages of
    the pipeline group `pp` (`no_sync_func`: see run_actions; `microbatch_group_size`: see
    interleaved_order; `combined`: --overlap-moe-expert-parallel-comm, interleaved only, with
    `delay_wgrad_compute` and `gathered_func` as in forward_backward_combined)."""
    pipeline_size, rank = pp.size, pp.rank
    virtual_size = len(model_chunks)
    with _timed(timers, "batch-generator"):
        batches = [next(data_iterator) for _ in range(num_microbatches)]
    if forward_only:
        steps = [[action] for action in forward_only_order(num_microbatches, virtual_size)]
    elif virtual_size == 1:
        steps = [[action] for action in one_f_one_b_order(num_microbatches, pipeline_size, rank)]
    else:
        steps = combined_interleaved_steps(
            num_microbatches, pipeline_size, rank, virtual_size, microbatch_group_size, combined
        )
    gathered = gathered_func() if gathered_func and combined else contextlib.nullcontext()
    with gathered:
        return run_actions(
            steps,
            forward_step,
            batches,
            model_chunks,
            pp,
            tensor_shape,
            dtype,
            forward_only,
            loss_scale,
            trace,
            per_token_loss,
            timers,
            no_sync_func,
            delay_wgrad_compute,
        )


def get_forward_backward_func(pp: Group, combined_1f1b: bool = False) -> Callable:
    """The schedule for the pipeline group `pp`; call it with `pp=pp` among its keywords.
    `combined_1f1b`: --overlap-moe-expert-parallel-comm."""
    if pp.size > 1:
        return functools.partial(forward_backward_pipelining, combined=combined_1f1b)
    return forward_backward_combined if combined_1f1b else forward_backward_no_pipelining
