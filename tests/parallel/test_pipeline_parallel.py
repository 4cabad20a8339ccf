"""Pipeline parallelism (1F1B and interleaved) reproduces the single-process run."""

import pytest

from tests.distributed import run_distributed
from tests.parity import (
    DP_TOLERANCE,
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_losses_close,
    assert_matches_reference,
    train_job,
)
from threefold.model.loss import gpt_forward_step
from threefold.parallel.pipeline_parallel.order import interleaved_order, one_f_one_b_order
from threefold.parallel.pipeline_parallel.schedules import (
    ScheduleTrace,
    forward_backward_pipelining,
)

EIGHT_LAYERS = ["--num-layers", "8"]  # after the style's own --num-layers: argparse keeps the last
STYLES = {"gpt2_tied": GPT2_STYLE, "llama_untied": LLAMA_STYLE}
LAYOUTS = {
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp4": (4, ["--pipeline-model-parallel-size", "4"]),
    "pp2_vpp2": (
        2,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
    ),
    "pp4_vpp2": (
        4,
        ["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2"],
    ),
    "tp2_pp2_dp2": (
        8,
        [
            "--pipeline-model-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ),
}


@pytest.fixture(scope="module")
def references():
    return {style: train_job(argv + EIGHT_LAYERS + TRAINING, 10) for style, argv in STYLES.items()}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ten_steps_match_single_process(references, style, layout):
    world_size, flags = LAYOUTS[layout]
    argv = STYLES[style] + EIGHT_LAYERS + TRAINING + flags
    results = run_distributed(world_size, train_job, argv, 10)
    reference = references[style]
    assert_matches_reference(results, reference, 1e-5)


def test_uneven_stages_match_single_process(references):
    argv = (
        GPT2_STYLE
        + EIGHT_LAYERS
        + TRAINING
        + [
            "--pipeline-model-parallel-size",
            "4",
            "--decoder-first-pipeline-num-layers",
            "1",
            "--decoder-last-pipeline-num-layers",
            "3",
        ]
    )
    result = run_distributed(4, train_job, argv, 10)[0]
    assert_losses_close(result["losses"], references["gpt2_tied"]["losses"], 1e-5)


def _train_and_name_pipeline(argv: list[str], steps: int) -> dict:
    """`train_job`, and the ranks of this rank's pipeline."""
    import torch.distributed as dist

    from threefold.parallel import state

    result = train_job(argv, steps)
    return {**result, "pipeline": dist.get_process_group_ranks(state.parallel_context().pp.group)}


def test_the_tp_pp_dp_rank_order_matches_single_process(references):
    # Megatron-LM's --use-tp-pp-dp-mapping: PP before DP, so stages 0 and 1 are ranks 0 and 1;
    # tied embeddings, the distributed optimizer and its DP groups all follow the new order.
    argv = GPT2_STYLE + EIGHT_LAYERS + TRAINING
    argv += ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
    results = run_distributed(4, _train_and_name_pipeline, argv + ["--use-tp-pp-dp-mapping"], 10)
    assert [r["pipeline"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert_matches_reference(results, references["gpt2_tied"], DP_TOLERANCE)


def _one_step_with_trace(argv: list[str]) -> dict:
    trainer = _setup(argv)
    trace = ScheduleTrace()
    losses = forward_backward_pipelining(
        gpt_forward_step,
        trainer.train_iterator(),
        trainer.model_chunks,
        trainer.num_microbatches,
        **trainer.pipeline_options,
        trace=trace,
    )
    return {
        "loss": trainer._mean_loss(losses),
        "rank": trainer.parallel.pp.rank,
        "max_in_flight": trace.max_activations_in_flight,
        "events": len(trace.events),
    }


@pytest.mark.parametrize("micro_batches,virtual", [(1, 1), (3, 1), (4, 1), (9, 1), (4, 2), (8, 2)])
def test_schedules_complete_and_bound_memory(micro_batches, virtual):
    flags = [
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(micro_batches),
        "--pipeline-model-parallel-size",
        "4",
    ]
    if virtual > 1:
        flags += ["--virtual-pipeline-model-parallel-size", str(virtual)]
    argv = GPT2_STYLE + EIGHT_LAYERS + TRAINING + flags
    results = run_distributed(4, _one_step_with_trace, argv)
    expected = _loss_of_first_step(GPT2_STYLE + EIGHT_LAYERS + TRAINING + flags[:4])
    for result in results:
        assert abs(result["loss"] - expected) <= 1e-5 * expected
        if virtual == 1:  # 1F1B: stage r holds at most P - r micro-batches' activations
            assert result["max_in_flight"] <= 4 - result["rank"]


def _loss_of_first_step(argv: list[str]) -> float:
    trainer = _setup(argv)
    return trainer.train_step()[0]


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 2, 5, 8, 17])
def test_one_f_one_b_order_is_complete_and_bounded(stages, micro_batches):
    for rank in range(stages):
        order = one_f_one_b_order(micro_batches, stages, rank)
        _check_order(order, micro_batches, 1)
        assert _max_in_flight(order) <= stages - rank
        assert _max_in_flight(order) == min(stages - rank, micro_batches)


@pytest.mark.parametrize(
    "stages,virtual,micro_batches", [(2, 2, 2), (2, 2, 6), (4, 2, 4), (4, 2, 12), (4, 3, 8)]
)
def test_interleaved_order_is_complete(stages, virtual, micro_batches):
    for rank in range(stages):
        _check_order(
            interleaved_order(micro_batches, stages, rank, virtual), micro_batches, virtual
        )


@pytest.mark.parametrize(
    "stages,virtual,micro_batches,group",
    [(2, 2, 4, 4), (2, 2, 6, 3), (4, 2, 12, 5), (4, 3, 10, 5), (2, 3, 5, 3)],
)
def test_interleaved_order_with_micro_batch_groups_is_complete(
    stages, virtual, micro_batches, group
):
    for rank in range(stages):
        order = interleaved_order(micro_batches, stages, rank, virtual, group)
        _check_order(order, micro_batches, virtual)


def test_micro_batch_groups_run_in_megatrons_table_order():
    """megatron-core's get_schedule_table example, PP2 with VP2, N3 M5: micro-batches
    0 1 2 0 1 2 3 4 3 4 through chunks 0 0 0 1 1 1 0 0 1 1."""
    forwards = [(mb, c) for kind, mb, c in interleaved_order(5, 2, 1, 2, 3) if kind == "F"]
    assert forwards == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0)] + [
        (3, 1),
        (4, 1),
    ]
    default = [(mb, c) for kind, mb, c in interleaved_order(4, 2, 0, 2) if kind == "F"]
    assert default == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]


@pytest.mark.parametrize("batch,group", [(8, 4), (10, 5)], ids=["m4-n4", "m5-n5"])
def test_micro_batch_groups_match_single_process(batch, group):
    """--microbatch-group-size-per-virtual-pipeline-stage at PP2 x VP2: all the micro-batches
    through the first chunk before the second, instead of 2 at a time; with groups of 5, an
    odd number of micro-batches, which groups of PP could not take."""
    argv = GPT2_STYLE + EIGHT_LAYERS + TRAINING + ["--global-batch-size", str(batch)]
    reference = train_job(argv, 4)
    argv += ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage"]
    argv += ["2", "--microbatch-group-size-per-virtual-pipeline-stage", str(group)]
    results = run_distributed(2, train_job, argv, 4)
    assert_matches_reference(results, reference, 1e-5)


def _check_order(order, micro_batches, chunks):
    expected = {(mb, c) for mb in range(micro_batches) for c in range(chunks)}
    forwards = [(mb, c) for kind, mb, c in order if kind == "F"]
    backwards = [(mb, c) for kind, mb, c in order if kind == "B"]
    assert sorted(forwards) == sorted(expected) and sorted(backwards) == sorted(expected)
    for position, (kind, mb, c) in enumerate(order):
        if kind == "B":
            assert ("F", mb, c) in order[:position]


def _max_in_flight(order) -> int:
    held, most = 0, 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


@pytest.mark.parametrize(
    "world,layers,flags",
    [
        # Megatron-LM's functional test: 6 layers + embedding + loss over 4 x 2 chunks of one,
        # so rank 0's first chunk is the embedding alone and rank 3's last the loss alone.
        (
            4,
            6,
            ["--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank"]
            + ["2", "--account-for-embedding-in-pipeline-split"]
            + ["--account-for-loss-in-pipeline-split"],
        ),
        # 7 layers + embedding in two stages of 4: layers 0-2, then 3-6
        (
            2,
            7,
            ["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"],
        ),
    ],
    ids=["pp4-vp2-embedding-and-loss", "pp2-embedding"],
)
def test_embedding_and_loss_counted_in_the_split_match_single_process(world, layers, flags):
    argv = GPT2_STYLE + ["--num-layers", str(layers)] + TRAINING
    reference = train_job(argv, 4)
    results = run_distributed(world, train_job, argv + flags, 4)
    assert_matches_reference(results, reference, 1e-5)


def test_counted_embedding_and_loss_take_a_layer_of_the_first_and_last_chunk():
    from threefold.parallel.pipeline_parallel.layout import model_chunk_layers

    # (offset, layers) per chunk of each rank: megatron-core's get_num_layers_to_build
    assert [model_chunk_layers(6, 4, r, 2, embedding=True, loss=True) for r in range(4)] == [
        [(0, 0), (3, 1)],
        [(0, 1), (4, 1)],
        [(1, 1), (5, 1)],
        [(2, 1), (6, 0)],
    ]
    assert [model_chunk_layers(7, 2, r, embedding=True) for r in range(2)] == [[(0, 3)], [(3, 4)]]
    assert [model_chunk_layers(7, 2, r, loss=True) for r in range(2)] == [[(0, 4)], [(4, 3)]]
