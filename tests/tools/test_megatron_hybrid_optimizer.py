"""Adam's state of a hybrid model's Megatron-LM checkpoints in, against megatron-core itself.

megatron-core's MambaModel (tests/megatron_core_hybrid.py: a Mamba, an attention, a Mamba and
an MLP layer, "M*M-") trains two iterations at TP2 x DP2 with its DDP and optimizer
(tests/megatron_core_training.py), and saves Adam's state: in the distributed optimizer's
default torch_dist layout (dp_reshardable: buckets whose layout threefold rebuilds, a Mamba
mixer's dt_bias, A_log and D before its in_proj), in the legacy format's distrib_optim.pt
(buckets of 6000 elements) and, with the non-distributed optimizer, in the legacy
model_optim_rng.pt. Each TP rank holds its share of each section of a mixer's in_proj and
conv1d (z, x, B, C, dt), joined section by section. Newer Megatron-LM's mixers hold the
convolution's parameters first (`hold_conv_params`): the same keys in torch_dist, another
order in the buffers, which the load tells by where the masters are the weights, and other
names in the legacy files. threefold reads each at TP1 and its next iteration's loss and
weights are megatron-core's.
"""

from __future__ import annotations

import pytest

from tests import megatron_core_training as mt
from tests.distributed import run_distributed
from tests.tools.megatron_runs import continue_argv, continue_training

RUNS = [
    ("hybrid_dense", "dp_reshardable"),
    ("hybrid_dense", "legacy"),
    ("hybrid_dense_newer", "dp_reshardable"),
    ("hybrid_dense_newer", "legacy_plain"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(kind, layout) -> (checkpoint root, megatron-core's weights one iteration later, its
    loss)."""
    runs = {}
    for kind, layout in RUNS:
        directory = tmp_path_factory.mktemp(f"megatron_{kind}_{layout}")
        root, after = str(directory / "run"), str(directory / "after")
        losses = run_distributed(4, mt.train_and_save, kind, root, after, 2, layout, 2)
        runs[(kind, layout)] = (root, after, losses[0])
    return runs


@pytest.mark.parametrize("run", RUNS, ids=["-".join(run) for run in RUNS])
def test_training_goes_on_from_a_hybrids_optimizer_state_as_in_megatron(trained, run):
    root, after, megatron_loss = trained[run]
    argv = continue_argv(root, 1, 1, 1)
    for loss, difference in run_distributed(1, continue_training, argv, root, after, True):
        assert loss == pytest.approx(megatron_loss, rel=1e-6)
        assert difference < 1e-6
