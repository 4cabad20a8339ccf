"""The start-up the entry scripts share, after their flags and input files are checked: the
process environment `--deterministic-mode` needs (before any NCCL communicator or cuBLAS
handle exists), then torch.distributed and the groups for the layout. A mistake
found here (nccl without a GPU, a determinism variable set to a racy value) is one line and
exit code 2, as a flag mistake is."""

from __future__ import annotations

from threefold.arguments import print_refusal
from threefold.config import Config, ConfigError


def start_processes(config: Config, prog: str):
    """(device, ParallelContext) of this process, or None once the refusal is printed."""
    from threefold.kernels.determinism import deterministic_environment
    from threefold.parallel import state

    try:
        if config.kernels.deterministic_mode:
            deterministic_environment()
        return state.initialize_from_config(config.parallel)
    except ConfigError as error:
        print_refusal(prog, error)
        return None
