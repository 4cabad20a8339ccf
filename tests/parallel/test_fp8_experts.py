"""FP8 in mixture-of-experts layers: under rowwise scaling the experts' GEMMs run in FP8 and
every expert-parallel layout reproduces the one-device FP8 run (real gloo ranks); a shared
expert is in FP8 under every recipe, as a dense MLP.

Why only rowwise for the experts (threefold/model/fp8.py): an expert multiplies the tokens of
its whole EP group's micro-batches in one GEMM, where one device takes them micro-batch by
micro-batch. Rowwise scales are per token and per weight row, and, for the weight gradient,
per feature over the tokens as powers of two, which a union of micro-batches changes by 2^-k
only: the same FP8 values. The control scales the experts per tensor instead, and misses the
tolerances by orders of magnitude.
"""

import dataclasses
import functools

import pytest
import torch

from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import LAYOUTS as EP_LAYOUTS
from tests.parallel.test_expert_parallel import MOE
from tests.parallel.test_fp8 import (
    LOSS_TOLERANCE,
    MEDIAN_PARAMETER_TOLERANCE,
    RECIPES,
    _differences,
    _weights_and_scaling,
    assert_match_one_device,
    stepwise_parity,
)
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_close_dicts,
    first_step_gradients_job,
    merge_pipeline_stages,
    relative_error,
    train_steps,
)
from tests.training.test_checkpointing import _resume_job
from threefold.arguments import parse_args
from threefold.kernels import fp8_gemms
from threefold.kernels.fp8 import Fp8Linear
from threefold.model.fp8 import fp8_recipe
from threefold.model.moe.experts import ExpertLinear, Experts
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.sharding import normal_init
from threefold.training.trainer import Trainer

ROWWISE_MOE = LLAMA_STYLE + TRAINING + MOE + RECIPES["rowwise"]
LAYOUTS = {
    # --moe-grouped-gemm takes the FP8 loop: its bf16 grouped GEMM would miss the tolerances
    "ep2-alltoall-grouped": (2, EP_LAYOUTS["ep2-alltoall"][1] + ["--moe-grouped-gemm"]),
    **{
        name: EP_LAYOUTS[name]
        for name in (
            "ep2xetp2-tp2-alltoall",
            "ep2xcp2-alltoall",
            "ep2xpp2-allgather",
            "ep2xfsdp4-alltoall",
        )
    },
}


def _expert_fp8(trainer) -> list:
    return [m.fp8 for m in trainer.model.modules() if isinstance(m, ExpertLinear)]


def experts_trainer(argv: list[str], experts: str | None = None) -> Trainer:
    """A trainer with the experts' FP8 as configured (`experts` None), cast with one scale per
    tensor from each GEMM's own amax ("tensorwise": the control), or taken out of FP8
    ("off")."""
    trainer = _setup(argv)
    for module in trainer.model.modules():
        if isinstance(module, ExpertLinear) and experts is not None:
            tensorwise = dataclasses.replace(module.fp8.recipe, rowwise=False, delayed=False)
            module.fp8 = Fp8Linear(tensorwise) if experts == "tensorwise" else None
    return trainer


def experts_job(
    argv: list[str], steps: int, experts: str | None = None, directory: str | None = None
) -> dict:
    """`fp8_train_job` (a step at a time with a `directory`) of an `experts_trainer`."""
    return train_steps(experts_trainer(argv, experts), steps, _weights_and_scaling, directory)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_experts_match_one_device(tmp_path, layout):
    world_size, flags = LAYOUTS[layout]
    results, reference = stepwise_parity(
        world_size, experts_job, ROWWISE_MOE + flags, ROWWISE_MOE, tmp_path
    )
    assert_match_one_device(results, reference, "rowwise")


def test_per_tensor_scaled_experts_miss_one_device_under_expert_parallelism(tmp_path):
    """The controls, a step at a time as above: the experts really run in FP8 (without it a
    step's loss moves by up to 5.9e-6 from the step one device takes in FP8, the median tensor
    by 4.5e-3), and per-tensor scales, from each expert GEMM's tokens, make EP=2's steps
    differ from one device's with the same scales (8.5e-6 and 4.1e-3) where rowwise scales do
    not (6.9e-8 and 2.4e-9 at most, the layouts above)."""
    off = stepwise_parity(1, experts_job, ROWWISE_MOE, ROWWISE_MOE, tmp_path / "off", "off")
    loss, median = _differences(*off)
    assert loss > 3 * LOSS_TOLERANCE and median > 100 * MEDIAN_PARAMETER_TOLERANCE
    flags = EP_LAYOUTS["ep2-alltoall"][1]
    tensorwise = stepwise_parity(
        2,
        experts_job,
        ROWWISE_MOE + flags,
        ROWWISE_MOE,
        tmp_path / "tensorwise",
        "tensorwise",
        setup=functools.partial(experts_trainer, experts="tensorwise"),
    )
    loss, median = _differences(*tensorwise)
    assert loss > 3 * LOSS_TOLERANCE and median > 100 * MEDIAN_PARAMETER_TOLERANCE


SHARED = ["--moe-shared-expert-intermediate-size", "48"]
GRADIENT_TOLERANCE = 1e-5  # the worst tensor; shards scaled by their own amaxes: ~8e-2


def test_shared_expert_in_fp8_matches_one_device_experts_stay_out():
    """Tensorwise scaling: the shared expert's linears are in FP8 (its amaxes reduced over TP
    like a dense MLP's) and the experts' are not. Expert TP 2 inside TP 2 x EP 2 against one
    device, on the first step's gradients: over ten steps this model's trajectory is chaotic
    (an FP8 element rounded the other way, a token routed elsewhere, then Adam's update of
    every tiny gradient element by about the learning rate) and drifts to ~3e-5 in the loss
    though every step's gradients agree to ~5e-7."""
    argv = LLAMA_STYLE + TRAINING + MOE + SHARED + RECIPES["tensorwise"]
    expected = first_step_gradients_job(argv)
    flags = EP_LAYOUTS["ep2xetp2-tp2-alltoall"][1]
    results = run_distributed(4, first_step_gradients_job, argv + flags)
    assert results[0]["loss"] == pytest.approx(expected["loss"], rel=LOSS_TOLERANCE)
    grads = merge_pipeline_stages([result["grads"] for result in results])
    assert_close_dicts(grads, expected["grads"], GRADIENT_TOLERANCE, "gradient")
    trainer = _setup(argv)
    assert not any(_expert_fp8(trainer))
    names = trainer.fp8.states
    assert sum(".shared_experts." in name for name in names) == 2 * trainer.config.model.num_layers
    assert "shared-expert linear layers" in trainer.fp8.describe()


def _rowwise_experts(counts: list[int]) -> tuple[Experts, torch.Tensor, list[int]]:
    """Experts of `MOE` in rowwise FP8, seeded weights, and tokens routed `counts` to each."""
    config = parse_args(LLAMA_STYLE + TRAINING + MOE + RECIPES["rowwise"])
    experts = Experts(config.model, ParallelContext(), normal_init(0.1), normal_init(0.1))
    generator = torch.Generator().manual_seed(0)
    for param in experts.parameters():
        param.data.normal_(0, 0.1, generator=generator)
    recipe = fp8_recipe(config.fp8)
    for module in experts.modules():
        if isinstance(module, ExpertLinear):
            module.fp8 = Fp8Linear(recipe)
    tokens = torch.randn(sum(counts), config.model.hidden_size, generator=generator)
    return experts, tokens, counts


def test_experts_of_any_token_count_take_gemms_cublas_accepts(monkeypatch):
    """An H100 refused rowwise FP8 experts (bench/results/gpu_2026-11-28/): the weight
    gradient's GEMM sums over an expert's tokens, and cuBLASLt takes FP8 operands only with an
    inner dimension that is a multiple of 16. The GEMMs pad it with zeros
    (kernels/fp8_gemms.py): here `_scaled_mm` refuses as cuBLASLt does, and the experts'
    outputs and gradients at token counts of 3, 21 and 37 are those of the GEMMs unpadded."""
    scaled_mm = torch._scaled_mm

    def as_cublas(a, b, **kwargs):
        assert a.shape[1] % 16 == 0, f"inner dimension {a.shape[1]}"
        return scaled_mm(a, b, **kwargs)

    def run() -> list[torch.Tensor]:
        experts, tokens, counts = _rowwise_experts([3, 21, 37, 16])
        tokens.requires_grad_(True)
        out = experts(tokens, counts)
        out.square().sum().backward()
        return [out.detach(), tokens.grad] + [p.grad for p in experts.parameters()]

    monkeypatch.setattr(fp8_gemms, "INNER_MULTIPLE", 1)  # no padding: what failed on the GPU
    unpadded = run()
    monkeypatch.setattr(torch, "_scaled_mm", as_cublas)
    with pytest.raises(AssertionError, match="inner dimension 3"):
        run()
    monkeypatch.setattr(fp8_gemms, "INNER_MULTIPLE", 16)
    # The zeros change no sum; a CPU's GEMM may still order a longer sum otherwise (bitwise
    # on the machine this was written on)
    for got, expected in zip(run(), unpadded, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_an_expert_no_token_reaches_gets_a_zero_gradient_in_fp8():
    """Rowwise FP8 has no amax to scale an empty GEMM by: an expert without tokens computes
    nothing in FP8 and its weights get zero gradients, the others' the FP8 GEMMs'."""
    experts, tokens, counts = _rowwise_experts([3, 0, 5, 2])
    out = experts(tokens, counts)
    out.square().sum().backward()
    for index, count in enumerate(counts):
        expert = experts.local_experts[str(index)]
        grads = [expert.linear_fc1.weight.grad, expert.linear_fc2.weight.grad]
        assert all(bool(g.any()) == (count > 0) for g in grads), index
    # the FP8 GEMMs ran: the outputs differ from the same experts in fp32 at FP8's precision
    for module in experts.modules():
        if isinstance(module, ExpertLinear):
            module.fp8 = None
    exact = experts(tokens, counts)
    assert 1e-3 < relative_error(out.detach().numpy(), exact.detach().numpy()) < 0.2


def test_fp8_experts_save_and_resume_is_bitwise_identical(tmp_path):
    """Rowwise scaling keeps no state: an EP=2 run with its experts in FP8, saved after three
    steps and resumed, takes the uninterrupted run's next three steps bit for bit."""
    argv = ROWWISE_MOE + EP_LAYOUTS["ep2-alltoall"][1]
    result = run_distributed(2, _resume_job, argv, str(tmp_path / "ckpt"))[0]
    assert result["resumed_losses"] == result["straight"]["losses"][3:]
    assert_close_dicts(result["resumed_params"], result["straight"]["params"], 0.0, "parameter")
