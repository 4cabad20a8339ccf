"""Where the test suite's time goes: per test file and per test, from pytest's JUnit XML.

    python -m pytest -q --junitxml=/tmp/tests.xml tests
    python bench/test_durations.py /tmp/tests.xml --files 40 --tests 40
    python bench/test_durations.py /tmp/tests.xml --compare /tmp/before.xml --files 30

CI's target is 30 minutes on the 2-core machine; `make test` names only the slowest 40 tests,
and a file of many 2-second parity tests costs more than any one of them. A test's time is
pytest's (setup, call and teardown): the first test to use a world size also pays for its
worker pool, and a test that waits on runs started together (tests/concurrent_runs.py) for
theirs. `--compare` lists the files by how much their time changed from an earlier report;
two runs of the same code on this machine differ by minutes, so read a file's change beside
those of files the change cannot touch (command-line runs for a change to the pools).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def durations(path: str) -> list[tuple[float, str, str]]:
    """(seconds, module, test name) for every test case in the report."""
    root = ET.parse(path).getroot()
    return [
        (float(case.get("time", 0.0)), case.get("classname", ""), case.get("name", ""))
        for case in root.iter("testcase")
    ]


def per_file(cases: list[tuple[float, str, str]]) -> dict[str, list[float]]:
    """{module: its tests' seconds}."""
    files: dict[str, list[float]] = collections.defaultdict(list)
    for seconds, module, _ in cases:
        files[module].append(seconds)
    return files


def compare(
    before: list[tuple[float, str, str]], after: list[tuple[float, str, str]], limit: int
) -> None:
    """The files whose time changed most from `before` to `after`, either way."""
    old = {module: sum(times) for module, times in per_file(before).items()}
    new = {module: sum(times) for module, times in per_file(after).items()}
    total_old, total_new = sum(old.values()), sum(new.values())
    print(
        f"{total_old:.0f} s before, {total_new:.0f} s after "
        f"({total_new - total_old:+.0f} s, {total_new / total_old - 1:+.1%})\n"
    )
    print("| file | before | after | change |")
    print("|---|---:|---:|---:|")
    changed = sorted(old.keys() | new.keys(), key=lambda m: -abs(new.get(m, 0) - old.get(m, 0)))
    for module in changed[:limit]:
        a, b = old.get(module, 0.0), new.get(module, 0.0)
        print(f"| {module} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="pytest's --junitxml file")
    parser.add_argument("--files", type=int, default=40, help="how many files to list")
    parser.add_argument("--tests", type=int, default=40, help="how many tests to list")
    parser.add_argument("--compare", metavar="BEFORE", help="an earlier report to compare with")
    args = parser.parse_args()

    cases = durations(args.report)
    if args.compare:
        compare(durations(args.compare), cases, args.files)
        return
    total = sum(seconds for seconds, _, _ in cases)
    print(f"{len(cases)} tests, {total:.0f} s in all ({total / 60:.1f} min)\n")
    print("| file | tests | seconds | share | mean |")
    print("|---|---:|---:|---:|---:|")
    ranked = sorted(per_file(cases).items(), key=lambda item: -sum(item[1]))
    for module, times in ranked[: args.files]:
        seconds = sum(times)
        print(
            f"| {module} | {len(times)} | {seconds:.1f} | {seconds / total:.1%} "
            f"| {seconds / len(times):.1f} |"
        )
    print("\n| test | seconds |")
    print("|---|---:|")
    for seconds, module, name in sorted(cases, reverse=True)[: args.tests]:
        print(f"| {module}::{name} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
