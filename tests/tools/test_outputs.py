"""Every tool that writes a file or a directory checks where it goes before any work and before
torch is imported: a file standing where its directory must be is one line naming the flag
(threefold/output_directory.py), not a traceback after the tokenizing or the conversion."""

import os

import pytest

from tests.conftest import ROOT
from tests.tools.imports import run_watching_imports

# tool: (its arguments, the flag of its output); {blocked} is a file, {tmp} a directory.
TOOLS = {
    "preprocess_data.py": (
        ["--input", "{tmp}/corpus.jsonl", "--tokenizer-type", "NullTokenizer"]
        + ["--vocab-size", "100", "--output-prefix", "{blocked}/data"],
        "--output-prefix",
    ),
    "train_tokenizer.py": (
        ["--input", "{tmp}/corpus.jsonl", "--model-prefix", "{blocked}/sp"],
        "--model-prefix",
    ),
    "prepare_default_corpus.py": (["--output", "{blocked}/corpus.jsonl"], "--output"),
    "plot_logs.py": (["{tmp}/training.log", "--output", "{blocked}/training.png"], "--output"),
    "convert_checkpoint.py": (
        ["--loader", "hf", "--saver", "threefold", "--load-dir", "{tmp}"]
        + ["--save-dir", "{blocked}/converted"],
        "--save-dir",
    ),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_an_output_under_a_file_is_one_line_before_any_work(tool, tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"text": "1 2 3"}\n')
    (tmp_path / "training.log").write_text(" iteration        1/       1 | lm loss: 2.0 |\n")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the output's directory must be\n")
    argv, flag = TOOLS[tool]
    argv = [arg.format(tmp=tmp_path, blocked=blocked) for arg in argv]
    run = run_watching_imports(os.path.join(ROOT, "tools", tool), *argv)
    output = argv[argv.index(flag) + 1]
    assert (run.returncode, run.said) == (
        2,
        [
            f"{tool}: error: {flag} {output}: cannot write there ({blocked} is a file); give a "
            "path in a writable directory"
        ],
    )
    assert not run.imported_torch
    assert blocked.read_text() == "a file where the output's directory must be\n"


def test_plot_logs_writes_a_whole_png_or_refuses_another_format(tmp_path):
    """(before: --output plot.svg drew the figure, then failed on the PNG-only metadata with a
    traceback; the PNG is drawn aside and renamed, so a plot there is never half-replaced)"""
    log = tmp_path / "training.log"
    log.write_text(" iteration        1/       1 | lm loss: 2.0 |\n")
    script = os.path.join(ROOT, "tools", "plot_logs.py")
    refused = run_watching_imports(script, str(log), "--output", str(tmp_path / "plot.svg"))
    assert (refused.returncode, refused.said) == (
        2,
        [f"plot_logs.py: error: --output {tmp_path / 'plot.svg'}: give a .png file"],
    )
    drawn = run_watching_imports(script, str(log), "--output", str(tmp_path / "plot.png"))
    assert drawn.returncode == 0, drawn.said
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(os.listdir(tmp_path)) == ["plot.png", "training.log"]


# (plot_logs.py's --output '' is refused first as not a .png file)
@pytest.mark.parametrize("tool", sorted(set(TOOLS) - {"plot_logs.py"}))
def test_an_empty_output_path_is_one_line_before_any_work(tool, tmp_path):
    """(before: convert_checkpoint.py --save-dir '' ended in FileNotFoundError; the others
    wrote their files into the directory they were started in)"""
    (tmp_path / "corpus.jsonl").write_text('{"text": "1 2 3"}\n')
    (tmp_path / "training.log").write_text(" iteration        1/       1 | lm loss: 2.0 |\n")
    argv, flag = TOOLS[tool]
    argv = [arg.format(tmp=tmp_path, blocked=tmp_path) for arg in argv]
    argv[argv.index(flag) + 1] = ""
    run = run_watching_imports(os.path.join(ROOT, "tools", tool), *argv, cwd=str(tmp_path))
    assert (run.returncode, run.said) == (
        2,
        [f"{tool}: error: {flag} is empty: give the path to write"],
    )
    assert not run.imported_torch
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl", "training.log"]


@pytest.mark.parametrize("tool", ["prepare_default_corpus.py", "plot_logs.py"])
def test_a_directory_where_an_output_file_goes_is_one_line_before_any_work(tool, tmp_path):
    """(before: prepare_default_corpus.py --output .. wrote the corpus aside, then failed to
    rename it over the directory with OSError's traceback)"""
    (tmp_path / "training.log").write_text(" iteration        1/       1 | lm loss: 2.0 |\n")
    directory = tmp_path / "out.png"
    directory.mkdir()
    argv, flag = TOOLS[tool]
    argv = [arg.format(tmp=tmp_path, blocked=tmp_path) for arg in argv]
    argv[argv.index(flag) + 1] = str(directory)
    run = run_watching_imports(os.path.join(ROOT, "tools", tool), *argv)
    assert (run.returncode, run.said) == (
        2,
        [f"{tool}: error: {flag} {directory}: a directory; give the file to write"],
    )
    assert not run.imported_torch and sorted(os.listdir(tmp_path)) == ["out.png", "training.log"]
    assert not os.listdir(directory)
