"""The checks on what a training step computes (Megatron-LM's flags; training/numerics.py,
training/rerun.py and training/replica_check.py run them): non-finite losses and gradients,
the rerun state machine's validation of a bad loss, large gradient buckets, loss spikes, and
the data-parallel replicas' weights compared.

`TrainingConfig` inherits the fields; `finalize_result_checks` is called from its finalize.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import arg

RERUN_MODES = ("disabled", "validate_results", "report_stats")


@dataclass
class ResultChecksConfig:
    # On by default, as in Megatron-LM: stop at the first inf/nan loss or gradient, naming the
    # rank (off under fp16's dynamic loss scaling, whose overflows are skipped steps).
    check_for_nan_in_loss_and_grad: bool = arg(
        True,
        flag="--no-check-for-nan-in-loss-and-grad",
        help="do not stop at the first non-finite loss or NaN gradient",
    )
    check_weight_hash_across_dp_replicas_interval: int | None = arg(
        None,
        help="every N iterations (and before the first) compare the data-parallel replicas' "
        "weights by digest and stop, naming what differs, if they are not the same",
        metavar="N",
    )
    # Megatron-LM's rerun state machine (training/rerun.py); Megatron-LM's default is
    # validate_results, threefold's stops at the first bad loss as it always has.
    rerun_mode: str = arg(
        "disabled",
        choices=RERUN_MODES,
        help="validate_results: rerun an iteration whose loss is NaN or Inf to tell a device "
        "fault (exit 17, or 16 to resume elsewhere) from the model's; disabled: stop at once",
    )
    error_injection_rate: int = arg(
        0, help="with validate_results: pretend one in this many results is bad (tests)"
    )
    error_injection_type: str = arg(
        "transient_error",
        choices=("correct_result", "transient_error", "persistent_error"),
        help="what an injected bad result turns out to be",
    )
    result_rejected_tracker_filename: str | None = arg(
        None,
        help="with validate_results: append a line per rejected result to this file, and skip "
        "each iteration it shows rejected twice on one rank (and on no other rank of a job)",
    )
    # Megatron-LM's: an iteration whose global batch is read past, untrained (a batch that
    # makes the loss spike, or that the rerun machine found the model computes badly)
    iterations_to_skip: list[int] | None = arg(
        None,
        nargs="+",
        metavar="N",
        help="iterations (counted from 1) whose global batch is passed over: no forward, "
        "backward or update; iteration and consumed samples move on",
    )
    test_mode: bool = arg(
        False,
        help="compare the replicas' weights every iteration, and the weights each "
        "tensor-parallel rank holds whole (norms) across TP too",
    )
    check_for_large_grads: bool = arg(
        False,
        help="report a gradient bucket whose norm on this rank, before its reduction, is 10x "
        "the largest of the first 100 (Megatron-LM's check, which warns unless reruns validate)",
    )
    check_for_spiky_loss: bool = arg(
        False, help="log the batch of any loss above --spiky-loss-factor x the recent mean"
    )  # log batches whose loss jumps (see training/numerics)
    spiky_loss_factor: float = arg(
        10.0, help="with --check-for-spiky-loss: how many times the recent mean is a spike"
    )

    def finalize_result_checks(self) -> None:
        _require(self.spiky_loss_factor > 1, "--spiky-loss-factor must be above 1")
        _require(
            self.rerun_mode != "report_stats",
            "--rerun-mode report_stats (rerunning every iteration to measure nondeterminism) "
            "is not implemented; use validate_results or disabled",
        )
        validating = self.rerun_mode == "validate_results"
        _require(self.error_injection_rate >= 0, "--error-injection-rate must be >= 0")
        _require(
            validating
            or (self.error_injection_rate == 0 and not self.result_rejected_tracker_filename),
            "--error-injection-rate and --result-rejected-tracker-filename belong to "
            "--rerun-mode validate_results; add it or drop them",
        )
        _require(
            not validating or self.check_for_nan_in_loss_and_grad,
            "--rerun-mode validate_results validates the losses --check-for-nan-in-loss-and-grad "
            "checks; drop --no-check-for-nan-in-loss-and-grad (under fp16 dynamic loss scaling "
            "a bad loss is a skipped step instead)",
        )
        tracker = self.result_rejected_tracker_filename
        skipped = set(self.iterations_to_skip or ())
        _require(all(n >= 1 for n in skipped), "--iterations-to-skip takes iterations from 1 on")
        if tracker and os.path.isfile(tracker):  # (as Megatron-LM's validate_args does)
            skipped |= set(rejected_iterations(tracker))
        self.iterations_to_skip = sorted(skipped) or None
        where = os.path.dirname(os.path.abspath(tracker)) if tracker else None
        _require(
            where is None or os.access(where, os.W_OK),
            f"--result-rejected-tracker-filename {tracker}: {where} is not a writable directory",
        )
        _require(
            not (self.check_for_large_grads and validating),
            "--check-for-large-grads with --rerun-mode validate_results: Megatron-LM would "
            "rerun such an iteration; threefold's reruns validate losses only, and report large "
            "gradients without them: drop one",
        )
        if self.test_mode and self.check_weight_hash_across_dp_replicas_interval is None:
            self.check_weight_hash_across_dp_replicas_interval = 1  # every iteration
        interval = self.check_weight_hash_across_dp_replicas_interval
        _require(
            interval is None or interval >= 1,
            "--check-weight-hash-across-dp-replicas-interval must be >= 1",
        )


# A result-rejected tracker line (training/rerun.py writes them, as Megatron-LM does)
TRACKED = re.compile(
    r"ts=.+ node=.+ device=.+ jobID=(.+) rank=(.+) iteration=(.+) status=(.+) result="
)
# statuses of a bad result that came out again (or was never rerun)
REPRODUCED = ("RERUN_DISABLED", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_REPRODUCIBLE")


def rejected_iterations(tracker: str) -> list[int]:
    """Megatron-LM's iterations to skip from a result-rejected tracker: those rejected twice
    on the same rank, unless one job rejected them on several ranks (then it was not the
    data, and skipping would hide a fault)."""
    seen: set[tuple[int, int]] = set()
    twice: set[int] = set()
    ranks_by_job: dict[tuple[str, int], set[int]] = {}
    with open(tracker, errors="replace") as f:
        for line in f:
            found = TRACKED.search(line)
            if not found or found[4].split(".")[-1].upper() not in REPRODUCED:
                continue
            job, rank, iteration = found[1], int(found[2]), int(found[3])
            if (rank, iteration) in seen:
                twice.add(iteration)
            seen.add((rank, iteration))
            ranks_by_job.setdefault((job, iteration), set()).add(rank)
    several = {i for (_, i), ranks in ranks_by_job.items() if len(ranks) > 1}
    return sorted(twice - several)
