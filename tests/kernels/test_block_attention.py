"""The block kernel of context-parallel attention (and of attention sinks on one rank) on each
device: the blocks of one rank's queries, merged by log-sum-exp and differentiated from the
merged output and log-sum-exp, give the whole sequence's causal attention of those queries, in
bf16 against float64. On the CPU the blocks run PyTorch's CPU flash kernel; on CUDA
FlashAttention-2's (bench/gpu_session.sh tests runs the `cuda` legs). The eager kernel: a large
block in slices of rows is the whole block, a row without keys gets nothing, and the
hand-written backward (through capped scores too) passes autograd's gradient check."""

import dataclasses
import math

import pytest
import torch

from tests.conftest import CLI_MODEL, DEVICES
from tests.parity import relative_error
from threefold.arguments import parse_args
from threefold.kernels.dispatch import configure_for_model
from threefold.parallel.context_parallel import block_attention
from threefold.parallel.context_parallel.attention import _GatheredAttention
from threefold.parallel.context_parallel.block_attention import Dropout, Scoring, block_kernel

BF16_TOLERANCE = 2e-2  # see test_kernels.py
CP, CHUNK, BATCH, HEADS, GROUPS, HEAD_DIM = 4, 32, 2, 4, 2, 64


def _positions(rank: int) -> torch.Tensor:
    """The sequence positions rank `rank` holds: chunks rank and 2 CP - 1 - rank of 2 CP."""
    chunks = (rank, 2 * CP - 1 - rank)
    return torch.cat([torch.arange(c * CHUNK, (c + 1) * CHUNK) for c in chunks])


def _whole_attention(q, k, v, query_positions, sinks):
    """float64, written out: q's rows (at `query_positions`) over every key at or before
    them, query head i reading group i // (heads / groups), each head's sink one more logit."""
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
    future = torch.arange(k.shape[2])[None, :] > query_positions[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    if sinks is not None:
        sink_column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    return probs[..., : k.shape[2]] @ v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("rank", [0, 2])
def test_flash_blocks_give_the_whole_sequences_attention_in_bf16(device, rank, with_sinks):
    """Rank `rank` of CP4 attends over every rank's keys (the all-gather's blocks: one causal,
    the others full or half); its outputs and every gradient (its queries', all keys' and
    values', the sinks') are the float64 whole-sequence attention's within bf16's tolerance.
    Each block's backward is handed the rows' merged log-sum-exp, not its own: with four blocks
    and sinks a block's own would be wrong by up to the whole other share of the row."""
    generator = torch.Generator().manual_seed(11 + rank)
    sequence = 2 * CP * CHUNK

    def tensor(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q_whole = tensor(BATCH, HEADS, sequence, HEAD_DIM)
    k_whole, v_whole = (tensor(BATCH, GROUPS, sequence, HEAD_DIM) for _ in range(2))
    sinks = tensor(HEADS) if with_sinks else None
    grad_out = tensor(BATCH, HEADS, 2 * CHUNK, HEAD_DIM)
    mine = _positions(rank)

    leaves = [q_whole[:, :, mine], k_whole, v_whole] + ([sinks] if with_sinks else [])
    leaves = [t.clone().requires_grad_() for t in leaves]
    expected = _whole_attention(*leaves[:3], mine, leaves[3] if with_sinks else None)
    expected.backward(grad_out)

    def on_device(t):
        return None if t is None else t.to(device, torch.bfloat16).requires_grad_()

    q = on_device(q_whole[:, :, mine])
    gathered = torch.stack(
        [
            torch.stack((k_whole[:, :, _positions(j)], v_whole[:, :, _positions(j)]))
            for j in range(CP)
        ]
    )
    gathered, sinks_bf16 = on_device(gathered), on_device(sinks)
    flash = "cuda flash" if device == "cuda" else "cpu flash"
    assert block_kernel(q, None, None) == flash
    scoring = Scoring(1.0 / math.sqrt(HEAD_DIM))
    out = _GatheredAttention.apply(q, gathered, rank, scoring, 0.0, 0, None, sinks_bf16)
    out.backward(grad_out.to(device, torch.bfloat16))

    def cpu(t):
        return t.detach().double().cpu()

    grad_k = torch.zeros_like(k_whole)
    grad_v = torch.zeros_like(v_whole)
    for j in range(CP):
        grad_k[:, :, _positions(j)] = cpu(gathered.grad[j, 0])
        grad_v[:, :, _positions(j)] = cpu(gathered.grad[j, 1])
    got = {"out": cpu(out), "grad q": cpu(q.grad), "grad k": grad_k, "grad v": grad_v}
    want = {"out": expected, "grad q": leaves[0].grad, "grad k": leaves[1].grad}
    want["grad v"] = leaves[2].grad
    if with_sinks:
        got["grad sinks"], want["grad sinks"] = cpu(sinks_bf16.grad), leaves[3].grad
    for name, value in want.items():
        assert relative_error(got[name], value.detach()) < BF16_TOLERANCE, name


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_the_flash_kernel_cannot_take_run_eager(device):
    """Dropout masks, masked blocks (documents, windows) and capped scores need the eager
    kernel; so do float64 (the tests' gradient checks) and, on CUDA, fp32 blocks
    (FlashAttention-2 takes 16-bit inputs only)."""
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16, device=device)
    flash = "cuda flash" if device == "cuda" else "cpu flash"
    assert block_kernel(q, None, None) == flash
    assert block_kernel(q, Dropout(0.1, 0), None) == "math"
    assert block_kernel(q, None, torch.ones(1, 1, 8, 8, dtype=torch.bool, device=device)) == "math"
    assert block_kernel(q, None, None, capped=True) == "math"
    assert block_kernel(q.double(), None, None) == "math"
    assert block_kernel(q.float(), None, None) == ("math" if device == "cuda" else "cpu flash")


def test_the_cuda_flash_calls_take_a_blocks_views_of_the_merged_rows():
    """The CUDA kernels' arguments, checked by their meta implementations on any machine: a
    block of the second half of the rows over twice as many keys in half as many groups as
    heads, its log-sum-exp a strided view of the merged one, gives outputs, log-sum-exp and
    gradients of the block's shapes (the keys' and values' per group)."""
    q = torch.empty(2, 4, 64, 32, device="meta", dtype=torch.bfloat16)
    keys = torch.empty(2, 2, 128, 32, device="meta", dtype=torch.bfloat16)
    rows = q[:, :, 32:]
    out, lse = block_attention._cuda_flash_forward(rows, keys, keys, False, 0.125)
    assert (out.shape, lse.shape, lse.dtype) == (rows.shape, (2, 4, 32), torch.float32)
    merged = torch.empty(2, 4, 64, device="meta")
    grads = block_attention._cuda_flash_backward(
        rows, rows, keys, keys, out, merged[:, :, 32:], False, 0.125
    )
    assert [g.shape for g in grads] == [rows.shape, keys.shape, keys.shape]


@pytest.mark.parametrize("device", DEVICES)
def test_the_kernels_line_names_the_blocks_kernel_under_context_parallelism(device):
    """The ring's, the all-gather's and a2a+p2p's blocks say which kernel they run on, as
    configured for the device and dtype; Ulysses (a2a) runs the attention the line already
    names, on whole sequences. Capped scores (Gemma 2's) run on eager blocks, whatever the
    layout, and the line says so."""
    config = parse_args(CLI_MODEL + ["--bf16"])
    flash = "FlashAttention-2 (PyTorch's)" if device == "cuda" else "PyTorch's CPU flash kernel"

    def line(comm_type, dtype=torch.bfloat16, model=config.model):
        return configure_for_model(
            config.kernels, model, 1, torch.device(device), dtype, 2, None, 1, comm_type
        )

    blocks = "attention by blocks merged by log-sum-exp, on"
    assert f"--cp-comm-type p2p: {blocks} {flash} (masked blocks" in line("p2p")
    assert f"--cp-comm-type allgather: {blocks} {flash} (masked blocks" in line("allgather")
    assert "--cp-comm-type" not in line("a2a") and "--cp-comm-type" not in line(None)
    if device == "cuda":  # FlashAttention-2 takes 16-bit inputs only
        assert f"--cp-comm-type p2p: {blocks} eager blocks" in line("p2p", torch.float32)
    capped = dataclasses.replace(config.model, attn_logit_softcapping=50.0)
    said = "; --attn-logit-softcapping: attention as the context-parallel ring's blocks, the "
    said += "scores capped, on eager blocks"
    assert line(None, model=capped).endswith(said) and line("a2a", model=capped).endswith(said)
    assert f"--cp-comm-type p2p: {blocks} eager blocks{said}" in line("p2p", model=capped)
    assert "capped" not in line("p2p")


@pytest.mark.parametrize("capped", [False, True], ids=["", "capped"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "masked"])
def test_the_eager_kernel_in_slices_of_rows_is_the_whole_block(monkeypatch, causal, capped):
    """A block larger than SCORES_AT_ONCE runs its queries in slices of rows (here 3 rows of
    12 at a time): the output, log-sum-exp and gradients are those of the whole block at
    once, in float64 (a causal square block, or one masked by documents)."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=generator, dtype=torch.float64) for _ in "qkv")
    k, v = k[:, :2], v[:, :2]  # (2 groups)
    grad_out = torch.randn(q.shape, generator=generator, dtype=torch.float64)
    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    allowed = None if causal else (ids[:, :, None] == ids[:, None, :])[:, None]
    scoring = Scoring(0.3, 0.8 if capped else None)

    def both() -> list[torch.Tensor]:
        out, lse = block_attention.math_forward(q, k, v, causal, scoring, None, allowed)
        grads = block_attention.math_backward(
            grad_out, q, k, v, out, lse, causal, scoring, None, allowed
        )
        return [out, lse, *grads]

    whole = both()
    monkeypatch.setattr(block_attention, "SCORES_AT_ONCE", 2 * 4 * 12 * 3)
    assert len(block_attention._row_slices(q, 12, None)) == 4
    for sliced, expected in zip(both(), whole):
        torch.testing.assert_close(sliced, expected, rtol=1e-12, atol=1e-12)


def test_a_block_without_keys_for_a_row_gives_it_nothing():
    """A row whose block holds no key of its document: output 0 and log-sum-exp -inf, which
    merging weighs 0; its gradients are 0, and nothing is NaN."""
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.float64) for _ in range(3))
    allowed = torch.tensor([[True, False, True], [False] * 3, [True] * 3]).view(1, 1, 3, 3)
    for scoring in (Scoring(0.5), Scoring(0.5, softcap=0.3)):
        out, lse = block_attention.block_forward(q, k, v, False, scoring, None, allowed)
        assert torch.isneginf(lse[:, :, 1]).all() and (out[:, :, 1] == 0).all()
        assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, [0, 2]]).all()
        grad_out = torch.randn_like(out)
        args = (grad_out, q, k, v, out, lse, False, scoring, None, allowed)
        grads = block_attention.block_backward(*args)
        assert all(torch.isfinite(g).all() for g in grads) and (grads[0][:, :, 1] == 0).all()


@pytest.mark.parametrize("softcap", [None, 0.7], ids=["", "capped"])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_blockwise_attention_backward_is_the_gradient_of_its_forward(rank, dropout, softcap):
    """In float64, with a fixed seed (so every call draws the same masks), the hand-written
    backward of the blocks merged by log-sum-exp passes autograd's numerical gradient check,
    with the scores soft-capped too (Gemma 2's: the cap's own derivative)."""
    torch.manual_seed(0)
    batch, heads, groups, chunk, head_dim, cp = 1, 4, 2, 3, 4, 2
    q = torch.randn(batch, heads, 2 * chunk, head_dim, dtype=torch.float64, requires_grad=True)
    gathered = torch.randn(
        cp, 2, batch, groups, 2 * chunk, head_dim, dtype=torch.float64, requires_grad=True
    )

    def attention(q, gathered):
        scoring = Scoring(0.5, softcap)
        return _GatheredAttention.apply(q, gathered, rank, scoring, dropout, 1234, None, None)

    assert torch.autograd.gradcheck(attention, (q, gathered))
