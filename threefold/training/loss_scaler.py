"""Loss scaling: a dynamic scale for fp16, a constant one otherwise (1, or Megatron's static
`--loss-scale` for fp16 or bf16). Every scaler's steps with inf/nan gradients are skipped.

The dynamic scaler (Megatron's DynamicGradScaler): on inf/nan gradients the step is skipped
and, once `hysteresis` such steps have accumulated, the scale halves (not below
`--min-loss-scale`); after `--loss-scale-window` clean steps it doubles.
"""

from __future__ import annotations

from threefold.config import TrainingConfig


class ConstantLossScaler:
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DynamicLossScaler:
    def __init__(self, config: TrainingConfig) -> None:
        self.scale = float(config.initial_loss_scale)
        self.min_scale = float(config.min_loss_scale)
        self.growth_interval = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.hysteresis_tracker = self.hysteresis
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.scale = state_dict["scale"]
        self.growth_tracker = state_dict["growth_tracker"]
        self.hysteresis_tracker = state_dict["hysteresis_tracker"]


def build_loss_scaler(config: TrainingConfig):
    if config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale)
    return DynamicLossScaler(config) if config.fp16 else ConstantLossScaler()
