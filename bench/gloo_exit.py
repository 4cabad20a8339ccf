"""Why a run that succeeded could end in an abort: a gloo group still alive when the
interpreter tears down.

    python bench/gloo_exit.py --runs 20 > bench/results/gloo_exit.md

Each run is a 2-rank torchrun of a script that ends with an all-reduce in flight (its handle
dropped, as a finished collective's is), on a group it created:

- "kept": a reference to the group outlives the script, as threefold's trainer and model
  did past `state.shut_down` (`dist.destroy_process_group` forgets a gloo group but does not
  join its threads). The collective finishes on a gloo thread while the interpreter tears
  down; freeing its tensors needs the GIL, which the thread can no longer take, and the rank
  aborts: "terminate called without an active exception", exit -6.
- "released": the same, the last reference dropped after the destroy, as `shut_down` now
  does (the group's threads are joined there, the collective finished first).

A dropped handle widens the window a waited collective leaves (its thread still releasing
the finished work when the main thread reaches the end); the abort is the same.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile

RANK_SCRIPT = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
group = dist.new_group([0, 1])
tensor = torch.randn(2_000_000)
dist.all_reduce(tensor, group=group, async_op=True)
del tensor
dist.destroy_process_group()
if os.environ["MODE"] == "released":
    del group
"""
MODES = ("kept", "released")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(script: str, mode: str) -> tuple[int, bool]:
    """(torchrun's exit code, whether a rank printed the abort)."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        + ["--master_port", str(_free_port()), script],
        capture_output=True,
        text=True,
        env={**os.environ, "MODE": mode},
        timeout=120,
    )
    return result.returncode, "terminate called" in result.stderr


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0]
    except (OSError, IndexError):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="launches of each mode")
    args = parser.parse_args()
    import torch

    counts = {mode: [0, 0] for mode in MODES}  # failed launches, launches with the abort
    with tempfile.TemporaryDirectory() as directory:
        script = os.path.join(directory, "rank.py")
        with open(script, "w") as f:
            f.write(RANK_SCRIPT)
        for _ in range(args.runs):  # the modes alternate: the machine's load is shared
            for mode in MODES:
                code, aborted = run_once(script, mode)
                counts[mode][0] += code != 0
                counts[mode][1] += aborted
    print(
        f"`python bench/gloo_exit.py --runs {args.runs}`: torch {torch.__version__}, Python "
        f"{platform.python_version()}, {_cpu()}, "
        f"{os.cpu_count()} CPUs.\n"
    )
    print("| the group at exit | launches | failed | a rank aborted |")
    print("|---|---:|---:|---:|")
    for mode in MODES:
        failed, aborted = counts[mode]
        print(f"| {mode} | {args.runs} | {failed} | {aborted} |")


if __name__ == "__main__":
    main()
