"""--fim-data (data/fim.py): each document of a sample rearranged into prefix-suffix-middle or
suffix-prefix-middle order around the sentinel tokens, the text kept, the sample's length
kept, and each sample a function of the seed, its split and its index."""

import numpy as np
import pytest
import torch

from tests.data.test_datasets import MODEL, VOCAB, corpus  # noqa: F401 (a fixture)
from tests.parity import _setup
from threefold.arguments import parse_args
from threefold.config import ConfigError
from threefold.data.fim import FillInTheMiddle
from threefold.data.tokenizer import NullTokenizer

PREFIX, MIDDLE, SUFFIX, PAD, EOD = 1000, 1001, 1002, 1003, 1004
SENTINELS = {"<P>": PREFIX, "<M>": MIDDLE, "<S>": SUFFIX, "<pad>": PAD, "<eod>": EOD, "|": 1005}
TOKENS = ["--fim-prefix-token", "<P>", "--fim-middle-token", "<M>", "--fim-suffix-token", "<S>"]
TOKENS += ["--fim-pad-token", "<pad>", "--fim-eod-token", "<eod>"]


class Characters:
    """One token per character (its code point), "ab" as one token (2000): a rearranged
    document that cuts no "ab" apart re-tokenizes shorter than it was read."""

    def tokenize(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            pair = text[i : i + 2] == "ab"
            ids.append(2000 if pair else ord(text[i]))
            i += 2 if pair else 1
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return "".join("ab" if i == 2000 else chr(i) for i in ids)

    def token_id(self, token: str) -> int | None:
        return SENTINELS.get(token)


def _fim(*flags: str) -> FillInTheMiddle:
    argv = MODEL + ["--data-path", "unused", "--train-iters", "1", "--fim-data", *TOKENS, *flags]
    return FillInTheMiddle(parse_args(argv).data, Characters(), seed=1234)


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _text(ids) -> str:
    return Characters().detokenize([int(i) for i in ids])


def _text_of(document: list[int], order: str) -> str:
    """The text a rearranged document holds, read in `order` (PSM: <P> prefix <S> suffix <M>
    middle; SPM: <P> <S> suffix <M> prefix middle)."""
    assert document[0] == PREFIX and document.count(SUFFIX) == document.count(MIDDLE) == 1
    s, m = document.index(SUFFIX), document.index(MIDDLE)
    if order == "SPM":
        assert s == 1
        return _text(document[m + 1 :]) + _text(document[s + 1 : m])
    return _text(document[1:s]) + _text(document[m + 1 :]) + _text(document[s + 1 : m])


def _order(document: list[int]) -> str:
    """PSM unless the document starts <P> <S> (a PSM document whose prefix is empty looks the
    same: long documents make that rare)."""
    return "SPM" if document[1] == SUFFIX else "PSM"


def test_each_document_is_rearranged_around_the_sentinels_its_text_kept():
    texts = ["def add(a, b):\n    return a + b\n", "x = 1\n", "print(add(2, 3))"]
    # a fourth document of spaces, which the three sentinels each one gains push out
    tail = [EOD] + _ids(" " * 12)
    sample = np.array(sum((_ids(t) + [EOD] for t in texts), [])[:-1] + tail, dtype=np.int64)
    for spm, order in (("0", "PSM"), ("1", "SPM")):
        fim = _fim("--fim-rate", "1", "--fim-spm-rate", spm)
        out = fim(sample, index=7).tolist()
        assert len(out) == len(sample)
        ends = np.flatnonzero(np.array(out) == EOD)
        assert len(ends) == 3  # every end-of-document token kept
        documents = np.split(np.array(out), ends)
        documents = [documents[0].tolist()] + [d[1:].tolist() for d in documents[1:]]
        for text, document in zip(texts, documents):
            assert _text_of(document, order) == text
        # the same sample, index and seed: the same cuts
        assert fim(sample, index=7).tolist() == out
        assert fim(sample, index=8).tolist() != out


def test_a_sample_keeps_its_length_cut_or_padded():
    fim = _fim("--fim-rate", "1")
    long = np.array(_ids("the quick brown fox"), dtype=np.int64)  # 3 sentinels more: cut
    assert len(fim(long, 0)) == len(long)
    # "ab" read as two tokens re-tokenizes as one: shorter, filled with the pad token
    short = np.array(_ids("abababababab"), dtype=np.int64)
    out = fim(short, 0).tolist()
    assert len(out) == len(short) and out[-1] == PAD
    assert set(out) - {PREFIX, MIDDLE, SUFFIX, PAD} <= {2000, ord("a"), ord("b")}


def test_the_rates_are_the_shares_rearranged():
    fim = _fim("--fim-rate", "0.3", "--fim-spm-rate", "0.25")
    code = "for line in lines:\n    total += len(line)\n" * 8  # 360 characters
    documents = np.array((_ids(code) + [EOD]) * 20, dtype=np.int64)
    orders = []
    for index in range(400):
        out = fim(documents, index)
        pieces = np.split(out, np.flatnonzero(out == EOD))
        for piece in pieces[:-1]:
            piece = piece[piece != EOD].tolist()
            orders.append(_order(piece) if PREFIX in piece else "as read")
    share = {order: orders.count(order) / len(orders) for order in ("as read", "PSM", "SPM")}
    assert abs(share["as read"] - 0.7) < 0.03
    assert abs(share["SPM"] / (share["PSM"] + share["SPM"]) - 0.25) < 0.04
    assert np.array_equal(_fim("--fim-rate", "0")(documents, 3), documents)


def test_split_sample_rearranges_fragments_and_no_prefix_leaves_pieces():
    repository = _ids("# skip me") + [1005] + _ids("file one") + [1005] + _ids("file two")
    sample = np.array(repository, dtype=np.int64)
    split = ["--fim-rate", "1", "--fim-split-sample", "|", "--fim-fragment-rate", "1"]
    out = _fim(*split)(sample, 0).tolist()
    fragments = np.split(np.array(out), np.flatnonzero(np.array(out) == 1005))
    assert len(fragments) == 3 and all(PREFIX in f for f in fragments)
    split = ["--fim-rate", "1", "--fim-split-sample", "|", "--fim-fragment-rate", "1"]
    kept = _fim(*split, "--fim-no-prefix", "# skip")(sample, 0).tolist()
    assert kept[: len(_ids("# skip me")) + 1] == _ids("# skip me") + [1005]  # as read
    assert kept.count(PREFIX) == 2


def test_fim_data_rearranges_each_split_s_samples_by_their_index(corpus):  # noqa: F811
    """Through the dataset builder on indexed data: each sample is the plain run's sample
    rearranged as the transform says for its split and index (ids as tokens: NullTokenizer,
    whose text is the ids)."""
    argv = MODEL + ["--data-path", f"{corpus}/a", "--split", "80,20,0", "--train-iters", "2"]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]
    sentinels = ["--fim-prefix-token", "495", "--fim-middle-token", "496"]
    sentinels += ["--fim-suffix-token", "497", "--fim-pad-token", "498"]
    sentinels += ["--fim-eod-token", str(VOCAB - 1), "--fim-rate", "1"]
    plain = _setup(argv).datasets
    trainer = _setup(argv + ["--fim-data", *sentinels])
    rearranged, config = trainer.datasets, trainer.config
    fim = FillInTheMiddle(config.data, trainer.tokenizer, config.training.seed)
    for split in (0, 1):
        for index in range(6):
            expected = fim(plain[split][index], index, split)
            assert np.array_equal(rearranged[split][index], expected)
            assert not np.array_equal(expected, plain[split][index])
            assert 495 in expected  # every document rearranged at rate 1
    assert not np.array_equal(rearranged[0][0], fim(plain[0][0], 0, 1))  # a split's own


def test_worker_processes_read_the_micro_batches_this_process_reads(corpus):  # noqa: F811
    """--num-workers 2 (Megatron-LM's DataLoader workers, which take --fim-data's
    re-tokenization off the step): the same micro-batches in the same order, from the start
    and from a resumed position, and the same losses. Each reader is closed when done: left
    to the collection of its trainer's cycle, its workers would wait out DataLoader's 5 s
    shutdown timeout each (trainer.train does the same in its `finally`)."""
    argv = MODEL + ["--data-path", f"{corpus}/a", "--split", "80,20,0", "--train-iters", "4"]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--fim-data"]
    argv += ["--fim-prefix-token", "495", "--fim-middle-token", "496", "--fim-suffix-token"]
    argv += ["497", "--fim-pad-token", "498", "--fim-eod-token", str(VOCAB - 1)]
    for consumed in (0, 6):
        read = []
        for workers in ("0", "2"):
            trainer = _setup(argv + ["--num-workers", workers])
            trainer.state.consumed_train_samples = consumed
            iterator = trainer.train_iterator()
            read.append([next(iterator) for _ in range(5)])
            iterator.close()
        for here, there in zip(*read):
            assert here.keys() == there.keys()
            assert all(torch.equal(here[name], there[name]) for name in here)
    losses = []
    for workers in ("0", "2"):
        trainer = _setup(argv + ["--num-workers", workers])
        losses.append([trainer.train_step()[0] for _ in range(2)])
        trainer.train_iterator().close()
    assert losses[0] == losses[1]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--fim-data", "--mock-data"], "give --data-path, not --mock-data"),
        (["--fim-rate", "0.2"], "--fim-rate: fill-in-the-middle flags without --fim-data"),
        (["--fim-data", "--fim-rate", "2"], "--fim-rate 2.0 must be a probability"),
        (["--fim-data", "--fim-split-sample", "|"], "--fim-split-sample needs --fim-fragment"),
    ],
)
def test_bad_fim_flags_fail_in_one_line(capsys, flags, message):
    data = ["--data-path", "unused"] if "--mock-data" not in flags else []
    with pytest.raises(SystemExit):
        parse_args(MODEL + data + ["--train-iters", "1", *flags])
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and message in error[0], error


def test_sentinels_the_tokenizer_lacks_are_named():
    argv = MODEL + ["--data-path", "unused", "--train-iters", "2", "--fim-data"]
    with pytest.raises(ConfigError, match="--fim-prefix-token '<fim_prefix>': not a token"):
        FillInTheMiddle(parse_args(argv).data, NullTokenizer(VOCAB - 1), seed=1)
    with pytest.raises(ConfigError, match="--fim-data rearranges text: it needs --tokenizer"):
        FillInTheMiddle(parse_args(argv).data, None, seed=1)


def test_a_hugging_face_tokenizer_names_its_special_tokens(tmp_path):
    """The sentinels of a Hugging Face tokenizer by name; None (not the unknown token's id)
    for one it lacks."""
    pytest.importorskip("transformers")
    from tests.tools.hf_models import build_tokenizer
    from threefold.data.tokenizer import HuggingFaceTokenizer

    build_tokenizer(str(tmp_path))
    tokenizer = HuggingFaceTokenizer(str(tmp_path))
    assert tokenizer.token_id("</s>") == tokenizer.eod
    assert tokenizer.token_id("<fim_prefix>") is None


def test_finetuning_refuses_fim_data():
    from finetune import check_finetuning

    argv = MODEL + ["--train-data-path", "unused", "--train-iters", "2", "--fim-data"]
    argv += ["--tokenizer-type", "NullTokenizer"]
    with pytest.raises(ConfigError, match="finetune.py: --fim-data rearranges pretraining"):
        check_finetuning(parse_args(argv))
