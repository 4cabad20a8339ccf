"""Attention of a block of queries over a block of keys, returning the log-sum-exp of its
scores, and the backward of such a block given the *whole* row's output and log-sum-exp.

Context-parallel attention sees a query's keys in pieces (blocks that arrive around the ring,
or slices of the gathered sequence). Each piece gives a partial output o_i and the log-sum-exp
l_i of its scores; `merge` combines them exactly: l = log(sum exp l_i), o = sum exp(l_i - l) o_i.
In backward the softmax of a piece is exp(s - l) with the final l, and the output-gradient
term uses the final o, so each piece's gradients come from the block kernel's own backward
given (o, l) instead of its partial ones: FlashAttention's recomputation, one block at a time.

Attention dropout: the mask multiplies the *globally* normalized probabilities, and
exp(l_i - l) p_i = p for a block's rows, so dropping a block's own probabilities and merging
as above is exact. Each block draws its mask from a generator seeded with its own seed, so
backward regenerates the same mask; the output-gradient term is then rowsum(dO * O) with the
final, dropped O, as in FlashAttention's backward.

Queries are [batch, heads, sequence, head_dim], keys and values [batch, groups, sequence,
head_dim] (query head i reads group i // (heads / groups): the flash kernels take the groups
as they are, the eager ones expand them); `causal` blocks are square (a chunk over itself).
`allowed` [batch, 1, rows, keys] (True: may attend) masks a block further: packed documents,
each attending only within itself. A row may then have no key at all in a block: its
log-sum-exp is -inf and its output 0, which the merge weighs 0 (every row has a key in the
block of its own chunk: itself).

Soft-capped scores (Gemma 2's --attn-logit-softcapping): each block's scores are capped,
cap * tanh(score / cap), before the softmax, which is then the softmax of the capped scores;
merging is unchanged. Backward differentiates through the cap, 1 - (capped / cap)^2, from the
capped scores it recomputes. `Scoring` carries the scale and the cap.

Without dropout, mask or cap the block kernel is PyTorch's
flash-attention kernel, the op behind SDPA, which also returns the log-sum-exp: on the CPU, and
on CUDA for 16-bit inputs (FlashAttention-2's). Otherwise the eager `math` functions below
(which materialize one block's scores at a time, a large block's in slices of its query rows:
`SCORES_AT_ONCE`), also the tests' reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)
_CUDA_FLASH = torch.ops.aten._scaled_dot_product_flash_attention
_CUDA_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward


@dataclass(frozen=True)
class Dropout:
    """Attention dropout of a block: probability `p`, mask drawn from `seed`."""

    p: float
    seed: int

    def kept(self, probs: torch.Tensor) -> torch.Tensor:
        """probs with the block's mask applied, scaled by 1 / (1 - p)."""
        generator = torch.Generator(probs.device).manual_seed(self.seed)
        keep = torch.rand(probs.shape, generator=generator, device=probs.device) >= self.p
        return probs * keep / (1.0 - self.p)


@dataclass(frozen=True)
class Scoring:
    """How a block's scores are made: q k^T times `scale`, then with `softcap` capped softly,
    softcap * tanh(score / softcap)."""

    scale: float
    softcap: float | None = None

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(q)
        scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-2, -1)) * self.scale
        if self.softcap is None:
            return scores
        return torch.tanh(scores / self.softcap) * self.softcap

    def backward(self, grad: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The gradient of q k^T from that of the `scores` (as `scores` made them, unmasked:
        a masked score's gradient is 0 and its factor must stay finite)."""
        if self.softcap is not None:
            grad = grad * (1.0 - (scores / self.softcap) ** 2)
        return grad * self.scale


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32, or wider for wider inputs (the tests' float64)."""
    return torch.promote_types(q.dtype, torch.float32)


# The eager kernel materializes the scores of at most this many (batch, head, query, key)
# entries at a time (256 MiB in fp32): a larger block takes its queries in slices of rows.
SCORES_AT_ONCE = 2**26


def _row_slices(q: torch.Tensor, keys: int, dropout: Dropout | None) -> list[slice]:
    """The slices of q's rows the eager kernel takes at a time; all rows at once under
    dropout, whose mask is drawn for the whole block."""
    rows, per_row = q.shape[2], q.shape[0] * q.shape[1] * keys
    step = rows if dropout is not None else max(1, SCORES_AT_ONCE // per_row)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _masked(
    scores: torch.Tensor, causal: bool, allowed: torch.Tensor | None, rows: slice
) -> torch.Tensor:
    """`scores` of the block's rows `rows` with the future (of a square, causal block) and
    what `allowed` forbids at -inf."""
    if causal:
        scores = scores.masked_fill(_future(scores, rows.start), float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed[..., rows, :], float("-inf"))
    return scores


def math_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scoring: Scoring,
    dropout: Dropout | None = None,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = (expand_groups(t, q.shape[1] // k.shape[1]) for t in (k, v))
    outs, lses = [], []
    for rows in _row_slices(q, k.shape[2], dropout):
        scores = _masked(scoring.scores(q[:, :, rows], k), causal, allowed, rows)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(lse)[..., None])  # (a row without keys: all 0)
        if dropout is not None:
            probs = dropout.kept(probs)
        outs.append(torch.matmul(probs, v.to(probs.dtype)).to(q.dtype))
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def math_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scoring: Scoring,
    dropout: Dropout | None = None,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads_per_group = q.shape[1] // k.shape[1]
    k, v = (expand_groups(t, heads_per_group) for t in (k, v))
    dtype = compute_dtype(q)
    qf, kf, vf, grad = q.to(dtype), k.to(dtype), v.to(dtype), grad_out.to(dtype)
    grad_q = torch.empty(q.shape, dtype=dtype, device=q.device)
    grad_k = grad_v = None  # (summed over the slices; one slice, as most blocks: no sum)
    for rows in _row_slices(q, k.shape[2], dropout):
        scores = scoring.scores(q[:, :, rows], k)
        masked = _masked(scores, causal, allowed, rows)
        probs = torch.exp(masked - _finite(lse[:, :, rows])[..., None])
        kept = probs if dropout is None else dropout.kept(probs)
        grad_rows = grad[:, :, rows]
        grad_v = _summed(grad_v, torch.matmul(kept.transpose(-2, -1), grad_rows))
        grad_probs = torch.matmul(grad_rows, vf.transpose(-2, -1))
        if dropout is not None:  # through the mask: the same keep / (1 - p) factor
            grad_probs = dropout.kept(grad_probs)
        row_dot = (grad_rows * out[:, :, rows].to(dtype)).sum(-1, keepdim=True)
        grad_scores = scoring.backward(probs * (grad_probs - row_dot), scores)
        grad_q[:, :, rows] = torch.matmul(grad_scores, kf)
        grad_k = _summed(grad_k, torch.matmul(grad_scores.transpose(-2, -1), qf[:, :, rows]))
    grad_k, grad_v = (sum_groups(g, heads_per_group) for g in (grad_k, grad_v))
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _summed(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total.add_(part)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _future(scores: torch.Tensor, first_row: int) -> torch.Tensor:
    """The keys after each row's query, for rows from `first_row` of a square block."""
    rows, columns = scores.shape[-2:]
    ones = torch.ones(rows, columns, dtype=torch.bool, device=scores.device)
    return ones.triu(1 + first_row)


def block_kernel(
    q: torch.Tensor, dropout: Dropout | None, allowed: torch.Tensor | None, capped: bool = False
) -> str:
    """Which kernel attends a block of these queries: "cpu flash", "cuda flash" or "math"
    (`capped`: the scores soft-capped, which no flash kernel of PyTorch's does)."""
    if dropout is not None or allowed is not None or capped:
        return "math"
    if q.device.type == "cpu" and q.dtype != torch.float64 and _CPU_FLASH is not None:
        return "cpu flash"
    if q.device.type == "cuda" and _cuda_flash_runs(q):
        return "cuda flash"
    return "math"


def _cuda_flash_runs(q: torch.Tensor) -> bool:
    """FlashAttention-2's limits: 16-bit inputs, head sizes that are multiples of 8 up to 256,
    Ampere or newer. fp32 blocks stay eager, and so do blocks under --deterministic-mode, which
    keeps flash's backward out of SDPA too (kernels/determinism.py)."""
    head_dim = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and not torch.are_deterministic_algorithms_enabled()
        and head_dim % 8 == 0
        and head_dim <= 256
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    )


def _cuda_flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = _CUDA_FLASH(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _cuda_flash_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The kernel reads the log-sum-exp through a bare pointer as [b, heads, rows]: a block's
    # rows of the merged one are a strided view. The random state only matters with
    # dropout, which stays eager.
    unused = torch.empty((), dtype=torch.int64)
    rows, keys = q.shape[2], k.shape[2]
    lse = lse.contiguous()
    args = (grad_out, q, k, v, out, lse, None, None, rows, keys, 0.0, causal, unused, unused)
    return _CUDA_FLASH_BACKWARD(*args, scale=scale)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scoring: Scoring,
    dropout: Dropout | None = None,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp in fp32 or wider) of q's attention over k and v."""
    kernel = block_kernel(q, dropout, allowed, scoring.softcap is not None)
    if kernel == "cpu flash":
        out, lse = _CPU_FLASH(q, k, v, 0.0, causal, scale=scoring.scale)
        return out, lse.float()
    if kernel == "cuda flash":
        return _cuda_flash_forward(q, k, v, causal, scoring.scale)
    return math_forward(q, k, v, causal, scoring, dropout, allowed)


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scoring: Scoring,
    dropout: Dropout | None = None,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v for this block, given the rows' final output and log-sum-exp."""
    kernel = block_kernel(q, dropout, allowed, scoring.softcap is not None)
    scale = scoring.scale
    if kernel == "cpu flash":
        return _CPU_FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    if kernel == "cuda flash":
        return _cuda_flash_backward(grad_out, q, k, v, out, lse, causal, scale)
    return math_backward(grad_out, q, k, v, out, lse, causal, scoring, dropout, allowed)


class Accumulator:
    """The output and log-sum-exp of every query row so far, merged block by block in fp32
    (or wider)."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        if self.out is None:  # the first block covers every row (a chunk over itself)
            self.out, self.lse = out.to(compute_dtype(out)), lse
            return
        old = self.lse[:, :, rows]
        merged = torch.logaddexp(old, lse)
        self.out[:, :, rows] = (
            self.out[:, :, rows] * torch.exp(old - merged)[..., None]
            + out.to(self.out.dtype) * torch.exp(lse - merged)[..., None]
        )
        self.lse[:, :, rows] = merged


def expand_groups(kv: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """[b, groups, s, d] -> [b, heads, s, d]: query head i reads group i // heads_per_group."""
    return kv if heads_per_group == 1 else kv.repeat_interleave(heads_per_group, dim=1)


def sum_groups(grad: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """The gradient of `expand_groups`: the heads of each group summed."""
    if heads_per_group == 1:
        return grad
    b, heads, s, d = grad.shape
    return grad.view(b, heads // heads_per_group, heads_per_group, s, d).sum(2)


def add_sinks(result: Accumulator, sinks: torch.Tensor | None) -> None:
    """Every row's sink logit (per head; attention sinks, --softmax-type) merged as one more
    block: no value, only weight."""
    if sinks is not None:
        lse = sinks.to(result.lse.dtype).view(1, -1, 1).expand_as(result.lse)
        result.add(slice(None), torch.zeros_like(result.out), lse)


def sinks_gradient(
    grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor | None:
    """d loss / d sinks [heads]: a sink's probability exp(sink - lse) times its value's
    (zero) score gradient minus rowsum(dO * O), summed over the rows and the batch."""
    if sinks is None or not sinks.requires_grad:
        return None
    dtype = lse.dtype
    row_dot = (grad_out.to(dtype) * out.to(dtype)).sum(-1)  # [b, heads, rows]
    probability = torch.exp(sinks.to(dtype).view(1, -1, 1) - lse)
    return -(probability * row_dot).sum(dim=(0, 2)).to(sinks.dtype)
