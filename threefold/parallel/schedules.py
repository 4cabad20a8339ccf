"""Forward/backward schedules over the micro-batches of one global batch.

With one pipeline stage there is nothing to schedule: each micro-batch runs forward then
backward, gradients accumulating in the model's gradient buffer. Pipeline schedules (1F1B,
interleaved) plug in here behind `get_forward_backward_func`, with the same signature.

A forward step is `forward_step(batch, model) -> (output, loss_func)`, and
`loss_func(output) -> (loss, reported)` gives the micro-batch's mean loss and the detached
value to report, as in Megatron-LM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from threefold.parallel import state

ForwardStep = Callable[[dict, torch.nn.Module], tuple[torch.Tensor, Callable]]


def forward_backward_no_pipelining(forward_step: ForwardStep, data_iterator: Iterator[dict],
                                   model: torch.nn.Module, num_microbatches: int,
                                   forward_only: bool = False,
                                   loss_scale: float = 1.0) -> list[torch.Tensor]:
    """Returns each micro-batch's reported loss. The loss is divided by the number of
    micro-batches so the accumulated gradient is the mean over the global batch."""
    reported = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step(next(data_iterator), model)
        loss, value = loss_func(output)
        if not forward_only:
            (loss * (loss_scale / num_microbatches)).backward()
        reported.append(value)
    return reported


def get_forward_backward_func() -> Callable:
    if state.pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("pipeline-parallel schedules are not available yet")
    return forward_backward_no_pipelining
