"""The distributed optimizer (ZeRO-1/2) reproduces the single-process run and holds the memory
Megatron's accounting predicts."""

import pytest

from tests.distributed import run_distributed
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_close_dicts,
    assert_matches_reference,
    train_job,
)
from threefold.training.memory import measure_bytes_per_parameter

DISTRIBUTED = ["--use-distributed-optimizer"]
LAYOUTS = {
    "dp2": (2, []),
    "dp4": (4, []),
    "tp2_dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "pp2_dp2": (4, ["--pipeline-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def reference():
    return train_job(LLAMA_STYLE + TRAINING, 10)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ten_steps_with_clipping_match_single_process(reference, layout):
    world_size, flags = LAYOUTS[layout]
    argv = LLAMA_STYLE + TRAINING + flags
    distributed = run_distributed(world_size, train_job, argv + DISTRIBUTED, 10)
    plain = run_distributed(world_size, train_job, argv, 10)
    # Sharding the optimizer changes no arithmetic: the same layout without it, bit for bit.
    for with_sharding, without in zip(distributed, plain):
        assert with_sharding["losses"] == without["losses"]
        assert_close_dicts(with_sharding["params"], without["params"], 0.0, "parameter")
    # Against one process: 1e-6, or the tensor-parallel tolerance where TP reorders sums.
    tolerance = 1e-5 if "tp" in layout else 1e-6
    assert_matches_reference(distributed, reference, tolerance)


def _bytes_job(argv: list[str]) -> dict:
    trainer = _setup(argv)
    trainer.train_step()
    return measure_bytes_per_parameter(trainer).__dict__


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("precision,without,with_distributed", [
    ("fp32", 16.0, lambda d: 8 + 8 / d),
    ("bf16", 18.0, lambda d: 6 + 12 / d),
])
def test_bytes_per_parameter_follow_megatron_accounting(world_size, precision, without,
                                                        with_distributed):
    argv = LLAMA_STYLE + TRAINING + (["--bf16"] if precision == "bf16" else [])
    for flags, expected in (([], without), (DISTRIBUTED, with_distributed(world_size))):
        for measured in run_distributed(world_size, _bytes_job, argv + flags):
            total = sum(measured.values())
            assert abs(total - expected) <= 0.05 * expected, (precision, flags, measured)
