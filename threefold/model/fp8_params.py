"""--fp8-param-gather: the FP8 layers' weights kept for compute in FP8, all-gathered as FP8 bytes.

(Under the distributed optimizer, here; under FSDP2, model/fp8_fsdp_params.py, whose per-step
cast of the shards is this module's `Fp8ShardCasts`.)

Without it, the distributed optimizer all-gathers each updated weight in the run's precision
(2 bytes an element in bf16) and each step's first forward casts the weight to FP8 again
(`Fp8Scaling.weights_cached`). With it, as Megatron-LM does with Transformer Engine's FP8
parameters, the optimizer casts its fp32 shard of each weight to FP8 once per step and the
all-gather moves one byte an element; the GEMMs read the gathered FP8 copy
(`Fp8Linear.weight_in_fp8`).

The weights live in a GradientBuffer of their own whose flat parameters are FP8: their
gradients are reduced like every other's, their copies gathered per bucket (and, with
--overlap-param-gather, waited for in the forward of the module that reads them).

The scale: every rank must cast with the same one, and no rank holds the whole weight (the
distributed optimizer's shards split it over DP x CP, tensor parallelism over TP). So each
rank's amax of its shards is reduced (max) over the buffer's group and the layer's TP x CP group
first, in one message for all weights: tensorwise scaling casts with the scale from that amax,
delayed scaling with its history's scale, recording the amax as the step's weight amax.
Blockwise scaling reduces the amaxes of each weight's 128 x 128 blocks over the buffer's group
instead (a rank's piece starts and ends anywhere in a block), and casts with a scale per block
(`Fp8ShardCasts._cast_blocks`). The casts start from the fp32 masters, not from a bf16 rounding
of them (Megatron's "no intermediate dtype").

The parameter keeps no copy in the run's dtype: once the optimizer has its fp32 masters, the
parameter's storage *is* its FP8 copy in the buffer (`param.dtype` is E4M3), 1 byte per weight
where a bf16 run holds 2, as Megatron-LM's FP8 parameters. Its gradient goes straight into
`main_grad` (there is no bf16 tensor to hold one: the FP8 GEMM's fp32 weight gradient is added
there, whatever --gradient-accumulation-fusion says). Readers of the values in the run's dtype
(checkpoint saves and loads, the tests) ask for them with `in_model_dtype()`, which dequantizes
the weights for as long as it is open: the very values the GEMMs use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from math import inf

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from threefold.kernels import reference
from threefold.kernels.fp8 import WEIGHT, Fp8Linear
from threefold.kernels.fp8_gemms import FP8_MAX
from threefold.kernels.reference import FP8_BLOCK, scale_from_amax
from threefold.parallel.data_parallel.gradient_buffer import GradientBuffer
from threefold.parallel.parallel_context import Group

# (the weight, the start and end of the master's piece in the flattened weight, the master)
Shard = tuple[nn.Parameter, int, int, torch.Tensor]
# (the weight's index, the start and end of the piece, the master, its place in FP8)
Piece = tuple[int, int, int, torch.Tensor, torch.Tensor]


class Fp8ShardCasts:
    """The per-step cast of this rank's fp32 pieces of FP8 layers' weights into their FP8
    copies, with the scales of the whole weights (module doc): what the distributed
    optimizer's `Fp8Parameters` and FSDP2's `Fp8FsdpParameters` (model/fp8_fsdp_params.py)
    share. `shard_group`: the ranks holding the other pieces of a weight."""

    def __init__(
        self, states: list[Fp8Linear], shapes: list[torch.Size], shard_group: Group
    ) -> None:
        # one recipe per run: one FP8 format for every weight
        self.recipe = states[0].recipe
        self._dtype = self.recipe.dtypes[WEIGHT]
        self._states, self._shapes = states, shapes
        for state, shape in zip(states, shapes):
            state.param_gather = True
            if self.recipe.blockwise:  # one scale per 128 x 128 block
                blocks = [-(-size // FP8_BLOCK) for size in shape]
                state.gathered_inverses = torch.ones(blocks, device=state.gathered_scale.device)
        self.shard_group = shard_group
        # the TP x CP group every layer reduces its amaxes over
        self.amax_group = states[0].amax_group

    def set_pieces(self, pieces: list[Piece]) -> None:
        """This rank's fp32 pieces of the weights (the masters) and the FP8 places they are
        cast into by `cast`: one piece per weight at most."""
        owners = [owner for owner, *_ in pieces]
        if len(set(owners)) != len(owners):
            raise ValueError("Fp8ShardCasts.set_pieces: a weight with two pieces on one rank")
        self._owner_list = owners
        self._masters = [master for *_, master, _ in pieces]
        self._targets = [target for *_, target in pieces]
        device = self._states[0].gathered_scale.device
        self._owners = torch.tensor(owners, dtype=torch.long, device=device)
        if self.recipe.blockwise:  # the pieces' rows and their blocks, fixed for the run
            self._segments = [
                _piece_segments(master, target, start, end, self._shapes[owner][1])
                for owner, start, end, master, target in pieces
            ]

    @torch.no_grad()
    def cast(self) -> None:
        """The FP8 copies from this rank's fp32 pieces of the weights, after an optimizer
        step (an all-gather then brings them to every rank)."""
        if self.recipe.blockwise:
            self._cast_blocks()
        else:
            self._cast_tensors()

    def _cast_tensors(self) -> None:
        """One scale per weight (tensorwise, delayed): the scales agreed over every rank
        holding a piece, then the pieces cast into FP8. In batches over the pieces: the
        amaxes in one multi-tensor norm, the scales of all weights at once
        (`set_gathered_scales`), the casts' multiply and clamp as multi-tensor ops; each piece
        then takes one copy into FP8 (per piece: some twenty launches before)."""
        device = self._owners.device
        amax = torch.zeros(len(self._states), device=device)
        masters = self._masters
        if masters:  # max |x| of each piece, exactly (a maximum does not round)
            amax[self._owners] = torch.stack(torch._foreach_norm(masters, ord=inf)).to(device)
        self.shard_group.all_reduce(amax, op=dist.ReduceOp.MAX)
        self.amax_group.all_reduce(amax, op=dist.ReduceOp.MAX)
        scales = set_gathered_scales(self._states, amax)
        if not masters:
            return
        # (`reference.fp8_cast`'s arithmetic: the same bytes)
        per_piece = scales[self._owners].to(masters[0].device)
        scaled = torch._foreach_mul(masters, list(per_piece.unbind(0)))
        limit = FP8_MAX[self._dtype]
        torch._foreach_clamp_min_(scaled, -limit)
        torch._foreach_clamp_max_(scaled, limit)
        for target, piece in zip(self._targets, scaled):
            target.copy_(piece)  # (not multi-tensor: CUDA's takes no FP8 destination)

    def _cast_blocks(self) -> None:
        """Blockwise: one power-of-two scale per 128 x 128 block of each weight, as a forward
        casting the whole fp32 weight would (`reference.fp8_cast_blocks`), though a rank's
        piece of the flattened weight starts and ends anywhere in a block. Each rank takes
        the amaxes of the blocks its pieces touch, every weight's blocks are reduced (max)
        over the shard group in one message, and each rank casts its pieces with their
        blocks' scales (Transformer Engine casts its blockwise FP8 parameters so). No
        reduction over TP x CP: a tensor-parallel rank's blocks are those of its own shard,
        as without the flag."""
        states = self._states
        amaxes = [torch.zeros_like(state.gathered_inverses) for state in states]
        for segments, owner in zip(self._segments, self._owner_list):
            for values, _, row, col, _ in segments:
                (r, c), block_amax = _block_amaxes(values, row, col)
                tile = amaxes[owner][r : r + block_amax.shape[0], c : c + block_amax.shape[1]]
                torch.maximum(tile, block_amax.to(tile.device), out=tile)
        flat = torch.cat([amax.view(-1) for amax in amaxes])
        self.shard_group.all_reduce(flat, op=dist.ReduceOp.MAX)
        limit, margin = FP8_MAX[self._dtype], self.recipe.margin
        scales = reference.rowwise_scale(flat, limit, margin).split([a.numel() for a in amaxes])
        for state, scale, amax in zip(states, scales, amaxes):
            state.gathered_inverses.copy_(scale.view(amax.shape).reciprocal())
        for segments, owner, master in zip(self._segments, self._owner_list, self._masters):
            scale = scales[owner].view(amaxes[owner].shape).to(master.device)
            for values, target, _, _, blocks in segments:
                cast = reference.fp8_cast(values, scale[blocks], self._dtype, limit)
                target.copy_(cast.view(-1))


class Fp8Parameters(Fp8ShardCasts):
    """The FP8 compute copies of the weights of `states` (weight -> its layer's FP8 state),
    held in `buffer`'s flat parameters, cast from the distributed optimizer's shards."""

    def __init__(self, states: dict[nn.Parameter, Fp8Linear], buffer: GradientBuffer) -> None:
        super().__init__(list(states.values()), [param.shape for param in states], buffer.dp)
        self.states, self.buffer = states, buffer
        self._index = {param: i for i, param in enumerate(states)}
        for param, state in states.items():
            start, end = buffer.ranges[param]
            state.gathered = (param, buffer.param_buffer[start:end].view(param.shape))
        # The run's dtype, which `in_model_dtype` dequantizes into.
        self.model_dtype = next(iter(states)).dtype

    def store_in_fp8(self) -> None:
        """Each parameter's storage becomes its FP8 copy, dropping the one in the run's dtype
        (after the optimizer has taken its masters from it)."""
        for param, state in self.states.items():
            param.data = state.gathered[1]

    @contextmanager
    def in_model_dtype(self) -> Iterator[None]:
        """The parameters in the run's dtype while open, the dequantized FP8 copies (what a
        checkpoint saves; what it loads, into the masters, with the optimizer's
        `copy_model_to_masters`); FP8 again after. Holds 2 bytes per weight while open."""
        self.buffer.finish_param_gather()
        with torch.no_grad():
            for param, state in self.states.items():
                param.data = dequantized(state).to(self.model_dtype)
        try:
            yield
        finally:
            self.store_in_fp8()

    def set_shards(self, shards: list[Shard]) -> None:
        """This rank's fp32 pieces of the weights (the distributed optimizer's masters), cast
        into their places in the FP8 buffer: one piece per weight at most (a bucket holds
        whole parameters, and a rank one shard of it)."""
        flat, ranges = self.buffer.param_buffer, self.buffer.ranges
        self.set_pieces(
            [
                (
                    self._index[param],
                    start,
                    end,
                    master,
                    flat[ranges[param][0] + start : ranges[param][0] + end],
                )
                for param, start, end, master in shards
            ]
        )

    def padding_bytes(self) -> int:
        """The buffer's bytes beyond its weights' (the padding to equal shards): the FP8 copies
        themselves are the parameters' storage."""
        flat = self.buffer.param_buffer
        return (flat.numel() - sum(param.numel() for param in self.states)) * flat.element_size()


def dequantized(state: Fp8Linear) -> torch.Tensor:
    """A gathered FP8 weight in fp32: its values times the inverse of its scale, or of each
    block's (exact either way: an FP8 value times a power of two, or over one scale)."""
    weight8 = state.gathered[1]
    if state.gathered_inverses is not None:
        return reference.dequantize_blocks(weight8, state.gathered_inverses, FP8_BLOCK)
    return weight8.float() / state.gathered_scale


def _row_segments(start: int, end: int, cols: int) -> list[tuple[int, int, int, int, int]]:
    """The piece [start, end) of a row-major weight with `cols` columns as runs of whole rows
    and partial rows (three at most): (offset in the piece, first row, rows, first column,
    columns)."""
    segments, offset = [], 0
    while start < end:
        row, col = divmod(start, cols)
        if col == 0 and end - start >= cols:
            rows, width = (end - start) // cols, cols
        else:
            rows, width = 1, min(cols - col, end - start)
        segments.append((offset, row, rows, col, width))
        offset, start = offset + rows * width, start + rows * width
    return segments


def _piece_segments(
    master: torch.Tensor, target: torch.Tensor, start: int, end: int, cols: int
) -> list[tuple]:
    """A piece's `_row_segments` as the blockwise cast reads them: (the master's values
    [rows, columns], their place in the FP8 buffer, the first row and column, the block of
    each value as an index into the weight's block scales)."""
    segments = []
    for offset, row, rows, col, width in _row_segments(start, end, cols):
        rows_index = torch.arange(row, row + rows, device=master.device) // FP8_BLOCK
        cols_index = torch.arange(col, col + width, device=master.device) // FP8_BLOCK
        values = master[offset : offset + rows * width].view(rows, width)
        place = target[offset : offset + rows * width]
        segments.append((values, place, row, col, (rows_index[:, None], cols_index)))
    return segments


def _block_amaxes(values: torch.Tensor, row: int, col: int) -> tuple[tuple[int, int], torch.Tensor]:
    """max |x| over each 128 x 128 block of the weight that `values` ([rows, columns] of it,
    from `row`, `col`) touches: the first block's (row, column) and the amaxes, exact (a
    maximum does not round; the padding is zeros)."""
    rows, width = values.shape
    lead_rows, lead_cols = row % FP8_BLOCK, col % FP8_BLOCK
    pad = (lead_cols, -(lead_cols + width) % FP8_BLOCK)
    if any(pad):
        values = F.pad(values, pad)
    col_blocks = values.shape[1] // FP8_BLOCK
    per_row = torch.linalg.vector_norm(
        values.view(rows, col_blocks, FP8_BLOCK), ord=inf, dim=-1
    )  # [rows, column blocks], then the rows folded into their blocks
    per_row = F.pad(per_row, (0, 0, lead_rows, -(lead_rows + rows) % FP8_BLOCK))
    amax = per_row.view(-1, FP8_BLOCK, col_blocks).amax(dim=1)
    return (row // FP8_BLOCK, col // FP8_BLOCK), amax


def set_gathered_scales(states: list[Fp8Linear], amax: torch.Tensor) -> torch.Tensor:
    """--fp8-param-gather, after an optimizer step: from the amaxes ([layers]) of the whole
    updated weights of `states` (reduced over the ranks holding their pieces), the scale each
    weight is cast with, set as its `gathered_scale` and returned ([layers]). Delayed scaling
    records the amax as the step's weight amax, as a forward casting the weight would, and
    casts with its history's scale once it has one. One batch for every layer, as
    `push_amaxes`: each layer alone took a dozen launches."""
    recipe = states[0].recipe
    if recipe.delayed:
        torch._foreach_copy_([state.step_amax[WEIGHT] for state in states], list(amax.unbind(0)))
    from_history = [recipe.delayed and state.has_history for state in states]
    current = None
    if not all(from_history):
        fp8_max = states[0].fp8_max[WEIGHT]
        current = scale_from_amax(amax, fp8_max, recipe.margin, torch.ones_like(amax))
    if not any(from_history):
        scales = current
    else:
        scales = torch.stack(
            [
                state.scale_in_use[WEIGHT] if history else current[i]
                for i, (state, history) in enumerate(zip(states, from_history))
            ]
        )
    torch._foreach_copy_([state.gathered_scale for state in states], list(scales.unbind(0)))
    return scales
