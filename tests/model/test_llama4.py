"""Llama 4's architecture as Megatron-LM builds it: layers without RoPE (--no-rope-freq), queries
and keys scaled to unit RMS (--qk-l2-norm; Megatron-LM's --export-qk-l2-norm) and Maverick's
mixture, each token scaled by its routing weight before its expert
(--moe-apply-probs-on-input). megatron-core's own models, saved at TP2 (the mixture at TP2 x
EP2) and read back, give threefold's logits and every gradient; without each flag the same
weights give others; TP, SP, EP and PP layouts compute megatron-core's losses; the export reads
back into megatron-core; what megatron-core refuses is one line."""

from __future__ import annotations

import os

import pytest
import torch

from tests import megatron_core_models as mc
from tests.distributed import run_distributed
from tests.parallel.test_context_parallel import DOCUMENTS
from tests.parity import LLAMA_MHA_STYLE, TRAINING, assert_matches_reference, train_job
from tests.tools.hf_models import convert_checkpoint
from tests.tools.megatron_runs import (
    exports,
    gradients_from,
    megatron_argv,
    per_token_losses,
    reference_losses,
    saved_by_megatron_core,
)
from threefold.arguments import parse_args
from threefold.checkpoint.load import load_model
from threefold.config.moe import parse_layer_pattern

# kind -> (TP, PP, EP, ranks) megatron-core saves it at
SAVED = {"llama4": (2, 1, 1, 2), "llama4_moe": (2, 1, 2, 4)}
# each kind's Llama 4 fields: a model without one of them computes something else
FIELDS = {
    "llama4": {"no_rope_freq": None, "qk_l2_norm": False},
    "llama4_moe": {"no_rope_freq": None, "qk_l2_norm": False, "moe_apply_probs_on_input": False},
}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """kind -> (checkpoint root, megatron-core's logits, its training loss and gradients)."""
    saved = saved_by_megatron_core(tmp_path_factory, SAVED)
    result = {}
    for kind, (root, logits) in saved.items():
        path = os.path.join(root, "iter_0000010")
        result[kind] = (root, logits, *run_distributed(1, mc.gradients, kind, path)[0])
    return result


@pytest.mark.parametrize("kind", SAVED)
def test_megatron_cores_llama4_gives_threefolds_logits_and_gradients(megatron, kind):
    """Layers 2 and 4 without RoPE, the L2 norm on every layer's queries and keys (and the
    routing weight on the experts' input): megatron-core's logits within 1e-5, its loss, every
    gradient within 1e-5 of its largest. Without any one of the flags, other logits."""
    root, expected_logits, expected_loss, expected = megatron[kind]
    config, _, _ = load_model(root, with_tokenizer=False)
    model = config.model
    assert (model.no_rope_freq, model.no_rope_pattern(4), model.qk_l2_norm) == (
        "2",
        [0, 1, 0, 1],
        True,
    )
    assert model.moe_apply_probs_on_input == (kind == "llama4_moe")
    loss, grads, logits = gradients_from(root)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-5 * grad.abs().max())
    for name, off in FIELDS[kind].items():
        _, _, other = gradients_from(root, **{name: off})
        assert (other - expected_logits).abs().max() > 1e-3, name


@pytest.mark.parametrize(
    "kind,tp,pp,ep,flags",
    [
        ("llama4", 2, 2, 1, []),
        ("llama4_moe", 2, 1, 2, ["--sequence-parallel", "--moe-token-dispatcher-type", "alltoall"]),
    ],
    ids=["tp2pp2", "tp2-sp-ep2-alltoall"],
)
def test_any_layout_computes_megatron_cores_losses(megatron, kind, tp, pp, ep, flags):
    """Under PP the second stage's layers (3 and 4) know which of them skips RoPE by their
    global number; under TP each rank normalizes its own heads; under EP a token is scaled by
    its weight on its own rank, before it travels to its expert."""
    root, reference, _, _ = megatron[kind]
    argv = megatron_argv(root, tp, pp) + ["--expert-model-parallel-size", str(ep), *flags]
    argv += ["--global-batch-size", str(2 * ep)]  # each rank's micro-batch of 2
    # Sequence parallelism splits the sequence over TP: 14 of the causal model's 15 tokens.
    length = 14 if "--sequence-parallel" in flags else mc.SEQ - 1
    argv += ["--seq-length", str(length)]
    results = run_distributed(tp * pp * ep, per_token_losses, argv, root, length)
    expected = reference_losses(reference)[:length]
    for losses in (r for r in results if r is not None):
        torch.testing.assert_close(torch.tensor(losses), expected, rtol=0, atol=1e-5)


def test_export_holds_megatron_lms_args_and_loads_into_megatron_core(megatron, tmp_path):
    """threefold -> Megatron of the mixture, trained two steps and as read: the args hold
    --no-rope-freq as Megatron-LM's parser leaves it (2) and ModelOpt's two flags;
    megatron-core computes threefold's logits from the first and its own, bitwise, from the
    second."""
    root, reference, _, _ = megatron["llama4_moe"]
    ours, written = exports(root, reference, tmp_path)
    assert (ours - reference).abs().max() > 1e-3  # training moved it
    for path, expected, tolerance in written:
        args = vars(torch.load(os.path.join(path, "common.pt"), weights_only=False)["args"])
        assert args["no_rope_freq"] == 2
        assert args["export_qk_l2_norm"] and args["export_moe_apply_probs_on_input"]
        theirs = run_distributed(1, mc.logits, "llama4_moe", path)[0]
        torch.testing.assert_close(theirs, expected, rtol=0, atol=tolerance)


def test_the_hugging_face_export_is_refused_in_one_line(megatron, tmp_path, capsys):
    """transformers' Llama 4 normalizes queries and keys in its layers with RoPE only, and
    megatron-core's in every layer: the export is refused, nothing written."""
    root = megatron["llama4"][0]
    hf = str(tmp_path / "hf")
    argv = ["--loader", "megatron", "--saver", "hf", "--load-dir", root, "--save-dir", hf]
    with pytest.raises(SystemExit):
        convert_checkpoint.main(argv)
    error = capsys.readouterr().err
    assert "Llama4ForCausalLM cannot express this model: --qk-l2-norm in the layers" in error
    assert error.count("\n") == 1 and not os.path.exists(hf)


def test_maverick_patterns_read_as_megatron_lm_evaluates_them():
    """Megatron-LM evaluates these as Python; threefold reads them."""
    assert parse_layer_pattern("([0,1]*24)", 48) == [0, 1] * 24
    assert parse_layer_pattern("([0]*3+[1]*1)*3", 12, "--no-rope-freq") == [0, 0, 0, 1] * 3


MOE = ["--num-experts", "4", "--moe-router-topk", "1"]


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--no-rope-freq", "3"], "--no-rope-freq 3 must divide --num-layers 2"),
        (["--no-rope-freq", "[0,1,1]"], "gives 3 layers, --num-layers is 2"),
        (["--no-rope-freq", "2", "--position-embedding-type", "learned_absolute"], "needs"),
        (["--no-rope-freq", "2", "--mtp-num-layers", "1"], "--mtp-num-layers"),
        (MOE[:2] + ["--moe-apply-probs-on-input"], "--moe-router-topk 1, not 2"),
    ],
    ids=["divides", "pattern", "without-rope", "mtp", "top-2"],
)
def test_what_megatron_core_refuses_is_one_line(capsys, argv, named):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_MHA_STYLE + argv + TRAINING)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1


def test_megatron_lms_modelopt_spellings_are_the_same_flags():
    spellings = ["--export-qk-l2-norm", "--export-moe-apply-probs-on-input"]
    config = parse_args(LLAMA_MHA_STYLE + MOE + spellings + TRAINING)
    assert config.model.qk_l2_norm and config.model.moe_apply_probs_on_input


# Megatron-LM's Llama 4 flags (examples/post_training/modelopt/conf/meta-llama/), its sizes
# shrunk; mock data for its tokenizer
LLAMA4 = "--micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear "
LLAMA4 += "--untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion "
LLAMA4 += "--normalization RMSNorm --swiglu --num-layers 4 --hidden-size 64 "
LLAMA4 += "--ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
LLAMA4 += "--num-query-groups 2 --num-experts 4 --moe-ffn-hidden-size 64 "
LLAMA4 += "--moe-router-score-function sigmoid --moe-router-topk 1 "
LLAMA4 += "--moe-router-topk-scaling-factor 1.0 --moe-router-dtype fp32 "
LLAMA4 += "--moe-shared-expert-intermediate-size 64 --moe-aux-loss-coeff 1e-3 "
LLAMA4 += "--moe-token-dispatcher-type alltoall --moe-token-drop-policy probs "
LLAMA4 += "--moe-router-load-balancing-type seq_aux_loss --seq-length 32 "
LLAMA4 += "--max-position-embeddings 32 --use-mcore-models --rotary-interleaved "
LLAMA4 += "--rotary-percent 1.0 --rotary-base 500000 --rope-scaling-factor 8.0 "
LLAMA4 += "--use-rope-scaling --sequence-parallel --no-bias-swiglu-fusion "
LLAMA4 += "--export-moe-apply-probs-on-input --mock-data --vocab-size 500 --train-iters 1 "
LLAMA4 += "--global-batch-size 1 --lr 1e-4"
SCOUT = ["--qk-layernorm", "--export-qk-l2-norm"]
MAVERICK = ["--moe-layer-freq", "([0,1]*2)", "--moe-layer-recompute", "--no-rope-freq", "4"]


@pytest.mark.parametrize("variant", [SCOUT, MAVERICK], ids=["scout", "maverick"])
def test_megatron_lms_llama4_flags_build_llama4(capsys, variant):
    """Scout's flags: the L2 norm in every layer, --qk-layernorm named as changing nothing
    (megatron-core's spec takes the L2 norm); Maverick's: experts in layers 2 and 4, RoPE
    skipped in layer 4, the MoE layers recomputed."""
    from tests.parity import _setup
    from threefold.model.norms import L2Norm

    layers = _setup(LLAMA4.split() + variant).model.decoder.layers
    said = capsys.readouterr().out
    attention = [layer.self_attention for layer in layers]
    if variant is SCOUT:
        assert all(isinstance(a.q_layernorm, L2Norm) for a in attention)
        assert "--qk-layernorm has no effect with --qk-l2-norm" in said
        assert [a.rope for a in attention] == [True] * 4
        return
    assert [a.rope for a in attention] == [True, True, True, False]
    assert [type(layer.mlp).__name__ for layer in layers] == ["MLP", "MoELayer"] * 2
    assert all(layer.mlp.apply_probs_on_input for layer in layers[1::2])
    assert "--recompute-modules core_attn moe" in said


# transformers' Llama 4 options (config/llama4.py): chunks of 6, which straddle the CP ranks'
# chunks of 4, and queries tempered from position 2 on
TRANSFORMERS = ["--no-rope-freq", "2", "--qk-l2-norm", "--qk-l2-norm-rope-layers-only"]
TRANSFORMERS += ["--rotary-interleaved", "--attention-chunk-size", "6", "--attn-temperature-tuning"]
TRANSFORMERS += ["--attn-temperature-floor-scale", "3", "--attn-temperature-scale", "0.5"]


@pytest.mark.parametrize(
    "world,layout,data",
    [
        (2, ["--cp-comm-type", "p2p"], []),
        (2, ["--cp-comm-type", "p2p"], DOCUMENTS + ["--reset-attention-mask"]),
        (4, ["--cp-comm-type", "allgather", "--tensor-model-parallel-size", "2"], []),
        (4, ["--cp-comm-type", "a2a", "--pipeline-model-parallel-size", "2"], []),
    ],
    ids=["cp2-p2p", "cp2-p2p-documents", "cp2-allgather-tp2", "cp2-a2a-pp2"],
)
def test_transformers_llama4_trains_over_context_parallel_ranks_as_one_process(world, layout, data):
    """Each CP rank's queries tempered by their place in the whole sequence, the chunks (within
    packed documents) masked a block at a time: five steps as one process."""
    argv = LLAMA_MHA_STYLE + TRANSFORMERS + TRAINING + data
    reference = train_job(argv, 5)
    layout = ["--context-parallel-size", "2", *layout]
    assert_matches_reference(run_distributed(world, train_job, argv + layout, 5), reference, 1e-5)
