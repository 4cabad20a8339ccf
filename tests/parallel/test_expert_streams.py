"""Random streams inside experts (parallel/tensor_parallel/random.py): dropout in an expert (a
LoRA adapter's) draws from streams of the experts' own, seeded by EP and expert-TP rank.

An expert draws as many numbers as tokens reached it, so its draws differ from EP rank to EP
rank. Drawn from the default stream (before), they put the TP ranks' default streams out of
step wherever those ranks are different EP ranks (expert TP 1), and every later mask that must
agree over TP with them (a column-parallel adapter's, on the input all of TP shares)."""

import itertools

import torch

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, _setup
from threefold.checkpoint.save import rng_state, set_rng_state
from threefold.parallel.parallel_context import Group, ParallelContext
from threefold.parallel.tensor_parallel.random import (
    EXPERT_MODEL_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    get_rng_tracker,
    set_random_seed,
)

MOE_LORA_DROPOUT = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--lora-rank", "4"]
MOE_LORA_DROPOUT += ["--lr", "3e-2", "--lora-dropout", "0.1"]


def _expert_masks_job() -> dict:
    from threefold.parallel import state

    state.initialize_model_parallel(expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    parallel = state.parallel_context()
    set_random_seed(1234, parallel)
    masks = {"ep": parallel.ep.rank, "etp": parallel.expert_tp.rank}
    for name, stream in (("split", EXPERT_PARALLEL_RNG), ("shared", EXPERT_MODEL_PARALLEL_RNG)):
        with get_rng_tracker().fork(stream):
            masks[name] = torch.nn.functional.dropout(torch.ones(64), 0.5)
    return masks


def test_expert_masks_differ_over_expert_tp_only_on_split_inputs():
    """EP 2 x expert TP 2 over four DP ranks: masks on an input split over expert TP (fc2's)
    differ on every rank; on an input the expert-TP ranks share (fc1's) they agree there and
    differ from EP rank to EP rank (other experts, other tokens)."""
    place = {(r["ep"], r["etp"]): r for r in run_distributed(4, _expert_masks_job)}
    assert sorted(place) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for a, b in itertools.combinations(place.values(), 2):
        assert not torch.equal(a["split"], b["split"])
    for ep in (0, 1):
        assert torch.equal(place[ep, 0]["shared"], place[ep, 1]["shared"])
    assert not torch.equal(place[0, 0]["shared"], place[1, 0]["shared"])


def _default_streams_job(argv: list[str]) -> list[torch.Tensor]:
    trainer = _setup(argv)
    return [(trainer.train_step(), torch.get_rng_state())[1] for _ in range(2)]


def test_routed_draws_leave_the_tp_ranks_default_streams_in_step():
    """TP 2 + SP x EP 2 at expert TP 1: the TP ranks are different EP ranks, whose experts got
    different numbers of tokens. Their default streams stay equal after each step (before:
    they differed after the first, so the next layer's QKV adapter drew other masks on each
    TP rank for the sequence both hold)."""
    argv = LLAMA_STYLE + TRAINING + MOE_LORA_DROPOUT + ["--tensor-model-parallel-size", "2"]
    argv += ["--sequence-parallel", "--expert-model-parallel-size", "2"]
    results = run_distributed(
        2, _default_streams_job, argv + ["--expert-tensor-parallel-size", "1"]
    )
    for step in range(2):
        assert torch.equal(results[0][step], results[1][step]), step


def _seeded(ep_rank: int) -> dict[str, torch.Tensor]:
    set_random_seed(1234, ParallelContext(ep=Group(size=2, rank=ep_rank)))
    return dict(get_rng_tracker().states)


def test_a_checkpoint_resumes_the_expert_streams_of_ranks_seeded_alike():
    """A rank resumes the saved rank's expert streams where that rank held the same EP and
    expert-TP place (at another DP size it need not); the other streams, Megatron's way,
    regardless. A file from before the expert streams leaves them as seeded (before: the
    tracker took the file's streams only, and the first expert dropout found none)."""
    with torch.random.fork_rng():
        _seeded(1)
        for name in list(get_rng_tracker().states):
            with get_rng_tracker().fork(name):
                torch.rand(100)  # every stream moves on from its seed
        saved = rng_state()
        drawn = saved["tracker"]

        _seeded(1)
        set_rng_state(saved)
        assert all(torch.equal(get_rng_tracker().states[k], v) for k, v in drawn.items())

        _assert_expert_streams_left_as_seeded(saved, 0, drawn)  # (another EP rank)
        older = {k: v for k, v in saved.items() if k != "tracker_seeds"}
        older["tracker"] = {MODEL_PARALLEL_RNG: drawn[MODEL_PARALLEL_RNG]}
        _assert_expert_streams_left_as_seeded(older, 1, drawn)


def _assert_expert_streams_left_as_seeded(saved: dict, ep_rank: int, drawn: dict) -> None:
    """`saved` resumed at EP rank `ep_rank`: the TP stream as drawn, the experts' as seeded."""
    fresh = _seeded(ep_rank)
    set_rng_state(saved)
    resumed = get_rng_tracker().states
    assert torch.equal(resumed[MODEL_PARALLEL_RNG], drawn[MODEL_PARALLEL_RNG])
    for name in (EXPERT_PARALLEL_RNG, EXPERT_MODEL_PARALLEL_RNG):
        assert torch.equal(resumed[name], fresh[name]), name
