"""`--rerun-mode validate_results`: Megatron-LM's rerun state machine, which tells a fault of the
device from a fault of the model or data when a loss comes out NaN or Inf.

With `--check-for-nan-in-loss-and-grad`, each rank of the last pipeline stage validates its own
loss of the iteration (the sum over its micro-batches):

1. A rank whose loss is NaN or Inf (or that `--error-injection-rate` picks) makes every rank run
   the iteration again in place: the same micro-batches, the RNG streams, FP8 amaxes and MoE
   counts as they were before it.
2. If the rerun does not reproduce the result, the device erred once: "Possible transient
   error!", exit 17, nothing saved. If it does, the device may err every time: the state before
   the iteration is saved (a checkpoint of the iteration before, unless one exists, and
   `rerun_state.json` beside the tracker with each rank's result, node and device) and the job
   exits 16, to be resumed on other devices.
3. The resumed job reruns that iteration first. On the same node and device it exits 16 again.
   Elsewhere, a different result means the first device computes this iteration wrongly every
   time ("Possible persistent error!"); the same result, that it was right and the model or data
   produced it ("Correct result (but possible Application error)"): exit 17 either way.

As in Megatron-LM, a job's first iteration is not validated (its optimizer has not stepped, so
there is no state to rerun from) unless it is such a rerun: a bad loss there stops the run as
without the mode. `--result-rejected-tracker-filename` appends a line per event. The lines and
exit codes are Megatron-LM's. `disabled` (threefold's default; Megatron-LM defaults to
validate_results) stops at the first bad loss; `report_stats` is not implemented.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
from collections.abc import Callable

import torch
import torch.distributed as dist

from threefold.checkpoint.save import rng_state, set_rng_state
from threefold.training import faults
from threefold.written_aside import write_atomically

EXIT_RESUME_TO_DISAMBIGUATE = 16  # Megatron-LM's EXIT_CODE_RESUME_TO_DISAMBIGUATE
EXIT_FAILED_ON_RESULT_VALIDATION = 17  # its EXIT_CODE_FAILED_ON_RESULT_VALIDATION
STATE_FILE = "rerun_state.json"
MESSAGE = "found NaN or Inf in local forward loss calculation"
_INJECTED = {"correct_result": "Expected result", "transient_error": "Transient error"}
_INJECTED["persistent_error"] = "Persistent error"


class RerunExit(Exception):  # noqa: N818 (an exit, not an error of the program)
    """The diagnosis is made (or needs another device): leave with `code` after `message`;
    `save` asks for the state before the iteration to be saved first."""

    def __init__(self, code: int, message: str, save: bool = False) -> None:
        super().__init__(message)
        self.code, self.save = code, save


def _same(first: float, second: float) -> bool:
    """Megatron-LM's comparison at tolerance 0: equal, or both NaN."""
    return first == second or (math.isnan(first) and math.isnan(second))


class ResultValidation:
    """The validation of one job's iterations, for a TrainingConfig; `world` is the job's
    world group. The error injection draws from `training.seed` (as Megatron-LM's: one rank
    in every `error_injection_rate`)."""

    def __init__(self, training, world, device: torch.device) -> None:
        self.enabled = training.rerun_mode == "validate_results"
        self.rate, self.kind = training.error_injection_rate, training.error_injection_type
        self.tracker_file = training.result_rejected_tracker_filename
        self.world, self.device = world, device
        self.random = random.Random(training.seed)
        self.injected: str | None = None  # the injected error's kind, until diagnosed
        self.first_done = False
        self.pending: dict | None = None  # a rerun from a checkpoint: its saved state
        self.suspect: dict | None = None  # after a reproducible first rerun: what to save
        self.announced = False

    # -- where this process runs (what "another device" means) -------------------------------
    def location(self) -> tuple[str, int]:
        """(node, device index): the GPU's, or on CPUs the process's local rank."""
        node = faults.node_name() or os.uname()[1]
        if self.device.type == "cuda":
            return node, torch.cuda.current_device()
        return node, int(os.environ.get("LOCAL_RANK", 0))

    def _log(self, message: str, iteration: int) -> None:
        """Megatron-LM's failure line (which appends "!" to the message)."""
        node, device = self.location()
        print(
            f"ERROR: Rank {self.world.rank}, node {node}, device {device}, iteration "
            f"#{iteration}: {message}!",
            flush=True,
        )

    def _track(self, status: str, iteration: int, result: float) -> None:
        if self.tracker_file is None:
            return
        node, device = self.location()
        job = os.environ.get("SLURM_JOBID", "N/A")
        with open(self.tracker_file, "a") as f:
            f.write(
                f"ts={datetime.datetime.now()} node={node} device={device} jobID={job} "
                f"rank={self.world.rank} iteration={iteration} status={status} "
                f"result={result} message='{MESSAGE}'\n"
            )

    def _any(self, flag: bool) -> bool:
        value = torch.tensor([float(flag)], device=self.device)
        if self.world.size > 1:
            dist.all_reduce(value, group=self.world.group)
        return bool(value.item())

    def _maybe_inject(self) -> bool:
        if self.rate <= 0 or self.injected is not None:
            return False
        if (self.random.randint(0, self.rate - 1) + self.world.rank) % self.rate:
            return False
        self.injected = self.kind
        print(f"WARNING: Injecting error type {_INJECTED[self.kind]}", flush=True)
        return True

    # -- the step ------------------------------------------------------------------------------
    def validate(
        self, iteration: int, losses: list[torch.Tensor], rerun: Callable[[], list[torch.Tensor]]
    ) -> list[torch.Tensor]:
        """This iteration's losses, validated (rerun in place when a rank's is rejected);
        raises RerunExit when the job must stop. `losses` are this rank's [total, weight]
        pairs of its micro-batches (none off the last pipeline stage); `rerun` runs the
        iteration again from the state before it and returns the new ones."""
        if not self.enabled:
            return losses
        if not self.announced:
            self.announced = True
            if self.world.rank == 0:
                print("WARNING: Result validation enabled", flush=True)
        result = float(torch.stack(losses).sum(0)[0]) if losses else None
        if self.pending is not None:
            self._second_rerun(iteration, result)
        first, self.first_done = not self.first_done, True
        rejected = result is not None and not first
        rejected = rejected and (self._maybe_inject() or not math.isfinite(result))
        if not self._any(rejected):
            return losses
        if rejected:
            print(
                f"ERROR: Unexpected result {result} on rank {self.world.rank} at iteration "
                f"#{iteration} invocation #1 (message='{MESSAGE}')",
                flush=True,
            )
            self._track("RerunValidationStatus.INITIAL_RUN", iteration, result)
        if self.world.rank == 0:
            print(
                "WARNING: Need to rerun step to check reproducibility of initial result", flush=True
            )
        losses = rerun()
        again = float(torch.stack(losses).sum(0)[0]) if losses else None
        reproduced = True
        if rejected:
            if self.injected is not None:
                reproduced = self.injected != "transient_error"
            else:
                reproduced = _same(result, again)
        if self._any(not reproduced):
            if not reproduced:
                self._log(
                    "First rerun: unexpected result is not reproducible within the tolerance "
                    f"({again} != {result})",
                    iteration,
                )
                self._track("RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE", iteration, again)
                self._log("Possible transient error!", iteration)
            raise RerunExit(
                EXIT_FAILED_ON_RESULT_VALIDATION,
                "Exiting now. The job can be resumed from a previous checkpoint",
            )
        if rejected:
            self._track("RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE", iteration, again)
            self._log(
                "First rerun: unexpected result is reproducible within the tolerance "
                f"({again} = {result}). Need to rerun on a different GPU to verify correctness.",
                iteration,
            )
        node, device = self.location()
        self.suspect = {
            "rejected": rejected,
            "result": result,
            "node": node,
            "device": device,
            "injected": self.injected,
        }
        raise RerunExit(
            EXIT_RESUME_TO_DISAMBIGUATE,
            "Saving a checkpoint and exiting now. Please resume the job from the checkpoint "
            "to rerun the last iteration and establish a diagnostic",
            save=True,
        )

    def _second_rerun(self, iteration: int, result: float | None) -> None:
        mine, self.pending = self.pending, None
        if mine["rejected"]:
            self.injected = mine["injected"]
            here = self.location()
            if here == (mine["node"], mine["device"]):
                print(
                    "ERROR: Got rescheduled on the same GPU. Need to resume again from the "
                    f"same checkpoint (node: {mine['node']}, gpu: {mine['device']})",
                    flush=True,
                )
                status = "same"
            else:
                if self.injected is not None:
                    same = self.injected == "correct_result"
                else:
                    same = result is not None and _same(mine["result"], result)
                status = "correct" if same else "persistent"
                if same:
                    self._track(
                        "RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE", iteration, result
                    )
                    print(
                        "WARNING: Second rerun: unexpected result is reproducible on a different "
                        f"GPU, therefore it was likely correct ({result} = {mine['result']})",
                        flush=True,
                    )
                    self._log(
                        f"Correct result (but possible Application error) ({MESSAGE})", iteration
                    )
                else:
                    self._track(
                        "RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE", iteration, result
                    )
                    print(
                        "WARNING: Second rerun: unexpected result is not reproducible on a "
                        "different GPU, therefore was likely incorrect "
                        f"({result} != {mine['result']})",
                        flush=True,
                    )
                    self._log("Possible persistent error!", iteration)
        else:
            status = "other"
        again = self._any(status == "same")
        if again:
            raise RerunExit(
                EXIT_RESUME_TO_DISAMBIGUATE,
                "Exiting now. Please resume the job from the same checkpoint to rerun the last "
                "iteration and establish a diagnostic",
            )
        raise RerunExit(
            EXIT_FAILED_ON_RESULT_VALIDATION,
            "Exiting now. A checkpoint at the last iteration already exists if further "
            "examination is needed",
        )

    # -- across the restart --------------------------------------------------------------------
    def write_state(self, save_dir: str, iteration: int) -> None:
        """After the checkpoint of the iteration before `iteration`: every rank's suspect
        record into `rerun_state.json` (written by rank 0, atomically)."""
        everyone = [self.suspect]
        if self.world.size > 1:
            everyone = [None] * self.world.size
            dist.all_gather_object(everyone, self.suspect, group=self.world.group)
        if self.world.rank == 0:
            state = {"iteration": iteration, "ranks": everyone}
            write_atomically(os.path.join(save_dir, STATE_FILE), json.dumps(state, indent=1))

    def after_load(self, load_dir: str, iteration: int) -> str | None:
        """Take a pending rerun of iteration `iteration + 1` from `load_dir`; a line to print
        when there is one."""
        path = os.path.join(load_dir, STATE_FILE)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            state = json.load(f)  # plain JSON: numbers, strings, booleans
        if state.get("iteration") != iteration + 1:
            return None
        if not self.enabled:
            return (
                f"> --rerun-mode disabled: ignoring the rerun of iteration {iteration + 1} "
                f"that {path} asks for"
            )
        ranks = state["ranks"]
        if len(ranks) != self.world.size:
            return f"> {path} was written by {len(ranks)} ranks, not {self.world.size}: ignored"
        self.pending = ranks[self.world.rank]
        return (
            f"> rerunning iteration {iteration + 1} from the checkpoint to establish a "
            f"diagnostic ({path})"
        )


class IterationState:
    """What an iteration's forward and backward passes change besides gradients, taken before
    it and put back for a rerun: every RNG stream and the FP8 layers' step amaxes."""

    def __init__(self, fp8) -> None:
        self.rng = rng_state()
        amaxes = [state.step_amax for state in fp8.states.values()] if fp8 is not None else []
        self.amaxes = [(amax, amax.clone()) for amax in amaxes]

    def restore(self) -> None:
        set_rng_state(self.rng)
        for live, saved in self.amaxes:
            live.copy_(saved)
