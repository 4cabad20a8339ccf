"""Every entry point's --help describes every flag it takes (with its default where it has
one), under the entry point's own name, and answers before torch is imported (a flag mistake
costs a tenth of a second, not the three of torch's import); a flag mistake is one line, not
argparse's usage block; the planning tools answer whole without torch."""

import os
import re

import pytest

from tests.tools.imports import run_watching_imports

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


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help_describes_every_flag(script):
    run = run_watching_imports(script, "--help")
    assert run.returncode == 0, run.said[-30:]
    assert run.stdout.startswith(f"usage: {os.path.basename(script)}")
    assert flags_without_help(run.stdout) == []
    assert not run.imported_torch


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_a_flag_mistake_is_one_line_before_torch(script):
    run = run_watching_imports(script, "--no-such-flag")
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.said) == 1 and run.said[0].startswith(f"{os.path.basename(script)}: error: ")
    assert not run.imported_torch


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
    run = run_watching_imports(*argv)
    assert run.returncode == 0 and "GiB" in run.stdout, run.said[-30:]
    assert not run.imported_torch
