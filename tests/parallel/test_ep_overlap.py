"""--overlap-moe-expert-parallel-comm (Megatron-LM's combined 1F1B): each micro-batch's forward
runs together with the previous one's backward, handing over at every expert-parallel exchange
while the exchange travels. The layouts train as one process without it; each rank counts the
handovers the order promises (backward first, then strictly in turn, four per MoE layer of a
combined step); bad combinations stop in one line."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import MOE
from tests.parallel.test_fp8 import RECIPES, assert_match_one_device, fp8_train_job, stepwise_parity
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    assert_close_dicts,
    assert_matches_reference,
    train_job,
)
from threefold.arguments import parse_args
from threefold.parallel.expert_parallel import dispatcher
from threefold.parallel.pipeline_parallel import combined_1f1b
from threefold.parallel.pipeline_parallel.order import combined_interleaved_steps, interleaved_order
from threefold.parallel.tensor_parallel import delayed_wgrad
from threefold.parallel.tensor_parallel.mappings import COLLECTIVE_COUNTS
from threefold.training.activation_estimate import micro_batches_in_flight
from threefold.training.memory_estimate import estimate_memory, stage_parameters

ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
MODEL = LLAMA_STYLE + TRAINING + MOE + ALLTOALL
OVERLAP = ["--overlap-moe-expert-parallel-comm"]


def counted_train_job(argv: list[str], iterations: int) -> dict:
    """`train_job`, recording which pass handed over at each exchange of a combined step,
    whether the exchange was still pending on the wire (not yet waited) when it did, and how
    many deferred weight gradients each flush computed with an exchange in flight or not."""
    sides, pending, steps, flushed = [], [], [], {True: 0, False: 0}
    hand_over, all_to_all = combined_1f1b._Turns.hand_over, dispatcher._all_to_all
    start, flush = combined_1f1b._Turns.__init__, delayed_wgrad.flush
    in_flight = threading.local()

    def counting_flush():
        travelling = getattr(in_flight, "work", None) is not None
        flushed[travelling] += len(delayed_wgrad._pending or [])
        flush()

    def counting(self, first):
        steps.append(first)
        start(self, first)

    def recording(self, side):
        sides.append(side)
        pending.append(getattr(in_flight, "work", None) is not None)
        return hand_over(self, side)

    def watched(x, send, recv, ep, async_op=False):
        result = all_to_all(x, send, recv, ep, async_op)
        if async_op:
            out, work = result
            in_flight.work = work

            class Work:
                def wait(self):
                    in_flight.work = None
                    return work.wait()

            return out, Work()
        return result

    rings = COLLECTIVE_COUNTS["in_ring_steps"]
    combined_1f1b._Turns.hand_over, dispatcher._all_to_all = recording, watched
    combined_1f1b._Turns.__init__, delayed_wgrad.flush = counting, counting_flush
    try:
        result = train_job(argv, iterations)
    finally:
        combined_1f1b._Turns.hand_over, dispatcher._all_to_all = hand_over, all_to_all
        combined_1f1b._Turns.__init__, delayed_wgrad.flush = start, flush
    rank = torch.distributed.get_rank()
    counts = {"combined": len(steps), "rank": rank, "flushed": flushed}
    counts["rings"] = COLLECTIVE_COUNTS["in_ring_steps"] - rings  # --tp-comm-overlap's
    return {**result, "sides": sides, "pending": pending, **counts}


EP2 = ["--expert-model-parallel-size", "2"]
PP2_VPP2 = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
DELAYED = ["--delay-wgrad-compute"]
SHARED = ["--moe-shared-expert-intermediate-size", "32"]
# (the layout, model flags the one-process reference shares)
LAYOUTS = {
    "ep2": (EP2, []),
    "ep4": (["--expert-model-parallel-size", "4"], []),
    "ep2-tp2-sp": (EP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], []),
    "ep2-etp2": (EP2 + ["--expert-tensor-parallel-size", "2"], []),
    # FSDP2, every parameter kept gathered through the schedule
    "ep2-fsdp4": (EP2 + ["--distributed-strategy", "fsdp"], []),
    "ep2-fsdp4-delayed-wgrad": (EP2 + DELAYED + ["--distributed-strategy", "fsdp"], SHARED),
    # the ring attention's exchanges between the turns
    "ep2-cp2": (EP2 + ["--context-parallel-size", "2"], []),
    "ep2-dp2-distributed-optimizer-overlapped": (
        EP2 + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
        [],
    ),
    # one MTP layer (an MoE layer too), a gated shared expert, the grouped GEMM, offloading
    "ep2-mtp-shared-grouped-offloaded": (
        EP2,
        ["--mtp-num-layers", "1", "--moe-shared-expert-intermediate-size", "32"]
        + ["--moe-shared-expert-gate", "--moe-grouped-gemm", "--fine-grained-activation-offloading"]
        + ["--offload-modules", "core_attn", "expert_fc1", "--min-offloaded-tensor-size", "0"],
    ),
    # interleaved: four chunks of one layer, four micro-batches a step
    "pp2-vpp2-ep2": (PP2_VPP2 + EP2, ["--num-layers", "4", "--global-batch-size", "16"]),
    # --delay-wgrad-compute: every GEMM path that defers (gradient-accumulation fusion's, the
    # SwiGLU blocks' of the shared expert, the plain one, the grouped experts')
    "ep2-delayed-wgrad-fused": (
        EP2 + DELAYED + ["--use-distributed-optimizer", "--overlap-grad-reduce"],
        SHARED,
    ),
    "ep2-delayed-wgrad-unfused-grouped": (
        EP2 + DELAYED + ["--no-gradient-accumulation-fusion"],
        SHARED + ["--moe-grouped-gemm"],
    ),
    "pp2-vpp2-ep2-delayed-wgrad": (
        PP2_VPP2 + EP2 + DELAYED,
        ["--num-layers", "4", "--global-batch-size", "16"],
    ),
    # FSDP2 around each of the four chunks, every one kept gathered through the schedule
    "pp2-vpp2-ep2-fsdp": (
        PP2_VPP2 + EP2 + ["--distributed-strategy", "fsdp"],
        ["--num-layers", "4", "--global-batch-size", "16"],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_combined_step_trains_as_one_process(layout):
    parallel, model = LAYOUTS[layout]
    model = ["--global-batch-size", "32"] + model  # (a layout's own comes after, and wins)
    reference = train_job(MODEL + model, 4)
    results = run_distributed(4, counted_train_job, MODEL + model + OVERLAP + parallel, 4)
    assert_matches_reference(results, reference, 1e-5)
    for result in results:
        # every combined step the order has, both passes handing over at both exchanges of
        # each MoE layer they run, and the exchange still on the wire each time
        assert result["combined"] == 4 * combined_steps(parallel, model, result["rank"])
        layers = 1 if "--pipeline-model-parallel-size" in parallel else 2
        layers += "--mtp-num-layers" in model
        assert result["sides"] == ["backward", "forward"] * 2 * layers * result["combined"]
        assert all(result["pending"])
        # --delay-wgrad-compute: most weight-gradient GEMMs of a combined step's backward ran
        # beside an exchange (the rest at the end of the pass: below its first layer)
        beside, after = result["flushed"][True], result["flushed"][False]
        assert (beside > after > 0) if DELAYED[0] in parallel else beside == after == 0


def test_a_tied_output_layer_is_not_deferred_under_the_overlapped_reduction():
    """A tied output layer's weight also gets the embedding's gradient in the same pass. Its
    share deferred, the gradient buffer would meet that weight twice in one micro-batch, and
    --overlap-grad-reduce, which counts one arrival per micro-batch, reduced its bucket before
    the step's last gradients (the first step's grad norm 0.771 against 0.372). Only a layer's
    own weight defers: the layout trains as one process."""
    tied = [flag for flag in MODEL if flag != "--untie-embeddings-and-output-weights"]
    tied += ["--global-batch-size", "32"]
    reference = train_job(tied, 4)
    flags = OVERLAP + EP2 + DELAYED + ["--overlap-grad-reduce"]
    results = run_distributed(4, counted_train_job, tied + flags, 4)
    assert_matches_reference(results, reference, 1e-5)
    assert all(result["flushed"][True] > 0 for result in results)


def test_the_tp_comm_overlap_rings_weight_gradients_wait_as_the_plain_gemms_do():
    """--delay-wgrad-compute with --tp-comm-overlap: EP2 x TP2 with sequence parallelism, the
    linear layers' collectives in ring steps, tied embeddings and --overlap-grad-reduce, trains
    as one process. The rings' weight-gradient GEMMs wait as the plain collectives' GEMMs do
    (as many deferred, most beside an exchange); the tied output layer's ring, whose weight the
    embedding's gradient also reaches, computes at once."""
    tied = [flag for flag in MODEL if flag != "--untie-embeddings-and-output-weights"]
    tied += ["--global-batch-size", "32"] + SHARED
    reference = train_job(tied, 4)
    layout = tied + OVERLAP + EP2 + DELAYED + ["--overlap-grad-reduce"]
    layout += ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    in_rings = run_distributed(4, counted_train_job, layout + ["--tp-comm-overlap"], 4)
    gathered = run_distributed(4, counted_train_job, layout, 4)
    assert_matches_reference(in_rings, reference, 1e-5)
    for rings, plain in zip(in_rings, gathered):
        assert rings["rings"] > 0 and plain["rings"] == 0
        assert rings["flushed"] == plain["flushed"]
        assert rings["flushed"][True] > rings["flushed"][False] > 0


@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
def test_fp8_weight_gradients_wait_for_the_exchanges_too(tmp_path, recipe):
    """--delay-wgrad-compute with FP8 layers (attention and the shared expert; under rowwise
    the experts too): EP2 with the combined step trains exactly as the same layout with its
    weight gradients computed at once (the same GEMMs, each weight's micro-batches added in
    the same order), as many of them deferred as in bf16, most beside an exchange; and as
    one FP8 device, a step at a time, to the FP8 layouts' tolerances
    (tests/parallel/test_fp8.py)."""
    model = MODEL + ["--global-batch-size", "32"] + SHARED
    argv, layout = model + RECIPES[recipe], model + RECIPES[recipe] + OVERLAP + EP2
    at_once = run_distributed(4, counted_train_job, layout, 3)
    deferred = run_distributed(4, counted_train_job, layout + DELAYED, 3)
    in_bf16 = run_distributed(4, counted_train_job, model + OVERLAP + EP2 + DELAYED, 3)
    for plain, delayed, bf16 in zip(at_once, deferred, in_bf16):
        assert delayed["losses"] == plain["losses"]
        assert_close_dicts(delayed["params"], plain["params"], 0, "parameter")
        assert_close_dicts(delayed["fp8"], plain["fp8"], 0, "fp8 state")
        assert plain["flushed"] == {True: 0, False: 0}
        assert delayed["flushed"] == bf16["flushed"]
        assert delayed["flushed"][True] > delayed["flushed"][False] > 0
    results, reference = stepwise_parity(4, fp8_train_job, layout + DELAYED, argv, tmp_path)
    assert_match_one_device(results, reference, recipe)


def combined_steps(parallel: list[str], model: list[str], rank: int) -> int:
    """Combined steps in one iteration on `rank`: all micro-batches but the first without
    pipeline stages; the interleaved order's pairs with them (PP2 outermost of 4 ranks)."""
    global_batch = int(model[len(model) - 1 - model[::-1].index("--global-batch-size") + 1])
    model_parallel = 2 if "--tensor-model-parallel-size" in parallel else 1
    model_parallel *= 2 if "--context-parallel-size" in parallel else 1
    model_parallel *= 2 if "--pipeline-model-parallel-size" in parallel else 1
    micro_batches = global_batch // (2 * (4 // model_parallel))
    if "--pipeline-model-parallel-size" not in parallel:
        return micro_batches - 1
    steps = combined_interleaved_steps(micro_batches, 2, rank // 2, 2)
    return sum(len(step) == 2 for step in steps)


def test_one_process_of_expert_parallel_size_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(MODEL + OVERLAP)
    assert "--expert-model-parallel-size > 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,named",
    [
        (TRAINING + MOE, "add --moe-token-dispatcher-type alltoall"),
        (
            TRAINING + MOE + ALLTOALL + ["--pipeline-model-parallel-size", "2"],
            "--num-virtual-stages-per-pipeline-rank",
        ),
        (
            TRAINING
            + MOE
            + ALLTOALL
            + ["--recompute-granularity", "full"]
            + ["--recompute-method", "uniform", "--recompute-num-layers", "1"],
            "full recomputation",
        ),
        (
            TRAINING
            + MOE
            + ALLTOALL
            + ["--recompute-granularity", "selective"]
            + ["--recompute-modules", "moe"],
            "drop moe",
        ),
        (
            TRAINING
            + MOE
            + ALLTOALL
            + ["--moe-shared-expert-intermediate-size", "32"]
            + ["--moe-shared-expert-overlap"],
            "--moe-shared-expert-overlap",
        ),
        (TRAINING + MOE + ALLTOALL + ["--compile-layers"], "--compile-layers"),
    ],
    ids=["allgather", "pipeline", "full-recompute", "moe-recompute", "shared-overlap", "compile"],
)
def test_refusals_are_one_line(capsys, monkeypatch, flags, named):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + flags + OVERLAP + ["--expert-model-parallel-size", "2"])
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1, error


def _runs_to_the_end(steps_of_ranks: list[list[list[tuple]]], virtual: int) -> bool:
    """Every rank runs its steps in turn; a step starts once the neighbours have finished the
    steps that send its inputs (a forward's from the stage before, a backward's gradient from
    the stage after, chunks wrapping around the ring) and its backward's own forward ran in an
    earlier step; sends go out as a step ends. False if the ranks stop short (a deadlock)."""
    stages = len(steps_of_ranks)

    def source(kind: str, micro_batch: int, chunk: int, rank: int):
        if kind == "F":
            if rank == 0 and chunk == 0:
                return None
            return ("F", micro_batch, *((chunk, rank - 1) if rank else (chunk - 1, stages - 1)))
        if rank == stages - 1 and chunk == virtual - 1:
            return None
        later = (chunk, rank + 1) if rank < stages - 1 else (chunk + 1, 0)
        return ("B", micro_batch, *later)

    done, position, moved = set(), [0] * stages, True
    while moved:
        moved = False
        for rank, steps in enumerate(steps_of_ranks):
            if position[rank] == len(steps):
                continue
            step = steps[position[rank]]
            inputs = [source(*action, rank) for action in step]
            own = [("F", mb, chunk, rank) for kind, mb, chunk in step if kind == "B"]
            if all(x is None or x in done for x in inputs) and all(x in done for x in own):
                done.update((*action, rank) for action in step)
                position[rank] += 1
                moved = True
    return all(position[rank] == len(steps) for rank, steps in enumerate(steps_of_ranks))


def test_the_combined_interleaved_order_never_waits_on_itself():
    """Every valid interleaved layout up to 6 stages, 4 chunks, 30 micro-batches (groups
    included): the combined steps run to the end, each pairing independent actions, and the
    flat order is the plain one with one more warm-up forward. Without the extra forward
    the last stage would pair a micro-batch's forward with its own backward."""
    cases = 0
    for stages in range(2, 7):
        for virtual in range(2, 5):
            for micro_batches in range(stages, 5 * stages + 1):
                groups = [None] + [
                    group
                    for group in range(stages, micro_batches + 1)
                    if micro_batches % group in (0, *range(stages, group))
                ]
                for group in groups:
                    if group is None and micro_batches % stages:
                        continue
                    ranks = range(stages)
                    steps = [
                        combined_interleaved_steps(micro_batches, stages, r, virtual, group)
                        for r in ranks
                    ]
                    assert _runs_to_the_end(steps, virtual), (stages, virtual, micro_batches)
                    plain = [
                        combined_interleaved_steps(micro_batches, stages, r, virtual, group, False)
                        for r in ranks
                    ]
                    assert _runs_to_the_end(plain, virtual)
                    cases += 1
    assert cases > 1000
    # the last stage, without the extra warm-up forward, would pair F(mb, c) with B(mb, c)
    last = combined_interleaved_steps(8, 2, 1, 2)
    assert all(step[0][1:] != step[1][1:] for step in last if len(step) == 2)


def _most_held(order: list[tuple]) -> int:
    held = most = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def test_the_memory_estimate_holds_what_the_combined_schedule_holds(monkeypatch):
    """Without stages a combined step holds two micro-batches' activations, where the plain
    schedule holds one; interleaved, each stage holds one model chunk's more (the extra
    warm-up forward), which the estimate walks from the same order."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    flags = MODEL + EP2 + ["--global-batch-size", "32"]
    assert micro_batches_in_flight(parse_args(flags), 0) == 1
    assert micro_batches_in_flight(parse_args(flags + OVERLAP), 0) == 2
    for rank in range(4):
        plain = combined_interleaved_steps(8, 4, rank, 2, None, False)
        combined = combined_interleaved_steps(8, 4, rank, 2)
        flat = [action for step in combined for action in step]
        assert _most_held(flat) == _most_held([step[0] for step in plain]) + 1
        assert flat == interleaved_order(8, 4, rank, 2, None, True)


def test_under_fsdp_the_estimate_counts_every_parameter_gathered(monkeypatch):
    """FSDP2 keeps the parameters gathered through the combined schedule: the estimate adds
    a whole copy in the compute dtype (fp32 here) to the shards."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    flags = MODEL + EP2 + ["--global-batch-size", "32", "--distributed-strategy", "fsdp"]
    config, plain = parse_args(flags + OVERLAP), parse_args(flags)
    count = stage_parameters(config.model, config.parallel, config.model.padded_vocab_size(1), 0)
    gathered = estimate_memory(config).parameters - estimate_memory(plain).parameters
    assert gathered == pytest.approx(4 * count)
