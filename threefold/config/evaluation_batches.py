"""Evaluation's own batch sizes (Megatron-LM's --eval-global-batch-size and
--eval-micro-batch-size): each of --eval-iters evaluation steps reads --eval-global-batch-size
samples in micro-batches of --eval-micro-batch-size, both by default training's.

`TrainingConfig` inherits the fields; `finalize_eval_batches` is called from its finalize, once
the global batch size is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import arg


@dataclass
class EvalBatchConfig:
    eval_global_batch_size: int | None = arg(
        None, help="samples per evaluation step; default --global-batch-size"
    )
    eval_micro_batch_size: int | None = arg(
        None,
        help="samples per evaluation forward on each data-parallel rank; default "
        "--micro-batch-size",
    )

    def finalize_eval_batches(
        self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int
    ) -> None:
        if self.eval_global_batch_size is None:
            self.eval_global_batch_size = global_batch_size
        if self.eval_micro_batch_size is None:
            self.eval_micro_batch_size = micro_batch_size
        size, micro = self.eval_global_batch_size, self.eval_micro_batch_size
        _require(
            size >= 1 and micro >= 1,
            "--eval-global-batch-size and --eval-micro-batch-size must be >= 1",
        )
        per_step = micro * data_parallel_size
        _require(
            size % per_step == 0,
            f"--eval-global-batch-size {size} is not divisible by --eval-micro-batch-size "
            f"{micro} x data-parallel size {data_parallel_size}; use a multiple of {per_step}",
        )

    def num_eval_micro_batches(self, data_parallel_size: int) -> int:
        return self.eval_global_batch_size // (self.eval_micro_batch_size * data_parallel_size)
