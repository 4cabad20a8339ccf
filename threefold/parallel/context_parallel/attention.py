"""Core attention over a sequence split across context-parallel ranks, by Megatron's
--cp-comm-type:

  p2p        ring attention: each rank's keys/values travel around the CP ring; while one
             block's attention is computed the next block is already in flight (asynchronous
             send/receive). Backward sends the blocks around again, with their gradient
             accumulators following them home.
  allgather  all keys/values gathered once (Llama 3's choice: simple, cheap with GQA's few
             key/value heads); the same blocks as the ring, computed from memory.
  a2a        Ulysses: all-to-all from sequence-sharded to head-sharded, ordinary attention
             over the whole sequence for 1/CP of the heads, all-to-all back.
  a2a+p2p    both (--hierarchical-context-parallel-sizes A P): Ulysses within groups of A
             consecutive CP ranks, ring attention across the P groups for 1/A of the heads.

Packed documents (--reset-attention-mask, --sft, --sft-packing) reach the core attention as
`Documents` (sequence.py): the ring and all-gather mask each block by its queries' and keys'
document ids (the eager block kernel then, on a CPU too), Ulysses builds the whole
sequence's mask after its all-to-all, and a2a+p2p lays the ids out for its ring.

Attention sinks (--softmax-type: one more logit per head beside every row's scores, GPT-OSS's)
take `sinks` [heads]: the ring and all-gather merge each row's sink as a last block whose
output is 0 and whose log-sum-exp is the sink (its gradient, per head, -sum over rows of
exp(sink - lse) rowsum(dO * O)); Ulysses hands its local attention its share of the heads'.
Soft-capped scores (--attn-logit-softcapping, Gemma 2's) take `softcap`: the ring's and the
all-gather's blocks cap their own scores (block_attention.py's `Scoring`); Ulysses's local
attention must cap alike.

Ranks hold chunks r and 2CP-1-r of 2 x CP (sequence.py). Against the block of rank j, rank r's
queries need: j == r, causal attention over its own two chunks (in order, so an ordinary causal
mask is exact); j < r, both of its chunks over j's first chunk only (j's second chunk lies in
the future of both); j > r, its second chunk over both of j's chunks (its first chunk precedes
both). Every step costs every rank the same: the load balance of the chunk layout.

All three take and return the layouts of `threefold.kernels.reference.attention`: query
[s, b, heads, d], key/value [s, b, groups, d] -> context [s, b, heads * d], s the local
sequence. Communication is counted in `COLLECTIVE_COUNTS` (as the TP collectives are); when
`TRACE` is a list, the ring appends (event, step, time) to it so a test can see its sends in
flight while a block computes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from threefold.parallel.context_parallel.block_attention import (
    Accumulator,
    Dropout,
    Scoring,
    add_sinks,
    block_backward,
    block_forward,
    compute_dtype,
    sinks_gradient,
)
from threefold.parallel.context_parallel.sequence import Documents, to_global_order, to_rank_order
from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    record_collective,
)

TRACE: list | None = None


def _trace(event: str, step: int) -> None:
    if TRACE is not None:
        TRACE.append((event, step, time.perf_counter()))


def _step_plan(source: int, rank: int, half: int) -> tuple[slice, slice, bool]:
    """(this rank's query rows, the rows of `source`'s keys they attend to, causal?)."""
    everything = slice(None)
    if source == rank:
        return everything, everything, True
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


class _Exchange:
    """`tensor` sent to the next CP rank while the previous rank's arrives, asynchronously."""

    def __init__(self, tensor: torch.Tensor, cp: Group, what: str, step: int) -> None:
        self.what, self.step = what, step
        self.received = torch.empty_like(tensor)
        after = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.size)
        before = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.size)
        operations = [
            dist.P2POp(dist.isend, tensor, after, cp.group),
            dist.P2POp(dist.irecv, self.received, before, cp.group),
        ]
        record_collective(what, tensor.numel(), tensor.element_size())
        self.requests = dist.batch_isend_irecv(operations)
        _trace(f"{what} posted", step)

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        _trace(f"{self.what} arrived", self.step)
        return self.received


def _attend(
    q: torch.Tensor,
    kv: torch.Tensor,
    plan: tuple[slice, slice, bool],
    scoring: Scoring,
    dropout: Dropout | None,
    into: Accumulator,
    allowed: torch.Tensor | None,
) -> None:
    rows, keys, causal = plan
    k, v = kv[:, :, :, keys]
    out, lse = block_forward(q[:, :, rows], k, v, causal, scoring, dropout, allowed)
    into.add(rows, out, lse)


def _attend_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: tuple[slice, slice, bool],
    scoring: Scoring,
    dropout: Dropout | None,
    grad_q: torch.Tensor,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """Adds the block's query gradient to `grad_q`; returns the gradient of `kv` (in
    `grad_q`'s dtype: fp32 or wider)."""
    rows, keys, causal = plan
    k, v = kv[:, :, :, keys]
    block = (grad_out[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows])
    dq, dk, dv = block_backward(*block, causal, scoring, dropout, allowed)
    grad_q[:, :, rows] += dq.to(grad_q.dtype)
    grad_kv = torch.zeros(kv.shape, dtype=grad_q.dtype, device=kv.device)
    grad_kv[0][:, :, keys] = dk
    grad_kv[1][:, :, keys] = dv
    return grad_kv


def _dropout(p: float, seed: int, source: int) -> Dropout | None:
    """The block of CP rank `source`'s keys draws its mask from seed + source."""
    return Dropout(p, seed + source) if p > 0 else None


def _allowed(documents: Documents | None, rank: int, source: int, plan) -> torch.Tensor | None:
    """The block's per-document mask (None: no packed documents)."""
    return None if documents is None else documents.allowed(rank, source, plan)


class _RingAttention(torch.autograd.Function):
    """q [b, heads, 2c, d], k and v [b, groups, 2c, d] -> out [b, heads, 2c, d]."""

    @staticmethod
    def forward(
        ctx, q, k, v, cp: Group, scoring: Scoring, dropout: float, seed: int, documents, sinks
    ):
        kv, result, half = torch.stack((k, v)), Accumulator(), q.shape[2] // 2
        for step in range(cp.size):
            incoming = _Exchange(kv, cp, "cp_send_kv", step) if step + 1 < cp.size else None
            _trace("forward block start", step)
            source = (cp.rank - step) % cp.size
            plan = _step_plan(source, cp.rank, half)
            mask, allowed = (
                _dropout(dropout, seed, source),
                _allowed(documents, cp.rank, source, plan),
            )
            _attend(q, kv, plan, scoring, mask, result, allowed)
            _trace("forward block end", step)
            if incoming is not None:
                kv = incoming.wait()
        add_sinks(result, sinks)
        out = result.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, result.lse, sinks)
        ctx.cp, ctx.scoring, ctx.dropout, ctx.seed = cp, scoring, dropout, seed
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cp, scoring = ctx.cp, ctx.scoring
        half = q.shape[2] // 2
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros(q.shape, dtype=compute_dtype(q), device=q.device)
        kv, returning = torch.stack((k, v)), None
        for step in range(cp.size):
            incoming = _Exchange(kv, cp, "cp_send_kv", step) if step + 1 < cp.size else None
            source = (cp.rank - step) % cp.size
            plan = _step_plan(source, cp.rank, half)
            mask = _dropout(ctx.dropout, ctx.seed, source)
            allowed = _allowed(ctx.documents, cp.rank, source, plan)
            _trace("backward block start", step)
            grad_kv = _attend_backward(
                grad_out, q, kv, out, lse, plan, scoring, mask, grad_q, allowed
            )
            _trace("backward block end", step)
            # The gradient of the block held now travels with it: add what the ranks before
            # this one computed, pass it on; after the last step it reaches its owner.
            if returning is not None:
                grad_kv += returning.wait()
            returning = _Exchange(grad_kv, cp, "cp_send_grad_kv", step)
            if incoming is not None:
                kv = incoming.wait()
        grad_k, grad_v = returning.wait()
        grad_sinks = sinks_gradient(grad_out, out, lse, sinks)
        return (grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), *[None] * 5, grad_sinks)


class _GatheredAttention(torch.autograd.Function):
    """The ring's blocks from the gathered keys/values [CP, 2, b, groups, 2c, d]."""

    @staticmethod
    def forward(
        ctx, q, gathered, rank: int, scoring: Scoring, dropout: float, seed: int, documents, sinks
    ):
        result, half = Accumulator(), q.shape[2] // 2
        for step in range(gathered.shape[0]):
            source = (rank - step) % gathered.shape[0]
            plan, mask = _step_plan(source, rank, half), _dropout(dropout, seed, source)
            allowed = _allowed(documents, rank, source, plan)
            _attend(q, gathered[source], plan, scoring, mask, result, allowed)
        add_sinks(result, sinks)
        out = result.out.to(q.dtype)
        ctx.save_for_backward(q, gathered, out, result.lse, sinks)
        ctx.rank, ctx.scoring, ctx.dropout, ctx.seed = rank, scoring, dropout, seed
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, gathered, out, lse, sinks = ctx.saved_tensors
        half = q.shape[2] // 2
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros(q.shape, dtype=compute_dtype(q), device=q.device)
        grad_gathered = torch.zeros(gathered.shape, dtype=grad_q.dtype, device=q.device)
        for source in range(gathered.shape[0]):
            plan, mask = _step_plan(source, ctx.rank, half), _dropout(ctx.dropout, ctx.seed, source)
            grad_gathered[source] = _attend_backward(
                grad_out,
                q,
                gathered[source],
                out,
                lse,
                plan,
                ctx.scoring,
                mask,
                grad_q,
                _allowed(ctx.documents, ctx.rank, source, plan),
            )
        grad_sinks = sinks_gradient(grad_out, out, lse, sinks)
        return grad_q.to(q.dtype), grad_gathered.to(gathered.dtype), *[None] * 5, grad_sinks


class _OneBlockAttention(torch.autograd.Function):
    """Attention with sinks or capped scores on one rank's whole sequences: the ring's one
    block (q over its own keys, causal or by `allowed`) and the sinks merged after it, so that
    backward recomputes the scores from (out, lse) as flash attention does, instead of keeping
    the S x S matrices that writing the softmax out keeps for every layer."""

    @staticmethod
    def forward(ctx, q, k, v, allowed, scoring: Scoring, dropout: float, seed: int, sinks):
        kv, result = torch.stack((k, v)), Accumulator()
        plan = (slice(None), slice(None), allowed is None)
        mask = _dropout(dropout, seed, 0)
        _attend(q, kv, plan, scoring, mask, result, allowed)
        add_sinks(result, sinks)
        out = result.out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, result.lse, sinks, allowed)
        ctx.scoring, ctx.dropout, ctx.seed = scoring, dropout, seed
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, out, lse, sinks, allowed = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros(q.shape, dtype=compute_dtype(q), device=q.device)
        plan, mask = (slice(None), slice(None), allowed is None), _dropout(ctx.dropout, ctx.seed, 0)
        grad_kv = _attend_backward(
            grad_out, q, kv, out, lse, plan, ctx.scoring, mask, grad_q, allowed
        )
        grad_sinks = sinks_gradient(grad_out, out, lse, sinks)
        grad_k, grad_v = grad_kv.to(kv.dtype)
        return grad_q.to(q.dtype), grad_k, grad_v, *[None] * 4, grad_sinks


def one_block_attention(
    query,
    key,
    value,
    attention_mask,
    dropout: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`kernels.reference.attention_written_out` with `sinks` or `softcap` (its layouts;
    `attention_mask` True where a query may attend, [s, s] or [b, 1, s, s], None: causal)
    without its S x S activations."""
    q, k, v = _heads_first(query, key, value)
    allowed = attention_mask
    if allowed is not None and allowed.dim() == 2:
        allowed = allowed[None, None]
    scoring = Scoring(1.0 / math.sqrt(q.shape[-1]), softcap)
    seed = _seed(dropout, q.device)
    out = _OneBlockAttention.apply(q, k, v, allowed, scoring, dropout, seed, sinks)
    return _sequence_first(out)


def _heads_first(*tensors: torch.Tensor) -> list[torch.Tensor]:
    # Views, not copies: the rotated queries and keys are what autograd keeps anyway.
    return [t.permute(1, 2, 0, 3) for t in tensors]


def _sequence_first(out: torch.Tensor) -> torch.Tensor:
    b, heads, s, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


def _seed(p: float, device: torch.device) -> int:
    """A fresh seed for this call's dropout masks, from the device's current generator: the
    TP- and CP-rank-specific stream inside the RNG tracker's fork."""
    return int(torch.randint(0, 2**62, (1,), device=device)) if p > 0 else 0


def ring_attention(
    query,
    key,
    value,
    cp: Group,
    dropout: float = 0.0,
    documents: Documents | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    q, k, v = _heads_first(query, key, value)
    scoring = Scoring(1.0 / math.sqrt(q.shape[-1]), softcap)
    seed = _seed(dropout, q.device)
    out = _RingAttention.apply(q, k, v, cp, scoring, dropout, seed, documents, sinks)
    return _sequence_first(out)


def allgather_attention(
    query,
    key,
    value,
    cp: Group,
    dropout: float = 0.0,
    documents: Documents | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    # One all-gather for keys and values (backward: one reduce-scatter of their gradients).
    s, b, groups, d = key.shape
    kv = torch.stack((key, value), dim=1)  # [s, 2, b, groups, d]
    gathered = gather_from_sequence_parallel_region(kv, cp).unflatten(0, (cp.size, s))
    gathered = gathered.permute(0, 2, 3, 4, 1, 5).contiguous()  # [CP, 2, b, groups, s, d]
    (q,) = _heads_first(query)
    scoring, seed = Scoring(1.0 / math.sqrt(d), softcap), _seed(dropout, q.device)
    args = (q, gathered, cp.rank, scoring, dropout, seed, documents, sinks)
    out = _GatheredAttention.apply(*args)
    return _sequence_first(out)


class _AllToAll(torch.autograd.Function):
    """[CP, ...]: part i to rank i, part j received from rank j. Applied twice it is the
    identity, so it is its own backward."""

    @staticmethod
    def forward(ctx, x, cp: Group):
        ctx.cp = cp
        return _all_to_all(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.cp), None


def _all_to_all(x: torch.Tensor, cp: Group) -> torch.Tensor:
    x = x.contiguous()
    output = torch.empty_like(x)
    record_collective("all_to_all", x.numel(), x.element_size())
    dist.all_to_all_single(output, x, group=cp.group)
    return output


def gather_sequence(parts: torch.Tensor, cp: Group) -> torch.Tensor:
    """[s, b, CP, f]: this rank's s tokens, f features for each CP rank's share of the heads
    -> [CP x s, b, f]: this rank's share for the whole sequence, in position order (Ulysses's
    first all-to-all)."""
    received = _AllToAll.apply(parts.permute(2, 0, 1, 3), cp)  # [CP source, s, b, f]
    return to_global_order(received, cp.size)


def scatter_sequence(whole: torch.Tensor, cp: Group) -> torch.Tensor:
    """The inverse of `gather_sequence`: [CP x s, b, f] -> [s, b, CP x f], every rank's share
    of the heads for this rank's tokens."""
    back = _AllToAll.apply(to_rank_order(whole, cp.size), cp)  # [CP head part, s, b, f]
    return back.permute(1, 2, 0, 3).flatten(2)


def ulysses_attention(
    query,
    key,
    value,
    attention_mask,
    dropout,
    cp: Group,
    local: Callable,
    sinks: torch.Tensor | None = None,
):
    """a2a: every rank gets the whole sequence of 1/CP of the heads (query heads and their
    key/value groups together, so GQA's pairing is kept), attends with `local`, sends back;
    packed documents' `Documents` become the whole sequence's [b, 1, s, s] mask. `sinks`:
    `local` takes this rank's share of them as a sixth argument."""
    if isinstance(attention_mask, Documents):
        attention_mask = attention_mask.whole_mask()
    s, b, heads, d = query.shape
    groups = key.shape[2]
    split = [heads // cp.size, groups // cp.size, groups // cp.size]
    # [s, b, CP, heads/CP + 2 groups/CP, d]: each rank's share of q, k and v side by side.
    parts = torch.cat([t.unflatten(2, (cp.size, -1)) for t in (query, key, value)], dim=3)
    whole = gather_sequence(parts.flatten(3), cp).unflatten(2, (-1, d))  # [CP x s, b, ., d]
    q, k, v = whole.split(split, dim=2)
    mine = () if sinks is None else (sinks.unflatten(0, (cp.size, -1))[cp.rank],)
    context = local(q, k, v, attention_mask, dropout, *mine)  # [CP x s, b, heads/CP x d]
    return scatter_sequence(context, cp)


def hierarchical_attention(
    query,
    key,
    value,
    dropout,
    a2a: Group,
    p2p: Group,
    documents: Documents | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
):
    """a2a+p2p: Ulysses over `a2a` (A consecutive CP ranks), then ring attention over `p2p`
    (the ranks at the same place of each a2a group). The all-to-all gives each rank its a2a
    group's 2A chunks for 1/A of the heads, in the order `to_global_order` puts them: the A
    first chunks, then the A second ones in reverse. With ring rank o holding CP ranks oA ..
    oA+A-1, those are chunks oA .. oA+A-1 and 2CP-A(o+1) .. 2CP-1-oA: coarse chunks o and
    2P-1-o of 2P, the ring's own load-balanced layout, on which it runs unchanged (packed
    documents too: their ids laid out for P ranks)."""
    coarse = None
    if documents is not None:
        coarse = Documents.of(documents.whole(), p2p.size, documents.window)

    def ring(q, k, v, attention_mask, p, sinks=None):
        return ring_attention(q, k, v, p2p, p, coarse, sinks, softcap)

    return ulysses_attention(query, key, value, None, dropout, a2a, ring, sinks)


def context_parallel_attention(
    cp: Group,
    comm_type: str,
    local: Callable,
    hierarchy: tuple[Group, Group] | None = None,
    softcap: float | None = None,
) -> Callable:
    """The core attention for `--cp-comm-type comm_type` over `cp`; `local` is the
    single-rank attention (the kernel dispatch's) that a2a runs on whole sequences, taking
    the sinks as a sixth argument when the attention is called with them; `hierarchy`
    a2a+p2p's (all-to-all group, ring group); `softcap` the blocks' cap of their scores
    (`local` caps alike)."""
    if comm_type == "a2a":

        def ulysses(query, key, value, attention_mask, dropout, sinks=None):
            return ulysses_attention(query, key, value, attention_mask, dropout, cp, local, sinks)

        return ulysses
    if comm_type == "a2a+p2p":
        a2a, p2p = hierarchy

        def hierarchical(query, key, value, attention_mask, dropout, sinks=None):
            return hierarchical_attention(
                query, key, value, dropout, a2a, p2p, attention_mask, sinks, softcap
            )

        return hierarchical
    blockwise = {"p2p": ring_attention, "allgather": allgather_attention}[comm_type]

    def attention(query, key, value, attention_mask, dropout, sinks=None):
        # (a mask under CP is packed documents': split_batch's `Documents`)
        return blockwise(query, key, value, cp, dropout, attention_mask, sinks, softcap)

    return attention
