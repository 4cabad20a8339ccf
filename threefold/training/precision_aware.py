"""AdamW whose master weights and moments are stored in fewer bits (Megatron-LM's
--use-precision-aware-optimizer, which runs Transformer Engine's FusedAdam).

What is stored, as Transformer Engine stores it:
- `exp_avg`, `exp_avg_sq` (--exp-avg-dtype, --exp-avg-sq-dtype): fp32; bf16, rounded; fp16 or
  fp8 (E4M3) with one fp32 scale per tensor, set at every store so that the tensor's largest
  magnitude lands on half of fp16's range (the other half is headroom) or on E4M3's 448.
- the master weight of a 16-bit weight: with --main-params-dtype fp32 and a bf16 weight, only
  the 16 bits the weight lacks (`split_master`: the weight is the master's high half, rounded,
  and the remainder the signed rest, so the two give the fp32 master back exactly); of an fp16
  weight, a whole fp32 copy; with --main-params-dtype fp16, an fp16 copy scaled as above. An
  fp32 weight (an fp32 run's, or --fp8-param-gather's separate masters) is its own master.

The arithmetic is fp32 throughout: each step turns a chunk of parameters' masters, moments and
gradients into fp32 copies (at most CHUNK_ELEMENTS each), runs PyTorch's AdamW on them (the
fused kernel, where the device has it) and stores the results back, writing the new 16-bit
weights. With every dtype fp32 the step is the plain optimizer's, bit for bit.

The gradients are read from `param.decoupled_grad` (the gradient buffer's slice, fp32 or, with
--main-grads-dtype bf16, bf16), as Transformer Engine's optimizer reads them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.optim.adam import adam

if TYPE_CHECKING:
    from threefold.config import Config

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}
# The magnitude a scaled tensor's largest element is stored at.
RANGES = {torch.float16: torch.finfo(torch.float16).max / 2, torch.float8_e4m3fn: 448.0}
# Elements per fp32 copy a step makes at once (64 MiB per tensor).
CHUNK_ELEMENTS = 1 << 24
MOMENTS = ("exp_avg", "exp_avg_sq")


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 master as a bf16 weight and an int16 remainder: the weight is the master's high
    16 bits rounded half away from zero (round to nearest, except that ties round up in
    magnitude where bf16's cast rounds them to even), the remainder what the weight's bits lack,
    from -2**15 to 2**15 - 1; `join_master` adds them back into the same bits."""
    bits = master.view(torch.int32)
    # The bit patterns of floats of one sign are ordered as their magnitudes, so adding half
    # a unit of the low 16 bits rounds the magnitude; the shift keeps the sign (arithmetic).
    high = torch.bitwise_right_shift(bits + 0x8000, 16)
    low = bits - high * 65536
    return high.to(torch.int16).view(torch.bfloat16), low.to(torch.int16)


def join_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master `split_master` split into `weight` (bf16) and `remainder`."""
    high = weight.view(torch.int16).to(torch.int32)
    return (high * 65536 + remainder.to(torch.int32)).view(torch.float32)


def store_scaled(value: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor) -> None:
    """Store fp32 `value` into fp16 or fp8 `stored` with a new per-tensor `scale` (written in
    place): stored = value / scale, the largest magnitude at RANGES[dtype]."""
    absmax = torch.linalg.vector_norm(value, float("inf"))  # (no |value| copy)
    torch.div(absmax.reshape(1), RANGES[stored.dtype], out=scale)
    inverse = torch.where(scale > 0, scale.reciprocal(), 0.0)
    stored.copy_(value * inverse)


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) over parameters whose state is stored in `dtypes`:
    {"exp_avg": ..., "exp_avg_sq": ..., "master_param": ...} (see the module docstring).
    Parameter groups and their lr, weight_decay, eps and betas are as torch.optim.AdamW's."""

    def __init__(
        self,
        params: list[dict],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        dtypes: dict[str, torch.dtype],
        fused: bool,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.dtypes = dtypes
        self.fused = fused

    def _master_kind(self, param: torch.Tensor) -> str:
        """How `param`'s master is kept: none (fp32: its own), remainder, fp32 or scaled."""
        if param.dtype == torch.float32:
            return "none"
        if self.dtypes["master_param"] == torch.float32:
            return "remainder" if param.dtype == torch.bfloat16 else "fp32"
        return "scaled"

    def initialize_state(self, param: torch.Tensor) -> None:
        """Zero moments, step 0 and a master equal to the weight, unless already there."""
        state = self.state[param]
        if state:
            return
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        for name in MOMENTS:
            state[name] = torch.zeros_like(param, dtype=self.dtypes[name])
            if self.dtypes[name] in RANGES:
                state[f"{name}_scale"] = torch.ones(1, device=param.device)
        kind = self._master_kind(param)
        if kind == "remainder":
            state["master_param"] = torch.zeros_like(param, dtype=torch.int16)
        elif kind == "fp32":
            state["master_param"] = param.detach().float()
        elif kind == "scaled":
            state["master_param"] = torch.empty_like(param, dtype=self.dtypes["master_param"])
            state["master_param_scale"] = torch.ones(1, device=param.device)
            store_scaled(param.detach().float(), state["master_param"], state["master_param_scale"])

    def unscaled(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """`name`'s value in fp32: "exp_avg", "exp_avg_sq" or "master"; the stored tensor
        itself where that is fp32 (written in place by a step), else a copy."""
        self.initialize_state(param)
        state = self.state[param]
        if name == "master":
            kind = self._master_kind(param)
            if kind == "none":
                return param.detach()
            if kind == "remainder":
                return join_master(param.detach(), state["master_param"])
            name = "master_param"
        stored = state[name]
        if f"{name}_scale" in state:
            return stored.float() * state[f"{name}_scale"]
        return stored.float()  # (the tensor itself when fp32)

    def store(self, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Store fp32 `value` as `name` (as `unscaled` names it); a master also sets the
        weight, which is the master's high half (remainders) or the master rounded."""
        self.initialize_state(param)
        state = self.state[param]
        if name == "master":
            kind = self._master_kind(param)
            if kind == "remainder":
                weight, state["master_param"] = split_master(value.float().reshape(param.shape))
                param.detach().copy_(weight)
                return
            param.detach().copy_(value.reshape(param.shape))
            if kind == "none":
                return
            name = "master_param"
        stored = state[name]
        if value is stored:  # (an fp32 state, which the step wrote in place)
            return
        if f"{name}_scale" in state:
            store_scaled(value.float().reshape(stored.shape), stored, state[f"{name}_scale"])
        else:
            stored.copy_(value.reshape(stored.shape))

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if getattr(p, "decoupled_grad", None) is not None]
            for chunk in _chunks(params):
                self._step_chunk(chunk, group)

    def _step_chunk(self, params: list[torch.Tensor], group: dict) -> None:
        for param in params:
            self.initialize_state(param)
        masters = [self.unscaled(p, "master") for p in params]
        moments = {name: [self.unscaled(p, name) for p in params] for name in MOMENTS}
        beta1, beta2 = group["betas"]
        adam(
            masters,
            [p.decoupled_grad.float().view_as(p) for p in params],
            moments["exp_avg"],
            moments["exp_avg_sq"],
            [],
            [self.state[p]["step"] for p in params],
            foreach=None if self.fused else False,
            fused=self.fused or None,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        for i, param in enumerate(params):
            for name in MOMENTS:
                self.store(param, name, moments[name][i])
            if param.dtype != torch.float32:  # (an fp32 one was its own master, stepped)
                self.store(param, "master", masters[i])


def _chunks(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """`params` in runs of at most CHUNK_ELEMENTS elements (a larger one alone)."""
    chunk, size = [], 0
    for param in params:
        if chunk and size + param.numel() > CHUNK_ELEMENTS:
            yield chunk
            chunk, size = [], 0
        chunk.append(param)
        size += param.numel()
    if chunk:
        yield chunk


def describe(config: Config) -> str:
    """The start-up line of --use-precision-aware-optimizer."""
    training = config.training
    weights = "bf16" if training.bf16 else "fp16" if training.fp16 else "fp32"
    if weights == "fp32":
        masters = "the fp32 weights themselves"
    elif training.main_params_dtype == "fp16":
        masters = "fp16, scaled per tensor"
    elif weights == "bf16":
        masters = "fp32, as the bf16 weights and 16-bit remainders"
    else:
        masters = "fp32"
    if config.fp8.fp8_param_gather:
        masters += " (--fp8-param-gather's FP8 weights: fp32 copies)"

    def stored(dtype: str) -> str:
        return f"{dtype}, scaled per tensor" if DTYPES[dtype] in RANGES else dtype

    return (
        f"> optimizer: precision-aware AdamW: masters {masters}; exp_avg "
        f"{stored(training.exp_avg_dtype)}; exp_avg_sq {stored(training.exp_avg_sq_dtype)}; "
        f"gradients read in {training.main_grads_dtype}; the step in fp32, "
        f"{CHUNK_ELEMENTS // 2**20}M elements at a time"
    )
