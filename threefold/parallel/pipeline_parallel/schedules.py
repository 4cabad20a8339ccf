"""Forward/backward schedules over the micro-batches of one global batch.

A forward step is `forward_step(batch, model, input_tensor) -> (output, loss_func)`, and
`loss_func(output) -> (loss, reported)` gives the micro-batch's loss and the detached value
to report, as in Megatron-LM. Every schedule returns the reported losses (on the last pipeline
stage; other stages return an empty list). It divides each loss by the number of micro-batches,
so the accumulated gradient is the mean over the global batch, unless `per_token_loss`: then
the loss is a sum over tokens, and the caller divides the gradients by the global batch's token
count once it is known (Megatron's --calculate-per-token-loss).

Pipeline schedules are written as an *order of actions* per rank, F(micro-batch, chunk) and
B(micro-batch, chunk), run by one executor (`run_actions`):

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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from threefold.parallel.parallel_context import Group
from threefold.parallel.pipeline_parallel.order import (
    Action,
    forward_only_order,
    interleaved_order,
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
    actions: list[Action],
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
) -> list[torch.Tensor]:
    """`no_sync_func` (PyTorch DDP/FSDP2 around the stage): gradient reduction held back for
    every action but this stage's last backward, which reduces what all micro-batches
    accumulated (FSDP2; DDP, which cannot have several forwards in flight, reduces nothing
    here and the data-parallel wrapper reduces after the schedule)."""
    device = next(model_chunks[0].parameters()).device
    p2p = P2P(pp, tensor_shape, dtype, device)
    divisor = 1 if per_token_loss else len(batches)
    held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    reported = []
    last = len(actions) - 1 if not forward_only else -1

    for index, (kind, micro_batch, chunk) in enumerate(actions):
        model = model_chunks[chunk]
        # (PyTorch DDP keeps the stage as `.module`; FSDP2 wraps it in place)
        stage = getattr(model, "module", model)
        with no_sync_func() if no_sync_func and index != last else contextlib.nullcontext():
            if kind == "F":
                input_tensor = None
                if not stage.pre_process:
                    with _recorded(trace, timers, "recv-forward", micro_batch, chunk):
                        input_tensor = p2p.recv_forward()
                    input_tensor.requires_grad_(not forward_only)
                with _recorded(trace, timers, "F", micro_batch, chunk):
                    output, loss_func = forward_step(batches[micro_batch], model, input_tensor)
                    if stage.post_process:
                        loss, value = loss_func(output)
                        reported.append(value)
                        output = loss * (loss_scale / divisor)
                if not stage.post_process:
                    with _recorded(trace, timers, "send-forward", micro_batch, chunk):
                        p2p.send_forward(output)
                if not forward_only:
                    held[(micro_batch, chunk)] = (input_tensor, output)
                    if trace is not None:
                        trace.max_activations_in_flight = max(
                            trace.max_activations_in_flight, len(held)
                        )
            else:
                input_tensor, output = held.pop((micro_batch, chunk))
                grad = None
                if not stage.post_process:
                    with _recorded(trace, timers, "recv-backward", micro_batch, chunk):
                        grad = p2p.recv_backward()
                with _recorded(trace, timers, "B", micro_batch, chunk):
                    torch.autograd.backward(output, grad_tensors=grad)
                if not stage.pre_process:
                    with _recorded(trace, timers, "send-backward", micro_batch, chunk):
                        p2p.send_backward(input_tensor.grad)
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
) -> list[torch.Tensor]:
    """1F1B with one model chunk per rank, interleaved 1F1B with several, over the stages of
    the pipeline group `pp` (`no_sync_func`: see run_actions; `microbatch_group_size`: see
    interleaved_order)."""
    pipeline_size, rank = pp.size, pp.rank
    virtual_size = len(model_chunks)
    with _timed(timers, "batch-generator"):
        batches = [next(data_iterator) for _ in range(num_microbatches)]
    if forward_only:
        actions = forward_only_order(num_microbatches, virtual_size)
    elif virtual_size == 1:
        actions = one_f_one_b_order(num_microbatches, pipeline_size, rank)
    else:
        actions = interleaved_order(
            num_microbatches, pipeline_size, rank, virtual_size, microbatch_group_size
        )
    return run_actions(
        actions,
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
    )


def get_forward_backward_func(pp: Group) -> Callable:
    """The schedule for the pipeline group `pp`; call it with `pp=pp` among its keywords."""
    if pp.size > 1:
        return forward_backward_pipelining
    return forward_backward_no_pipelining
