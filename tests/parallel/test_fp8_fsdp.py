"""--fp8-param-gather under FSDP2 (--distributed-strategy fsdp): the FP8 layers' weights are
all-gathered as FP8 bytes, cast from FSDP2's fp32 shards with the whole weight's scale, and
train as one device does (real gloo ranks; tolerances: tests/parallel/test_fp8.py)."""

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.parallel.test_fp8 import (
    LOSS_TOLERANCE,
    PARAM_GATHER_RECIPES,
    RECIPES,
    _differences,
    _weights_and_scaling,
    assert_match_one_device,
    fp8_train_job,
    stepwise_parity,
)
from tests.parity import LLAMA_STYLE, TRAINING, _setup, train_steps
from tests.training.test_checkpointing import _resume_job
from threefold.kernels.fp8_fsdp import Fp8GatheredWeight, Fp8ShardWeight
from threefold.model.fp8 import fp8_layers
from threefold.parallel.parallel_context import ONE_DEVICE
from threefold.training.memory import measure_bytes_per_parameter
from threefold.training.memory_estimate import estimate_stage

FSDP_PARAM_GATHER = ["--distributed-strategy", "fsdp", "--fp8-param-gather"]
LAYOUTS = {
    **{f"fsdp2-{recipe}": (2, recipe, []) for recipe in PARAM_GATHER_RECIPES},
    "tp2_fsdp2-delayed": (4, "delayed", ["--tensor-model-parallel-size", "2"]),
}


def fsdp_param_gather_job(
    argv: list[str], steps: int, sabotage: bool = False, directory: str | None = None
) -> dict:
    """Losses, whole parameters and scaling state after `steps` steps, and what travelled:
    the bytes FSDP2 all-gathered for the FP8 layers' shards, whether every FP8 GEMM read a
    gathered FP8 weight, and how often a forward cast a weight itself. `sabotage`: each rank
    scales its rows of a weight by their own amax, as a shard-unaware cast would."""
    trainer = _setup(argv)
    fp8_parameters = trainer.data_parallel.fp8_parameters
    if sabotage:
        fp8_parameters.shard_group = ONE_DEVICE
    gathered, reads, weight_casts = [], [], []
    pre_all_gather = Fp8ShardWeight.fsdp_pre_all_gather

    def recording(self, mesh, outer_size, outer_stride, module, mp_policy):
        inputs, metadata = pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)
        gathered.append((inputs[0].dtype, inputs[0].numel(), self._tensor.numel()))
        return inputs, metadata

    Fp8ShardWeight.fsdp_pre_all_gather = recording
    for layer in fp8_layers(trainer.model_chunks):
        state = layer.fp8
        read, cast = state.gathered_fp8, state.cast
        state.gathered_fp8 = lambda w, read=read: (reads.append(w.__class__), read(w))[1]
        state.cast = lambda index, t, cast=cast: (weight_casts.append(index == 1), cast(index, t))[
            1
        ]
    try:
        result = train_steps(trainer, steps, _weights_and_scaling, directory)
    finally:
        Fp8ShardWeight.fsdp_pre_all_gather = pre_all_gather
    named = trainer.layout_independent_parameters()
    count = sum(param.numel() for _, param in named)
    measured = measure_bytes_per_parameter(named, trainer.data_parallel).parameters * count
    estimated = estimate_stage(trainer.config, trainer.parallel.pp.rank).parameters
    return result | {
        "parameter_bytes": (measured, estimated),
        "gathered": gathered,
        "reads": set(reads),
        "weight_casts": sum(weight_casts),
        "rank": trainer.parallel.dp.rank,
        "line": trainer.fp8.describe(),
    }


def _assert_gathered_in_fp8(results: list[dict]) -> None:
    """FSDP2 gathered the FP8 layers' shards as one byte an element (uint8, the rows and any
    padding), and the GEMMs read only gathered FP8 weights and cast no weight themselves."""
    for result in results:
        assert result["gathered"], "no FP8 shard was all-gathered"
        for dtype, numel, rows in result["gathered"]:
            assert dtype == torch.uint8 and numel >= rows
        assert result["reads"] == {Fp8GatheredWeight} and result["weight_casts"] == 0
        assert "all-gathered in FP8" in result["line"]
        # the fp32 shards and the FP8 copies of their rows, as the memory estimate says
        measured, estimated = result["parameter_bytes"]
        assert abs(measured - estimated) <= 0.02 * measured, (measured, estimated)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp2_fp8_param_gather_matches_one_device(tmp_path, layout):
    """In fp32 each rank casts its rows of a weight with the scale of the whole weight (the
    amax of every rank's rows; blockwise, of each 128 x 128 block), so FSDP2 gathers exactly
    the FP8 bytes one device casting the fp32 weight gets: the run matches the one-device run
    without the flag, as FSDP2 without it does (tests/parallel/test_fp8.py)."""
    world_size, recipe, flags = LAYOUTS[layout]
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe]
    layout_argv = argv + FSDP_PARAM_GATHER + flags
    results, reference = stepwise_parity(
        world_size, fsdp_param_gather_job, layout_argv, argv, tmp_path
    )
    _assert_gathered_in_fp8(results)
    assert_match_one_device(results, reference, recipe)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_uneven_fsdp2_shards_gather_the_bytes_of_the_run_without_the_flag(recipe):
    """Three ranks cut the weights unevenly (a 64-row weight into 22, 22 and 20 rows; FSDP2
    pads the last shard with zero rows, which travel too): in fp32 the run is bitwise the
    FSDP2 run without the flag, whose forward casts each gathered fp32 weight itself. (Three
    ranks' fp32 gradient sums move both a hair from one device: ~1e-5 over 10 steps.)"""
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe] + ["--global-batch-size", "12"]
    argv += ["--distributed-strategy", "fsdp"]
    gathered = run_distributed(3, fsdp_param_gather_job, argv + ["--fp8-param-gather"], 10)
    _assert_gathered_in_fp8(gathered)
    assert any(numel > rows for _, numel, rows in gathered[-1]["gathered"])  # the padding
    plain = run_distributed(3, fp8_train_job, argv, 10)
    for with_flag, without in zip(gathered, plain):
        assert with_flag["losses"] == without["losses"]
        for name, value in without["params"].items():
            assert np.array_equal(with_flag["params"][name], value), name


def test_fsdp2_fp8_param_gather_without_the_shard_amax_reduction_differs(tmp_path):
    """The negative control: FSDP2 ranks that scale their rows of a weight by their own amax
    cast the two halves of one weight differently, and the steps leave one device's."""
    argv = LLAMA_STYLE + TRAINING + RECIPES["tensorwise"]
    results, reference = stepwise_parity(
        2, fsdp_param_gather_job, argv + FSDP_PARAM_GATHER, argv, tmp_path, True
    )
    worst, _ = _differences(results, reference)
    assert worst > 10 * LOSS_TOLERANCE


def test_fsdp2_fp8_param_gather_resumes_bitwise(tmp_path):
    """Saved after three steps (the fp32 shards, as without the flag, and the delayed
    histories) and resumed in bf16: the next losses and the final weights are the
    uninterrupted run's, bitwise (the FP8 copies are cast again from the loaded shards)."""
    argv = LLAMA_STYLE + TRAINING + RECIPES["delayed"] + FSDP_PARAM_GATHER + ["--bf16"]
    result = run_distributed(2, _resume_job, argv, str(tmp_path / "ckpt"))[0]
    assert result["resumed_losses"] == result["straight"]["losses"][3:]
    for name, value in result["resumed_params"].items():
        assert np.array_equal(value, result["straight"]["params"][name]), name
