"""The one line a job of many ranks prints when it has to stop: once, by the first rank to
reach it, whichever that is.

Before the process groups exist every rank meets the same refusal (the same flags, the same
files), so local rank 0 prints it (threefold/arguments.py). After start-up ranks can meet
different ones: a file one node lacks, a cache or a checkpoint shard only some ranks read, a
save that failed on one rank's disk. Rank 0 printing alone lost the line of a refusal only
another rank met: that rank exited 2 and nothing said why. Every rank printing repeats a
refusal they all meet once per rank. So each distinct line is claimed in the job's
rendezvous store, which a rank reaches without a collective (its peers may be blocked in
one, waiting for it), and printed by the rank that claimed it.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import time

import torch.distributed as dist

# Rank 0's line is the plain one: the other ranks give it this much of a head start (only
# a failing run waits it; torchrun stops the job once one rank has exited).
RANK_ZERO_FIRST_S = 1.0
# A store that went with its host (rank 0, launched without torchrun's agent) is not waited
# for: the line is printed anyway.
_STORE_TIMEOUT = datetime.timedelta(seconds=5)
# Rank 0 waits at most this long for the other ranks' claims before it exits: launched
# without torchrun's agent (srun, a job's own ranks) its process hosts the store, and a claim
# on a store gone with it fails, torch printing the socket's C++ stack, and says the line
# again as the rank's own.
PEERS_CLAIM_S = 2 * RANK_ZERO_FIRST_S


def refusal_line(prog: str, error: Exception | str, rank: int) -> str:
    where = "" if rank == 0 else f" on rank {rank}"
    return f"{prog}: error{where}: {error}"


def print_refusal_once(prog: str, error: Exception | str, rank: int) -> None:
    """`prog: error: ...` on stderr, once per job for each distinct refusal; a rank other
    than 0 names itself (`error on rank 3: ...`)."""
    if rank != 0:
        time.sleep(RANK_ZERO_FIRST_S)
    key = "refusal/" + hashlib.sha256(f"{prog}\n{error}".encode()).hexdigest()[:32]
    if _first_to_claim(key):
        print(refusal_line(prog, error, rank), file=sys.stderr, flush=True)
    if rank == 0:
        _await_peers(key)


def _store():
    store = dist.distributed_c10d._get_default_store()  # no public accessor
    store.set_timeout(_STORE_TIMEOUT)
    return store


def _first_to_claim(key: str) -> bool:
    if not dist.is_initialized():
        return True
    try:
        return _store().add(key, 1) == 1
    except Exception:  # noqa: BLE001 (any store failure: better twice than never)
        return True


def _await_peers(key: str) -> None:
    """Until every rank has claimed `key` (met the same refusal), at most PEERS_CLAIM_S;
    not at all where the store is torchrun's agent's, which outlives this process."""
    if not dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    deadline = time.monotonic() + PEERS_CLAIM_S
    try:
        store, ranks = _store(), dist.get_world_size()
        while store.add(key, 0) < ranks and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 (the peers' claims only: the refusal is said already)
        return
