"""The state space duality (SSD) scan: Mamba-2's selective state space model (Dao and Gu
2024; megatron-core's `MambaMixer`, Nemotron-H's Mamba layers), in PyTorch.

Each head carries a state S (state size N x head size P). At token t it decays by
exp(dt_t A), a scalar per head (A < 0, dt_t > 0), and takes in the token's input x_t through
the input projection B_t; the output reads the state through C_t. B and C are shared by the
heads of a group, as grouped query attention shares keys:

    S_t = exp(dt_t A) S_{t-1} + dt_t B_t x_t^T          y_t = S_t^T C_t

`recurrent_ssd` is that definition, a token at a time (the tests' reference). `chunk_ssd`
computes the same chunk by chunk (the "dual", attention-like form). Within a chunk, with a_i
the log decay summed from the chunk's start and S_0 the state entering it,

    y_i = sum_{j <= i} (C_i . B_j) exp(a_i - a_j) dt_j x_j  +  exp(a_i) S_0^T C_i
    S_C = exp(a_C) S_0 + sum_j exp(a_C - a_j) dt_j B_j x_j^T

so everything but the state passed from chunk to chunk runs for all chunks at once, as
matrix products (mamba_ssm's `mamba_chunk_scan_combined` computes the same, fused in Triton;
threefold does not ship it). The skip D x is added in the same precision; the gate belongs to
the mixer (model/mamba.py). Everything is computed in fp32 (fp64 inputs in fp64) and the output
returned in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from threefold.kernels.chunk_documents import chunk_documents, continues

# Tokens a chunk spans (megatron-core's and mamba_ssm's default chunk_size).
SSD_CHUNK_SIZE = 128


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, s, groups, n] -> [b, s, heads, n]: each group's B or C for each of its heads."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def recurrent_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scan a token at a time. x [b, s, heads, p]; dt [b, s, heads] (after softplus);
    A [heads] (negative); B, C [b, s, groups, n]; D [heads], the skip y_t += D x_t;
    `documents` [b, s], packed documents' ids: the state starts afresh at each one -> y [b,
    s, heads, p]."""
    dtype, work = x.dtype, torch.promote_types(x.dtype, torch.float32)
    heads = x.shape[2]
    x, dt, A = x.to(work), dt.to(work), A.to(work)
    B, C = _heads(B, heads).to(work), _heads(C, heads).to(work)
    b, s, _, p = x.shape
    state = x.new_zeros(b, heads, B.shape[-1], p)
    outputs = []
    for t in range(s):
        if (carried := continues(documents, t)) is not None:  # (a new document: afresh)
            state = state * carried
        decay = (dt[:, t] * A).exp()[:, :, None, None]
        update = (dt[:, t, :, None] * B[:, t])[..., None] * x[:, t, :, None, :]
        state = decay * state + update
        outputs.append(torch.einsum("bhnp,bhn->bhp", state, C[:, t]))
    y = torch.stack(outputs, dim=1)
    return (y if D is None else y + D.to(work)[:, None] * x).to(dtype)


def chunk_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    chunk_size: int = SSD_CHUNK_SIZE,
) -> torch.Tensor:
    """`recurrent_ssd`, computed chunk by chunk (same arguments and result). With packed
    `documents`, a token reads only its own document's tokens within a chunk, a chunk's state
    holds only its last document's, and it carries on into the next chunk's tokens of that
    document only."""
    dtype, work = x.dtype, torch.promote_types(x.dtype, torch.float32)
    b, s, heads, p = x.shape
    groups = B.shape[2]
    per = heads // groups  # (a group's heads read its B and C: no copy of them a head)
    pad = -s % chunk_size  # (padded tokens: dt 0, so no decay and no input; outputs dropped)
    chunks = (s + pad) // chunk_size

    def split(t: torch.Tensor, rest: int) -> torch.Tensor:
        """[b, s, ...] padded and cut into [b, chunks, chunk, ...] (`rest` dims after s)."""
        return F.pad(t.to(work), (0, 0) * rest + (0, pad)).unflatten(1, (chunks, chunk_size))

    x = split(x, 2).unflatten(3, (groups, per))  # [b, z, c, g, hg, p]
    dt = split(dt, 1).unflatten(3, (groups, per))  # [b, z, c, g, hg]
    B, C = split(B, 2), split(C, 2)  # [b, z, c, g, n]
    a = (dt * A.to(work).view(groups, per)).cumsum(dim=2)  # log decay from the chunk's start
    # exp(a_i - a_j) for j <= i, 0 above the diagonal (masked before exp: a_i - a_j > 0 there)
    difference = a[:, :, :, None] - a[:, :, None]  # [b, z, i, j, g, hg]
    allowed = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    packed = None if documents is None else chunk_documents(documents, pad, chunk_size)
    if packed is not None:
        allowed = allowed & packed.same  # [b, z, i, j]
    decay = difference.masked_fill(~allowed[..., None, None], float("-inf")).exp()
    scores = torch.einsum("bzign,bzjgn->bzijg", C, B)[..., None] * decay
    y = torch.einsum("bzijgh,bzjghp->bzighp", scores, dt[..., None] * x)
    # Each chunk's own contribution to the state leaving it (its last document's tokens),
    # then the states passed along.
    to_end = (a[:, :, -1:] - a).exp() * dt  # [b, z, c, g, hg]
    entry = a.exp()  # the entering state's decay to each token
    kept = a[:, :, -1].exp()  # [b, z, g, hg]: the entering state's decay through the chunk
    if packed is not None:
        carries = packed.carries[..., None, None]  # [b, z, c, 1, 1]
        to_end = to_end * packed.last[..., None, None]
        entry, kept = entry * carries, kept * carries[:, :, -1]
    contributions = torch.einsum("bzjgn,bzjgh,bzjghp->bzghnp", B, to_end, x)
    state = x.new_zeros(b, groups, per, B.shape[-1], p)
    entering = []
    for z in range(chunks):
        entering.append(state)
        state = kept[:, z, :, :, None, None] * state + contributions[:, z]
    entering = torch.stack(entering, dim=1)  # [b, z, g, hg, n, p]
    y = y + torch.einsum("bzign,bzghnp,bzigh->bzighp", C, entering, entry)
    if D is not None:
        y = y + D.to(work).view(groups, per)[:, :, None] * x
    y = y.flatten(3, 4)  # [b, z, c, heads, p]
    # (contiguous: the padded rows go, and a consumer keeps [b, s, heads, p], not the padding)
    return y.flatten(1, 2)[:, :s].to(dtype).contiguous()
