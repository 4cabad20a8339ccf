"""Activation recomputation changes memory, never results: with dropout on (so the RNG streams
must be replayed exactly), runs with and without recomputation are bitwise equal, single
process and under TP=2 (sequence parallel) and PP=2."""

import pytest

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, assert_close_dicts, train_job
from threefold.arguments import parse_args

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--num-layers", "4"]
RECOMPUTE = {
    "selective": ["--recompute-granularity", "selective"],
    "full_uniform": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "2",
    ],
    "full_block": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "1",
    ],
}
LAYOUTS = {
    "single": (1, []),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}


def _run(world_size: int, argv: list[str]) -> list[dict]:
    if world_size == 1:
        return [train_job(argv, 3)]
    return run_distributed(world_size, train_job, argv, 3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_recomputation_is_bitwise_neutral(layout):
    world_size, flags = LAYOUTS[layout]
    argv = LLAMA_STYLE + TRAINING + DROPOUT + flags
    baseline = _run(world_size, argv)
    for name, recompute in RECOMPUTE.items():
        for with_recompute, without in zip(_run(world_size, argv + recompute), baseline):
            assert with_recompute["losses"] == without["losses"], name
            assert_close_dicts(with_recompute["params"], without["params"], 0.0, name)


def test_recompute_flags_are_validated(capsys):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + ["--recompute-granularity", "full"])
    assert "--recompute-method" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + ["--recompute-granularity", "selective"] + ONE)
    assert "need --recompute-granularity full" in capsys.readouterr().err


ONE = ["--recompute-num-layers", "1"]


def test_recompute_layers_without_a_granularity_recompute_nothing_as_in_megatron(capsys):
    """Megatron-LM's reruns test passes --recompute-num-layers alone: it runs, recomputing
    nothing, and says so."""
    config = parse_args(LLAMA_STYLE + TRAINING + ONE)
    assert config.model.recompute_granularity is None
    assert "--recompute-num-layers changes nothing" in capsys.readouterr().out
