"""finetune.py: loss on responses only, packing equivalent to separate samples, LoRA trains only
adapters, a converted HF model fine-tuned and exported loads back into transformers, and its
mistakes refused in one line before torch is imported."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.conftest import TINY_MODEL
from tests.parity import GPT2_STYLE, LLAMA_STYLE, TRAINING, _setup
from threefold.config import ConfigError
from threefold.data.loader import collate
from threefold.data.sft import SFTDataset, read_jsonl
from threefold.data.tokenizer import NullTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = [
    {"prompt": "1 2 3", "response": "4 5"},
    {"prompt": "7 8", "response": "9 10 11"},
    {"prompt": "5 6", "response": "12 13"},
]


def test_prompt_tokens_carry_no_loss():
    sample = SFTDataset(RECORDS[:1], NullTokenizer(100), seq_length=8)[0]
    # tokens 1 2 3 4 5 <eod> then padding; labels are the tokens shifted by one
    assert sample["tokens"][:6].tolist() == [1, 2, 3, 4, 5, 100]
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]


def test_chat_messages_carry_loss_on_assistant_turns_only(tmp_path):
    """Without a chat template: "Role: content" lines, loss on the assistant's and the end."""
    pytest.importorskip("transformers")
    from tests.tools.hf_models import build_tokenizer
    from threefold.data.tokenizer import HuggingFaceTokenizer

    build_tokenizer(str(tmp_path))
    tokenizer = HuggingFaceTokenizer(str(tmp_path))
    record = {
        "messages": [
            {"role": "user", "content": "To be"},
            {"role": "assistant", "content": "or not to be"},
        ]
    }
    sample = SFTDataset([record], tokenizer, seq_length=40)[0]
    labels, mask = sample["tokens"][1:], sample["loss_mask"] > 0
    answer = tokenizer.tokenize("or not to be\n") + [tokenizer.eod]
    assert labels[mask].tolist() == answer


CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "To be"},
        {"role": "assistant", "content": "or not to be"},
        {"role": "user", "content": "that is"},
        {"role": "assistant", "content": "the question"},
    ]
}


def test_chat_records_are_rendered_token_by_token_as_transformers_does(tmp_path):
    """With the tokenizer's chat template the sample is `apply_chat_template`'s ids exactly,
    and loss falls on what each assistant turn adds after its header: content, <|im_end|>."""
    transformers = pytest.importorskip("transformers")
    from tests.tools.hf_models import build_tokenizer
    from threefold.data.tokenizer import HuggingFaceTokenizer

    build_tokenizer(str(tmp_path), chat=True)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    expected = hf.apply_chat_template(CONVERSATION["messages"], tokenize=False)
    expected = hf(expected, add_special_tokens=False)["input_ids"]
    sample = SFTDataset([CONVERSATION], HuggingFaceTokenizer(str(tmp_path)), seq_length=80)[0]
    assert sample["tokens"][: len(expected)].tolist() == expected
    assert (sample["tokens"][len(expected) :] == hf.eos_token_id).all()  # padding
    labels, mask = sample["tokens"][1:], sample["loss_mask"] > 0
    replies = "or not to be<|im_end|>\nthe question<|im_end|>\n"
    assert hf.decode(labels[mask].tolist()) == replies


@pytest.mark.parametrize("style", [LLAMA_STYLE, GPT2_STYLE], ids=["rope", "learned"])
def test_packed_documents_see_only_themselves(style):
    """Per-token losses of conversations packed into one sample equal those of each
    conversation in its own sample: positions restart and attention stays inside each."""
    model = _setup(style + TRAINING).model.eval()
    tokenizer = NullTokenizer(100)
    packed = collate([SFTDataset(RECORDS, tokenizer, 16, packing=True)[0]], torch.device("cpu"))
    with torch.no_grad():
        packed_loss = model(
            packed["tokens"],
            labels=packed["labels"],
            attention_mask=packed["attention_mask"],
            position_ids=packed["position_ids"],
        )[0]
        alone = []
        for index in range(len(RECORDS)):
            batch = collate([SFTDataset(RECORDS, tokenizer, 16)[index]], torch.device("cpu"))
            loss = model(batch["tokens"], labels=batch["labels"])[0]
            alone.append(loss[batch["loss_mask"][0] > 0])
    mask = packed["loss_mask"][0] > 0
    assert mask.sum() == sum(len(a) for a in alone)
    torch.testing.assert_close(packed_loss[mask], torch.cat(alone), rtol=1e-5, atol=1e-6)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_lora_finetune_of_a_converted_model_exports_to_transformers(tmp_path, kind):
    """Mixtral: adapters on every expert too, merged into each expert's weights on export."""
    transformers = pytest.importorskip("transformers")
    from tests.tools.hf_models import VOCAB, build_hf_model, convert_in_process
    from threefold.checkpoint.load import load_model

    build_hf_model(kind, str(tmp_path / "hf"))
    names = ["Romeo", "Juliet", "Hamlet", "Ophelia"]
    for split, count in (("train", 40), ("valid", 8)):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for i in range(count):
                f.write(
                    json.dumps(
                        {
                            "prompt": f"Who is {names[i % 4]}? ",
                            "response": f"{names[i % 4]} is a character.",
                        }
                    )
                    + "\n"
                )
    converted, tuned, exported = (str(tmp_path / d) for d in ("tf", "sft", "export"))
    convert_in_process(
        "--loader",
        "hf",
        "--saver",
        "threefold",
        "--load-dir",
        str(tmp_path / "hf"),
        "--save-dir",
        converted,
    )
    result = _run(
        os.path.join(ROOT, "finetune.py"),
        "--load",
        converted,
        "--save",
        tuned,
        "--train-data-path",
        str(tmp_path / "train.jsonl"),
        "--valid-data-path",
        str(tmp_path / "valid.jsonl"),
        "--test-data-path",
        str(tmp_path / "valid.jsonl"),
        "--seq-length",
        "32",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--train-iters",
        "30",
        "--lr",
        "3e-3",
        "--lora-rank",
        "8",
        "--log-interval",
        "10",
        "--eval-interval",
        "30",
        "--eval-iters",
        "1",
        "--sft-packing",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [
        float(x) for x in re.findall(r"validation loss.*?lm loss value: ([\d.E+-]+)", result.stdout)
    ]
    # before fine-tuning, at --eval-interval 30, and Megatron's reports after training on the
    # validation and the test set (the same weights and batches: the same loss)
    assert len(losses) == 4 and losses[1] == losses[2] == losses[3] < losses[0] - 0.2
    assert "on test set" in result.stdout

    # LoRA: the base weights are the converted ones, bit for bit; the adapters moved.
    base_config, base, _ = load_model(converted)
    config, model, tokenizer = load_model(tuned)
    # The converted model records no dropout, and fine-tuning keeps that, not Megatron's 0.1.
    assert base_config.model.hidden_dropout == config.model.hidden_dropout == 0.0
    assert config.model.attention_dropout == base_config.model.attention_dropout
    base_weights = dict(base.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert any("local_experts" in n and ".adapter." in n for n in names) == (kind == "mixtral")
    for name, param in model.named_parameters():
        if ".adapter." in name:
            if name.endswith("linear_out.weight"):
                assert param.abs().sum() > 0, name  # B starts at zero
        else:
            assert torch.equal(param, base_weights[name]), name

    convert_in_process(
        "--loader", "threefold", "--saver", "hf", "--load-dir", tuned, "--save-dir", exported
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)[..., :VOCAB].transpose(0, 1)
        np.testing.assert_allclose(
            merged(tokens).logits.numpy(), ours.numpy(), rtol=1e-4, atol=1e-5
        )


def test_a_small_fine_tuning_set_is_said_before_training():
    from finetune import dataset_size_warnings
    from threefold.arguments import parse_args

    config = parse_args(
        GPT2_STYLE + TRAINING + ["--global-batch-size", "32", "--eval-iters", "100"]
    )
    train, evaluation = dataset_size_warnings(config, train_samples=3, valid_samples=10)
    assert "3 training samples" in train and "--global-batch-size 32" in train
    assert "reads 3200 samples" in evaluation and "use --eval-iters 1" in evaluation
    assert dataset_size_warnings(config, train_samples=64, valid_samples=1600) == []
    config.training.full_validation = True  # each evaluation reads the set once: nothing to say
    assert dataset_size_warnings(config, train_samples=64, valid_samples=10) == []


def test_a_seq_length_that_cuts_off_every_response_is_refused_and_some_is_said(tmp_path, capsys):
    """(before: a run that trained on nothing, its loss 0.0000 each iteration)"""
    from finetune import sft_datasets
    from threefold.arguments import parse_args

    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    # ids 1 2 3 | 4 5 <eod>, 7 8 | 9 10 11 <eod> and 5 6 | 12 13 <eod>; the label at position i
    # is token i + 1: one position reaches no response, two reach all but the first's.
    build, said = sft_datasets(packing=False), {}
    for seq_length in (1, 2):
        config = parse_args(GPT2_STYLE + TRAINING + ["--seq-length", str(seq_length)])
        config.data.train_data_path = [str(records)]
        try:
            build(config, NullTokenizer(100))
            said[seq_length] = capsys.readouterr().out
        except ConfigError as refused:
            said[seq_length] = str(refused)
    cut = "cuts off every response token of"
    assert said[1] == (
        f"--seq-length 1 {cut} every conversation in --train-data-path (the shortest prompt is "
        "2 tokens); raise --seq-length"
    )
    assert (
        f"WARNING: --seq-length 2 {cut} 1 of 3 conversations in --train-data-path: they train "
        "nothing\n"
    ) in said[2]
    assert SFTDataset(RECORDS, NullTokenizer(100), seq_length=3).without_loss == 0


PERSONA = "I am Nemo of the Nautilus."


def test_a_chat_model_fine_tuned_on_a_persona_answers_in_it(tmp_path):
    """A converted chat model (ChatML template) fine-tuned on a persona answers in it through
    `tools/generate.py --chat`, and, exported, through `transformers`' own chat template."""
    transformers = pytest.importorskip("transformers")
    from tests.tools.hf_models import build_hf_model, convert_in_process

    build_hf_model("qwen2", str(tmp_path / "hf"), num_layers=2, chat=True)
    questions = ["Who are you?", "Your name?", "Who is this?", "Name?"]  # 45-51 tokens
    for split, count in (("train", 32), ("valid", 4)):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for i in range(count):
                user = {"role": "user", "content": questions[i % len(questions)]}
                reply = {"role": "assistant", "content": PERSONA}
                f.write(json.dumps({"messages": [user, reply]}) + "\n")
    converted, tuned, exported = (str(tmp_path / d) for d in ("tf", "sft", "export"))
    convert = ["--loader", "hf", "--saver", "threefold", "--load-dir", str(tmp_path / "hf")]
    convert_in_process(*convert, "--save-dir", converted)
    result = _run(
        os.path.join(ROOT, "finetune.py"),
        *("--load", converted, "--save", tuned, "--seq-length", "64", "--lr", "3e-3"),
        *("--train-data-path", str(tmp_path / "train.jsonl"), "--train-iters", "60"),
        *("--valid-data-path", str(tmp_path / "valid.jsonl"), "--eval-iters", "1"),
        *("--micro-batch-size", "8", "--global-batch-size", "8", "--log-interval", "40"),
    )
    assert result.returncode == 0, result.stderr[-3000:]

    question = "Who are you?"
    generate = os.path.join(ROOT, "tools", "generate.py")
    answer = _run(
        generate, "--load", tuned, "--chat", "--prompt", question, "--max-new-tokens", "40"
    )
    assert answer.returncode == 0, answer.stderr[-2000:]
    assert answer.stdout.strip().splitlines()[-1] == PERSONA

    export = ["--loader", "threefold", "--saver", "hf", "--load-dir", tuned, "--save-dir", exported]
    convert_in_process(*export)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
    )
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        output = model.generate(
            prompt, max_new_tokens=40, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )
    reply = tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True)
    assert reply.strip() == PERSONA


@pytest.fixture(scope="module")
def pretrained(shakespeare_data, tmp_path_factory) -> str:
    """Two iterations on the tokenized default corpus, saved with the tokenizer."""
    directory = str(tmp_path_factory.mktemp("pretrained") / "run")
    result = _run(
        os.path.join(ROOT, "pretrain_gpt.py"),
        *TINY_MODEL,
        *("--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2", "--eval-iters", "0"),
        *("--data-path", shakespeare_data["DATA_PATH"], "--split", "98,1,1"),
        *("--tokenizer-type", "SentencePieceTokenizer"),
        *("--tokenizer-model", shakespeare_data["TOKENIZER_MODEL"]),
        *("--save", directory),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


# finetune.py's main in a fresh interpreter, failing if it imported torch on the way.
BEFORE_TORCH = (
    "import sys, finetune; code = finetune.main(sys.argv[1:]); "
    "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)"
)


def test_fine_tuning_mistakes_are_refused_before_torch_is_imported(pretrained, tmp_path):
    records = tmp_path / "sft.jsonl"
    records.write_text(json.dumps({"prompt": "To be", "response": " or not"}) + "\n")
    damaged, resumed = str(tmp_path / "damaged"), str(tmp_path / "resumed")
    shutil.copytree(pretrained, damaged)
    os.remove(os.path.join(damaged, "iter_0000002", "__0_0.distcp"))
    shutil.copytree(pretrained, resumed)  # (a run resumes itself: --load is its --save)
    base = ["--load", pretrained, "--train-iters", "2", "--lr", "1e-4"]
    base += ["--micro-batch-size", "1", "--global-batch-size", "1"]
    data, missing = ["--train-data-path", str(records)], str(tmp_path / "none.jsonl")
    cases = [
        (["--mock-data"], "give --train-data-path FILE"),
        (["--train-data-path", missing], f"--train-data-path {missing}: no such file"),
        (data + ["--valid-data-path", missing], f"--valid-data-path {missing}: no such file"),
        (data + ["--test-data-path", missing], f"--test-data-path {missing}: no such file"),
        (
            data + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "no.model"],
            "--tokenizer-model no.model: no such file",
        ),
        (data + ["--load", damaged], "__0_0.distcp is missing"),
        (data + ["--load", resumed, "--save", resumed, "--lr", "2e-3"], "schedule has --lr 0.001"),
        (data + ["--sft"], "--sft "),  # (pretrain_gpt.py's Megatron-LM SFT)
        (data + ["--pretrained-checkpoint", pretrained], "give the model as --load"),
    ]
    for extra, expected in cases:
        result, seconds = _before_torch(*base, *extra)
        assert result.returncode == 2, (extra, result.stderr[-2000:])
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("finetune.py: error: ") and expected in line, (extra, line)
        assert seconds < 5, (extra, seconds)
    # The control: resumed with the checkpoint's --lr, the load passes the same checks.
    result, _ = _before_torch(
        *base,
        *data,
        "--load",
        resumed,
        "--save",
        resumed,
        "--lr",
        "1e-3",
        THREEFOLD_VALIDATE_ONLY="1",
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_resumed_fine_tuning_run_takes_its_newer_non_persistent_checkpoint(pretrained, tmp_path):
    """A fine-tuning job that resumes itself (--save is its --load) loads its non-persistent
    checkpoint where that is newer than its persistent one, as pretrain_gpt.py does."""
    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in RECORDS * 4))
    run = str(tmp_path / "run")
    shutil.copytree(pretrained, run)  # (its iteration 2: the run resumes from it)
    argv = [os.path.join(ROOT, "finetune.py"), "--load", run, "--save", run]
    argv += ["--train-data-path", str(records), "--lr", "1e-3", "--log-interval", "1"]
    argv += ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "4"]
    argv += ["--save-interval", "10", "--eval-iters", "0", "--lr-decay-iters", "2"]
    argv += ["--non-persistent-save-interval", "3", "--non-persistent-ckpt-type", "global"]

    def losses(output: str) -> dict[int, str]:
        found = re.findall(r" iteration +(\d+)/ +\d+ \|.*?\| lm loss: ([\d.E+-]+) \|", output)
        return {int(i): loss for i, loss in found}

    # killed in the save at the end: iteration 3's non-persistent checkpoint is the newest
    killed = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, THREEFOLD_CRASH_AT="before-shards@4"),
    )
    assert killed.returncode != 0 and sorted(losses(killed.stdout)) == [3, 4], killed.stderr[-3000:]
    resumed = _run(*argv)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    non_persistent = os.path.join(run, "non_persistent")
    assert (
        f"> loading the non-persistent checkpoint of iteration 3 in {non_persistent} (--load "
        f"{run} holds 2)" in resumed.stdout
    )
    assert f"> fine-tuning from {non_persistent} (iteration 3)" in resumed.stdout
    after = losses(resumed.stdout)
    assert after == {4: losses(killed.stdout)[4]}


def _before_torch(*argv: str, **environment) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", BEFORE_TORCH, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, **environment),
    )
    return result, time.monotonic() - start


def test_a_bad_record_names_its_flag_file_and_line(tmp_path):
    cases = [
        (b'{"prompt": "a", "response": "b"}\n[1, 2]\n', ':2: needs "prompt" and "response"'),
        (b'{"prompt": "a"\n', ":1: not JSON"),
        (b"\xff\xfe\n", "not UTF-8 text"),
        (b"\n\n", "no records"),
        # (before: a TypeError or KeyError out of the rendering, after start-up)
        (b'{"prompt": "a", "response": 3}\n', ':1: "response" is 3, not text'),
        (b'{"messages": "hi"}\n', ':1: "messages" must be a list of {"role": ..., "content"'),
        (b'{"messages": []}\n', ':1: "messages" must be a list'),
        (
            b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}\n',
            ':1: turn 2 of "messages" needs a "role" and a "content", both text',
        ),
    ]
    for content, expected in cases:
        path = tmp_path / "records.jsonl"
        path.write_bytes(content)
        with pytest.raises(ConfigError, match=re.escape(f"--valid-data-path {path}")) as error:
            read_jsonl(str(path), "--valid-data-path")
        assert expected in str(error.value)
