"""bf16 and fp16 training: fp32 master weights track the fp32 run; the fp16 loss scaler skips
overflowing steps and backs off, as Megatron's DynamicGradScaler does; gradients of bf16 models
are accumulated and reduced in fp32 unless --grad-reduce-in-bf16, as in Megatron-LM."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import GPT2_STYLE, LLAMA_STYLE, TRAINING, _setup, train_job
from threefold.arguments import parse_args
from threefold.config import TrainingConfig
from threefold.parallel.data_parallel.torch_native import local
from threefold.training.loss_scaler import DynamicLossScaler


def test_bf16_and_fp16_follow_fp32_within_half_precision_tolerance():
    reference = train_job(GPT2_STYLE + TRAINING, 5)["losses"]
    for flag in ("--bf16", "--fp16"):
        trainer = _setup(GPT2_STYLE + TRAINING + [flag, "--initial-loss-scale", "1024"])
        assert trainer.optimizer.master_params[0].dtype.is_floating_point
        losses = [trainer.train_step()[0] for _ in range(5)]
        for loss, expected in zip(losses, reference):
            assert abs(loss - expected) <= 2e-2 * expected, (flag, losses, reference)


def test_fp16_overflow_skips_the_step_and_backs_off():
    trainer = _setup(
        GPT2_STYLE + TRAINING + ["--fp16", "--initial-loss-scale", "1e30", "--hysteresis", "1"]
    )
    before = [p.detach().clone() for p in trainer.optimizer.master_params]
    _, grad_norm, skipped = trainer.train_step()
    assert skipped and grad_norm is None
    assert all((b == p).all() for b, p in zip(before, trainer.optimizer.master_params))
    assert trainer.loss_scaler.scale == 5e29
    for _ in range(200):  # the scale halves until the gradients fit, then training proceeds
        _, _, skipped = trainer.train_step()
        if not skipped:
            break
    assert not skipped


def test_static_loss_scale_stays_and_still_skips_overflows():
    """Megatron's --loss-scale: a constant scale (fp16 or bf16) whose overflowing steps are
    skipped without the scale moving; a power of two scales and unscales bf16 gradients
    exactly, so the losses are those of the unscaled run bitwise."""
    unscaled = train_job(LLAMA_STYLE + TRAINING + ["--bf16"], 3)["losses"]
    scaled = _setup(LLAMA_STYLE + TRAINING + ["--bf16", "--loss-scale", "1024"])
    assert [scaled.train_step()[0] for _ in range(3)] == unscaled
    assert scaled.loss_scaler.scale == 1024.0
    # (NaN checking, on by default as in Megatron-LM, would stop at the first overflow)
    trainer = _setup(
        GPT2_STYLE
        + TRAINING
        + ["--fp16", "--loss-scale", "1e30", "--no-check-for-nan-in-loss-and-grad"]
    )
    for _ in range(3):
        _, grad_norm, skipped = trainer.train_step()
        assert skipped and grad_norm is None and trainer.loss_scaler.scale == 1e30


def test_dynamic_scaler_grows_after_a_clean_window():
    scaler = DynamicLossScaler(
        TrainingConfig(initial_loss_scale=8.0, loss_scale_window=3, hysteresis=2)
    )
    scaler.update(found_inf=True)
    assert scaler.scale == 8.0  # hysteresis: the first overflow only counts
    scaler.update(found_inf=True)
    assert scaler.scale == 4.0
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 8.0


def test_optimizer_cpu_offload_keeps_separate_masters_with_identical_arithmetic():
    """The offload path (fp32 masters and Adam moments apart from the model, gradients copied
    to them, weights copied back) computes exactly what the in-place update does. On a CPU
    run the flag itself is a no-op that says so; here the path is forced."""
    from threefold.training.lr_scheduler import OptimizerParamScheduler
    from threefold.training.optimizer import OFFLOAD_DEVICE, MixedPrecisionOptimizer

    reference = train_job(GPT2_STYLE + TRAINING, 3)["losses"]
    trainer = _setup(GPT2_STYLE + TRAINING + ["--optimizer-cpu-offload"])
    assert not trainer.optimizer.separate_masters  # CPU run: nothing to offload
    named = [(n, p) for n, p in trainer.model.named_parameters()]
    trainer.optimizer = MixedPrecisionOptimizer(
        named, trainer.config.training, trainer.parallel, offload=True
    )
    trainer.scheduler = OptimizerParamScheduler(trainer.optimizer, trainer.config.training)
    piece = trainer.optimizer.pieces[0]
    assert piece.master is not piece.param and piece.master.device == OFFLOAD_DEVICE
    assert [trainer.train_step()[0] for _ in range(3)] == reference


@pytest.mark.parametrize(
    "flags,fp32_gradients",
    [
        (["--bf16"], True),  # Megatron-LM's default for bf16
        (["--bf16", "--grad-reduce-in-bf16"], False),
        (["--fp16"], False),
        (["--fp16", "--accumulate-allreduce-grads-in-fp32"], True),
        (["--bf16", "--accumulate-allreduce-grads-in-fp32"], True),
    ],
)
def test_gradient_precision_follows_megatron_defaults(flags, fp32_gradients):
    config = parse_args(GPT2_STYLE + TRAINING + flags)
    assert config.parallel.accumulate_allreduce_grads_in_fp32 == fp32_gradients


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16; drop it"),
        (["--fp16", "--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16; drop it"),
        (
            ["--loss-scale", "128"],
            "--loss-scale scales fp16/bf16 gradients; add --fp16 or --bf16, or drop it",
        ),
        (
            ["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"],
            "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict each other; "
            "give one",
        ),
    ],
)
def test_contradicting_gradient_precision_flags_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(GPT2_STYLE + TRAINING + flags)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {message}")


def _reduced_gradients_job(argv: list[str]) -> tuple[str, bool]:
    """The dtype of the data-parallel reduced gradients after a step, and whether every value
    is a bf16 number (a reduction in bf16 leaves nothing finer)."""
    trainer = _setup(argv)
    trainer.train_step()
    grads = [
        local(p.main_grad if trainer.data_parallel.grad_buffer is not None else p.grad)
        for _, p in trainer.model.named_parameters()
    ]
    on_bf16_grid = all(torch.equal(g, g.bfloat16().to(g.dtype)) for g in grads)
    return str(grads[0].dtype), on_bf16_grid


@pytest.mark.parametrize("strategy", ["megatron", "ddp", "fsdp"])
def test_grad_reduce_in_bf16_reduces_in_bf16_in_every_strategy(strategy):
    # Without clipping the gradients are left as the reduction wrote them.
    argv = (
        LLAMA_STYLE
        + TRAINING
        + [
            "--bf16",
            "--clip-grad",
            "0",
            "--global-batch-size",
            "4",
            "--distributed-strategy",
            strategy,
        ]
    )
    fp32 = "torch.float32"
    default = run_distributed(2, _reduced_gradients_job, argv)
    assert default == [(fp32, False)] * 2
    in_bf16 = run_distributed(2, _reduced_gradients_job, argv + ["--grad-reduce-in-bf16"])
    assert in_bf16 == [("torch.bfloat16" if strategy == "megatron" else fp32, True)] * 2
