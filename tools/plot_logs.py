"""Plot training logs (Megatron-LM's log line, printed by Megatron-LM or by threefold) side by
side: loss, learning rate and throughput against iteration, one line per log.

    python tools/plot_logs.py logs/run1.out logs/run2.out --output compare.png
    python tools/plot_logs.py a.log b.log --labels "TP=2" "TP=4" --output tp.png

Any prefix a launcher puts before the log line is ignored. A log holding a resumed run (a
requeued Slurm job appends to its log) is plotted once per iteration, the later value winning.
What was plotted is also written into the PNG's metadata (the `threefold-series` text chunk).
"""

from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import ToolParser  # noqa: E402
from threefold.config import ConfigError  # noqa: E402
from threefold.output_directory import make_parent_directory  # noqa: E402
from threefold.written_aside import written_aside  # noqa: E402

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")
# every `name: value |` field of a log line (Megatron-LM's and threefold's own)
FIELD = re.compile(r" ([A-Za-z][^|:]*?): (\S+) \|")
# during training, and Megatron-LM's report after it ("... on validation set"); one of
# --multiple-validation-sets is `validation-NAME loss at ...`
VALIDATION = re.compile(
    r"(validation(?:-\S+)?) loss at iteration (\d+)(?: on validation set)? \| "
    r"lm loss value: (\S+) \|"
)
PANELS = [
    ("lm loss", "training loss"),
    ("validation loss", "validation loss"),
    ("learning rate", "learning rate"),
    ("tokens per second", "tokens per second"),
    ("throughput per GPU (TFLOP/s/GPU)", "TFLOP/s per GPU"),  # Megatron's --log-throughput
]


def parse_log(path: str) -> dict[str, dict[int, float]]:
    """{series: {iteration: value}} from one log file, threefold's or Megatron-LM's (whose
    lines lack threefold's tokens/s; an iteration whose window was all skipped has no loss)."""
    series: dict[str, dict[int, float]] = {name: {} for name, _ in PANELS}
    with open(path, errors="replace") as file:
        for line in file:
            if match := ITERATION.search(line):
                iteration = int(match.group(1))
                for name, text in FIELD.findall(line[match.end() - 1 :]):
                    if name in series and name != "validation loss":
                        try:
                            series[name][iteration] = float(text)
                        except ValueError:
                            pass
            elif match := VALIDATION.search(line):
                name, iteration, value = match.groups()
                series.setdefault(f"{name} loss", {})[int(iteration)] = float(value)
    return series


def _curves(run: dict[str, dict[int, float]], name: str) -> dict[str, dict[int, float]]:
    """A panel's series of one run: the validation panel's are each validation set's."""
    if name != "validation loss":
        return {name: run[name]}
    return {key: points for key, points in run.items() if key.startswith("validation")}


def plot(runs: dict[str, dict[str, dict[int, float]]], output: str) -> dict:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    panels = [
        (name, title)
        for name, title in PANELS
        if any(any(_curves(run, name).values()) for run in runs.values())
    ]
    figure, axes = plt.subplots(
        len(panels), 1, figsize=(8, 2.8 * len(panels)), sharex=True, squeeze=False
    )
    summary = {}
    for axis, (name, title) in zip(axes[:, 0], panels):
        drawn = []
        for label, run in runs.items():
            for series, points in _curves(run, name).items():
                if points:
                    # (one of several validation sets: the run's label and the set's name)
                    named = label if series == name else f"{label} {series.removesuffix(' loss')}"
                    marker = "." if len(points) < 30 else None
                    axis.plot(*zip(*sorted(points.items())), label=named, marker=marker)
                    summary.setdefault(series, {})[label] = len(points)
                    drawn.append(named)
        axis.set_ylabel(title)
        axis.grid(alpha=0.3)
        if name in ("lm loss", "validation loss") and len(drawn) > 1:
            axis.legend()
    axes[-1, 0].set_xlabel("iteration")
    figure.tight_layout()
    # Drawn aside and renamed: a plot already there is replaced by a whole one or not at all.
    try:
        with written_aside(output) as (partial,):
            figure.savefig(partial, dpi=100, metadata={"threefold-series": json.dumps(summary)})
    finally:
        plt.close(figure)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="plot_logs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="training logs (stdout of pretrain_gpt.py)")
    parser.add_argument("--labels", nargs="+", help="one per log; default: the file names")
    parser.add_argument("--output", default="training.png", help="PNG file to write")
    args = parser.parse_args(argv)
    if not args.output.endswith(".png"):  # (what was plotted goes into a PNG text chunk)
        parser.error(f"--output {args.output}: give a .png file")
    try:
        make_parent_directory(args.output, "--output", a_file=True)
    except ConfigError as error:
        parser.error(str(error))
    labels = args.labels or [os.path.basename(path) for path in args.logs]
    if len(labels) != len(args.logs):
        parser.error(f"--labels: {len(labels)} labels for {len(args.logs)} logs")
    runs = {}
    for label, path in zip(labels, args.logs):
        if not os.path.isfile(path):
            parser.error(f"{path}: no such file")
        runs[label] = parse_log(path)
        if not runs[label]["lm loss"]:
            parser.error(f"{path}: no training log lines (' iteration N/M | ... lm loss: ...')")
    summary = plot(runs, args.output)
    for name, counts in summary.items():
        print(f"{name}: " + ", ".join(f"{label} {n} points" for label, n in counts.items()))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
