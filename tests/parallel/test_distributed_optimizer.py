"""The distributed optimizer (ZeRO-1/2) reproduces the single-process run and holds the memory
Megatron's accounting predicts."""

import pytest

from bench.layout_matrix import FEATURES
from tests.distributed import run_distributed
from tests.parity import (
    DP_TOLERANCE,
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_close_dicts,
    assert_matches_reference,
    train_job,
)
from threefold.training.memory import measure_bytes_per_parameter

DISTRIBUTED = ["--use-distributed-optimizer"]
LAYOUTS = {
    "dp2": (2, []),
    "dp4": (4, []),
    "tp2_dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "pp2_dp2": (4, ["--pipeline-model-parallel-size", "2"]),
    # Sequence-parallel norms are summed over TP after the DP reduction: their buckets are
    # all-reduced, not reduce-scattered.
    "tp2_sp_dp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    # Small buckets so several reduce-scatters and all-gathers are in flight at once.
    "dp2_overlapped": (
        2,
        ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "3000"],
    ),
    "tp2_dp2_overlapped": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--ddp-bucket-size",
            "3000",
        ],
    ),
}


@pytest.fixture(scope="module")
def reference():
    return train_job(LLAMA_STYLE + TRAINING, 10)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ten_steps_with_clipping_match_single_process(reference, layout):
    world_size, flags = LAYOUTS[layout]
    argv = LLAMA_STYLE + TRAINING + flags
    distributed = run_distributed(world_size, train_job, argv + DISTRIBUTED, 10)
    # The same layout without the distributed optimizer (which --overlap-param-gather needs).
    plain_flags = [f for f in argv if f != "--overlap-param-gather"]
    plain = run_distributed(world_size, train_job, plain_flags, 10)
    # Sharding the optimizer changes no arithmetic: the same layout without it, bit for bit.
    for with_sharding, without in zip(distributed, plain):
        assert with_sharding["losses"] == without["losses"]
        assert_close_dicts(with_sharding["params"], without["params"], 0.0, "parameter")
    # Against one process: DP_TOLERANCE, or the tensor-parallel tolerance where TP reorders sums.
    tolerance = 1e-5 if "tp" in layout else DP_TOLERANCE
    assert_matches_reference(distributed, reference, tolerance)


INSTANCES = DISTRIBUTED + ["--num-distributed-optimizer-instances", "2"]


@pytest.mark.parametrize(
    "world_size,flags",
    [
        (4, []),
        (4, ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "3000"]),
        (2, []),  # one rank per instance: nothing to reduce-scatter, all-reduced across them
    ],
    ids=["dp4", "dp4-overlapped", "dp2"],
)
def test_distributed_optimizer_instances_match_single_process(reference, world_size, flags):
    """--num-distributed-optimizer-instances 2 (Megatron-LM's partial distributed optimizer):
    each instance shards over half the replicas, and the shards' gradients are all-reduced
    across instances; ten clipped steps match one process."""
    argv = LLAMA_STYLE + TRAINING + INSTANCES + flags
    # The gradients are summed in two levels, (a + b) + (c + d) over DP4, where one reduction
    # sums them in gloo's ring order: the rarely-seen embedding rows, whose tiny second moments
    # amplify rounding (DP_TOLERANCE), end 2.2e-6 off instead of 1.1e-6; the losses agree to
    # 1.4e-7 either way. An instance summed twice or missed is off by 1e-3 or more.
    assert_matches_reference(run_distributed(world_size, train_job, argv, 10), reference, 3e-6)


def test_an_instance_keeps_its_share_of_the_optimizer():
    """fp32 at DP4 with two instances: Adam's state and the masters over 2 ranks, not 4."""
    argv = LLAMA_STYLE + TRAINING
    for measured in run_distributed(4, _bytes_job, argv + INSTANCES):
        total = sum(measured.values())
        assert abs(total - (8 + 8 / 2)) <= 0.05 * 12, measured


def test_tied_embeddings_across_pipeline_stages():
    # The first stage's embedding and the last stage's copy sit at different offsets of
    # their stages' buffers; both must see the fully reduced gradient before being summed.
    argv = GPT2_STYLE + TRAINING + ["--pipeline-model-parallel-size", "2"]
    reference = train_job(GPT2_STYLE + TRAINING, 10)
    assert_matches_reference(run_distributed(4, train_job, argv + DISTRIBUTED, 10), reference, 1e-6)


def _bytes_job(argv: list[str]) -> dict:
    trainer = _setup(argv)
    trainer.train_step()  # the state after a step, not only at start-up
    return measure_bytes_per_parameter(
        trainer.layout_independent_parameters(), trainer.data_parallel
    ).__dict__


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "precision,flags,without,with_distributed",
    [
        ("fp32", [], 16.0, lambda d: 8 + 8 / d),
        # Megatron's default for bf16: gradients accumulated and reduced in fp32.
        ("bf16", ["--bf16"], 18.0, lambda d: 6 + 12 / d),
        (
            "bf16 with bf16 gradients",
            ["--bf16", "--grad-reduce-in-bf16"],
            16.0,
            lambda d: 4 + 12 / d,
        ),
    ],
)
def test_bytes_per_parameter_follow_megatron_accounting(
    world_size, precision, flags, without, with_distributed
):
    argv = LLAMA_STYLE + TRAINING + flags
    for extra, expected in (([], without), (DISTRIBUTED, with_distributed(world_size))):
        for measured in run_distributed(world_size, _bytes_job, argv + extra):
            total = sum(measured.values())
            assert abs(total - expected) <= 0.05 * expected, (precision, extra, measured)


class _LateGather:
    """An all-gather still in flight: the bucket holds garbage until `wait` lands the values."""

    def __init__(self, destination, values) -> None:
        self.destination, self.values = destination, values

    def wait(self) -> None:
        self.destination.copy_(self.values)


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_overlapped_forward_waits_for_every_bucket_it_reads(feature):
    """--overlap-param-gather: each module waits only for its buckets' all-gather. Here every
    bucket is NaN until waited for, so a weight read before its wait (SwiGLU's fc1 through
    `forward_blocks`, GPT-2's position table sliced by the embedding, the experts' weights
    stacked by the grouped GEMM) makes the loss NaN instead of the loss of the same step
    without pending gathers. Deterministic, where the real race only showed as a rare flaky
    resume at DP=2, and for the grouped GEMM in 5 of 12 DP2 runs beside busy processes
    (bench/results/layout_matrix.md). Every feature of bench/layout_matrix.py."""
    argv = TRAINING + FEATURES[feature] + DISTRIBUTED
    argv += ["--overlap-param-gather", "--ddp-bucket-size", "300"]
    expected = _setup(argv).train_step()[0]
    trainer = _setup(argv)
    assert len(trainer.data_parallel.grad_buffer.buckets) > 3
    for buffer in trainer.data_parallel.buffers:  # (the experts' own, for a mixture)
        for bucket, (start, end) in enumerate(buffer.buckets):
            destination = buffer.param_buffer[start:end]
            buffer._gather_handles[bucket] = _LateGather(destination, destination.clone())
            destination.fill_(float("nan"))
    assert trainer.train_step()[0] == expected
