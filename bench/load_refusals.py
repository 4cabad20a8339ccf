"""How long `pretrain_gpt.py` takes to refuse a `--load` that cannot succeed.

    python bench/load_refusals.py [--baseline DIR] > bench/results/load_refusals.md

A tiny run saves iterations 2 and 4; each case damages a copy of it as the fault table does
(tests/test_fault_table.py) and times the resumed run until it exits with its one line.
`--baseline DIR`: the same cases also with the checkout in DIR (e.g. `git worktree add DIR REV`
at a commit before checkpoint/loadable.py), alternating with this one, so the two are measured
side by side. Each cell is the median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 6 --eval-iters 0 "
    "--mock-data --vocab-size 128 --save-interval 2"
).split()
TRACKER = "latest_checkpointed_iteration.txt"


def _remove(root: str, *names: str) -> None:
    for name in names:
        os.remove(os.path.join(root, name))


# (what is done to the copy, the flags the resumed run adds)
CASES = {
    "every iteration misses a shard": (
        lambda root: _remove(root, "iter_0000002/__0_0.distcp", "iter_0000004/__0_0.distcp"),
        [],
    ),
    "no manifest, RNG file missing": (
        lambda root: _remove(root, "iter_0000004/manifest.json", "iter_0000004/rng/rank_00000.pt"),
        [],
    ),
    "no tracker, no complete iteration": (
        lambda root: _remove(
            root, TRACKER, "iter_0000002/manifest.json", "iter_0000004/manifest.json"
        ),
        [],
    ),
    "none: the run resumes with another --lr": (lambda root: None, ["--lr", "2e-3"]),
}


def refused(tree: str, root: str, flags: list[str]) -> float:
    command = [sys.executable, os.path.join(tree, "pretrain_gpt.py"), *RUN, *flags, "--load", root]
    start = time.perf_counter()
    result = subprocess.run(command + ["--save", root], cwd=tree, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 2 or "error:" not in result.stderr:
        sys.exit(f"{root}: not refused\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another checkout to time alongside this one")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    trees = {"this checkout": ROOT} | ({"baseline": args.baseline} if args.baseline else {})
    with tempfile.TemporaryDirectory() as scratch:
        good = os.path.join(scratch, "good")
        saved = subprocess.run(
            [sys.executable, "pretrain_gpt.py", *RUN, "--exit-interval", "4", "--save", good],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if saved.returncode != 0:
            sys.exit(f"the run to damage failed\n{saved.stderr[-3000:]}")
        damaged = {}
        for name, (damage, _) in CASES.items():
            damaged[name] = os.path.join(scratch, str(len(damaged)))
            shutil.copytree(good, damaged[name])
            damage(damaged[name])
        times = {(case, tree): [] for case in CASES for tree in trees}
        for _ in range(args.repeats):
            for case, root in damaged.items():
                for tree, path in trees.items():
                    times[case, tree].append(refused(path, root, CASES[case][1]))
    print("# A --load that cannot succeed: seconds until pretrain_gpt.py refuses it\n")
    print(
        f"Machine: {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
        f"`python bench/load_refusals.py{' --baseline DIR' if args.baseline else ''} "
        f"--repeats {args.repeats}`; median (min-max) of {args.repeats} alternating runs. "
        f"The run: `pretrain_gpt.py {' '.join(RUN)} --load DIR --save DIR`.\n"
    )
    print("| damage | " + " | ".join(trees) + " |")
    print("|---" * (len(trees) + 1) + "|")
    for case in CASES:
        cells = [
            f"{statistics.median(times[case, tree]):.2f} "
            f"({min(times[case, tree]):.2f}-{max(times[case, tree]):.2f})"
            for tree in trees
        ]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
