"""The operators one training step dispatches, counted, in this tree and in older ones: what a
change of speed between commits did to the work the host hands the device, on a CPU.

    python bench/step_ops.py --only threefold+fp8 --trees .old/b5ce27a

Each tree (this one first) runs `gpu_mfu.py`'s contender, as that tree defines it, on its tiny
model in bf16 with 4 micro-batches, in a process of its own: warm-up steps, then one profiled
step. The table lists every operator whose count differs between the trees, and each tree's
total and loss. An old tree is a commit unpacked as `gpu_session.sh at` takes it
(`mkdir -p .old/REV && git archive REV | tar -x -C .old/REV`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def count(tree: str, contender: str, warmup: int) -> dict:
    """Run in a child process: the operator counts of one step in `tree` (module doc)."""
    sys.path[:0] = [tree, os.path.join(tree, "bench")]
    import collections
    import dataclasses

    import gpu_mfu
    import torch

    import threefold

    assert threefold.__file__.startswith(tree), f"threefold came from {threefold.__file__}"
    torch.manual_seed(0)
    shape = dataclasses.replace(gpu_mfu.TINY, global_batch_size=4 * gpu_mfu.TINY.micro_batch_size)
    flags = {
        "threefold": (),
        "threefold+fp8": gpu_mfu.FP8_FLAGS,
        "threefold+fp8-tensorwise": gpu_mfu.TENSORWISE_FLAGS,
        "threefold+fp8-rowwise": gpu_mfu.ROWWISE_FLAGS,
    }[contender]
    step = gpu_mfu._threefold(shape, torch.device("cpu"), True, extra=flags)
    for _ in range(warmup):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        loss = step()
    return {"loss": loss, "counts": collections.Counter(e.name for e in profiler.events())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="threefold+fp8", help="the gpu_mfu.py contender")
    parser.add_argument("--trees", nargs="+", required=True, help="older trees (.old/REV)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(count(os.path.abspath(args.child), args.only, args.warmup)))
        return
    trees = [ROOT] + [os.path.abspath(tree) for tree in args.trees]
    results = []
    for tree in trees:
        command = [sys.executable, __file__, "--only", args.only, "--trees", tree]
        command += ["--warmup", str(args.warmup), "--child", tree]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{tree}: {done.stderr.strip().splitlines()[-1]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    names = [os.path.relpath(tree, ROOT) if tree != ROOT else "this tree" for tree in trees]
    print(f"# Operators one `{args.only}` step dispatches (tiny model, bf16, 4 micro-batches)\n")
    print("| operator | " + " | ".join(names) + " |")
    print("|---" * (len(trees) + 1) + "|")
    every = sorted(set().union(*(r["counts"] for r in results)))
    for name in every:
        row = [r["counts"].get(name, 0) for r in results]
        if len(set(row)) > 1:
            print(f"| {name} | " + " | ".join(map(str, row)) + " |")
    totals = [sum(r["counts"].values()) for r in results]
    print("| (all) | " + " | ".join(map(str, totals)) + " |")
    print("| loss | " + " | ".join(f"{r['loss']:.6f}" for r in results) + " |")


if __name__ == "__main__":
    main()
