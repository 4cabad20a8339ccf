"""Start-up: the wall time of tiny pretrain_gpt.py runs, with and without megatron-core imported,
and with the cyclic collector left to pass over the imports.

    python bench/startup.py > bench/results/startup.md   (after `make data`)

Every process a launch starts pays its imports before the first step: on a 2-core machine a
tiny model's run (2 layers, hidden 32, one iteration) is mostly start-up. threefold builds its
process groups itself (threefold/parallel/state.py), and a run on .bin/.idx data imports only
megatron-core's dataset modules, not its package's __init__ (threefold/data/megatron_core.py).
Importing that package (its tensor-parallel layers, torch's compiler for its fused kernels,
wandb for its inference contexts) is what each "imported first" row adds back: the same run,
`megatron.core.parallel_state` imported before it, as the old group set-up did. The
"collector left on" row is the run as it was before threefold/startup.py's `frozen_imports`:
the collector neither paused nor frozen, so it passes over torch's objects while they import
and once more at exit. Rows alternate; each reports the median of `--repeats` runs.
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
    "--micro-batch-size 2 --train-iters 1 --lr 1e-3"
).split()
MOCK_DATA = ["--mock-data", "--vocab-size", "100"]
SHAKESPEARE = os.path.join(ROOT, "data", "shakespeare")
INDEXED_DATA = (
    f"--data-path {SHAKESPEARE}_text_document --split 98,1,1 --eval-iters 0 "
    f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {SHAKESPEARE}_sp.model"
).split()
# The same run, megatron-core imported first (its import warnings silenced, as state.py did).
WITH_MEGATRON_CORE = (
    "import runpy, sys, warnings; warnings.simplefilter('ignore'); "
    "import megatron.core.parallel_state; "
    "sys.argv = ['pretrain_gpt.py'] + sys.argv[1:]; "
    "runpy.run_path('pretrain_gpt.py', run_name='__main__')"
)
# The same run, `frozen_imports` without its effect (gc.disable and gc.freeze do nothing).
COLLECTOR_LEFT_ON = (
    "import gc, runpy, sys; gc.disable = gc.freeze = lambda: None; "
    "sys.argv = ['pretrain_gpt.py'] + sys.argv[1:]; "
    "runpy.run_path('pretrain_gpt.py', run_name='__main__')"
)
OURS = [sys.executable, "pretrain_gpt.py"]
THEIRS = [sys.executable, "-c", WITH_MEGATRON_CORE]
LEFT_ON = [sys.executable, "-c", COLLECTOR_LEFT_ON]
ROWS = {
    "mock data (threefold's groups)": OURS + MOCK_DATA,
    "mock data, the collector left on through imports and exit": LEFT_ON + MOCK_DATA,
    "mock data, megatron-core imported first": THEIRS + MOCK_DATA,
    "--data-path (megatron-core's dataset modules only)": OURS + INDEXED_DATA,
    "--data-path, megatron-core imported first": THEIRS + INDEXED_DATA,
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
    if not os.path.exists(f"{SHAKESPEARE}_text_document.idx"):
        sys.exit("bench/startup.py: data/shakespeare_text_document is missing; run `make data`")
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    timed(ROWS[next(iter(ROWS))])  # warm the file cache
    for _ in range(args.repeats):
        for name, command in ROWS.items():
            times[name].append(timed(command))
    print("# Start-up: tiny pretrain_gpt.py runs, wall seconds\n")
    print(
        f"Machine: {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
        f"`python bench/startup.py --repeats {args.repeats}`; median of {args.repeats} "
        f"alternating runs each. The run: `pretrain_gpt.py {' '.join(RUN)}`, with "
        f"`{' '.join(MOCK_DATA)}` or `{' '.join(INDEXED_DATA).replace(ROOT + os.sep, '')}`.\n"
    )
    print("| run | median s | min s | max s |")
    print("|---|---|---|---|")
    for name, values in times.items():
        print(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |"
        )


if __name__ == "__main__":
    main()
