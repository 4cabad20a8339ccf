"""Point-to-point communication between pipeline stages, device-agnostic.

Activations flow to the next rank of the pipeline ring and gradients to the previous one. Each
direction has its own process group, so messages of the two kinds can never be confused, even
when the previous and the next rank are the same peer (two stages with virtual stages, where
megatron-core's batched p2p mismatches them). Within one group, messages between two ranks are
sent and received in the same order by construction of the schedules.

Sends are asynchronous: `send` returns at once and the schedule waits for all sends at its end.
Receives block until the data is there. Shapes are known ahead (sequence x micro-batch x hidden,
the sequence divided by TP under sequence parallelism), so no shapes are exchanged.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from threefold.parallel.parallel_context import Group

_GROUPS: dict[str, dist.ProcessGroup] = {}


def initialize_p2p_groups(pipelines: list[list[int]], timeout_minutes: float = 10) -> None:
    """Create the activation and gradient groups of every pipeline (its ranks, first stage
    first); all ranks must call this. A receive that waits longer than the timeout fails
    instead of hanging the job."""
    _GROUPS.clear()
    if len(pipelines[0]) == 1:
        return
    for ranks in pipelines:
        for kind in ("activation", "gradient"):
            group = dist.new_group(ranks, timeout=datetime.timedelta(minutes=timeout_minutes))
            if dist.get_rank() in ranks:
                _GROUPS[kind] = group


def destroy_p2p_groups() -> None:
    _GROUPS.clear()  # the groups themselves are destroyed with the others by state


class P2P:
    """Sends and receives of one schedule run between the stages of the pipeline group `pp`."""

    def __init__(self, pp: Group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.pp = pp
        self.shape, self.dtype, self.device = shape, dtype, device
        self.pending: list = []

    def _ring_rank(self, offset: int) -> int:
        ranks = dist.get_process_group_ranks(self.pp.group)
        return ranks[(self.pp.rank + offset) % len(ranks)]

    def _send(self, tensor: torch.Tensor, kind: str, offset: int) -> None:
        tensor = tensor.detach().contiguous()
        work = dist.isend(tensor, dst=self._ring_rank(offset), group=_GROUPS[kind])
        self.pending.append((work, tensor))  # keep the buffer alive until the send completes

    def _recv(self, kind: str, offset: int) -> torch.Tensor:
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        source = self._ring_rank(offset)
        try:
            dist.irecv(tensor, src=source, group=_GROUPS[kind]).wait()
        except RuntimeError as error:
            raise RuntimeError(
                f"rank {dist.get_rank()} (pipeline stage {self.pp.rank})"
                f" timed out receiving the {kind} from rank {source}: that rank is stalled, dead"
                f" or on another schedule ({error})"
            ) from None
        return tensor

    def send_forward(self, activation: torch.Tensor) -> None:
        self._send(activation, "activation", +1)

    def recv_forward(self) -> torch.Tensor:
        return self._recv("activation", -1)

    def send_backward(self, gradient: torch.Tensor) -> None:
        self._send(gradient, "gradient", -1)

    def recv_backward(self) -> torch.Tensor:
        return self._recv("gradient", +1)

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
