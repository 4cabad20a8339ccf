"""Start-up: the wall time of a tiny pretrain_gpt.py run, with and without megatron-core imported.

    python bench/startup.py > bench/results/startup.md

Every process a launch starts pays its imports before the first step: on a 2-core machine a
tiny model's run (2 layers, hidden 32, one iteration, mock data) is mostly start-up. threefold
builds its process groups itself (threefold/parallel/state.py); megatron-core built them
before, and importing its package (which imports torch's compiler for its fused kernels) is
what the second row adds back: the same run, with `megatron.core.parallel_state` imported
first, as the old group set-up did. Runs alternate between the two rows; each row reports the
median of `--repeats` runs. A run with `--data-path` still imports megatron-core (its dataset
builder reads the .bin/.idx files); mock data does not.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --mock-data --vocab-size 100 --train-iters 1 --lr 1e-3"
).split()
# The same run, megatron-core imported first (its import warnings silenced, as state.py did).
WITH_MEGATRON_CORE = (
    "import runpy, sys, warnings; warnings.simplefilter('ignore'); "
    "import megatron.core.parallel_state; "
    "sys.argv = ['pretrain_gpt.py'] + sys.argv[1:]; "
    "runpy.run_path('pretrain_gpt.py', run_name='__main__')"
)
ROWS = {
    "pretrain_gpt.py (threefold's groups)": [sys.executable, "pretrain_gpt.py"],
    "the same, megatron-core imported first": [sys.executable, "-c", WITH_MEGATRON_CORE],
}


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(command + RUN, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0 or "> done: 1 iterations" not in result.stdout:
        sys.exit(f"{command}: the run failed\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    timed(ROWS[next(iter(ROWS))])  # warm the file cache
    for _ in range(args.repeats):
        for name, command in ROWS.items():
            times[name].append(timed(command))
    print("# Start-up: a tiny pretrain_gpt.py run, wall seconds\n")
    print(
        f"Machine: {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
        f"`python bench/startup.py --repeats {args.repeats}`; median of {args.repeats} "
        f"alternating runs each. The run: `pretrain_gpt.py {' '.join(RUN)}`.\n"
    )
    print("| run | median s | min s | max s |")
    print("|---|---|---|---|")
    for name, values in times.items():
        print(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |"
        )


if __name__ == "__main__":
    main()
