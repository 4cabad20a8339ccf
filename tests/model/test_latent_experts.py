"""--moe-latent-size (megatron-core's latent mixture of experts, Nemotron 3 Super's): the routed
experts work at a latent width, `fc1_latent_proj` down before the dispatch and
`fc2_latent_proj` up after the combine, whole on every TP rank; the router and the shared
expert read the hidden states. The layer computes that order written out; TP2+SP x EP2 (the
projections' gradients summed over the sequence's TP slices), ETP2 and the shared expert's
overlap train as one process; parameters and FLOPs are Megatron-LM's counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import MOE
from tests.parity import LLAMA_STYLE, TRAINING, _setup, assert_matches_reference, train_job
from threefold.arguments import parse_args
from threefold.model.moe.layer import MoELayer
from threefold.training.flops import training_flops_per_iteration
from threefold.training.memory_estimate import estimate_stage

LATENT = ["--moe-latent-size", "16"]
SHARED = ["--moe-shared-expert-intermediate-size", "24"]
# GELU experts and projections with biases (LLAMA_STYLE's SwiGLU without them)
WITH_BIASES = [a for a in LLAMA_STYLE if a not in ("--swiglu", "--disable-bias-linear")]


def _moe_layer(argv: list[str]) -> MoELayer:
    trainer = _setup(argv)
    return next(m for m in trainer.model_chunks[0].modules() if isinstance(m, MoELayer))


@pytest.mark.parametrize("style", ["swiglu", "gelu-biases"])
def test_the_layer_projects_down_routes_and_projects_up(style):
    """fp64: route the hidden states, project them down, each token's experts' weighted sum at
    the latent width, project it up, add the shared expert of the hidden states (as
    megatron-core's MoELayer and transformers' NemotronHMoE)."""
    base = LLAMA_STYLE if style == "swiglu" else WITH_BIASES
    layer = _moe_layer(base + TRAINING + MOE + LATENT + SHARED).double().eval()
    assert layer.fc1_latent_proj.weight.shape == (16, 32)
    assert (layer.fc1_latent_proj.bias is None) == (style == "swiglu")
    hidden = torch.randn(16, 2, 32, dtype=torch.float64)
    tokens = hidden.reshape(-1, 32)
    with torch.no_grad():
        out = layer(hidden).reshape(-1, 32)
        probs, routing_map, _ = layer.router(tokens, 2)
        down, up = layer.fc1_latent_proj, layer.fc2_latent_proj
        latent = F.linear(tokens, down.weight, down.bias)
        mixed = torch.zeros_like(latent)
        for e, expert in layer.experts.local_experts.items():
            chosen = routing_map[:, int(e)]
            fc1 = expert.linear_fc1(latent[chosen])
            if style == "swiglu":
                gate, value = fc1.chunk(2, -1)
                activated = F.silu(gate) * value
            else:
                activated = F.gelu(fc1)
            expert_out = expert.linear_fc2(activated)
            mixed[chosen] += probs[chosen, int(e)].unsqueeze(-1) * expert_out
        expected = F.linear(mixed, up.weight, up.bias) + layer.shared_experts(tokens)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


LAYOUTS = {
    # the projections' gradients: each TP rank's slice of the sequence, summed over TP
    "tp2-sp-ep2-alltoall-distopt": (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
        + ["--use-distributed-optimizer"],
        LLAMA_STYLE,
    ),
    "ep2-etp2-biases": (
        ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
        WITH_BIASES,
    ),
    "tp2-sp-ep2-shared-overlap": (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
        + ["--moe-shared-expert-overlap"],
        LLAMA_STYLE,
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_latent_experts_train_as_one_process(name):
    layout, base = LAYOUTS[name]
    argv = base + TRAINING + MOE + LATENT + SHARED
    reference = train_job(argv, 4)
    results = run_distributed(4, train_job, argv + layout, 4)
    assert_matches_reference(results, reference, 1e-5)
    for result in results:  # (the projections trained, the same on every rank)
        weight = result["params"]["decoder.layers.1.mlp.fc2_latent_proj.weight"]
        assert weight.shape == (32, 16)


def test_the_estimate_counts_the_built_models_parameters():
    """(At TP2 x EP2, in tests/training/test_memory_estimate_layouts.py.)"""
    trainer = _setup(WITH_BIASES + TRAINING + MOE + LATENT + SHARED)
    built = sum(p.numel() for p in trainer.model_chunks[0].parameters())
    assert estimate_stage(trainer.config, 0).parameters == 4 * built  # (fp32 bytes)


def test_flops_are_megatrons():
    """Megatron-LM's num_floating_point_operations for latent experts: the routed experts at
    the latent width (SwiGLU's three GEMMs of k f latent a token, 2 FLOPs each), and the
    projections down and up (2 x 2 h latent); times 3 for the training step."""
    config = parse_args(LLAMA_STYLE + TRAINING + MOE + LATENT + SHARED).model
    h, s, f, k, latent, shared, experts, vocab = 32, 16, 32, 2, 16, 24, 4, 1008
    d, heads, groups = 4, 8, 4
    qkv = 2 * h * d * (heads + 2 * groups) + 2 * d * heads * h
    attention = 2 * 2 * s * heads * d
    moe = 2 * 3 * k * f * latent + 2 * 2 * h * latent + 2 * 3 * h * shared + 2 * h * experts
    per_token = 2 * (qkv + attention + moe) + 2 * h * vocab
    expected = 3 * per_token * 8 * s
    assert training_flops_per_iteration(config, 8, vocab) == pytest.approx(expected)
