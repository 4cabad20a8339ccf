"""What a training checkpoint saves and restores: components that each own their state.

The checkpoint code never sees a trainer. It receives `CheckpointComponents`: the model's
parameters under layout-independent names, the optimizer, the LR scheduler, the loss scaler
and the train state, each with its own `state_dict`/`load_state_dict` (torchtitan's `Stateful`)
or, for the tensors, its own keyed view (`state_tensors`, `load_resharded`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from threefold.config import Config
from threefold.parallel.parallel_context import ParallelContext


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


@dataclass
class CheckpointComponents:
    config: Config
    parallel: ParallelContext
    # This rank's parameters under their names in the whole single-device model, complete.
    parameters: Callable[[], list[tuple[str, nn.Parameter]]]
    # state_tensors(names), store_loaded(tensors), copy_masters_to_model(),
    # copy_model_to_masters(), load_resharded()
    optimizer: Any
    scheduler: Stateful
    loss_scaler: Stateful
    train_state: Stateful
    tokenizer: Any = None
    # FP8 scaling state (model/fp8.py's Fp8Scaling): state_tensors() under layout-independent
    # keys, the same on every rank that holds them; None without --fp8-format.
    fp8: Any = None
    # A context in which `parameters` are in the run's dtype (--fp8-param-gather stores its
    # FP8 weights in FP8 only): saves read, and loads write, inside it.
    parameters_in_model_dtype: Callable[[], AbstractContextManager] = nullcontext
