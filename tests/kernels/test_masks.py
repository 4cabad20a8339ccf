"""Attention masks converted once and shared by the layers
(threefold/parallel/context_parallel/masks.py): the conversion is SDPA's own, bit for bit;
one mask object gets one additive tensor, which goes when the mask goes."""

import gc

import pytest
import torch
import torch.nn.functional as F

from threefold.kernels import reference
from threefold.parallel.context_parallel import masks
from threefold.parallel.context_parallel.sequence import document_mask, window_mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_the_shared_additive_mask_is_sdpas_with_the_boolean_one(dtype):
    torch.manual_seed(0)
    s, b = 24, 2
    q = torch.randn(s, b, 4, 8, dtype=dtype)
    k, v = (torch.randn(s, b, 2, 8, dtype=dtype) for _ in "kv")
    ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 3 + [1] * 21])
    mask = window_mask(s, 5, document_mask(ids), q.device)
    heads_first = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, enable_gqa=True)
    got = reference.attention(q, k, v, mask, 0.0)
    assert torch.equal(got, expected.permute(2, 0, 1, 3).reshape(s, b, -1))


def test_one_mask_object_gets_one_additive_tensor_until_it_is_freed():
    before = len(masks._DERIVED)
    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    bias = masks.additive(mask, torch.bfloat16)
    assert masks.additive(mask, torch.bfloat16) is bias
    assert bias.dtype == torch.bfloat16 and torch.equal(bias == 0, mask)
    assert torch.isneginf(bias[~mask]).all()
    twin = mask.clone()  # equal values, another object: its own
    assert masks.additive(twin, torch.bfloat16) is not bias
    assert masks.additive(mask, torch.float32) is not bias
    assert window_mask(5, 2, mask, mask.device) is window_mask(5, 2, mask, mask.device)
    assert window_mask(5, 2, None, mask.device) is window_mask(5, 2, None, mask.device)
    del mask, twin
    gc.collect()
    assert len(masks._DERIVED) == before


def test_masks_of_the_shapes_alone_are_the_latest_two():
    """Generation asks for a longer window band each token: only the latest two stay."""
    bands = [window_mask(length, 2, None, torch.device("cpu")) for length in (6, 7, 8)]
    assert window_mask(8, 2, None, torch.device("cpu")) is bands[2]
    assert window_mask(7, 2, None, torch.device("cpu")) is bands[1]
    assert window_mask(6, 2, None, torch.device("cpu")) is not bands[0]
    assert len(masks._CONSTANT) == 2
