"""--eval-global-batch-size and --eval-micro-batch-size (Megatron-LM's): evaluation reads its
own global batches in its own micro-batches; the validation loss is the mean over the same
tokens however they are cut, on one process and across pipeline stages. Each evaluation reads
on from where the last stopped, as Megatron-LM's, and a checkpoint carries the count."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY_MODEL
from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, _setup
from threefold.arguments import parse_args
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.manifest import MANIFEST, digest
from threefold.checkpoint.save import save_checkpoint

EVAL = ["--eval-iters", "2"]


def _validation_loss(argv: list[str]) -> float:
    trainer = _setup(argv)
    trainer.train_step()
    return trainer.evaluate()


def test_the_validation_loss_is_the_same_tokens_however_they_are_cut():
    """Training's global batch is 8 (2 per micro-batch): two evaluation steps of 8 read samples
    0-15, as four of 4 in micro-batches of 1 and one of 16 in micro-batches of 4 do."""
    argv = LLAMA_STYLE + TRAINING
    reference = _validation_loss(argv + EVAL)
    for flags in (
        ["--eval-iters", "4", "--eval-global-batch-size", "4", "--eval-micro-batch-size", "1"],
        ["--eval-iters", "1", "--eval-global-batch-size", "16", "--eval-micro-batch-size", "4"],
    ):
        assert _validation_loss(argv + flags) == pytest.approx(reference, rel=1e-6)
    # another set of tokens: another loss (the flags are not ignored)
    other = _validation_loss(argv + EVAL + ["--eval-global-batch-size", "4"])
    assert other != pytest.approx(reference, rel=1e-6)


def test_pipeline_stages_pass_evaluation_micro_batches_of_its_own_size():
    """Under PP2 what travels between the stages is an evaluation micro-batch (4 samples), not
    a training one (2)."""
    argv = LLAMA_STYLE + TRAINING + EVAL + ["--eval-micro-batch-size", "4"]
    reference = _validation_loss(argv)
    results = run_distributed(2, _validation_loss, argv + ["--pipeline-model-parallel-size", "2"])
    assert results[-1] == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--eval-global-batch-size", "6", "--eval-micro-batch-size", "4"], "not divisible"),
        (["--eval-micro-batch-size", "0"], "must be >= 1"),
    ],
)
def test_evaluation_batch_mistakes_are_one_line(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + flags)
    assert message in capsys.readouterr().err


def test_each_evaluation_reads_on_from_the_last_as_megatron():
    """Megatron-LM's validation iterator goes on through the split (sized for every evaluation
    of the run and the one after it); before, threefold read the same first batches each time.
    The test split is read from its start."""
    trainer = _setup(LLAMA_STYLE + TRAINING + EVAL + ["--eval-interval", "4"])
    training = trainer.config.training
    assert training.evaluation_samples() == 2 * 8
    # 10 iterations: evaluations after 4 and 8, and after training
    assert len(trainer.datasets[1]) == 3 * 16 and len(trainer.datasets[2]) == 16
    first = trainer.evaluate(advance=False)  # (finetune.py's baseline: read again after)
    assert trainer.evaluate() == first and trainer.state.consumed_valid_samples == 16
    second = trainer.evaluate()
    assert second != pytest.approx(first, rel=1e-6)
    assert trainer.state.consumed_valid_samples == 32
    fresh = _setup(LLAMA_STYLE + TRAINING + EVAL + ["--eval-interval", "4"])
    fresh.state.consumed_valid_samples = 16
    assert fresh.evaluate() == second  # the same weights, the batches from sample 16
    assert trainer.evaluate(2) == fresh.evaluate(2)  # test: its first batches, every time


def test_a_checkpoint_carries_the_count_and_one_without_it_is_counted_as_megatron(tmp_path):
    argv = LLAMA_STYLE + TRAINING + EVAL + ["--eval-interval", "2"]
    trainer = _setup(argv)
    for _ in range(3):
        trainer.train_step()
    trainer.state.consumed_valid_samples = 48  # (what three evaluations of 16 read)
    save_checkpoint(str(tmp_path), trainer.checkpoint_components())
    resumed = _setup(argv)
    assert load_checkpoint(str(tmp_path), resumed.checkpoint_components()) == 3
    assert resumed.state.consumed_valid_samples == 48
    # A checkpoint saved before the count was kept: Megatron-LM's rule, one evaluation of
    # --eval-iters global batches each --eval-interval iterations (iteration 3: one of 16).
    path = os.path.join(str(tmp_path), "iter_0000003")
    with open(os.path.join(path, "metadata.json")) as f:
        metadata = json.load(f)
    del metadata["train_state"]["consumed_valid_samples"]
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(metadata, f)
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    manifest["files"]["metadata.json"] = digest(os.path.join(path, "metadata.json"))
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)
    older = _setup(argv)
    assert load_checkpoint(str(tmp_path), older.checkpoint_components()) == 3
    assert older.state.consumed_valid_samples == 16


def _pretrain(*argv: str) -> dict[str, str]:
    """pretrain_gpt.py on mock data (`argv` last: its flags win): {what each validation line
    names: its loss}, and the rest of its output under "said"."""
    run = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY_MODEL]
    run += ["--mock-data", "--vocab-size", "64", "--global-batch-size", "2", "--lr", "1e-3"]
    run += ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2", *argv]
    result = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(
        r"validation loss at (iteration \d+[^|]*)\| lm loss value: (\S+)", result.stdout
    )
    return {where.strip(): loss for where, loss in lines} | {"said": result.stdout}


def test_skip_train_evaluates_the_loaded_model_and_saves_nothing(tmp_path):
    """Megatron-LM's --skip-train: the loaded model on the validation split from its start and
    on the test split; no training step, no save."""
    save = str(tmp_path / "run")
    trained = _pretrain("--save", save)
    before = {
        os.path.join(path, name): os.stat(os.path.join(path, name)).st_mtime_ns
        for path, _, names in os.walk(save)
        for name in names
        if name != ".threefold.lock"
    }
    evaluated = _pretrain("--load", save, "--save", save, "--skip-train")
    assert "skipping training (--skip-train is on) ..." in evaluated["said"]
    assert "WARNING: enabling --no-load-optim when skipping training." in evaluated["said"]
    assert " iteration        1/" not in evaluated["said"]  # no training log line
    # the model of iteration 2 on the validation split's first batches: what the evaluation
    # at iteration 2 read (the one after training read on)
    assert evaluated["iteration 2 on validation set"] == trained["iteration 2"]
    assert evaluated["iteration 2 on test set"] == trained["iteration 2 on test set"]
    assert "no checkpoint (--skip-train)" in evaluated["said"]
    only_the_model = parse_args(LLAMA_STYLE + TRAINING + EVAL + ["--skip-train"]).checkpoint
    assert only_the_model.no_load_optim and only_the_model.no_load_rng  # (Megatron-LM's too)
    after = {path: os.stat(path).st_mtime_ns for path in before}
    assert after == before and sorted(os.listdir(save)) == sorted(
        [".threefold.lock", "iter_0000002", "latest_checkpointed_iteration.txt"]
    )


def test_start_eval_at_iter_evaluates_from_that_iteration_on_as_megatron():
    """Megatron-LM's --start-eval-at-iter: no evaluation during training before it (the one
    after training is kept); the split and a checkpoint's missing count follow its formula."""
    run = _pretrain("--train-iters", "6", "--start-eval-at-iter", "4")
    assert sorted(key for key in run if key != "said") == [
        "iteration 4",
        "iteration 6",
        "iteration 6 on test set",
        "iteration 6 on validation set",
    ]
    training = parse_args(
        LLAMA_STYLE + TRAINING + EVAL + ["--eval-interval", "5", "--start-eval-at-iter", "10"]
    ).training
    assert [training.evaluates_at(i) for i in (5, 9, 10, 15)] == [False, False, True, True]
    # evaluations at 10, 15 and 20 read 3 x 16 samples; Megatron-LM's formula counts 2 (it
    # takes 10 // 5 = 2 intervals as skipped), and the split is sized by it
    assert training.validation_samples_read(20) == 2 * 16
