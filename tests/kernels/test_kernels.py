"""Every fused kernel computes its reference's function.

- The chunked cross-entropy against the one-shot reference: bitwise in fp32 at TP=1 without
  vocabulary padding, to rounding with padding and uneven chunks, within bf16 tolerance for
  bf16 logits (keeping only bf16 for backward), and under TP=2 against one process.
- torch.compile'd norms, SwiGLU, GELU, RoPE and cross-entropy chunks (C++ on this CPU, Triton
  on a GPU) inside whole GPT-2 and LLaMA-style models: logits, loss and every gradient.
- Each compiled op alone in bf16, within bf16 tolerance of the fp32 reference.
- The stacked SwiGLU and the QKV split with RoPE, compiled: no concatenation in backward.
"""

import pytest
import torch

from tests.conftest import DEVICES
from tests.distributed import run_distributed
from tests.parity import GPT2_STYLE, LLAMA_STYLE, TRAINING, assert_close_dicts, gradient_job
from threefold.kernels import reference
from threefold.kernels.cross_entropy import fused_vocab_parallel_cross_entropy
from threefold.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

# bf16 keeps 8 bits of mantissa: one rounding is a relative error of at most 2^-9.
BF16_TOLERANCE = 2e-2


def _logits(tokens: int, partition: int, vocab: int, dtype=torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens // 4, 4, partition, generator=generator) * 3).to(dtype)
    target = torch.randint(0, vocab, (tokens // 4, 4), generator=generator)
    grad_loss = torch.rand(tokens // 4, 4, generator=generator)
    return logits, target, grad_loss


def _loss_and_grad(function, logits, target, grad_loss, vocab, **kwargs):
    logits = logits.clone().requires_grad_()
    loss = function(logits, target, vocab, **kwargs)
    loss.backward(grad_loss)
    return loss, logits.grad


def test_chunked_cross_entropy_is_bitwise_the_reference_without_padding():
    logits, target, grad_loss = _logits(64, 256, 256)
    expected = _loss_and_grad(vocab_parallel_cross_entropy, logits, target, grad_loss, 256)
    for chunk in (64, 4096):  # one chunk
        actual = _loss_and_grad(
            fused_vocab_parallel_cross_entropy, logits, target, grad_loss, 256, chunk_tokens=chunk
        )
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


def test_chunked_cross_entropy_with_padding_and_uneven_chunks():
    logits, target, grad_loss = _logits(64, 264, 250)
    loss, grad = _loss_and_grad(vocab_parallel_cross_entropy, logits, target, grad_loss, 250)
    for chunk in (7, 64):
        actual, actual_grad = _loss_and_grad(
            fused_vocab_parallel_cross_entropy, logits, target, grad_loss, 250, chunk_tokens=chunk
        )
        torch.testing.assert_close(actual, loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(actual_grad, grad, rtol=0, atol=1e-7)
        assert torch.all(actual_grad[..., 250:] == 0), "padding columns get no gradient"


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_cross_entropy_in_bf16_keeps_no_fp32_copy(device):
    logits, target, grad_loss = (t.to(device) for t in _logits(64, 512, 500, torch.bfloat16))
    expected_loss, expected_grad = _loss_and_grad(
        vocab_parallel_cross_entropy, logits.float(), target, grad_loss, 500
    )
    leaf = logits.clone().requires_grad_()
    loss = fused_vocab_parallel_cross_entropy(leaf, target, 500, chunk_tokens=16)
    saved = loss.grad_fn.saved_tensors
    assert [(t.dtype, t.shape) for t in saved] == [(torch.bfloat16, (64, 512))]
    loss.backward(grad_loss)
    assert loss.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)  # fp32 arithmetic
    torch.testing.assert_close(leaf.grad.float(), expected_grad, rtol=BF16_TOLERANCE, atol=1e-4)


def _tensor_parallel_cross_entropy(logits, target, grad_loss, vocab, chunk):
    from threefold.parallel import state
    from threefold.parallel.tensor_parallel.mappings import gather_from_tensor_parallel_region

    state.initialize_model_parallel(2, 1)
    tp = state.parallel_context().tp
    shard = logits.chunk(2, dim=-1)[tp.rank]
    loss, grad = _loss_and_grad(
        fused_vocab_parallel_cross_entropy,
        shard,
        target,
        grad_loss,
        vocab,
        tp=tp,
        chunk_tokens=chunk,
    )
    return loss.detach(), gather_from_tensor_parallel_region(grad, tp)


@pytest.mark.parametrize("vocab", [264, 250, 100])  # no padding; padding; rank 1 all padding
def test_chunked_cross_entropy_under_tensor_parallelism(vocab):
    logits, target, grad_loss = _logits(32, 264, vocab)
    loss, grad = _loss_and_grad(vocab_parallel_cross_entropy, logits, target, grad_loss, vocab)
    for rank_loss, rank_grad in run_distributed(
        2, _tensor_parallel_cross_entropy, logits, target, grad_loss, vocab, 5
    ):
        torch.testing.assert_close(rank_loss, loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(rank_grad, grad, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "style", {"gpt2": GPT2_STYLE, "llama": LLAMA_STYLE}.items(), ids=["gpt2", "llama"]
)
def test_compiled_kernels_in_the_model_match_the_reference(style):
    _, argv = style
    argv = argv + TRAINING + ["--cross-entropy-chunk-tokens", "10"]
    expected = gradient_job(argv + ["--fusion-impl", "eager", "--no-cross-entropy-loss-fusion"])
    actual = gradient_job(argv + ["--fusion-impl", "compile"])
    torch.testing.assert_close(actual["logits"], expected["logits"], rtol=1e-5, atol=1e-5)
    assert abs(actual["loss"] - expected["loss"]) <= 1e-6 * abs(expected["loss"])
    assert_close_dicts(actual["grads"], expected["grads"], 1e-5, "gradient")


def _ops(device: str = "cpu"):
    generator = torch.Generator().manual_seed(3)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    x, weight, bias = tensor(16, 2, 64), 1 + tensor(64) / 10, tensor(64) / 10
    cos, sin = tensor(16, 1, 1, 32).cos(), tensor(16, 1, 1, 32).sin()
    return {
        "layer_norm": (reference.layer_norm, (x, weight, bias, 1e-5)),
        "rms_norm": (reference.rms_norm, (x, weight, 1e-5)),
        "swiglu": (lambda fc1: reference.swiglu(*fc1.chunk(2, dim=-1)), (tensor(16, 2, 128),)),
        "gelu": (reference.gelu, (tensor(16, 2, 128), "tanh")),
        "rotary": (reference.rotary, (tensor(16, 2, 4, 32), cos, sin)),
        "rotary_interleaved": (reference.rotary_interleaved, (tensor(16, 2, 4, 32), cos, sin)),
        "swiglu_stacked": (reference.swiglu_stacked, (tensor(16, 2, 128),)),
        "split_rotary": (_split_rotary_flat, (tensor(16, 2, 2, 5, 32), cos, sin)),
    }


def _split_rotary_flat(qkv, cos, sin):
    """`split_rotary`'s three outputs (3 query heads per group) as one tensor."""
    return torch.cat([t.flatten() for t in reference.split_rotary(qkv, cos, sin, 3)])


def _backward_nodes(outputs, leaf) -> set[str]:
    """The kinds of autograd nodes between `outputs` and the leaf tensor `leaf`."""
    seen, names, stack = set(), set(), [t.grad_fn for t in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack += [next_node for next_node, _ in node.next_functions]
    return names


def test_compiled_stacked_swiglu_and_split_rotary_write_one_gradient():
    """On a GPU, autograd's backward of a split (the fused QKV output into query, key and
    value; an FP8 fc1 output into gate and up) concatenated the pieces' gradients: a copy of
    the whole gradient. Compiled, `split_rotary` and `swiglu_stacked` take the whole tensor
    and their backward writes its gradient in one piece: the same values as the split ops
    eager, and no split or concatenation left in the graph."""
    generator = torch.Generator().manual_seed(5)
    qkv = torch.randn(16, 2, 2, 5, 32, generator=generator)
    fc1 = torch.randn(16, 2, 128, generator=generator)
    angles = torch.randn(16, 1, 1, 32, generator=generator)
    cos, sin = angles.cos(), angles.sin()

    def split_ops(qkv):
        query, key, value = qkv.split([3, 1, 1], dim=3)
        query = reference.rotary(query.reshape(16, 2, -1, 32), cos, sin)
        return query, reference.rotary(key.squeeze(3), cos, sin), value.squeeze(3)

    cases = (
        (split_ops, lambda x: reference.split_rotary(x, cos, sin, 3), qkv),
        (
            lambda x: (reference.swiglu(*x.chunk(2, dim=-1)),),
            lambda x: (reference.swiglu_stacked(x),),
            fc1,
        ),
    )
    for eager, fused, tensor in cases:
        results = []
        for function in (eager, fused, torch.compile(fused)):
            leaf = tensor.clone().requires_grad_()
            outputs = function(leaf)
            grads = [
                torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
                for i, t in enumerate(outputs)
            ]
            torch.autograd.backward(outputs, grads)
            results.append(
                ([t.detach() for t in outputs], leaf.grad, _backward_nodes(outputs, leaf))
            )
        (want, want_grad, split), (same, same_grad, _), (got, got_grad, nodes) = results
        assert any("Split" in name for name in split)  # the eager ops' backward splits
        assert nodes == {"CompiledFunctionBackward", "AccumulateGrad"}, nodes
        for a, b in zip(same + [same_grad], want + [want_grad]):
            assert torch.equal(a, b)  # the reference is the split ops, bitwise
        for a, b in zip(got + [got_grad], want + [want_grad]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_ops_in_bf16_are_within_bf16_tolerance_of_fp32(device):
    """The compiled ops alone (C++ on the CPU, Triton on a GPU), forward and backward."""
    for name, (function, args) in _ops(device).items():
        first = args[0].clone().requires_grad_()
        expected = function(first, *args[1:])
        expected.sum().backward()
        half = args[0].bfloat16().requires_grad_()
        actual = torch.compile(function)(half, *args[1:])
        actual.float().sum().backward()  # the compiled backward, in bf16 too
        assert actual.dtype == half.grad.dtype == torch.bfloat16, name
        for got, want in ((actual, expected), (half.grad, first.grad)):
            torch.testing.assert_close(got.float(), want, rtol=BF16_TOLERANCE, atol=1e-2, msg=name)
