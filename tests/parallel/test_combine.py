"""The dispatchers' combine (each token's experts' outputs weighted by their probabilities and
summed): its gradients are autograd's own formulation's bit for bit, and it keeps for backward
the experts' outputs and the probabilities only, not the weighted products beside them."""

from __future__ import annotations

import pytest
import torch

from threefold.parallel.expert_parallel.dispatcher import Dispatch, _weighted_sum


def _autograd_weighted_sum(expert_output, probs, token_ids, num_tokens):
    dtype = torch.promote_types(expert_output.dtype, probs.dtype)
    weighted = expert_output.to(dtype) * probs.unsqueeze(-1).to(dtype)
    out = weighted.new_zeros(num_tokens, expert_output.shape[-1])
    return out.index_add(0, token_ids, weighted).to(expert_output.dtype)


def _saved_bytes(fn, *inputs) -> tuple[torch.Tensor, int]:
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(*inputs)
    return out, sum(storages.values())


@pytest.mark.parametrize(
    "outputs,probs", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
)
def test_the_combine_keeps_the_outputs_and_probabilities_and_is_autograds(outputs, probs):
    """(bf16 outputs under --moe-router-dtype fp32: autograd's keeps their fp32 copy and the
    fp32 products, 4 times the outputs' bytes.)"""
    torch.manual_seed(0)
    tokens, pairs, hidden = 12, 24, 16
    token_ids = torch.randint(0, tokens, (pairs,))
    expert_output = torch.randn(pairs, hidden).to(outputs)
    weights = torch.rand(pairs).to(probs)
    grad = torch.randn(tokens, hidden).to(outputs)
    results = []
    for fn in (
        lambda x, p: _weighted_sum(x, Dispatch(token_ids, p, tokens, [])),
        lambda x, p: _autograd_weighted_sum(x, p, token_ids, tokens),
    ):
        x, p = expert_output.clone().requires_grad_(), weights.clone().requires_grad_()
        out, kept = _saved_bytes(fn, x, p)
        out.backward(grad)
        results.append((out, x.grad, p.grad, kept))
    (out, grad_x, grad_p, kept), (out_ref, grad_x_ref, grad_p_ref, kept_ref) = results
    assert torch.equal(out, out_ref)
    assert torch.equal(grad_x, grad_x_ref) and torch.equal(grad_p, grad_p_ref)
    assert kept == expert_output.nbytes + weights.nbytes + token_ids.nbytes
    product = pairs * hidden * torch.promote_types(outputs, probs).itemsize
    if outputs == probs:  # autograd's: the outputs themselves and the products
        assert kept_ref == kept + product
    else:  # its: the outputs' fp32 copy and the products, not the bf16 outputs
        assert kept_ref == kept - expert_output.nbytes + 2 * product
