"""Both model families learn real text: GPT-2 style and LLaMA style (RMSNorm, SwiGLU, RoPE,
GQA). Single process; the data is the default corpus's format built from a small text."""

import warnings

import numpy as np
import pytest

from tests.parity import GPT2_STYLE, LLAMA_STYLE, _setup

TEXT = (
    "to be or not to be that is the question whether tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune "
) * 40


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    prefix = str(tmp_path_factory.mktemp("data") / "words")
    vocabulary = sorted(set(TEXT.split()))
    ids = [vocabulary.index(w) for w in TEXT.split()]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for start in range(0, len(ids), 50):
        builder.add_document(ids[start : start + 50], [len(ids[start : start + 50])])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("style", [GPT2_STYLE, LLAMA_STYLE], ids=["gpt2", "llama"])
def test_loss_falls_well_below_chance(data_prefix, style):
    argv = style + [
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--train-iters",
        "40",
        "--lr",
        "1e-2",
        "--data-path",
        data_prefix,
        "--vocab-size",
        "32",
        "--split",
        "90,10,0",
        "--eval-iters",
        "2",
        "--log-interval",
        "1000",
    ]
    trainer = _setup(argv)
    before = trainer.evaluate()
    losses = [trainer.train_step()[0] for _ in range(40)]
    after = trainer.evaluate()
    assert before > 3.0  # about ln(32): chance
    assert after < 1.0 and losses[-1] < 1.0, (before, after, losses[-5:])
