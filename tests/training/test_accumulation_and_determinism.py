"""Gradient accumulation equals one big micro-batch; runs are bitwise reproducible."""

from tests.parity import GPT2_STYLE, TRAINING, assert_close_dicts, assert_losses_close, train_job


def _with(argv: list[str], **flags) -> list[str]:
    argv = list(argv)
    for name, value in flags.items():
        argv[argv.index("--" + name.replace("_", "-")) + 1] = str(value)
    return argv


def test_accumulation_4x1_equals_1x4():
    base = GPT2_STYLE + _with(TRAINING, global_batch_size=4)
    four_micro_batches = train_job(_with(base, micro_batch_size=1), 10)
    one_micro_batch = train_job(_with(base, micro_batch_size=4), 10)
    assert_losses_close(four_micro_batches["losses"], one_micro_batch["losses"], 1e-6)
    assert_close_dicts(four_micro_batches["params"], one_micro_batch["params"], 1e-6, "parameter")


def test_same_seed_gives_bitwise_identical_losses():
    argv = GPT2_STYLE + TRAINING + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    first, second = train_job(argv, 5), train_job(argv, 5)
    assert first["losses"] == second["losses"]
    assert_close_dicts(first["params"], second["params"], 0.0, "parameter")
    other_seed = train_job(_with(argv, seed=99), 5)
    assert other_seed["losses"] != first["losses"]
