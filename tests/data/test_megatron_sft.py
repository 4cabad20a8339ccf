"""pretrain_gpt.py --sft (Megatron-LM's SFT): SFTTokenizer's prompt formats and targets, a JSONL
line packed as Megatron-LM packs it, the lines blended and split by megatron-core in file
order, every layout training as one process does, Megatron-LM's evaluation mean, and the
mistakes refused in one line."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from tests.distributed import run_distributed
from tests.parity import (
    DP_TOLERANCE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_matches_reference,
    train_job,
)
from tests.training.test_accumulation_and_determinism import _with
from threefold.arguments import parse_args
from threefold.config import ConfigError
from threefold.data.megatron_sft import pack, split_conversations
from threefold.data.sft_tokenizer import IGNORE_INDEX

pytest.importorskip("transformers")

CONVERSATION = [
    {"role": "system", "content": " You are terse. "},
    {"role": "user", "content": "To be"},
    {"role": "assistant", "content": "or not to be"},
]
WORDS = "to be or not that is the question whether tis nobler in the mind".split()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from tests.tools.hf_models import NEMOTRON_SPECIALS, build_tokenizer

    directory = str(tmp_path_factory.mktemp("nemotron"))
    build_tokenizer(directory, specials=NEMOTRON_SPECIALS)
    return directory


def _sft_tokenizer(directory: str, prompt_format: str):
    from threefold.data.sft_tokenizer import SFTTokenizer

    return SFTTokenizer(directory, prompt_format)


def _targets_text(tokenizer, tokens, targets) -> str:
    return tokenizer.detokenize([t for t in targets if t != IGNORE_INDEX])


@pytest.mark.parametrize(
    "prompt_format,text,target",
    [
        (
            "nemotron-h-aligned",
            "<SPECIAL_10>System\nYou are terse.\n<SPECIAL_11>User\nTo be\n"
            "<SPECIAL_11>Assistant\nor not to be\n",
            "or not to be\n",
        ),
        (
            # (the header's first 3 tokens masked: Nemotron's tokenizer spells it in 3)
            "nemotron-nano-v2",
            "<SPECIAL_10>System\nYou are terse.\n<SPECIAL_11>User\nTo be\n"
            "<SPECIAL_11>Assistant\nor not to be\n<SPECIAL_12>\n",
            None,
        ),
        ("identity", " You are terse. To beor not to be", "or not to be"),
    ],
)
def test_prompt_formats_render_and_target_the_assistant(tokenizer_dir, prompt_format, text, target):
    tokenizer = _sft_tokenizer(tokenizer_dir, prompt_format)
    tokens, targets = tokenizer.tokenize_conversation(CONVERSATION)
    assert tokenizer.detokenize(tokens) == text
    assert tokens == tokenizer.tokenize(text)
    assert all(t in (IGNORE_INDEX, token) for t, token in zip(targets, tokens, strict=True))
    if target is None:  # nano-v2: the assistant turn but its first 3 tokens
        turn = tokenizer.tokenize("<SPECIAL_11>Assistant\nor not to be\n<SPECIAL_12>\n")
        assert [t for t in targets if t != IGNORE_INDEX] == turn[3:]
    else:
        assert _targets_text(tokenizer, tokens, targets) == target
    pad = tokenizer.token_id("<unk>" if prompt_format != "nemotron-h-aligned" else "<SPECIAL_233>")
    assert tokenizer.pad == pad


def test_the_default_format_is_the_chat_template_with_every_token_a_target(tmp_path):
    from tests.tools.hf_models import build_tokenizer

    build_tokenizer(str(tmp_path), chat=True)
    tokenizer = _sft_tokenizer(str(tmp_path), "default")
    tokens, targets = tokenizer.tokenize_conversation(CONVERSATION)
    assert tokens == targets == tokenizer.chat_ids(CONVERSATION)
    assert tokenizer.pad == tokenizer.eod  # (no pad token: Megatron-LM pads with the end)


def test_tokenizers_a_format_cannot_use_are_refused(tmp_path, tokenizer_dir):
    from tests.tools.hf_models import build_tokenizer

    build_tokenizer(str(tmp_path))  # no <SPECIAL_*> tokens, no chat template
    with pytest.raises(ConfigError, match="needs the token <SPECIAL_10>"):
        _sft_tokenizer(str(tmp_path), "nemotron-h-aligned")
    with pytest.raises(ConfigError, match="has none; use identity"):
        _sft_tokenizer(str(tmp_path), "default")
    identity = _sft_tokenizer(tokenizer_dir, "identity")
    # "th" + "e question": alone and together the BPE merges differ
    merged = [{"role": "user", "content": "th"}, {"role": "assistant", "content": "e question"}]
    assert identity.tokenize("the question")[:1] != identity.tokenize("th")[:1]
    with pytest.raises(ConfigError, match="differently alone than together"):
        identity.tokenize_conversation(merged)


class _Ids:
    """A tokenizer of space-separated ids: a user or system turn's are prompt, pad is 0."""

    pad = 0

    def tokenize_conversation(self, conversation):
        tokens, targets = [], []
        for message in conversation:
            ids = [int(word) for word in message["content"].split()]
            tokens += ids
            targets += ids if message["role"] == "assistant" else [IGNORE_INDEX] * len(ids)
        return tokens, targets


LINE = [
    {"role": "system", "content": "1"},
    {"role": "user", "content": "2 3"},
    {"role": "assistant", "content": "4 5"},
    {"role": "system", "content": "6"},
    {"role": "user", "content": "7"},
    {"role": "assistant", "content": "8 9 10"},
    {"role": "system", "content": "11"},
    {"role": "user", "content": "12"},
    {"role": "assistant", "content": "13"},
]


def test_a_line_is_split_at_system_turns():
    assert [len(c) for c in split_conversations(LINE)] == [3, 3, 3]
    assert [len(c) for c in split_conversations(LINE[1:3] + LINE[3:6])] == [2, 3]


def test_a_line_packs_its_conversations_then_pads():
    sample = pack(LINE[:6], _Ids(), seq_length=12)
    assert sample["tokens"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0, 0]
    # labels are tokens[1:]: targets are the assistant's, never a pad
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0]
    # the padding continues the last conversation's positions, and is part of it
    assert sample["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    assert sample["document_ids"].tolist() == [0] * 5 + [1] * 7


def test_the_conversation_that_reaches_the_end_is_cut_and_the_rest_dropped():
    sample = pack(LINE, _Ids(), seq_length=7)
    assert sample["tokens"].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]  # (the last: a pad)
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert sample["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert sample["document_ids"].tolist() == [0] * 5 + [1] * 2


def test_under_context_parallelism_each_conversation_is_padded_to_2cp():
    """Megatron-LM's padding at CP2: each conversation to a multiple of 4 tokens, its
    positions going on; the padding is part of the conversation and carries no loss."""
    sample = pack(LINE[:6], _Ids(), seq_length=12, multiple=4)
    # 5 tokens padded to 8, then the second conversation reaches the end: cut, then a pad
    assert sample["tokens"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 9, 0]
    assert sample["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert sample["document_ids"].tolist() == [0] * 8 + [1] * 4
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0]
    short = pack(LINE[:3], _Ids(), seq_length=12, multiple=4)  # (then filled to the end)
    assert short["tokens"].tolist() == [1, 2, 3, 4, 5] + [0] * 8
    assert short["position_ids"].tolist() == list(range(12))


def _write_lines(path, count: int, seed: int) -> list[list[dict]]:
    rng, lines = random.Random(seed), []

    def text(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))

    for _ in range(count):
        messages = []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "system", "content": text(3)})
            for _ in range(rng.randint(1, 2)):
                messages.append({"role": "user", "content": text(rng.randint(2, 8))})
                messages.append({"role": "assistant", "content": text(rng.randint(2, 10))})
        lines.append(messages)
    path.write_text("".join(json.dumps({"messages": m}) + "\n\n" for m in lines))
    return lines


def _argv(tokenizer_dir: str, *data: str, prompt_format: str = "nemotron-h-aligned") -> list:
    at = TRAINING.index("--vocab-size")  # (the tokenizer's vocabulary, and JSONL, not mock)
    training = [f for f in TRAINING[:at] + TRAINING[at + 2 :] if f != "--mock-data"]
    return (
        _with(LLAMA_STYLE, seq_length=48)
        + training
        + ["--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", tokenizer_dir]
        + ["--sft-tokenizer-prompt-format", prompt_format, *data]
    )


def test_the_splits_are_lines_in_file_order_and_a_blend_draws_by_weight(tmp_path, tokenizer_dir):
    from threefold.data.loader import build_datasets
    from threefold.data.tokenizer import build_tokenizer

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    lines = _write_lines(first, 40, seed=0)
    _write_lines(second, 30, seed=1)
    config = parse_args(_argv(tokenizer_dir, "--data-path", str(first), "--split", "90,10,0"))
    tokenizer = build_tokenizer(config.data, None)
    train, valid, test = build_datasets(config, tokenizer)
    assert test is None
    # 36 training lines, then 4 of validation: read in order, over and over
    for index, line in ((0, 0), (5, 5), (35, 35), (36, 0), (79, 7)):
        expected = pack(lines[line], tokenizer, 48)
        for name, value in train[index].items():
            np.testing.assert_array_equal(value, expected[name], err_msg=f"{index} {name}")
    np.testing.assert_array_equal(valid[1]["tokens"], pack(lines[37], tokenizer, 48)["tokens"])

    blend = ["--data-path", "3", str(first), "1", str(second), "--split", "100,0,0"]
    config = parse_args(_argv(tokenizer_dir, *blend, "--train-iters", "100"))
    train = build_datasets(config, tokenizer)[0]
    sources = np.array([train.source_of(i) for i in range(len(train))])
    assert abs(np.mean(sources == 0) - 0.75) < 0.01


@pytest.fixture(scope="module")
def sft_run(tokenizer_dir, tmp_path_factory) -> list[str]:
    directory = tmp_path_factory.mktemp("sft_data")
    _write_lines(directory / "train.jsonl", 40, seed=0)
    return _argv(tokenizer_dir, "--data-path", str(directory / "train.jsonl"), "--split", "90,10,0")


@pytest.mark.parametrize(
    "world_size,flags,tolerance",
    [
        (2, ["--use-distributed-optimizer"], DP_TOLERANCE),
        (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 1e-5),
        (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], 1e-5),
    ],
    ids=["dp2-distopt", "tp2-sp-dp2", "pp2-tp2"],
)
def test_sft_layouts_match_single_process(sft_run, world_size, flags, tolerance):
    reference = train_job(sft_run, 4)
    results = run_distributed(world_size, train_job, sft_run + flags, 4)
    assert_matches_reference(results, reference, tolerance)


def test_sft_over_context_parallel_ranks_trains_as_one_process(sft_run, monkeypatch):
    """CP2 (ring attention): the conversations, padded to multiples of 4 as Megatron-LM pads
    them at CP2, attend within themselves over the ranks, as one process computes them from
    the same samples."""
    from threefold.data import megatron_sft

    cp2 = ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]
    results = run_distributed(2, train_job, sft_run + cp2, 4)
    monkeypatch.setattr(megatron_sft, "padding_multiple", lambda config: 4)
    assert_matches_reference(results, train_job(sft_run, 4), 1e-5)


def test_evaluation_is_megatron_lms_mean_of_micro_batch_means(sft_run):
    """Megatron-LM's --sft validation loss: every micro-batch's own token mean, averaged; not
    the token mean of the batch (pretraining's), which differs when micro-batches hold
    different numbers of response tokens."""
    import torch

    trainer = _setup(sft_run + ["--eval-iters", "2"])
    iterator = trainer._batches(1, 0, shuffle=False)
    means, totals, tokens = [], 0.0, 0.0
    with torch.no_grad():
        for _ in range(2 * trainer.num_microbatches):
            batch = next(iterator)
            losses = trainer.model(
                batch["tokens"],
                labels=batch["labels"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            )
            total, count = (losses * batch["loss_mask"]).sum().item(), batch["loss_mask"].sum()
            means.append(total / max(count.item(), 1))
            totals, tokens = totals + total, tokens + count.item()
    loss = trainer.evaluate()
    assert np.isclose(loss, np.mean(means), rtol=1e-6)
    assert not np.isclose(loss, totals / tokens, rtol=1e-4)


def test_sft_mistakes_are_refused_in_one_line(tmp_path, tokenizer_dir, capsys):
    from threefold.validation import check_inputs

    data = tmp_path / "data.jsonl"
    _write_lines(data, 3, seed=0)  # (90% of 3 lines rounds to 3: no validation line)
    good = _argv(tokenizer_dir, "--data-path", str(data), "--split", "90,10,0")

    def refusal(argv: list[str], world_size: int = 1) -> str:
        """The one line: the flags' (argparse's exit) or the files' (a ConfigError)."""
        with pytest.raises((ConfigError, SystemExit)) as error:
            check_inputs(parse_args(argv, world_size=world_size))
        if isinstance(error.value, ConfigError):
            return str(error.value)
        said = capsys.readouterr().err.strip()
        assert error.value.code == 2 and len(said.splitlines()) == 1, said
        return said.removeprefix("pretrain_gpt.py: error: ")

    typed = good.index("--tokenizer-type")
    assert refusal(good[:typed] + good[typed + 4 :]).startswith(
        "--sft renders conversations with --tokenizer-type SFTTokenizer"
    )
    assert "not --mock-data" in refusal(_argv(tokenizer_dir, "--mock-data", "--vocab-size", "9"))
    assert refusal(good + ["--reset-attention-mask"]).startswith("--sft with --reset-attention")
    plain = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir]
    assert "is SFTTokenizer's" in refusal(
        LLAMA_STYLE + TRAINING + plain + ["--sft-tokenizer-prompt-format", "identity"]
    )
    assert "--split 90,10,0: the validation split gets none of the 3" in refusal(good)

    whole = good[:-2] + ["--split", "1,0,0"]
    first = '{"messages": [{"role": "user", "content": "a"}]}\n'
    records = [
        ("not json", "not JSON"),
        ('{"text": "a"}', 'needs "messages"'),
        ('{"messages": [{"role": "user", "content": 1}]}', 'turn 1 of "messages" needs'),
        ('{"messages": [{"role": "robot", "content": "a"}]}', 'turn 1 has the role "robot"'),
        ('{"messages": [{"role": "assistant", "content": "a"}]}', "turn 1 is an assistant turn"),
        (
            '{"messages": [{"role": "user", "content": "a"}, '
            '{"role": "assistant", "content": ""}]}',
            "turn 2 is an empty assistant turn",
        ),
    ]
    for record, said in records:
        data.write_text(first + record + "\n")
        assert refusal(whole).startswith(f"--data-path {data}:2: {said}")
    # The default format (the tokenizer's own template, no targets by role) takes any role,
    # as Megatron-LM's does.
    data.write_text('{"messages": [{"role": "robot", "content": "a"}]}\n')
    check_inputs(parse_args(whole + ["--sft-tokenizer-prompt-format", "default"]))


def test_an_sft_run_resumes_exactly_with_its_tokenizer_in_the_checkpoint(sft_run, tmp_path):
    """pretrain_gpt.py --sft stopped at iteration 3 and resumed prints the losses of a run
    that never stopped, bit for bit (the lines are read on from the consumed samples); the
    checkpoint holds the tokenizer, and --use-checkpoint-args gives back its prompt format."""
    from tests.conftest import ROOT, logged_losses
    from threefold.checkpoint.args import checkpoint_flags

    argv = _with(sft_run, train_iters=6, log_interval=1) + ["--eval-iters", "1"]
    argv += ["--eval-interval", "3"]

    def run(save, *more):
        flags = ["--save", str(save), "--load", str(save), "--save-interval", "3", *more]
        done = subprocess.run(
            [sys.executable, "pretrain_gpt.py", *argv, *flags],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return logged_losses(done.stdout)

    whole = run(tmp_path / "whole")
    first = run(tmp_path / "stopped", "--exit-interval", "3")
    resumed = run(tmp_path / "stopped")
    assert sorted(first["train"]) == [1, 2, 3] and sorted(resumed["train"]) == [4, 5, 6]
    assert {**first["train"], **resumed["train"]} == whole["train"]
    assert resumed["validation"] == {i: whole["validation"][i] for i in (6,)}
    flags = checkpoint_flags(str(tmp_path / "stopped"), with_tokenizer=True)
    assert flags[-6:] == [
        "--tokenizer-type",
        "SFTTokenizer",
        "--tokenizer-model",
        str(tmp_path / "stopped" / "iter_0000006" / "tokenizer"),
        "--sft-tokenizer-prompt-format",
        "nemotron-h-aligned",
    ]
