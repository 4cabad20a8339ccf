"""Each attention head's largest score (--qk-clip, --log-max-attention-logit: config/qk_clip.py).

The kernels never show their scores, so they are computed again from the detached queries and
keys, a block of queries at a time: one more q . k product per layer, in fp32, only where the
flags ask for it. Over CP ranks each rank scores its queries against every rank's keys.
"""

from __future__ import annotations

import math

import torch

from threefold.parallel.context_parallel.sequence import Documents, local_positions, to_global_order
from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel.mappings import gather_from_sequence_parallel_region

_QUERY_ROWS = 256  # queries a block: [b, heads, 256, s] fp32 scores at a time


@torch.no_grad()
def max_scores(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """query [s, b, heads, d], key [s_k, b, groups, d], `attention_mask` None (causal) or
    [1 or b, 1, s, s_k] (bool: True where a query may attend; else added to the scores):
    each head's largest score q . k / sqrt(d) over the batch and the allowed keys, fp32
    [heads]."""
    s, _, heads, d = query.shape
    q = query.detach().permute(1, 2, 0, 3).float()
    k = key.detach().permute(1, 2, 3, 0).float()  # [b, groups, d, s_k]
    k = k.repeat_interleave(heads // key.shape[2], dim=1)
    best = torch.full((heads,), float("-inf"), device=query.device)
    for start in range(0, s, _QUERY_ROWS):
        scores = q[:, :, start : start + _QUERY_ROWS] @ k / math.sqrt(d)  # [b, h, rows, s_k]
        rows, keys = scores.shape[-2:]
        if attention_mask is None:
            allowed = torch.ones(rows, keys, dtype=torch.bool, device=q.device).tril(start)
            scores = scores.masked_fill(~allowed, float("-inf"))
        elif attention_mask.dtype == torch.bool:
            allowed = attention_mask[..., start : start + rows, :]
            scores = scores.masked_fill(~allowed, float("-inf"))
        else:
            scores = scores + attention_mask[..., start : start + rows, :]
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


@torch.no_grad()
def over_context_parallel(
    query: torch.Tensor, key: torch.Tensor, attention_mask: Documents | None, cp: Group
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `max_scores` takes for this CP rank's queries [2c, b, heads, d]: every rank's
    keys (one all-gather of the detached keys), in sequence order, and the mask of these
    queries over them: causal by position, or the documents' (window included)."""
    gathered = gather_from_sequence_parallel_region(key.detach(), cp)  # [CP x 2c, ...]
    keys = to_global_order(gathered.unflatten(0, (cp.size, -1)), cp.size)
    positions = local_positions(keys.shape[0], cp, query.device)
    if attention_mask is None:
        whole = torch.arange(keys.shape[0], device=query.device)
        return keys, (whole[None, :] <= positions[:, None])[None, None]
    return keys, attention_mask.whole_mask()[:, :, positions, :]
