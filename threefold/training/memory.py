"""Bytes per parameter actually held by a rank: parameters, gradients, optimizer state.

Megatron's accounting (Rajbhandari et al. for ZeRO): bf16 parameters with fp32 gradients take
2 + 4 + 12 = 18 bytes per parameter (fp32 master 4, Adam moments 8); with the distributed
optimizer over d data-parallel ranks 2 + 4 + 12/d. fp32 parameters need no separate master:
4 + 4 + 8 = 16, and 4 + 4 + 8/d distributed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryPerParameter:
    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    def __str__(self) -> str:
        return (f"bytes per parameter: {self.parameters:.2f} parameters + {self.gradients:.2f} "
                f"gradients + {self.optimizer:.2f} optimizer = {self.total:.2f}")


def measure_bytes_per_parameter(trainer) -> MemoryPerParameter:
    """From the tensors this rank holds (Adam moments exist after the first step)."""
    params = [p for _, p in trainer.layout_independent_parameters()]
    count = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = trainer.grad_buffer.buffer.numel() * trainer.grad_buffer.buffer.element_size()
    optimizer = trainer.optimizer
    state_bytes = sum(t.numel() * t.element_size()
                      for s in optimizer.optimizer.state.values()
                      for k, t in s.items() if k != "step")
    if optimizer.half:  # separate fp32 masters; for fp32 models the masters are the parameters
        state_bytes += sum(m.numel() * m.element_size() for m in optimizer.master_params)
    return MemoryPerParameter(param_bytes / count, grad_bytes / count, state_bytes / count)
