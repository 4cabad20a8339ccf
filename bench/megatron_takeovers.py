"""Megatron-LM's own pretrain_gpt.py in layouts, checkpoint formats and precisions beyond the
two runs tests/data/megatron_saved_models/trained/ keeps, each taken over by threefold.

    python bench/megatron_takeovers.py MEGATRON_LM_CHECKOUT [VARIANT...]

For each variant Megatron-LM trains 6 iterations on 4 gloo CPU ranks (bench/megatron_training.py's
model, schedule and CPU stand-ins), saving iteration 2; threefold's pretrain_gpt.py resumes that
on the same command line (at one process, or at the run's layout) and logs iterations 3 to 6.
Where its layout's optimizer state is one Megatron-LM's run takes (`hand_back`), threefold's
own save of iteration 4 (`--ckpt-format torch_dist`) goes back: Megatron-LM's pretrain_gpt.py
resumes it and logs iterations 5 and 6. Writes bench/results/megatron_takeovers.md: each
iteration's loss and gradient norm from each (the variants named replace their own sections;
all run where none is named).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_training import OUT, argv_of, commit_of, megatron_lm, threefold  # noqa: E402

RESULTS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "megatron_takeovers.md"
)
ONE_PROCESS = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
ONE_PROCESS += ["--expert-model-parallel-size", "1"]
DISTRIBUTED = "--use-distributed-optimizer"
# name -> (model, Megatron-LM's layout and format flags, threefold's processes, their flags,
# whether Megatron-LM resumes threefold's save: not from a one-process run of a mixture of
# experts at EP 2, whose state is shaped for EP 1, nor in the legacy format)
VARIANTS = {
    # Megatron-LM's legacy torch format (per-rank model_optim_rng.pt, distrib_optim.pt)
    "llama-legacy-format": (
        "llama",
        ["--tensor-model-parallel-size", "2", DISTRIBUTED, "--ckpt-format", "torch"],
        1,
        ONE_PROCESS,
        False,
    ),
    # 2 virtual stages a pipeline rank: the dp_reshardable buckets of each model chunk
    "llama-virtual-pipeline": (
        "llama",
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
        + [DISTRIBUTED],
        4,
        [],
        True,
    ),
    # the experts' dp_reshardable buckets, their own optimizer's (chained), at EP 2
    "moe-dp-reshardable": (
        "moe",
        ["--expert-model-parallel-size", "2", DISTRIBUTED],
        1,
        ONE_PROCESS,
        False,
    ),
    # bf16 weights with the non-distributed optimizer's fp32 masters (`fp32_param`)
    "llama-bf16": ("llama", ["--tensor-model-parallel-size", "2", "--bf16"], 1, ONE_PROCESS, True),
    "moe-bf16": (
        "moe",
        ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", DISTRIBUTED]
        + ["--dist-ckpt-optim-fully-reshardable", "--bf16"],
        1,
        ONE_PROCESS,
        False,
    ),
    # the experts unsplit beside TP 2 (expert TP 1, as Megatron-LM's MoE recipes run them):
    # their state in an optimizer of their own at EP 1 too (threefold does not lay out its
    # dp_reshardable buckets of such experts: refused in one line)
    "moe-expert-tp1": (
        "moe",
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--expert-tensor-parallel-size", "1", DISTRIBUTED]
        + ["--dist-ckpt-optim-fully-reshardable"],
        4,
        [],
        True,
    ),
    # the non-distributed optimizer's state, the experts' in an optimizer of their own (EP 2)
    "moe-non-distributed": (
        "moe",
        ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
        4,
        [],
        True,
    ),
    # fp16 as Megatron-LM's flags default it: a loss scale of 2^32, which this model's
    # gradients overflow through iteration 6, so every iteration is skipped and the scale
    # halves from the second on (its hysteresis, 2, spent); saved at 2 before Adam's first
    # step (no moments, only the fp32 masters), the LR schedule not started. (Far above the
    # gradients' range in both: a scale near its edge may overflow in one and not the other,
    # whose fp16 kernels differ.)
    "llama-fp16": ("llama", ["--tensor-model-parallel-size", "2", "--fp16"], 1, ONE_PROCESS, True),
    # the distributed optimizer's (its default dp_reshardable buckets) in fp16, no iteration
    # skipped (its save before Adam's first step fails with torch's AdamW, the CPU's: "assert
    # len(steps) == 1"), the growth counter carried over both ways
    "llama-fp16-distributed": (
        "llama",
        ["--tensor-model-parallel-size", "2", DISTRIBUTED, "--fp16"]
        + ["--initial-loss-scale", "16384", "--loss-scale-window", "3"],
        4,
        [],
        True,
    ),
}


def take_over(checkout: str, name: str) -> list[str]:
    """Variant `name`'s section of the results."""
    model, layout, nproc, flags, hand_back = VARIANTS[name]
    argv = argv_of(model, layout)
    with tempfile.TemporaryDirectory() as scratch:
        data = ["--data-path", os.path.join(OUT, "corpus"), "--data-cache-path", scratch]
        save, load = os.path.join(scratch, "save"), os.path.join(scratch, "load")
        theirs = megatron_lm(checkout, [*argv, *data, "--save", save], f"{scratch}/megatron.log")
        _from_iteration(f"{save}/iter_0000002", load)
        resume = [*argv, *data, "--load", load, "--save", load, *flags]
        ours = threefold(resume, f"{scratch}/threefold.log", nproc)
        back = {}
        if hand_back:  # (its CUDA RNG tracker is not set up on a CPU; nothing draws from it)
            again = os.path.join(scratch, "again")
            _from_iteration(f"{load}/iter_0000004", again)
            resumed = [*argv, *data, "--load", again, "--no-load-rng"]
            back = megatron_lm(checkout, resumed, f"{scratch}/back.log")
    where = "one process" if nproc == 1 else f"{nproc} processes, its layout"
    scaled = "--fp16" in layout  # (its loss scale beside the losses)
    rows = [_row(i, theirs[i], ours[i], back.get(i), scaled) for i in range(3, 7)]
    rates = all(ours[i]["learning rate"] == theirs[i]["learning rate"] for i in range(3, 7))
    header = "| iteration | Megatron-LM: lm loss | threefold: lm loss | difference | "
    header += "Megatron-LM: grad norm | threefold: grad norm | Megatron-LM from threefold's "
    header += "iteration 4: lm loss | grad norm |"
    if scaled:
        header += " loss scale: Megatron-LM | threefold | Megatron-LM from threefold's |"
    return [
        f"## {name}: {model}, {' '.join(layout)}; threefold at {where}\n",
        header,
        "|" + " ---: |" * header.count("|", 1),
        *rows,
        "",
        f"Learning rates {'the same' if rates else 'DIFFERENT'}.\n",
    ]


def _row(iteration: int, theirs: dict, ours: dict, back: dict | None, scaled: bool) -> str:
    """Iteration `iteration`'s row: each run's loss and gradient norm (and loss scale); an
    iteration an fp16 run skipped (its gradients overflowed) logs neither: "skipped"."""
    back = back or {}

    def value(run: dict, name: str) -> str:
        return run.get(name, "skipped" if run else "")

    both = "lm loss" in theirs and "lm loss" in ours
    difference = float(ours["lm loss"]) - float(theirs["lm loss"]) if both else None
    cells = [
        value(theirs, "lm loss"),
        value(ours, "lm loss"),
        "" if difference is None else f"{difference:+.1e}",
        value(theirs, "grad norm"),
        value(ours, "grad norm"),
        value(back, "lm loss"),
        value(back, "grad norm"),
    ]
    if scaled:
        cells += [value(run, "loss scale") for run in (theirs, ours, back)]
    return f"| {iteration} | " + " | ".join(cells) + " |"


def _from_iteration(source: str, root: str) -> None:
    """A checkpoint root whose tracker names the copied iteration directory `source`."""
    os.makedirs(root)
    shutil.copytree(source, os.path.join(root, os.path.basename(source)))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(int(os.path.basename(source).split("_")[1])))


FOOTER = (
    "\nIn bf16 and fp16 the two differ from the first iteration resumed, whose weights are the "
    "same half-precision tensors: Megatron-LM's local attention (`--transformer-impl local`, "
    "its CPU path) rounds the scores and the probabilities to bf16 (fp16) between its unfused "
    "steps, where threefold's (SDPA) keeps them in fp32, as Transformer Engine's fused "
    "attention does on a GPU.\n\n"
    "Handed back, Megatron-LM's second line after its resume (iteration 6) reports the mean of "
    "iterations 5 and 6 (its first line is an extra one, which resets no sums; "
    "bench/results/megatron_training.md); the gradient norms are each iteration's own.\n"
)


def _sections_kept() -> dict[str, str]:
    """The results file's sections by variant, as the last run of each wrote them."""
    if not os.path.exists(RESULTS):
        return {}
    text = open(RESULTS).read().split(FOOTER)[0]
    parts = text.split("\n## ")[1:]
    return {part.split(":")[0]: "## " + part.rstrip("\n") + "\n" for part in parts}


def main() -> None:
    """Runs the variants named (all where none is), each section replacing its own in the
    results; the others' stay as their last run wrote them."""
    checkout, names = os.path.abspath(sys.argv[1]), sys.argv[2:] or list(VARIANTS)
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        sys.exit(f"{unknown[0]}: not a variant of {sorted(VARIANTS)}")
    sections = _sections_kept()
    for name in names:
        sections[name] = "\n".join(take_over(checkout, name))
    with open(RESULTS, "w") as f:
        f.write(
            f"Megatron-LM {commit_of(checkout)}, `python bench/megatron_takeovers.py CHECKOUT "
            "[VARIANT...]`: its own pretrain_gpt.py trained 6 iterations on 4 gloo CPU ranks, "
            "saving iteration 2, which threefold's pretrain_gpt.py resumed on the same command "
            "line.\n\n"
        )
        f.write("\n".join(sections[name] for name in VARIANTS if name in sections))
        f.write(FOOTER)
    print(open(RESULTS).read())


if __name__ == "__main__":
    main()
