"""bench/test_durations.py adds up pytest's JUnit report per file and ranks the tests."""

import os
import subprocess
import sys

from tests.conftest import ROOT

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.a" name="test_one" time="3.0"/>
<testcase classname="tests.a" name="test_two" time="1.0"/>
<testcase classname="tests.b" name="test_slow" time="6.0"/>
</testsuite></testsuites>"""


def test_files_and_tests_are_ranked_by_their_seconds(tmp_path):
    (tmp_path / "report.xml").write_text(REPORT)
    script = os.path.join(ROOT, "bench", "test_durations.py")
    result = subprocess.run(
        [sys.executable, script, str(tmp_path / "report.xml"), "--tests", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "3 tests, 10 s in all (0.2 min)"
    files = [line for line in lines if line.startswith("| tests.") and line.count("|") == 6]
    assert files == ["| tests.b | 1 | 6.0 | 60.0% | 6.0 |", "| tests.a | 2 | 4.0 | 40.0% | 2.0 |"]
    ranked = [line for line in lines if "::" in line]
    assert ranked == ["| tests.b::test_slow | 6.0 |", "| tests.a::test_one | 3.0 |"]
