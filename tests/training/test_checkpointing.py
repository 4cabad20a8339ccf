"""Checkpoints resume exactly and the tracker only ever names complete checkpoints."""

import contextlib
import io
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.concurrent_runs import Runs, selected
from tests.conftest import TINY_MODEL
from tests.distributed import run_distributed
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    _full,
    _setup,
    _without_key_bias,
    assert_close_dicts,
    train_job,
)
from threefold.checkpoint.files import TRACKER
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.loadable import rng_source_ranks
from threefold.checkpoint.save import save_checkpoint
from threefold.config import ConfigError, ParallelConfig
from threefold.parallel.tensor_parallel.random import get_rng_tracker

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # RNG state must resume too


def _resume_job(argv: list[str], directory: str) -> dict:
    straight = train_job(argv, 6)
    first = _setup(argv + ["--save", directory])
    for _ in range(3):
        first.train_step()
    save_checkpoint(directory, first.checkpoint_components())
    second = _setup(argv)
    assert load_checkpoint(directory, second.checkpoint_components()) == 3
    resumed_losses = [second.train_step()[0] for _ in range(3)]
    params = _without_key_bias(_full(second), second)
    return {"straight": straight, "resumed_losses": resumed_losses, "resumed_params": params}


@pytest.mark.parametrize(
    "world_size,layout",
    [
        (2, []),
        (2, ["--tensor-model-parallel-size", "2"]),
        (2, ["--pipeline-model-parallel-size", "2"]),
        (2, ["--use-distributed-optimizer", "--bf16"]),
        (
            2,
            [
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
                "--ddp-bucket-size",
                "3000",
            ],
        ),
        (2, ["--distributed-strategy", "fsdp"]),
        (4, ["--distributed-strategy", "fsdp", "--tensor-model-parallel-size", "2"]),
        (4, ["--distributed-strategy", "fsdp", "--pipeline-model-parallel-size", "2"]),
        (2, ["--num-experts", "4", "--expert-model-parallel-size", "2"]),
        # LoRA dropout in the experts: their own random streams resume too
        (
            2,
            ["--num-experts", "4", "--expert-model-parallel-size", "2", "--lora-rank", "4"]
            + ["--lora-dropout", "0.1", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--expert-tensor-parallel-size", "1"],
        ),
        # FSDP2 with experts: each layer's experts sharded over expert DP 2, the rest over DP 4
        (
            4,
            ["--num-experts", "4", "--expert-model-parallel-size", "2"]
            + ["--distributed-strategy", "fsdp", "--bf16"],
        ),
        # DeepSeek-V3's expert biases: state outside the optimizer, resumed with the weights
        (
            1,
            ["--num-experts", "4", "--moe-router-score-function", "sigmoid"]
            + ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01"],
        ),
        (
            4,
            ["--num-experts", "4", "--expert-model-parallel-size", "2"]
            + ["--use-distributed-optimizer", "--bf16"],
        ),
        (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ],
)
def test_save_and_resume_is_bitwise_identical(tmp_path, world_size, layout):
    argv = LLAMA_STYLE + TRAINING + DROPOUT + layout
    result = run_distributed(world_size, _resume_job, argv, str(tmp_path / "ckpt"))[0]
    assert result["resumed_losses"] == result["straight"]["losses"][3:]
    assert_close_dicts(result["resumed_params"], result["straight"]["params"], 0.0, "parameter")


def test_tracker_names_only_complete_checkpoints(tmp_path):
    directory = str(tmp_path)
    trainer = _setup(LLAMA_STYLE + TRAINING)
    trainer.train_step()
    save_checkpoint(directory, trainer.checkpoint_components())
    assert open(os.path.join(directory, TRACKER)).read().strip() == "1"
    # A later save that dies before finishing leaves a partial directory and the old tracker.
    os.makedirs(os.path.join(directory, "iter_0000002"))
    fresh = _setup(LLAMA_STYLE + TRAINING)
    assert load_checkpoint(directory, fresh.checkpoint_components()) == 1
    assert fresh.state.iteration == 1


def test_loading_another_model_is_refused_naming_the_flag(tmp_path):
    directory = str(tmp_path)
    save_checkpoint(directory, _setup(LLAMA_STYLE + TRAINING).checkpoint_components())
    with pytest.raises(ConfigError, match="--num-layers 2 but this run has 3"):
        changed = _setup(LLAMA_STYLE + TRAINING + ["--num-layers", "3"])
        load_checkpoint(directory, changed.checkpoint_components())


def _adam_moments_are_zero(trainer) -> bool:
    return all(not state["exp_avg"].any() for state in trainer.optimizer.optimizer.state.values())


@pytest.mark.parametrize("how", ["finetune", "no_load_optim"])
def test_weights_only_loads(tmp_path, how):
    directory = str(tmp_path)
    saved = _setup(LLAMA_STYLE + TRAINING)
    for _ in range(3):
        saved.train_step()
    save_checkpoint(directory, saved.checkpoint_components())
    fresh = _setup(LLAMA_STYLE + TRAINING)
    if how == "finetune":  # weights only; a new run from iteration 0
        assert load_checkpoint(directory, fresh.checkpoint_components(), finetune=True) == 3
        assert fresh.state.iteration == 0 and fresh.scheduler.num_steps == 0
    else:  # the run continues, with a fresh optimizer
        assert load_checkpoint(directory, fresh.checkpoint_components(), load_optimizer=False) == 3
        assert fresh.state.iteration == 3 and fresh.scheduler.num_steps == 3
    assert _adam_moments_are_zero(fresh) and not _adam_moments_are_zero(saved)
    assert_close_dicts(_full(fresh), _full(saved), 0.0, "parameter")


def test_no_save_optim_and_rng_write_weights_and_progress_only(tmp_path):
    """Megatron's --no-save-optim / --no-save-rng: the checkpoint holds no optimizer tensors
    and no RNG files; loading it without --no-load-optim / --no-load-rng is refused naming the
    flag, and with them the run goes on from the saved iteration with the saved weights."""
    directory = str(tmp_path)
    argv = LLAMA_STYLE + TRAINING + ["--save", directory]
    saved = _setup(argv + ["--no-save-optim", "--no-save-rng"])
    for _ in range(2):
        saved.train_step()
    path = save_checkpoint(directory, saved.checkpoint_components())
    keys = dcp_keys(path)
    assert keys and all(key.startswith("model.") for key in keys)
    assert not os.path.exists(os.path.join(path, "rng"))
    with pytest.raises(ConfigError, match="saved with --no-save-optim .* pass --no-load-optim"):
        load_checkpoint(directory, _setup(argv).checkpoint_components())
    with pytest.raises(ConfigError, match="saved with --no-save-rng .* pass --no-load-rng"):
        load_checkpoint(directory, _setup(argv).checkpoint_components(), load_optimizer=False)
    fresh = _setup(argv)
    assert (
        load_checkpoint(
            directory, fresh.checkpoint_components(), load_optimizer=False, load_rng=False
        )
        == 2
    )
    assert fresh.state.iteration == 2 and _adam_moments_are_zero(fresh)
    assert_close_dicts(_full(fresh), _full(saved), 0.0, "parameter")
    # A full checkpoint of the same run does hold the optimizer and the RNG states.
    full = save_checkpoint(str(tmp_path / "full"), _setup(argv).checkpoint_components())
    assert any(key.startswith("optimizer.") for key in dcp_keys(full))
    assert os.path.isdir(os.path.join(full, "rng"))


def dcp_keys(path: str) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(path).read_metadata().state_dict_metadata)


def test_async_save_writes_the_state_of_its_iteration(tmp_path):
    directory = str(tmp_path)
    trainer = _setup(LLAMA_STYLE + TRAINING + ["--save", directory, "--async-save"])
    trainer.train_step()
    trainer.checkpointer.save(trainer.state.iteration)  # returns once the tensors are staged
    at_save = _full(trainer)
    trainer.train_step()  # training goes on and changes the parameters meanwhile
    # The tracker appears only once the checkpoint is complete (manifest written, renamed).
    if os.path.exists(os.path.join(directory, TRACKER)):
        assert os.path.isfile(os.path.join(directory, "iter_0000001", "manifest.json"))
    trainer.checkpointer.wait()
    assert open(os.path.join(directory, TRACKER)).read().strip() == "1"
    fresh = _setup(LLAMA_STYLE + TRAINING)
    assert load_checkpoint(directory, fresh.checkpoint_components()) == 1
    assert_close_dicts(_full(fresh), at_save, 0.0, "parameter")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_RUN = TINY_MODEL + "--global-batch-size 4 --train-iters 4 --mock-data --vocab-size 128".split()
TINY_RUN += "--eval-iters 0 --log-interval 1 --save-interval 2".split()


def _pretrain(directory: str, *extra: str, crash_at: str | None = None):
    environment = dict(os.environ, THREEFOLD_CRASH_AT=crash_at or "")
    return subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "pretrain_gpt.py"),
            *TINY_RUN,
            "--save",
            directory,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=environment,
    )


def _last_loss(output: str) -> str:
    return [line for line in output.splitlines() if "lm loss" in line][-1].split("|")[6]


def _kill_then_resume(directory: str, point: str) -> tuple:
    """(the run killed at `point` of the iteration-4 save, the tracker it left, the resumed
    run, the tracker that left)."""
    tracker = os.path.join(directory, TRACKER)
    killed = _pretrain(directory, crash_at=f"{point}@4")
    after_kill = open(tracker).read().strip()
    resumed = _pretrain(directory, "--load", directory)
    return killed, after_kill, resumed, open(tracker).read().strip()


@pytest.fixture(scope="module")
def killed_runs(request, tmp_path_factory):
    """The uninterrupted run and each selected point's kill and resume, started together."""
    with Runs(jobs=2) as runs:
        runs.start("straight", _pretrain, str(tmp_path_factory.mktemp("straight")))
        for point in selected(request, "test_a_process_killed_mid_save_loses_nothing", "point"):
            runs.start(point, _kill_then_resume, str(tmp_path_factory.mktemp(point) / "run"), point)
        yield runs


@pytest.mark.parametrize("point", ["after-rng", "before-shards", "before-tracker"])
def test_a_process_killed_mid_save_loses_nothing(point, killed_runs):
    """SIGKILL at several points of the iteration-4 save: the tracker still names iteration 2,
    which loads, and the resumed run finishes with the same final loss as one never killed."""
    killed, after_kill, resumed, after_resume = killed_runs.result(point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert after_kill == "2"
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "at iteration 2" in resumed.stdout
    assert _last_loss(resumed.stdout) == _last_loss(killed_runs.result("straight").stdout)
    assert after_resume == "4"


def _losses(output: str) -> list[str]:
    return [line.split("|")[6] for line in output.splitlines() if "lm loss" in line]


def test_pretrained_checkpoint_starts_a_run_that_later_resumes_itself(tmp_path):
    """Megatron-LM's --pretrained-checkpoint: while --load (the run's own --save) holds
    nothing, the run fine-tunes from it as --load BASE --finetune does; once it has saved, a
    restart with the same command line resumes its own checkpoint. Neither holding one is
    one line."""
    base, run = str(tmp_path / "base"), str(tmp_path / "run")
    assert _pretrain(base).returncode == 0
    same = ["--load", run, "--pretrained-checkpoint", base]
    first = _pretrain(run, *same)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"holds none: fine-tuning from --pretrained-checkpoint {base}" in first.stdout
    assert f"> loaded the weights of {base} (iteration 4)" in first.stdout
    finetuned = _pretrain(str(tmp_path / "finetune"), "--load", base, "--finetune")
    assert _losses(first.stdout) == _losses(finetuned.stdout) and len(_losses(first.stdout)) == 4
    again = _pretrain(run, *same)
    assert f"> resumed from {run} at iteration 4" in again.stdout, again.stderr[-2000:]
    # --use-checkpoint-args takes the model flags from where the run starts
    from threefold.checkpoint.args import flags_for_use_checkpoint_args

    fresh = run + "2"
    flags, note = flags_for_use_checkpoint_args(fresh, fresh, False, pretrained=base)
    assert f"model flags from {base}" in note and "--num-layers" in flags
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    refused = _pretrain(run + "2", "--load", run + "2", "--pretrained-checkpoint", empty)
    assert refused.returncode == 2 and refused.stderr == (
        f"pretrain_gpt.py: error: --pretrained-checkpoint {empty}: holds no checkpoint "
        f"(--load {run}2 holds none either); fix the path\n"
    )


def test_ckpt_step_loads_that_iteration_and_keeps_newer_ones_safe(tmp_path):
    """Megatron-LM's --ckpt-step N loads iteration N, not the tracker's; one --load does not
    hold is refused naming those it does, and a --save into the same directory, whose saves
    would replace the newer iterations, is refused before start."""
    from threefold.checkpoint.loadable import check_before_start

    directory = str(tmp_path / "run")
    trainer = _setup(LLAMA_STYLE + TRAINING)
    saved = {}
    for iteration in (1, 2):
        trainer.train_step()
        save_checkpoint(directory, trainer.checkpoint_components())
        saved[iteration] = _full(trainer)
    earlier = _setup(LLAMA_STYLE + TRAINING + ["--load", directory, "--ckpt-step", "1"])
    assert load_checkpoint(directory, earlier.checkpoint_components()) == 1
    assert earlier.state.iteration == 1
    assert_close_dicts(_full(earlier), saved[1], 0.0, "parameter")
    missing = _setup(LLAMA_STYLE + TRAINING + ["--load", directory, "--ckpt-step", "5"])
    with pytest.raises(ConfigError, match=r"holds no iteration 5 \(it holds: 2, 1\)"):
        load_checkpoint(directory, missing.checkpoint_components())
    same = missing.config.checkpoint
    same.ckpt_step, same.save = 1, directory
    with pytest.raises(ConfigError, match="newer iterations \\(2 the newest\\), which this run"):
        check_before_start(directory, same, 1, None)
    same.save = str(tmp_path / "elsewhere")
    assert check_before_start(directory, same, 1, None) == 1


def _streams_job(argv: list[str], directory: str, layouts: list[list[str]]) -> list[dict]:
    """Per layout, a load of `directory`: the streams the run had before it and after it,
    whether it said they were not restored, and the streams two steps later."""
    out = []
    for layout in layouts:
        trainer = _setup(argv + layout)
        fresh, said = torch.get_rng_state(), io.StringIO()
        with contextlib.redirect_stdout(said):
            assert load_checkpoint(directory, trainer.checkpoint_components()) == 1
        loaded, tracker = torch.get_rng_state(), dict(get_rng_tracker().states)
        for _ in range(2):
            trainer.train_step()
        out.append(
            {
                "fresh": fresh,
                "loaded": loaded,
                "tracker": tracker,
                "said": "random streams are not restored" in said.getvalue(),
                "after": torch.get_rng_state(),
            }
        )
    return out


def test_random_streams_resume_wherever_the_ranks_are_seeded_alike(tmp_path):
    """A rank's streams are seeded by its TP, PP and CP place, data-parallel replicas alike:
    a checkpoint resumes them at another DP (each replica takes replica 0's, and the
    replicas go on drawing alike), also where its tensors are read resharded (saved with the
    distributed optimizer's state, read at DP 2); at another TP they are left where --seed put
    them, and the run says so, as Megatron-LM does. (before: a 1-rank checkpoint at DP 2
    was refused for want of rank 1's streams, and with the distributed optimizer its streams
    were dropped)"""
    directory = str(tmp_path)
    argv = LLAMA_STYLE + TRAINING + DROPOUT
    saved = _setup(argv + ["--use-distributed-optimizer", "--save", directory])
    saved.train_step()
    save_checkpoint(directory, saved.checkpoint_components())
    streams = torch.load(os.path.join(directory, "iter_0000001", "rng", "rank_00000.pt"))
    layouts = [["--use-distributed-optimizer"], ["--tensor-model-parallel-size", "2"]]
    per_rank = run_distributed(2, _streams_job, argv, directory, layouts)
    for data_parallel, tensor_parallel in per_rank:
        assert torch.equal(data_parallel["loaded"], streams["torch"])
        assert data_parallel["tracker"].keys() == streams["tracker"].keys()
        assert all(
            torch.equal(data_parallel["tracker"][k], v) for k, v in streams["tracker"].items()
        )
        assert torch.equal(data_parallel["after"], per_rank[0][0]["after"])
        assert torch.equal(tensor_parallel["loaded"], tensor_parallel["fresh"])
    assert [rank[0]["said"] for rank in per_rank] == [False, False]
    assert [rank[1]["said"] for rank in per_rank] == [True, False]  # (rank 0 says it)


def test_each_rank_resumes_the_streams_of_its_place():
    """Which saved rank's streams each rank resumes: its own place (TP, CP, PP rank) in its
    own replica, or in replica 0 where the saved run had fewer; none where the saved ranks
    were placed otherwise."""
    one = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "world_size": 4}
    one |= {"virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1}
    layout = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    default = ParallelConfig(world_size=8, **layout)
    pp_before_dp = ParallelConfig(world_size=8, use_tp_pp_dp_mapping=True, **layout)
    assert rng_source_ranks(one, default, range(8)) == {
        **{0: 0, 1: 1, 2: 0, 3: 1},  # stage 0: replicas 0 and 1 (ranks 2, 3) take replica 0's
        **{4: 2, 5: 3, 6: 2, 7: 3},
    }
    two = one | {"world_size": 8, "use_tp_pp_dp_mapping": True}
    assert rng_source_ranks(two, pp_before_dp, range(8)) == {r: r for r in range(8)}
    assert rng_source_ranks(two | {"world_size": 4}, pp_before_dp, range(8)) == {
        r: r % 4 for r in range(8)
    }
    assert (
        rng_source_ranks(
            one, ParallelConfig(world_size=2, **layout | {"pipeline_model_parallel_size": 1}), [0]
        )
        == {}
    )
    assert rng_source_ranks(one, pp_before_dp, range(8)) == {}  # another rank order
    assert rng_source_ranks(
        two, ParallelConfig(world_size=4, **layout, use_tp_pp_dp_mapping=True), [3]
    ) == {3: 3}
    assert rng_source_ranks(None, default, [0]) == {}  # Megatron-LM's own: not read
