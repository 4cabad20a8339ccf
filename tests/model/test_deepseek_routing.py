"""DeepSeek-V3's routing options, against megatron-core's own routing function: group-limited
top-k, the scaling factor, and the auxiliary-loss-free expert bias (its update, its fp32 state
and its place in the checkpoint). Their parity at EP2 is among the router variants of
tests/parallel/test_expert_parallel.py."""

import pytest
import torch

from tests.parallel.test_expert_parallel import MOE
from tests.parity import LLAMA_STYLE, TRAINING, _setup


@pytest.mark.parametrize(
    "score_function,pre_softmax",
    [("softmax", False), ("softmax", True), ("sigmoid", False), ("sigmoid", True)],
    ids=["softmax", "pre-softmax", "sigmoid", "sigmoid-pre-softmax"],
)
def test_group_limited_routing_is_megatron_cores(score_function, pre_softmax):
    """--moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk 4 with
    --moe-router-topk-scaling-factor 2.5 over 16 experts (DeepSeek-V3's shape, smaller):
    megatron-core's topk_routing_with_score_function, probabilities and choice."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from threefold.model.moe.router import top_k

    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(3))
    probs, indices = top_k(logits, 4, score_function, pre_softmax, (4, 2), 2.5)
    ours = torch.zeros_like(logits).scatter(1, indices, probs)
    theirs, routing_map = topk_routing_with_score_function(
        logits, 4, pre_softmax, 4, 2, 2.5, score_function
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert torch.equal(ours > 0, routing_map)
    # the choice is group-limited: every token's experts lie in two of its four groups
    assert all(len(set((row // 4).tolist())) <= 2 for row in indices)
    plain = torch.zeros_like(logits).scatter(1, logits.topk(4, dim=-1).indices, 1.0)
    assert not torch.equal(plain > 0, routing_map)


def test_expert_bias_chooses_but_does_not_weigh_as_in_megatron_core():
    """--moe-router-enable-expert-bias: the bias moves the choice, the weights stay the
    sigmoid scores (megatron-core's topk_routing_with_score_function with expert_bias)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from threefold.model.moe.router import top_k

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(4))
    bias = torch.linspace(-0.3, 0.3, 8)
    probs, indices = top_k(logits, 2, "sigmoid", False, expert_bias=bias)
    ours = torch.zeros_like(logits).scatter(1, indices, probs)
    theirs, _ = topk_routing_with_score_function(
        logits, 2, score_function="sigmoid", expert_bias=bias
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.equal(indices, logits.topk(2, dim=-1).indices)  # the bias chose


def test_expert_bias_balances_and_stays_fp32_under_bf16():
    """Each step moves every expert's bias by the rate towards an even load; the bias is
    fp32 state in a bf16 model, outside the optimizer, and in the checkpoint's parameters."""
    argv = LLAMA_STYLE + TRAINING + MOE + ["--moe-router-score-function", "sigmoid"]
    argv += ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01", "--bf16"]
    trainer = _setup(argv)
    router = trainer.model.decoder.layers[0].mlp.router
    assert router.expert_bias.dtype == torch.float32 and not router.expert_bias.requires_grad
    trainer.train_step()
    bias = router.expert_bias.detach().clone()
    assert bias.abs().eq(0.01).sum() >= 2  # every expert not exactly at the mean moved 0.01
    trainer.train_step()
    assert not torch.equal(router.expert_bias, bias)
    names = [n for n, _ in trainer.layout_independent_parameters()]
    assert "decoder.layers.0.mlp.router.expert_bias" in names


def test_pre_softmax_beside_sigmoid_scores_is_taken_with_a_note(capsys):
    """Megatron-LM takes --moe-router-pre-softmax with sigmoid scores and ignores it (its MTP
    configs pass both); so does threefold, saying so at start-up (the routing: above)."""
    from threefold.arguments import parse_args

    sigmoid = ["--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax"]
    config = parse_args(LLAMA_STYLE + TRAINING + MOE + sigmoid)
    assert config.model.moe_router_pre_softmax
    assert "--moe-router-pre-softmax has no effect" in capsys.readouterr().out
