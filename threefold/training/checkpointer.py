"""The run's checkpoints: when to save, saving (blocking or in the background) and reporting.

The trainer hands over a way to get its `CheckpointComponents`; what is saved, and how, is
threefold/checkpoint/'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from threefold.checkpoint.components import CheckpointComponents
from threefold.checkpoint.megatron.training_save import save_megatron_training_checkpoint
from threefold.checkpoint.save import save_checkpoint
from threefold.checkpoint.writer import CheckpointWriter
from threefold.config import CheckpointConfig
from threefold.training.observability import Observability


class Checkpointer:
    def __init__(
        self,
        config: CheckpointConfig,
        components: Callable[[], CheckpointComponents],
        observability: Observability,
    ) -> None:
        self.config, self.components, self.observability = config, components, observability
        self.writer = (
            CheckpointWriter(
                config.save,
                config.async_save,
                keep_latest=config.ckpt_keep_latest,
                retain_interval=config.save_retain_interval,
            )
            if config.save
            else None
        )
        # --non-persistent-save-interval: its own directory, only the newest kept
        where = config.non_persistent_dir(config.save)
        self.non_persistent = (
            CheckpointWriter(where, config.async_save, keep_latest=1)
            if config.non_persistent_save_interval and where
            else None
        )
        self.last_saved = None  # the iteration whose checkpoint is (being) written, or loaded
        self.last_path: str | None = None  # its directory, once written by this run

    def due(self, iteration: int) -> bool:
        """--save-interval says so, given --save (the loop saves the last iteration itself)."""
        interval = self.config.save_interval
        return bool(self.config.save and interval and iteration % interval == 0)

    def non_persistent_due(self, iteration: int) -> bool:
        """--non-persistent-save-interval says so, and no persistent save is due."""
        interval = self.config.non_persistent_save_interval
        return (
            self.non_persistent is not None
            and iteration % interval == 0
            and not self.due(iteration)
        )

    def save(self, iteration: int, non_persistent: bool = False) -> None:
        watch = self.observability
        watch.watchdog.enter("checkpoint save", iteration)
        self.wait()
        writer = self.non_persistent if non_persistent else self.writer
        kind = "non-persistent checkpoint" if non_persistent else "checkpoint"
        start = time.perf_counter()
        with watch.timers("save-checkpoint", 0):
            save = save_checkpoint
            if self.config.ckpt_format == "torch_dist":  # (Megatron-LM's layout)
                save = save_megatron_training_checkpoint
            path = save(writer.root, self.components(), writer)
        if not non_persistent:  # (what the end of the run need not save again)
            self.last_saved, self.last_path = iteration, path
        blocked = time.perf_counter() - start
        if writer.asynchronous:
            watch.print(
                f"  started saving {kind} at iteration {iteration} in the "
                f"background ({blocked:.2f} s blocked)"
            )
        else:
            watch.print(f"  saved {kind} at iteration {iteration} to {path} in {blocked:.2f} s")
        watch.print_timers(["save-checkpoint"])
        watch.restart_window()

    def save_final(self, iteration: int) -> None:
        """At the end of training (with --save): save unless this iteration is on disk or being
        written already, and wait until every save is complete."""
        if self.config.save and self.last_saved != iteration:
            self.save(iteration)
        self.wait()

    def poll(self) -> None:
        """After each iteration: note a background save that completed; raise
        CheckpointSaveError for one that failed (not one interval later, at the next save)."""
        for writer in (self.writer, self.non_persistent):
            if writer is not None:
                self._saved(writer.poll())

    def wait(self) -> None:
        """Wait for an --async-save to complete everywhere (the tracker then names it)."""
        for writer in (self.writer, self.non_persistent):
            if writer is not None:
                self._saved(writer.wait())

    def _saved(self, iteration: int | None) -> None:
        if iteration is not None:
            self.observability.print(f"  checkpoint at iteration {iteration} complete")
