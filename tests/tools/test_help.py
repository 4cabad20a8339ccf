"""Every entry point's --help describes every flag it takes (with its default where it has
one), under the entry point's own name, and answers before torch is imported (a flag mistake
costs a tenth of a second, not the three of torch's import); a flag mistake is one line, not
argparse's usage block; the planning tools answer whole without torch."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY_POINTS = ["pretrain_gpt.py", "finetune.py"] + [
    os.path.join("tools", name)
    for name in sorted(os.listdir(os.path.join(ROOT, "tools")))
    if name.endswith(".py")
]


def flags_without_help(text: str) -> list[str]:
    """The options of an argparse --help text that are listed with no description."""
    lines = text.splitlines()
    missing = []
    for index, line in enumerate(lines):
        option = re.match(r"^  (-{1,2}\S+)(.*)$", line)
        if option is None:
            continue
        described = re.search(r"\S\s{2,}\S", line.strip())  # help on the option's own line
        following = lines[index + 1] if index + 1 < len(lines) else ""
        if not described and not re.match(r"^ {4,}\S", following):
            missing.append(option.group(1))
    return missing


def test_the_walker_finds_a_flag_without_help():
    text = "options:\n  -h, --help  show this\n  --bare BARE\n  --told TOLD  it says\n"
    assert flags_without_help(text) == ["--bare"]


def _imports_torch(importtime: str) -> bool:
    return re.search(r"\| +torch$", importtime, re.MULTILINE) is not None


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help_describes_every_flag(script):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", script, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"usage: {os.path.basename(script)}")
    assert flags_without_help(result.stdout) == []
    assert not _imports_torch(result.stderr)


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_a_flag_mistake_is_one_line_before_torch(script):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", script, "--no-such-flag"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2 and result.stdout == ""
    assert len(said) == 1 and said[0].startswith(f"{os.path.basename(script)}: error: "), said
    assert not _imports_torch(result.stderr)


MODEL = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 "
    "--max-position-embeddings 4096 --micro-batch-size 1 --vocab-size 32000"
).split()


@pytest.mark.parametrize(
    "argv",
    [
        ["tools/estimate_memory.py", *MODEL, "--tensor-model-parallel-size", "8"],
        ["tools/plan_layout.py", "--gpus", "16", "--global-batch-size", "64", *MODEL],
    ],
    ids=["estimate_memory", "plan_layout"],
)
def test_the_planning_tools_answer_without_torch(argv):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "GiB" in result.stdout, result.stderr[-3000:]
    assert not _imports_torch(result.stderr)
