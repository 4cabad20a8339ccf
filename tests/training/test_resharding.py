"""A checkpoint saved in one TP/PP/DP layout (with or without the distributed optimizer)
resumes in another: the next step's loss equals the un-resharded continuation's."""

import pytest

from tests.distributed import run_distributed
from tests.parity import (
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    _full,
    _setup,
    _without_key_bias,
    assert_close_dicts,
    assert_losses_close,
    merge_pipeline_stages,
)
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.save import save_checkpoint

FOUR_LAYERS = ["--num-layers", "4"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _save_then_continue(argv: list[str], directory: str) -> dict:
    trainer = _setup(argv)
    for _ in range(3):
        trainer.train_step()
    save_checkpoint(directory, trainer.checkpoint_components())
    loss = trainer.train_step()[0]
    return {"loss": loss, "params": _without_key_bias(_full(trainer), trainer)}


def _load_then_step(argv: list[str], directory: str) -> dict:
    trainer = _setup(argv)
    assert load_checkpoint(directory, trainer.checkpoint_components()) == 3
    assert trainer.state.consumed_train_samples == 3 * 8
    loss = trainer.train_step()[0]
    return {"loss": loss, "params": _without_key_bias(_full(trainer), trainer)}


def _check(saved: list[dict], resumed: list[dict]) -> None:
    assert_losses_close([r["loss"] for r in resumed], [saved[0]["loss"]] * len(resumed), 1e-6)
    # The Adam step after the resumed state: tensor-parallel sums reorder, hence 1e-5.
    assert_close_dicts(
        merge_pipeline_stages([r["params"] for r in resumed]),
        merge_pipeline_stages([s["params"] for s in saved]),
        1e-5,
        "parameter",
    )


@pytest.fixture(scope="module")
def tp2_pp2_checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tp2_pp2"))
    argv = LLAMA_STYLE + TRAINING + FOUR_LAYERS
    return argv, directory, run_distributed(4, _save_then_continue, argv + TP2_PP2, directory)


@pytest.mark.parametrize(
    "layout",
    [
        [],  # TP=1, PP=1, DP=4
        ["--tensor-model-parallel-size", "4"],
        # the first stage only embeds, the last holds two layers (Megatron's explicit layout)
        ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "E|t|t|ttL"],
        ["--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"],
        ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
        # PyTorch's data parallelism around threefold's TP/PP: FSDP2 shards each TP shard over
        # DP 2, DDP replicates each stage
        ["--distributed-strategy", "fsdp", "--tensor-model-parallel-size", "2"],
        ["--distributed-strategy", "ddp", "--pipeline-model-parallel-size", "2"],
    ],
    ids=[
        "dp4",
        "tp4",
        "pp4-layout",
        "pp2-dp2-distributed-optimizer",
        "dp4-two-optimizer-instances",
        "fsdp-tp2-dp2",
        "ddp-pp2-dp2",
    ],
)
def test_tp2_pp2_checkpoint_resumes_in_another_layout(tp2_pp2_checkpoint, layout):
    argv, directory, saved = tp2_pp2_checkpoint
    _check(saved, run_distributed(4, _load_then_step, argv + layout, directory))


def test_a_vocabulary_padded_at_the_saved_tp_loads_where_no_padding_is_added(tmp_path):
    """A vocabulary of 16 with --make-vocab-size-divisible-by 8 is padded to 32 rows at TP4
    and not at all at TP1 or TP2 (as LLaMA-3's 128,256 with the default 128: padded at TP4,
    whole below). The checkpoint's padding rows are dropped there too; they were refused as
    another model's rows."""
    argv = LLAMA_STYLE + TRAINING + ["--vocab-size", "16"]
    directory = str(tmp_path)
    tp4, tp2 = (["--tensor-model-parallel-size", str(tp)] for tp in (4, 2))
    saved = run_distributed(4, _save_then_continue, argv + tp4, directory)
    _check(saved, [_load_then_step(argv, directory)])
    _check(saved, run_distributed(2, _load_then_step, argv + tp2, directory))


def test_distributed_optimizer_state_reshards_across_data_parallel_sizes(tmp_path):
    argv = GPT2_STYLE + TRAINING + FOUR_LAYERS + ["--use-distributed-optimizer"]
    directory = str(tmp_path)
    saved = run_distributed(
        4, _save_then_continue, argv + ["--tensor-model-parallel-size", "2"], directory
    )
    # DP=4, and PP=2 x DP=2 with other buckets (so other shard boundaries).
    for layout in ([], ["--pipeline-model-parallel-size", "2", "--ddp-bucket-size", "5000"]):
        _check(saved, run_distributed(4, _load_then_step, argv + layout, directory))


def test_fsdp_checkpoint_resumes_under_threefolds_own_data_parallelism(tmp_path):
    """FSDP2's checkpoint (TP2 x DP2, its weights and moments saved from FSDP2's shards)
    resumes under threefold's distributed optimizer at DP4 and without it at PP2 x DP2."""
    argv = LLAMA_STYLE + TRAINING + FOUR_LAYERS
    fsdp = ["--distributed-strategy", "fsdp", "--tensor-model-parallel-size", "2"]
    saved = run_distributed(4, _save_then_continue, argv + fsdp, str(tmp_path))
    for layout in (["--use-distributed-optimizer"], ["--pipeline-model-parallel-size", "2"]):
        _check(saved, run_distributed(4, _load_then_step, argv + layout, str(tmp_path)))


def _fsdp_loads_masters(argv: list[str], directory: str) -> dict:
    """The fp32 parameters an FSDP2 run loads from `directory`, whole, and the checkpoint's
    fp32 masters of them."""
    from threefold.checkpoint.files import checkpoint_dir
    from threefold.checkpoint.resharding import saved_tensors

    trainer = _setup(argv)
    assert load_checkpoint(directory, trainer.checkpoint_components()) == 3
    saved = saved_tensors(checkpoint_dir(directory, 3))
    loaded = _full(trainer)
    named = trainer.layout_independent_parameters()
    masters = {name: saved.full("master", name, param, 1).numpy() for name, param in named}
    return {"loaded": loaded, "masters": masters}


def test_a_bf16_runs_masters_not_its_weights_fill_fsdps_parameters_at_the_same_layout(tmp_path):
    """threefold's bf16 run keeps fp32 masters beside its bf16 weights, PyTorch FSDP2's fp32
    parameters are their own masters: at the same layout (DP2), FSDP2's parameters take the
    masters, bitwise, not the weights rounded to bf16."""
    argv, directory = GPT2_STYLE + TRAINING + ["--bf16"], str(tmp_path)
    run_distributed(2, _save_then_continue, argv, directory)
    fsdp = argv + ["--distributed-strategy", "fsdp"]
    for result in run_distributed(2, _fsdp_loads_masters, fsdp, directory):
        assert_close_dicts(result["loaded"], result["masters"], 0.0, "parameter")


def test_optimizer_instances_checkpoint_resumes_with_one_instance(tmp_path):
    """Two distributed-optimizer instances at DP4 save each shard once (the instances hold
    the same ones); one instance over all four ranks takes the state up."""
    argv = GPT2_STYLE + TRAINING + FOUR_LAYERS + ["--use-distributed-optimizer"]
    instances = ["--num-distributed-optimizer-instances", "2"]
    saved = run_distributed(4, _save_then_continue, argv + instances, str(tmp_path))
    _check(saved, run_distributed(4, _load_then_step, argv, str(tmp_path)))


def test_bf16_masters_carry_over_when_resharded(tmp_path):
    # The resumed weights come from the fp32 masters: the first loss is the saved run's (same
    # micro-batches, same weights), although the layouts shard differently. DP=4 averages the
    # micro-batch losses in another order than DP=2, so the two agree to fp32 rounding (~1e-7
    # relative), not bitwise; weights rounded through bf16 would move it by ~1e-3.
    argv = GPT2_STYLE + TRAINING + ["--bf16", "--use-distributed-optimizer"]
    directory = str(tmp_path)
    saved = run_distributed(2, _save_then_continue, argv, directory)
    resumed = run_distributed(4, _load_then_step, argv + ["--ddp-bucket-size", "3000"], directory)
    losses = {r["loss"] for r in resumed}
    assert len(losses) == 1  # every rank reports the same all-reduced loss
    assert abs(losses.pop() - saved[0]["loss"]) <= 1e-6 * abs(saved[0]["loss"])


MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0.01"]
# Expert TP defaults to TP (2), as in Megatron: each expert split over two ranks.
EP2_TP2 = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
EP2_TP2 += ["--sequence-parallel"]
ETP2_DP4 = ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]


@pytest.mark.parametrize(
    "saved_layout,layouts",
    [
        (EP2_TP2, [[], ["--expert-model-parallel-size", "4"], ETP2_DP4]),
        (
            ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
            [
                ["--expert-model-parallel-size", "4", "--use-distributed-optimizer"],
                ETP2_DP4 + ["--use-distributed-optimizer"],
                # FSDP2: the experts sharded over expert DP 2, the rest over DP 4
                ["--expert-model-parallel-size", "2", "--distributed-strategy", "fsdp"],
            ],
        ),
    ],
    ids=["ep2-etp2-tp2", "ep2-dp2-distributed-optimizer"],
)
def test_moe_checkpoint_resumes_at_other_expert_parallel_sizes(tmp_path, saved_layout, layouts):
    """Experts are saved under their global index (split by expert-TP rank): a checkpoint
    resumes at other EP and expert-TP sizes (DP=4 at EP=1, EP=4, EP2 x ETP2, FSDP2 at EP2)
    and in one process, the Adam state of sharded experts included."""
    argv, directory = LLAMA_STYLE + TRAINING + MOE, str(tmp_path / "moe")
    saved = run_distributed(4, _save_then_continue, argv + saved_layout, directory)
    for layout in layouts:
        _check(saved, run_distributed(4, _load_then_step, argv + layout, directory))
    _check(saved, [_load_then_step(argv, directory)])
