"""Expert parallelism: moving tokens to the ranks of their experts and back."""

from threefold.parallel.expert_parallel.dispatcher import build_dispatcher

__all__ = ["build_dispatcher"]
