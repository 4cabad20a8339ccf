"""bench/flag_probe.py runs an entry point with one flag at a time at the values a slip gives
and counts what came back (bench/results/flag_probe.md)."""

import os
import subprocess
import sys

from tests.conftest import ROOT


def _probe(tmp_path, flag: str, *argv: str) -> list[str]:
    (tmp_path / "only.txt").write_text(flag + "\n")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "flag_probe.py")]
        + ["--only", str(tmp_path / "only.txt"), "--all", *argv],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_the_probe_tries_a_float_flags_values_and_counts_the_refusals(tmp_path):
    lines = _probe(tmp_path, "--distributed-timeout-minutes")
    # 0, -1, nan, inf and 1e30 minutes: none is a timeout a run can have
    assert "plus one flag at a time: 5 cases" in lines[0], lines
    assert lines[1].endswith(": 5 refused"), lines


def test_the_probe_runs_a_tool_on_the_files_it_made(tmp_path):
    """preprocess_data.py on the probe's corpus: 0 and -1 workers refused, 3 tokenize it
    (100000 tokenizing processes are left out)."""
    lines = _probe(tmp_path, "--workers", "--entry", "preprocess_data.py")
    assert lines[0].startswith("`preprocess_data.py --input "), lines
    assert "plus one flag at a time: 3 cases" in lines[0], lines
    assert lines[1].endswith(": 2 refused, 1 runs"), lines
    assert "| --workers | 3 | runs |" in "\n".join(lines), lines
