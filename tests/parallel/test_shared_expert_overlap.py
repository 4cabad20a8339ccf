"""--moe-shared-expert-overlap (Megatron-LM's): the shared expert runs while the alltoall
dispatcher's all-to-alls travel (fc1 and the activation beside the dispatch, fc2 and the gate
beside the combine). The exchange really is in flight while it runs; the computation is the
same, its gradients added to the input's in another order (after the router's, as in
Megatron-LM): EP2, EP2 x TP2+SP and EP2 x ETP2 train as one process without the overlap;
bad combinations stop in one line."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import MOE
from tests.parity import LLAMA_STYLE, TRAINING, assert_matches_reference, train_job
from threefold.arguments import parse_args
from threefold.parallel.expert_parallel import dispatcher

SHARED = ["--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"]
MODEL = LLAMA_STYLE + TRAINING + MOE + SHARED + ["--moe-token-dispatcher-type", "alltoall"]
OVERLAP = ["--moe-shared-expert-overlap"]


def overlapped_train_job(argv: list[str], steps: int) -> dict:
    """`train_job`, counting the shared-expert parts run between an all-to-all's start and
    its wait."""
    beside = []
    exchange = dispatcher._exchange

    def counting(x, send, recv, ep, work):
        def watched():
            beside.append(1)
            return work()

        return exchange(x, send, recv, ep, None if work is None else watched)

    dispatcher._exchange = counting
    try:
        result = train_job(argv, steps)
    finally:
        dispatcher._exchange = exchange
    return {**result, "beside": len(beside)}


LAYOUTS = {
    "ep2": ["--expert-model-parallel-size", "2"],
    "ep2-tp2-sp": ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    + ["--sequence-parallel"],
    "ep2-etp2": ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_overlapped_shared_expert_trains_as_one_process(layout):
    reference = train_job(MODEL, 4)
    results = run_distributed(4, overlapped_train_job, MODEL + OVERLAP + LAYOUTS[layout], 4)
    assert_matches_reference(results, reference, 1e-5)
    # the dispatch's and the combine's, in both MoE layers, for each micro-batch: 4 steps of a
    # global batch of 8 in micro-batches of 2 over DP (4 ranks / TP)
    data_parallel = 4 // (2 if "--tensor-model-parallel-size" in LAYOUTS[layout] else 1)
    micro_batches = 4 * 8 // (2 * data_parallel)
    assert [result["beside"] for result in results] == [2 * 2 * micro_batches] * 4


def test_one_process_matches_without_the_overlap():
    """No exchange on one rank: the shared expert runs in the same two parts, after the
    router; losses equal to rounding."""
    plain, overlapped = train_job(MODEL, 4), train_job(MODEL + OVERLAP, 4)
    assert overlapped["losses"] == pytest.approx(plain["losses"], rel=1e-6)


@pytest.mark.parametrize(
    "flags,named",
    [
        (MOE + OVERLAP, "add --moe-shared-expert-intermediate-size"),
        (MOE + SHARED + OVERLAP, "add --moe-token-dispatcher-type alltoall"),
        (
            MOE
            + SHARED
            + OVERLAP
            + ["--moe-token-dispatcher-type", "alltoall", "--recompute-granularity"]
            + ["selective", "--recompute-modules", "shared_experts"],
            "--recompute-modules shared_experts",
        ),
    ],
    ids=["no-shared-expert", "allgather", "recomputed"],
)
def test_refusals_are_one_line(capsys, flags, named):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + flags)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1, error
