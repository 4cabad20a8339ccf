"""Every flag of an entry point (pretrain_gpt.py, finetune.py, a tool), one at a time, at values
a slip of the keyboard gives (0, -1, 3, 100000; 0, -1, nan, inf, 1e30; an empty string, a
missing path, a directory, a word; each of a choice's choices; a switch on), on a tiny run:
what must never come back is a traceback.

    python bench/flag_probe.py [--entry finetune.py] [--extra "--bf16 --use-distributed-optimizer"]
        [--only FILE] [--kinds choice,switch] [--ranks 2] [--jobs 2] [--timeout 40] [--all]

bench/results/flag_probe.md holds its passes (pretrain_gpt.py plain, with a mixture, a hybrid,
FP8 and each layout on two ranks; finetune.py; each tool) and what they found.

Each case is the entry's `main` in a child forked from this process, which imported the
trainer once (half a second a case, where a fresh process spends three on its imports); a
child has its own directory, port and output. The tiny runs read files made once
(bench/flag_probe_entries.py: a checkpoint, conversations, a corpus), and the tiny run alone
must succeed before any case is tried. Outcomes: `runs` (exit 0), `refused` (exit 2, its
last line `PROG: error: ...`), `stopped` (another exit, no traceback: a loss gone NaN under
--check-for-nan-in-loss-and-grad), `traceback` (Python's, or a C++ stack torch printed), and
`still running` at --timeout (a model of 100000 layers is a large model, not a mistake). Only
the last two are listed case by case (every case with --all). `--only` takes a file of flags,
one a line: those refused on the plain run, tried again where their feature is on (`--extra
"--num-experts 4 ..."`); a layout's pass needs only the flags that pick code (`--kinds
choice,switch`).
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.startup import frozen_imports  # noqa: E402

with frozen_imports():  # what the entry points import after their flags
    import threefold.checkpoint.load  # noqa: F401
    import threefold.data.tokenizer  # noqa: F401
    import threefold.inference  # noqa: F401
    import threefold.training.trainer  # noqa: F401

import torch  # noqa: E402

from bench.flag_probe_entries import Entry, entries, write_fixtures  # noqa: E402
from tests.distributed import free_port, worker_environment  # noqa: E402

SWITCHES = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse.BooleanOptionalAction,
)
# (100000 data-loader or tokenizing processes are what they say, and take the machine down)
SKIPPED = {("--num-workers", "100000"), ("--workers", "100000")}
KINDS = {"choice", "switch", "int", "float", "text"}
# What counts as a traceback: Python's, and the C++ stack torch prints with a warning (a
# rank's store gone with the rank that hosted it)
STACKS = ("Traceback (most recent call last)", "Exception raised from ")


def _accepts(action: argparse.Action, text: str) -> bool:
    try:
        action.type(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return True


def _kind(action: argparse.Action) -> str:
    if action.choices:
        return "choice"
    if isinstance(action, SWITCHES):
        return "switch"
    if action.type is not None and _accepts(action, "7") and not _accepts(action, "0.5"):
        return "int"
    if action.type is not None and _accepts(action, "0.5"):
        return "float"
    return "text"


VALUES = {
    "switch": [None],
    "int": ["0", "-1", "3", "100000"],
    "float": ["0", "-1", "nan", "inf", "1e30"],
    # (relative: a case runs in its own directory, and writes nothing outside the probe's)
    "text": ["", "missing/x", "..", "x"],
}


def _values(action: argparse.Action) -> list[str | None]:
    kind = _kind(action)
    return [str(choice) for choice in action.choices] if kind == "choice" else VALUES[kind]


def cases(
    parser: argparse.ArgumentParser, only: set[str] | None, kinds: set[str] = KINDS
) -> list[tuple[str, str | None]]:
    found = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = max(action.option_strings, key=len)
        if (only is None or flag in only) and _kind(action) in kinds:
            found += [(flag, v) for v in _values(action) if (flag, v) not in SKIPPED]
    return found


def _argv(flag: str, value: str | None, base: list[str]) -> list[str]:
    argv = list(base)
    if flag in argv:  # the case's value replaces the run's own (a switch has none)
        at = argv.index(flag)
        del argv[at : at + (1 if value is None else 2)]
    return argv + [flag] + ([] if value is None else value.split(" "))


def _child(entry: Entry, argv: list[str], directory: str, rank: int, ranks: int, port: int):
    output = os.open(f"{directory}/output{rank}.txt", os.O_WRONLY | os.O_CREAT)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.environ.update(worker_environment(rank, ranks, port))
    if ranks > 1:
        torch.set_num_threads(1)  # (torchrun's OMP_NUM_THREADS for more than one worker)
    os.chdir(directory)
    sys.argv = [entry.prog] + argv
    code = 1
    try:
        code = entry.main() or 0
    except SystemExit as stop:  # argparse's
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 (what the probe looks for: printed, then counted)
        import traceback

        traceback.print_exc()
        code = 98
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _outcome(prog: str, codes: list[int | None], outputs: list[str]) -> str:
    if any(stack in output for output in outputs for stack in STACKS):
        return "traceback"
    if None in codes:
        return "still running"
    if not any(codes):
        return "runs"
    lasts = [output.strip().splitlines()[-1] for output in outputs if output.strip()]
    if 2 in codes and any(last.startswith(f"{prog}: error") for last in lasts):
        return "refused"
    return "stopped"


def _start(entry: Entry, argv: list[str], directory: str, ranks: int) -> list[int]:
    port = free_port()
    pids = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            _child(entry, argv, directory, rank, ranks, port)
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


def _alone(entry: Entry, argv: list[str], directory: str, ranks: int = 1) -> tuple[int, str]:
    """`entry` run on `argv` to its end, or killed after 10 minutes: the exit code of the
    first rank reaped that failed (-9 for a killed one), and rank 0's output."""
    codes, deadline = {}, time.monotonic() + 600
    pids = _start(entry, argv, directory, ranks)
    while not _finished(pids, codes, deadline):
        time.sleep(0.1)
    failed = [-signal.SIGKILL if code is None else code for code in codes.values() if code != 0]
    with open(f"{directory}/output0.txt", errors="replace") as f:
        return (failed[0] if failed else 0), f.read()


def probe(
    entry: Entry, cases: list, extra: list[str], jobs: int, ranks: int, timeout: float, root: str
):
    """(flag, value, outcome, seconds, last line) for each case, `jobs` cases at a time; a
    case's run is `entry`'s tiny one on the fixtures in `root`, plus `extra`."""
    fixtures = os.path.join(root, "fixtures")
    os.makedirs(fixtures)
    if entry.reads_fixtures:
        write_fixtures(fixtures, lambda script, argv: _alone(entries()[script], argv, fixtures))
    alone = os.path.join(root, "alone")
    os.makedirs(alone)
    code, output = _alone(entry, entry.argv(fixtures, alone) + extra, alone, ranks)
    if code:  # (else every case would be refused for the tiny run's own fault)
        sys.exit(f"the tiny run itself exits {code}, no case is probed:\n{output[-3000:]}")
    pending, running, results, again = list(enumerate(cases)), [], [], set()
    while pending or running:
        while pending and len(running) < jobs:
            number, (flag, value) = pending.pop(0)
            directory = os.path.join(root, str(number))
            os.makedirs(directory)
            argv = _argv(flag, value, entry.argv(fixtures, directory) + extra)
            pids = _start(entry, argv, directory, ranks)
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
            outcome = _outcome(entry.prog, [codes[pid] for pid in pids], outputs)
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
    known = entries()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--entry", choices=sorted(known), default="pretrain_gpt.py", help="the script probed"
    )
    parser.add_argument("--extra", default="", help="flags added to the tiny run")
    parser.add_argument("--only", help="a file of flags, one a line: probe these only")
    parser.add_argument("--jobs", type=int, default=2, help="cases at a time")
    parser.add_argument("--ranks", type=int, default=1, help="processes a case, as torchrun's")
    parser.add_argument("--timeout", type=float, default=40)
    parser.add_argument("--all", action="store_true", help="list every case, not only the bad")
    parser.add_argument(
        "--kinds",
        default=",".join(sorted(KINDS)),
        help="which flags, by the values they take: choice,switch,int,float,text (a layout's "
        "pass needs only the flags that pick code: choice,switch)",
    )
    args = parser.parse_args()
    only = set(open(args.only).read().split()) if args.only else None
    kinds = set(args.kinds.split(","))
    if not kinds <= KINDS:
        parser.error(f"--kinds: {','.join(sorted(kinds - KINDS))} is not one of {sorted(KINDS)}")
    entry, extra = known[args.entry], args.extra.split()
    todo = cases(entry.parser(), only, kinds)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        results = probe(entry, todo, extra, args.jobs, args.ranks, args.timeout, root)
        base = shlex.join(entry.argv("FIXTURES", "CASE") + extra)
    counts = collections.Counter(outcome for _, _, outcome, _, _ in results)
    which = "" if kinds == KINDS else f" ({','.join(sorted(kinds))} flags)"
    print(
        f"`{entry.prog} {base}` on {args.ranks} rank(s), plus one flag at a time{which}: "
        f"{len(results)} cases"
    )
    tally = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
    print(f"in {time.monotonic() - start:.0f} s: {tally}")
    listed = [r for r in results if args.all or r[2] in ("traceback", "still running")]
    if listed:
        print("\n| flag | value | outcome | s | last line |\n| --- | --- | --- | ---: | --- |")
    for flag, value, outcome, seconds, last in sorted(listed):
        last = last.replace("|", "\\|")[:160]
        print(f"| {flag} | {value} | {outcome} | {seconds:.0f} | {last} |")


if __name__ == "__main__":
    main()
