"""--compile-layers (each transformer layer one torch.compile'd graph) computes the eager
model's function: logits, loss and every gradient within 1e-5, alone, with recomputation
inside and around the compiled layers, and under TP=2 with sequence parallelism and PP=2,
where the collectives run eager between compiled graphs.

Inductor compiles each case's graphs to C++ here, half of this file's CPU time. What the
pipeline, tensor-parallel and most FP8 cases check is what dynamo and AOTAutograd make of the
layers (graphs, their backward, the state they read and write), so those trace with
--compile-backend aot_eager, which runs the same graphs op by op; one dense, one FP8 case per
kind and the opaque casts' (which exist for Inductor) compile with inductor."""

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
from threefold.kernels import dispatch
from threefold.kernels.dispatch import KERNELS

LLAMA = LLAMA_STYLE + TRAINING
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
AOT_EAGER = ["--compile-backend", "aot_eager"]  # (the module's docstring says why)


@pytest.fixture(autouse=True)
def _fresh_compiler():
    # Each test compiles afresh: dynamo's per-function cache would otherwise fill up over the
    # session's many configurations and quietly fall back to eager.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def opaque_fp8_casts(monkeypatch):
    """The FP8 casts inside compiled layers as opaque operators (kernels/fp8_ops.py), as where
    the run's casts are Triton (CUDA); here they run the CPU's eager casts."""
    configure = dispatch.configure

    def configure_opaque(*args, **kwargs):
        line = configure(*args, **kwargs)
        KERNELS.opaque_fp8_casts = True
        return line

    monkeypatch.setattr(dispatch, "configure", configure_opaque)
    yield
    KERNELS.opaque_fp8_casts = False


def _compiled_matches_eager(argv, backend=()):
    expected = gradient_job(argv)
    actual = gradient_job(argv + ["--compile-layers", *backend])
    assert relative_error(actual["logits"], expected["logits"]) <= 1e-5
    assert abs(actual["loss"] - expected["loss"]) <= 1e-6 * abs(expected["loss"])
    assert_close_dicts(actual["grads"], expected["grads"], 1e-5, "gradient")


@pytest.mark.parametrize(
    "style,backend", [(GPT2_STYLE, AOT_EAGER), (LLAMA_STYLE, [])], ids=["gpt2", "llama"]
)
def test_compiled_layers_match_the_eager_model(style, backend):
    _compiled_matches_eager(style + TRAINING, backend)


def _explained_layer(argv: list[str]):
    from tests.parity import _setup

    trainer = _setup(argv)
    layer = trainer.model.decoder.layers[0]
    hidden = torch.randn(16, 2, 32, requires_grad=True)
    rotary = trainer.model.rotary_pos_emb(16, hidden.device)
    return torch._dynamo.explain(layer._call_impl)(hidden, rotary)


def _fp8_gemms_traced(explained) -> int:
    """The custom autograd functions traced into the graphs whose forward is an FP8 GEMM (a
    torch._scaled_mm; blockwise on the CPU, casts to FP8 whose blocks are multiplied in fp32)."""
    forwards = (
        module
        for graph in explained.graphs
        for name, module in graph.named_children()
        if name.startswith("fwd_body")
    )
    return sum(
        any(
            "_scaled_mm" in str(node.target) or "float8" in str(node.args)
            for node in module.graph.nodes
        )
        for module in forwards
    )


def test_compiled_layers_are_one_graph_each():
    explained = _explained_layer(LLAMA + ["--compile-layers"])
    assert explained.graph_count == 1 and explained.graph_break_count == 0


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "rowwise", "blockwise"])
def test_fp8_linears_are_traced_into_the_compiled_layer(capsys, recipe):
    """QKV, output projection, fc1 and fc2 inside the layer's one graph: no break around them
    (the first step of delayed scaling, current scaling without TP, is traced too)."""
    argv = LLAMA + ["--compile-layers", "--fp8-format", "hybrid", "--fp8-recipe", recipe]
    explained = _explained_layer(argv)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert _fp8_gemms_traced(explained) == 4
    assert "traced into the compiled layers' graphs" in capsys.readouterr().out


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_opaque_fp8_casts_are_operators_of_the_compiled_layer(opaque_fp8_casts, recipe):
    """Where the casts are opaque, each FP8 linear's forward in the layer's one graph casts
    through kernels/fp8_ops.py's operators and traces no cast of its own for Inductor."""
    argv = LLAMA + ["--compile-layers", "--fp8-format", "hybrid", "--fp8-recipe", recipe]
    explained = _explained_layer(argv)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert _fp8_gemms_traced(explained) == 4
    for graph in explained.graphs:
        for name, module in graph.named_children():
            if name.startswith("fwd_body"):
                targets = [str(node.target) for node in module.graph.nodes]
                assert any(target.startswith("threefold.fp8_cast") for target in targets)
                assert not any(
                    "float8" in str(node.args) and not str(node.target).startswith("threefold.")
                    for node in module.graph.nodes
                    if "_scaled_mm" not in str(node.target)
                )


def _fp8_linears_traced(argv: list[str]) -> bool:
    from tests.parity import _setup
    from threefold.model.fp8 import fp8_states

    trainer = _setup(argv)
    return any(state.traced for state in fp8_states(trainer.model_chunks).values())


def test_fp8_linears_stay_eager_with_fp8_param_gather(capsys):
    """Its FP8 weight copies are found by the parameter's identity: a graph would be one per
    layer."""
    argv = LLAMA + ["--compile-layers", "--fp8-format", "hybrid", "--use-distributed-optimizer"]
    assert not _fp8_linears_traced(argv + ["--fp8-param-gather"])
    assert "eager between the compiled layers' graphs (--fp8-param-gather)" in (
        capsys.readouterr().out
    )


def test_compiled_layers_add_their_weight_gradients_into_the_buffer(monkeypatch):
    """--gradient-accumulation-fusion inside compiled layers: every weight-gradient GEMM of the
    layers adds into main_grad through the operator Inductor calls with main_grad itself (5
    per layer and micro-batch: QKV, projection, SwiGLU's gate and up blocks, fc2); the
    gradient buffer finds each of their placeholders flagged (by the traced forward: the
    second layer's, and the first's, which is fully recomputed, by the forward recomputed in
    backward) and discards it; two steps of four micro-batches train as the eager layers
    do."""
    import inspect

    from tests.parity import _setup
    from threefold.parallel.data_parallel.gradient_buffer import GradientBuffer
    from threefold.parallel.tensor_parallel import weight_grad

    add_product, accumulate = weight_grad._add_product, GradientBuffer._accumulate
    by_operator, unflagged = [], set()

    def counted_add_product(*args):
        by_operator.append(inspect.stack()[2].function == "_add_product_op")
        add_product(*args)

    def watched_accumulate(self, param):
        if not getattr(param, "grad_added_to_main_grad", False):
            unflagged.add(param)
        accumulate(self, param)

    monkeypatch.setattr(weight_grad, "_add_product", counted_add_product)
    monkeypatch.setattr(GradientBuffer, "_accumulate", watched_accumulate)
    runs = {}
    argv = LLAMA + ["--recompute-granularity", "full", "--recompute-method", "block"]
    argv += ["--recompute-num-layers", "1"]
    for name, flags in (("eager", []), ("compiled", ["--compile-layers"])):
        by_operator.clear()
        trainer = _setup(argv + flags)
        runs[name] = [trainer.train_step()[0] for _ in range(2)]
    assert "gradient buffer by their GEMM" in KERNELS.description
    assert sum(by_operator) == 2 * 5 * 4 * 2  # layers, GEMMs, micro-batches, steps
    layers = trainer.model.decoder.layers
    weights = {name for name, param in layers.named_parameters() if param in unflagged}
    assert weights == {
        f"{i}.{norm}"
        for i in (0, 1)
        for norm in ("input_layernorm.weight", "pre_mlp_layernorm.weight")
    }
    assert_losses_close(runs["compiled"], runs["eager"], 1e-6)


def test_selective_recompute_inside_compiled_layers():
    # The recomputed core attention runs eager between two compiled graphs.
    _compiled_matches_eager(LLAMA + ["--recompute-granularity", "selective"])


def test_tensor_parallel_with_sequence_parallel_and_compiled_layers():
    reference = gradient_job(LLAMA)
    argv = LLAMA + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--compile-layers"]
    argv += AOT_EAGER
    for result in run_distributed(2, gradient_job, argv):
        assert relative_error(result["logits"], reference["logits"]) <= 1e-5
        assert_close_dicts(result["grads"], reference["grads"], 1e-5, "gradient")


def test_pipeline_parallel_with_full_recompute_and_compiled_layers():
    reference = train_job(LLAMA, 10)
    argv = LLAMA + ["--pipeline-model-parallel-size", "2", "--compile-layers"] + FULL_RECOMPUTE
    argv += ["--recompute-num-layers", "1", *AOT_EAGER]
    assert_matches_reference(run_distributed(2, train_job, argv, 10), reference, 1e-5)


# and a weight gradient from the unquantized operands, inside the compiled backward. Not
# rowwise: its linears traced into the layer's graph are test_fp8_linears_are_traced_into_the_
# compiled_layer's, its compiled casts bitwise the eager ones test_fp8_casts.py's, and the rest
# of its step is tensorwise's (a scale per row instead of per tensor).
COMPILED_FP8_VARIANTS = {
    name: flags for name, flags in FP8_STEP_VARIANTS.items() if name != "rowwise"
} | {"tensorwise-unquantized-wgrad": FP8_STEP_VARIANTS["tensorwise"] + ["--no-fp8-wgrad"]}


@pytest.mark.parametrize("recipe", COMPILED_FP8_VARIANTS.values(), ids=COMPILED_FP8_VARIANTS)
def test_fp8_layers_compiled_train_as_eager_ones(recipe):
    backend = [] if recipe == FP8_STEP_VARIANTS["tensorwise"] else AOT_EAGER
    _fp8_compiled_trains_as_eager(recipe, backend)


def _fp8_compiled_trains_as_eager(recipe: list[str], backend: list[str]) -> None:
    """FP8 linears traced into compiled layers, over three steps of four micro-batches (the
    step's FP8 weights cast by the first micro-batch, or before the step) and the delayed scales'
    first step and history, train as eager ones, to the FP8 layouts' tolerances
    (tests/parallel/test_fp8.py): the compiled fp32 ops round differently, and that can tip
    an FP8 cast over a rounding boundary (E4M3 gradients, --fp8-format e4m3, tip most: a
    median tensor 2e-4 off after three steps). The amax histories and scales are each layer's
    own (one graph serves every layer). Compiled, and within dynamo's recompile limit (a
    fallback to eager would also pass, so it is counted)."""
    from torch._dynamo.utils import counters

    argv = LLAMA + recipe
    eager = train_job(argv, 3)
    counters.clear()
    compiled = train_job(argv + ["--compile-layers", *backend], 3)
    assert "each torch.compile'd as one graph" in KERNELS.description
    assert_losses_close(compiled["losses"], eager["losses"], 1e-6)
    assert_close_dicts(compiled["params"], eager["params"], 1e-3, "parameter")
    errors = [relative_error(compiled["params"][n], eager["params"][n]) for n in eager["params"]]
    assert np.median(errors) <= 1e-6
    assert sum(counters["frames"].values()) > 0 and not counters["recompile_limit"]
    assert compiled["fp8"].keys() == eager["fp8"].keys()
    assert_close_dicts(compiled["fp8"], eager["fp8"], 1e-5, "FP8 state")


def test_fp8_layers_with_opaque_casts_compiled_train_as_eager_ones(opaque_fp8_casts):
    """The same with the casts opaque operators (delayed: current scaling's first step, then
    the history's casts max-accumulating each step's amaxes in place; the blockwise cast's
    bytes through a compiled graph are test_fp8_casts.py's)."""
    _fp8_compiled_trains_as_eager(FP8_STEP_VARIANTS["delayed"], [])


def test_fp8_layers_compiled_under_pipeline_parallelism():
    """PP=2 with compiled FP8 layers: 1F1B runs the next micro-batch's forward before the last
    one's backward, which a backward reading the FP8 state as saved tensors could not take."""
    argv = LLAMA + ["--fp8-format", "hybrid", "--pipeline-model-parallel-size", "2"]
    eager = run_distributed(2, train_job, argv, 3)
    compiled = run_distributed(2, train_job, argv + ["--compile-layers", *AOT_EAGER], 3)
    for got, expected in zip(compiled, eager):
        assert_losses_close(got["losses"], expected["losses"], 1e-6)
    # eager between the compiled parts: a traced backward would find its saved state changed
    assert not any(run_distributed(2, _fp8_linears_traced, argv + ["--compile-layers"]))


def test_fp8_layers_compiled_under_tensor_parallelism():
    """TP=2 without sequence parallelism: delayed scaling's first step reduces each amax over
    TP, so those calls run eager; from the second step on they are traced. The losses and
    every layer's scaling state train as eager ones."""
    argv = LLAMA + ["--fp8-format", "hybrid", "--tensor-model-parallel-size", "2"]
    eager = run_distributed(2, train_job, argv, 3)
    compiled = run_distributed(2, train_job, argv + ["--compile-layers", *AOT_EAGER], 3)
    for got, expected in zip(compiled, eager):
        assert_losses_close(got["losses"], expected["losses"], 1e-6)
        assert_close_dicts(got["fp8"], expected["fp8"], 1e-5, "FP8 state")


def _fp8_storages_saved(trainer, batch) -> set[int]:
    """The FP8 storages one micro-batch's forward saves for backward."""
    saved: set[int] = set()

    def pack(tensor):
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            saved.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        (chunk,) = trainer.model_chunks
        output = chunk(batch["tokens"], labels=batch["labels"])
    del output
    return saved


@pytest.mark.parametrize("cast_for_the_step", [True, False], ids=["cast-for-the-step", "control"])
def test_traced_fp8_layers_read_the_weights_cast_once_for_the_step(
    opaque_fp8_casts, cast_for_the_step
):
    """A traced FP8 linear cannot keep what it casts, so the step's weights are cast before its
    first forward (`Fp8Scaling.weights_cached`) and each micro-batch's graph reads them. On an
    H100 a traced layer cast every weight for every micro-batch and kept each one's copy for
    backward (45 MiB per 1B layer). Here the FP8 tensors two micro-batches' graphs save include
    the step's transposed weight copies, one per linear, the same for both; the control, whose
    weights are not cast for the step, saves none of them (its graph casts its own)."""
    from tests.parity import _setup

    trainer = _setup(LLAMA + ["--compile-layers", "--fp8-format", "hybrid"])
    trainer.train_step()  # compiled; delayed scaling has its history from here on
    if not cast_for_the_step:
        trainer.fp8.traced_weights = {}
    batch = next(trainer.train_iterator())
    states = list(trainer.fp8.traced_weights.values()) or list(trainer.fp8.states.values())
    assert len(states) == 4 * 2  # QKV, proj, fc1, fc2 of two layers, all traced
    with trainer.fp8.weights_cached():
        saved = [_fp8_storages_saved(trainer, batch) for _ in range(2)]
        cached = [state.weight_cache for state in states]
    # each linear saves an FP8 copy of its input and one of its weight (transposed)
    assert len(saved[0]) == len(saved[1]) == 2 * len(states)
    if not cast_for_the_step:  # each graph casts and keeps its own weight copies
        assert cached == [None] * len(states) and not saved[0] & saved[1]
        return
    transposed = {cache[1].untyped_storage().data_ptr() for cache in cached}
    assert len(transposed) == len(states)
    assert saved[0] & saved[1] == transposed  # the step's copies; the inputs' each its own


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_traced_fp8_weight_gradients_are_written_by_a_steps_first_micro_batch(monkeypatch, recipe):
    """A traced FP8 linear's weight-gradient GEMM writes main_grad on the step's first
    micro-batch, while it holds the step's zeros, and adds on the others, as the eager path
    does (on an H100 a compiled layer added every micro-batch's: about 5.6 ms of the 1B FP8
    step). The graph cannot branch on that, so one operator decides as it runs, from the
    gradient buffer's flag: here, over two steps of four micro-batches, each of the 8 linears
    writes once a step and adds three times, and the run trains as the eager one does."""
    from threefold.kernels import fp8_gemms

    # the operator's GEMMs: into main_grad (`out`) or for an add; no other GEMM of the run
    # calls this module's scaled_mm (kernels/fp8.py calls its own import of it)
    written, scaled_mm = [], fp8_gemms.scaled_mm

    def watched(*args, out=None, **kwargs):
        written.append(out is not None)
        return scaled_mm(*args, out=out, **kwargs)

    monkeypatch.setattr(fp8_gemms, "scaled_mm", watched)
    argv = LLAMA + FP8_STEP_VARIANTS[recipe]
    eager = train_job(argv, 2)
    assert written == []  # the eager path writes through `write_weight_grad`
    backend = AOT_EAGER if recipe == "delayed" else []  # (the operator decides as it runs)
    compiled = train_job(argv + ["--compile-layers", *backend], 2)
    assert "each torch.compile'd as one graph" in KERNELS.description
    assert written == 2 * ([True] * 8 + [False] * 3 * 8)
    assert_losses_close(compiled["losses"], eager["losses"], 1e-6)
