"""The README's "Your own data, step by step" block works as pasted: run as written (only its
working folder `own/` moved into a temporary directory), it trains, samples, fine-tunes."""

import os
import re
import subprocess
import sys

from tests.conftest import ROOT
from tests.distributed import free_port


def _walkthrough() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("### Your own data, step by step") :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_own_data_walkthrough_runs_as_written(tmp_path):
    block = _walkthrough().replace("source .venv/bin/activate\n", "")
    assert "own/" in block
    block = block.replace("own/", f"{tmp_path}/own/").replace(
        "mkdir -p own", f"mkdir -p {tmp_path}/own"
    )
    # The test's interpreter stands for the activated virtual environment. The block's torchrun
    # takes its port from PET_MASTER_PORT (its default, 29500, another launch may hold).
    environment = dict(
        os.environ,
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        PET_MASTER_PORT=str(free_port()),
    )
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout
    done = re.findall(r"> done: (\d+) iterations .*?best validation loss ([\d.]+)", output)
    assert [int(n) for n, _ in done] == [100, 200], output[-3000:]
    # The fine-tuned model answers the way it was tuned to.
    assert "# square\ndef square(x):\n    return x * x" in output, output[-2000:]
