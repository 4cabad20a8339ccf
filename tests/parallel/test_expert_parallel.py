"""Mixture of experts: the router against a plain reference, and expert parallelism (real gloo
ranks) reproducing the single-process run's losses, gradients and parameters."""

import math

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    _full,
    _setup,
    _without_key_bias,
    assert_close_dicts,
    assert_matches_reference,
    first_step_gradients_job,
    merge_pipeline_stages,
)
from threefold.arguments import parse_args
from threefold.model.moe.experts import Experts
from threefold.model.moe.router import TopKRouter
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.sharding import normal_init

MOE = [
    "--num-experts",
    "4",
    "--moe-ffn-hidden-size",
    "32",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-z-loss-coeff",
    "0.001",
]
TOLERANCE = 1e-5


def _model_config(*flags: str):
    return parse_args(LLAMA_STYLE + TRAINING + MOE + list(flags)).model


# -- the router against a reference written out token by token ---------------------------------
def _reference_routing(logits, k, score_function, pre_softmax):
    probs = torch.zeros(logits.shape, dtype=torch.float64)
    for t, row in enumerate(logits.double()):
        if score_function == "softmax" and pre_softmax:
            scores = torch.softmax(row, 0)
            chosen = sorted(range(len(row)), key=lambda e: -scores[e])[:k]
            weights = [scores[e] for e in chosen]
        elif score_function == "softmax":
            chosen = sorted(range(len(row)), key=lambda e: -row[e])[:k]
            top = torch.stack([row[e] for e in chosen])
            weights = list(torch.softmax(top, 0))
        else:
            scores = torch.sigmoid(row)
            chosen = sorted(range(len(row)), key=lambda e: -scores[e])[:k]
            weights = [scores[e] for e in chosen]
            if k > 1:
                weights = [w / sum(weights) for w in weights]
        for e, w in zip(chosen, weights):
            probs[t, e] = w
    return probs


def _reference_aux_loss(logits, k, coeff, score_function):
    """Switch Transformer: E * sum_e f_e P_e, f_e the fraction of the k T assignments."""
    tokens, experts = logits.shape
    scores = torch.softmax(logits.double(), -1)
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits.double())
        scores = scores / scores.sum(-1, keepdim=True)
    fraction = torch.zeros(experts, dtype=torch.float64)
    for row in scores:
        for e in row.topk(k).indices:
            fraction[e] += 1.0 / (tokens * k)
    mean_prob = scores.mean(0)
    return coeff * experts * float((fraction * mean_prob).sum())


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--moe-router-topk", "1"],
        ["--moe-router-pre-softmax"],
        ["--moe-router-score-function", "sigmoid"],
        ["--moe-router-score-function", "sigmoid", "--moe-router-topk", "1"],
    ],
)
def test_router_matches_the_reference(flags):
    config = _model_config(*flags)
    router = TopKRouter(config, ParallelContext(), normal_init(0.5))
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    tokens = torch.randn(24, config.hidden_size, generator=torch.Generator().manual_seed(1))
    probs, routing_map, losses = router(tokens, batch_size=2)
    logits = tokens @ router.weight.detach().T
    k, function = config.moe_router_topk, config.moe_router_score_function
    expected = _reference_routing(logits, k, function, config.moe_router_pre_softmax)
    torch.testing.assert_close(probs.detach().double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(routing_map, expected > 0)
    aux = _reference_aux_loss(logits, k, config.moe_aux_loss_coeff, function)
    assert losses["load_balancing_loss"].item() == pytest.approx(aux, rel=1e-5)
    z = config.moe_z_loss_coeff * float((torch.logsumexp(logits.double(), -1) ** 2).mean())
    assert losses["z_loss"].item() == pytest.approx(z, rel=1e-5)


def test_router_dtype_routes_and_combines_a_bf16_model_in_fp32():
    """--moe-router-dtype fp32 (megatron-core's): the logits of bf16 tokens and weight
    computed in fp32, the probabilities kept in fp32 and the experts' outputs weighted and
    summed in fp32, each rounded to bf16 once; gradients return in bf16. Without it the logits
    are bf16's, which route differently."""
    from threefold.parallel.expert_parallel.dispatcher import Dispatch, _weighted_sum

    routers = []
    for flags in (["--moe-router-dtype", "fp32"], []):
        config = _model_config("--bf16", *flags)
        router = TopKRouter(config, ParallelContext(), normal_init(0.5))
        torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
        routers.append(router.bfloat16())
    tokens = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(1))
    tokens = tokens.bfloat16().requires_grad_()
    (probs, routing_map, _), (plain, _, _) = (router(tokens, batch_size=2) for router in routers)
    logits = tokens.detach().float() @ routers[0].weight.detach().float().T
    expected = _reference_routing(logits, config.moe_router_topk, "softmax", False)
    assert probs.dtype == torch.float32 and plain.dtype == torch.bfloat16
    torch.testing.assert_close(probs.detach().double(), expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(plain.detach().double(), expected, rtol=1e-3, atol=1e-4)
    probs.square().sum().backward()
    assert tokens.grad.dtype == routers[0].weight.grad.dtype == torch.bfloat16
    token_ids, experts = routing_map.nonzero(as_tuple=True)
    plan = Dispatch(token_ids, probs.detach()[token_ids, experts], 64, [])
    outputs = torch.randn(len(token_ids), 8, generator=torch.Generator().manual_seed(2))
    combined = _weighted_sum(outputs.bfloat16(), plan)
    weighted = outputs.bfloat16().float() * plan.probs[:, None]
    exact = torch.zeros(64, 8).index_add(0, token_ids, weighted).bfloat16()
    assert combined.dtype == torch.bfloat16 and torch.equal(combined, exact)


def test_sequence_aux_loss_is_the_mean_over_sequences():
    config = _model_config("--moe-router-load-balancing-type", "seq_aux_loss")
    router = TopKRouter(config, ParallelContext(), normal_init(0.5))
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    sequence, batch = 12, 3
    tokens = torch.randn(sequence * batch, config.hidden_size)
    _, _, losses = router(tokens, batch_size=batch)
    logits = (tokens @ router.weight.detach().T).view(sequence, batch, -1)
    k, coeff = config.moe_router_topk, config.moe_aux_loss_coeff
    per_sequence = [_reference_aux_loss(logits[:, b], k, coeff, "softmax") for b in range(batch)]
    expected = sum(per_sequence) / batch
    assert losses["seq_load_balancing_loss"].item() == pytest.approx(expected, rel=1e-5)


SINKHORN = ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"]


def _reference_sinkhorn(logits: torch.Tensor, tolerance: float = 1e-4) -> torch.Tensor:
    """exp(logits) scaled row- and column-wise, written out entry by entry (float64)."""
    cost = logits.double().exp()
    tokens, experts = cost.shape
    rows, columns = [1.0] * tokens, [1.0] * experts
    error = 1e9
    while error > tolerance:
        rows = [
            1 / tokens / (sum(columns[e] * cost[t, e] for e in range(experts)) + 1e-8)
            for t in range(tokens)
        ]
        new = [
            1 / experts / (sum(rows[t] * cost[t, e] for t in range(tokens)) + 1e-8)
            for e in range(experts)
        ]
        error = sum(abs(a - b) for a, b in zip(columns, new)) / experts
        columns = new
    return torch.tensor(
        [[rows[t] * cost[t, e] * columns[e] for e in range(experts)] for t in range(tokens)]
    )


@pytest.mark.parametrize("k", [1, 2])
def test_sinkhorn_routing_matches_the_reference(k):
    """Training routes to the top-k of the Sinkhorn-balanced scores with sigmoid (k = 1) or
    softmax weights; evaluation to the plain top-k; no auxiliary loss."""
    config = _model_config(*SINKHORN, "--moe-router-topk", str(k))
    router = TopKRouter(config, ParallelContext(), normal_init(0.5))
    torch.nn.init.normal_(router.weight, std=0.3, generator=torch.Generator().manual_seed(0))
    tokens = torch.randn(24, config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = (tokens @ router.weight.detach().T).double()
    balanced = _reference_sinkhorn(logits)
    # balanced: every expert receives the same share of the tokens
    torch.testing.assert_close(
        balanced.sum(0), torch.full((4,), 1 / 4, dtype=torch.float64), atol=1e-3, rtol=0
    )
    scores = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, dim=-1)
    for training, chooser in ((True, balanced), (False, scores)):
        router.train(training)
        probs, routing_map, losses = router(tokens, batch_size=2)
        chosen = chooser.topk(k, dim=-1).indices
        expected = torch.zeros_like(scores).scatter(1, chosen, scores.gather(1, chosen))
        torch.testing.assert_close(probs.detach().double(), expected, rtol=1e-6, atol=1e-7)
        assert torch.equal(routing_map, expected > 0)
        assert "load_balancing_loss" not in losses
    assert not torch.equal(balanced.topk(k).indices, scores.topk(k).indices)  # it mattered


@pytest.mark.parametrize(
    "world_size,layout",
    [
        (2, ["--expert-model-parallel-size", "2"]),
        (
            4,
            ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
            + ["--sequence-parallel"]
            + ["--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall"],
        ),
    ],
    ids=["ep2", "ep2xtp2-sp"],
)
def test_sinkhorn_routing_matches_single_process(world_size, layout):
    """The normalization runs over the micro-batch's tokens gathered from the TP ranks that
    each route a slice of them, so TP x SP routes as one device does."""
    argv = LLAMA_STYLE + TRAINING + MOE + SINKHORN + ["--moe-router-topk", "1"]
    reference = _train_with_statistics(argv, 10)
    results = run_distributed(world_size, _train_with_statistics, argv + layout, 10)
    assert_matches_reference(results, reference, TOLERANCE)
    for result in results:
        np.testing.assert_allclose(result["tokens"], reference["tokens"])


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_keeps_the_chosen_tokens(policy, pad):
    flags = ["--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", policy]
    config = _model_config(*flags, *(["--moe-pad-expert-input-to-capacity"] if pad else []))
    router = TopKRouter(config, ParallelContext(), normal_init(0.5))
    torch.nn.init.normal_(router.weight, std=0.3, generator=torch.Generator().manual_seed(0))
    tokens = torch.randn(16, config.hidden_size, generator=torch.Generator().manual_seed(3))
    probs, routing_map, _ = router(tokens, batch_size=2)
    logits = tokens @ router.weight.detach().T
    routed = _reference_routing(logits, 2, "softmax", False)
    capacity = math.ceil(16 * 2 / 4 * 0.5)
    for e in range(4):
        candidates = [t for t in range(16) if routed[t, e] > 0]
        if policy == "probs":
            candidates.sort(key=lambda t: -routed[t, e])
        kept = set(candidates[:capacity])
        got = set(routing_map[:, e].nonzero().flatten().tolist())
        if pad:  # exactly `capacity` tokens; the routed ones kept are among them
            assert len(got) == capacity and kept <= got
            if policy == "probs":
                others = got - kept
                assert all(probs[t, e] == 0 for t in others)
        else:
            assert got == kept
            assert all(abs(probs[t, e].item() - routed[t, e].item()) < 1e-6 for t in kept)


def test_grouped_gemm_equals_the_loop():
    config = _model_config("--moe-grouped-gemm")
    experts = Experts(config, ParallelContext(), normal_init(0.1), normal_init(0.1))
    generator = torch.Generator().manual_seed(0)
    for param in experts.parameters():
        param.data.normal_(0, 0.1, generator=generator)
    counts = [3, 0, 5, 2]
    tokens = torch.randn(sum(counts), config.hidden_size, requires_grad=True)
    grouped = experts(tokens, counts)
    experts.grouped_gemm = False
    loop = experts(tokens, counts)
    torch.testing.assert_close(grouped, loop, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(grouped.square().sum(), [tokens, *experts.parameters()])
    expected = torch.autograd.grad(loop.square().sum(), [tokens, *experts.parameters()])
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- expert parallelism reproduces one process -------------------------------------------------
def _train_with_statistics(argv: list[str], steps: int) -> dict:
    """Losses, gradient norms, final parameters, and the log's MoE numbers of the run."""
    trainer = _setup(argv)
    steps = [trainer.train_step() for _ in range(steps)]
    means, tokens = trainer.moe_statistics.report(trainer.device)
    params = _without_key_bias(_full(trainer), trainer)
    losses, norms = [step[0] for step in steps], [step[1] for step in steps]
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "moe": means,
        "tokens": tokens.numpy(),
    }


EP2 = ["--expert-model-parallel-size", "2"]
ETP2 = ["--expert-tensor-parallel-size", "2"]
LAYOUTS = {
    "ep2-alltoall": (2, EP2 + ["--moe-token-dispatcher-type", "alltoall"]),
    "ep2-allgather": (2, EP2 + ["--moe-token-dispatcher-type", "allgather"]),
    "ep4-alltoall": (
        4,
        ["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall"],
    ),
    "ep2xtp2-alltoall": (
        4,
        EP2
        + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall"],
    ),
    # Expert TP: each expert split over two ranks (the TP group, Megatron's default; or, at
    # TP 1, two data-parallel ranks).
    "ep2xetp2-tp2-alltoall": (
        4,
        EP2
        + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--moe-token-dispatcher-type", "alltoall"],
    ),
    "ep2xetp2-dp4-allgather": (
        4,
        EP2 + ["--expert-tensor-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"],
    ),
    "ep2xpp2-allgather": (4, EP2 + ["--pipeline-model-parallel-size", "2"]),
    # Megatron-LM's moe/..._cp2_pp2_ep2_..._dp_last: PP before DP, EP carved out of CP
    "cp2xpp2xep2xdp2-tp-pp-dp-alltoall": (
        8,
        EP2
        + ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
        + ["--moe-token-dispatcher-type", "alltoall", "--use-tp-pp-dp-mapping"],
    ),
    "ep2xcp2-alltoall": (
        4,
        EP2 + ["--context-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
    ),
    "cp2-tp2-ep2-allgather": (
        4,
        ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]
        + ["--sequence-parallel", "--expert-tensor-parallel-size", "1"]
        + EP2,
    ),
    "ep2xdp2-allgather": (4, EP2),
    "ep2xdp2-distributed-optimizer": (4, EP2 + ["--use-distributed-optimizer"]),
    # two distributed-optimizer instances: experts' of one rank each (expert DP 2), the dense
    # weights' of two
    "ep2xdp2-distributed-optimizer-instances": (
        4,
        EP2 + ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
    ),
    # experts: x (expert DP / DP) before an average over expert DP, as Megatron-LM scales them
    "ep2xdp2-distributed-optimizer-average-in-collective": (
        4,
        EP2 + ["--use-distributed-optimizer", "--ddp-average-in-collective"],
    ),
    "ep2xdp2-distributed-optimizer-overlap-alltoall": (
        4,
        EP2
        + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
        + ["--moe-token-dispatcher-type", "alltoall"],
    ),
    # FSDP2 with experts (torchtitan's FSDP + EP): the experts sharded over expert DP 2, the
    # rest of each layer over DP 4 (EP ranks share it)
    "ep2xfsdp4-alltoall": (
        4,
        EP2 + ["--distributed-strategy", "fsdp", "--moe-token-dispatcher-type", "alltoall"],
    ),
    # every expert on one rank (EP = DP: expert DP 1), its gradient / DP all the same
    "ep2xfsdp2-alltoall": (
        2,
        EP2 + ["--distributed-strategy", "fsdp", "--moe-token-dispatcher-type", "alltoall"],
    ),
    "ep2xfsdp2-tp2-allgather": (
        4,
        EP2
        + ["--distributed-strategy", "fsdp", "--tensor-model-parallel-size", "2"]
        + ["--sequence-parallel", "--expert-tensor-parallel-size", "1"],
    ),
    "ep2xdp2-alltoall-overlap": (
        4,
        EP2
        + ["--moe-token-dispatcher-type", "alltoall", "--overlap-grad-reduce"]
        + ["--ddp-bucket-size", "500"],
    ),
}
VARIANTS = {
    "top2": [],
    "top1+shared": ["--moe-router-topk", "1", "--moe-shared-expert-intermediate-size", "48"],
    "capacity": ["--moe-expert-capacity-factor", "0.75", "--moe-token-dispatcher-type", "alltoall"],
    # fp64 logits, probabilities and weighted sums in an fp32 run (fp32 would change nothing)
    "router-fp64": ["--moe-router-dtype", "fp64", "--moe-token-dispatcher-type", "alltoall"],
    # DeepSeek-V3's auxiliary-loss-free balancing: biases from the token counts of all ranks
    "expert-bias": ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    + ["--moe-router-bias-update-rate", "0.01"],
    # DeepSeek-V3's group-limited routing: 2 groups of 2 experts, the best one per token
    "group-limited": ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]
    + ["--moe-router-topk-scaling-factor", "2.5"],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_expert_parallel_layouts_match_single_process(name):
    world_size, layout = LAYOUTS[name]
    argv = LLAMA_STYLE + TRAINING + MOE
    reference = _train_with_statistics(argv, 10)
    results = run_distributed(world_size, _train_with_statistics, argv + layout, 10)
    assert_matches_reference(results, reference, TOLERANCE)
    for result in results:
        for name, value in reference["moe"].items():
            assert result["moe"][name] == pytest.approx(value, rel=1e-5), name
        np.testing.assert_allclose(result["tokens"], reference["tokens"])
        # the clipped norm counts every expert once, wherever its shards are
        np.testing.assert_allclose(result["norms"], reference["norms"], rtol=TOLERANCE)


def test_expert_tensor_parallel_biases_match_single_process():
    """GELU experts with biases, split over expert TP 2 inside TP 4 (ETP ranks hold different
    slices of the sequence): fc1's bias splits with its rows; fc2's, whole on both ETP ranks,
    is added once and keeps one value. Grouped GEMM on, alltoall."""
    argv = [a for a in LLAMA_STYLE if a not in ("--swiglu", "--disable-bias-linear")]
    argv += TRAINING + MOE + ["--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"]
    reference = _train_with_statistics(argv, 10)
    layout = ["--tensor-model-parallel-size", "4", "--sequence-parallel"]
    results = run_distributed(4, _train_with_statistics, argv + layout + ETP2, 10)
    assert_matches_reference(results, reference, TOLERANCE)
    bias = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.bias"
    assert np.abs(reference["params"][bias]).max() > 1e-4  # trained away from its zero init


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_router_variants_match_single_process_at_ep2(variant):
    argv = LLAMA_STYLE + TRAINING + MOE + VARIANTS[variant]
    reference = _train_with_statistics(argv, 10)
    results = run_distributed(
        2, _train_with_statistics, argv + ["--expert-model-parallel-size", "2"], 10
    )
    assert_matches_reference(results, reference, TOLERANCE)
    # The same tokens routed, and under a capacity the same ones dropped.
    for result in results:
        np.testing.assert_allclose(result["tokens"], reference["tokens"])


def test_deepseek_routing_under_fsdp_matches_single_process():
    """FSDP2 with experts under DeepSeek-V3's routing: group-limited top-k, and the expert
    biases (state that FSDP2 shards between steps) nudged from the token counts of all ranks."""
    argv = LLAMA_STYLE + TRAINING + MOE + VARIANTS["expert-bias"] + VARIANTS["group-limited"]
    reference = _train_with_statistics(argv, 10)
    layout = LAYOUTS["ep2xfsdp4-alltoall"][1]
    results = run_distributed(4, _train_with_statistics, argv + layout, 10)
    # (each step's routing follows the biases of the steps before: the losses show them)
    assert_matches_reference(results, reference, TOLERANCE)


def test_first_step_gradients_match_at_ep2_and_ep4():
    argv = LLAMA_STYLE + TRAINING + MOE
    reference = first_step_gradients_job(argv)
    for world_size in (2, 4):
        flags = ["--expert-model-parallel-size", str(world_size)]
        results = run_distributed(world_size, first_step_gradients_job, argv + flags)
        for result in results:
            assert result["loss"] == pytest.approx(reference["loss"], rel=TOLERANCE)
        grads = merge_pipeline_stages([r["grads"] for r in results])
        assert_close_dicts(grads, reference["grads"], TOLERANCE, "gradient")


def test_token_counts_add_up_and_the_log_line_names_the_loss(capsys):
    argv = LLAMA_STYLE + TRAINING + MOE + ["--log-interval", "2", "--moe-per-layer-logging"]
    trainer = _setup(argv + ["--train-iters", "2"])
    trainer.train()
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "] iteration        2/" in x)
    assert " lm loss: " in line and " load_balancing_loss: " in line and " z_loss: " in line
    assert (
        line.index(" lm loss: ") < line.index(" load_balancing_loss: ") < line.index(" loss scale")
    )
    # Every token of the global batch goes to two experts in each MoE layer: after iteration 1
    # (Megatron-LM's first line) and after 2 (the mean of both: the first closed no window).
    tokens_per_iteration = 8 * 16 * 2
    counts = [x for x in out.splitlines() if x.startswith("> MoE layer")]
    assert len(counts) == 4
    for x in counts:
        assert sum(float(c) for c in x.split(":")[-1].split()) == tokens_per_iteration


def test_moe_layer_freq_pattern_makes_only_those_layers_moe():
    trainer = _setup(LLAMA_STYLE + TRAINING + MOE + ["--moe-layer-freq", "([0]*1+[1]*1)"])
    names = [n for n, _ in trainer.layout_independent_parameters()]
    assert any(n.startswith("decoder.layers.1.mlp.router") for n in names)
    assert not any(n.startswith("decoder.layers.0.mlp.router") for n in names)
    assert any(n.startswith("decoder.layers.0.mlp.linear_fc1") for n in names)
    losses = [trainer.train_step()[0] for _ in range(2)]
    assert all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize(
    "flags,world_size,expected",
    [
        (["--expert-model-parallel-size", "2"], 2, "--num-experts"),
        (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2, "--num-experts 3"),
        (["--num-experts", "4", "--expert-model-parallel-size", "4"], 2, "must divide"),
        (
            ["--num-experts", "4", "--moe-ffn-hidden-size", "30"]
            + ["--expert-tensor-parallel-size", "4"],
            4,
            "--moe-ffn-hidden-size 30 is not divisible by --expert-tensor-parallel-size 4",
        ),
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "2"]
            + ["--expert-tensor-parallel-size", "2"],
            2,
            "must divide TP x CP x DP = 2",
        ),
        (
            ["--num-experts", "4", "--tensor-model-parallel-size", "2"]
            + ["--expert-tensor-parallel-size", "1"],
            2,
            "needs --sequence-parallel",
        ),
        (
            ["--num-experts", "4", "--pipeline-model-parallel-size", "2"]
            + ["--expert-model-parallel-size", "2", "--use-tp-pp-dp-mapping"],
            4,
            "--use-tp-pp-dp-mapping with --pipeline-model-parallel-size 2 needs "
            "--expert-tensor-parallel-size 1 x --expert-model-parallel-size 2 = "
            "--tensor-model-parallel-size 1 x --context-parallel-size 1",
        ),
        (["--num-experts", "4", "--moe-router-topk", "5"], 1, "--moe-router-topk 5"),
        (
            ["--num-experts", "4", "--moe-router-num-groups", "2"],
            1,
            "--moe-router-num-groups and --moe-router-group-topk go together",
        ),
        (
            ["--num-experts", "4", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
            1,
            "--moe-router-num-groups 3 must divide --num-experts 4",
        ),
        (["--num-experts", "4", "--moe-layer-freq", "__import__('os')"], 1, "--moe-layer-freq"),
        (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"], 1, "gives 3 layers"),
        (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], 1, "capacity-factor"),
        (["--moe-latent-size", "16"], 1, "--moe-latent-size: mixture-of-experts settings"),
        (["--num-experts", "4", "--moe-latent-size", "0"], 1, "--moe-latent-size must be >= 1"),
        (
            ["--moe-router-topk", "1", "--moe-router-dtype", "fp32"],
            1,
            "--moe-router-topk --moe-router-dtype: mixture-of-experts settings of a model "
            "without experts; add --num-experts or drop them",
        ),
    ],
)
def test_moe_mistakes_are_refused_in_one_line(flags, world_size, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(LLAMA_STYLE + TRAINING + flags, world_size=world_size)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert expected in last, last


def test_full_recomputation_changes_nothing():
    """The recomputed forward routes again but records nothing twice."""
    argv = LLAMA_STYLE + TRAINING + MOE
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    plain = _train_with_statistics(argv, 3)
    recomputed = _train_with_statistics(argv + recompute + ["--recompute-num-layers", "1"], 3)
    assert plain["losses"] == recomputed["losses"]
    assert plain["moe"] == recomputed["moe"]
    np.testing.assert_array_equal(plain["tokens"], recomputed["tokens"])


@pytest.mark.parametrize("freeze", [False, True], ids=["experts-adapted", "experts-frozen"])
def test_lora_on_experts_matches_single_process_at_ep2(freeze):
    flags = ["--lora-rank", "4", "--lr", "3e-2"] + (["--lora-freeze-experts"] if freeze else [])
    argv = LLAMA_STYLE + TRAINING + MOE + flags
    reference = _train_with_statistics(argv, 5)
    adapters = [n for n in reference["params"] if "local_experts" in n and ".adapter." in n]
    assert bool(adapters) != freeze
    results = run_distributed(2, _train_with_statistics, argv + EP2, 5)
    assert_matches_reference(results, reference, TOLERANCE)


def test_a_pipeline_stage_without_moe_layers_joins_the_expert_reductions():
    """Stage 0 holds only the dense layer: it must still take part in the expert norms and
    statistics (a rank skipping them would hang the others)."""
    argv = LLAMA_STYLE + TRAINING + MOE + ["--moe-layer-freq", "([0]*1+[1]*1)"]
    reference = _train_with_statistics(argv, 10)
    layout = EP2 + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
    results = run_distributed(4, _train_with_statistics, argv + layout, 10)
    assert_matches_reference(results, reference, TOLERANCE)
    for result in results:
        assert result["moe"] == pytest.approx(reference["moe"], rel=1e-5)
