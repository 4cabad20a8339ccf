"""Out of memory, said in one line: what the run was doing, what torch could not allocate, and
what threefold's estimate says the layout needs a device (training/memory_estimate.py), with
the levers that lower it. torch's own error is a traceback per rank that names a line of the
model, not the flags that decide how much memory a device needs.

A model built too large, or a micro-batch whose activations do not fit, is a configuration
the device cannot hold: it is refused as a ConfigError (exit code 2, one line), like any other
flag that cannot work.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

from threefold.config import Config, ConfigError
from threefold.training.memory_estimate import estimate_memory
from threefold.training.strategy import device_memory_bytes

GIB = 2**30
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# torch's CUDA allocator: "Tried to allocate 2.00 GiB"; its CPU one (a RuntimeError, not an
# OutOfMemoryError): "DefaultCPUAllocator: can't allocate memory: you tried to allocate
# 120000000000 bytes"
_REQUEST = re.compile(r"[Tt]ried to allocate ([\d.]+) (bytes|[KMGT]iB)")


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


def out_of_memory_line(error: BaseException, config: Config, during: str) -> str:
    request = _REQUEST.search(str(error))
    asked = (
        f"{float(request[1]) * _UNITS[request[2]] / GIB:.2f} GiB more" if request else "more memory"
    )
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    has = device_memory_bytes(device)  # (the host's: shared by its ranks)
    line = f"out of memory {during}: torch could not allocate {asked} of the {has / GIB:.1f} "
    line += f"GiB a rank has on this {device.type}"
    try:
        need = estimate_memory(config)
        fp8 = f", {need.fp8_weights / GIB:.1f} GiB of FP8 weight copies" if need.fp8_weights else ""
        line += (
            f"; by threefold's estimate this layout needs about {need.total / GIB:.1f} GiB a "
            f"device ({need.static / GIB:.1f} GiB of weights, gradients and optimizer state, "
            f"{need.activations / GIB:.1f} GiB of activations{fp8}; tools/estimate_memory.py "
            "shows each stage)"
        )
    except Exception:  # noqa: BLE001 (the line must come out; the estimate only adds to it)
        pass
    return (
        line + ". Spread the model over more devices (--tensor-model-parallel-size, "
        "--pipeline-model-parallel-size, --use-distributed-optimizer), recompute activations "
        "(--recompute-activations) or lower --micro-batch-size; tools/plan_layout.py plans a "
        "layout that fits"
    )


@contextlib.contextmanager
def out_of_memory_refused(config: Config, during: str) -> Iterator[None]:
    """Inside, running out of memory raises a ConfigError of one line, `out_of_memory_line`."""
    try:
        yield
    except RuntimeError as error:  # (torch.OutOfMemoryError is one)
        if not is_out_of_memory(error):
            raise
        raise ConfigError(out_of_memory_line(error, config, during)) from None
