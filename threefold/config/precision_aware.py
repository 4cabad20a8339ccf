"""Megatron-LM's precision-aware optimizer: the optimizer's state in fewer bits
(--use-precision-aware-optimizer, --main-grads-dtype, --main-params-dtype, --exp-avg-dtype,
--exp-avg-sq-dtype; training/precision_aware.py stores and steps it).

`TrainingConfig` inherits the fields; `check_precision_aware` is called from the run config's
finalize, where the parallel layout is known. Megatron-LM's rules hold: the dtypes other than
fp32 need the flag, and the flag needs Adam and the distributed optimizer. As with Megatron-LM
(Transformer Engine 2.1 and later), a bf16 run's fp32 masters are stored as 16-bit remainders
beside the bf16 weights. With --optimizer-cpu-offload the optimizer steps in host memory in fp32,
which is what Megatron-LM's hybrid CPU optimizer (which needs this flag) does too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from threefold.config.errors import require as _require
from threefold.config.fields import arg

if TYPE_CHECKING:
    from threefold.config.run import Config

GROUP = "Precision-aware optimizer"
STATE_DTYPES = ("fp32", "fp16", "bf16", "fp8")
# Bytes an element of each dtype takes (the memory estimate's).
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


@dataclass
class PrecisionAwareConfig:
    use_precision_aware_optimizer: bool = arg(
        False,
        group=GROUP,
        help="keep the optimizer's master weights and Adam moments in the dtypes below, "
        "computing in fp32 (a bf16 run's fp32 masters as 16-bit remainders beside the weights)",
    )
    main_grads_dtype: str = arg(
        "fp32",
        choices=("fp32", "bf16"),
        group=GROUP,
        help="the gradients the optimizer reads: bf16 accumulates and reduces them in bf16",
    )
    main_params_dtype: str = arg(
        "fp32", choices=("fp32", "fp16"), group=GROUP, help="the master weights' dtype"
    )
    exp_avg_dtype: str = arg(
        "fp32",
        choices=STATE_DTYPES,
        group=GROUP,
        help="Adam's first moment, stored (fp16 and fp8 with a scale per tensor)",
    )
    exp_avg_sq_dtype: str = arg(
        "fp32",
        choices=STATE_DTYPES,
        group=GROUP,
        help="Adam's second moment, stored (fp16 and fp8 with a scale per tensor)",
    )

    def state_dtypes(self) -> dict[str, str]:
        """By flag, the dtypes that are not fp32."""
        flags = {
            "--main-grads-dtype": self.main_grads_dtype,
            "--main-params-dtype": self.main_params_dtype,
            "--exp-avg-dtype": self.exp_avg_dtype,
            "--exp-avg-sq-dtype": self.exp_avg_sq_dtype,
        }
        return {flag: dtype for flag, dtype in flags.items() if dtype != "fp32"}

    def precision_aware_steps(self) -> bool:
        """Whether the precision-aware optimizer steps (not the offloaded fp32 one)."""
        return self.use_precision_aware_optimizer and not self.optimizer_cpu_offload


def check_precision_aware(config: Config) -> None:
    """The flags beside the rest of the run (a `Config`); a bf16 --main-grads-dtype turns on
    bf16 gradient accumulation and reduction."""
    training, parallel = config.training, config.parallel
    lowered = " ".join(f"{flag} {dtype}" for flag, dtype in training.state_dtypes().items())
    if not training.use_precision_aware_optimizer:
        _require(
            not lowered,
            f"{lowered} needs --use-precision-aware-optimizer (as in Megatron-LM); add it",
        )
        return
    _require(
        training.optimizer == "adam",
        f"--use-precision-aware-optimizer steps Adam, not --optimizer {training.optimizer} "
        "(as in Megatron-LM); drop one",
    )
    _require(
        parallel.distributed_strategy == "megatron" and parallel.use_distributed_optimizer,
        "--use-precision-aware-optimizer runs with --use-distributed-optimizer (as in "
        "Megatron-LM); add it",
    )
    if training.optimizer_cpu_offload:
        _require(
            not lowered,
            f"{lowered} with --optimizer-cpu-offload: the offloaded optimizer keeps fp32 state "
            "in host memory; drop the dtypes",
        )
        return
    if training.main_grads_dtype == "bf16":
        _require(training.bf16, "--main-grads-dtype bf16 needs --bf16; drop it")
        _require(
            not parallel.accumulate_allreduce_grads_in_fp32,
            "--main-grads-dtype bf16 and --accumulate-allreduce-grads-in-fp32 contradict each "
            "other (as in Megatron-LM); give one",
        )
        parallel.grad_reduce_in_bf16 = True
    half = training.bf16 or training.fp16
    _require(
        training.main_params_dtype == "fp32" or half,
        "--main-params-dtype fp16 keeps masters of --bf16 or --fp16 weights; an fp32 run's "
        "weights are their own masters: drop it",
    )
    _require(
        training.main_params_dtype == "fp32" or not config.fp8.fp8_param_gather,
        "--main-params-dtype fp16 with --fp8-param-gather is not built (the FP8 weights keep "
        "fp32 masters); drop one",
    )
