"""--init-model-with-meta-device (Megatron-LM's): a model chunk built with its parameters on
PyTorch's meta device, holding no storage, and materialized later where it will live.

Under FSDP2 the chunk is sharded while still on the meta device, so each rank allocates and
initializes only its shards: no rank ever holds the whole model (without the flag every rank
builds its tensor- and pipeline-parallel share whole on the CPU first). Under the other
strategies each rank holds its share anyway; the chunk is materialized on its device at once,
without a host copy.

Initialization is threefold's usual one (`initialize_parameters`): each full tensor drawn
from its own per-name generator, one at a time, and this rank's piece of it kept. The values
are the same as without the flag, bitwise, in every layout.

Buffers (the RoPE frequencies, FP8 scaling state) are small and computed when the modules
are built: they are built on the CPU as usual, and only parameters go to the meta device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers inside is replaced by a meta one of its shape,
    dtype and attributes (the tensor-parallel marks); buffers are left where they are made."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def holds_meta_parameters(module: nn.Module) -> bool:
    return any(param.is_meta for param in module.parameters())


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """The buffers to `device`; the meta parameters stay (`module.to(device)` would refuse
    to copy them)."""
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None:
                submodule._buffers[name] = buffer.to(device)


@torch.no_grad()
def materialize(chunk: nn.Module, device: torch.device, seed: int) -> None:
    """Storage on `device` for the chunk's meta parameters (FSDP2's shards once it has sharded
    them), initialized from `seed` as without the flag; the buffers kept."""
    # to_empty gives the buffers new, uninitialized storage too: their values are put back.
    # It makes new parameter objects, without the attributes the old ones carried.
    buffers = {name: buffer.clone() for name, buffer in chunk.named_buffers()}
    attributes = {name: dict(param.__dict__) for name, param in chunk.named_parameters()}
    chunk.to_empty(device=device)
    for name, buffer in chunk.named_buffers():
        buffer.copy_(buffers[name])
    for name, param in chunk.named_parameters():
        param.__dict__.update(attributes[name])
    chunk.initialize(seed)
