"""Hugging Face's BambaForCausalLM and GraniteMoeHybridForCausalLM (Granite 4.0's hybrids) in
and out: a layer of Mamba-2 or attention then an MLP each, threefold's hybrid stack two layers
a Hugging Face one. Tiny ones (Bamba: RoPE on half of each head; Granite: its four
multipliers, no positions, a dense MLP or experts beside it) give transformers' logits over 24
tokens; a bitwise round trip that transformers loads; greedy generation; per-token losses at
TP2 + SP x PP2 and CP2 (Bamba) and at EP2 on TP2 + SP's ranks (Granite's experts)."""

from __future__ import annotations

import pytest
import torch

from tests.tools.hf_models import converted_hf_model, has_transformers

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)


from tests.tools.hf_checks import (  # noqa: E402
    TOKENS,
    TOKENS_25,
    assert_greedy_generation,
    assert_layout_losses,
    assert_round_trip,
    logits_with,
    relative_error,
)

KINDS = ["bamba", "granite-hybrid", "granite-hybrid-moe"]


@pytest.fixture(scope="module", params=KINDS)
def converted(request, tmp_path_factory):
    """(the kind, transformers' model, its directory, threefold's checkpoint of it)."""
    kind = request.param
    return (kind, *converted_hf_model(kind, tmp_path_factory.mktemp(kind)))


def test_logits_round_trip_and_generation_are_transformers(converted, tmp_path):
    kind, hf_model, hf_dir, ours = converted
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        assert relative_error(logits_with(ours, TOKENS), expected) < 1e-5
        if kind != "bamba":  # the residual multiplier counts in the Mamba layers too
            assert (
                relative_error(logits_with(ours, TOKENS, residual_multiplier=1.0), expected) > 1e-3
            )
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


LAYOUTS = {
    "bamba": [
        (
            4,
            [
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--pipeline-model-parallel-size",
                "2",
            ],
        ),
        (2, ["--context-parallel-size", "2"]),
    ],
    # the experts over EP2 on the two TP ranks
    "granite-hybrid-moe": [
        (
            2,
            ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
        )
    ],
}


def test_parallel_layouts_compute_transformers_losses(converted):
    kind, hf_model, _, ours = converted
    for world, layout in LAYOUTS.get(kind, []):
        assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


def test_a_swiglu_hybrid_trained_in_threefold_exports_as_bamba(tmp_path):
    from tests.tools.hf_checks import assert_exports_as
    from tests.tools.hf_models import VOCAB

    argv = ["--hybrid-layer-pattern", "M-*-", "--hidden-size", "64", "--num-attention-heads"]
    argv += ["4", "--group-query-attention", "--num-query-groups", "2", "--swiglu"]
    argv += ["--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--disable-bias-linear"]
    argv += ["--position-embedding-type", "rope", "--rotary-percent", "0.5"]
    argv += ["--untie-embeddings-and-output-weights", "--mock-data", "--vocab-size", str(VOCAB)]
    argv += ["--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "1"]
    argv += ["--mamba-state-dim", "8", "--mamba-head-dim", "16", "--mamba-num-groups", "2"]
    exported = assert_exports_as(argv, tmp_path, "BambaForCausalLM")
    assert exported["attn_layer_indices"] == [1]
