"""Context parallelism reproduces the single-process model (real gloo ranks).

Each rank holds chunks r and 2CP-1-r of the sequence; the three --cp-comm-type attentions must
give every token the same output and gradients as attention over the whole sequence.
"""

import pytest
import torch

from tests.distributed import run_distributed

COMM_TYPES = ["p2p", "allgather", "a2a"]
# a2a+p2p: all-to-all within pairs of consecutive CP ranks, ring attention across the pairs
HIERARCHICAL = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"]


# Packed documents of a 32-token sequence, per sample: their first tokens. They cross chunk
# boundaries, and at CP4 (chunks of 4) whole chunks' queries have no key in another's block.
DOCUMENT_STARTS = ([0, 3, 11, 12, 20, 29], [0, 16, 17, 31])


def _document_ids(sequence: int) -> torch.Tensor:
    starts = torch.zeros(len(DOCUMENT_STARTS), sequence, dtype=torch.long)
    for row, firsts in enumerate(DOCUMENT_STARTS):
        starts[row, firsts] = 1
    return starts.cumsum(1)


def _core_attention_job(
    comm_type: str,
    heads: int,
    groups: int,
    hierarchy: list[int] | None = None,
    documents: bool = False,
    window: int | None = None,
    sinks: bool = False,
    softcap: float | None = None,
) -> list[float]:
    import functools

    import torch.distributed as dist

    from threefold.kernels import reference
    from threefold.parallel import state
    from threefold.parallel.context_parallel.attention import context_parallel_attention
    from threefold.parallel.context_parallel.sequence import (
        Documents,
        document_mask,
        local_positions,
        window_mask,
    )

    state.initialize_model_parallel(
        1,
        1,
        context_parallel_size=dist.get_world_size(),
        hierarchical_context_parallel_sizes=hierarchy,
    )
    parallel = state.parallel_context(cp_comm_type=comm_type)
    cp = parallel.cp
    torch.manual_seed(0)  # the same whole-sequence inputs on every rank
    sequence, batch, head_dim = 32, 2, 8
    q = torch.randn(sequence, batch, heads, head_dim, requires_grad=True)
    k = torch.randn(sequence, batch, groups, head_dim, requires_grad=True)
    v = torch.randn(sequence, batch, groups, head_dim, requires_grad=True)
    upstream = torch.randn(sequence, batch, heads * head_dim)
    ids = _document_ids(sequence) if documents else None
    mask = None if ids is None else document_mask(ids)
    mask = mask if window is None else window_mask(sequence, window, mask, q.device)
    # attention sinks (--softmax-type learnable): one more logit per head, learned
    sink = torch.randn(heads, requires_grad=True) if sinks else None
    whole = reference.attention if sink is None else reference.attention_with_sinks
    if softcap is not None:  # (--attn-logit-softcapping: Ulysses's local attention caps too)
        whole = functools.partial(reference.attention_written_out, softcap=softcap)
    expected = whole(q, k, v, mask, 0.0, *([] if sink is None else [sink]))
    expected.backward(upstream)

    mine = local_positions(sequence, cp)
    local = [t.detach()[mine].clone().requires_grad_() for t in (q, k, v)]
    hierarchy = (parallel.cp_a2a, parallel.cp_p2p)
    attention = context_parallel_attention(cp, comm_type, whole, hierarchy, softcap)
    spans = None if ids is None else Documents.of(ids, cp.size)
    if window is not None:
        spans = Documents.windowed(spans, window, cp.size, local[0])
    my_sink = None if sink is None else sink.detach().clone().requires_grad_()
    out = attention(*local, spans, 0.0, *([] if sink is None else [my_sink]))
    out.backward(upstream[mine])
    pairs = [(out, expected[mine])] + [(t.grad, w.grad[mine]) for t, w in zip(local, (q, k, v))]
    if sink is not None:  # each rank's rows' share of the sinks' gradient, summed
        dist.all_reduce(my_sink.grad, group=cp.group)
        pairs.append((my_sink.grad, sink.grad))
    return [float((a - b).abs().max() / b.abs().max()) for a, b in pairs]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_core_attention_equals_whole_sequence_attention(cp, comm_type):
    for errors in run_distributed(cp, _core_attention_job, comm_type, 8, 4):  # GQA: 2 per group
        assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("comm_type", [*COMM_TYPES, "a2a+p2p"])
def test_packed_documents_attend_within_themselves_over_cp4(comm_type):
    """Per-document attention (--reset-attention-mask, --sft, --sft-packing) split over 4 CP
    ranks: every token's output and gradients are those of the whole sequence's masked
    attention, though some blocks hold queries with no key of their own document."""
    hierarchy = [2, 2] if comm_type == "a2a+p2p" else None
    for errors in run_distributed(4, _core_attention_job, comm_type, 8, 4, hierarchy, True):
        assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("documents", [False, True], ids=["window", "window-documents"])
@pytest.mark.parametrize("comm_type", [*COMM_TYPES, "a2a+p2p"])
def test_a_sliding_window_over_cp4_is_the_whole_sequences(comm_type, documents):
    """--window-size 5,0 over 4 CP ranks (chunks of 4 tokens): each block masked by its
    tokens' positions (and documents) gives every token the whole sequence's output and
    gradients."""
    hierarchy = [2, 2] if comm_type == "a2a+p2p" else None
    results = run_distributed(4, _core_attention_job, comm_type, 8, 4, hierarchy, documents, 5)
    for errors in results:
        assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("comm_type", [*COMM_TYPES, "a2a+p2p"])
def test_attention_sinks_over_cp4_are_the_whole_sequences(comm_type):
    """GPT-OSS's attention over 4 CP ranks: learned sinks, a sliding window of 5 and packed
    documents; the ring and all-gather merge the sinks as a last block, Ulysses gives each
    rank its heads' sinks. Outputs, q/k/v gradients and the sinks' gradient (summed over the
    ranks' rows) are the whole sequence's."""
    hierarchy = [2, 2] if comm_type == "a2a+p2p" else None
    args = (comm_type, 8, 4, hierarchy, True, 5, True)
    for errors in run_distributed(4, _core_attention_job, *args):
        assert len(errors) == 5 and max(errors) < 1e-5, errors


@pytest.mark.parametrize("comm_type", [*COMM_TYPES, "a2a+p2p"])
def test_capped_scores_over_cp4_are_the_whole_sequences(comm_type):
    """Gemma 2's attention over 4 CP ranks: scores capped softly at 0.5 (more than half the
    random ones are larger), a sliding window of 5 and packed documents; each block caps its
    own scores (Ulysses's local attention caps them on whole sequences). Outputs and q/k/v
    gradients are the whole sequence's."""
    hierarchy = [2, 2] if comm_type == "a2a+p2p" else None
    args = (comm_type, 8, 4, hierarchy, True, 5, False, 0.5)
    for errors in run_distributed(4, _core_attention_job, *args):
        assert len(errors) == 4 and max(errors) < 1e-5, errors


@pytest.mark.parametrize("hierarchy", [[2, 2], [4, 2], [2, 4]], ids=["2x2", "4x2", "2x4"])
def test_hierarchical_core_attention_equals_whole_sequence_attention(hierarchy):
    """a2a+p2p: the all-to-all's group first (consecutive CP ranks), then the ring's."""
    world = hierarchy[0] * hierarchy[1]
    for errors in run_distributed(world, _core_attention_job, "a2a+p2p", 8, 4, hierarchy):
        assert max(errors) < 1e-5, errors


from tests.parity import (  # noqa: E402
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    assert_close_dicts,
    assert_matches_reference,
    first_step_gradients_job,
    relative_error,
    train_job,
)

STYLES = {"llama": LLAMA_STYLE, "gpt2": GPT2_STYLE}
# Sequence 16 splits into 2 x CP chunks of 4 (CP=2) or 2 (CP=4) tokens.
LAYOUTS = {
    "cp2": (2, []),
    "cp4": (4, []),
    "tp2_cp2_sp": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_cp2": (4, ["--pipeline-model-parallel-size", "2"]),
    "cp2_dp2_distopt": (4, ["--use-distributed-optimizer"]),
    "cp2_recompute_full": (
        2,
        ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        + ["--recompute-num-layers", "1"],
    ),
    "cp2_recompute_selective": (2, ["--recompute-granularity", "selective"]),
    "cp2_dp2_torch_ddp": (4, ["--distributed-strategy", "ddp"]),
    "cp2_dp2_torch_fsdp": (4, ["--distributed-strategy", "fsdp"]),
    "pp2_vpp2_cp2": (
        4,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
        + ["--num-layers", "4"],
    ),
}


def _argv(style: str, world: int, extra: list[str], comm_type: str, cp: int) -> list[str]:
    argv = STYLES[style] + TRAINING + extra + ["--context-parallel-size", str(cp)]
    if comm_type == "a2a+p2p":
        return argv + HIERARCHICAL
    return argv + ["--cp-comm-type", comm_type]


@pytest.fixture(scope="module")
def references():
    return {
        style: {
            "train": train_job(argv + TRAINING, 10),
            "grads": first_step_gradients_job(argv + TRAINING),
            # a deeper model (for the virtual stages): its own reference
            "train-4-layers": train_job(argv + TRAINING + ["--num-layers", "4"], 10),
        }
        for style, argv in STYLES.items()
    }


@pytest.mark.parametrize(
    "style,cp,comm_type",
    [(style, cp, comm) for comm in COMM_TYPES for cp in (2, 4) for style in STYLES]
    + [("llama", 4, "a2a+p2p")],
)
def test_first_step_gradients_match(references, style, cp, comm_type):
    expected = references[style]["grads"]
    for result in run_distributed(
        cp, first_step_gradients_job, _argv(style, cp, [], comm_type, cp)
    ):
        assert abs(result["loss"] - expected["loss"]) <= 1e-6 * expected["loss"]
        assert_close_dicts(result["grads"], expected["grads"], 1e-5, "gradient")


# Each layout meets each communication type once, the model styles alternating: every pair of
# layout, communication type and style is covered (a pairwise design) in half the runs of their
# product. The communication type changes only core attention, proven per type and style by
# the first-step tests; the layout changes what runs around it.
PAIRWISE = [
    pytest.param(layout, comm_type, style, id=f"{layout}-{comm_type}-{style}")
    for i, layout in enumerate(LAYOUTS)
    for j, comm_type in enumerate(COMM_TYPES)
    for style in [list(STYLES)[(i + j) % len(STYLES)]]
]


PAIRWISE.append(pytest.param("cp4", "a2a+p2p", "gpt2", id="cp4-a2a+p2p-gpt2"))


@pytest.mark.parametrize("layout,comm_type,style", PAIRWISE)
def test_ten_training_steps_match(references, layout, comm_type, style):
    world, extra = LAYOUTS[layout]
    cp = 4 if layout == "cp4" else 2
    argv = _argv(style, world, extra, comm_type, cp)
    reference = references[style]["train-4-layers" if "--num-layers" in extra else "train"]
    assert_matches_reference(run_distributed(world, train_job, argv, 10), reference, 1e-5)


@pytest.fixture(scope="module")
def cp2_checkpoint(tmp_path_factory):
    from tests.training.test_resharding import _save_then_continue

    directory = str(tmp_path_factory.mktemp("cp2"))
    argv = LLAMA_STYLE + TRAINING + ["--use-distributed-optimizer"]
    layout = ["--context-parallel-size", "2"]  # x DP=2
    return argv, directory, run_distributed(4, _save_then_continue, argv + layout, directory)


@pytest.mark.parametrize("cp,comm_type", [(1, "p2p"), (4, "p2p"), (4, "a2a")])
def test_cp2_checkpoint_resumes_at_another_context_parallel_size(cp2_checkpoint, cp, comm_type):
    from tests.training.test_resharding import _check, _load_then_step

    argv, directory, saved = cp2_checkpoint
    layout = ["--context-parallel-size", str(cp), "--cp-comm-type", comm_type]
    _check(saved, run_distributed(4, _load_then_step, argv + layout, directory))


def _collectives_of_one_step(argv: list[str]) -> dict:
    from tests.parity import _setup
    from threefold.parallel.tensor_parallel.mappings import COLLECTIVE_COUNTS

    trainer = _setup(argv)
    batch = next(trainer.train_iterator())
    COLLECTIVE_COUNTS.clear()
    loss = trainer.model(
        batch["tokens"], labels=batch["labels"], position_ids=batch["position_ids"]
    )
    loss.mean().backward()
    return dict(COLLECTIVE_COUNTS)


def _per_layer_collectives_job(argv: list[str]) -> dict:
    one = _collectives_of_one_step(argv + ["--num-layers", "1"])
    two = _collectives_of_one_step(argv + ["--num-layers", "2"])
    return {key: two.get(key, 0) - one.get(key, 0) for key in set(one) | set(two)}


@pytest.mark.parametrize(
    "cp,comm_type", [(cp, comm) for comm in COMM_TYPES for cp in (2, 4)] + [(4, "a2a+p2p")]
)
def test_communication_per_layer_equals_the_theory(cp, comm_type):
    argv = _argv("llama", cp, [], comm_type, cp)
    per_layer = run_distributed(cp, _per_layer_collectives_job, argv)[0]
    per_layer = {key: count for key, count in per_layer.items() if count}
    # LLaMA style: 8 query heads and 4 key/value groups of 4 channels; micro-batch 2, fp32.
    sequence, batch, heads, groups, head_dim = 16, 2, 8, 4, 4
    local = sequence // cp
    kv_bytes = 2 * local * batch * groups * head_dim * 4  # this rank's keys and values
    if comm_type == "p2p":
        # Forward: the blocks of the CP-1 other ranks arrive; backward: they go round again,
        # and CP gradient accumulators travel (the last one home), in fp32.
        expected = {
            "cp_send_kv": 2 * (cp - 1),
            "cp_send_kv:bytes": 2 * (cp - 1) * kv_bytes,
            "cp_send_grad_kv": cp,
            "cp_send_grad_kv:bytes": cp * kv_bytes,
        }
    elif comm_type == "allgather":
        # One all-gather of every rank's keys and values; backward reduce-scatters them.
        expected = {
            "all_gather": 1,
            "all_gather:bytes": cp * kv_bytes,
            "reduce_scatter": 1,
            "reduce_scatter:bytes": cp * kv_bytes,
        }
    else:
        # q, k, v to head-sharded, the context back; backward the same two in reverse.
        qkv_bytes = local * batch * (heads + 2 * groups) * head_dim * 4
        context_bytes = local * batch * heads * head_dim * 4
        expected = {"all_to_all": 4, "all_to_all:bytes": 2 * (qkv_bytes + context_bytes)}
    if comm_type == "a2a+p2p":
        # The same all-to-alls within pairs, then the ring over 2 pairs: a block is a pair's
        # keys and values for half the groups, as many bytes as this rank's own.
        ring = 2
        expected |= {
            "cp_send_kv": 2 * (ring - 1),
            "cp_send_kv:bytes": 2 * (ring - 1) * kv_bytes,
            "cp_send_grad_kv": ring,
            "cp_send_grad_kv:bytes": ring * kv_bytes,
        }
    assert per_layer == expected


def _ring_trace_job(argv: list[str]) -> list:
    from threefold.parallel.context_parallel import attention

    attention.TRACE = []
    try:
        _collectives_of_one_step(argv)
        return attention.TRACE
    finally:
        attention.TRACE = None


def test_ring_sends_are_in_flight_while_each_block_computes():
    """Each step posts the next block's send/receive, computes its own block, then waits: the
    block's attention runs between the post and the arrival. In backward the gradient
    accumulator of the previous step is in flight too."""
    argv = _argv("llama", 4, ["--num-layers", "1"], "p2p", 4)
    for trace in run_distributed(4, _ring_trace_job, argv):
        times = {}
        for event, step, when in trace:
            times.setdefault((event, step), []).append(when)
        for step in range(3):  # steps 0..CP-2 pass their block on; the last does not
            for phase, send in (("forward", 0), ("backward", 1)):
                posted = times[("cp_send_kv posted", step)][send]
                arrived = times[("cp_send_kv arrived", step)][send]
                start = times[(f"{phase} block start", step)][0]
                end = times[(f"{phase} block end", step)][0]
                assert posted <= start < end <= arrived, (phase, step)
            returning = times[("cp_send_grad_kv posted", step)][0]
            next_block = times[("backward block end", step + 1)][0]
            assert returning < next_block <= times[("cp_send_grad_kv arrived", step)][0]
        assert len(times[("cp_send_kv posted", 0)]) == 2  # forward and backward only
        assert ("cp_send_kv posted", 3) not in times


LONG_SEQUENCE = ["--seq-length", "16384", "--micro-batch-size", "1", "--global-batch-size", "4"]


def test_activation_memory_falls_as_one_over_cp_at_16k_tokens():
    """Measured with saved-tensor hooks (what autograd keeps per micro-batch) and predicted by
    the memory estimator, for the tiny LLaMA at 16k tokens."""
    from tests.training.test_memory_estimate import _measure_and_estimate

    argv = LLAMA_STYLE + TRAINING + LONG_SEQUENCE
    whole, estimate = _measure_and_estimate(argv)["activations"]
    assert abs(estimate - whole) <= 0.1 * whole
    for cp, comm_type in [(2, "p2p"), (4, "p2p"), (4, "a2a"), (4, "allgather")]:
        layout = ["--context-parallel-size", str(cp), "--cp-comm-type", comm_type]
        for result in run_distributed(cp, _measure_and_estimate, argv + layout):
            measured, estimate = result["activations"]
            assert abs(estimate - measured) <= 0.1 * measured, (cp, comm_type, measured, estimate)
            if comm_type != "allgather":  # which keeps every rank's keys and values
                assert abs(measured * cp / whole - 1) <= 0.1, (cp, comm_type, measured, whole)


def _ring_and_gathered_with_dropout_job() -> dict:
    import torch.distributed as dist

    from threefold.parallel import state
    from threefold.parallel.context_parallel.attention import allgather_attention, ring_attention

    state.initialize_model_parallel(1, 1, context_parallel_size=dist.get_world_size())
    cp = state.parallel_context().cp
    results = {}
    for name, attention in (("p2p", ring_attention), ("allgather", allgather_attention)):
        torch.manual_seed(7 + cp.rank)  # this rank's inputs; then the same seed draw for both
        q = torch.randn(8, 2, 4, 8, requires_grad=True)
        k, v = (torch.randn(8, 2, 2, 8, requires_grad=True) for _ in range(2))
        out = attention(q, k, v, cp, dropout=0.5)
        out.backward(torch.ones_like(out))
        results[name] = [out.detach(), q.grad, k.grad, v.grad]
    return results


def test_ring_and_allgather_draw_the_same_dropout_masks():
    """Both comm types drop the probabilities of the block of CP rank j with the mask of
    seed + j: the same attention with dropout, whether the blocks travel or are gathered."""
    for result in run_distributed(2, _ring_and_gathered_with_dropout_job):
        for ring, gathered in zip(result["p2p"], result["allgather"]):
            torch.testing.assert_close(ring, gathered, rtol=1e-5, atol=1e-6)


def _dropout_seed_job() -> int:
    import torch.distributed as dist

    from threefold.parallel import state
    from threefold.parallel.context_parallel.attention import _seed
    from threefold.parallel.tensor_parallel.random import get_rng_tracker, set_random_seed

    state.initialize_model_parallel(1, 1, context_parallel_size=2)  # x DP=2
    assert dist.get_world_size() == 4
    set_random_seed(1234, state.parallel_context())
    with get_rng_tracker().fork():
        return _seed(0.1, torch.device("cpu"))


def test_dropout_masks_differ_across_cp_ranks_and_agree_across_replicas():
    seeds = run_distributed(4, _dropout_seed_job)  # ranks 0,1 and 2,3 are CP groups
    assert seeds[0] != seeds[1]
    assert seeds[0] == seeds[2] and seeds[1] == seeds[3]


@pytest.mark.parametrize(
    "flags,world_size,expected",
    [
        (
            ["--context-parallel-size", "2", "--seq-length", "18"],
            2,
            "2 x --context-parallel-size 2",
        ),
        (
            ["--context-parallel-size", "4", "--cp-comm-type", "a2a"]
            + ["--tensor-model-parallel-size", "2"],
            8,
            "--cp-comm-type a2a splits each TP rank's 4 heads and 2 query groups over "
            "--context-parallel-size 4",
        ),
        (["--context-parallel-size", "3"], 4, "--context-parallel-size 3"),
        (
            ["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "1"],
            2,
            "--hierarchical-context-parallel-sizes shapes --cp-comm-type a2a+p2p",
        ),
        (
            ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"],
            4,
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes",
        ),
        (
            ["--context-parallel-size", "4"] + HIERARCHICAL[:3] + ["4", "2"],
            4,
            "--hierarchical-context-parallel-sizes 4 2 must multiply to --context-parallel-size 4",
        ),
        (
            ["--context-parallel-size", "8"] + HIERARCHICAL[:3] + ["8", "1"],
            8,
            "over the all-to-all's 8 ranks",
        ),
        (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a"], 2, "--cp-comm-type"),
        (
            ["--context-parallel-size", "2", "--tensor-model-parallel-size", "4"]
            + ["--sequence-parallel", "--seq-length", "20"],
            8,
            "--seq-length 20 / --context-parallel-size 2 is not divisible by "
            "--tensor-model-parallel-size 4",
        ),
    ],
    ids=[
        "sequence",
        "a2a-heads",
        "world",
        "hierarchical",
        "hierarchical-needs-sizes",
        "hierarchical-product",
        "hierarchical-heads",
        "per-layer",
        "sp",
    ],
)
def test_bad_context_parallel_layouts_are_refused_naming_the_flag(
    capsys, flags, world_size, expected
):
    from threefold.arguments import parse_args

    argv = LLAMA_STYLE + TRAINING + flags
    with pytest.raises(SystemExit) as exit:
        parse_args(argv, world_size=world_size)
    assert exit.value.code == 2
    assert expected in capsys.readouterr().err


# Documents inside samples (end-of-document id 15 of a 16-token vocabulary): the CP ranks'
# chunks hold different numbers of loss tokens, and positions restart inside chunks.
DOCUMENTS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "15", "--eod-mask-loss"]
DOCUMENTS += ["--reset-position-ids"]


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per-token"])
@pytest.mark.parametrize("world,comm_type", [(2, "p2p"), (4, "a2a")], ids=["cp2", "cp2xdp2"])
def test_uneven_loss_tokens_and_restarting_positions_match(per_token, world, comm_type):
    """Each micro-batch's loss is over the whole sequence's loss tokens (summed over CP before
    dividing), and --calculate-per-token-loss weighs every token of the global batch alike."""
    argv = LLAMA_STYLE + TRAINING + DOCUMENTS
    argv += ["--calculate-per-token-loss"] if per_token else []
    reference = train_job(argv, 10)
    layout = ["--context-parallel-size", "2", "--cp-comm-type", comm_type]
    assert_matches_reference(run_distributed(world, train_job, argv + layout, 10), reference, 1e-5)


@pytest.mark.parametrize(
    "world,layout",
    [
        (2, ["--cp-comm-type", "p2p"]),
        (4, ["--cp-comm-type", "allgather", "--tensor-model-parallel-size", "2"]),
        (4, ["--cp-comm-type", "a2a", "--pipeline-model-parallel-size", "2"]),
    ],
    ids=["cp2-p2p", "cp2-allgather-tp2", "cp2-a2a-pp2"],
)
def test_per_document_attention_trains_as_one_process(world, layout):
    """--reset-attention-mask over CP ranks: each document attends only within itself, as on
    one process; without the mask the run differs (the mask is applied, not ignored)."""
    argv = LLAMA_STYLE + TRAINING + DOCUMENTS + ["--reset-attention-mask"]
    reference = train_job(argv, 5)
    layout = ["--context-parallel-size", "2", *layout]
    assert_matches_reference(run_distributed(world, train_job, argv + layout, 5), reference, 1e-5)
    unmasked = train_job(LLAMA_STYLE + TRAINING + DOCUMENTS, 5)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert relative_error(unmasked["params"][qkv], reference["params"][qkv]) > 1e-3


YARN = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4"]
YARN += ["--yarn-original-max-position-embeddings", "8"]
# Phi's LongRoPE: beyond its original context of 8, the long factors (model/rope.py)
LONGROPE = ["--position-embedding-type", "longrope", "--longrope-short-factor", "1", "1.5"]
LONGROPE += ["--longrope-long-factor", "2", "7", "--longrope-original-max-position-embeddings", "8"]


@pytest.mark.parametrize(
    "rope",
    [["--rotary-interleaved"], ["--rotary-percent", "0.5"], YARN, LONGROPE],
    ids=["interleaved", "half", "yarn", "longrope"],
)
def test_rope_variants_match_at_cp2_with_restarting_positions(rope):
    """--rotary-interleaved, --rotary-percent, YaRN and LongRoPE turn each rank's chunks by
    their own positions, restarted at each document: CP2 trains as one process does, and not
    as whole-head rotate-half RoPE does."""
    argv = LLAMA_STYLE + TRAINING + DOCUMENTS + rope
    reference = train_job(argv, 5)
    layout = ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]
    assert_matches_reference(run_distributed(2, train_job, argv + layout, 5), reference, 1e-5)
    halves = train_job(LLAMA_STYLE + TRAINING + DOCUMENTS, 5)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert relative_error(halves["params"][qkv], reference["params"][qkv]) > 1e-3
