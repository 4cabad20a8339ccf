"""--overlap-param-gather: no module reads a parameter before the all-gather of its bucket has
been waited for. The gathers here are poisoned: each bucket's gathered values stay NaN until
its handle is waited on, so a forward that reads a weight early (a module reading weights of
modules it does not call) trains to NaN, deterministically, where the real race shows only
when a slow rank's gather is still in flight."""

import math

import pytest
import torch

from bench.layout_matrix import FEATURES
from tests.distributed import run_distributed
from tests.parity import TRAINING, assert_matches_reference, train_job

OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


class _Deferred:
    """A finished gather whose values reach the bucket only when it is waited on."""

    def __init__(self, output: torch.Tensor, gathered: torch.Tensor) -> None:
        self.output, self.gathered = output, gathered

    def wait(self) -> None:
        self.output.copy_(self.gathered)


def _poisoned_train_job(argv: list[str], steps: int) -> dict:
    from threefold.parallel.data_parallel import gradient_buffer

    real = gradient_buffer.all_gather_single

    def deferred(output, tensor, group=None, async_op=False):
        gathered = torch.empty_like(output)
        real(gathered, tensor, group=group)
        fill = 0xFF if output.dtype == torch.uint8 else math.nan
        output.fill_(fill)
        return _Deferred(output, gathered) if async_op else output.copy_(gathered)

    gradient_buffer.all_gather_single = deferred
    try:
        return train_job(argv, steps)
    finally:
        gradient_buffer.all_gather_single = real


@pytest.mark.parametrize(
    "feature", ["gpt2", "mla", "dsa", "mtp", "moe-alltoall", "moe-latent", "gdn", "mamba-moe"]
)
def test_no_module_reads_a_weight_before_its_gather(feature):
    argv = TRAINING + FEATURES[feature]
    reference = train_job(argv, 3)
    results = run_distributed(2, _poisoned_train_job, argv + OVERLAP, 3)
    assert_matches_reference(results, reference, 1e-5)
