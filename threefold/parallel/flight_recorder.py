"""The NCCL flight recorder's environment (config/flight_recorder.py), set before the first
process group: PyTorch reads it when a NCCL group is made."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# the dump path's two variables (the older name is NCCL's debug-info file)
PATH_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def flight_recorder_environment(
    parallel, environ: MutableMapping[str, str] = os.environ
) -> list[str]:
    """Set the recorder's variables from `parallel`'s flags where a dump path is given (by
    --flight-recorder-dump-path or already in `environ`), leaving any already set, as
    Megatron-LM does; returns the lines that say what was set and what was kept."""
    path = parallel.flight_recorder_dump_path or next(
        (environ[name] for name in PATH_VARIABLES if name in environ), None
    )
    if path is None:
        return []
    prefix = os.path.join(path, "_dump_") if os.path.isdir(path) else path  # (then per rank)
    wanted = {
        **dict.fromkeys(PATH_VARIABLES, prefix),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(parallel.flight_recorder_trace_buffer_size),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": str(int(parallel.flight_recorder_dump_on_timeout)),
        "TORCH_INCLUDE_STACK_TRACE": str(int(parallel.flight_recorder_include_stack_trace)),
        "TORCH_INCLUDE_ONLY_ACTIVE": str(int(parallel.flight_recorder_include_only_active)),
        "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": str(int(parallel.flight_recorder_extra_dump_on_exec)),
    }
    kept = [name for name in wanted if name in environ and environ[name] != wanted[name]]
    for name, value in wanted.items():
        environ.setdefault(name, value)
    lines = ["> flight recorder: " + " ".join(f"{n}={environ[n]}" for n in wanted)]
    lines += [f"> flight recorder: {n} kept as the environment sets it" for n in kept]
    return lines
