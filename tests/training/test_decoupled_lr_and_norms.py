"""--decoupled-lr / --decoupled-min-lr, --log-params-norm and --log-num-zeros-in-grad: the
embeddings' and output layer's own schedule, and model-wide sums that count every parameter
element once in every layout."""

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import (
    DP_TOLERANCE,
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_matches_reference,
    train_job,
)
from threefold.training.logging import IterationStats, format_iteration

DECOUPLED = [
    "--decoupled-lr",
    "0.02",
    "--decoupled-min-lr",
    "0.001",
    "--min-lr",
    "0.0001",
    "--lr-decay-style",
    "cosine",
]


def test_decoupled_groups_follow_their_own_schedule():
    trainer = _setup(LLAMA_STYLE + TRAINING + DECOUPLED)
    names = {param: name for name, param in trainer.model.named_parameters()}
    for group in trainer.optimizer.param_groups:
        members = {
            names[piece.param]
            for piece in trainer.optimizer.pieces
            if any(piece.master is p for p in group["params"])
        }
        outer = {
            n for n in members if n.endswith(("word_embeddings.weight", "output_layer.weight"))
        }
        assert outer == (members if group["decoupled_lr"] else set()), members
    scheduler = trainer.scheduler
    for steps, lr, decoupled in ((1, 3e-3 / 2, 0.02 / 2), (2, 3e-3, 0.02), (10, 1e-4, 1e-3)):
        scheduler.num_steps = 0
        scheduler.step(steps)  # warm-up over 2 iterations, cosine decay to iteration 10
        for group in trainer.optimizer.param_groups:
            expected = decoupled if group["decoupled_lr"] else lr
            assert group["lr"] == pytest.approx(expected, rel=1e-12)


def test_decoupled_lr_zero_freezes_only_the_embeddings_and_output_layer():
    argv = LLAMA_STYLE + TRAINING + ["--decoupled-lr", "0", "--min-lr", "0"]
    trainer = _setup(argv)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for _ in range(3):
        trainer.train_step()
    for name, param in trainer.model.named_parameters():
        outer = name in ("embedding.word_embeddings.weight", "output_layer.weight")
        assert torch.equal(param, before[name]) == outer, name


def test_decoupled_min_lr_needs_decoupled_lr(capsys):
    from threefold.arguments import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(LLAMA_STYLE + TRAINING + ["--decoupled-min-lr", "0.1"])
    assert exit_info.value.code == 2
    assert "--decoupled-min-lr needs --decoupled-lr" in capsys.readouterr().err


def _norms_job(argv: list[str], steps: int) -> dict:
    trainer = _setup(argv)
    for _ in range(steps):
        trainer.train_step()
    model = trainer.config.model
    heads = model.num_attention_heads
    result = {
        "params_norm": trainer.optimizer.params_norm(),
        "num_zeros": trainer.optimizer.num_zeros_in_grad,
        # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared
        # by all keys): in floating point each entry may round to 0 or not, by layout.
        "key_bias_entries": model.num_layers
        * (model.num_query_groups or heads)
        * (model.kv_channels or model.hidden_size // heads)
        if model.add_bias_linear or model.add_qkv_bias
        else 0,
    }
    if torch.distributed.is_initialized():
        return result
    # Single process: the same sums written out over the whole model.
    params = [p.detach().float().reshape(-1) for p in trainer.model.parameters()]
    result["expected_params_norm"] = torch.cat(params).norm().item()
    # The buffer still holds the last step's reduced gradients.
    result["expected_num_zeros"] = sum(
        int((p.main_grad == 0).sum()) for p in trainer.data_parallel.grad_buffer.params
    )
    return result


NORMS = ["--log-params-norm", "--log-num-zeros-in-grad"]


def test_params_norm_and_zero_count_are_the_model_wide_sums():
    argv = GPT2_STYLE + TRAINING + NORMS
    result = _norms_job(argv, 2)
    assert result["params_norm"] == pytest.approx(result["expected_params_norm"], rel=1e-6)
    # Embedding rows of tokens absent from the batch have zero gradient: a real count.
    assert 0 < result["num_zeros"] == result["expected_num_zeros"]


@pytest.mark.parametrize(
    "world_size,style,flags",
    [
        (2, LLAMA_STYLE, ["--use-distributed-optimizer"]),
        (
            4,
            GPT2_STYLE,
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        ),
    ],
    ids=["dp2-distopt", "tp2-pp2-tied"],
)
def test_decoupled_lr_and_norms_match_single_process(world_size, style, flags):
    argv = style + TRAINING + DECOUPLED + NORMS
    reference = train_job(argv, 4)
    results = run_distributed(world_size, train_job, argv + flags, 4)
    assert_matches_reference(results, reference, 2 * DP_TOLERANCE)
    expected = _norms_job(argv, 2)
    for result in run_distributed(world_size, _norms_job, argv + flags, 2):
        assert result["params_norm"] == pytest.approx(expected["params_norm"], rel=1e-6)
        assert abs(result["num_zeros"] - expected["num_zeros"]) <= result["key_bias_entries"]


def test_log_line_carries_the_megatron_fields():
    stats = IterationStats(
        iteration=10,
        train_iters=100,
        consumed_samples=80,
        elapsed_ms=12.5,
        learning_rate=1e-3,
        global_batch_size=8,
        lm_loss=2.5,
        loss_scale=1.0,
        grad_norm=0.5,
        skipped_iterations=0,
        nan_iterations=0,
        tokens_per_second=100.0,
        tflops_per_device=0.1,
        decoupled_learning_rate=2e-2,
        num_zeros_in_grad=1234,
        params_norm=56.789,
    )
    line = format_iteration(stats)
    # Megatron's fields first; threefold's decoupled learning rate among its own, after them
    assert " learning rate: 1.000000E-03 | global batch size:     8 |" in line
    assert (
        " number of nan iterations:   0 | decoupled learning rate: 2.000000E-02 | tokens per"
    ) in line
    assert " grad norm: 0.500 | num zeros: 1234 | params norm: 56.789 |" in line
    assert np.isfinite(stats.params_norm)


def test_training_log_prints_them(capsys):
    from tests.training.test_accumulation_and_determinism import _with

    trainer = _setup(
        _with(GPT2_STYLE + TRAINING, train_iters=2, log_interval=1) + DECOUPLED + NORMS
    )
    trainer.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert len(lines) == 2
    for line in lines:
        for field in ("decoupled learning rate: ", "num zeros: ", "params norm: "):
            assert field in line, line
