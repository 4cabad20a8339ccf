"""bench/flag_probe.py runs pretrain_gpt.py with one flag at a time at the values a slip gives
and counts what came back (bench/results/flag_probe.md)."""

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_the_probe_tries_a_float_flags_values_and_counts_the_refusals(tmp_path):
    (tmp_path / "only.txt").write_text("--distributed-timeout-minutes\n")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "flag_probe.py")]
        + ["--only", str(tmp_path / "only.txt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # 0, -1, nan, inf and 1e30 minutes: none is a timeout a run can have
    assert "plus one flag at a time: 5 cases" in lines[0], result.stdout
    assert lines[1].endswith(": 5 refused"), result.stdout
