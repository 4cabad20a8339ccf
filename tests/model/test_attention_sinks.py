"""Attention sinks (--softmax-type off-by-one|learnable): one more softmax logit per head, the
learned ones split over TP with the heads, every layout (context-parallel ones too) as one
process, and what is not implemented (multi-latent attention) refused in one line.
megatron-core's logits of such models: tests/tools/test_megatron_checkpoints.py."""

import math

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, assert_matches_reference, train_job
from threefold.arguments import parse_args
from threefold.kernels import reference


def test_the_sink_takes_a_share_of_each_rows_probability():
    """Written out by hand: softmax over [scores, sink], the sink's share dropped; with a sink
    of -inf it is ordinary causal attention."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(5, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, dtype=torch.float64)
    out = reference.attention_with_sinks(q, k, v, None, 0.0, sinks)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sinks.exp()[:, None, None])
    expected = torch.einsum("bhst,tbhd->sbhd", weights, v).reshape(5, 2, -1)
    torch.testing.assert_close(out, expected)
    plain = reference.attention_with_sinks(q, k, v, None, 0.0, torch.full((4,), -math.inf))
    torch.testing.assert_close(plain, reference.attention(q, k, v, None, 0.0))


@pytest.mark.parametrize("capped", [False, True], ids=["sinks", "capped"])
@pytest.mark.parametrize("mask", ["causal", "window", "documents"])
def test_the_blockwise_attention_is_the_written_out_one_without_its_matrices(mask, capped):
    """The model's sink attention and Gemma 2's capped attention (one block of the CP ring's,
    the sinks merged after it; its scores capped softly at 0.5): the written-out attention's
    output and gradients (q, k, v and the sinks; GQA), and what it keeps for backward holds no
    S x S matrix (the written-out one keeps several)."""
    from threefold.parallel.context_parallel.attention import one_block_attention
    from threefold.parallel.context_parallel.sequence import document_mask, window_mask

    torch.manual_seed(0)
    s, b = 48, 2
    q = torch.randn(s, b, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(s, b, 2, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0] * 20 + [1] * 28, [0] * 5 + [1] * 43])
    allowed = {
        "causal": None,
        "window": window_mask(s, 7, None, q.device),
        "documents": document_mask(ids),
    }[mask]
    upstream = torch.randn(s, b, 32, dtype=torch.float64)
    results = []
    extra = {"softcap": 0.5} if capped else {"sinks": sinks}
    for attention in (reference.attention_written_out, one_block_attention):
        kept = []

        def pack(tensor, kept=kept):
            kept.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = attention(q, k, v, allowed, 0.0, **extra)
        leaves = (q, k, v) if capped else (q, k, v, sinks)
        grads = torch.autograd.grad(out, leaves, upstream)
        results.append((out, grads, max(kept)))
    (expected, expected_grads, written), (out, grads, blockwise) = results
    # (the written-out attention computes its scores in fp32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert written >= b * 4 * s * s > blockwise  # (the largest tensor kept: per head, or not)


@pytest.mark.parametrize(
    "world,flags",
    [
        (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        (2, ["--pipeline-model-parallel-size", "2"]),
        (2, ["--tensor-model-parallel-size", "2", "--window-size", "3,0"]),
        (2, ["--context-parallel-size", "2", "--window-size", "3,0"]),
        (
            4,
            ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]
            + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ),
    ],
    ids=["tp2-sp", "pp2", "tp2-window", "cp2-ring-window", "cp2-ulysses-tp2-sp"],
)
def test_learned_sinks_train_as_one_process(world, flags):
    """Each TP rank holds its heads' sinks; with a sliding window too (GPT-OSS's layers);
    over CP ranks, each rank's queries' share of the sinks' gradient summed as every weight's."""
    argv = LLAMA_STYLE + TRAINING + ["--softmax-type", "learnable"]
    window = flags[flags.index("--window-size") :] if "--window-size" in flags else []
    reference_run = train_job(argv + window, 4)
    results = run_distributed(world, train_job, argv + flags, 4)
    assert_matches_reference(results, reference_run, 1e-5)
    assert (
        "decoder.layers.0.self_attention.core_attention.softmax_offset" in reference_run["params"]
    )


@pytest.mark.parametrize(
    "flags,world_size,said",
    [(["--multi-latent-attention"], 1, "--softmax-type learnable with --multi-latent")],
    ids=["mla"],
)
def test_what_sinks_do_not_implement_is_one_line(capsys, flags, world_size, said):
    argv = LLAMA_STYLE + TRAINING + ["--softmax-type", "learnable", *flags]
    with pytest.raises(SystemExit) as stop:
        parse_args(argv, world_size=world_size)
    assert stop.value.code == 2 and said in capsys.readouterr().err
