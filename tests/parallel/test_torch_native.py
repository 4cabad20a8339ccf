"""PyTorch DDP and FSDP2 fallbacks (`--distributed-strategy`) reproduce the single-process run,
hold the memory their sharding predicts, and `auto` explains its choice."""

import dataclasses

import pytest

from tests.distributed import run_distributed
from tests.parity import (
    DP_TOLERANCE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_matches_reference,
    train_job,
)
from threefold.arguments import parse_args
from threefold.config import ConfigError
from threefold.training.memory import measure_bytes_per_parameter
from threefold.training.memory_estimate import estimate_memory
from threefold.training.strategy import choose_strategy


@pytest.fixture(scope="module")
def reference():
    return train_job(LLAMA_STYLE + TRAINING, 10)


def _bytes_job(argv: list[str]) -> dict:
    trainer = _setup(argv)
    trainer.train_step()
    return measure_bytes_per_parameter(
        trainer.layout_independent_parameters(), trainer.data_parallel
    ).__dict__


@pytest.mark.parametrize(
    "strategy,flags",
    [
        ("ddp", ["--ddp-bucket-size", "2000"]),  # several of PyTorch DDP's buckets
        ("fsdp", []),
        ("fsdp", ["--torch-fsdp2-no-reshard-after-forward"]),  # ZeRO-2
    ],
    ids=["ddp", "fsdp", "fsdp-zero2"],
)
def test_ten_steps_with_clipping_match_single_process(reference, strategy, flags):
    results = run_distributed(
        2, train_job, LLAMA_STYLE + TRAINING + ["--distributed-strategy", strategy] + flags, 10
    )
    assert_matches_reference(results, reference, DP_TOLERANCE)


def _gathered_after_forward(argv: list[str]) -> list[bool]:
    """Whether each layer's parameters are still gathered (not DTensor shards) after a forward
    (the root's stay gathered either way: FSDP2 leaves its root's for the backward)."""
    from torch.distributed.tensor import DTensor

    trainer = _setup(argv)
    batch = next(trainer.train_iterator())
    trainer.model(batch["tokens"], labels=batch["labels"]).mean()
    layers = trainer.model.decoder.layers
    return [not isinstance(layer.self_attention.linear_qkv.weight, DTensor) for layer in layers]


def test_zero2_keeps_each_layers_parameters_gathered_until_its_backward():
    argv = LLAMA_STYLE + TRAINING + ["--distributed-strategy", "fsdp"]
    assert run_distributed(2, _gathered_after_forward, argv) == [[False, False]] * 2
    zero2 = run_distributed(
        2, _gathered_after_forward, argv + ["--torch-fsdp2-no-reshard-after-forward"]
    )
    assert zero2 == [[True, True]] * 2


def test_zero2_without_fsdp2_is_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + ["--torch-fsdp2-no-reshard-after-forward"])
    error = capsys.readouterr().err
    assert "shapes FSDP2: add --use-torch-fsdp2" in error and error.count("\n") == 1


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_inside_match_single_process(reference, strategy, sequence_parallel):
    """2D: FSDP2 (or DDP) over DP = 2, threefold's TP = 2 inside; ten steps with clipping."""
    flags = ["--distributed-strategy", strategy, "--tensor-model-parallel-size", "2"]
    flags += ["--sequence-parallel"] if sequence_parallel else []
    results = run_distributed(4, train_job, LLAMA_STYLE + TRAINING + flags, 10)
    assert_matches_reference(results, reference, DP_TOLERANCE)


@pytest.mark.parametrize("virtual", [None, 2], ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_pipeline_stages_inside_match_single_process(strategy, virtual):
    """FSDP2 (or DDP) over DP = 2 around each of PP = 2 stages, tied embeddings (their copies
    on the first and last stage summed); ten steps with clipping, two micro-batches per rank
    in 1F1B, or around each of two chunks per stage in the interleaved schedule (each chunk's
    gradients reduced in its own last backward of the step: with the stage's last backward
    alone, FSDP2's second chunk is off by 1e-4 at the second step)."""
    argv = [a for a in LLAMA_STYLE if a != "--untie-embeddings-and-output-weights"] + TRAINING
    if virtual:
        argv += ["--num-layers", "4"]
    reference = train_job(argv, 10)
    flags = ["--distributed-strategy", strategy, "--pipeline-model-parallel-size", "2"]
    flags += ["--num-virtual-stages-per-pipeline-rank", str(virtual)] if virtual else []
    results = run_distributed(4, train_job, argv + flags, 10)
    assert_matches_reference(results, reference, DP_TOLERANCE)


@pytest.mark.parametrize("strategy,expected", [("ddp", 16.0), ("fsdp", 8.0)])
def test_bytes_per_parameter(strategy, expected):
    # fp32 parameters, gradients and Adam moments: 4 + 4 + 8, all sharded over 2 ranks by FSDP.
    for measured in run_distributed(
        2, _bytes_job, LLAMA_STYLE + TRAINING + ["--distributed-strategy", strategy]
    ):
        assert abs(sum(measured.values()) - expected) <= 0.05 * expected, measured


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--use-distributed-optimizer"], "--use-distributed-optimizer"),
        (["--overlap-grad-reduce"], "--overlap-grad-reduce"),
        (["--ddp-bucket-size", "1000"], "--ddp-bucket-size"),
    ],
)
def test_fallbacks_refuse_megatron_only_layouts(capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(
            LLAMA_STYLE + TRAINING + ["--distributed-strategy", "fsdp"] + flags, world_size=4
        )
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def _config(hidden: int, layers: int, world_size: int = 8, flags: tuple = ()):
    heads = hidden // 128
    return parse_args(
        [
            "--num-layers",
            str(layers),
            "--hidden-size",
            str(hidden),
            "--num-attention-heads",
            str(heads),
            "--seq-length",
            "4096",
            "--swiglu",
            "--normalization",
            "RMSNorm",
            "--position-embedding-type",
            "rope",
            "--disable-bias-linear",
            "--vocab-size",
            "32000",
            "--untie-embeddings-and-output-weights",
            "--micro-batch-size",
            "1",
            "--bf16",
            "--mock-data",
            "--distributed-strategy",
            "auto",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
            *flags,
        ],
        world_size=world_size,
    )


GIB = 2**30


@pytest.mark.parametrize(
    "hidden,layers,expected",
    [
        (1024, 24, ("ddp", False)),  # ~0.4B parameters
        (3072, 26, ("megatron", True)),  # ~3B
        (8192, 48, ("fsdp", False)),  # ~39B
    ],
)
def test_auto_follows_the_rule_of_thumb_when_memory_allows(hidden, layers, expected):
    strategy, distributed, why = choose_strategy(_config(hidden, layers), 10_000 * GIB)
    assert (strategy, distributed) == expected
    assert "parameters" in why and "GiB" in why


def test_auto_shards_more_when_the_estimate_does_not_fit():
    # ~0.9B parameters: DDP by size, but 16 bytes/parameter do not fit in 12 GiB.
    strategy, distributed, why = choose_strategy(_config(2048, 16), 12 * GIB)
    assert (strategy, distributed) != ("ddp", False)
    assert "ddp would need" in why


@pytest.mark.parametrize(
    "experts,expected", [(4, ("megatron", False)), (32, ("megatron", True)), (256, ("fsdp", False))]
)
def test_auto_with_experts_takes_threefolds_data_parallelism_where_it_would_take_ddp(
    experts, expected
):
    """Mixture-of-experts: never DDP (it would average each expert's gradients with other
    experts'); the size rule and the memory budget otherwise as without experts, the experts
    counted whole (0.62B, 3.8B and 29B parameters: each expert 3 x 1024 x 1536 a layer)."""
    flags = ("--num-experts", str(experts), "--expert-model-parallel-size", "2")
    flags += ("--moe-ffn-hidden-size", "1536")
    config = _config(1024, 24, flags=flags)
    strategy, distributed, why = choose_strategy(config, 10_000 * GIB)
    assert (strategy, distributed) == expected, why


def test_auto_with_tensor_parallelism_stays_with_megatron():
    config = _config(1024, 24, flags=("--tensor-model-parallel-size", "2"))
    assert choose_strategy(config, 10_000 * GIB)[:2] == ("megatron", False)


def test_auto_refuses_an_explicit_distributed_optimizer():
    with pytest.raises(ConfigError):
        config = _config(1024, 24)
        config.parallel.use_distributed_optimizer = True
        config.parallel._finalize_strategy()


def test_auto_names_the_context_parallel_size_that_fits_a_long_sequence():
    # ~0.4B parameters at 64k tokens on 6 GiB devices: even FSDP does not fit, because the
    # activations, which no data-parallel strategy shards, dominate; CP=4 divides them.
    flags = ("--seq-length", "65536", "--max-position-embeddings", "65536")
    config = _config(1024, 24, world_size=8, flags=flags)
    strategy, distributed, why = choose_strategy(config, 6 * GIB)
    assert strategy == "fsdp" and "may still not fit; --context-parallel-size 4 would" in why

    def need(cp: int) -> float:
        layout = dataclasses.replace(config.parallel, context_parallel_size=cp)
        candidate = dataclasses.replace(config, parallel=layout)
        return estimate_memory(candidate, strategy, distributed).total

    assert need(4) <= 0.9 * 6 * GIB < need(2)


def test_auto_counts_gated_delta_net_layers():
    # 18 of 24 layers gated delta nets with 16 query/key and 32 value heads of 128: each
    # projects to 12352 and back from 4096 features, 12.6M parameters more than attention's
    # 4h^2 at hidden 1024: 0.36B + 18 x 12.6M (model/test_gated_delta_net.py checks the count
    # against a built model).
    flags = ("--swiglu", "--experimental-attention-variant", "gated_delta_net")
    flags += ("--linear-attention-freq", "4")
    strategy, distributed, why = choose_strategy(_config(1024, 24, flags=flags), 10_000 * GIB)
    assert (strategy, distributed) == ("ddp", False) and "0.59B parameters" in why
