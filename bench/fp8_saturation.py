"""How often delayed FP8 scaling clamps: each step, each FP8 layer's amax of its input, weight
and gradient against the largest value the scale in use can represent (FP8 max / scale).
A ratio above 1 means that tensor's largest values were clamped at the format's max.

    python bench/fp8_saturation.py --iters 100 --out bench/results/fp8_loss/saturation.md \
        [pretrain_gpt.py FP8 flags]

The model, data and seed are bench/fp8_loss.py's; the default flags are its Megatron-LM Llama-3
recipe (hybrid, amax history 1024, max). One process on this machine's CPU or GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.fp8_loss import RUNS, model_flags  # noqa: E402

KINDS = ("input", "weight", "gradient")


def main() -> None:
    import torch

    from threefold.arguments import parse_args
    from threefold.model.fp8 import fp8_states
    from threefold.parallel.parallel_context import ParallelContext
    from threefold.training.trainer import Trainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", help="the report's file (default: printed after the log)")
    args, fp8_flags = parser.parse_known_args()
    fp8_flags = fp8_flags or RUNS["fp8_delayed"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = parse_args(model_flags(args.iters) + fp8_flags, world_size=1)
    if not config.fp8.enabled or config.fp8.fp8_recipe != "delayed":
        sys.exit("fp8_saturation.py looks at delayed scaling: pass --fp8-format (and no recipe)")
    trainer = Trainer(config, device, ParallelContext())
    states = list(fp8_states(trainer.model_chunks).values())
    ratios = []  # per step with a history: [layers, 3]
    update = trainer.fp8.after_step

    def after_step() -> None:
        if states[0].has_history:  # (the first step scales from its own amaxes)
            ratios.append(
                torch.stack([s.step_amax / (s.fp8_max / s.scale_in_use) for s in states]).cpu()
            )
        update()

    trainer.fp8.after_step = after_step
    for _ in range(args.iters):
        trainer.train_step()
    ratio = torch.cat(ratios)  # [steps x layers, 3]
    lines = [
        f"# Delayed FP8 scaling: amax against the scale's range, {args.iters} steps",
        "",
        f"`python bench/fp8_saturation.py --iters {args.iters} {' '.join(fp8_flags)}` "
        f"({device.type}); a ratio above 1: the tensor's largest values were clamped.",
        "",
        f"{len(ratios)} steps x {len(states)} FP8 layers ({ratio.shape[0]} layer-steps).",
        "",
        "| tensor | layer-steps clamped | median amax / range | largest amax / range |",
        "|---|---|---|---|",
    ]
    for kind, column in zip(KINDS, ratio.t()):
        clamped = int((column > 1).sum())
        lines.append(
            f"| {kind} | {clamped} ({100 * clamped / column.numel():.0f}%) | "
            f"{column.median():.3f} | {column.max():.3f} |"
        )
    report = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as stream:
            stream.write(report)
    print(report)


if __name__ == "__main__":
    main()
