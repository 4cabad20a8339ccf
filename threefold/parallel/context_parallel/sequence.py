"""Which tokens a context-parallel rank holds, and its share of a micro-batch.

Causal attention costs more for later tokens (a token attends to everything before it), so a
contiguous split would leave the last rank with most of the work. Megatron's load balancing
cuts the sequence into 2 x CP equal chunks and gives rank r chunks r and 2CP-1-r: an early and
a late chunk, the same work on every rank. Rank r's local sequence is the two chunks one after
the other, so it is still in increasing position order.
"""

from __future__ import annotations

import torch

from threefold.parallel.parallel_context import Group

# The batch entries laid out [micro-batch, sequence] that every rank cuts the same way.
_SEQUENCE_ENTRIES = ("tokens", "labels", "loss_mask", "position_ids")


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x CP) that rank `cp_rank` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_length: int, cp: Group, device: torch.device | None = None) -> torch.Tensor:
    """The positions in the whole sequence of this rank's tokens, in local order."""
    chunk = seq_length // (2 * cp.size)
    return torch.cat(
        [
            torch.arange(i * chunk, (i + 1) * chunk, device=device)
            for i in chunk_ids(cp.size, cp.rank)
        ]
    )


def split_batch(batch: dict, cp: Group) -> dict:
    """This CP rank's share of a micro-batch: its two chunks of the tokens, labels, loss mask
    and positions. Positions are made explicit (0..s-1 cut the same way) so RoPE and learned
    position embeddings see each token's true place in the sequence."""
    if cp.size == 1:
        return batch
    if "attention_mask" in batch:
        raise ValueError(
            "per-document attention masks (--reset-attention-mask, packed fine-tuning "
            "sequences) are not implemented with --context-parallel-size > 1"
        )
    tokens = batch["tokens"]
    batch = dict(batch)
    if "position_ids" not in batch:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        batch["position_ids"] = positions.expand_as(tokens)
    index = local_positions(tokens.shape[1], cp, tokens.device)
    for name in _SEQUENCE_ENTRIES:
        batch[name] = batch[name].index_select(1, index)
    return batch


def to_global_order(local_blocks: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[CP, 2c, ...] rank-major local sequences (rank j: chunks j and 2CP-1-j) -> the whole
    sequence [2 x CP x c, ...] in position order."""
    chunks = local_blocks.unflatten(1, (2, -1))  # [CP, 2, c, ...]
    order = [None] * (2 * cp_size)
    for rank in range(cp_size):
        first, second = chunk_ids(cp_size, rank)
        order[first], order[second] = chunks[rank, 0], chunks[rank, 1]
    return torch.cat(order)


def to_rank_order(sequence: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The inverse of `to_global_order`: [2 x CP x c, ...] -> [CP, 2c, ...]."""
    chunks = sequence.unflatten(0, (2 * cp_size, -1))
    return torch.stack(
        [torch.cat([chunks[i] for i in chunk_ids(cp_size, rank)]) for rank in range(cp_size)]
    )
