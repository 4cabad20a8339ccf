"""--fp8-param-gather under the distributed optimizer: the FP8 layers' weights cast from their
fp32 masters once per step and all-gathered as FP8 bytes, stored in FP8 only, match the
one-device FP8 run in every layout within tests/parallel/test_fp8.py's tolerances, and
checkpoint in the run's dtype (FSDP2's: tests/parallel/test_fp8_fsdp.py; docs/fp8.md).
"""

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.model.test_mla import MLA
from tests.parallel.test_fp8 import (
    LAYOUTS,
    LOSS_TOLERANCE,
    PARAM_GATHER_RECIPES,
    RECIPES,
    STEPS,
    _differences,
    _scaling_state,
    assert_match_one_device,
    fp8_train_job,
    stepwise_parity,
)
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    _full,
    _setup,
    _without_key_bias,
    assert_close_dicts,
    one_thread,
    train_steps,
)
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.save import save_checkpoint
from threefold.kernels.dispatch import KERNELS
from threefold.model.fp8_params import dequantized as fp8_dequantized
from threefold.parallel.parallel_context import ONE_DEVICE
from threefold.parallel.tensor_parallel.sharding import (
    gather_tensor_parallel,
    is_expert,
    sharding_group,
)

PARAM_GATHER = ["--use-distributed-optimizer", "--fp8-param-gather"]
PARAM_GATHER_LAYOUTS = {
    "one_device": (1, PARAM_GATHER),
    # a weight stored in FP8 has no gradient of its own: it goes into main_grad regardless
    "one_device_unfused": (1, PARAM_GATHER + ["--no-gradient-accumulation-fusion"]),
    "dp2": (2, PARAM_GATHER),
    # the optimizer's shards split over the CP ranks; the stages' buffers on their own
    "cp2": (2, PARAM_GATHER + ["--context-parallel-size", "2"]),
    "pp2": (2, PARAM_GATHER + ["--pipeline-model-parallel-size", "2"]),
    "tp2_dp2_overlap": (
        4,
        PARAM_GATHER
        + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "2000"],
    ),
}


def _full_masters(trainer) -> dict[str, np.ndarray]:
    """The distributed optimizer's fp32 masters, whole: each rank's pieces summed over the
    ranks sharing the buffer (each element is on one of them; an expert's: over expert DP; of
    one optimizer instance, which holds them all), then gathered over TP."""
    optimizer, parallel = trainer.data_parallel.optimizer, trainer.parallel
    flat = {param: torch.zeros(param.numel()) for param in optimizer.model_params}
    for piece in optimizer.pieces:
        flat[piece.param][piece.start : piece.end] = piece.master.detach().float()
    masters = {}
    for name, param in trainer.layout_independent_parameters():
        if param not in flat:  # (no master: a router's expert bias, which a rule updates)
            masters[name] = param.detach().float().numpy().copy()
            continue
        sharers = parallel.expert_dp_intra if is_expert(param) else parallel.dp_cp_intra
        whole = sharers.all_reduce(flat[param]).view(param.shape)
        masters[name] = (
            gather_tensor_parallel(whole, param, sharding_group(param, parallel)).numpy().copy()
        )
    return _without_key_bias(masters, trainer)


def _masters_and_scaling(trainer) -> dict:
    return {"params": _full_masters(trainer), "fp8": _scaling_state(trainer)}


def param_gather_job(
    argv: list[str], steps: int, sabotage: bool = False, directory: str | None = None
) -> dict:
    """`fp8_train_job` for --fp8-param-gather, with the fp32 masters as the parameters, and
    what the forward read: how often it cast a weight to FP8 itself, and whether each
    parameter holds its gathered FP8 copy. `sabotage`: each rank scales its pieces of a weight
    by their own amax, as a shard-unaware cast would."""
    trainer = _setup(argv)
    fp8_parameters = trainer.data_parallel.fp8_parameters
    if sabotage:
        fp8_parameters.shard_group = ONE_DEVICE
    weight_casts = []
    for state in fp8_parameters.states.values():
        for name in ("cast", "cast_fine"):  # (the weight's: tensorwise, delayed; rowwise)
            cast = getattr(state, name)
            setattr(
                state,
                name,
                lambda index, tensor, cast=cast: (
                    weight_casts.append(index == 1),
                    cast(index, tensor),
                )[1],
            )
    blocks = KERNELS.fp8_cast_blocks  # (blockwise: its weights' 128 x 128 blocks)
    KERNELS.fp8_cast_blocks = lambda tensor, dtype, limit, margin, rows: (
        weight_casts.append(rows > 1),
        blocks(tensor, dtype, limit, margin, rows),
    )[1]
    try:
        result = train_steps(trainer, steps, _masters_and_scaling, directory)
    finally:
        KERNELS.fp8_cast_blocks = blocks
    trainer.data_parallel.finish_param_gather()  # (--overlap-param-gather: the next forward's)
    with trainer.data_parallel.parameters_in_model_dtype():
        dequantized = all(
            param.dtype == fp8_parameters.model_dtype
            and torch.equal(param.float(), fp8_dequantized(state))
            for param, state in fp8_parameters.states.items()
        )
    # (after the context too: it stores them in FP8 again)
    stored_in_fp8 = all(
        param.dtype == torch.float8_e4m3fn and param.data_ptr() == state.gathered[1].data_ptr()
        for param, state in fp8_parameters.states.items()
    )
    return result | {
        "weights_cast_in_forward": sum(weight_casts),
        "casts_in_forward": len(weight_casts),
        "flat_dtype": str(fp8_parameters.buffer.param_buffer.dtype),
        "stored_in_fp8": stored_in_fp8,
        "dequantized": dequantized,
    }


@pytest.mark.parametrize("recipe", PARAM_GATHER_RECIPES)
@pytest.mark.parametrize("layout", PARAM_GATHER_LAYOUTS)
def test_fp8_param_gather_matches_one_device(tmp_path, recipe, layout):
    """--fp8-param-gather in fp32 casts each weight from its fp32 master with the scale of the
    whole weight: the same FP8 values a forward casting the fp32 weight gets, so on one device
    it trains bitwise as the run without the flag, and every layout (DP, CP, PP, TP x DP with
    both overlaps) takes each step as one device does. The forward reads the gathered FP8
    weights (and casts only inputs and gradients), which travel as E4M3 bytes and are the FP8
    weights' only storage, dequantized on request (`parameters_in_model_dtype`)."""
    world_size, flags = PARAM_GATHER_LAYOUTS[layout]
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe]
    results, reference = stepwise_parity(
        world_size,
        param_gather_job,
        argv + flags,
        argv + PARAM_GATHER,
        tmp_path,
        record=_masters_and_scaling,
    )
    if world_size == 1:  # the same arithmetic in the same order: bitwise
        with one_thread():
            plain = fp8_train_job(argv, STEPS)
        assert results[0]["losses"] == plain["losses"]
        assert_close_dicts(results[0]["params"], plain["params"], 0.0, "master")
    for result in results:
        assert result["weights_cast_in_forward"] == 0 < result["casts_in_forward"]
        assert result["flat_dtype"] == "torch.float8_e4m3fn"
        assert result["stored_in_fp8"] and result["dequantized"]
    assert_match_one_device(results, reference, recipe)


def test_fp8_param_gather_sums_whole_weights_gradients_over_tp(tmp_path):
    """MLA's down projections are FP8 weights whole on every TP rank; under SP each rank's
    gradient is its part of the sequence's, summed over TP as the norms' are (without, the
    copies drifted 10% apart in three steps; merging the ranks' masters asserts them equal)."""
    argv = MLA + TRAINING + RECIPES["delayed"]
    layout, one = argv + PARAM_GATHER + LAYOUTS["tp2_sp"][1], argv + PARAM_GATHER
    record = _masters_and_scaling
    results, reference = stepwise_parity(2, param_gather_job, layout, one, tmp_path, record=record)
    assert_match_one_device(results, reference, "delayed")


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_param_gather_without_the_shard_amax_reduction_differs(tmp_path, recipe):
    """The negative control: DP=2 ranks that scale their optimizer shards of a weight by
    their own amax (of each block they touch) cast the two halves of one weight (of one
    block) differently."""
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe] + PARAM_GATHER
    results, reference = stepwise_parity(
        2, param_gather_job, argv, argv, tmp_path, True, record=_masters_and_scaling
    )
    worst, _ = _differences(results, reference)
    assert worst > 10 * LOSS_TOLERANCE


def _save_param_gather_run(argv: list[str], directory: str) -> dict:
    trainer = _setup(argv + ["--save", directory])
    for _ in range(3):
        trainer.train_step()
    save_checkpoint(directory, trainer.checkpoint_components())
    return {"params": _full(trainer)}


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_fp8_param_gather_checkpoints_hold_the_weights_in_the_runs_dtype(tmp_path, recipe):
    """--fp8-param-gather keeps its FP8 weights in FP8 only, yet its checkpoint holds them in
    bf16 — the dequantized values its GEMMs used (per tensor, or per block) — as any other
    run's: a DP2 checkpoint loads as weights into one device with and without the flag (with
    it, the optimizer takes its masters from the loaded weights, which it can only read in
    bf16), and both hold exactly the saved run's weights."""
    directory = str(tmp_path / "ckpt")
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe] + ["--bf16", "--use-distributed-optimizer"]
    saved = run_distributed(2, _save_param_gather_run, argv + ["--fp8-param-gather"], directory)
    expected = saved[0]["params"]
    for flags in ([], ["--fp8-param-gather"]):
        loaded = _setup(argv + flags)
        assert load_checkpoint(directory, loaded.checkpoint_components(), load_optimizer=False)
        assert_close_dicts(_full(loaded), expected, 0.0, "weight")
        if flags:
            masters = _without_key_bias(dict(expected), loaded)
            assert_close_dicts(_full_masters(loaded), masters, 0.0, "master")
            stored = loaded.data_parallel.fp8_parameters.states
            assert all(param.dtype == torch.float8_e4m3fn for param in stored)
