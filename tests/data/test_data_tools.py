"""tools/preprocess_data.py writes Megatron's format; threefold reads it back exactly."""

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from threefold.arguments import parse_args
from threefold.config import ConfigError
from threefold.data.loader import build_datasets
from threefold.data.tokenizer import HuggingFaceTokenizer, NullTokenizer, SentencePieceTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = [
    f"Document {i}: the quick brown fox jumps over the lazy dog {i} times." * 3 for i in range(40)
]


def _tool(name: str, *argv: str) -> None:
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", name), *argv],
        check=True,
        capture_output=True,
        timeout=120,
    )


def _trained_tokenizer(tmp_path) -> str:
    """TEXTS as tmp_path/corpus.jsonl, and a 300-piece tokenizer trained on it: its prefix."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prefix = str(tmp_path / "sp")
    _tool(
        "train_tokenizer.py",
        "--input",
        str(corpus),
        "--vocab-size",
        "300",
        "--model-prefix",
        prefix,
    )
    return prefix


def test_preprocess_round_trip_through_megatron_core(tmp_path):
    _trained_tokenizer(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    _tool(
        "preprocess_data.py",
        "--input",
        str(corpus),
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        str(tmp_path / "sp.model"),
        "--output-prefix",
        str(tmp_path / "out"),
        "--append-eod",
        "--workers",
        "2",
    )
    tokenizer = SentencePieceTokenizer(str(tmp_path / "sp.model"))
    expected = [tokenizer.tokenize(t) + [tokenizer.eod] for t in TEXTS]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    prefix = str(tmp_path / "out_text_document")
    megatron = IndexedDataset(prefix)
    assert len(megatron) == len(TEXTS)
    assert [megatron[i].tolist() for i in range(len(TEXTS))] == expected

    # threefold's samples are megatron-core GPTDataset samples of that data, unchanged.
    config = parse_args(
        [
            "--num-layers",
            "1",
            "--hidden-size",
            "8",
            "--num-attention-heads",
            "1",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "1",
            "--train-iters",
            "5",
            "--data-path",
            prefix,
            "--split",
            "1,0,0",
            "--vocab-size",
            str(tokenizer.vocab_size),
        ]
    )
    train = build_datasets(config, tokenizer)[0]
    # Each sample runs through documents in megatron-core's shuffled document order: every
    # piece between end-of-document tokens is a piece of one document.
    documents = [" " + " ".join(map(str, e)) + " " for e in expected]
    for index in range(len(train)):
        sample = train[index].tolist()
        assert len(sample) == 17
        pieces, current = [], []
        for token in sample:
            current.append(token)
            if token == tokenizer.eod:
                pieces.append(current)
                current = []
        pieces.append(current)
        for piece in filter(None, pieces):
            text = " " + " ".join(map(str, piece)) + " "
            assert any(text in d for d in documents), piece
    reference = train.dataset[2]
    assert np.array_equal(train[2][:-1], reference["tokens"].numpy())


def test_gpt2_bpe_tokenizer_from_vocab_and_merges(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(TEXTS, vocab_size=400, special_tokens=["<|endoftext|>"])
    trainer.save_model(str(tmp_path))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:5]))
    _tool(
        "preprocess_data.py",
        "--input",
        str(corpus),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(tmp_path / "vocab.json"),
        "--merge-file",
        str(tmp_path / "merges.txt"),
        "--output-prefix",
        str(tmp_path / "bpe"),
        "--append-eod",
    )
    from threefold.data.tokenizer import GPT2BPETokenizer

    tokenizer = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert tokenizer.eod == trainer.token_to_id("<|endoftext|>")
    assert tokenizer.detokenize(tokenizer.tokenize(TEXTS[0])) == TEXTS[0]
    # special tokens by name (--fim-data's sentinels), None where the vocabulary lacks one
    assert tokenizer.token_id("<|endoftext|>") == tokenizer.eod
    assert tokenizer.token_id("<fim_prefix>") is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    written = IndexedDataset(str(tmp_path / "bpe_text_document"))
    assert [written[i].tolist() for i in range(5)] == [
        tokenizer.tokenize(t) + [tokenizer.eod] for t in TEXTS[:5]
    ]


def test_a_trained_tokenizer_keeps_newlines_indentation_and_spaces(tmp_path):
    code = "class Net{i}(nn.Module):\n    def forward(self, x):\n\treturn x  *  {i}\n\n"
    verse = "ROMEO:\n  But soft! what light through yonder window breaks?\n"
    documents = [code.format(i=i) + verse + f"  ({i})  \n" for i in range(100)]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in documents)
    prefix = str(tmp_path / "sp")
    _tool(
        "train_tokenizer.py",
        "--input",
        str(tmp_path / "corpus.jsonl"),
        "--vocab-size",
        "400",
        "--model-prefix",
        prefix,
    )
    tokenizer = SentencePieceTokenizer(prefix + ".model")
    unseen = "def  f():\n\n        pass\t# ünïcode ✓\n"  # byte fallback for the new characters
    for text in documents + [unseen]:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert tokenizer.token_id(tokenizer.processor.id_to_piece(tokenizer.eod)) == tokenizer.eod
    assert tokenizer.token_id("<fim_prefix>") is None  # not the unknown piece's id


def test_a_tokenizer_that_cannot_be_trained_is_one_line_and_keeps_the_one_there(tmp_path):
    """(before: sentencepiece's or the reader's traceback, after writing nothing but by luck)"""
    prefix = _trained_tokenizer(tmp_path)
    kept = {ext: open(prefix + ext, "rb").read() for ext in (".model", ".vocab")}
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + '\n{"text": 1}\n')
    for corpus_name, vocab_size, line in (
        ("corpus.jsonl", "0", "argument --vocab-size: give a positive number, not 0"),
        (
            "corpus.jsonl",
            "100",
            "--vocab-size 100: below the 300 pieces every tokenizer of this text holds (its "
            "characters, 256 bytes, the special tokens); give at least that; nothing was written",
        ),
        (
            "corpus.jsonl",
            "5000",
            "--vocab-size 5000: more pieces than this text yields; give at most 512, or more "
            "text; nothing was written",
        ),
        ("bad.jsonl", "300", f"{tmp_path}/bad.jsonl:2: 'text' is 1, not text; nothing was written"),
    ):
        argv = ["--input", str(tmp_path / corpus_name), "--vocab-size", vocab_size]
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), *argv]
            + ["--model-prefix", prefix],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (result.returncode, result.stderr) == (2, f"train_tokenizer.py: error: {line}\n")
    assert {ext: open(prefix + ext, "rb").read() for ext in (".model", ".vocab")} == kept
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "corpus.jsonl", "sp.model", "sp.vocab"]


def test_a_corpus_written_again_is_replaced_whole_or_not_at_all(tmp_path):
    from threefold.data.corpus import default_corpus_documents, write_jsonl

    path = tmp_path / "corpus.jsonl"
    assert write_jsonl(default_corpus_documents(), path) > 100
    complete = path.read_bytes()

    def interrupted():
        yield {"text": "the first document"}
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_jsonl(interrupted(), path)
    assert path.read_bytes() == complete and os.listdir(tmp_path) == ["corpus.jsonl"]


def test_a_hugging_face_tokenizer_its_library_cannot_read_is_one_line(tmp_path):
    """(before: transformers' ValueError or JSONDecodeError, as preprocess_data.py's,
    finetune.py's or generate.py's traceback)"""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty: holds no tokenizer.json or tokenizer_config"):
        HuggingFaceTokenizer(str(tmp_path / "empty"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ConfigError) as refused:
        HuggingFaceTokenizer(str(tmp_path / "broken"))
    line = str(refused.value)
    assert line.startswith(f"--tokenizer-model {tmp_path / 'broken'}: not a readable Hugging Face")
    assert "\n" not in line


def test_null_tokenizer_reads_token_ids_of_its_vocabulary_only():
    """(before: int()'s message without the record, and an id past the vocabulary written
    to the .bin for the training run to refuse)"""
    tokenizer = NullTokenizer(100)
    assert tokenizer.tokenize(" 0 7\n99 100 ") == [0, 7, 99, 100]  # 100: end of document
    with pytest.raises(ValueError, match="'seven' is not a token id"):
        tokenizer.tokenize("0 seven")
    for word in ("101", "-1"):
        with pytest.raises(ValueError, match=f"token id {word} is outside the vocabulary"):
            tokenizer.tokenize(f"1 {word}")


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--tokenizer-type", "SentencePieceTokenizer"],
            "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model FILE",
        ),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer"],
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR",
        ),
        (
            ["--tokenizer-type", "GPT2BPETokenizer"],
            "--tokenizer-type GPT2BPETokenizer needs --vocab-file FILE",
        ),
        (
            ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--json-keys", "a/b"],
            "--json-keys a/b: a key names its output file, so holds no '/'",
        ),
    ],
    ids=["sentencepiece", "hugging face", "gpt-2", "a key with a slash"],
)
def test_preprocessing_flags_no_corpus_can_be_written_with_are_one_line(argv, line, tmp_path):
    """(before: os.stat's TypeError of a missing --tokenizer-model, or FileNotFoundError for
    an output under a directory named by the key, as tracebacks)"""
    from tests.tools.imports import run_watching_imports

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "1 2 3", "a/b": "4 5"}\n')
    script = os.path.join(ROOT, "tools", "preprocess_data.py")
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out"), *argv]
    run = run_watching_imports(script, *argv)
    assert (run.returncode, run.said) == (2, [f"preprocess_data.py: error: {line}"])
    assert not run.imported_torch and os.listdir(tmp_path) == ["corpus.jsonl"]


@pytest.mark.parametrize("prefix", ["{tmp}/.", "{tmp}/new/"], ids=["a dot", "a slash"])
def test_a_tokenizer_prefix_that_names_a_directory_is_one_line(prefix, tmp_path):
    """(before: sentencepiece wrote `..vocab.tmp.PID.model` (or `new/.vocab.tmp.PID.model`),
    and the rename failed with FileNotFoundError's traceback)"""
    from tests.tools.imports import run_watching_imports

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "to be or not to be"}\n')
    prefix = prefix.format(tmp=tmp_path)
    script = os.path.join(ROOT, "tools", "train_tokenizer.py")
    run = run_watching_imports(script, "--input", str(corpus), "--model-prefix", prefix)
    example = os.path.join(prefix, "tokenizer")
    assert (run.returncode, run.said) == (
        2,
        [
            f"train_tokenizer.py: error: --model-prefix {prefix}: a directory; give a name in "
            f"it, such as {example} (which writes tokenizer.model and .vocab)"
        ],
    )
    assert not run.imported_torch and os.listdir(tmp_path) == ["corpus.jsonl"]
