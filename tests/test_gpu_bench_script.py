"""bench/gpu_mfu.py runs end to end (on the CPU, with its tiny check model): every contender
gets a row, or a reason; the ratio column is threefold's speed over each contender's."""

import os
import re
import subprocess
import sys

from tests.conftest import ROOT


def test_gpu_mfu_script_runs_on_a_tiny_model(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu_mfu.py"), "--tiny", "--steps", "2",
         "--warmup", "1", "--out", str(tmp_path), "--only", "threefold", "transformers",
         "megatron-core", "torchtitan"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "gpu_mfu.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| contender")}
    assert re.match(r"\| threefold \| [\d,]+ \| [\d.]+ \| n/a .* \| 1\.00 \|$", rows["threefold"])
    assert re.search(r"\| [\d.]+ \|$", rows["transformers"])
    assert "not run: RuntimeError: megatron-core's GPTModel needs CUDA" in rows["megatron-core"]
    assert "not run: RuntimeError: torchtitan is not installed" in rows["torchtitan"]
    log = (tmp_path / "threefold.log").read_text()
    assert "> kernels: transformer-impl local;" in log and "RESULT {" in log
