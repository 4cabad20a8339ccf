"""Where the test suite's time goes: per test file and per test, from pytest's JUnit XML.

    python -m pytest -q --junitxml=/tmp/tests.xml tests
    python bench/test_durations.py /tmp/tests.xml --files 40 --tests 40

CI's target is 30 minutes on the 2-core machine; `make test` names only the slowest 40 tests,
and a file of many 2-second parity tests costs more than any one of them. A test's time is
pytest's (setup, call and teardown): the first test to use a world size also pays for its
worker pool, and a test that waits on runs started together (tests/concurrent_runs.py) for
theirs.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="pytest's --junitxml file")
    parser.add_argument("--files", type=int, default=40, help="how many files to list")
    parser.add_argument("--tests", type=int, default=40, help="how many tests to list")
    args = parser.parse_args()

    cases = durations(args.report)
    per_file: dict[str, list[float]] = collections.defaultdict(list)
    for seconds, module, _ in cases:
        per_file[module].append(seconds)
    total = sum(seconds for seconds, _, _ in cases)
    print(f"{len(cases)} tests, {total:.0f} s in all ({total / 60:.1f} min)\n")
    print("| file | tests | seconds | share | mean |")
    print("|---|---:|---:|---:|---:|")
    ranked = sorted(per_file.items(), key=lambda item: -sum(item[1]))
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
