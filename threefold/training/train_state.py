"""Where the run stands: the counters a checkpoint saves and a resumed run continues from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0  # where the next evaluation reads on (Megatron-LM's)
    skipped_iterations: int = 0
    nan_iterations: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        for name, value in state_dict.items():
            setattr(self, name, value)
