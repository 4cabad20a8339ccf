"""--pipeline-model-parallel-layout (Megatron-LM's explicit layout): each rank builds the layers
megatron-core's layout gives it, and every layout, empty chunks and MTP included, trains as one
process."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.parity import GPT2_STYLE, TRAINING, assert_matches_reference, train_job
from threefold.config.errors import ConfigError
from threefold.config.pipeline_layout import layout_layer_counts
from threefold.parallel.pipeline_parallel.layout import chunks_of_rank

FLAG = "--pipeline-model-parallel-layout"
# (layout, PP, layers, MTP depths): the docs' DeepSeek-V3 layout without its standalone MTP, and
# Megatron-LM's functional-test configs (moe/*_selective_recompute_experimental, mixtral/*flex*)
MEGATRON_LAYOUTS = [
    ("Et*3|(tt|)*29,t|tL", 16, 63, None),
    ("Et*3|(tt|)*6tmL", 2, 16, 1),
    ("Et*3|(tt|)*6mL", 2, 15, 1),
    ("Et*2|(tt|)*5t|tmL", 4, 14, 1),
    ("Et|(tt|)*6mL", 2, 13, 1),
    ("E|t*3|tt||tt|tL", 3, 8, None),
]


@pytest.mark.parametrize("layout,pp,layers,depths", MEGATRON_LAYOUTS)
def test_each_rank_holds_megatron_cores_layers(layout, pp, layers, depths):
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    theirs = PipelineParallelLayerLayout(layout, pp)
    assert theirs.validate_layer_layout(layers, depths) is False  # MTP beside the loss
    virtual = theirs.virtual_pipeline_model_parallel_size
    counts = layout_layer_counts(layout, pp, layers, depths)
    assert len(counts) == pp * virtual
    parallel_state.set_virtual_pipeline_model_parallel_world_size(virtual)
    try:
        for rank in range(pp):
            expected = [
                (
                    theirs.get_layer_offset(LayerType.decoder, vp_stage=v, pp_rank=rank),
                    theirs.get_num_layers_to_build(LayerType.decoder, vp_stage=v, pp_rank=rank),
                )
                for v in range(virtual)
            ]
            assert chunks_of_rank(counts, pp, rank) == expected
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


@pytest.mark.parametrize(
    "layout,depths,message",
    [
        ("Ett|tLx", None, "unknown letters 'x'"),
        ("Ett|t|tL", None, "not a multiple of --pipeline-model-parallel-size 2"),
        ("tEt|ttL", None, "must begin with the embedding"),
        ("EtL|ttL", None, "must end with the loss"),
        ("Ett|tttL", None, "places 5 transformer layers (t) and --num-layers is 4"),
        ("Ett|ttL", 1, "places 0 MTP depths (m) and --mtp-num-layers is 1"),
        ("Etmt|ttL", 1, "after every transformer layer"),
        ("Ett|tt|m|L", 1, "megatron-core's MTP on a stage of its own is not built"),
        ("Ett||t|tL", None, "pipeline rank 1 holds no layer in any of its chunks"),
    ],
)
def test_a_layout_that_does_not_fit_is_refused_by_name(layout, depths, message):
    with pytest.raises(ConfigError) as error:
        layout_layer_counts(layout, 4 if "||" in layout else 2, 4, depths)
    assert message in str(error.value) and FLAG in str(error.value)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--decoder-first-pipeline-num-layers", "1"], "places every layer"),
        (["--account-for-loss-in-pipeline-split"], "places every layer"),
        (["--virtual-pipeline-model-parallel-size", "3"], "2 per pipeline rank"),
    ],
)
def test_conflicting_pipeline_flags_stop_in_one_line(capsys, extra, message):
    from threefold.arguments import parse_args

    argv = GPT2_STYLE + TRAINING + ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]
    with pytest.raises(SystemExit):
        parse_args(argv + [FLAG, "Et|t|t|tL"] + extra, world_size=2)
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def _layout_of(argv: list[str]) -> dict:
    """The virtual pipeline size a layout gives, and the layers of this rank's chunks."""
    from tests.parity import _setup

    trainer = _setup(argv)
    return {
        "virtual": trainer.config.parallel.virtual_pipeline_model_parallel_size,
        "layers": [len(chunk.decoder.layers) for chunk in trainer.model_chunks],
    }


@pytest.mark.parametrize(
    "layers,world,layout,chunk_layers,mtp",
    [
        # interleaved over three chunks per rank, rank 0's second one empty
        (8, 2, "Et|tt||ttt|t|tL", [[1, 0, 1], [2, 3, 1]], False),
        # Megatron's MTP configs' shape: the last chunk holds the depths and the loss only
        (4, 2, "Et|t|tt|mmL", [[1, 2], [1, 0]], True),
    ],
    ids=["pp2-three-chunks-one-empty", "pp2-mtp-chunk"],
)
def test_layouts_train_as_one_process(layers, world, layout, chunk_layers, mtp):
    argv = GPT2_STYLE + TRAINING + ["--num-layers", str(layers)]
    argv += ["--mtp-num-layers", "2"] if mtp else []
    reference = train_job(argv, 4)
    argv += ["--pipeline-model-parallel-size", str(world), FLAG, layout]
    chunks = run_distributed(world, _layout_of, argv)
    assert [c["layers"] for c in chunks] == chunk_layers
    assert chunks[0]["virtual"] == (len(chunk_layers[0]) if len(chunk_layers[0]) > 1 else None)
    # 1e-5 as the other pipeline parity tests: the stages' fp32 sums are ordered otherwise, and
    # how far that moves the norms' biases depends on the CPU (2.5e-6 on an AVX-512 Xeon)
    assert_matches_reference(run_distributed(world, train_job, argv, 4), reference, 1e-5)
