"""FP8 training reproduces the single-process FP8 run in every layout, and its scaling state
checkpoints, reshards and resumes exactly (real gloo ranks; the FP8 GEMMs are torch._scaled_mm,
which the CPU runs exactly).

Layouts are compared a step at a time from the layout's own checkpoints (tests/parity.py:
FP8 rounding makes longer runs chaotic). Why these tolerances: a layout changes the order of
fp32 sums (TP's all-reduce, DP's gradient average), so within a step an activation or gradient
can land a hair on the other side of an FP8 rounding boundary, and that element moves by an
FP8 step (1/16 relative, E4M3). Each step's loss stays within ~1.4e-7 of one device's. The
parameters after it too (median tensor ~1e-8), except when such an element reaches Adam's first
steps, which divide by the root of few squared gradients: then (TP2 tensorwise, the step that
first moves the weights, on an AVX-512 Xeon) the median tensor is off by 1.25e-6 and the worst,
layer 0's attention projection, by 6.4e-4. A layout that scales any shard by its own amax
instead of the whole tensor's (the sabotaged runs) is off by 2e-5 to 6e-5 in some step's loss,
by 3e-3 to 1e-2 in the median tensor and by 8e-3 to 3e-2 in the worst: the bounds sit between.
"""

import os

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    _full,
    _setup,
    _without_key_bias,
    assert_close_dicts,
    assert_losses_close,
    merge_pipeline_stages,
    one_device_steps,
    one_thread,
    relative_error,
    train_steps,
)
from tests.training.test_checkpointing import _resume_job
from threefold.arguments import parse_args
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.save import save_checkpoint
from threefold.kernels.fp8 import Fp8Linear
from threefold.model.fp8 import fp8_states
from threefold.parallel.parallel_context import ONE_DEVICE
from threefold.parallel.tensor_parallel.mappings import COLLECTIVE_COUNTS

LOSS_TOLERANCE = 1e-6
PARAMETER_TOLERANCE = 3e-3  # the worst tensor
MEDIAN_PARAMETER_TOLERANCE = 1e-5
RECIPES = {
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    # a history longer than one step, and its maximum: the history itself must match
    "delayed": ["--fp8-format", "e4m3", "--fp8-amax-history-len", "3"]
    + ["--fp8-amax-compute-algo", "max"],
    # torchao's rowwise recipe: E4M3 everywhere
    "rowwise": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
    # TE's and DeepSeek-V3's; at these widths one block spans a row (weights: the whole
    # weight), and a layout's pieces lie inside it (tests/kernels/test_fp8_casts.py: blocks a
    # layout cuts)
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}
# --fp8-param-gather casts one copy of each weight (rowwise scaling casts two)
PARAM_GATHER_RECIPES = ["tensorwise", "delayed", "blockwise"]
# sequence-parallel inputs gathered in FP8: one scale per tensor
ONE_SCALE_RECIPES = ["tensorwise", "delayed"]
LAYOUTS = {
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2": (2, []),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp2_dp2_distributed_optimizer": (
        4,
        ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
    ),
    "torch_ddp2": (2, ["--distributed-strategy", "ddp"]),
    "torch_fsdp2": (2, ["--distributed-strategy", "fsdp"]),
}


def _scaling_state(trainer) -> dict[str, np.ndarray]:
    return {
        f"{name}.{field}": getattr(state, field).numpy().copy()
        for name, state in fp8_states(trainer.model_chunks).items()
        for field in ("scale", "amax_history")
    }


def _weights_and_scaling(trainer) -> dict:
    return {"params": _without_key_bias(_full(trainer), trainer), "fp8": _scaling_state(trainer)}


def fp8_train_job(
    argv: list[str], steps: int, sabotage: str | None = None, directory: str | None = None
) -> dict:
    """`train_job` plus the delayed-scaling state; with a `directory`, checkpointed before
    and recorded after every step (`train_steps`). `sabotage`: skip the amax
    reduction over TP x CP ("current": per GEMM; "delayed": at step end), as a layout-unaware
    FP8 would."""
    trainer = _setup(argv)
    if sabotage == "current":
        for module in trainer.model.modules():
            if isinstance(module, Fp8Linear):
                module.amax_group = ONE_DEVICE
    if sabotage == "delayed":
        trainer.fp8.parallel = type(trainer.parallel)(dp=trainer.parallel.dp)
    return train_steps(trainer, steps, _weights_and_scaling, directory)


# delayed scaling's history of 3 rolls over at the fourth step
STEPS = 5


def stepwise_parity(
    world_size: int,
    job,
    argv: list[str],
    reference_argv: list[str],
    directory,
    sabotage=None,
    record=_weights_and_scaling,
    setup=_setup,
) -> tuple[list[dict], dict]:
    """`job(argv, STEPS, sabotage, directory)` on `world_size` ranks, and one device's steps
    (`setup(reference_argv)`) from its checkpoints, recording what the job records
    (`record`)."""
    directory = str(directory)
    if world_size == 1:
        with one_thread():
            results = [job(argv, STEPS, sabotage, directory)]
    else:
        results = run_distributed(world_size, job, argv, STEPS, sabotage, directory)
    reference = one_device_steps(reference_argv, STEPS, directory, record, setup)
    return results, reference


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_layouts_match_one_device(tmp_path, recipe, layout):
    world_size, flags = LAYOUTS[layout]
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe]
    results, reference = stepwise_parity(world_size, fp8_train_job, argv + flags, argv, tmp_path)
    assert_match_one_device(results, reference, recipe)


def assert_match_one_device(results: list[dict], reference: dict, recipe: str) -> None:
    """Every rank's losses, and after each step (stepwise runs; else after the last) the
    merged parameters and every rank's delayed-scaling state (the single device's amax
    history and scales), within the tolerances above."""
    for result in results:
        assert_losses_close(result["losses"], reference["losses"], LOSS_TOLERANCE)
    if "after" not in reference:
        _assert_state_matches(results, reference, recipe)
    for step, expected in enumerate(reference.get("after", [])):
        _assert_state_matches([result["after"][step] for result in results], expected, recipe)


def step_errors(per_rank: list[dict], expected: dict) -> dict:
    """One step's relative errors against one device's: the farthest parameter tensor's
    (`worst`, named by `name`), the median tensor's, and the scaling state's (`state`: every
    rank's amax histories and scales); infinite where the names differ or ranks disagree."""
    try:
        params = merge_pipeline_stages([r["params"] for r in per_rank])
        assert params.keys() == expected["params"].keys(), "names differ"
    except AssertionError as differs:  # (or ranks hold unequal copies of a whole weight)
        return {"median": np.inf, "worst": np.inf, "name": str(differs), "state": np.inf}
    tensors = {n: relative_error(params[n], expected["params"][n]) for n in params}
    name = max(tensors, key=tensors.get)
    scaling = {}
    for result in per_rank:
        scaling |= result["fp8"]
    state = np.inf
    if scaling.keys() == expected["fp8"].keys():
        state = max((relative_error(v, expected["fp8"][k]) for k, v in scaling.items()), default=0)
    median = float(np.median(list(tensors.values())))
    return {"median": median, "worst": tensors[name], "name": name, "state": state}


def _assert_state_matches(per_rank: list[dict], expected: dict, recipe: str) -> None:
    errors = step_errors(per_rank, expected)
    assert errors["worst"] <= PARAMETER_TOLERANCE, errors
    assert errors["median"] <= MEDIAN_PARAMETER_TOLERANCE, errors
    assert errors["state"] <= (1e-5 if recipe == "delayed" else 0), errors


def _differences(results: list[dict], reference: dict) -> tuple[float, float]:
    """(the worst relative loss difference of a step, the worst step's median parameter
    tensor's relative error) of a stepwise run."""
    losses = zip(results[0]["losses"], reference["losses"])
    worst = max(abs(a - e) / abs(e) for a, e in losses)
    steps = enumerate(reference["after"])
    medians = [step_errors([r["after"][i] for r in results], e)["median"] for i, e in steps]
    return worst, max(medians)


# --no-fp8-wgrad: the weight gradients from the unquantized inputs; under SP those are gathered
# in the run's dtype (not FP8) and kept whole for the weight gradient.
UNQUANTIZED_WGRAD_LAYOUTS = [("tensorwise", "tp2_sp"), ("delayed", "dp2"), ("blockwise", "cp2")]


@pytest.mark.parametrize("recipe,layout", UNQUANTIZED_WGRAD_LAYOUTS)
def test_weight_gradients_in_the_runs_precision_match_one_device(tmp_path, recipe, layout):
    world_size, flags = LAYOUTS[layout]
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe]
    plain = fp8_train_job(argv, 3)["losses"]
    argv = argv + ["--no-fp8-wgrad"]
    assert fp8_train_job(argv, 3)["losses"] != plain  # the flag changes training
    results, reference = stepwise_parity(world_size, fp8_train_job, argv + flags, argv, tmp_path)
    assert_match_one_device(results, reference, recipe)


@pytest.mark.parametrize("recipe,sabotage", [("tensorwise", "current"), ("delayed", "delayed")])
def test_without_the_amax_reduction_tensor_parallel_fp8_differs(tmp_path, recipe, sabotage):
    """The negative control: the same TP=2 run whose ranks scale their shards by their own
    amaxes misses the tolerance the real one meets. (Rowwise scaling needs no reduction:
    tests/kernels/test_fp8_casts.py's power-of-two pieces.)"""
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe]
    flags = LAYOUTS["tp2_sp"][1]
    results, reference = stepwise_parity(2, fp8_train_job, argv + flags, argv, tmp_path, sabotage)
    worst, median = _differences(results, reference)
    assert worst > 10 * LOSS_TOLERANCE
    assert median > 100 * MEDIAN_PARAMETER_TOLERANCE
    with pytest.raises(AssertionError):  # (and the layouts' check says so)
        assert_match_one_device(results, reference, recipe)


def sequence_gather_job(argv: list[str], steps: int, in_fp8: bool) -> dict:
    """`fp8_train_job` and the bytes this rank all-gathered over TP; `in_fp8` off: the FP8
    layers gather their sequence-parallel inputs in the run's dtype and cast after."""
    COLLECTIVE_COUNTS.clear()
    trainer = _setup(argv)
    for module in trainer.model.modules():
        if isinstance(module, Fp8Linear):
            module.gathers_in_fp8 = module.gathers_in_fp8 and in_fp8
    losses = [trainer.train_step()[0] for _ in range(steps)]
    gathered = COLLECTIVE_COUNTS["all_gather:bytes"]
    line, rings = trainer.fp8.describe(), COLLECTIVE_COUNTS["in_ring_steps"]
    return {"losses": losses, "params": _full(trainer), "gathered": gathered, "line": line} | {
        "rings": rings
    }


def _layer_passes(argv: list[str], steps: int) -> tuple[int, int]:
    """(layers x micro-batches x `steps`: the layer forward and backward passes of a TP=2 run,
    the elements of one activation of a micro-batch's whole sequence)."""
    config = parse_args(argv, world_size=2)
    model, training = config.model, config.training
    micro_batches = training.global_batch_size // training.micro_batch_size
    elements = model.seq_length * training.micro_batch_size * model.hidden_size
    return model.num_layers * micro_batches * steps, elements


def _gathered_elements(argv: list[str], steps: int) -> int:
    """The elements of one kind of tensor a TP=2 SP run all-gathers in `steps` steps: two per
    layer pass (QKV's and fc1's inputs; or the gradients of the attention projection's and
    fc2's outputs)."""
    passes, elements = _layer_passes(argv, steps)
    return 2 * passes * elements


@pytest.mark.parametrize("recipe", ONE_SCALE_RECIPES)
def test_sequence_parallel_inputs_are_gathered_in_fp8(recipe):
    """Under SP, QKV's and fc1's inputs, and the gradients of the attention projection's and
    fc2's outputs, are cast on each rank and all-gathered as FP8 bytes: bitwise the training
    of gathering them in the run's dtype (fp32 here) and casting after, for 1 byte an element
    instead of 4 — the all-gathered bytes fall by exactly 3 per element of those inputs and
    gradients (two each per layer, per micro-batch)."""
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe] + LAYOUTS["tp2_sp"][1]
    steps = 2
    fp8, control = (run_distributed(2, sequence_gather_job, argv, steps, on)[0] for on in (1, 0))
    assert fp8["losses"] == control["losses"]
    assert_close_dicts(fp8["params"], control["params"], 0.0, "parameter")
    assert control["gathered"] - fp8["gathered"] == 3 * 2 * _gathered_elements(argv, steps)
    assert (
        "; sequence-parallel inputs and row-parallel gradients all-gathered in FP8;"
        in (fp8["line"])
    )


@pytest.mark.parametrize(
    "recipe,tp,extra",
    [
        ("tensorwise", 2, []),
        ("delayed", 4, []),
        ("blockwise", 4, []),
        ("delayed", 4, ["--no-fp8-wgrad"]),
    ],
    ids=["tensorwise-2", "delayed-4", "blockwise-4", "delayed-4-no-fp8-wgrad"],
)
def test_overlapped_fp8_layers_match_one_device(tmp_path, recipe, tp, extra):
    """--tp-comm-overlap with FP8 layers (kernels/fp8_sequence_parallel.py): each
    sequence-parallel collective a ring of slices or partial sums around the slices' FP8
    GEMMs, a step at a time as one device (--no-fp8-wgrad: slices in the run's dtype, each
    cast as it arrives with the whole tensor's scale)."""
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe] + extra
    flags = ["--tensor-model-parallel-size", str(tp), "--sequence-parallel", "--tp-comm-overlap"]
    results, reference = stepwise_parity(tp, fp8_train_job, argv + flags, argv, tmp_path)
    assert_match_one_device(results, reference, recipe)


@pytest.mark.parametrize(
    "recipe,extra",
    [
        ("tensorwise", []),
        ("rowwise", []),
        ("blockwise", ["--no-fp8-wgrad"]),
        ("delayed", ["--no-fp8-wgrad"]),
    ],
    ids=["tensorwise", "rowwise", "blockwise-no-fp8-wgrad", "delayed-no-fp8-wgrad"],
)
def test_overlapped_fp8_layers_train_as_the_plain_ones(recipe, extra):
    """With the overlap, TP=2 trains as without it, every linear layer's collective in ring
    steps (4 forward + 4 backward per layer and micro-batch; the output layer's 2, in the
    run's dtype), gathering the bytes the plain layers gather: FP8 with one scale per tensor;
    rowwise and blockwise slices, and --no-fp8-wgrad's (whose weight gradients take the
    gathered tensors unquantized), in the run's dtype, each cast as it arrives (delayed: the
    first step's slices with the whole tensor's amax reduced before the ring, the second's
    with the history's scale). Bitwise on the
    CPUs this was written on (a reduce-scatter of two ranks adds one pair either way); the
    module's tolerances because each slice's GEMM has half the rows of the plain layer's,
    which another CPU's BLAS may block, and so sum, otherwise."""
    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe] + extra + LAYOUTS["tp2_sp"][1]
    steps = 2
    overlapped, plain = (
        run_distributed(2, sequence_gather_job, argv + overlap, steps, True)[0]
        for overlap in (["--tp-comm-overlap"], [])
    )
    assert_losses_close(overlapped["losses"], plain["losses"], LOSS_TOLERANCE)
    assert_close_dicts(overlapped["params"], plain["params"], PARAMETER_TOLERANCE, "parameter")
    errors = [relative_error(overlapped["params"][n], plain["params"][n]) for n in plain["params"]]
    assert np.median(errors) <= MEDIAN_PARAMETER_TOLERANCE
    assert plain["gathered"] == overlapped["gathered"]
    in_fp8 = recipe in ONE_SCALE_RECIPES and "--no-fp8-wgrad" not in extra
    passes = _layer_passes(argv, steps)[0]
    output_layer = 2 * passes // parse_args(argv, world_size=2).model.num_layers  # (run's dtype)
    assert (plain["rings"], overlapped["rings"]) == (0, 8 * passes + output_layer)
    assert ("gradients all-gathered in FP8, in ring steps" in overlapped["line"]) == in_fp8
    assert "in ring steps beside their GEMMs" in overlapped["line"]


@pytest.mark.parametrize(
    "world_size,layout",
    [
        (2, ["--tensor-model-parallel-size", "2"]),
        (2, ["--use-distributed-optimizer", "--bf16"]),
        (
            2,
            [
                "--use-distributed-optimizer",
                "--fp8-param-gather",
                "--bf16",
                "--overlap-param-gather",
            ],
        ),
    ],
)
def test_fp8_save_and_resume_is_bitwise_identical(tmp_path, world_size, layout):
    argv = LLAMA_STYLE + TRAINING + RECIPES["delayed"] + layout
    result = run_distributed(world_size, _resume_job, argv, str(tmp_path / "ckpt"))[0]
    assert result["resumed_losses"] == result["straight"]["losses"][3:]
    assert_close_dicts(result["resumed_params"], result["straight"]["params"], 0.0, "parameter")


def _compiled_resume_job(argv: list[str], directory: str) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # this worker's earlier compiles could fill dynamo's cache
    counters.clear()
    result = _resume_job(argv, directory)
    result["compiled_frames"] = sum(counters["frames"].values())
    result["fell_back"] = bool(counters["recompile_limit"])
    return result


def test_compiled_fp8_save_and_resume_is_bitwise_identical(tmp_path):
    """FP8 linears traced into compiled layers (delayed scaling, one process): resumed after three
    steps, the next three losses and the final weights are the uninterrupted run's, bitwise
    (the resumed run starts from the loaded history, in the graph the straight run reaches
    at its second step). Traced with aot_eager (the graphs inductor would compile, run op by
    op: the state they carry is the point here; tests/kernels/test_compile_layers.py's)."""
    argv = LLAMA_STYLE + TRAINING + RECIPES["delayed"] + ["--compile-layers"]
    argv += ["--compile-backend", "aot_eager"]
    result = _compiled_resume_job(argv, str(tmp_path / "ckpt"))
    torch._dynamo.reset()
    assert result["compiled_frames"] > 0 and not result["fell_back"]
    assert result["resumed_losses"] == result["straight"]["losses"][3:]
    assert_close_dicts(result["resumed_params"], result["straight"]["params"], 0.0, "parameter")


def _three_steps_then_stepwise(argv: list[str], directory: str) -> dict:
    """Three steps, then three more a step at a time, each from a checkpoint
    (`directory`/0, /1, /2: `train_steps`): the losses, and the scaling state after each."""
    trainer = _setup(argv)
    for _ in range(3):
        trainer.train_step()
    save_checkpoint(os.path.join(directory, "0"), trainer.checkpoint_components())
    return train_steps(trainer, 3, lambda trainer: {"fp8": _scaling_state(trainer)}, directory)


def test_fp8_state_reshards_from_tp2_pp2_to_one_device(tmp_path):
    """Saved at TP=2 x PP=2, loaded on one device: every layer's history and scales are the
    saved ones, and each next step's loss and state are the 4-rank run's (a step at a time
    from its checkpoints, as the layouts above: FP8 rounding makes longer runs chaotic)."""
    directory = str(tmp_path / "ckpt")
    argv = LLAMA_STYLE + TRAINING + RECIPES["delayed"]
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    saved = run_distributed(4, _three_steps_then_stepwise, argv + layout, directory)
    with one_thread():
        for step in range(3):
            resumed = _setup(argv)
            fresh_state = _scaling_state(resumed)
            path = os.path.join(directory, str(step))
            assert load_checkpoint(path, resumed.checkpoint_components()) == 3 + step
            loaded = _scaling_state(resumed)
            assert all(state.has_history for state in fp8_states(resumed.model_chunks).values())
            assert any(not np.array_equal(loaded[k], fresh_state[k]) for k in loaded)
            loss = resumed.train_step()[0]
            # (the last pipeline stage's losses are the run's)
            assert_losses_close([loss], saved[-1]["losses"][step : step + 1], LOSS_TOLERANCE)
            merged = {}
            for result in saved:
                merged |= result["after"][step]["fp8"]
            assert_close_dicts(_scaling_state(resumed), merged, 1e-5, "fp8 state")
