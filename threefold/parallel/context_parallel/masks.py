"""Attention masks derived once per mask and shared by every layer that asks for them.

A packed micro-batch's boolean mask [b, 1, s, s] (or a window's band) reaches SDPA in every
layer, and SDPA turns it into an additive mask of the activations' dtype that it keeps for
backward: L layers kept L copies, e b s^2 bytes each (measured on the CPU; CUDA's
memory-efficient kernel keeps its bias likewise: 128 MiB a layer at 8,192 tokens in bf16).
`additive` makes that conversion here, once per boolean mask object, so every layer's SDPA
reads (and keeps) the same tensor; `derived` does the same for any tensor built from a mask
(a window's band within the documents, Ulysses's whole-sequence mask from the documents'
ids), and `constant` for one built from the shapes alone (the band itself).

What is derived lives as long as the mask it came from (a weak reference drops it then), so a
micro-batch's masks go with the micro-batch. Under torch.compile the derivation is traced into
the graph instead (no Python state inside a compiled layer).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

T = TypeVar("T")
_DERIVED: dict[tuple[int, Hashable], tuple[weakref.ref, torch.Tensor]] = {}
# Masks that depend on the shapes only (a window's band), and what is derived from them: the
# latest two (a run's training and validation shapes), as generation asks for a longer one each
# token and each holds s^2 bytes and more
_CONSTANT: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
_CONSTANTS_KEPT = 2


def constant(what: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`build()`, made once for each `what` (of the latest two asked for)."""
    if torch.compiler.is_compiling():
        return build()
    if what not in _CONSTANT:
        _CONSTANT[what] = build()
        while len(_CONSTANT) > _CONSTANTS_KEPT:
            _CONSTANT.popitem(last=False)
    _CONSTANT.move_to_end(what)
    return _CONSTANT[what]


def derived(source: torch.Tensor, what: Hashable, build: Callable[[], T]) -> T:
    """`build()`, made once for each live `source` tensor object and `what` (a tensor, or
    a tuple of them and numbers: a packed convolution's indices, model/sequence_mixing.py)."""
    if torch.compiler.is_compiling():
        return build()
    key = (id(source), what)
    held = _DERIVED.get(key)
    if held is not None and held[0]() is source:
        return held[1]
    value = build()
    # (the callback runs as `source` is freed, before its id can be reused)
    _DERIVED[key] = (weakref.ref(source, lambda _, key=key: _DERIVED.pop(key, None)), value)
    return value


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may attend) as SDPA's additive one: 0 where True, -inf where
    False, in `dtype`; the same tensor for every call with the same `mask` object."""

    def build() -> torch.Tensor:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return bias.masked_fill_(~mask, float("-inf"))

    return derived(mask, ("additive", dtype), build)


def shared(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is one of the masks made here, which every layer shares (activation
    offloading leaves them on the device, as it leaves the rotary tables)."""
    storage = tensor.untyped_storage().data_ptr()
    held = [value for _, value in _DERIVED.values()] + list(_CONSTANT.values())
    held = [t for value in held for t in (value if isinstance(value, tuple) else (value,))]
    tensors = [t for t in held if isinstance(t, torch.Tensor)]
    return any(t.untyped_storage().data_ptr() == storage for t in tensors)
