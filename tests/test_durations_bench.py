"""bench/test_durations.py adds up pytest's JUnit report per file and ranks the tests, or the
files by their change from an earlier report."""

import os
import subprocess
import sys

from tests.conftest import ROOT

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.a" name="test_one" time="3.0"/>
<testcase classname="tests.a" name="test_two" time="1.0"/>
<testcase classname="tests.b" name="test_slow" time="6.0"/>
</testsuite></testsuites>"""


def _script(*argv: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "test_durations.py"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.splitlines()


def test_files_and_tests_are_ranked_by_their_seconds(tmp_path):
    (tmp_path / "report.xml").write_text(REPORT)
    lines = _script(str(tmp_path / "report.xml"), "--tests", "2")
    assert lines[0] == "3 tests, 10 s in all (0.2 min)"
    files = [line for line in lines if line.startswith("| tests.") and line.count("|") == 6]
    assert files == ["| tests.b | 1 | 6.0 | 60.0% | 6.0 |", "| tests.a | 2 | 4.0 | 40.0% | 2.0 |"]
    ranked = [line for line in lines if "::" in line]
    assert ranked == ["| tests.b::test_slow | 6.0 |", "| tests.a::test_one | 3.0 |"]


def test_files_are_ranked_by_their_change_from_an_earlier_report(tmp_path):
    (tmp_path / "before.xml").write_text(REPORT)
    after = REPORT.replace('time="3.0"', 'time="2.0"').replace('time="6.0"', 'time="9.5"')
    extra = '<testcase classname="tests.c" name="test_new" time="0.5"/>'
    after = after.replace("</testsuite>", extra + "</testsuite>")
    (tmp_path / "after.xml").write_text(after)
    lines = _script(str(tmp_path / "after.xml"), "--compare", str(tmp_path / "before.xml"))
    assert lines[0] == "10 s before, 13 s after (+3 s, +30.0%)"
    rows = [line for line in lines if line.startswith("| tests.")]
    assert rows == [
        "| tests.b | 6.0 | 9.5 | +3.5 |",
        "| tests.a | 4.0 | 3.0 | -1.0 |",
        "| tests.c | 0.0 | 0.5 | +0.5 |",
    ]
