"""collate: what a micro-batch holds, and how it crosses to the device."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from threefold.data.loader import collate

LENGTH = 12  # sequence length + 1


class HostCopies(TorchDispatchMode):
    """Every copy of a host tensor to another device, as (source, non_blocking)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.Tensor, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func is torch.ops.aten._to_copy.default and device is not None:
            if args[0].device.type == "cpu" and torch.device(device).type != "cpu":
                self.copies.append((args[0], kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


def _samples(packed: bool) -> list[dict[str, np.ndarray]]:
    samples = []
    for seed in range(2):
        tokens = np.random.default_rng(seed).integers(0, 50, LENGTH, dtype=np.int64)
        sample = {"tokens": tokens}
        if packed:  # two documents, the first ending at input 4
            documents = np.array([0] * 5 + [1] * (LENGTH - 6))
            sample["loss_mask"] = np.arange(LENGTH - 1, dtype=np.float32) != 4
            sample["document_ids"] = documents
            sample["position_ids"] = np.concatenate([np.arange(5), np.arange(LENGTH - 6)])
        samples.append(sample)
    return samples


@pytest.mark.parametrize("packed", [False, True])
def test_a_micro_batch_holds_megatrons_fields(packed):
    samples = _samples(packed)
    batch = collate(samples, torch.device("cpu"))
    tokens = torch.from_numpy(np.stack([s["tokens"] for s in samples]))
    torch.testing.assert_close(batch["tokens"], tokens[:, :-1], rtol=0, atol=0)
    torch.testing.assert_close(batch["labels"], tokens[:, 1:], rtol=0, atol=0)
    assert batch["tokens"].is_contiguous() and batch["labels"].is_contiguous()
    if not packed:
        assert set(batch) == {"tokens", "labels", "loss_mask"}
        torch.testing.assert_close(batch["loss_mask"], torch.ones(2, LENGTH - 1))
        return
    torch.testing.assert_close(batch["loss_mask"][0], torch.from_numpy(samples[0]["loss_mask"]))
    torch.testing.assert_close(
        batch["position_ids"][1], torch.from_numpy(samples[1]["position_ids"])
    )
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, LENGTH - 1, LENGTH - 1) and mask.dtype == torch.bool
    documents = torch.from_numpy(samples[0]["document_ids"])
    for query in range(LENGTH - 1):
        for key in range(LENGTH - 1):
            attends = key <= query and documents[key] == documents[query]
            assert bool(mask[0, 0, query, key]) == bool(attends), (query, key)


@pytest.mark.parametrize("device", ["meta", "cuda"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_micro_batch_crosses_to_the_device_once_per_field(device, packed):
    """One copy per field the samples hold (the tokens feed inputs and labels; the all-ones
    loss mask and the [b, 1, s, s] attention mask are made on the device), each from pinned
    memory and non-blocking on a GPU: a copy from pageable memory may make the host wait for
    the GPU's queue to drain."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    samples = _samples(packed)
    with HostCopies() as mode:
        batch = collate(samples, torch.device(device))
    assert len(mode.copies) == len(samples[0])  # tokens (+ loss_mask, document_ids, positions)
    assert all(value.device.type == device for value in batch.values())
    for source, non_blocking in mode.copies:
        assert non_blocking
        assert source.is_pinned() == (device == "cuda")
