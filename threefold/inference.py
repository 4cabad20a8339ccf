"""Greedy / sampled text generation and scoring with a GPT model over TP x PP.

Every rank runs the same loop. Within a stage the TP ranks run the forward together and the
vocabulary-parallel logits are gathered, so each picks the same next token; across stages each
forward passes the hidden states on from the first stage to the last (a model that needs
pipeline parallelism to fit is sampled and scored too), and the last stage's token or loss is
broadcast back over the pipeline, so every rank goes on with the same sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.config import ConfigError
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.pipeline_parallel.p2p import P2P
from threefold.parallel.tensor_parallel.mappings import gather_from_tensor_parallel_region


def _stage_forward(model, tokens: torch.Tensor, labels: torch.Tensor | None = None):
    """The model's output (logits, or per-token losses with `labels`) on the last pipeline
    stage, None on the others: each stage takes the previous one's hidden states and sends its
    own on."""
    pp = model.parallel.pp
    if pp.size == 1:
        return model(tokens, labels=labels)
    dtype = next(model.parameters()).dtype
    shape = (tokens.shape[1], tokens.shape[0], model.config.hidden_size)
    p2p = P2P(pp, shape, dtype, tokens.device)
    hidden = None if model.pre_process else p2p.recv_forward()
    output = model(tokens, labels=labels, hidden_states=hidden)
    if model.post_process:
        return output
    p2p.send_forward(output)
    p2p.wait_all()
    return None


def _from_last_stage(value: torch.Tensor, model) -> torch.Tensor:
    """`value` as the last pipeline stage computed it, on every stage (`value` on the others
    only gives the shape and dtype)."""
    pp = model.parallel.pp
    if pp.size > 1:
        dist.broadcast(value, src=dist.get_global_rank(pp.group, pp.size - 1), group=pp.group)
    return value


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
        output = _stage_forward(model, context)
        chosen = torch.zeros(1, dtype=torch.long, device=device)
        if output is not None:
            logits = gather_from_tensor_parallel_region(output[-1, 0], model.tp)
            logits = logits[: model.vocab_size].float().cpu()
            chosen.fill_(_pick(logits, temperature, top_p, generator))
        next_id = int(_from_last_stage(chosen, model))
        ids.append(next_id)
        if eod is not None and next_id == eod:
            break
    return ids[len(prompt_ids) :]


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    sorted_probs = sorted_probs * keep
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[choice])


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
        per_token = _stage_forward(model, tokens, labels)
        window_total = torch.zeros(1, dtype=torch.float64, device=device)
        if per_token is not None:
            window_total.fill_(float(per_token.double().sum()))
        total += float(_from_last_stage(window_total, model))
        count += labels.numel()
    if count == 0:
        raise ValueError("the text has fewer than 2 tokens; nothing to score")
    return total / count, count


def load_for_text(args, device: torch.device, parallel: ParallelContext):
    """(config, model, tokenizer) of the checkpoint in --load, for a tool that reads or writes
    text: its tokenizer is the checkpoint's, or the files the tokenizer flags name; a run that
    had none is refused."""
    from threefold.checkpoint.load import load_model
    from threefold.inference_flags import tokenizer_files

    config, model, tokenizer = load_model(
        args.load,
        device,
        parallel=parallel,
        tokenizer_files=tokenizer_files(args),
        strictness=args.dist_ckpt_strictness,
    )
    if tokenizer is None:
        raise ConfigError(
            f"--load {args.load}: the run had no tokenizer (mock data, or a converted model); "
            "give one with --tokenizer-type and its files"
        )
    return config, model, tokenizer


def start_tool(parser, args) -> tuple[torch.device, ParallelContext]:
    """This tool process's device and parallel context at the layout of `add_layout_flags`;
    a layout the launch cannot take exits in one line (said by the first process)."""
    from threefold.arguments import print_refusal
    from threefold.parallel import state

    try:
        return state.initialize_for_inference(
            args.pipeline_model_parallel_size, args.tensor_model_parallel_size
        )
    except ConfigError as error:  # every process meets it: local rank 0 says it
        print_refusal(parser.prog, error)
        parser.exit(2)
