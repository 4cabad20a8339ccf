"""Megatron-LM's `--deterministic-mode`: runs that repeat bitwise on the same GPUs and software.

What it sets, as Megatron-LM does, before the first collective or kernel:
- NCCL_ALGO=Ring (NVLS and tree all-reduces may sum in another order from one run to the
  next), CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS's deterministic workspace) and
  NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (Transformer Engine's deterministic attention backward);
  a value the user set is kept when it is one of the deterministic ones, refused otherwise;
- torch.use_deterministic_algorithms(True) (an op without a deterministic kernel then fails
  instead of varying) and cuDNN's deterministic, non-benchmarked algorithms.
And threefold's own part, in kernels/dispatch.py: SDPA's FlashAttention and cuDNN backends
accumulate dQ with atomics in their backward, so `auto` picks among memory-efficient (whose
backward is deterministic under torch.use_deterministic_algorithms) and math only. Megatron-LM
also requires its fused cross-entropy off; threefold's chunked cross-entropy has no atomics.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from threefold.config import ConfigError

DEFAULTS = {
    "NCCL_ALGO": "Ring",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}
_NCCL_ALGOS = {"Ring", "CollnetDirect", "CollnetChain", "^NVLS"}
_ACCEPTED = {
    "CUBLAS_WORKSPACE_CONFIG": {":4096:8", ":16:8"},
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": {"0"},
}


def deterministic_environment(env: MutableMapping[str, str] = os.environ) -> None:
    """Check the determinism variables the user set, then fill in the rest."""
    algos = env.get("NCCL_ALGO")
    if algos is not None:
        tokens = [token.strip() for token in algos.split(",") if token.strip()]
        if not tokens or not set(tokens) <= _NCCL_ALGOS:
            raise ConfigError(
                f"--deterministic-mode: NCCL_ALGO={algos} may reorder sums between runs; "
                f"unset it or use one of {', '.join(sorted(_NCCL_ALGOS))}"
            )
    for name, accepted in _ACCEPTED.items():
        if env.get(name) is not None and env[name] not in accepted:
            raise ConfigError(
                f"--deterministic-mode: {name}={env[name]} is not deterministic; unset it or "
                f"use {' or '.join(sorted(accepted))}"
            )
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)


def use_deterministic_algorithms() -> str:
    """torch's deterministic kernels (idempotent); the `> kernels:` line's entry."""
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return (
        "deterministic (torch deterministic algorithms, "
        + ", ".join(f"{name}={os.environ.get(name)}" for name in DEFAULTS)
        + ")"
    )
