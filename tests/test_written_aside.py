"""threefold/written_aside.py: a file is replaced whole or not at all, and nothing is left
beside it either way."""

import os

import pytest

from threefold.written_aside import write_atomically, written_aside


def test_a_failure_leaves_the_old_files_and_no_temporary(tmp_path):
    paths = [str(tmp_path / "corpus.bin"), str(tmp_path / "corpus.idx")]
    for path in paths:
        write_atomically(path, "good")
    with pytest.raises(RuntimeError), written_aside(*paths) as temporaries:
        assert [os.path.splitext(t)[1] for t in temporaries] == [".bin", ".idx"]
        for temporary in temporaries:
            with open(temporary, "w") as f:
                f.write("half")
        raise RuntimeError("the disk filled")
    assert [open(p).read() for p in paths] == ["good", "good"]
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.idx"]


def test_success_replaces_every_file_in_the_order_given(tmp_path, monkeypatch):
    renamed, replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(b), replace(a, b)))
    paths = [str(tmp_path / "tokenizer.vocab"), str(tmp_path / "tokenizer.model")]
    with written_aside(*paths) as temporaries:
        for temporary, text in zip(temporaries, ("vocab", "model")):
            with open(temporary, "w") as f:
                f.write(text)
    assert [open(p).read() for p in paths] == ["vocab", "model"]
    assert renamed == paths  # (the model, which a run reads, last)
    assert sorted(os.listdir(tmp_path)) == ["tokenizer.model", "tokenizer.vocab"]
