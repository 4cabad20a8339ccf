"""Megatron-LM's --moe-router-load-balancing-type global_aux_loss: the routed counts of every
data-parallel replica's micro-batch, averaged over the step's micro-batches so far, against
megatron-core's loss function; and what it means across layouts, by design (its gradient is
averaged over the replicas like every loss's): DP2 computes one process's loss over both
replicas' micro-batches at half the coefficient."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import MOE, _train_with_statistics
from tests.parity import LLAMA_STYLE, TRAINING, _setup, assert_matches_reference

GLOBAL = ["--moe-router-load-balancing-type", "global_aux_loss", "--moe-z-loss-coeff", "0"]


def test_the_loss_is_megatron_cores_over_the_steps_running_counts():
    """Two micro-batches: each loss is megatron-core's switch_load_balancing_loss_func of
    its scores with the counts averaged over the step so far; a new step starts over."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    from threefold.model.moe import start_aux_losses

    trainer = _setup(LLAMA_STYLE + TRAINING + MOE + GLOBAL)
    router = trainer.model.decoder.layers[0].mlp.router
    start_aux_losses(trainer.model_chunks, 1.0)
    generator = torch.Generator().manual_seed(5)
    counts, losses, expected = torch.zeros(4), [], []
    for step in range(2):
        tokens = torch.randn(32, 32, generator=generator)
        _, _, aux = router(tokens, batch_size=2)
        scores = torch.softmax(tokens @ router.weight.detach().t(), dim=-1)
        counts += _routed(scores)
        losses.append(aux["global_load_balancing_loss"].detach())
        expected.append(
            switch_load_balancing_loss_func(scores, counts / (step + 1), 32, 2, 4, 0.01)
        )
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-6, atol=0)
    start_aux_losses(trainer.model_chunks, 1.0)
    _, _, aux = router(tokens, batch_size=2)
    first = switch_load_balancing_loss_func(scores, _routed(scores), 32, 2, 4, 0.01)
    torch.testing.assert_close(aux["global_load_balancing_loss"].detach(), first, rtol=1e-6, atol=0)


def _routed(scores: torch.Tensor) -> torch.Tensor:
    """Tokens per expert of a fresh top-2 of the scores."""
    return torch.zeros_like(scores).scatter(1, scores.topk(2, dim=-1).indices, 1).sum(0)


def test_dp2_is_one_process_over_both_replicas_at_half_the_coefficient():
    """DP2 with micro-batches of 2 against one process with micro-batches of 4 (the two
    replicas' m-th micro-batches together) and --moe-aux-loss-coeff halved: losses,
    weights and the logged global_load_balancing_loss (summed over replicas, as
    megatron-core's tracker does) agree; at the full coefficient the weights do not."""
    argv = LLAMA_STYLE + TRAINING + MOE + GLOBAL
    reference = _train_with_statistics(argv + ["--micro-batch-size", "4"] + HALF, 5)
    results = run_distributed(2, _train_with_statistics, argv, 5)
    assert_matches_reference(results, reference, 1e-5)
    for result in results:
        logged = result["moe"]["global_load_balancing_loss"]
        assert logged == pytest.approx(reference["moe"]["global_load_balancing_loss"], rel=1e-5)
    full = _train_with_statistics(argv + ["--micro-batch-size", "4"], 5)
    name = "decoder.layers.0.mlp.router.weight"
    assert abs(full["params"][name] - reference["params"][name]).max() > 1e-4


HALF = ["--moe-aux-loss-coeff", "0.005"]


def test_full_recomputation_is_refused(capsys):
    from threefold.arguments import parse_args

    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    with pytest.raises(SystemExit):
        parse_args(
            LLAMA_STYLE + TRAINING + MOE + GLOBAL + recompute + ["--recompute-num-layers", "1"]
        )
    assert "global_aux_loss counts each micro-batch once" in capsys.readouterr().err
