"""Bytes per parameter actually held by a rank: parameters, gradients, optimizer state.

Megatron's accounting (Rajbhandari et al. for ZeRO): bf16 parameters with fp32 gradients take
2 + 4 + 12 = 18 bytes per parameter (fp32 master 4, Adam moments 8); with the distributed
optimizer over d data-parallel ranks 2 + 4 + 12/d. fp32 parameters need no separate master:
4 + 4 + 8 = 16, and 4 + 4 + 8/d distributed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from threefold.parallel.data_parallel.torch_native import local


@dataclass
class MemoryPerParameter:
    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    def __str__(self) -> str:
        return (
            f"bytes per parameter: {self.parameters:.2f} parameters + {self.gradients:.2f} "
            f"gradients + {self.optimizer:.2f} optimizer = {self.total:.2f}"
        )


def measure_bytes_per_parameter(
    named_parameters: list[tuple[str, torch.nn.Parameter]], data_parallel
) -> MemoryPerParameter:
    """From the tensors this rank holds, per parameter of the model part its model-parallel
    rank covers (FSDP shards count at their global size, their bytes at the local one):
    `named_parameters` under layout-independent names, `data_parallel` holding the gradients
    and the optimizer (training/data_parallel.py)."""
    params = [p for _, p in named_parameters]
    count = sum(p.numel() for p in params)
    param_bytes = sum(local(p).numel() * p.element_size() for p in params)
    param_bytes += data_parallel.extra_parameter_bytes()
    grad_bytes = data_parallel.gradient_bytes()
    state_bytes = data_parallel.optimizer.state_bytes()
    return MemoryPerParameter(param_bytes / count, grad_bytes / count, state_bytes / count)


def measure_activation_bytes(
    model_chunks: list[torch.nn.Module],
    batch: dict,
    tensor_shape: tuple[int, ...],
    dtype: torch.dtype,
    shared: Iterable[torch.Tensor] = (),
) -> int:
    """Bytes of the tensors autograd keeps for backward over one training micro-batch through
    this rank's model chunks (parameters and `shared`, tensors held once for all micro-batches,
    excluded; each storage counted once): what a micro-batch in flight costs. A chunk that does
    not start the model gets zeros of `tensor_shape` as what the previous stage would have
    sent. Measured with saved-tensor hooks, so it works on the CPU; counted once the forward
    is done, when recomputation (--recompute-modules layernorm, ...) has freed what it frees
    and activation offloading has moved what it moves (on the CPU its host copies are not
    counted: on a GPU they are not device memory)."""
    params = {p.untyped_storage().data_ptr() for chunk in model_chunks for p in chunk.parameters()}
    params |= {tensor.untyped_storage().data_ptr() for tensor in shared}
    storages: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage
        return tensor

    # Activation offloading's groups save through hooks of their own, which hide their tensors
    # from `pack`: each reports those it leaves on the device instead.
    offloads = [chunk.activation_offload for chunk in model_chunks]
    offloads = [offload for offload in offloads if offload is not None]
    for offload in offloads:
        offload.resident = {}
    outputs = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        for chunk in model_chunks:
            chunk.train(True)
            hidden = None
            if not chunk.pre_process:  # what the previous stage would have sent
                hidden = torch.zeros(
                    tensor_shape, dtype=dtype, device=batch["tokens"].device, requires_grad=True
                )
            outputs.append(
                chunk(
                    batch["tokens"],
                    labels=batch["labels"],
                    hidden_states=hidden,
                    position_ids=batch.get("position_ids"),  # a CP rank's true positions
                    attention_mask=batch.get("attention_mask"),  # packed documents'
                )
            )
    for offload in offloads:
        storages |= {p: s for p, s in offload.resident.items() if p not in params}
        offload.resident = None
    kept = sum(storage.nbytes() for storage in storages.values())
    del outputs  # frees the graph
    return kept
