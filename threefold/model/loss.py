"""The language-model loss of one micro-batch, as the schedules consume it (Megatron's
`forward_step`)."""

from __future__ import annotations

import torch

from threefold.parallel.parallel_context import ONE_DEVICE, Group


def gpt_forward_step(
    batch: dict,
    model: torch.nn.Module,
    input_tensor: torch.Tensor | None = None,
    per_token_loss: bool = False,
    cp: Group = ONE_DEVICE,
):
    """Megatron's forward step: the model's output (per-token loss on the last pipeline stage,
    hidden states elsewhere) and how to reduce it to the micro-batch loss.

    The reported value is [loss total, loss tokens]: the global batch's loss is the sum of the
    totals over the sum of the tokens, the token mean Megatron-LM's log line and evaluation
    report. The loss backpropagated is by default the micro-batch's mean over its loss-mask
    tokens (every micro-batch weighs the same in the gradient, whatever its token count); with
    `per_token_loss` it is the sum over those tokens, divided by the global batch's count
    after the reduction, so every token weighs the same (Megatron's --calculate-per-token-loss).

    Under context parallelism (`cp`) the batch is this rank's share of the sequence: the
    reported sums are taken over the CP group, so they are the whole micro-batch's, and the
    loss backpropagated is this rank's part of it times CP, because gradients are averaged
    over DP x CP where they must be summed over CP."""
    output = model(
        batch["tokens"],
        labels=batch["labels"],
        hidden_states=input_tensor,
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
        loss_mask=batch["loss_mask"],
    )
    loss_mask = batch["loss_mask"]

    def loss_func(per_token_loss_values: torch.Tensor):
        total = (per_token_loss_values.float() * loss_mask).sum()
        whole = cp.all_reduce(torch.stack((total.detach(), loss_mask.sum().float())))
        if per_token_loss:
            return total * cp.size, whole
        # clamp: a fine-tuning micro-batch may hold no response token at all
        return total * cp.size / whole[1].clamp(min=1), whole

    return output, loss_func
