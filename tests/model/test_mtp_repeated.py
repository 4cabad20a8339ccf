"""--mtp-use-repeated-layer (Megatron-LM's; Nemotron 3.5's): one depth's layer, projection
and norms, run for every depth with their weights shared. It computes what separate depths
holding the same weights compute, its gradients their sum; it trains as one process in
parallel layouts (a hybrid pattern's depth too); parameters count it once, FLOPs every depth,
and the MoE statistics its expert layer once, as Megatron-LM counts them."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.model.test_hybrid_mtp import BASE, PATTERN
from tests.model.test_hybrid_mtp import LAYOUTS as HYBRID_LAYOUTS
from tests.parallel.test_expert_parallel import MOE
from tests.parity import LLAMA_STYLE, TRAINING, _setup, assert_matches_reference, train_job
from threefold.arguments import parse_args
from threefold.training.flops import training_flops_per_iteration
from threefold.training.memory_estimate import parameter_count

GPT = LLAMA_STYLE + TRAINING + MOE + ["--mtp-num-layers", "3", "--mtp-loss-scaling-factor", "0.3"]
REPEATED = ["--mtp-use-repeated-layer"]


def _loss_and_gradients(model, batch):
    model.train()
    per_token = model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"])
    per_token.mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return per_token.mean().item(), model.mtp.take_losses(), grads


def test_the_repeated_layer_is_separate_depths_holding_its_weights():
    separate, repeated = _setup(GPT), _setup(GPT + REPEATED)
    assert len(separate.model.mtp.layers) == 3 and len(repeated.model.mtp.layers) == 1
    weights = repeated.model.state_dict()
    with torch.no_grad():  # every separate depth holds the repeated one's weights
        for name, tensor in separate.model.state_dict().items():
            shared = name.replace("mtp.layers.1.", "mtp.layers.0.").replace(
                "mtp.layers.2.", "mtp.layers.0."
            )
            tensor.copy_(weights[shared])
    batch = next(repeated.train_iterator())
    loss, losses, grads = _loss_and_gradients(separate.model, batch)
    loss_r, losses_r, grads_r = _loss_and_gradients(repeated.model, batch)
    assert loss_r == loss
    torch.testing.assert_close(losses_r, losses, rtol=1e-6, atol=0)
    assert losses[0] != losses[1]  # (each depth predicts another token)
    for name, grad in grads_r.items():
        if name.startswith("mtp."):  # the sum of the depths' gradients
            parts = [grads[name.replace("layers.0.", f"layers.{k}.")] for k in range(3)]
            torch.testing.assert_close(grad, sum(parts), rtol=1e-5, atol=1e-7)
        else:
            torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-7)


LAYOUTS = {name: HYBRID_LAYOUTS[name] for name in ("tp2-sp-pp2", "ep2-dp2-distributed-optimizer")}


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_repeated_layer_trains_as_one_process(model, layout):
    argv = (GPT if model == "gpt" else BASE + ["--hybrid-layer-pattern", PATTERN]) + REPEATED
    world, flags = LAYOUTS[layout]
    reference = train_job(argv, 3)
    assert_matches_reference(run_distributed(world, train_job, argv + flags, 3), reference, 1e-5)


def test_parameters_count_it_once_flops_every_depth_and_the_moe_statistics_once():
    trainer = _setup(GPT + REPEATED)
    model = trainer.config.model
    counted = sum(p.numel() for p in trainer.model.parameters())
    assert parameter_count(model, model.padded_vocab_size(1)) == counted
    one_depth = parse_args([a if a != "3" else "1" for a in GPT]).model
    assert parameter_count(one_depth, 1008) == parameter_count(model, 1008)
    separate = parse_args(GPT).model
    assert training_flops_per_iteration(model, 8, 1008) == training_flops_per_iteration(
        separate, 8, 1008
    )
    assert trainer.moe_statistics.moe_layer_numbers == [1, 2, 3]  # (the depth's once)


def test_it_needs_depths(capsys):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + REPEATED)
    error = capsys.readouterr().err
    assert "--mtp-use-repeated-layer repeats a depth's layer" in error
    assert error.count("\n") == 1
