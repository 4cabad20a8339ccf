"""--async-save under every collective the training thread runs, looped.

Each loop trains a tiny model for --iterations steps under torchrun with --async-save
--save-interval 1 and the flags whose all-reduces used to collide with the background save
(--exit-signal-handler, --check-for-nan-in-loss-and-grad, --exit-duration-in-mins), on each
layout, and compares it with the same run saved synchronously (made once per layout):

    hang      the run did not end within --timeout seconds
    crash     it ended with a non-zero exit code
    mismatch  a logged loss differs, the tracker does not name the last iteration, or any saved
              iteration's tensor shards or RNG files differ from the synchronous run's (SHA-256
              from each checkpoint's manifest: every tracker position is bitwise correct)

    python bench/async_save_stress.py --loops 20 --out bench/results/async_save_stress.md

--jobs N runs N at once: tests/test_async_save.py's quick check, whose runs mostly wait on
imports and fsync; the seconds in its table are then a shared machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--mock-data",
    "--vocab-size",
    "128",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--lr",
    "1e-3",
    "--distributed-backend",
    "gloo",
    "--save-interval",
    "1",
    "--exit-signal-handler",
    "--check-for-nan-in-loss-and-grad",
    "--exit-duration-in-mins",
    "1000",
]
LAYOUTS = {
    "dp2": (2, ["--global-batch-size", "4"]),
    "dp4-distopt": (4, ["--global-batch-size", "8", "--use-distributed-optimizer"]),
    # FSDP2's shards are DTensors (staged as their local shards), the FP8 layers' all-gather
    # extensions (plain tensors while saved)
    "fsdp2-fp8": (
        2,
        ["--global-batch-size", "4", "--distributed-strategy", "fsdp", "--bf16"]
        + ["--fp8-format", "hybrid", "--fp8-param-gather"],
    ),
    "tp2pp2": (
        4,
        [
            "--global-batch-size",
            "8",
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ],
    ),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(
    layout: str, iterations: int, save: str, asynchronous: bool, timeout: float
) -> tuple[str, str, float]:
    """(outcome: ok / hang / crash, the log, seconds)."""
    nproc, flags = LAYOUTS[layout]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(_free_port()),
        os.path.join(ROOT, "pretrain_gpt.py"),
        *TINY,
        *flags,
        "--train-iters",
        str(iterations),
        "--save",
        save,
        *(["--async-save"] if asynchronous else []),
    ]
    start = time.monotonic()
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
    except subprocess.TimeoutExpired as expired:
        log = (expired.stdout or b"").decode(errors="replace")
        return "hang", log, time.monotonic() - start
    outcome = "ok" if result.returncode == 0 else "crash"
    return outcome, result.stdout + result.stderr, time.monotonic() - start


def _losses(log: str) -> dict[str, str]:
    return dict(re.findall(r" iteration +(\d+)/ +\d+ .*?lm loss: (\S+) \|", log))


def _shards(save: str, iterations: int) -> dict[int, dict[str, str]]:
    """Per saved iteration: {tensor shard or RNG file: sha256} from its manifest."""
    saved = {}
    for iteration in range(1, iterations + 1):
        path = os.path.join(save, f"iter_{iteration:07d}", "manifest.json")
        if not os.path.isfile(path):
            saved[iteration] = {}
            continue
        files = json.load(open(path))["files"]
        saved[iteration] = {
            name: value[1]
            for name, value in files.items()
            if name.endswith(".distcp") or name.startswith("rng/")
        }
    return saved


def _mismatch(reference: tuple, log: str, save: str, iterations: int) -> str | None:
    losses, shards = reference
    if _losses(log) != losses:
        return "losses differ"
    tracker = open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip()
    if tracker != str(iterations):
        return f"tracker names {tracker}"
    for iteration, files in _shards(save, iterations).items():
        if not files or files != shards[iteration]:
            return f"iteration {iteration}'s files differ"
    return None


def _row(layout: str, loops: list[tuple[str, str | None, float, str]]) -> str:
    counts = {"ok": 0, "hang": 0, "crash": 0, "mismatch": 0}
    for outcome, _, _, _ in loops:
        counts[outcome] += 1
    durations = [seconds for _, _, seconds, _ in loops]
    blocked = [float(b) for *_, log in loops for b in re.findall(r"\(([\d.]+) s blocked\)", log)]
    return (
        f"| {layout} | {LAYOUTS[layout][0]} | {len(loops)} | {counts['ok']} | "
        f"{counts['hang']} | {counts['crash']} | {counts['mismatch']} | "
        f"{sum(durations) / len(durations):.1f} | {max(blocked, default=0) * 1000:.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loops", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once (the tests' check; the seconds in the table are then shared ones)",
    )
    parser.add_argument("--out", help="write the table to this markdown file")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="async-save-stress-")
    pool = ThreadPoolExecutor(args.jobs)

    def save_dir(layout: str, name: str) -> str:
        return os.path.join(work, f"{layout}-{name}")

    def run(layout: str, name: str, asynchronous: bool) -> Future:
        save = save_dir(layout, name)
        return pool.submit(_run, layout, args.iterations, save, asynchronous, args.timeout)

    rows, failures = [], 0
    try:
        # Every run starts at once (--jobs at a time); each loop is checked against its
        # layout's synchronous run once both have ended.
        started = {
            layout: (
                run(layout, "sync", False),
                [run(layout, f"async-{loop}", True) for loop in range(args.loops)],
            )
            for layout in args.layouts
        }
        for layout, (synchronous, loops) in started.items():
            outcome, log, _ = synchronous.result()
            if outcome != "ok":
                print(log[-3000:], file=sys.stderr)
                raise SystemExit(f"{layout}: the synchronous reference run ended in {outcome}")
            reference = (_losses(log), _shards(save_dir(layout, "sync"), args.iterations))
            checked = []
            for loop, future in enumerate(loops):
                outcome, log, seconds = future.result()
                save = save_dir(layout, f"async-{loop}")
                problem = (
                    _mismatch(reference, log, save, args.iterations) if outcome == "ok" else None
                )
                outcome = "mismatch" if problem else outcome
                checked.append((outcome, problem, seconds, log))
                print(
                    f"{layout} loop {loop + 1}/{args.loops}: {outcome}"
                    f"{': ' + problem if problem else ''} ({seconds:.1f} s)",
                    flush=True,
                )
                if outcome != "ok":
                    print(log[-3000:], file=sys.stderr)
                shutil.rmtree(save, ignore_errors=True)
            failures += sum(outcome != "ok" for outcome, *_ in checked)
            rows.append(_row(layout, checked))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(work, ignore_errors=True)
    table = "\n".join(
        [
            f"--async-save stress: {args.iterations} iterations, a save every iteration, with "
            "--exit-signal-handler, --check-for-nan-in-loss-and-grad and --exit-duration-in-mins; "
            "each loop compared with the same run saved synchronously.",
            "",
            "| layout | ranks | loops | ok | hang | crash | mismatch | s per run | "
            "max ms blocked per save |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(
                f"# {' '.join(['python', 'bench/async_save_stress.py', *sys.argv[1:]])}\n\n"
                f"{table}\n"
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
