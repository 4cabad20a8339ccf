"""Megatron-LM's own pretrain_gpt.py, unchanged, trains on gloo CPU ranks; threefold takes its
run over from a checkpoint, and Megatron-LM takes threefold's over.

    python bench/megatron_training.py fixture MEGATRON_LM_CHECKOUT [RUN...]
    python bench/megatron_training.py handback MEGATRON_LM_CHECKOUT [RUN...]

`fixture` writes tests/data/megatron_saved_models/trained/: a tiny corpus (.bin/.idx) and, for
each of RUNS (a dense LLaMA at TP2 x DP2; a mixture of experts at PP2 x EP2 x DP2) in a folder
of its own, the command line, the checkpoint Megatron-LM's run saved at iteration 2 (its
distributed optimizer's state included) and the learning rates, losses and gradient norms it
logged for iterations 1 to 6.
tests/tools/test_megatron_trained.py runs threefold's pretrain_gpt.py on that command line,
--load pointing at the checkpoint, and holds iterations 3 to 6 to Megatron-LM's. `handback`
is the other way (bench/results/megatron_training.md): threefold resumes the checkpoint, saves
at iteration 4 in Megatron-LM's format, and Megatron-LM's pretrain_gpt.py --loads that and
trains iterations 5 and 6, whose losses must be those of its own uninterrupted run.

Megatron-LM runs under torchrun with bench/megatron_cpu/ first on PYTHONPATH (its
sitecustomize.py: the CPU's stand-ins for CUDA) and needs pybind11 for its dataset helpers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from megatron_saved_models import COMMON, MODELS, SHAPE  # noqa: E402

OUT = os.path.join(ROOT, "tests", "data", "megatron_saved_models", "trained")
RESULTS = os.path.join(ROOT, "bench", "results", "megatron_training.md")
NPROC = 4
# As Megatron-LM's example scripts shape a run: warm-up then cosine decay, weight decay,
# clipping; a checkpoint every 2 iterations.
SCHEDULE = [
    *("--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6"),
    *("--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1"),
    *("--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0"),
    *("--split", "1,0,0", "--eval-iters", "0", "--eval-interval", "1000"),
    *("--log-interval", "1", "--save-interval", "2", "--ckpt-format", "torch_dist"),
]
# COMMON's flags for bench/megatron_saved_models.py's weights-only saves, and its batch size
LEFT_OUT = {"--no-save-optim": 0, "--no-save-rng": 0, "--save-interval": 1, "--micro-batch-size": 1}


def _without(argv: list[str], flags: dict[str, int]) -> list[str]:
    """`argv` less `flags` (each with its number of values)."""
    kept, skip = [], 0
    for item in argv:
        if skip:
            skip -= 1
        elif item in flags:
            skip = flags[item]
        else:
            kept.append(item)
    return kept


# name -> (its model's flags, its layout's), each run in tests/data/.../trained/<name>/
RUNS = {
    # the distributed optimizer over DP 2 at TP 2, in its default (dp_reshardable) layout
    "llama": (
        MODELS["llama"],
        ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
    ),
    # 4 experts over EP 2 (their tokens exchanged all-to-all, a load-balancing loss), PP 2, and
    # the optimizer state in model space (fully_reshardable); the experts have an optimizer of
    # their own (chained with the rest's) at EP 2
    "moe": (
        [
            *_without(MODELS["moe"], {"--moe-token-dispatcher-type": 1}),
            *("--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "1e-2"),
        ],
        [
            *("--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"),
            *("--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"),
        ],
    ),
}


def argv_of(name: str, layout: list[str] | None = None) -> list[str]:
    """Run `name`'s command line (less its data and checkpoint flags), at its layout or at
    `layout`'s flags."""
    model, own = RUNS[name]
    return [
        *SHAPE,
        *model,
        *_without(COMMON, LEFT_OUT),
        *(own if layout is None else layout),
        *SCHEDULE,
    ]


ITERATION = re.compile(r" iteration +(\d+)/ +\d+ \|(.*)")
# what the tables show; a mixture of experts' runs also log their load-balancing loss, and
# fp16 runs a loss scale that changes
NAMES = ("learning rate", "lm loss", "grad norm")
LOGGED = (*NAMES, "load_balancing_loss", "loss scale")


def write_corpus(prefix: str) -> None:
    """64 documents of 4 to 20 tokens, frequent ids more likely (a text's shape), each ended
    by id 0; the vocabulary is SHAPE's 60."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    generator = np.random.default_rng(0)
    weights = np.arange(59, 0, -1) / np.arange(59, 0, -1).sum()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(64):
        length = int(generator.integers(3, 20))
        document = [*(generator.choice(59, size=length, p=weights) + 1), 0]
        builder.add_document(torch.tensor(document, dtype=torch.int64), [len(document)])
    builder.finalize(prefix + ".idx")


def logged(output: str) -> dict[int, dict[str, str]]:
    """{iteration: {name: value}} of the LOGGED names as Megatron-LM's (and threefold's) log
    lines print them ("name: value |")."""
    found = {}
    for iteration, fields in ITERATION.findall(output):
        pairs = (field.partition(":") for field in fields.split(" | "))
        values = {name.strip(): value.strip() for name, _, value in pairs}
        found[int(iteration)] = {name: values[name] for name in LOGGED if name in values}
    return found


def megatron_lm(checkout: str, argv: list[str], log: str) -> dict[int, dict[str, str]]:
    """Megatron-LM's pretrain_gpt.py on NPROC gloo CPU ranks; its logged iterations."""
    environment = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [
                os.path.join(ROOT, "bench", "megatron_cpu"),
                checkout,
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
        THREEFOLD_MEGATRON_LM=checkout,
        CUDA_DEVICE_MAX_CONNECTIONS="1",  # (its check for TP; its launch scripts set it)
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(NPROC)]
    command = torchrun + [os.path.join(checkout, "pretrain_gpt.py"), *argv]
    with open(log, "w") as f:
        result = subprocess.run(command, env=environment, stdout=f, stderr=subprocess.STDOUT)
    output = open(log).read()
    if result.returncode != 0:
        sys.exit(f"{output[-4000:]}\nMegatron-LM's run failed (exit {result.returncode})")
    return logged(output)


def threefold(argv: list[str], log: str, nproc: int = NPROC) -> dict[int, dict[str, str]]:
    """threefold's pretrain_gpt.py on the same command line (on `nproc` processes); its logged
    iterations."""
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    with open(log, "w") as f:
        result = subprocess.run(
            [*launch, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    output = open(log).read()
    if result.returncode != 0:
        sys.exit(f"{output[-4000:]}\nthreefold's run failed (exit {result.returncode})")
    return logged(output)


def commit_of(checkout: str) -> str:
    return subprocess.run(
        ["git", "-C", checkout, "log", "-1", "--format=%H (%cs)"], capture_output=True, text=True
    ).stdout.strip()


def _data(scratch: str) -> list[str]:
    """The fixture's corpus; the dataset's index cache in `scratch`, not beside it."""
    return ["--data-path", os.path.join(OUT, "corpus"), "--data-cache-path", scratch]


def fixture(checkout: str, names: list[str]) -> None:
    """Megatron-LM's runs `names` (all of RUNS where none is named) into the fixture, on its
    corpus (written where it is missing; the same bytes each time)."""
    if not os.path.exists(os.path.join(OUT, "corpus.bin")):
        os.makedirs(OUT, exist_ok=True)
        write_corpus(os.path.join(OUT, "corpus"))
    for name in names or RUNS:
        folder = os.path.join(OUT, name)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        with tempfile.TemporaryDirectory() as scratch:
            save = os.path.join(scratch, "checkpoints")
            argv = [*argv_of(name), *_data(scratch), "--save", save]
            iterations = megatron_lm(checkout, argv, os.path.join(scratch, "log"))
            assert sorted(iterations) == list(range(1, 7)), iterations
            # Its checkpoint of iteration 2, as if the run had stopped after it.
            shutil.copytree(f"{save}/iter_0000002", os.path.join(folder, "iter_0000002"))
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
        with open(os.path.join(folder, "run.json"), "w") as f:
            run = {"argv": argv_of(name), "nproc": NPROC, "logged": iterations}
            json.dump(run | {"megatron_lm": commit_of(checkout)}, f, indent=1)
        print(name, json.dumps(iterations, indent=1))
    with open(os.path.join(OUT, "README.md"), "w") as f:
        f.write(
            "Written by `python bench/megatron_training.py fixture CHECKOUT [RUN...]`: for each "
            f"run (a folder), Megatron-LM's own pretrain_gpt.py on {NPROC} gloo CPU ranks with "
            "its run.json's `argv` (and `--data-path corpus`), 6 iterations; its checkpoint of "
            "iteration 2 with its optimizer's state, and the learning rate, lm loss and grad "
            "norm it logged for each iteration (run.json's `logged`; `megatron_lm`: the "
            "checkout's commit). `llama`: TP2 x DP2, the distributed optimizer's state in its "
            "default dp_reshardable layout. `moe`: 4 experts over EP2, PP2, DP2, the alltoall "
            "dispatcher and a load-balancing loss, the state fully_reshardable.\n"
        )


def _handed_back(checkout: str, name: str) -> list[str]:
    """threefold resumes run `name` to iteration 4 and saves; Megatron-LM resumes that. Beside
    it, Megatron-LM resuming its own checkpoint of iteration 2: what its resumes log. The
    results' section for the run."""
    folder = os.path.join(OUT, name)
    with open(os.path.join(folder, "run.json")) as f:
        run = json.load(f)
    argv = run["argv"]
    with tempfile.TemporaryDirectory() as scratch:
        ours, own = os.path.join(scratch, "threefold"), os.path.join(scratch, "megatron")
        for root in (ours, own):
            os.makedirs(root)
            shutil.copytree(os.path.join(folder, "iter_0000002"), f"{root}/iter_0000002")
            shutil.copy(os.path.join(folder, "latest_checkpointed_iteration.txt"), root)
        # (the same schedule, stopped after iteration 4 with a checkpoint)
        to_four = [*argv, *_data(scratch), "--load", ours, "--save", ours, "--exit-interval", "4"]
        handed = threefold(to_four, os.path.join(scratch, "threefold.log"))
        # (its CUDA RNG tracker is not set up on a CPU; dropout is 0: nothing draws from it)
        resume = [*argv, *_data(scratch), "--no-load-rng"]
        handed |= megatron_lm(checkout, [*resume, "--load", ours], f"{scratch}/back.log")
        control = megatron_lm(checkout, [*resume, "--load", own], f"{scratch}/own.log")
    rows = []
    for iteration in range(3, 7):
        runs = (run["logged"][str(iteration)], control[iteration], handed[iteration])
        who = "threefold" if iteration <= 4 else "Megatron-LM"
        cells = [values[name] for values in runs for name in NAMES[1:]]
        rows.append(f"| {iteration} | {' | '.join(cells[:4])} | {who} | {' | '.join(cells[4:])} |")
    loss = {int(i): float(v["lm loss"]) for i, v in run["logged"].items()}
    means = [
        f"{resumed[first + 1]['lm loss']} after {whose} (the mean of {loss[first]:.6f} and "
        f"{loss[first + 1]:.6f}: {(loss[first] + loss[first + 1]) / 2:.6f})"
        for whose, resumed, first in (("its own resume", control, 3), ("threefold's", handed, 5))
    ]
    rates = {
        all(r[i]["learning rate"] == run["logged"][str(i)]["learning rate"] for i in r)
        for r in (control, handed)
    }
    return [
        f"## {name}: {' '.join(RUNS[name][1])}\n",
        "| iteration | uninterrupted: lm loss | grad norm | Megatron-LM resumed at 2: "
        "lm loss | grad norm | handed over: run by | lm loss | grad norm |",
        "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
        *rows,
        "",
        f"The learning rates {'agree too' if rates == {True} else 'DIFFER'}. The second lines "
        f"after a resume: {means[0]}; {means[1]}.\n",
    ]


def handback(checkout: str, names: list[str]) -> None:
    sections = [line for name in names or RUNS for line in _handed_back(checkout, name)]
    with open(RESULTS, "w") as f:
        f.write(
            f"Megatron-LM {commit_of(checkout)}, `python bench/megatron_training.py handback "
            "CHECKOUT`. Megatron-LM's own pretrain_gpt.py trained 6 iterations on "
            f"{NPROC} gloo CPU ranks (tests/data/megatron_saved_models/trained/<run>/), saving "
            "iteration 2. Resumed from that by itself (`--no-load-rng`); and handed over: "
            "threefold's pretrain_gpt.py, on the same command line, resumed it and saved "
            "iteration 4 in Megatron-LM's format (`--ckpt-format torch_dist`, `--exit-interval "
            "4`), which Megatron-LM's pretrain_gpt.py resumed for iterations 5 and 6. What each "
            "logged, by run (its layout's flags):\n\n"
        )
        f.write("\n".join(sections))
        f.write(
            "\nA resumed Megatron-LM run's second log line reports the mean of its first two "
            "iterations' losses (its first line is an extra one, which resets no sums; so is "
            "the uninterrupted run's iteration 2). The gradient norms, which it does not sum, "
            "are each iteration's own.\n"
        )
    print(open(RESULTS).read())


def main() -> None:
    mode, checkout, names = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3:]
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        sys.exit(f"{unknown[0]}: not a run of {sorted(RUNS)}")
    {"fixture": fixture, "handback": handback}[mode](checkout, names)


if __name__ == "__main__":
    main()
