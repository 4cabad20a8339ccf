"""An entry point run in a fresh interpreter that reports its imports (`python -X importtime`):
what it said, and whether it imported torch (three seconds a mistake should not cost)."""

import re
import subprocess
import sys
from dataclasses import dataclass

from tests.conftest import ROOT


@dataclass
class Run:
    returncode: int
    stdout: str
    said: list[str]  # stderr without the import timings
    imported_torch: bool


def run_watching_imports(script: str, *argv: str, cwd: str = ROOT) -> Run:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", script, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return Run(
        result.returncode,
        result.stdout,
        [line for line in result.stderr.splitlines() if not line.startswith("import time:")],
        re.search(r"\| +torch$", result.stderr, re.MULTILINE) is not None,
    )
