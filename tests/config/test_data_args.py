"""--data-args-path and --per-split-data-args-path (Megatron-LM's): blends read from files,
then checked like any on the command line; their mistakes are one line."""

import json

import pytest

from tests.parity import GPT2_STYLE, TRAINING
from threefold.arguments import parse_args

ON_DATA = [flag for flag in TRAINING if flag != "--mock-data"]


def test_the_files_hold_what_the_flags_would(tmp_path):
    blend = tmp_path / "blend.txt"
    blend.write_text("0.3 /data/web\n0.7\t/data/code\n")
    config = parse_args(GPT2_STYLE + ON_DATA + ["--data-args-path", str(blend)])
    assert config.data.data_path == ["0.3", "/data/web", "0.7", "/data/code"]
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": "1 /data/a 2 /data/b", "valid": ["/v"], "test": None}))
    config = parse_args(GPT2_STYLE + ON_DATA + ["--per-split-data-args-path", str(splits)])
    data = config.data
    assert data.train_data_path == ["1", "/data/a", "2", "/data/b"]
    assert (data.valid_data_path, data.test_data_path) == (["/v"], [])


@pytest.mark.parametrize(
    "flag,content,message",
    [
        ("--data-args-path", None, "cannot read it (No such file or directory)"),
        ("--data-args-path", " \n", "the file is empty"),
        ("--per-split-data-args-path", "{", "not JSON"),
        ("--per-split-data-args-path", '{"train": "/a"}', '"train", "valid" and "test" keys'),
        (
            "--per-split-data-args-path",
            '{"train": "/a", "valid": 3, "test": null}',
            '"valid" must be a string, a list of strings, or null',
        ),
    ],
)
def test_a_bad_file_is_one_line(tmp_path, capsys, flag, content, message):
    path = tmp_path / "args"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit):
        parse_args(GPT2_STYLE + ON_DATA + [flag, str(path)])
    assert message in capsys.readouterr().err


def test_a_blend_given_twice_is_refused(tmp_path, capsys):
    path = tmp_path / "blend.txt"
    path.write_text("/data/web")
    with pytest.raises(SystemExit):
        parse_args(GPT2_STYLE + ON_DATA + ["--data-args-path", str(path), "--data-path", "/x"])
    assert "--data-args-path holds the --data-path blend: give one of them" in (
        capsys.readouterr().err
    )
