"""The gated delta rule: Gated DeltaNet's linear attention (Yang, Kautz and Hatamizadeh 2024;
Qwen3-Next's and megatron-core's `GatedDeltaNet`), in PyTorch.

Each head carries a state S (key size x value size). At token t it decays by exp(g_t), then
moves towards storing v_t under the key k_t, by the write strength beta_t; the output reads
the state with the query:

    S~_t = exp(g_t) S_{t-1}
    S_t  = S~_t + k_t [beta_t (v_t - S~_t^T k_t)]^T          o_t = S_t^T q_t / sqrt(d_k)

`recurrent_gated_delta_rule` is that definition, a token at a time (the tests' reference).
`chunk_gated_delta_rule` computes the same chunk by chunk. Within a chunk of C tokens, with
gamma_i the decay summed from the chunk's start and S_0 the state entering it, the updates
u_t = beta_t (v_t - S~_t^T k_t) solve one unit lower-triangular system,

    (I + L) U = beta V - beta exp(gamma) K S_0,  L_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j, j < i

after which the chunk's outputs and the state leaving it are matrix products:

    O   = (Q exp(gamma)) S_0 + [(Q K^T) o exp(gamma_i - gamma_j)]_{j <= i} U
    S_C = exp(gamma_C) S_0 + (K exp(gamma_C - gamma))^T U

Only the state passes from chunk to chunk; everything else runs for all chunks at once. It is
what megatron-core's deterministic mode runs (its `torch_chunk_gated_delta_rule`); its default
is FLA's Triton kernels, which threefold does not ship. Everything is computed in fp32 (fp64
inputs in fp64) and the output returned in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from threefold.config.linear_attention import RULE_CHUNK_SIZE
from threefold.kernels.chunk_documents import chunk_documents, continues


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rule a token at a time. query, key [b, s, heads, d_k]; value [b, s, heads, d_v];
    g (log decay, <= 0) and beta (write strength) [b, s, heads]; `documents` [b, s], packed
    documents' ids: the state starts afresh at each one -> output [b, s, heads, d_v]."""
    dtype, work = query.dtype, torch.promote_types(query.dtype, torch.float32)
    query, key, value, g, beta = (t.to(work) for t in (query, key, value, g, beta))
    query = query * query.shape[-1] ** -0.5
    b, s, heads, d_k = key.shape
    state = key.new_zeros(b, heads, d_k, value.shape[-1])
    outputs = []
    for t in range(s):
        if (carried := continues(documents, t)) is not None:  # (a new document: afresh)
            state = state * carried
        state = state * g[:, t, :, None, None].exp()
        read = torch.einsum("bhkv,bhk->bhv", state, key[:, t])
        update = beta[:, t, :, None] * (value[:, t] - read)
        state = state + key[:, t, :, :, None] * update[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, query[:, t]))
    return torch.stack(outputs, dim=1).to(dtype)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None = None,
    chunk_size: int = RULE_CHUNK_SIZE,
) -> torch.Tensor:
    """`recurrent_gated_delta_rule`'s output, computed in chunks of `chunk_size` tokens. With
    packed `documents`, a token's row of the chunk's system and its output read only its own
    document's tokens, and the state entering a chunk only the document open at its start."""
    dtype, work = query.dtype, torch.promote_types(query.dtype, torch.float32)
    s = query.shape[1]
    pad = -s % chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:
        # [b, s, heads, ...] -> [b, heads, chunks, chunk_size, ...], zero-padded at the end (a
        # padded token writes nothing, beta 0, and is cut from the output)
        t = t.to(work).transpose(1, 2)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 4 else F.pad(t, (0, pad))
        return t.unflatten(2, (-1, chunk_size))

    query = query * query.shape[-1] ** -0.5
    query, key, value, g, beta = (chunked(t) for t in (query, key, value, g, beta))
    gamma = g.cumsum(dim=-1)  # [b, heads, chunks, C]
    # exp(gamma_i - gamma_j) for j <= i (at most 1: the decay from token j to token i)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).tril()
    carries = None
    if documents is not None:  # ([b, 1, chunks, ...]: every head alike)
        packed = chunk_documents(documents, pad, chunk_size)
        lower = lower & packed.same[:, None]
        carries = packed.carries[:, None].to(work)  # [b, 1, chunks, C]
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, 0.0).exp()
    decay = decay.masked_fill(~lower, 0.0)
    strict = (beta[..., :, None] * (key @ key.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk_size, dtype=strict.dtype, device=strict.device)
    # U = W_v - W_k S_0, both sides of the solve at once
    entry = gamma.exp() if carries is None else gamma.exp() * carries  # (S_0's reach)
    sides = torch.cat((beta[..., None] * value, (beta * entry)[..., None] * key), dim=-1)
    solved = torch.linalg.solve_triangular(eye + strict, sides, upper=False, unitriangular=True)
    w_value, w_key = solved.split([value.shape[-1], key.shape[-1]], dim=-1)
    scores = (query @ key.transpose(-1, -2)) * decay
    query_decayed = query * entry[..., None]
    to_end, kept = (gamma[..., -1:] - gamma).exp(), gamma[..., -1].exp()
    if carries is not None:  # (the state leaving a chunk: its last document's tokens only)
        to_end, kept = to_end * packed.last[:, None], kept * carries[..., -1]
    key_to_end = key * to_end[..., None]

    b, heads, chunks = query.shape[:3]
    state = query.new_zeros(b, heads, key.shape[-1], value.shape[-1])
    outputs = []
    for c in range(chunks):
        update = w_value[:, :, c] - w_key[:, :, c] @ state
        outputs.append(query_decayed[:, :, c] @ state + scores[:, :, c] @ update)
        state = state * kept[:, :, c, None, None]
        state = state + key_to_end[:, :, c].transpose(-1, -2) @ update
    output = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :s]
    return output.transpose(1, 2).to(dtype)
