"""One run's FP8 recipe: the formats and the scaling that kernels/fp8.py's layers cast with,
from config/fp8.py's flags (model/fp8.py resolves them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.kernels.fp8_gemms import fp8_dtypes


@dataclass(frozen=True)
class Fp8Recipe:
    """One run's FP8 settings (config/fp8.py's flags, resolved)."""

    fp8_format: str = "hybrid"
    delayed: bool = True
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    rowwise: bool = False
    blockwise: bool = False
    # False (--no-fp8-wgrad): the weight gradient's GEMM in the run's precision
    fp8_wgrad: bool = True

    @property
    def fine_grained(self) -> bool:
        """Rowwise and blockwise scaling: scales per row or block of each GEMM operand, from
        this rank's own piece of it (no amax reduced over ranks, no state kept)."""
        return self.rowwise or self.blockwise

    @property
    def gathers_in_fp8(self) -> bool:
        """Whether sequence parallelism all-gathers an input in FP8 (`Fp8Linear`'s attribute)."""
        return not self.fine_grained and self.fp8_wgrad

    @property
    def dtypes(self) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """The FP8 dtype of the input, the weight and the gradient."""
        forward, backward = fp8_dtypes(self.fp8_format)
        return forward, forward, backward

    def describe(self) -> str:
        formats = "E4M3 activations and weights, E5M2 gradients"
        if self.fp8_format == "e4m3":
            formats = "E4M3 everywhere"
        if not self.fp8_wgrad:
            formats += "; weight gradients in the run's precision"
        if self.rowwise:
            return f"rowwise current scaling (power-of-two scales per row), {formats}"
        if self.blockwise:
            return (
                "blockwise current scaling (power-of-two scales per 1 x 128 block of "
                f"activations and gradients, per 128 x 128 block of weights), {formats}"
            )
        if not self.delayed:
            return f"tensorwise current scaling, {formats}"
        return (
            f"delayed scaling (amax history {self.amax_history_len}, "
            f"{self.amax_compute_algo}, margin {self.margin}), {formats}"
        )
