"""--full-validation (Megatron-LM's): each evaluation reads one epoch of the validation split,
every sample once, and its loss is the mean over all of its tokens: the same however the
samples are cut into batches (the last one padded with samples that carry no loss), and the
same in every layout."""

import json

import pytest
import torch

from tests.data.test_datasets import write_corpus
from tests.distributed import run_distributed
from tests.parity import GPT2_STYLE, LLAMA_STYLE, TRAINING, _setup
from threefold.arguments import parse_args
from threefold.config import ConfigError
from threefold.data.loader import build_datasets

ON_DATA = [flag for flag in TRAINING if flag != "--mock-data"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(str(root / "docs"), 120, seed=3)
    write_corpus(str(root / "web"), 20, seed=4)
    write_corpus(str(root / "code"), 30, seed=5, low=300)
    return str(root)


@pytest.fixture(scope="module")
def argv(root):
    data = ["--data-path", f"{root}/docs", "--split", "80,20,0"]
    return LLAMA_STYLE + ON_DATA + data + ["--data-cache-path", f"{root}/cache"]


def _validation_loss(argv: list[str]) -> float:
    trainer = _setup(argv)
    trainer.train_step()
    return trainer.evaluate()


def _token_mean_of_each_sample(argv: list[str]) -> tuple[float, int]:
    """The reference: the model after one step, on each validation sample alone; the mean of
    the per-token losses over all of them, and how many samples there were."""
    trainer = _setup(argv)
    trainer.train_step()
    model, valid = trainer.model.eval(), trainer.datasets[1]
    total = tokens = 0
    with torch.no_grad():
        for index in range(len(valid)):
            sample = torch.from_numpy(valid[index]).unsqueeze(0)
            losses = model(sample[:, :-1], labels=sample[:, 1:])
            total, tokens = total + losses.double().sum().item(), tokens + losses.numel()
    return total / tokens, len(valid)


def test_every_validation_sample_is_read_once_however_the_batches_cut_them(argv):
    full = argv + ["--full-validation"]
    reference, samples = _token_mean_of_each_sample(full)
    # one epoch of the split's documents, not the epochs a split sized for --eval-iters
    # batches would repeat (7 x 8 samples: a second one)
    config = parse_args(argv + ["--eval-iters", "7"])
    assert samples < 7 * 8 < len(build_datasets(config)[1])
    for sizes in (["8", "2"], ["3", "1"], ["16", "4"]):
        assert samples % int(sizes[0])  # a last batch padded
        flags = ["--eval-global-batch-size", sizes[0], "--eval-micro-batch-size", sizes[1]]
        assert _validation_loss(full + flags) == pytest.approx(reference, rel=1e-5)


def test_each_evaluation_reads_the_split_from_its_start(argv, capsys):
    trainer = _setup(argv + ["--full-validation", "--eval-iters", "1"])
    samples = len(trainer.datasets[1])
    assert f"> --full-validation: validation: {samples} samples per evaluation" in (
        capsys.readouterr().out
    )
    first = trainer.evaluate()
    assert trainer.evaluate() == first and trainer.state.consumed_valid_samples == 0
    assert trainer.evaluate(2) is None  # (--split 80,20,0: no test split)


@pytest.mark.parametrize(
    "layout",
    [["--pipeline-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"], []],
    ids=["pp2", "tp2", "dp2"],
)
def test_every_layout_computes_the_single_process_validation_loss(argv, layout):
    full = argv + ["--full-validation", "--eval-global-batch-size", "6"]
    full += ["--eval-micro-batch-size", "1"]
    reference = _validation_loss(full)
    results = run_distributed(2, _validation_loss, full + layout)
    assert results[-1] == pytest.approx(reference, rel=1e-5)


def test_what_it_cannot_read_is_refused_in_one_line(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + ["--full-validation"])
    assert "--full-validation reads the validation split once through" in capsys.readouterr().err
    prefix = argv[argv.index("--data-path") + 1]
    weighted = argv + ["--full-validation", "--data-path", "1", prefix]
    with pytest.raises(ConfigError, match="--data-path weighs its datasets"):
        build_datasets(parse_args(weighted))
    # --skip-train with it needs no --eval-iters: the validation split is read whole
    config = parse_args(argv + ["--full-validation", "--skip-train", "--eval-iters", "0"])
    assert config.training.evaluates(1) and not config.training.evaluates(2)


def test_fine_tuning_counts_each_response_token_of_the_validation_set_once(tmp_path):
    """finetune.py's conversations carry loss on their responses only, of different lengths:
    the loss is the mean over all response tokens of the set, not over micro-batches."""
    from finetune import sft_datasets
    from threefold.parallel import state
    from threefold.training.trainer import Trainer

    records = [{"prompt": "1 2", "response": " ".join(["7"] * n)} for n in (1, 2, 3, 5, 8, 4, 2)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    argv = GPT2_STYLE + ON_DATA + ["--tokenizer-type", "NullTokenizer", "--full-validation"]
    argv += ["--train-data-path", str(path), "--valid-data-path", str(path)]
    argv += ["--eval-global-batch-size", "4", "--eval-micro-batch-size", "2"]
    config = parse_args(argv)
    trainer = Trainer(config, torch.device("cpu"), state.parallel_context(), sft_datasets(False))
    valid, total, tokens = trainer.datasets[1], 0.0, 0.0
    with torch.no_grad():
        for index in range(len(valid)):
            sample = {k: torch.from_numpy(v).unsqueeze(0) for k, v in valid[index].items()}
            tokens_ = sample["tokens"]
            losses = trainer.model.eval()(tokens_[:, :-1], labels=tokens_[:, 1:])
            total += (losses.double() * sample["loss_mask"]).sum().item()
            tokens += sample["loss_mask"].sum().item()
    assert len(valid) == 7 and tokens == 25 + 7  # (and each one's end-of-document)
    assert trainer.evaluate() == pytest.approx(total / tokens, rel=1e-5)


def _per_set(argv: list[str]) -> dict[str, float]:
    trainer = _setup(argv)
    trainer.train_step()
    with trainer.observability:  # (its metric writers)
        trainer._validate(1)
    return {name: trainer.evaluate(dataset=d) for name, d in trainer.validation_sets}


def test_multiple_validation_sets_are_each_evaluated_whole_under_their_names(root, capsys):
    """--multiple-validation-sets: each --valid-data-path dataset on its own, its loss what a
    run with that dataset alone computes, reported as Megatron-LM's `validation-NAME`."""
    per_split = ["--data-cache-path", f"{root}/cache", "--train-data-path", f"{root}/docs"]
    argv = LLAMA_STYLE + ON_DATA + per_split + ["--full-validation"]
    sets = ["--valid-data-path", f"{root}/web", f"{root}/code", "--multiple-validation-sets"]
    losses = _per_set(argv + sets + ["--validation-set-names", "web", "code"])
    said = capsys.readouterr().out
    assert list(losses) == ["validation-web", "validation-code"]
    for name, path in (("web", "web"), ("code", "code")):
        alone = _per_set(argv + ["--valid-data-path", f"{root}/{path}"])
        assert losses[f"validation-{name}"] == pytest.approx(alone["validation"], rel=1e-6)
        assert f" validation-{name} loss at iteration 1 | lm loss value: " in said
    assert losses["validation-web"] != pytest.approx(losses["validation-code"], rel=1e-5)
    assert list(_per_set(argv + sets)) == ["validation-0", "validation-1"]  # (unnamed)
    with pytest.raises(ConfigError, match="2 names for 3 --valid-data-path datasets"):
        three = ["--valid-data-path", f"{root}/web", f"{root}/code", f"{root}/docs"]
        _setup(argv + sets + three + ["--validation-set-names", "web", "code"])


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--multiple-validation-sets"], "evaluates each set whole: add --full-validation"),
        (["--validation-set-names", "web"], "names the --multiple-validation-sets: add that"),
        (
            ["--multiple-validation-sets", "--full-validation"],
            "evaluates each --valid-data-path dataset on its own",
        ),
    ],
)
def test_multiple_validation_set_mistakes_are_one_line(argv, flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv + flags)
    assert message in capsys.readouterr().err


def test_fine_tuning_takes_a_validation_set_per_file(tmp_path):
    from finetune import sft_datasets
    from threefold.data.tokenizer import NullTokenizer

    paths = []
    for name, count in (("chat", 3), ("math", 5)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join('{"prompt": "1 2", "response": "3 4"}\n' for _ in range(count)))
        paths.append(str(path))
    argv = GPT2_STYLE + ON_DATA + ["--train-data-path", paths[0], "--valid-data-path", *paths]
    config = parse_args(argv + ["--full-validation", "--multiple-validation-sets"])
    _, valid, _ = sft_datasets(False)(config, NullTokenizer(1001))
    assert [len(d) for d in valid] == [3, 5]
