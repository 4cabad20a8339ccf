"""How far one step's FP8 weight gradients are from the base precision's, per current-scaling
recipe, at the same weights: the base run trains `--at` steps and is saved; each recipe loads
that checkpoint and takes the same next step; each FP8 linear layer's gradient is compared
with the base run's (relative Frobenius error). One step's error at shared weights, unlike the
final losses of bench/fp8_loss.py, does not mix recipes' arithmetic with where their
trajectories drifted apart.

    python bench/fp8_grad_error.py --at 50 --out bench/results/fp8_loss/grad_error.md

The model, data and seed are bench/fp8_loss.py's. Delayed scaling is left out: loaded without
an amax history, its step would be current scaling.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.fp8_loss import model_flags  # noqa: E402

RECIPES = {
    "tensorwise, hybrid": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "tensorwise, e4m3": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
    "rowwise, hybrid": ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
    "rowwise, e4m3": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
}


def main() -> None:
    import numpy as np
    import torch

    from threefold.arguments import parse_args
    from threefold.checkpoint.load import load_checkpoint
    from threefold.checkpoint.save import save_checkpoint
    from threefold.parallel.parallel_context import ParallelContext
    from threefold.training.trainer import Trainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--at", type=int, default=50, help="base steps before the compared one")
    parser.add_argument("--out", help="the report's file (default: printed only)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def trainer(flags: list[str]) -> Trainer:
        return Trainer(
            parse_args(model_flags(300) + flags, world_size=1), device, ParallelContext()
        )

    def gradients(run: Trainer) -> dict[str, np.ndarray]:
        run.train_step()
        return {
            name: param.main_grad.detach().double().cpu().numpy()
            for name, param in run.layout_independent_parameters()
            if ".linear_" in name and name.endswith(".weight")
        }

    with tempfile.TemporaryDirectory() as directory:
        base = trainer(["--save", directory])
        for _ in range(args.at):
            base.train_step()
        save_checkpoint(directory, base.checkpoint_components())
        expected = gradients(base)
        rows = []
        for name, flags in RECIPES.items():
            run = trainer(flags)
            load_checkpoint(directory, run.checkpoint_components())
            got = gradients(run)
            errors = {
                key: np.linalg.norm(got[key] - value) / np.linalg.norm(value)
                for key, value in expected.items()
            }
            worst = max(errors, key=errors.get)
            rows.append(
                f"| {name} | {np.median(list(errors.values())):.2e} | {errors[worst]:.2e} "
                f"({worst.removeprefix('decoder.')}) |"
            )
    report = "\n".join(
        [
            f"# One FP8 step's weight gradients against the base precision's, after {args.at} "
            "base steps",
            "",
            f"`python bench/fp8_grad_error.py --at {args.at}` ({device.type}); relative "
            f"Frobenius error of each of the {len(expected)} FP8 linear layers' weight "
            "gradients, at the same weights and batch.",
            "",
            "| recipe | median layer | worst layer |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )
    if args.out:
        with open(args.out, "w") as stream:
            stream.write(report)
    print(report)


if __name__ == "__main__":
    main()
