"""Packed documents as the chunked recurrences see them (kernels/ssd.py, the Mamba-2 scan;
kernels/gated_delta_rule.py, the gated delta rule): which tokens of a chunk may read which,
which tokens the state entering the chunk reaches, and which tokens make the state leaving it.

A chunk's state carries the document open at its start (the previous chunk's last token's);
documents are contiguous, so a token reads the entering state only if it is still in that
document, and the state leaving a chunk holds only the chunk's last document's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkDocuments:
    same: torch.Tensor  # [b, z, i, j]: tokens i and j of a chunk in one document
    carries: torch.Tensor  # [b, z, c]: the token is in the document open at the chunk's start
    last: torch.Tensor  # [b, z, c]: the token is in the chunk's last document


def chunk_documents(documents: torch.Tensor, pad: int, chunk_size: int) -> ChunkDocuments:
    """`documents` [b, s] ids, padded by `pad` tokens of the last document and cut into chunks
    of `chunk_size`."""
    b = documents.shape[0]
    documents = torch.cat([documents, documents[:, -1:].expand(b, pad)], dim=1)
    ids = documents.unflatten(1, (-1, chunk_size))  # [b, z, c]
    open_ = torch.cat([ids[:, :1, 0], ids[:, :-1, -1]], dim=1)  # [b, z]
    return ChunkDocuments(
        same=ids[:, :, :, None] == ids[:, :, None, :],
        carries=ids == open_[:, :, None],
        last=ids == ids[:, :, -1:],
    )


def continues(documents: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """[b, 1, 1, 1]: whether token t (> 0) is in token t - 1's document (a recurrence's
    state carries on), for a state [b, heads, ...]; None without documents or at t = 0."""
    if documents is None or t == 0:
        return None
    return (documents[:, t] == documents[:, t - 1])[:, None, None, None]
