"""An FP8 run stopped and resumed from its checkpoint against the same run uninterrupted,
through pretrain_gpt.py as a user runs it (a GPU's kernels where there is one).

    python bench/fp8_resume.py --out bench/results/fp8_resume      # 40 iterations, cut at 20
    python bench/fp8_resume.py --iters 6 --cut 3 --recipes tensorwise --modes default

For each recipe and mode, three runs of bench/fp8_loss.py's model, data and seed: straight
through `--iters`; the same with `--save D --load D --exit-interval CUT` (it saves at CUT and
leaves); and the same with `--save D --load D` again (it resumes at CUT + 1). Compared: the
logged training loss of every resumed iteration against the straight run's (as printed,
`%.6E`), and every tensor of the two final checkpoints (weights, optimizer state, FP8
amax histories and scales) bit for bit. Modes: `deterministic` adds `--deterministic-mode`
(deterministic kernels and attention backward); `default` leaves the kernels as the
benchmark runs them, where a GPU's attention backward may add in a different order each run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.fp8_loss import RUNS, model_flags  # noqa: E402

RECIPES = {
    "delayed": RUNS["fp8_delayed"],  # amax histories to carry over
    "tensorwise": RUNS["fp8_tensorwise"],
    "blockwise": RUNS["fp8_blockwise"],
}
MODES = {"deterministic": ["--deterministic-mode"], "default": []}
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \|")


def _train(flags: list[str], log: str) -> dict[int, str]:
    """One pretrain_gpt.py run; its logged training losses by iteration."""
    command = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags]
    with open(log, "w") as stream:
        subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, check=True)
    with open(log) as stream:
        return {int(iteration): loss for iteration, loss in LOSS.findall(stream.read())}


def _tensors(root: str) -> dict:
    """Every tensor of the newest checkpoint under `root`, read without unpickling."""
    import torch
    import torch.distributed.checkpoint as dcp

    from threefold.checkpoint.files import checkpoint_dir, read_tracker
    from threefold.safe_loading import SafeFileSystemReader

    reader = SafeFileSystemReader(checkpoint_dir(root, read_tracker(root)))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if hasattr(meta, "size")
    }
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def compare(straight: str, resumed: str) -> tuple[int, int, float]:
    """(bitwise-equal tensors, tensors, largest absolute difference) of two checkpoints."""
    first, second = _tensors(straight), _tensors(resumed)
    if first.keys() != second.keys():
        raise SystemExit(f"{straight} and {resumed} hold different tensors")
    equal = sum(first[key].equal(second[key]) for key in first)
    worst = max(
        (first[key].double() - second[key].double()).abs().max().item() if first[key].numel() else 0
        for key in first
    )
    return equal, len(first), worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fp8_resume"))
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--cut", type=int, default=20, help="the iteration the first half ends at")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--jobs", type=int, default=1, help="cases run side by side")
    args = parser.parse_args()
    if not 0 < args.cut < args.iters:
        parser.error("--cut must lie between 0 and --iters")
    os.makedirs(args.out, exist_ok=True)

    def case(recipe: str, mode: str) -> str:
        name = f"{recipe}_{mode}"
        flags = model_flags(args.iters) + RECIPES[recipe] + MODES[mode]
        flags += ["--log-interval", "1", "--eval-interval", str(args.iters)]
        with tempfile.TemporaryDirectory() as directory:
            straight_dir, resumed_dir = (os.path.join(directory, d) for d in "sr")
            log = os.path.join(args.out, f"{name}_%s.log")
            straight = _train(flags + ["--save", straight_dir], log % "straight")
            resume = ["--save", resumed_dir, "--load", resumed_dir]
            first = _train(flags + resume + ["--exit-interval", str(args.cut)], log % "first")
            second = _train(flags + resume, log % "resumed")
            equal, total, worst = compare(straight_dir, resumed_dir)
        if sorted(first) != list(range(1, args.cut + 1)):
            raise SystemExit(f"{name}: the first half logged iterations {sorted(first)}")
        later = range(args.cut + 1, args.iters + 1)
        same = sum(second.get(i) == straight[i] for i in later)
        gap = max(abs(float(second[i]) - float(straight[i])) for i in later)
        row = f"| {recipe} | {mode} | {same}/{len(later)} | {gap:.1e} | {equal}/{total} "
        row += f"| {worst:.1e} |"
        print(row, flush=True)
        return row

    cases = [(recipe, mode) for recipe in args.recipes for mode in args.modes]
    with ThreadPoolExecutor(args.jobs) as pool:  # each case's three runs one after another
        rows = list(pool.map(lambda c: case(*c), cases))
    report = "\n".join(
        [
            f"# FP8 resumed at iteration {args.cut} against an uninterrupted run of {args.iters}",
            "",
            f"`python bench/fp8_resume.py --iters {args.iters} --cut {args.cut}`; "
            "bench/fp8_loss.py's model, data and flags, `--log-interval 1`; raw logs beside "
            "this file (they name the device).",
            "",
            "| recipe | mode | resumed losses equal as logged | largest loss difference "
            "| final checkpoint tensors bitwise equal | largest tensor difference |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    with open(os.path.join(args.out, "fp8_resume.md"), "w") as stream:
        stream.write(report)
    print(report)


if __name__ == "__main__":
    main()
