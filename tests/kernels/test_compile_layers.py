"""--compile-layers (each transformer layer one torch.compile'd graph) computes the eager
model's function: logits, loss and every gradient within 1e-5, alone, with recomputation
inside and around the compiled layers, and under TP=2 with sequence parallelism and PP=2,
where the collectives run eager between compiled graphs."""

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import (
    FP8_STEP_VARIANTS,
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    assert_close_dicts,
    assert_losses_close,
    assert_matches_reference,
    gradient_job,
    relative_error,
    train_job,
)
from threefold.kernels.dispatch import KERNELS

LLAMA = LLAMA_STYLE + TRAINING


@pytest.fixture(autouse=True)
def _fresh_compiler():
    # Each test compiles afresh: dynamo's per-function cache would otherwise fill up over the
    # session's many configurations and quietly fall back to eager.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_matches_eager(argv):
    expected = gradient_job(argv)
    actual = gradient_job(argv + ["--compile-layers"])
    assert relative_error(actual["logits"], expected["logits"]) <= 1e-5
    assert abs(actual["loss"] - expected["loss"]) <= 1e-6 * abs(expected["loss"])
    assert_close_dicts(actual["grads"], expected["grads"], 1e-5, "gradient")


@pytest.mark.parametrize("style", [GPT2_STYLE, LLAMA_STYLE], ids=["gpt2", "llama"])
def test_compiled_layers_match_the_eager_model(style):
    _compiled_matches_eager(style + TRAINING)


def test_compiled_layers_are_one_graph_each():
    from tests.parity import _setup

    trainer = _setup(LLAMA + ["--compile-layers"])
    layer = trainer.model.decoder.layers[0]
    hidden = torch.randn(16, 2, 32, requires_grad=True)
    rotary = trainer.model.rotary_pos_emb(16, hidden.device)
    explained = torch._dynamo.explain(layer._call_impl)(hidden, rotary)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_selective_recompute_inside_compiled_layers():
    # The recomputed core attention runs eager between two compiled graphs.
    _compiled_matches_eager(LLAMA + ["--recompute-granularity", "selective"])


def test_tensor_parallel_with_sequence_parallel_and_compiled_layers():
    reference = gradient_job(LLAMA)
    argv = LLAMA + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--compile-layers"]
    for result in run_distributed(2, gradient_job, argv):
        assert relative_error(result["logits"], reference["logits"]) <= 1e-5
        assert_close_dicts(result["grads"], reference["grads"], 1e-5, "gradient")


def test_pipeline_parallel_with_full_recompute_and_compiled_layers():
    reference = train_job(LLAMA, 10)
    argv = LLAMA + [
        "--pipeline-model-parallel-size",
        "2",
        "--compile-layers",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ]
    assert_matches_reference(run_distributed(2, train_job, argv, 10), reference, 1e-5)


@pytest.mark.parametrize("recipe", FP8_STEP_VARIANTS.values(), ids=FP8_STEP_VARIANTS)
def test_fp8_layers_compiled_train_as_eager_ones(recipe):
    """FP8 GEMMs inside compiled layers, over three steps of four micro-batches: the step's
    cached FP8 weights (first micro-batch casts, the rest read) and the delayed scales' first
    step and history, train as eager ones, to the FP8 layouts' tolerances
    (tests/parallel/test_fp8.py): the compiled fp32 ops around the FP8 linears (which run eager)
    round differently, and that can tip an FP8 cast over a rounding boundary (E4M3 gradients,
    --fp8-format e4m3, tip most: a median tensor 2e-4 off after three steps). Compiled, and
    within dynamo's recompile limit (a fallback to eager would also pass, so it is counted)."""
    from torch._dynamo.utils import counters

    argv = LLAMA + recipe
    eager = train_job(argv, 3)
    counters.clear()
    compiled = train_job(argv + ["--compile-layers"], 3)
    assert "each torch.compile'd, its FP8 linears eager between" in KERNELS.description
    assert_losses_close(compiled["losses"], eager["losses"], 1e-6)
    assert_close_dicts(compiled["params"], eager["params"], 1e-3, "parameter")
    errors = [relative_error(compiled["params"][n], eager["params"][n]) for n in eager["params"]]
    assert np.median(errors) <= 1e-6
    assert sum(counters["frames"].values()) > 0 and not counters["recompile_limit"]


def test_fp8_layers_compiled_under_pipeline_parallelism():
    """PP=2 with compiled FP8 layers: 1F1B runs the next micro-batch's forward before the last
    one's backward, which a backward reading the FP8 state as saved tensors could not take."""
    argv = LLAMA + ["--fp8-format", "hybrid", "--pipeline-model-parallel-size", "2"]
    eager = run_distributed(2, train_job, argv, 3)
    compiled = run_distributed(2, train_job, argv + ["--compile-layers"], 3)
    for got, expected in zip(compiled, eager):
        assert_losses_close(got["losses"], expected["losses"], 1e-6)
