"""Attention masks converted once and shared by the layers
(threefold/parallel/context_parallel/masks.py): the conversion is SDPA's own, bit for bit;
SDPA alone keeps a copy of a boolean mask a call, the shared one is kept once (on each
device: bench/gpu_session.sh's tests phase runs the `cuda` legs); one mask object gets one
additive tensor, which goes when the mask goes."""

import gc

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import DEVICES
from threefold.kernels import reference
from threefold.parallel.context_parallel import masks
from threefold.parallel.context_parallel.sequence import document_mask, window_mask

DTYPES = {"cpu": [torch.float32, torch.bfloat16], "cuda": [torch.bfloat16, torch.float16]}
IDS = torch.tensor([[0] * 10 + [1] * 22, [0] * 3 + [1] * 29])  # two samples' documents


@pytest.mark.parametrize("device", DEVICES)
def test_attention_with_the_shared_additive_mask_is_sdpas_with_the_boolean_one(device):
    for dtype in DTYPES[device]:
        torch.manual_seed(0)
        s, b = 32, 2
        q = torch.randn(s, b, 4, 8, dtype=dtype, device=device)
        k, v = (torch.randn(s, b, 2, 8, dtype=dtype, device=device) for _ in "kv")
        mask = window_mask(s, 5, document_mask(IDS.to(device)), q.device)
        heads_first = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, enable_gqa=True)
        got = reference.attention(q, k, v, mask, 0.0)
        assert torch.equal(got, expected.permute(2, 0, 1, 3).reshape(s, b, -1)), dtype


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_keeps_a_copy_of_a_boolean_mask_a_call_and_the_shared_one_once(device):
    """What the sharing is for, on each device: SDPA converts a boolean mask in every call and
    keeps its copy for backward (four layers' calls: four copies); through
    `reference.attention` the four calls keep one."""
    dtype, (s, b) = DTYPES[device][0], (32, 2)
    mask = document_mask(IDS.to(device))

    def copies(attention) -> int:
        kept = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.shape[-2:] == (s, s) and not tensor.requires_grad:
                kept[tensor.untyped_storage().data_ptr()] = tensor
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            for _ in range(4):
                q, k, v = (
                    torch.randn(s, b, 4, 16, dtype=dtype, device=device, requires_grad=True)
                    for _ in "qkv"
                )
                attention(q, k, v, mask)
        return len(kept)

    def sdpa(q, k, v, mask):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    assert copies(sdpa) == 4
    assert copies(lambda q, k, v, mask: reference.attention(q, k, v, mask, 0.0)) == 1


def test_one_mask_object_gets_one_additive_tensor_until_it_is_freed():
    before = set(masks._DERIVED)  # (earlier tests' entries may come and go meanwhile)
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
    assert not set(masks._DERIVED) - before  # every entry of this test's masks gone


def test_masks_of_the_shapes_alone_are_the_latest_two():
    """Generation asks for a longer window band each token: only the latest two stay."""
    bands = [window_mask(length, 2, None, torch.device("cpu")) for length in (6, 7, 8)]
    assert window_mask(8, 2, None, torch.device("cpu")) is bands[2]
    assert window_mask(7, 2, None, torch.device("cpu")) is bands[1]
    assert window_mask(6, 2, None, torch.device("cpu")) is not bands[0]
    assert len(masks._CONSTANT) == 2
