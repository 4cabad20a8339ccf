"""--recompute-modules (megatron-core's selective recomputation of chosen modules) changes
memory, not results: every module, alone and together, gives one process's gradients and
steps, with and without FP8; TP+SP x PP, EP x expert-TP x SP, TP with MLA and PP x EP (the
whole MoE layer recomputed, its all-to-alls run again in backward) train as one process;
the output-discarding modules (layernorm, moe_act, mla_up_proj) really free their outputs
(test_memory_estimate.py measures what each saves); bad combinations stop in one line."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.model.test_mla import MLA
from tests.parallel.test_expert_parallel import MOE
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    assert_close_dicts,
    assert_losses_close,
    assert_matches_reference,
    gradient_job,
    train_job,
)
from threefold.arguments import parse_args
from threefold.model.recompute import OutputDiscardingCheckpoint

SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]
SHARED = ["--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "2"]
MOE_MODEL = LLAMA_STYLE + TRAINING + MOE + SHARED
# Each model's modules: one at a time, then all that go together.
MODELS = {
    "llama": (LLAMA_STYLE + TRAINING, ["layernorm", "mlp", "core_attn"]),
    "moe": (MOE_MODEL, ["layernorm", "moe_act", "shared_experts"]),
    "moe-grouped": (MOE_MODEL + ["--moe-grouped-gemm"], ["moe_act"]),
    "moe-whole": (MOE_MODEL, ["moe"]),
    "mla": (MLA + TRAINING, ["mla_up_proj", "layernorm", "core_attn"]),
    "fp8": (LLAMA_STYLE + TRAINING + MOE + ["--fp8-format", "hybrid"], ["layernorm", "moe_act"]),
    "mla-fp8": (MLA + TRAINING + ["--fp8-format", "hybrid"], ["mla_up_proj"]),
}
# Recomputation only changes the order in which a tensor's gradient contributions are summed
# (the recomputed graph's, then the rest): fp32 rounding, 1e-7 relative.
TOLERANCE = 1e-6


@pytest.mark.parametrize("model", MODELS)
def test_each_module_gives_the_gradients_of_no_recomputation(model):
    argv, modules = MODELS[model]
    reference = gradient_job(argv)
    for chosen in [[m] for m in modules] + ([modules] if len(modules) > 1 else []):
        result = gradient_job(argv + SELECTIVE + chosen)
        assert result["loss"] == reference["loss"], chosen
        assert_close_dicts(result["grads"], reference["grads"], TOLERANCE, " ".join(chosen))


def test_modules_train_as_no_recomputation_over_steps():
    """moe with moe_act (inside a recomputed MoE layer the activation is not discarded: the
    layer's recomputation keeps only its input) and the dense layers' modules, four steps."""
    argv = MOE_MODEL + ["--moe-layer-freq", "[0,1]"]
    reference = train_job(argv, 4)
    modules = ["layernorm", "mlp", "moe", "moe_act", "core_attn"]
    result = train_job(argv + SELECTIVE + modules, 4)
    assert_losses_close(result["losses"], reference["losses"], TOLERANCE)
    assert_close_dicts(result["params"], reference["params"], TOLERANCE, "parameter")


LAYOUTS = {
    "tp2-sp-pp2": (
        LLAMA_STYLE + TRAINING,
        ["layernorm", "mlp", "core_attn"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--pipeline-model-parallel-size", "2"],
    ),
    "ep2-etp2-tp2-sp": (
        MOE_MODEL,
        ["layernorm", "moe_act", "shared_experts"],
        ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]
        + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ),
    "mla-tp2-dp2": (
        MLA + TRAINING,
        ["mla_up_proj", "layernorm", "core_attn"],
        ["--tensor-model-parallel-size", "2"],
    ),
    "moe-pp2-ep2": (
        MOE_MODEL + ["--moe-token-dispatcher-type", "alltoall"],
        ["moe", "layernorm"],
        ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_with_recomputed_modules_train_as_one_process(layout):
    argv, modules, flags = LAYOUTS[layout]
    reference = train_job(argv, 4)
    results = run_distributed(4, train_job, argv + SELECTIVE + modules + flags, 4)
    assert_matches_reference(results, reference, 1e-5)


def test_a_discarded_output_is_freed_and_refilled_before_its_consumers_backward():
    """The norm's output storage is empty between the consumer's forward and backward; the
    consumer's backward reads the recomputed values (its weight gradient is exact)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(8, 8, requires_grad=True)
    norm = torch.nn.RMSNorm(8)
    normed = norm(x)
    (normed @ weight).square().sum().backward()
    expected = (x.grad.clone(), weight.grad.clone(), norm.weight.grad.clone())
    for tensor in (x, weight, norm.weight):
        tensor.grad = None
    checkpoint = OutputDiscardingCheckpoint()
    normed = checkpoint.checkpoint(norm, x)
    out = normed @ weight
    checkpoint.discard_output_and_register_recompute(out)
    assert normed.untyped_storage().nbytes() == 0
    out.square().sum().backward()
    assert normed.untyped_storage().nbytes() == 4 * 8 * 4
    for got, want in zip((x.grad, weight.grad, norm.weight.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_default_and_notes(capsys):
    config = parse_args(LLAMA_STYLE + TRAINING + ["--recompute-granularity", "selective"])
    assert config.model.recompute_modules == ["core_attn"]
    assert config.model.recomputes("core_attn") and not config.model.recomputes("mlp")
    # as in Megatron-LM: modules without selective recomputation recompute nothing
    config = parse_args(LLAMA_STYLE + TRAINING + ["--recompute-modules", "mlp"])
    assert not config.model.recomputes("mlp")
    assert "--recompute-modules changes nothing" in capsys.readouterr().out
    # an empty list recomputes nothing
    config = parse_args(LLAMA_STYLE + TRAINING + SELECTIVE)
    assert not any(config.model.recomputes(m) for m in ("core_attn", "mlp", "layernorm"))
    parse_args(LLAMA_STYLE + TRAINING + SELECTIVE + ["moe_act", "core_attn"])
    assert "moe_act: the model has no such module" in capsys.readouterr().out
    parse_args(MOE_MODEL + SELECTIVE + ["moe", "shared_experts"])
    assert "shared_experts adds nothing" in capsys.readouterr().out


def test_the_deprecated_moe_layer_recompute_adds_moe_as_megatron_core_does(capsys):
    """--moe-layer-recompute (Megatron-LM's Llama 4 Maverick and DeepSeek-R1 configurations):
    selective recomputation with moe beside the modules given, or beside core_attn."""
    config = parse_args(MOE_MODEL + ["--moe-layer-recompute"])
    assert config.model.recompute_granularity == "selective"
    assert config.model.recompute_modules == ["core_attn", "moe"]
    assert "--moe-layer-recompute is deprecated" in capsys.readouterr().out
    config = parse_args(MOE_MODEL + ["--moe-layer-recompute"] + SELECTIVE + ["moe_act"])
    assert config.model.recompute_modules == ["moe_act", "moe"]
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    with pytest.raises(SystemExit):
        parse_args(MOE_MODEL + ["--moe-layer-recompute"] + full + ["--recompute-num-layers", "1"])
    error = capsys.readouterr().err
    assert "--moe-layer-recompute with --recompute-granularity full" in error
    assert error.count("\n") == 1


@pytest.mark.parametrize(
    "argv,named",
    [
        (LLAMA_STYLE + TRAINING + SELECTIVE + ["attention"], "--recompute-modules attention"),
        (LLAMA_STYLE + TRAINING + SELECTIVE + ["mhc"], "models threefold does not have"),
        (LLAMA_STYLE + TRAINING + SELECTIVE + ["mla_up_proj"], "--multi-latent-attention"),
        (
            MOE_MODEL
            + ["--moe-router-load-balancing-type", "global_aux_loss"]
            + SELECTIVE
            + ["moe"],
            "global_aux_loss",
        ),
        (LLAMA_STYLE + TRAINING + ["--compile-layers"] + SELECTIVE + ["layernorm"], "--compile"),
        (
            MLA + TRAINING + ["--lora-rank", "4", "--lora-dropout", "0.1"] + SELECTIVE,
            "--lora-dropout",
        ),
    ],
    ids=["unknown", "other-model", "no-mla", "global-aux-loss", "compile-layers", "lora-dropout"],
)
def test_refusals_are_one_line(capsys, argv, named):
    if named == "--lora-dropout":
        argv = argv + ["mla_up_proj"]
    with pytest.raises(SystemExit):
        parse_args(argv)
    error = capsys.readouterr().err
    assert named in error and "--recompute-modules" in error and error.count("\n") == 1
