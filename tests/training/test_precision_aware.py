"""--use-precision-aware-optimizer (Megatron-LM's, Transformer Engine's FusedAdam semantics):
masters and Adam moments stored in fewer bits, the step in fp32. Stored states equal a plain
AdamW whose state is rounded the same way after each step, bit for bit; a bf16 weight and its
remainder are its fp32 master exactly; layouts match one process; checkpoints resume bit for
bit and load into the plain optimizer and back; the memory is what the estimate says."""

import pytest
import torch

from tests.conftest import DEVICES
from tests.distributed import run_distributed
from tests.parity import (
    DP_TOLERANCE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_matches_reference,
    train_job,
)
from tests.training.test_checkpointing import _resume_job
from tests.training.test_resharding import _check, _load_then_step, _save_then_continue
from threefold.arguments import parse_args
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.save import save_checkpoint
from threefold.training.memory import measure_bytes_per_parameter
from threefold.training.memory_estimate import _bytes_per_parameter
from threefold.training.precision_aware import PrecisionAwareAdamW, join_master, split_master

PRECISION_AWARE = ["--use-distributed-optimizer", "--use-precision-aware-optimizer"]
BF16_MOMENTS = ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
HYPERPARAMETERS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_weight_and_its_remainder_are_the_fp32_master_bit_for_bit(device):
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(100_000, generator=generator) * torch.logspace(-30, 30, 100_000)
    special = [0.0, -0.0, float("inf"), -float("inf"), 1e-45, -3.4e38, torch.finfo().tiny]
    master[: len(special)] = torch.tensor(special)
    # Exact ties, half a bf16 unit above an even and an odd high half, of both signs.
    for i, high in enumerate((0x3F80, 0x3F81, 0xBF80 - 0x10000, 0xBF81 - 0x10000)):
        master.view(torch.int32)[10 + i] = high * 65536 + 0x8000
    master = master.to(device)
    weight, remainder = split_master(master)
    assert weight.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_master(weight, remainder).view(torch.int32), master.view(torch.int32))
    # The weight is the master rounded to nearest, as bf16's cast, except that a tie rounds up
    # in magnitude (Transformer Engine's rule) where the cast rounds to even.
    cast = master.to(torch.bfloat16)
    differs = weight.view(torch.int16) != cast.view(torch.int16)
    bits = master.view(torch.int32)
    ties_above_even = ((bits & 0xFFFF) == 0x8000) & ((bits & 0x10000) == 0)
    assert torch.equal(differs, ties_above_even)
    assert differs[10:14].tolist() == [True, False, True, False]
    assert weight[10:12].view(torch.int16).tolist() == [0x3F81, 0x3F82]  # both up


def _rounded(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Transformer Engine's stored value of fp32 `value`, back in fp32: bf16 rounded; fp16 and
    fp8 over a per-tensor scale putting the largest magnitude at 65504 / 2 or 448."""
    if dtype in (torch.float32, torch.bfloat16):
        return value.to(dtype).float()
    largest = {torch.float16: 65504.0 / 2, torch.float8_e4m3fn: 448.0}[dtype]
    scale = value.abs().max().reshape(1) / largest
    inverse = scale.reciprocal() if scale > 0 else torch.zeros_like(scale)
    return (value * inverse).to(dtype).float() * scale


@pytest.mark.parametrize(
    "exp_avg,exp_avg_sq,weights,masters",
    [
        (torch.bfloat16, torch.bfloat16, torch.float32, None),
        (torch.float16, torch.float8_e4m3fn, torch.float32, None),
        (torch.float8_e4m3fn, torch.float16, torch.float32, None),
        (torch.float32, torch.float32, torch.bfloat16, torch.float32),  # remainders
        (torch.bfloat16, torch.float32, torch.bfloat16, torch.float16),
        (torch.float32, torch.bfloat16, torch.float16, torch.float32),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_the_stored_state_is_adamw_rounded_after_each_step(
    exp_avg, exp_avg_sq, weights, masters, device
):
    """Five steps on a [300] weight: the masters and moments equal torch's AdamW in fp32 whose
    moments (and masters) are rounded as stored after each step, bit for bit; the weight is
    its master in the weights' dtype (a bf16 weight with fp32 masters: the master's high
    half)."""
    generator = torch.Generator().manual_seed(1)
    start = torch.randn(300, generator=generator).to(device)
    weight = torch.nn.Parameter(start.to(weights))
    dtypes = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "master_param": masters}
    group = {"params": [weight], "weight_decay": 0.1}
    optimizer = PrecisionAwareAdamW([group], dtypes=dtypes, fused=True, **HYPERPARAMETERS)
    reference = torch.nn.Parameter(_rounded(start.to(weights).float(), masters or torch.float32))
    adamw = torch.optim.AdamW([reference], fused=True, weight_decay=0.1, **HYPERPARAMETERS)
    for step in range(5):
        gradient = torch.randn(300, generator=generator).to(device) * 10.0 ** (step - 2)
        weight.decoupled_grad = gradient.to(weights)
        optimizer.step()
        reference.grad = gradient.to(weights).float()
        adamw.step()
        state = adamw.state[reference]
        state["exp_avg"].copy_(_rounded(state["exp_avg"], exp_avg))
        state["exp_avg_sq"].copy_(_rounded(state["exp_avg_sq"], exp_avg_sq))
        expected_weight = reference.detach().to(weights)
        if weights == torch.bfloat16 and masters == torch.float32:
            expected_weight = split_master(reference.detach())[0]
        if masters is not None:
            reference.data.copy_(_rounded(reference.detach(), masters))
        assert torch.equal(optimizer.unscaled(weight, "master"), reference.detach()), step
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.unscaled(weight, name), state[name]), (step, name)
        assert torch.equal(weight.detach(), expected_weight), step


def test_all_fp32_is_the_plain_optimizer_bit_for_bit():
    argv = LLAMA_STYLE + TRAINING + ["--use-distributed-optimizer"]
    plain = train_job(argv, 4)
    precision_aware = train_job(argv + ["--use-precision-aware-optimizer"], 4)
    assert precision_aware["losses"] == plain["losses"]
    for name, value in plain["params"].items():
        assert (precision_aware["params"][name] == value).all(), name


def _masters(trainer) -> list[torch.Tensor]:
    optimizer = trainer.optimizer
    return [optimizer._state_value(piece, "master").clone() for piece in optimizer.pieces]


def test_bf16_remainders_step_the_fp32_masters_exactly():
    """A bf16 step from the same weights: the weights and remainders give the plain
    optimizer's fp32 masters back, bit for bit."""
    argv = LLAMA_STYLE + TRAINING + ["--use-distributed-optimizer", "--bf16"]
    plain, precision_aware = _setup(argv), _setup(argv + ["--use-precision-aware-optimizer"])
    assert plain.train_step()[0] == precision_aware.train_step()[0]
    for expected, actual in zip(_masters(plain), _masters(precision_aware)):
        assert torch.equal(actual, expected)
    pieces = precision_aware.optimizer.pieces
    assert all(piece.master.dtype == torch.bfloat16 and not piece.separate for piece in pieces)


def test_fp8_weights_keep_fp32_masters_beside_the_remainders():
    """--fp8-param-gather stores FP8 weights in FP8 only: their masters stay fp32 copies (as
    megatron-core keeps them), the other weights' are remainders; all-fp32 state steps as the
    plain optimizer."""
    argv = LLAMA_STYLE + TRAINING + ["--use-distributed-optimizer", "--bf16"]
    argv += ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"]
    plain = train_job(argv, 3)["losses"]
    trainer = _setup(argv + ["--use-precision-aware-optimizer"])
    # (bitwise here; 1e-5 for a CPU on which a master lands on a tie, whose bf16 weight then
    # rounds away from zero instead of to even, and FP8 carries the difference on)
    assert [trainer.train_step()[0] for _ in range(3)] == pytest.approx(plain, rel=1e-5)
    fp8 = trainer.data_parallel.fp8_parameters.states
    for piece in trainer.optimizer.pieces:
        expected = torch.float32 if piece.param in fp8 else torch.bfloat16
        assert piece.master.dtype == expected and piece.separate == (piece.param in fp8)


@pytest.mark.parametrize(
    "world_size,layout", [(2, []), (2, ["--tensor-model-parallel-size", "2"])], ids=["dp2", "tp2"]
)
@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_layouts_match_one_process(world_size, layout, moments):
    """fp32 weights, their moments fp32 or bf16 (elementwise, so a shard's state is the whole
    tensor's): DP2 and TP2 match one process. In bf16 a moment that the layout's reordered
    sums moved by 1e-7 lands a whole bf16 unit (2**-8) away now and then: 4.1e-5 after six
    steps, where a piece stored under another's state is off by 1e-2 or more."""
    argv = LLAMA_STYLE + TRAINING + PRECISION_AWARE + ["--exp-avg-dtype", moments]
    argv += ["--exp-avg-sq-dtype", moments]
    reference = train_job(argv, 6)
    results = run_distributed(world_size, train_job, argv + layout, 6)
    tolerance = 1e-4 if moments == "bf16" else 1e-5 if layout else DP_TOLERANCE
    assert_matches_reference(results, reference, tolerance)


@pytest.mark.parametrize(
    "flags", [BF16_MOMENTS, ["--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp16"]]
)
def test_a_resumed_run_continues_bit_for_bit(tmp_path, flags):
    """DP2, bf16 weights with remainders: the checkpoint holds the fp32 values (the same keys
    as the plain optimizer's); stored again on load, they give the same state."""
    argv = LLAMA_STYLE + TRAINING + PRECISION_AWARE + ["--bf16"] + flags
    result = run_distributed(2, _resume_job, argv, str(tmp_path / "ckpt"))[0]
    assert result["resumed_losses"] == result["straight"]["losses"][3:]
    for name, value in result["straight"]["params"].items():
        assert (result["resumed_params"][name] == value).all(), name


def _loaded_masters(argv: list[str], directory: str) -> list:
    trainer = _setup(argv)
    assert load_checkpoint(directory, trainer.checkpoint_components()) == 3
    return [master.numpy() for master in _masters(trainer)]


def test_a_checkpoint_reshards(tmp_path):
    """A TP2 checkpoint read at DP2: a bf16 run's remainders give back the fp32 masters the
    plain optimizer reads from it, bit for bit; with bf16 moments the next step is the saved
    run's."""
    tp2 = ["--tensor-model-parallel-size", "2"]
    argv = LLAMA_STYLE + TRAINING + ["--use-distributed-optimizer", "--bf16"]
    run_distributed(2, _save_then_continue, argv + tp2, str(tmp_path / "bf16"))
    plain = run_distributed(2, _loaded_masters, argv, str(tmp_path / "bf16"))
    argv += ["--use-precision-aware-optimizer"]
    for expected, actual in zip(
        plain, run_distributed(2, _loaded_masters, argv, str(tmp_path / "bf16"))
    ):
        assert all((a == e).all() for a, e in zip(actual, expected))
    argv = LLAMA_STYLE + TRAINING + PRECISION_AWARE + BF16_MOMENTS
    saved = run_distributed(2, _save_then_continue, argv + tp2, str(tmp_path / "fp32"))
    _check(saved, run_distributed(2, _load_then_step, argv, str(tmp_path / "fp32")))


def test_checkpoints_load_into_the_plain_optimizer_and_back(tmp_path):
    argv = LLAMA_STYLE + TRAINING + ["--use-distributed-optimizer", "--bf16"]
    plain = _setup(argv)
    for _ in range(2):
        plain.train_step()
    save_checkpoint(str(tmp_path / "plain"), plain.checkpoint_components())
    precision_aware = _setup(argv + ["--use-precision-aware-optimizer"] + BF16_MOMENTS)
    assert load_checkpoint(str(tmp_path / "plain"), precision_aware.checkpoint_components()) == 2
    for expected, actual in zip(_masters(plain), _masters(precision_aware)):
        assert torch.equal(actual, expected)
    save_checkpoint(str(tmp_path / "aware"), precision_aware.checkpoint_components())
    again = _setup(argv)
    assert load_checkpoint(str(tmp_path / "aware"), again.checkpoint_components()) == 2
    for expected, actual in zip(_masters(plain), _masters(again)):
        assert torch.equal(actual, expected)
    moments = [again.optimizer._state_value(p, "exp_avg") for p in again.optimizer.pieces]
    expected = [plain.optimizer._state_value(p, "exp_avg") for p in plain.optimizer.pieces]
    for value, before in zip(moments, expected):
        assert torch.equal(value, before.bfloat16().float())


@pytest.mark.parametrize(
    "flags,gradients,optimizer",
    [
        (["--bf16"], 4, 2 + 4 + 4),  # remainders, fp32 moments
        (["--bf16"] + BF16_MOMENTS, 4, 2 + 2 + 2),
        (["--bf16", "--main-grads-dtype", "bf16"] + BF16_MOMENTS, 2, 2 + 2 + 2),
        (["--bf16", "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp16"], 4, 2 + 1 + 2),
        (["--bf16", "--main-params-dtype", "fp16"], 4, 2 + 4 + 4),
        (["--fp16", "--exp-avg-dtype", "bf16"], 2, 4 + 2 + 4),  # fp32 masters of fp16
        (BF16_MOMENTS, 4, 0 + 2 + 2),  # fp32 weights are their own masters
    ],
)
def test_bytes_per_parameter_are_the_estimates(flags, gradients, optimizer):
    argv = LLAMA_STYLE + TRAINING + PRECISION_AWARE + flags
    trainer = _setup(argv)
    trainer.train_step()
    named = trainer.layout_independent_parameters()
    measured = measure_bytes_per_parameter(named, trainer.data_parallel)
    assert abs(measured.gradients - gradients) < 0.05 * gradients
    assert abs(measured.optimizer - optimizer) < 0.05 * optimizer
    config = parse_args(argv)
    assert _bytes_per_parameter(config, "megatron", True)[1:] == (gradients, optimizer)


def test_with_cpu_offload_the_host_optimizer_keeps_fp32_state():
    """Megatron-LM requires the flag for --optimizer-cpu-offload, whose hybrid optimizer keeps
    fp32 state on the host: so does threefold's offloaded one."""
    argv = LLAMA_STYLE + TRAINING + PRECISION_AWARE + ["--bf16", "--optimizer-cpu-offload"]
    trainer = _setup(argv)
    assert not trainer.optimizer.precision_aware
    assert all(piece.master.dtype == torch.float32 for piece in trainer.optimizer.pieces)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware"),
        (["--use-precision-aware-optimizer"], "runs with --use-distributed-optimizer"),
        (PRECISION_AWARE + ["--optimizer", "muon"], "steps Adam, not --optimizer muon"),
        (PRECISION_AWARE + ["--main-grads-dtype", "bf16"], "--main-grads-dtype bf16 needs --bf16"),
        (
            PRECISION_AWARE
            + ["--bf16", "--main-grads-dtype", "bf16"]
            + ["--accumulate-allreduce-grads-in-fp32"],
            "contradict each other",
        ),
        (PRECISION_AWARE + ["--main-params-dtype", "fp16"], "an fp32 run's weights are their own"),
        (
            PRECISION_AWARE + ["--bf16", "--optimizer-cpu-offload"] + BF16_MOMENTS,
            "the offloaded optimizer keeps fp32 state",
        ),
    ],
)
def test_bad_combinations_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + argv)
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert message in line
