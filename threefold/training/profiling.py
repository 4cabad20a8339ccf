"""Megatron's --profile: a window of training iterations recorded for a profiler.

Megatron's `iteration` counts completed iterations, so --profile-step-start S and
--profile-step-end E record the iterations the log numbers S + 1 .. E, on the global ranks
--profile-ranks names (default: rank 0).

- with --use-pytorch-profiler: torch.profiler records CPU (and CUDA) activity with shapes and
  Python stacks; the trace goes to --tensorboard-dir as `<rank>.<time>.pt.trace.json`, which
  TensorBoard's profiler plugin, Perfetto and chrome://tracing open;
- without it (CUDA only): the window is bracketed by cudaProfilerStart/Stop and NVTX ranges, for
  `nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop`.
"""

from __future__ import annotations

import contextlib
import os

import torch

from threefold.config import ConfigError, LoggingConfig


class IterationProfiler:
    def __init__(self, config: LoggingConfig, device: torch.device, rank: int) -> None:
        self.config = config
        self.active = config.profile and rank in config.profile_ranks
        self.rank = rank
        self.device = device
        self._profiler = None
        self._nvtx = contextlib.ExitStack()
        if config.profile and not config.use_pytorch_profiler and device.type != "cuda":
            raise ConfigError(
                "--profile without --use-pytorch-profiler drives nsys through the "
                "CUDA profiler API, which needs a GPU; add --use-pytorch-profiler"
            )

    def before_iteration(self, completed: int) -> None:
        if not self.active or completed != self.config.profile_step_start:
            return
        if self.config.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities, record_shapes=True, with_stack=True
            )
            self._profiler.start()
        else:
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx.enter_context(torch.autograd.profiler.emit_nvtx(record_shapes=True))

    def after_iteration(self, completed: int) -> str | None:
        """Ends the window after its last iteration; returns what was written, to log."""
        if not self.active or completed != self.config.profile_step_end:
            return None
        return self.close()

    def close(self) -> str | None:
        """Stops a window still open (training ended or exited inside it)."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
            os.makedirs(self.config.tensorboard_dir, exist_ok=True)
            handler = torch.profiler.tensorboard_trace_handler(
                self.config.tensorboard_dir, worker_name=f"rank{self.rank}"
            )
            handler(profiler)
            return (
                f"> rank {self.rank}: profiler trace of iterations "
                f"{self.config.profile_step_start + 1}-{self.config.profile_step_end} "
                f"written to {self.config.tensorboard_dir}"
            )
        if self._nvtx._exit_callbacks:
            self._nvtx.close()
            torch.cuda.cudart().cudaProfilerStop()
            return f"> rank {self.rank}: CUDA profiler range closed"
        return None
