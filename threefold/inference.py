"""Greedy / sampled text generation with a (tensor-parallel) GPT model.

Every TP rank runs the same loop: the forward pass needs all of them, and the vocabulary-
parallel logits are gathered so every rank picks the same next token.
"""

from __future__ import annotations

import torch

from threefold.parallel.tensor_parallel.mappings import gather_from_tensor_parallel_region


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    context_length: int,
    eod: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[int]:
    """Continue `prompt_ids`; greedy when temperature is 0. Recomputes the whole (cropped)
    context each step: simple and exact, fine for the short samples it is used for."""
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-context_length:]], device=device)
        logits = gather_from_tensor_parallel_region(model(context)[-1, 0], model.tp)
        logits = logits[: model.vocab_size].float().cpu()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < top_p
            sorted_probs = sorted_probs * keep
            choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
            next_id = int(order[choice])
        ids.append(next_id)
        if eod is not None and next_id == eod:
            break
    return ids[len(prompt_ids) :]


@torch.no_grad()
def score(model, ids: list[int], context_length: int) -> tuple[float, int]:
    """Mean next-token loss of a token sequence and the number of tokens predicted, over
    consecutive windows of up to `context_length` predictions (each window starts afresh)."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, context_length):
        window = ids[start : start + context_length + 1]
        if len(window) < 2:
            break
        tokens = torch.tensor([window[:-1]], device=device)
        labels = torch.tensor([window[1:]], device=device)
        per_token = model(tokens, labels=labels)
        total += float(per_token.double().sum())
        count += labels.numel()
    if count == 0:
        raise ValueError("the text has fewer than 2 tokens; nothing to score")
    return total / count, count


TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file")


def add_tokenizer_flags(parser) -> None:
    """The tools' own tokenizer flags: by default the checkpoint's tokenizer is used; a
    Megatron-LM checkpoint names files on the machine that trained it, these name local ones."""
    group = parser.add_argument_group("tokenizer (default: the checkpoint's)")
    for flag in TOKENIZER_FLAGS:
        group.add_argument(flag, help=f"instead of the checkpoint's {flag.removeprefix('--')}")


def tokenizer_files(args) -> dict:
    """{DataConfig field: value} of the tokenizer flags given."""
    names = [flag.removeprefix("--").replace("-", "_") for flag in TOKENIZER_FLAGS]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
