"""Adam's state of a hybrid model's Megatron-LM checkpoints in, against megatron-core itself.

megatron-core's MambaModel (tests/megatron_core_hybrid.py: a Mamba, an attention, a Mamba and
an MLP layer, "M*M-") trains two iterations at TP2 x DP2 with its DDP and optimizer
(tests/megatron_core_training.py), and saves Adam's state three ways: the distributed
optimizer's default torch_dist layout (dp_reshardable: buckets whose layout threefold
rebuilds, a Mamba mixer's dt_bias, A_log and D before its in_proj), the legacy format's
distrib_optim.pt (buckets of 6000 elements), and the non-distributed optimizer's state in the
legacy model_optim_rng.pt. Each TP rank holds its share of each section of a mixer's in_proj
and conv1d (z, x, B, C, dt), joined section by section. threefold reads each at TP1 and its
next iteration's loss and weights are megatron-core's.
"""

from __future__ import annotations

import pytest

from tests import megatron_core_training as mt
from tests.distributed import run_distributed
from tests.tools.megatron_runs import continue_argv, continue_training

LAYOUTS = ("dp_reshardable", "legacy", "legacy_plain")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """layout -> (checkpoint root, megatron-core's weights one iteration later, its loss)."""
    runs = {}
    for layout in LAYOUTS:
        directory = tmp_path_factory.mktemp(f"megatron_hybrid_{layout}")
        root, after = str(directory / "run"), str(directory / "after")
        losses = run_distributed(4, mt.train_and_save, "hybrid_dense", root, after, 2, layout, 2)
        runs[layout] = (root, after, losses[0])
    return runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_goes_on_from_a_hybrids_optimizer_state_as_in_megatron(trained, layout):
    root, after, megatron_loss = trained[layout]
    argv = continue_argv(root, 1, 1, 1)
    for loss, difference in run_distributed(1, continue_training, argv, root, after, True):
        assert loss == pytest.approx(megatron_loss, rel=1e-6)
        assert difference < 1e-6
