"""--dataloader-inter-document-masking (Megatron-LM's): a sample's documents, as megatron-core's
index stitched them together, attend only within themselves, positions restarting at each,
with no end-of-document token needed; a blend's too; over CP ranks as on one process."""

import warnings

import numpy as np
import pytest

from tests.data.test_datasets import write_corpus
from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, assert_matches_reference, train_job
from threefold.arguments import parse_args
from threefold.data.loader import build_datasets

VOCAB = 300


def _documents(prefix: str, first: int, count: int) -> None:
    """`count` documents of 3-29 tokens, every token of document k the id `first` + k: a
    sample's tokens say which document each came from."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(first)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for k in range(count):
        size = int(rng.integers(3, 30))
        builder.add_document(np.full(size, first + k), [size])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("documents")
    _documents(str(root / "a"), 1, 140)
    _documents(str(root / "b"), 150, 140)
    return str(root / "a"), str(root / "b")


def _argv(*data: str) -> list[str]:
    at = TRAINING.index("--vocab-size")
    training = [f for f in TRAINING[:at] + TRAINING[at + 2 :] if f != "--mock-data"]
    return LLAMA_STYLE + training + ["--vocab-size", str(VOCAB), *data]


@pytest.mark.parametrize("blend", [False, True], ids=["one-file", "blend"])
def test_documents_are_the_indexs_and_positions_restart(corpora, blend):
    paths = ["1", corpora[0], "1", corpora[1]] if blend else [corpora[0]]
    data = ["--data-path", *paths, "--split", "90,10,0"]
    config = parse_args(_argv(*data, "--dataloader-inter-document-masking"))
    train = build_datasets(config)[0]
    assert blend == (len({train.source_of(i) for i in range(64)}) == 2)
    for index in range(64):
        sample = train[index]
        inputs = sample["tokens"][:-1]
        changes = np.concatenate([[0], np.cumsum(inputs[1:] != inputs[:-1])])
        assert sample["document_ids"].tolist() == changes.tolist(), index
        starts = np.flatnonzero(np.concatenate([[True], inputs[1:] != inputs[:-1]]))
        assert sample["position_ids"].tolist() == (np.arange(16) - starts[changes]).tolist()
    assert any(train[i]["document_ids"][-1] > 0 for i in range(64))  # (documents do meet)


def test_inter_document_masking_over_cp2_trains_as_one_process(tmp_path):
    """(On documents of random tokens: those of one token repeated are learned so fast that
    Adam's steps amplify the layouts' reordered sums past 1e-5 by the fourth step, in
    Ulysses's whole-sequence attention too.)"""
    write_corpus(str(tmp_path / "random"), 200, seed=3)  # (ids below 500)
    data = ["--data-path", str(tmp_path / "random"), "--split", "90,10,0", "--vocab-size", "500"]
    argv = _argv(*data, "--dataloader-inter-document-masking")
    reference = train_job(argv, 4)
    layout = ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]
    assert_matches_reference(run_distributed(2, train_job, argv + layout, 4), reference, 1e-5)
    whole = train_job(_argv(*data), 1)  # (the masks matter)
    assert abs(whole["losses"][0] - reference["losses"][0]) > 1e-4


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--mock-data"], "--dataloader-inter-document-masking with --mock-data"),
        (
            ["--data-path", "x", "--fim-data", "--tokenizer-type", "NullTokenizer"],
            "--dataloader-inter-document-masking with --fim-data",
        ),
    ],
    ids=["mock", "fim"],
)
def test_data_without_the_indexs_documents_is_refused(capsys, flags, said):
    with pytest.raises(SystemExit) as stop:
        parse_args(_argv(*flags, "--dataloader-inter-document-masking"))
    assert stop.value.code == 2 and said in capsys.readouterr().err
