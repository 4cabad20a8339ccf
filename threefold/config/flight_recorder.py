"""Megatron-LM's NCCL flight recorder flags: with a dump path, PyTorch keeps a ring of each
rank's last collectives and writes it out when one times out (or the process is killed), so a
hang says which collective each rank was in. They are PyTorch's environment variables,
set before the first process group as Megatron-LM sets them (parallel/flight_recorder.py);
one already in the environment wins. Off without a path, as in Megatron-LM; the recorder is
NCCL's, so a gloo run's hangs are named by threefold's watchdog instead (docs/reliability.md).

`ParallelConfig` inherits the fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.fields import arg


@dataclass
class FlightRecorderConfig:
    flight_recorder_dump_path: str | None = arg(
        None,
        help="write NCCL's flight recorder trace here (a directory: a file per rank in it) "
        "when a collective times out (TORCH_FR_DUMP_TEMP_FILE)",
    )
    flight_recorder_trace_buffer_size: int = arg(
        2000,
        minimum=1,
        help="collectives each rank's recorder keeps (TORCH_NCCL_TRACE_BUFFER_SIZE)",
    )
    flight_recorder_dump_on_timeout: bool = arg(
        True,
        flag="--no-flight-recorder-dump-on-timeout",
        help="do not dump the trace when a collective times out (TORCH_NCCL_DUMP_ON_TIMEOUT)",
    )
    flight_recorder_include_stack_trace: bool = arg(
        False, help="each collective's Python stack in the trace (TORCH_INCLUDE_STACK_TRACE)"
    )
    flight_recorder_include_only_active: bool = arg(
        True,
        flag="--no-flight-recorder-include-only-active",
        help="dump finished collectives too, not only those in flight (TORCH_INCLUDE_ONLY_ACTIVE)",
    )
    flight_recorder_extra_dump_on_exec: bool = arg(
        True,
        flag="--no-flight-recorder-extra-dump-on-exec",
        help="no extra dump when the process ends on an error (TORCH_NCCL_EXTRA_DUMP_ON_EXEC)",
    )
