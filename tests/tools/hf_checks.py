"""What the Hugging Face conversion tests of one family each check (tests/tools/
test_convert_*.py): threefold's logits of a converted checkpoint (its model options changed,
to show each does its part), its per-token losses in parallel layouts, the export's round
trip, greedy generation, and a multimodal checkpoint's text model."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.tools.hf_models import TOKENS, VOCAB, convert_in_process
from threefold.checkpoint.load import load_model
from threefold.inference import generate
from threefold.model import GPTModel

# The dense families' layouts (`world, layout` for assert_layout_losses): TP2 with sequence
# parallelism on 2 ranks, TP2 x PP2 on 4.
TP2_SP_AND_TP2_PP2 = pytest.mark.parametrize(
    "world,layout",
    [
        (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ],
    ids=["tp2-sp", "tp2-pp2"],
)
# 24 positions (sequence parallelism splits them over TP 2), and their next tokens
TOKENS_25 = torch.randint(0, VOCAB, (2, 25), generator=torch.Generator().manual_seed(4))


def per_token_losses(argv: list[str], directory: str, tokens=TOKENS) -> list | None:
    """Per-token losses of `tokens` through a pipeline/tensor/context-parallel run of the
    checkpoint (a CP rank's losses of its chunks gathered back into the whole sequence's)."""
    import torch.distributed as dist

    from tests.parity import _setup
    from threefold.checkpoint.load import load_checkpoint
    from threefold.parallel.context_parallel.sequence import split_batch, to_global_order
    from threefold.parallel.pipeline_parallel.schedules import get_forward_backward_func

    trainer = _setup(argv)
    load_checkpoint(directory, trainer.checkpoint_components(), finetune=True)
    for chunk in trainer.model_chunks:
        chunk.eval()  # no dropout
    cp = trainer.parallel.cp
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    batch = split_batch({**batch, "loss_mask": torch.ones(batch["labels"].shape)}, cp)

    def step(batch, model, input_tensor=None):
        output = model(
            batch["tokens"],
            position_ids=batch.get("position_ids"),
            labels=batch["labels"],
            hidden_states=input_tensor,
        )
        return output, lambda per_token: (per_token.mean(), per_token.detach())

    sequence = (tokens.shape[1] - 1) // cp.size  # (this rank's share of it under SP)
    sequence //= trainer.parallel.tp.size if trainer.parallel.sequence_parallel else 1
    hidden = trainer.config.model.hidden_size
    trainer.pipeline_options["tensor_shape"] = (sequence, tokens.shape[0], hidden)
    losses = get_forward_backward_func(trainer.parallel.pp)(
        step, iter([batch]), trainer.model_chunks, 1, forward_only=True, **trainer.pipeline_options
    )
    if not trainer.parallel.is_last_pipeline_stage:
        return None
    mine = losses[0]  # [b, this rank's 2 chunks]
    if cp.size > 1:
        every = [torch.empty_like(mine) for _ in range(cp.size)]
        dist.all_gather(every, mine, group=cp.group)
        mine = to_global_order(torch.stack(every).transpose(1, 2), cp.size).T
    return mine.numpy().tolist()


def assert_transformers_losses(hf_model, results: list, tokens=TOKENS) -> None:
    """Each rank's per-token losses of `tokens` are the ones `transformers` computes."""
    with torch.no_grad():
        logits = hf_model(tokens[:, :-1]).logits
        expected = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none"
        )
    for result in results:
        np.testing.assert_allclose(
            np.asarray(result).reshape(-1), expected.numpy(), rtol=1e-4, atol=1e-5
        )


def assert_layout_losses(hf_model, ours: str, world: int, layout: list[str], tokens=TOKENS) -> None:
    """The per-token losses of `tokens` through the checkpoint `ours` at `layout` (flags after
    the model's own, --use-checkpoint-args) on `world` gloo ranks are transformers'."""
    argv = ["--use-checkpoint-args", "--load", ours, "--mock-data"]
    argv += ["--seq-length", str(tokens.shape[1] - 1), "--micro-batch-size", "2"]
    argv += ["--global-batch-size", "2", *layout]
    results = run_distributed(world, per_token_losses, argv, ours, tokens)
    assert_transformers_losses(hf_model, [r for r in results if r is not None], tokens)


def relative_error(logits: torch.Tensor, expected: torch.Tensor) -> float:
    return ((logits - expected).abs().max() / expected.abs().max()).item()


def logits_with(ours: str, tokens: torch.Tensor, **changes) -> torch.Tensor:
    """The logits [b, s, vocab] of the checkpoint `ours`, its model config changed by
    `changes` (its weights loaded as they fit: a norm the change drops is left out, one it
    adds keeps its initialization)."""
    config, model, _ = load_model(ours)
    other = GPTModel(dataclasses.replace(config.model, **changes), model.padded_vocab_size)
    other.initialize(seed=0)  # (a norm the change adds starts at its initialization: 1)
    other.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():  # (in eval mode: a converted model may carry the family's dropout)
        return other.eval()(tokens)[..., :VOCAB].transpose(0, 1)


def assert_round_trip(hf_model, hf_dir: str, ours: str, exported: str, tokens, **load) -> None:
    """The export of `ours` holds the Hugging Face model's tensors bitwise (the output layer of
    tied embeddings left out, as transformers saves), and loads (with `load`) into
    transformers' class of it with its logits."""
    from safetensors import torch as safetensors_torch
    from transformers import AutoModelForCausalLM

    argv = ["--loader", "threefold", "--saver", "hf", "--load-dir", ours, "--save-dir", exported]
    convert_in_process(*argv)
    before = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    after = safetensors_torch.load_file(os.path.join(exported, "model.safetensors"))
    if hf_model.config.tie_word_embeddings:
        before.pop("lm_head.weight", None)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    reloaded = AutoModelForCausalLM.from_pretrained(exported, **load).eval()
    assert type(reloaded) is type(hf_model)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)


def assert_greedy_generation(hf_model, ours: str) -> None:
    """threefold's greedy continuation of a prompt is transformers' (with its cache)."""
    _, model, tokenizer = load_model(ours)
    prompt = tokenizer.tokenize("To be, or not")
    theirs = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert generate(model, prompt, 12, 64) == theirs


def assert_text_of_multimodal(both, hf_model, ours: str, root, tokens, said: str) -> None:
    """`both`, a multimodal model whose language model holds `hf_model`'s weights, saved as the
    Hub keeps it: its conversion says `said` (what stays behind), holds the tensors of the text
    model's (`ours`) bitwise, and exports as the text model, which transformers loads with
    `hf_model`'s logits."""
    import transformers

    from tests.tools.hf_models import build_tokenizer

    hub, converted, exported = (str(root / name) for name in ("hub", "threefold", "exported"))
    both.save_pretrained(hub)
    build_tokenizer(hub)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        convert_in_process(
            "--loader", "hf", "--saver", "threefold", "--load-dir", hub, "--save-dir", converted
        )
    assert said in output.getvalue(), output.getvalue()
    (text_config, text, _), (config, model, _) = load_model(ours), load_model(converted)
    assert config.model == text_config.model
    expected = text.state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in model.state_dict().items())
    convert_in_process(
        "--loader", "threefold", "--saver", "hf", "--load-dir", converted, "--save-dir", exported
    )
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(reloaded) is type(hf_model)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)


def assert_exports_as(argv: list[str], root, architecture: str) -> dict:
    """A model built in threefold from `argv` (its initialization, saved) exports with no
    --hf-architecture as `architecture` (the export's guess), and transformers computes its
    logits within 1e-5. Returns the exported config.json."""
    import json

    from transformers import AutoModelForCausalLM

    from tests.parity import _setup
    from threefold.checkpoint.save import save_checkpoint

    ours, exported = str(root / "threefold"), str(root / "exported")
    trainer = _setup(argv + ["--save", ours])
    save_checkpoint(ours, trainer.checkpoint_components())
    argv = ["--loader", "threefold", "--saver", "hf", "--load-dir", ours, "--save-dir", exported]
    convert_in_process(*argv)
    with open(os.path.join(exported, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == [architecture]
    _, model, _ = load_model(ours)
    theirs = AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        expected = model.eval()(TOKENS)[..., :VOCAB].transpose(0, 1)
        assert relative_error(theirs(TOKENS).logits, expected) < 1e-5
    return config
