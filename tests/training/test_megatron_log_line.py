"""threefold's log line is Megatron-LM's, field for field, with threefold's own fields after.

The reference is built with the format strings of Megatron-LM's `training_log` and
`evaluate_and_print_results` (megatron/training/training.py), for the same numbers.
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import pytest

from tests.distributed import run_distributed
from threefold.training.logging import IterationStats, format_iteration, format_validation

TIMESTAMP = re.compile(r"^ \[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})\]")
# What log parsers written for Megatron-LM's line look for.
MEGATRON_REGEXES = {
    "iteration": r" iteration\s+(\d+)/\s*(\d+) \|",
    "consumed": r" consumed samples:\s+(\d+) \|",
    "elapsed": r" elapsed time per iteration \(ms\): ([\d.]+) \|",
    "throughput": r" throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|",
    "lr": r" learning rate: ([\d.E+-]+) \|",
    "batch": r" global batch size:\s+(\d+) \|",
    "loss": r" lm loss: ([\d.E+-]+) \|",
    "loss scale": r" loss scale: ([\d.]+) \|",
    "grad norm": r" grad norm: ([\d.]+) \|",
    "skipped": r" number of skipped iterations:\s+(\d+) \|",
    "nan": r" number of nan iterations:\s+(\d+) \|",
}


def _stats(**changes) -> IterationStats:
    values = dict(
        iteration=40,
        train_iters=100,
        consumed_samples=1280,
        elapsed_ms=812.345,
        learning_rate=2.5e-4,
        global_batch_size=32,
        lm_loss=3.14159,
        loss_scale=1.0,
        grad_norm=0.8765,
        skipped_iterations=1,
        nan_iterations=0,
        tokens_per_second=12345.6,
        tflops_per_device=187.654,
        mfu=0.52,
        memory_gib=40.5,
        log_throughput=True,
        num_zeros_in_grad=17,
        params_norm=245.5,
    )
    values.update(changes)
    return IterationStats(**values)


def _megatron(stamp: str, s: IterationStats) -> str:
    """Megatron-LM's training_log line for the same numbers (its format strings)."""
    log_string = f" [{stamp}]"
    log_string += f" iteration {s.iteration:8d}/{s.train_iters:8d} |"
    log_string += f" consumed samples: {s.consumed_samples:12d} |"
    log_string += f" elapsed time per iteration (ms): {s.elapsed_ms:.1f} |"
    if s.log_throughput:
        log_string += f" throughput per GPU (TFLOP/s/GPU): {s.tflops_per_device:.1f} |"
    log_string += f" learning rate: {s.learning_rate:.6E} |"
    log_string += f" global batch size: {s.global_batch_size:5d} |"
    if s.lm_loss is not None:
        log_string += " {}: {:.6E} |".format("lm loss", s.lm_loss)
    log_string += f" loss scale: {s.loss_scale:.1f} |"
    if s.grad_norm is not None:
        log_string += f" grad norm: {s.grad_norm:.3f} |"
    if s.num_zeros_in_grad is not None:
        log_string += f" num zeros: {s.num_zeros_in_grad} |"
    if s.params_norm is not None:
        log_string += f" params norm: {s.params_norm:.3f} |"
    log_string += f" number of skipped iterations: {s.skipped_iterations:3d} |"
    log_string += f" number of nan iterations: {s.nan_iterations:3d} |"
    return log_string


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"log_throughput": False, "num_zeros_in_grad": None, "params_norm": None},
        # every iteration of the window skipped: no loss, no grad norm, no zero count
        {"lm_loss": None, "grad_norm": None, "num_zeros_in_grad": None, "skipped_iterations": 5},
    ],
    ids=["all-fields", "plain", "all-skipped"],
)
def test_the_line_is_megatrons_with_threefolds_fields_after(changes):
    stats = _stats(**changes)
    line = format_iteration(stats)
    stamp = TIMESTAMP.match(line)
    assert stamp, line
    reference = _megatron(stamp.group(1), stats)
    assert line.startswith(reference), f"\n{line}\n{reference}"
    extras = line[len(reference) :]
    assert extras.startswith(" tokens per second: 12345.6 | TFLOP/s per device: 187.654 |")
    assert ("lm loss" in line) == (stats.lm_loss is not None)


def test_megatron_log_regexes_read_threefolds_line():
    line = format_iteration(_stats())
    found = {name: re.search(pattern, line) for name, pattern in MEGATRON_REGEXES.items()}
    assert all(found.values()), [name for name, match in found.items() if not match]
    assert found["iteration"].groups() == ("40", "100")
    assert float(found["loss"].group(1)) == pytest.approx(3.14159, rel=1e-6)
    assert float(found["throughput"].group(1)) == pytest.approx(187.7)
    assert float(found["elapsed"].group(1)) == pytest.approx(812.3)


def test_validation_is_megatrons_report_between_rules():
    loss = 2.5
    text = format_validation("iteration 40", loss)
    string = " validation loss at iteration 40 | "
    string += "{} value: {:.6E} | ".format("lm loss", loss)
    string += "{} PPL: {:.6E} | ".format("lm loss", math.exp(min(20, loss)))
    rule = "-" * (len(string) + 1)
    assert text.split("\n") == [rule, string, rule]


def _log_lines(argv: list[str], load: str | None = None) -> list[str]:
    """The lines this rank prints while training (log line and validation), from the
    checkpoint `load` if given."""
    from tests.parity import _setup
    from threefold.checkpoint.load import load_checkpoint

    trainer = _setup(argv)
    if load is not None:
        load_checkpoint(load, trainer.checkpoint_components())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.train()
    return [line for line in out.getvalue().splitlines() if "iteration" in line]


def test_the_last_rank_prints_the_iteration_and_validation_lines():
    argv = (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --micro-batch-size 2 "
        "--global-batch-size 4 --train-iters 2 --log-interval 1 --eval-interval 2 "
        "--eval-iters 1 --pipeline-model-parallel-size 2 --lr 1e-3"
    ).split()
    first, last = run_distributed(2, _log_lines, argv)
    assert not [line for line in first if " lm loss: " in line or " validation loss at" in line]
    assert len([line for line in last if TIMESTAMP.match(line) and " lm loss: " in line]) == 2
    assert any(line.startswith(" validation loss at iteration 2 | ") for line in last)
    # Megatron-LM's reports after training, on the validation and on the test split
    for split in ("validation set", "test set"):
        assert any(
            line.startswith(f" validation loss at iteration 2 on {split} | ") for line in last
        )


def test_plot_logs_reads_megatrons_log(tmp_path):
    import sys

    sys.path.insert(0, "tools")
    from plot_logs import parse_log, plot

    stamp = "2026-11-24 03:50:37.123456"
    lines = [
        _megatron(stamp, _stats(iteration=10, log_throughput=True)),
        _megatron(stamp, _stats(iteration=20, lm_loss=None, grad_norm=None)),  # all skipped
        _megatron(stamp, _stats(iteration=30, lm_loss=2.0)),
        "-" * 20,
        " validation loss at iteration 30 | lm loss value: 2.100000E+00 | "
        "lm loss PPL: 8.166170E+00 | ",
        " validation loss at iteration 30 on validation set | lm loss value: 2.050000E+00 | "
        "lm loss PPL: 7.767901E+00 | ",
        " validation loss at iteration 30 on test set | lm loss value: 9.000000E+00 | "
        "lm loss PPL: 8.103084E+03 | ",
        " validation-web loss at iteration 30 | lm loss value: 2.200000E+00 | "
        "lm loss PPL: 9.025013E+00 | ",
    ]
    path = tmp_path / "megatron.log"
    path.write_text("\n".join(lines) + "\n")
    series = parse_log(str(path))
    assert series["lm loss"] == {10: pytest.approx(3.14159), 30: 2.0}
    assert series["throughput per GPU (TFLOP/s/GPU)"][10] == pytest.approx(187.7)
    assert series["learning rate"][20] == pytest.approx(2.5e-4)
    assert series["validation loss"] == {30: 2.05}  # the test-set report is not validation
    assert series["validation-web loss"] == {30: 2.2}  # one of --multiple-validation-sets
    drawn = plot({"run": series}, str(tmp_path / "plot.png"))
    assert drawn["validation loss"] == drawn["validation-web loss"] == {"run": 1}
    assert series["tokens per second"] == {}


# One process, a tiny model on mock data: what the tests of the line's windows train.
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --vocab-size 64 --mock-data --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --eval-iters 0"
).split()


def test_skipped_iterations_are_counted_per_line_as_megatrons():
    """Megatron-LM's line counts the skipped (and nan) iterations of its own window, not of
    the run: an fp16 run whose loss scale overflows (1.2e18: every iteration here) says 1 on
    every line at --log-interval 1, and 2 at --log-interval 2, where the run's first line,
    after iteration 1, leaves its window open (1, then 2 at iteration 2)."""
    argv = TINY + "--train-iters 4 --fp16 --initial-loss-scale 1.2e18".split()
    for interval, expected in ((1, [1, 1, 1, 1]), (2, [1, 2, 2])):
        lines = _log_lines(argv + ["--log-interval", str(interval)])
        counts = [re.search(MEGATRON_REGEXES["skipped"], line) for line in lines]
        assert [int(c.group(1)) for c in counts if c] == expected, lines
        assert not any(" lm loss: " in line for line in lines)  # (every iteration skipped)


def _iteration_lines(argv: list[str], load: str | None = None) -> dict[int, str]:
    lines = _log_lines(argv, load)
    numbers = [re.search(r" iteration +(\d+)/", line) for line in lines]
    return {int(n.group(1)): line for n, line in zip(numbers, lines) if n}


def _lm_loss(line: str) -> float:
    return float(re.search(r" lm loss: (\S+) \|", line).group(1))


def test_the_first_iteration_is_logged_and_leaves_its_window_open_as_megatrons(tmp_path):
    """Megatron-LM (its training_log's is_first_iteration) prints a line after the first
    iteration a process trains, fresh or resumed, to show what the start cost, and resets no
    sums there: the next line at --log-interval covers its interval whole. The metric writers
    keep to --log-interval. At --log-interval 1 every line is the iteration's own (Megatron-
    LM's second is the mean of two: observability.py says why threefold's is not)."""
    argv = TINY + ["--log-interval", "1"]
    each = _iteration_lines(argv + ["--train-iters", "6"])
    assert sorted(each) == [1, 2, 3, 4, 5, 6]
    losses = {i: _lm_loss(line) for i, line in each.items()}
    # At --log-interval 3: iteration 1, then 3 (the mean of 1, 2 and 3), then 6 (4 to 6).
    board = str(tmp_path / "tensorboard")
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "4"]
    every_third = argv[:-1] + ["3", "--train-iters", "6", "--tensorboard-dir", board] + save
    lines = _iteration_lines(every_third)
    assert sorted(lines) == [1, 3, 6]
    assert _lm_loss(lines[1]) == pytest.approx(losses[1], rel=1e-5)
    assert _lm_loss(lines[3]) == pytest.approx(sum(losses[i] for i in (1, 2, 3)) / 3, rel=1e-5)
    assert _lm_loss(lines[6]) == pytest.approx(sum(losses[i] for i in (4, 5, 6)) / 3, rel=1e-5)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(board)
    events.Reload()
    assert [event.step for event in events.Scalars("lm loss")] == [3, 6]
    # Resumed from iteration 4 (--ckpt-step picks it): lines after 5 and 6, the second the
    # mean of both. (Losses agree to the 7 digits the line prints: rel=1e-5.)
    load = ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "4"]
    resumed = _iteration_lines(every_third[:-4] + load, str(tmp_path / "ckpt"))
    assert sorted(resumed) == [5, 6]
    assert _lm_loss(resumed[5]) == pytest.approx(losses[5], rel=1e-5)
    assert _lm_loss(resumed[6]) == pytest.approx((losses[5] + losses[6]) / 2, rel=1e-5)


def test_the_first_line_leaves_the_moe_and_mtp_losses_window_open_too():
    """The layers' own losses follow the line's window: at --log-interval 3, iteration 3's
    load-balancing and MTP losses are the means over iterations 1 to 3 (the first line, after
    iteration 1, reset neither)."""
    argv = TINY + "--train-iters 3 --num-experts 4 --moe-router-topk 2 ".split()
    argv += "--moe-aux-loss-coeff 0.01 --mtp-num-layers 1".split()
    fields = ("load_balancing_loss", "mtp_1 loss")

    def values(line: str) -> list[float]:
        return [float(re.search(rf" {field}: (\S+) \|", line).group(1)) for field in fields]

    each = {i: values(line) for i, line in _iteration_lines(argv + ["--log-interval", "1"]).items()}
    lines = _iteration_lines(argv + ["--log-interval", "3"])
    assert sorted(lines) == [1, 3]
    assert values(lines[1]) == pytest.approx(each[1], rel=1e-5)
    means = [sum(each[i][k] for i in (1, 2, 3)) / 3 for k in range(len(fields))]
    assert values(lines[3]) == pytest.approx(means, rel=1e-5)
