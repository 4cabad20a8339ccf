"""How far a layout's FP8 step is from one process's, next to how far both are from the same
step in fp32: for the cells bench/layout_matrix.py --fp8 finds outside the FP8 parity bounds.

    python bench/fp8_step_against_fp32.py FEATURE LAYOUT RECIPE [--steps 3]

The layout trains `--steps` FP8 steps a step at a time (tests/parallel/test_fp8.py's
`fp8_train_job`, checkpointed before each); from each checkpoint, one process takes the same
step in FP8 and in fp32 (no FP8 flags, the FP8 scaling state left). Printed per step: each
run's loss against fp32's, and for the median tensor and for the tensor where the layout is
farthest from one process, the distance between the two FP8 runs and each one's from fp32.
Where an element crossed an FP8 rounding boundary on one side only, the two FP8 runs sit
apart by several times less than either sits from fp32 (each at the same distance from it);
where the layout quantizes otherwise (`--sabotage`: an amax reduction left out), they sit as
far apart as FP8 sits from fp32, and the layout's loss farther from fp32's.

`--nudge N` (`--ulps K`, 1 by default): the noise floor beside it. One process takes each FP8
step N more times from the same checkpoint, every weight first moved K fp32 steps (ulps) up
or down at random (seeds 1 to N): a difference of the size a reordered fp32 sum makes (TP's
all-reduce: about 3 ulps), and of no other kind. Where these nudged runs land as far from one
process as the layout, on the median tensor and on the layout's farthest one, rounding of
that size alone accounts for the layout's distance.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.layout_matrix import FEATURES, LAYOUTS  # noqa: E402
from tests.distributed import close_pools, run_distributed  # noqa: E402
from tests.parallel.test_fp8 import RECIPES, _weights_and_scaling, fp8_train_job  # noqa: E402
from tests.parity import TRAINING, _setup, merge_pipeline_stages, one_device_steps, relative_error  # noqa: E402


def nudge(model: torch.nn.Module, seed: int, ulps: int) -> None:
    """Move every parameter element `ulps` fp32 steps up or down, at random (by `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            up = torch.rand(parameter.shape, generator=generator) < 0.5
            away = torch.where(up, torch.inf, -torch.inf).to(parameter.dtype)
            for _ in range(ulps):
                parameter.copy_(torch.nextafter(parameter, away))


def nudged_setup(seed: int, ulps: int = 1):
    """`_setup` whose trainer nudges its (fp32) weights before each step, so after
    one_device_steps has loaded the step's checkpoint."""

    def setup(argv: list[str]):
        trainer = _setup(argv)
        take_step = trainer.train_step

        def train_step():
            nudge(trainer.model, seed, ulps)
            return take_step()

        trainer.train_step = train_step
        return trainer

    return setup


def _distances(layout: dict, one: dict, exact: dict, name: str | None) -> tuple[float, ...]:
    """(the layout from one process, one process from fp32, the layout from fp32): for tensor
    `name`, or (None) each the median tensor's."""
    pairs = ((layout, one), (one, exact), (layout, exact))
    if name is not None:
        return tuple(relative_error(a[name], b[name]) for a, b in pairs)
    return tuple(float(np.median([relative_error(a[n], b[n]) for n in one])) for a, b in pairs)


def report(
    step: int,
    losses: tuple[float, float, float],
    layout: dict,
    one: dict,
    exact: dict,
    nudged: list[dict] | None = None,
    ulps: int = 1,
) -> str:
    """The lines of one step: `losses` the layout's, one process's FP8 and fp32 ones;
    `nudged`: one process's FP8 parameters after the step from nudged weights."""
    loss, loss_fp8, loss_fp32 = losses
    lines = [
        f"step {step}: loss from fp32's: one process {abs(loss_fp8 / loss_fp32 - 1):.1e}, "
        f"the layout {abs(loss / loss_fp32 - 1):.1e}"
    ]
    apart = {n: relative_error(layout[n], one[n]) for n in one}
    for what, name in (("median tensor", None), ("farthest tensor", max(apart, key=apart.get))):
        gap, to_one, to_layout = _distances(layout, one, exact, name)
        lines.append(
            f"  {what}{f' ({name})' if name else ''}: the layout from one process {gap:.1e}; "
            f"from fp32: one process {to_one:.1e}, the layout {to_layout:.1e}"
        )
        if nudged:
            floor = [_distances(n, one, exact, name)[0] for n in nudged]
            lines.append(
                f"    one process nudged {ulps} ulp, from one process: {min(floor):.1e} to "
                f"{max(floor):.1e} ({len(floor)} seeds)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("feature", choices=FEATURES)
    parser.add_argument("layout", choices=LAYOUTS)
    parser.add_argument("recipe", choices=RECIPES)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--sabotage",
        choices=("current", "delayed"),
        help="the layout skips its amax reduction (fp8_train_job's): what a wrong one looks like",
    )
    parser.add_argument(
        "--nudge",
        type=int,
        default=0,
        metavar="N",
        help="also N one-process FP8 steps from weights moved --ulps at random: the noise floor",
    )
    parser.add_argument("--ulps", type=int, default=1, help="--nudge's weights move this many")
    args = parser.parse_args(argv)
    base = TRAINING + FEATURES[args.feature]
    world, flags = LAYOUTS[args.layout]
    fp8 = base + RECIPES[args.recipe]
    job = (fp8 + flags, args.steps, args.sabotage)
    try:
        with tempfile.TemporaryDirectory() as directory:
            results = run_distributed(world, fp8_train_job, *job, directory)
            # (each step from the layout's checkpoint of its start, in FP8 and in fp32)
            one = one_device_steps(fp8, args.steps, directory, _weights_and_scaling)
            exact = one_device_steps(base, args.steps, directory, _weights_and_scaling)
            nudged = [
                one_device_steps(
                    fp8, args.steps, directory, _weights_and_scaling, nudged_setup(s, args.ulps)
                )
                for s in range(1, args.nudge + 1)
            ]
        for step in range(1, args.steps):
            layout = merge_pipeline_stages([r["after"][step]["params"] for r in results])
            losses = (results[0]["losses"][step], one["losses"][step], exact["losses"][step])
            params = (one["after"][step]["params"], exact["after"][step]["params"])
            floor = [n["after"][step]["params"] for n in nudged]
            print(report(step, losses, layout, *params, floor, args.ulps), flush=True)
    finally:
        close_pools()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
