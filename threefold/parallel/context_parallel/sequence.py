"""Which tokens a context-parallel rank holds, and its share of a micro-batch.

Causal attention costs more for later tokens (a token attends to everything before it), so a
contiguous split would leave the last rank with most of the work. Megatron's load balancing
cuts the sequence into 2 x CP equal chunks and gives rank r chunks r and 2CP-1-r: an early and
a late chunk, the same work on every rank. Rank r's local sequence is the two chunks one after
the other, so it is still in increasing position order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from threefold.parallel.context_parallel.masks import constant, derived
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


def shift_left(tensors: list[torch.Tensor], cp: Group) -> list[torch.Tensor]:
    """Each [b, s] tensor (this rank's tokens, local order) moved one position left in the
    whole sequence, 0 at its end (megatron-core's roll_tensor, multi-token prediction's
    shift). Each chunk's last place takes the next chunk's first element: chunk r + 1 is rank
    r + 1's first (for the last rank, its own second chunk), chunk 2CP - r is rank r - 1's
    second (none after rank 0's second, the sequence's last). One all-gather of every
    tensor's two first elements per rank, in float64 (token ids, positions and loss-mask
    values are exact in it)."""
    if cp.size == 1:
        return [torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1) for t in tensors]
    halves = [t.chunk(2, dim=1) for t in tensors]
    heads = torch.stack([torch.stack([a[:, 0], b[:, 0]]).double() for a, b in halves])
    everyone = heads.new_empty((cp.size * heads.shape[0], *heads.shape[1:]))
    dist.all_gather_into_tensor(everyone, heads, group=cp.group)
    everyone = everyone.view(cp.size, *heads.shape)  # [rank, tensor, chunk, b]
    shifted = []
    for index, (first, second) in enumerate(halves):
        if cp.rank + 1 < cp.size:
            after_first = everyone[cp.rank + 1, index, 0].to(first.dtype)
        else:
            after_first = second[:, 0]
        after_second = (
            everyone[cp.rank - 1, index, 1].to(first.dtype)
            if cp.rank > 0
            else torch.zeros_like(second[:, 0])
        )
        pieces = [first[:, 1:], after_first[:, None], second[:, 1:], after_second[:, None]]
        shifted.append(torch.cat(pieces, dim=1))
    return shifted


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> [b, 1, s, s]: True where a query may attend, its own document's
    tokens up to itself (packed documents, --reset-attention-mask)."""
    length = document_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal).unsqueeze(1)


def window_mask(
    length: int, window: int, attention_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """[1 or b, 1, s, s]: True where a query may attend, the `window` keys before it and
    itself (--window-size window,0), within the packed documents of `attention_mask`. The
    same tensor for every layer (masks.py): SDPA keeps one additive copy, not one a layer."""

    def band(offsets: torch.Tensor) -> torch.Tensor:
        back = offsets[:, None] - offsets[None, :]
        return (back >= 0) & (back <= window)

    return _positional(("window", window), band, length, attention_mask, device)


def chunk_mask(
    length: int, chunk: int, attention_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """[1 or b, 1, s, s]: True where a query may attend, the keys of its own chunk of `chunk`
    positions up to itself (--attention-chunk-size: transformers' Llama 4 chunked attention),
    within the packed documents of `attention_mask`; shared by the layers as `window_mask`."""

    def chunks(offsets: torch.Tensor) -> torch.Tensor:
        same = offsets[:, None] // chunk == offsets[None, :] // chunk
        return same & (offsets[:, None] >= offsets[None, :])

    return _positional(("chunk", chunk), chunks, length, attention_mask, device)


def _positional(
    what: tuple,
    rule: Callable[[torch.Tensor], torch.Tensor],
    length: int,
    attention_mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """The [1, 1, s, s] mask `rule` makes of the positions (one per shape), within the packed
    documents of `attention_mask` (one per mask object)."""

    def build() -> torch.Tensor:
        return rule(torch.arange(length, device=device))[None, None]

    mask = constant((*what, length, device), build)
    if attention_mask is None:
        return mask
    return derived(attention_mask, what, lambda: mask & attention_mask)


def _one_document(cp_size: int, query: torch.Tensor) -> torch.Tensor:
    """The ids [CP, b, 2c] of sequences of one document each, this rank's `query` [2c, b, ...]:
    one object for every layer, so that what is derived from it (`Documents.whole_mask`) is
    made once."""
    shape = (cp_size, query.shape[1], query.shape[0])
    return constant(
        ("one document", shape, query.device), lambda: torch.zeros(shape, device=query.device)
    )


@dataclass(frozen=True)
class Documents:
    """Per-document attention over a sequence split across CP ranks, as the core attention
    masks it a block at a time (no rank holds a [s, s] mask of the whole sequence): the
    document ids of every CP rank's local sequence, [CP, b, 2c]. Every rank reads the whole
    micro-batch before keeping its share, so each knows every rank's ids without a collective.
    `window`: a sliding window's keys back (--window-size), by position in the sequence."""

    ranks: torch.Tensor
    window: int | None = None

    @classmethod
    def of(cls, document_ids: torch.Tensor, cp_size: int, window: int | None = None) -> Documents:
        """The layout of `cp_size` ranks of a whole sequence's [b, s] ids."""
        return cls(to_rank_order(document_ids.t(), cp_size).permute(0, 2, 1), window)

    @classmethod
    def windowed(
        cls, mask: Documents | None, window: int, cp_size: int, query: torch.Tensor
    ) -> Documents:
        """`mask` (None: one document, the whole sequence) with a sliding window; `query`
        [2c, b, ...] this rank's."""
        if mask is None:
            return cls(_one_document(cp_size, query), window)
        return cls(mask.ranks, window)

    @classmethod
    def chunked(
        cls, mask: Documents | None, chunk: int, cp_size: int, query: torch.Tensor
    ) -> Documents:
        """`mask` (None: one document, the whole sequence) within chunks of `chunk` positions
        (--attention-chunk-size): an id per document and chunk; `query` [2c, b, ...] this
        rank's."""
        if mask is None:
            mask = cls(_one_document(cp_size, query))

        def build() -> torch.Tensor:
            positions = torch.stack([mask._positions(rank) for rank in range(cp_size)])
            chunks_per_sequence = cp_size * positions.shape[-1] // chunk + 1
            return mask.ranks * chunks_per_sequence + (positions // chunk)[:, None, :]

        # (one object for every layer, as `_one_document`'s)
        return cls(derived(mask.ranks, ("chunked", chunk), build))

    def whole(self) -> torch.Tensor:
        """The [b, s] ids of the whole sequence, in position order."""
        return to_global_order(self.ranks.permute(0, 2, 1), self.ranks.shape[0]).t()

    def whole_mask(self) -> torch.Tensor:
        """[b, 1, s, s]: the whole sequence's mask (Ulysses, after its all-to-all); the same
        tensor for every layer with these ids and window (masks.py)."""

        def build() -> torch.Tensor:
            mask = document_mask(self.whole())
            if self.window is None:
                return mask
            return window_mask(mask.shape[-1], self.window, mask, mask.device)

        return derived(self.ranks, ("whole", self.window), build)

    def _positions(self, rank: int) -> torch.Tensor:
        cp_size, chunk = self.ranks.shape[0], self.ranks.shape[-1] // 2
        return torch.cat(
            [
                torch.arange(i * chunk, (i + 1) * chunk, device=self.ranks.device)
                for i in chunk_ids(cp_size, rank)
            ]
        )

    def allowed(self, rank: int, source: int, plan: tuple[slice, slice, bool]) -> torch.Tensor:
        """[b, 1, rows, keys]: which of `source`'s keys the rows of `rank`'s queries may
        attend to, for a block (rows, keys, causal) of the attention's plan."""
        rows, keys, causal = plan
        queries, others = self.ranks[rank][:, rows], self.ranks[source][:, keys]
        same = queries[:, :, None] == others[:, None, :]
        if causal:  # (a chunk over itself: square)
            same &= torch.ones(same.shape[1:], dtype=torch.bool, device=same.device).tril()
        if self.window is not None:  # (the plan's keys never lie after its queries)
            back = self._positions(rank)[rows][:, None] - self._positions(source)[keys][None]
            same &= back <= self.window
        return same.unsqueeze(1)


def split_batch(batch: dict, cp: Group) -> dict:
    """This CP rank's share of a micro-batch: its two chunks of the tokens, labels, loss mask
    and positions. Positions are made explicit (0..s-1 cut the same way) so RoPE and learned
    position embeddings see each token's true place in the sequence. Packed documents'
    `document_ids` become the attention's mask: [b, 1, s, s] on one rank, `Documents` over
    CP ranks."""
    batch = dict(batch)
    documents = batch.pop("document_ids", None)
    if cp.size == 1:
        if documents is not None:
            batch["attention_mask"] = document_mask(documents)
        return batch
    tokens = batch["tokens"]
    if "position_ids" not in batch:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        batch["position_ids"] = positions.expand_as(tokens)
    index = local_positions(tokens.shape[1], cp, tokens.device)
    for name in _SEQUENCE_ENTRIES:
        batch[name] = batch[name].index_select(1, index)
    if documents is not None:
        batch["attention_mask"] = Documents.of(documents, cp.size)
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
