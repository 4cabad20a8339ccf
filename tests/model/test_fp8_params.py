"""--fp8-param-gather's per-step cast of the optimizer's fp32 pieces into the FP8 buffer
(threefold.model.fp8_params), on one process: its launches, and its bytes against casting
each weight alone. (tests/parallel/test_fp8.py trains with it in every layout.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.kernels.test_fp8 import _VIEWS
from threefold.kernels import reference
from threefold.kernels.fp8 import WEIGHT, Fp8Linear
from threefold.kernels.fp8_gemms import E4M3, quantize
from threefold.kernels.fp8_recipe import Fp8Recipe
from threefold.kernels.reference import scale_from_amax
from threefold.model.fp8_params import Fp8Parameters
from threefold.parallel.data_parallel.gradient_buffer import GradientBuffer
from threefold.parallel.parallel_context import ParallelContext


class _Count(TorchDispatchMode):
    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _Count.calls += func.overloadpacket.__name__ not in _VIEWS
        return func(*args, **(kwargs or {}))


def _parameters(count: int, delayed: bool) -> tuple[Fp8Parameters, list[torch.Tensor]]:
    """`count` FP8 weights of different ranges in one buffer, each a whole piece on this rank
    (one device): the parameters and their fp32 masters. Under delayed scaling every third
    layer, from the second on, has a history whose scale differs from its weight's current
    one (the others' first step: a scale from the weight's own amax)."""
    recipe = Fp8Recipe(delayed=delayed, amax_history_len=2)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4) * 4.0**i) for i in range(count)]
    states = [Fp8Linear(recipe) for _ in params]
    for i, state in enumerate(states[1::3] if delayed else []):
        state.scale.fill_(2.0**-i)
        state.use_history()
    buffer = GradientBuffer(params, ParallelContext().dp, flat_parameters=True, param_dtype=E4M3)
    fp8 = Fp8Parameters(dict(zip(params, states)), buffer)
    masters = [param.detach().view(-1).clone() for param in params]
    fp8.set_shards([(p, 0, p.numel(), m) for p, m in zip(params, masters)])
    return fp8, masters


@pytest.mark.parametrize("delayed", [False, True], ids=["tensorwise", "delayed"])
def test_the_param_gather_cast_launches_one_copy_per_weight(delayed):
    """The amaxes of every piece (one multi-tensor norm), the scales of every weight and the
    casts' multiply and clamp (multi-tensor ops) are one batch: each more weight costs one
    launch, its copy into FP8, where it cost 25 (tensorwise) or 11 (delayed, from its
    history). Each weight's FP8 bytes and scale are those of casting it alone; delayed
    scaling records its amax, and casts with its history's scale where it has one (one more
    launch where some layers have a history and some not: picking their scales)."""
    launches = {}
    for count in (1, 12):
        fp8, masters = _parameters(count, delayed)
        _Count.calls = 0
        with _Count():
            fp8.cast()
        launches[count] = _Count.calls
    assert launches[12] - launches[1] == 11 + delayed and launches[1] < 30, launches
    for state, master in zip(fp8.states.values(), masters):
        amax = master.abs().max()
        if state.has_history:
            scale = state.scale_in_use[WEIGHT]
        else:
            scale = scale_from_amax(amax, 448.0, 0, torch.ones(()))
        assert torch.equal(state.gathered_scale, scale)
        assert torch.equal(
            state.gathered[1].view(-1).float(), quantize(master, scale, E4M3).float()
        )
        assert state.step_amax[WEIGHT] == (amax if delayed else 0.0)


class _MaxOverRanks:
    """A stand-in for the buffer's group over simulated ranks: the first pass records each
    rank's tensor, the second gives every rank their elementwise maximum."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.result: torch.Tensor | None = None

    def all_reduce(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        if self.result is None:
            self.seen.append(tensor.clone())
        else:
            tensor.copy_(self.result)
        return tensor


def test_blockwise_pieces_cast_as_the_whole_weight():
    """--fp8-param-gather under blockwise scaling: ranks whose pieces of a weight start and
    end anywhere in its 128 x 128 blocks (mid-row, mid-block, several blocks) reduce the
    amaxes of the blocks they touch and cast their pieces into exactly the bytes, and the
    block scales, of casting the whole fp32 weight at once (`reference.fp8_cast_blocks`)."""
    torch.manual_seed(1)
    shape = (300, 260)  # edge blocks cut short both ways
    magnitudes = 2.0 ** torch.randint(-6, 6, (3, 3)).float()
    weight = (
        torch.randn(shape)
        * magnitudes.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    )
    cuts = [0, 127 * 260 + 5, 129 * 260 + 200, 300 * 260]  # three ranks' pieces
    recipe = Fp8Recipe(fp8_format="e4m3", delayed=False, blockwise=True)
    group, ranks = _MaxOverRanks(), []
    for start, end in zip(cuts, cuts[1:]):
        param = torch.nn.Parameter(weight.clone())
        buffer = GradientBuffer(
            [param], ParallelContext().dp, flat_parameters=True, param_dtype=E4M3
        )
        fp8 = Fp8Parameters({param: Fp8Linear(recipe)}, buffer)
        fp8.shard_group = group
        fp8.set_shards([(param, start, end, weight.view(-1)[start:end].clone())])
        ranks.append((fp8, start, end))
    for fp8, _, _ in ranks:
        fp8.cast()  # recording
    group.result = torch.stack(group.seen).amax(0)
    gathered = torch.zeros(weight.numel(), dtype=E4M3)
    for fp8, start, end in ranks:
        fp8.cast()
        gathered[start:end] = fp8.buffer.param_buffer[start:end]
    expected, inverses = reference.fp8_cast_blocks(weight, E4M3, 448.0, 0, 128)
    assert torch.equal(gathered.view(shape).float(), expected.float())
    for fp8, _, _ in ranks:
        state = next(iter(fp8.states.values()))
        assert torch.equal(state.gathered_inverses, inverses)
