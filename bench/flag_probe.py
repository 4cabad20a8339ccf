"""Every flag of pretrain_gpt.py, one at a time, at values a slip of the keyboard gives (0, -1,
3, 100000; 0, -1, nan, inf, 1e30; an empty string, a missing path, a directory, a word; each
of a choice's choices; a switch on), on a tiny run: what must never come back is a traceback.

    python bench/flag_probe.py [--extra "--bf16 --use-distributed-optimizer"] [--only FILE]
        [--ranks 2] [--jobs 2] [--timeout 40]

bench/results/flag_probe.md holds its passes (plain, a mixture, a hybrid, FP8, two ranks) and
what the first ones found.

Each case is `pretrain_gpt.main` in a child forked from this process, which imported the
trainer once (half a second a case, where a fresh process spends three on its imports); a
child has its own directory, port and output. Outcomes: `trains` (exit 0), `refused` (exit 2,
its last line `pretrain_gpt.py: error: ...`), `stopped` (another exit, no traceback: a loss
gone NaN under --check-for-nan-in-loss-and-grad), `traceback`, and `still running` at
--timeout (a model of 100000 layers is a large model, not a mistake). Only the last two are
listed case by case. `--only` takes a file of flags, one a line: those refused on the plain
run, tried again where their feature is on (`--extra "--num-experts 4 ..."`).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.startup import frozen_imports  # noqa: E402

with frozen_imports():
    import threefold.checkpoint.load  # noqa: F401
    import threefold.training.trainer  # noqa: F401

import torch  # noqa: E402

import pretrain_gpt  # noqa: E402
from tests.distributed import free_port, worker_environment  # noqa: E402
from threefold.arguments import build_parser  # noqa: E402

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --train-iters 2 "
    "--lr 1e-3 --mock-data --vocab-size 100 --log-interval 1 --eval-interval 2 --eval-iters 1 "
    "--save-interval 2"
).split()
SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)
# (a data loader of 100000 worker processes is what it says, and takes the machine down)
SKIPPED = {("--num-workers", "100000")}


def _accepts(action: argparse.Action, text: str) -> bool:
    try:
        action.type(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return True


def _values(action: argparse.Action) -> list[str | None]:
    if action.choices:
        return [str(choice) for choice in action.choices]
    if isinstance(action, SWITCHES):
        return [None]
    if action.type is not None and _accepts(action, "7") and not _accepts(action, "0.5"):
        return ["0", "-1", "3", "100000"]  # an int
    if action.type is not None and _accepts(action, "0.5"):
        return ["0", "-1", "nan", "inf", "1e30"]
    return ["", "/nonexistent/x", "/tmp", "x"]


def cases(only: set[str] | None) -> list[tuple[str, str | None]]:
    found = []
    for action in build_parser()._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = max(action.option_strings, key=len)
        if only is None or flag in only:
            found += [(flag, v) for v in _values(action) if (flag, v) not in SKIPPED]
    return found


def _argv(flag: str, value: str | None, base: list[str], directory: str) -> list[str]:
    argv = base + ["--save", f"{directory}/checkpoints", "--tensorboard-dir", f"{directory}/tb"]
    if flag in argv:  # the case's value replaces the run's own
        at = argv.index(flag)
        del argv[at : at + 2]
    return argv + [flag] + ([] if value is None else value.split(" "))


def _child(argv: list[str], directory: str, rank: int, ranks: int, port: int) -> None:
    output = os.open(f"{directory}/output{rank}.txt", os.O_WRONLY | os.O_CREAT)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.environ.update(worker_environment(rank, ranks, port))
    if ranks > 1:
        torch.set_num_threads(1)  # (torchrun's OMP_NUM_THREADS for more than one worker)
    os.chdir(directory)
    code = 1
    try:
        code = pretrain_gpt.main(argv) or 0
    except SystemExit as stop:  # argparse's
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 (what the probe looks for: printed, then counted)
        import traceback

        traceback.print_exc()
        code = 98
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _outcome(codes: list[int | None], outputs: list[str]) -> str:
    if any("Traceback (most recent call last)" in output for output in outputs):
        return "traceback"
    if None in codes:
        return "still running"
    if not any(codes):
        return "trains"
    lasts = [output.strip().splitlines()[-1] for output in outputs if output.strip()]
    if 2 in codes and any(last.startswith("pretrain_gpt.py: error") for last in lasts):
        return "refused"
    return "stopped"


def _start(argv: list[str], directory: str, ranks: int) -> list[int]:
    port = free_port()
    pids = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            _child(argv, directory, rank, ranks, port)
        pids.append(pid)
    return pids


def _finished(pids: list[int], codes: dict[int, int | None], deadline: float) -> bool:
    """Reaps the ranks that ended into `codes`; at the deadline kills the rest (code None).
    True once every rank has a code."""
    for pid in pids:
        if pid not in codes:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
    if len(codes) == len(pids):
        return True
    if time.monotonic() < deadline:
        return False
    for pid in pids:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[pid] = None
    return True


def probe(cases: list, base: list[str], jobs: int, ranks: int, timeout: float, root: str):
    """(flag, value, outcome, seconds, last line) for each case, `jobs` cases at a time."""
    pending, running, results, again = list(enumerate(cases)), [], [], set()
    while pending or running:
        while pending and len(running) < jobs:
            number, (flag, value) = pending.pop(0)
            directory = os.path.join(root, str(number))
            os.makedirs(directory)
            pids = _start(_argv(flag, value, base, directory), directory, ranks)
            running.append((flag, value, directory, time.monotonic(), pids, {}))
        for case in list(running):
            flag, value, directory, start, pids, codes = case
            if not _finished(pids, codes, start + timeout):
                continue
            outputs = []
            for rank in range(ranks):
                with open(f"{directory}/output{rank}.txt", errors="replace") as f:
                    outputs.append(f.read())
            lasts = [output.strip().splitlines()[-1] for output in outputs if output.strip()]
            outcome = _outcome([codes[pid] for pid in pids], outputs)
            seconds = time.monotonic() - start
            shutil.rmtree(directory, ignore_errors=True)
            running.remove(case)
            if any("EADDRINUSE" in output for output in outputs) and (flag, value) not in again:
                # the probe's, not the flag's: another case's store took the free port first
                again.add((flag, value))
                pending.append((len(cases) + len(again), (flag, value)))
                continue
            results.append((flag, value, outcome, seconds, lasts[0] if lasts else ""))
        time.sleep(0.02)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", default="", help="flags added to the tiny run")
    parser.add_argument("--only", help="a file of flags, one a line: probe these only")
    parser.add_argument("--jobs", type=int, default=2, help="cases at a time")
    parser.add_argument("--ranks", type=int, default=1, help="processes a case, as torchrun's")
    parser.add_argument("--timeout", type=float, default=40)
    args = parser.parse_args()
    only = set(open(args.only).read().split()) if args.only else None
    base = TINY + args.extra.split()
    todo = cases(only)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        results = probe(todo, base, args.jobs, args.ranks, args.timeout, root)
    counts = collections.Counter(outcome for _, _, outcome, _, _ in results)
    print(
        f"`pretrain_gpt.py {' '.join(base)}` on {args.ranks} rank(s), plus one flag at a "
        f"time: {len(results)} cases"
    )
    tally = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
    print(f"in {time.monotonic() - start:.0f} s: {tally}")
    listed = [r for r in results if r[2] in ("traceback", "still running")]
    if listed:
        print("\n| flag | value | outcome | s | last line |\n| --- | --- | --- | ---: | --- |")
    for flag, value, outcome, seconds, last in sorted(listed):
        last = last.replace("|", "\\|")[:160]
        print(f"| {flag} | {value} | {outcome} | {seconds:.0f} | {last} |")


if __name__ == "__main__":
    main()
