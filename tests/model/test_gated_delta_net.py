"""Gated DeltaNet layers and Qwen3-Next's gates (--experimental-attention-variant
gated_delta_net, --attention-output-gate, --moe-shared-expert-gate,
--apply-wd-to-qk-layernorm): the chunked rule is the recurrence, a layer computes what
megatron-core's does (written out here from its definition), the gates are what they say, the
layouts train as one process, and bad settings stop in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import MOE
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_close_dicts,
    assert_losses_close,
    assert_matches_reference,
    gradient_job,
    train_job,
)
from threefold.arguments import parse_args
from threefold.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from threefold.parallel.tensor_parallel.sharding import mark_tensor_parallel, shard_of, unshard

HEADS = ["--linear-num-key-heads", "2", "--linear-num-value-heads", "4"]
SIZES = ["--linear-key-head-dim", "8", "--linear-value-head-dim", "6"]
GDN = ["--experimental-attention-variant", "gated_delta_net", *HEADS, *SIZES]
# layers 1 and 3 gated delta nets, 2 and 4 gated attention (a stage of each under PP2)
HYBRID = ["--num-layers", "4", *GDN, "--linear-attention-freq", "2", "--attention-output-gate"]
QWEN3_NEXT = (
    LLAMA_STYLE
    + TRAINING
    + HYBRID
    + MOE
    + ["--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"]
    + ["--qk-layernorm", "--apply-wd-to-qk-layernorm", "--weight-decay", "0.1"]
)


def _rule_inputs(seq: int, dtype=torch.float64):
    torch.manual_seed(0)
    b, heads, d_k, d_v = 2, 3, 8, 5
    q = torch.randn(b, seq, heads, d_k, dtype=dtype)
    k = F.normalize(torch.randn(b, seq, heads, d_k, dtype=dtype), dim=-1)
    v = torch.randn(b, seq, heads, d_v, dtype=dtype)
    g = -3 * torch.rand(b, seq, heads, dtype=dtype)
    beta = torch.rand(b, seq, heads, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("seq,chunk", [(37, 4), (37, 16), (64, 64), (5, 64)])
def test_the_chunked_rule_is_the_recurrence_with_its_gradients(seq, chunk):
    inputs = _rule_inputs(seq)
    expected = recurrent_gated_delta_rule(*inputs)
    actual = chunk_gated_delta_rule(*inputs, chunk_size=chunk)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)
    weight = torch.randn_like(expected)
    for a, e in zip(
        torch.autograd.grad((actual * weight).sum(), inputs),
        torch.autograd.grad((expected * weight).sum(), inputs),
    ):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-11)


def test_packed_documents_are_solved_each_alone():
    """With document ids, the chunked rule (and its gradients) equals each document's own
    recurrence, run apart: boundaries inside chunks and on their edges, one a token long."""
    from tests.model.test_mamba import DOCUMENT_IDS

    inputs = _rule_inputs(37)
    expected = torch.zeros(2, 37, 3, 5, dtype=torch.float64)
    for row, ids in enumerate(DOCUMENT_IDS):
        for document in ids.unique():
            span = slice(*(ids == document).nonzero()[[0, -1], 0].add(torch.tensor([0, 1])))
            pieces = [t[row : row + 1, span] for t in inputs]
            expected[row : row + 1, span] = recurrent_gated_delta_rule(*pieces)
    for chunk in (4, 16):
        actual = chunk_gated_delta_rule(*inputs, DOCUMENT_IDS, chunk_size=chunk)
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(expected)
    want = torch.autograd.grad(recurrent_gated_delta_rule(*inputs, DOCUMENT_IDS), inputs, grad)
    got = torch.autograd.grad(chunk_gated_delta_rule(*inputs, DOCUMENT_IDS, 4), inputs, grad)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_the_recurrence_is_the_delta_rule():
    """Two tokens by hand: the first writes beta v k^T, the second corrects what k_2 reads."""
    q, k, v, g, beta = (t.detach() for t in _rule_inputs(2))
    out = recurrent_gated_delta_rule(q, k, v, g, beta)
    state = beta[0, 0, 1] * torch.outer(k[0, 0, 1], v[0, 0, 1])
    scale = q.shape[-1] ** -0.5
    torch.testing.assert_close(out[0, 0, 1], state.T @ q[0, 0, 1] * scale)
    state = g[0, 1, 1].exp() * state
    state = state + beta[0, 1, 1] * torch.outer(k[0, 1, 1], v[0, 1, 1] - state.T @ k[0, 1, 1])
    torch.testing.assert_close(out[0, 1, 1], state.T @ q[0, 1, 1] * scale)


def _megatron_gated_delta_net(layer, x: torch.Tensor) -> torch.Tensor:
    """megatron-core's GatedDeltaNet forward (TP 1), step by step from its definition."""
    qk = layer.key_heads * layer.key_head_dim
    v_dim = layer.value_heads * layer.value_head_dim
    heads = layer.value_heads
    projected = x @ layer.in_proj.weight.T  # [s, b, sections]
    q, k, v, z, beta, alpha = projected.split([qk, qk, v_dim, v_dim, heads, heads], dim=-1)
    qkv = torch.cat((q, k, v), dim=-1)  # causal depthwise convolution, tap by tap
    weight = layer.conv1d.weight[:, 0]  # [channels, kernel]
    width = weight.shape[1]
    padded = F.pad(qkv, (0, 0, 0, 0, width - 1, 0))
    conv = sum(padded[i : i + x.shape[0]] * weight[:, i] for i in range(width))
    q, k, v = F.silu(conv).transpose(0, 1).split([qk, qk, v_dim], dim=-1)
    b, s = q.shape[:2]
    q = F.normalize(q.reshape(b, s, layer.key_heads, -1), dim=-1, eps=1e-6)
    k = F.normalize(k.reshape(b, s, layer.key_heads, -1), dim=-1, eps=1e-6)
    group = heads // layer.key_heads
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    g = -layer.A_log.exp() * F.softplus(alpha + layer.dt_bias)
    core = recurrent_gated_delta_rule(
        q, k, v.reshape(b, s, heads, -1), g.transpose(0, 1), beta.sigmoid().transpose(0, 1)
    )
    norm = layer.out_norm
    normed = core * torch.rsqrt(core.square().mean(-1, keepdim=True) + norm.eps) * norm.weight
    gated = normed * F.silu(z.transpose(0, 1).reshape(b, s, heads, -1))
    return gated.reshape(b, s, -1).transpose(0, 1) @ layer.out_proj.weight.T


def test_a_layer_computes_megatron_cores_gated_delta_net():
    trainer = _setup(LLAMA_STYLE + TRAINING + HYBRID)
    layer = trainer.model.decoder.layers[0].self_attention
    assert [type(m.self_attention).__name__ for m in trainer.model.decoder.layers] == [
        "GatedDeltaNet",
        "SelfAttention",
    ] * 2
    torch.manual_seed(1)
    with torch.no_grad():
        layer.out_norm.weight.uniform_(0.5, 1.5)  # not the ones it starts at
        x = torch.randn(16, 2, 32)
        torch.testing.assert_close(layer(x), _megatron_gated_delta_net(layer, x))


def test_the_attention_output_gate_multiplies_the_context_by_its_sigmoid():
    """A zero gate halves what the plain attention with the same q/k/v rows gives (no bias)."""
    plain_model = _setup(LLAMA_STYLE + TRAINING).model
    plain = plain_model.decoder.layers[0].self_attention
    gated = _setup(LLAMA_STYLE + TRAINING + ["--attention-output-gate"])
    gated = gated.model.decoder.layers[0].self_attention
    with torch.no_grad():
        per_group = gated.linear_qkv.weight.view(4, 2 * 2 + 2, 4, 32)  # groups, rows, d, h
        plain_rows = plain.linear_qkv.weight.view(4, 2 + 2, 4, 32)
        per_group[:, :2] = plain_rows[:, :2]  # queries
        per_group[:, 2:4] = 0.0  # the gates
        per_group[:, 4:] = plain_rows[:, 2:]  # key, value
        gated.linear_proj.weight.copy_(plain.linear_proj.weight)
        x = torch.randn(16, 2, 32)
        rotary = plain_model.rotary_pos_emb(16, x.device)
        torch.testing.assert_close(gated(x, rotary), 0.5 * plain(x, rotary))


def test_the_shared_expert_gate_scales_by_a_sigmoid_per_token():
    trainer = _setup(QWEN3_NEXT)
    shared = trainer.model.decoder.layers[0].mlp.shared_experts
    x = torch.randn(16, 2, 32)
    with torch.no_grad():
        ungated = super(type(shared), shared).forward(x)
        gate = torch.sigmoid(x @ shared.gate_weight.T)
        torch.testing.assert_close(shared(x), ungated * gate)
        assert gate.shape == (16, 2, 1) and gate.std() > 0


def test_weight_decay_reaches_the_query_and_key_norms_only_when_asked():
    def decayed(argv: list[str]) -> set[str]:
        trainer = _setup(argv)
        ids = {id(p): n for n, p in trainer.model.named_parameters()}
        masters = {id(p.master): ids[id(p.param)] for p in trainer.optimizer.pieces}
        return {
            masters[id(master)]
            for group in trainer.optimizer.param_groups
            if group["wd_mult"] == 1.0
            for master in group["params"]
        }

    with_norms = decayed(QWEN3_NEXT)
    without = decayed([a for a in QWEN3_NEXT if a != "--apply-wd-to-qk-layernorm"])
    norms = {"q_layernorm.weight", "k_layernorm.weight"}
    assert {n.split("self_attention.")[-1] for n in with_norms - without} == norms
    assert not any(
        "layernorm" in n and n.rsplit(".", 2)[-2] not in ("q_layernorm", "k_layernorm")
        for n in with_norms
    )
    assert any(n.endswith("conv1d.weight") for n in without)  # a 3-D weight decays
    assert not any(n.endswith(("A_log", "dt_bias", "out_norm.weight")) for n in with_norms)


def test_the_layer_pattern_and_parameter_count_are_megatron_lms():
    from threefold.training.memory_estimate import parameter_count

    config = parse_args(
        LLAMA_STYLE + TRAINING + ["--num-layers", "6"] + GDN + ["--linear-attention-freq", "3"]
    ).model
    assert config.linear_attention_pattern(6) == [1, 1, 0, 1, 1, 0]
    listed = parse_args(
        LLAMA_STYLE
        + TRAINING
        + ["--num-layers", "6"]
        + GDN
        + ["--linear-attention-freq", "([1]*1+[0]*1)*3"]
    ).model
    assert listed.linear_attention_pattern(6) == [1, 0] * 3
    trainer = _setup(QWEN3_NEXT)
    model = trainer.config.model
    counted = sum(p.numel() for p in trainer.model.parameters())
    assert parameter_count(model, model.padded_vocab_size(1)) == counted


def test_sections_split_by_heads_over_tp_and_back():
    sizes = (4, 4, 6, 6, 2, 2)
    param = mark_tensor_parallel(
        torch.nn.Parameter(torch.empty(12)), 0, None, (24,), partition_sizes=sizes
    )
    full = torch.arange(24.0)
    shards = [shard_of(full, param, rank, 2) for rank in range(2)]
    assert shards[0].tolist() == [0, 1, 4, 5, 8, 9, 10, 14, 15, 16, 20, 22]
    torch.testing.assert_close(unshard(shards, param), full)


def test_gradients_match_with_the_norm_recomputed():
    reference = gradient_job(QWEN3_NEXT)
    argv = QWEN3_NEXT + ["--recompute-granularity", "selective", "--recompute-modules"]
    result = gradient_job(argv + ["gdn_norm_out", "core_attn"])
    assert result["loss"] == reference["loss"]
    assert_close_dicts(result["grads"], reference["grads"], 1e-6, "gdn_norm_out")


LAYOUTS = {
    "tp2-sp-pp2": (
        4,
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--pipeline-model-parallel-size", "2"],
    ),
    "ep2-tp2-sp": (
        4,
        ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
        + ["--sequence-parallel"],
    ),
    "dp2-distributed-optimizer": (2, ["--use-distributed-optimizer"]),
    # the gated delta nets' all-to-all over CP beside the attention layers' ring
    "cp2-pp2": (4, ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}


def test_packed_documents_over_cp2_and_tp2_train_as_one_process():
    """--reset-attention-mask: the gated delta nets convolve and solve each document alone
    (their heads' whole sequence gathered over CP), the attention layers attend within it:
    two packed documents' logits are each one's alone; at CP2 x TP2+SP it trains as one
    process does, and not as without the mask."""
    from tests.model.test_mamba import DOCUMENTS
    from threefold.parallel.context_parallel.sequence import document_mask

    argv = QWEN3_NEXT + DOCUMENTS + ["--linear-num-key-heads", "4"]  # (whole heads a rank)
    model = _setup(argv).model.eval()
    tokens = torch.randint(0, 15, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # two packed documents' logits: each document's alone
        for module in model.modules():  # (slow decays: a state carried over would show)
            if hasattr(module, "A_log"):
                module.A_log.fill_(-3.0)
        packed = model(tokens, attention_mask=document_mask(torch.tensor([[0] * 6 + [1] * 10])))
        apart = torch.cat([model(tokens[:, :6]), model(tokens[:, 6:])])
    torch.testing.assert_close(packed, apart, rtol=1e-5, atol=1e-5)
    reference = train_job(argv, 4)
    layout = ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    layout += ["--sequence-parallel"]
    assert_matches_reference(run_distributed(4, train_job, argv + layout, 4), reference, 1e-5)
    unmasked = train_job([a for a in argv if a != "--reset-attention-mask"], 4)
    assert unmasked["losses"] != reference["losses"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_train_as_one_process(layout):
    world, flags = LAYOUTS[layout]
    reference = train_job(QWEN3_NEXT, 4)
    assert_matches_reference(
        run_distributed(world, train_job, QWEN3_NEXT + flags, 4), reference, 1e-5
    )


def test_a_depth_after_gated_attention_trains_as_one_process():
    """Qwen3-Next's multi-token prediction: a depth of the last layer's kind (gated attention
    with experts and the gated shared expert), as megatron-core builds one; TP2+SP x PP2
    (the depth beside the loss, its attention's heads split) trains as one process."""
    argv = QWEN3_NEXT + ["--mtp-num-layers", "1"]
    depth = _setup(argv).model.mtp.layers[0].transformer_layer
    assert type(depth.self_attention).__name__ == "SelfAttention"
    assert depth.self_attention.output_gate
    world, flags = LAYOUTS["tp2-sp-pp2"]
    reference = train_job(argv, 4)
    assert_matches_reference(run_distributed(world, train_job, argv + flags, 4), reference, 1e-5)


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--linear-num-key-heads", "2"], "--linear-num-key-heads: gated delta net settings"),
        (GDN, "needs --linear-attention-freq"),
        (GDN + ["--linear-attention-freq", "[1,0,1]"], "gives 3 layers, --num-layers is 2"),
        (
            [*GDN, "--linear-attention-freq", "2", "--linear-num-value-heads", "3"],
            "is not a multiple of --linear-num-key-heads",
        ),
        (
            [*GDN, "--linear-attention-freq", "2", "--tensor-model-parallel-size", "4"],
            "--linear-num-key-heads 2 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            [*GDN, "--linear-attention-freq", "2", "--context-parallel-size", "4"],
            "--linear-num-key-heads 2 is not divisible by TP x --context-parallel-size 4",
        ),
        (
            [*GDN, "--linear-attention-freq", "[0,1]", "--mtp-num-layers", "1"],
            "--mtp-num-layers with a gated delta net as the last layer",
        ),
        (MOE + ["--moe-shared-expert-gate"], "--moe-shared-expert-gate gates the shared expert"),
    ],
)
def test_refusals_are_one_line(capsys, argv, named):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + argv, world_size=4)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1, error


def test_an_activation_other_than_silu_is_refused(capsys):
    argv = [a for a in LLAMA_STYLE if a != "--swiglu"] + TRAINING + GDN
    with pytest.raises(SystemExit):
        parse_args(argv + ["--linear-attention-freq", "2"])
    assert "add --swiglu" in capsys.readouterr().err


def test_fp8_runs_the_projections_and_trains_close_to_fp32():
    """In FP8 the gated delta net's in_proj and out_proj are FP8 layers (their scaling state is
    checkpointed), the convolution and the rule stay in the run's dtype."""
    fp8 = train_job(QWEN3_NEXT + ["--fp8-format", "hybrid"], 3)
    names = " ".join(fp8["fp8"])
    assert (
        "layers.0.self_attention.in_proj" in names and "layers.0.self_attention.out_proj" in names
    )
    assert "conv1d" not in names
    reference = train_job(QWEN3_NEXT, 3)
    for ours, theirs in zip(fp8["losses"], reference["losses"]):
        assert abs(ours - theirs) < 1e-3 * theirs


def test_lora_adapts_the_projections_as_one_process():
    """linear_qkv and linear_proj mean a gated delta net's in_proj and out_proj; at TP2+SP the
    in_proj adapter's B is split by heads in each section, as the weight (split evenly, its
    rows would meet other heads' features and TP2 would train another model: relative error
    1.3 in that B against 1.8e-3 measured, Adam's first steps on B, which starts at zero,
    following the sign of gradients that are rounding noise; the losses agree to 1e-6)."""
    argv = QWEN3_NEXT + ["--lora-rank", "4", "--lr", "3e-2"]
    reference = train_job(argv, 4)
    adapted = {n.split(".")[4] for n in reference["params"] if ".layers.0.self_attention." in n}
    assert {"in_proj", "out_proj"} <= adapted
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    flags += ["--expert-tensor-parallel-size", "1"]
    for result in run_distributed(2, train_job, argv + flags, 4):
        assert_losses_close(result["losses"], reference["losses"], 1e-6)
        assert_close_dicts(result["params"], reference["params"], 1e-2, "parameter")
