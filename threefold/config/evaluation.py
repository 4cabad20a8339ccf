"""Evaluation, as Megatron-LM's: when (every --eval-interval iterations from
--start-eval-at-iter, and after training; --skip-train for nothing else), how much (--eval-iters
steps, each of --eval-global-batch-size samples in micro-batches of --eval-micro-batch-size, by
default training's sizes; --full-validation: the whole validation split, or each of
--multiple-validation-sets) and where on the validation split (each evaluation reads on from
the last; --full-validation's from its start).

`TrainingConfig` inherits the fields; `finalize_evaluation` is called from its finalize, once
the global batch size is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import arg


@dataclass
class EvaluationConfig:
    eval_interval: int = arg(
        1000, help="evaluate on the validation split every this many iterations (and at the end)"
    )
    eval_iters: int = arg(100, help="global batches per evaluation (0: none)")
    start_eval_at_iter: int | None = arg(
        None,
        minimum=0,
        help="evaluate during training only from this iteration on (default: from the first "
        "--eval-interval); the evaluation after training is kept",
    )
    skip_train: bool = arg(
        False,
        help="evaluate the model (--load's, without its optimizer state) on the validation split "
        "from its start and on the test split, --eval-iters global batches each, without "
        "training or saving",
    )
    full_validation: bool = arg(
        False,
        help="each evaluation reads the whole validation split, every sample once (one epoch "
        "of it, not --eval-iters global batches), its loss the mean over its tokens",
    )
    multiple_validation_sets: bool = arg(
        False,
        help="evaluate each --valid-data-path dataset on its own, whole (with "
        "--full-validation), its loss on a line of its own ('validation-NAME loss at ...')",
    )
    validation_set_names: list[str] = arg(
        default_factory=list,
        help="the names of the --multiple-validation-sets, one per --valid-data-path dataset "
        "(default: their positions, 0 1 ...)",
    )
    eval_global_batch_size: int | None = arg(
        None, help="samples per evaluation step; default --global-batch-size"
    )
    eval_micro_batch_size: int | None = arg(
        None,
        help="samples per evaluation forward on each data-parallel rank; default "
        "--micro-batch-size",
    )

    def finalize_evaluation(
        self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int
    ) -> None:
        _require(self.eval_interval >= 1, "--eval-interval must be >= 1")
        _require(self.eval_iters >= 0, "--eval-iters must be >= 0")
        _require(
            not self.skip_train or self.eval_iters > 0 or self.full_validation,
            "--skip-train only evaluates, --eval-iters global batches of each split; give "
            "--eval-iters 1 or more",
        )
        _require(
            not self.multiple_validation_sets or self.full_validation,
            "--multiple-validation-sets evaluates each set whole: add --full-validation "
            "(as Megatron-LM requires)",
        )
        _require(
            not self.validation_set_names or self.multiple_validation_sets,
            "--validation-set-names names the --multiple-validation-sets: add that flag",
        )
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

    def evaluation_samples(self) -> int:
        """The samples one evaluation reads: --eval-iters global batches of evaluation's size
        (the test split's still under --full-validation, whose validation reads its whole
        split, a size only the data knows)."""
        return self.eval_iters * self.eval_global_batch_size

    def evaluates(self, split: int) -> bool:
        """Whether evaluations read split 1 (validation) or 2 (test) at all."""
        return self.eval_iters > 0 or (split == 1 and self.full_validation)

    def validation_set_name(self, index: int) -> str:
        """What Megatron-LM's report calls validation set `index`: `validation`, or with
        --multiple-validation-sets `validation-NAME` (`validation-0` without names)."""
        if not self.multiple_validation_sets:
            return "validation"
        names = self.validation_set_names
        return f"validation-{names[index] if names else index}"

    def evaluates_at(self, iteration: int) -> bool:
        """Whether training evaluates after `iteration` (the evaluation after training aside)."""
        return iteration % self.eval_interval == 0 and iteration >= (self.start_eval_at_iter or 0)

    def validation_samples_read(self, iteration: int) -> int:
        """The validation samples the evaluations up to `iteration` read, one every
        --eval-interval iterations from --start-eval-at-iter: Megatron-LM's count (its
        formula, which takes the evaluation at a --start-eval-at-iter on the interval for
        skipped too), for the split's size and a checkpoint that does not hold the count.
        --full-validation reads the split from its start every time, so it counts none."""
        if self.full_validation:
            return 0
        skipped = (self.start_eval_at_iter or 0) // self.eval_interval
        return max(0, iteration // self.eval_interval - skipped) * self.evaluation_samples()
