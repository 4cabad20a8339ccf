"""Indexed datasets through megatron-core: the same global batches in every layout and after a
resume, blending weights respected, and bad data refused naming the file."""

import hashlib
import warnings

import numpy as np
import pytest

from tests.distributed import run_distributed
from threefold.arguments import parse_args
from threefold.config import ConfigError
from threefold.data.loader import build_datasets

VOCAB = 500
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--vocab-size",
    str(VOCAB),
    "--eval-iters",
    "0",
    "--log-interval",
    "100",
]


def write_corpus(prefix: str, documents: int, seed: int, low: int = 0) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(documents):
        ids = rng.integers(low, VOCAB - 1, size=int(rng.integers(5, 60)))
        builder.add_document(np.append(ids, VOCAB - 1), [len(ids) + 1])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(str(root / "a"), 300, seed=1)
    write_corpus(str(root / "b"), 300, seed=2)
    return str(root)


def _batch_hashes(argv: list[str], iterations: int, resume_at: int = 0) -> list | None:
    """Per iteration, the hash of the global batch's token ids as this layout reads it."""
    from tests.parity import _setup
    from threefold.parallel import state

    trainer = _setup(argv)
    trainer.state.consumed_train_samples = resume_at * trainer.config.training.global_batch_size
    iterator = trainer.train_iterator()
    hashes = []
    for _ in range(iterations):
        local = np.stack(
            [next(iterator)["tokens"].numpy() for _ in range(trainer.num_microbatches)]
        )
        dp = trainer.parallel.dp
        if dp.size > 1:  # put the replicas' micro-batches in order
            import torch
            import torch.distributed as dist

            parts = [torch.empty_like(torch.from_numpy(local)) for _ in range(dp.size)]
            dist.all_gather(parts, torch.from_numpy(local), group=dp.group)
            local = np.stack([p.numpy() for p in parts], axis=1)  # [micro-batch, dp, ...]
        hashes.append(hashlib.sha256(np.ascontiguousarray(local).tobytes()).hexdigest())
    return hashes if state.global_rank() == 0 else None


def test_same_global_batches_in_every_layout_and_after_resume(corpus):
    argv = MODEL + [
        "--data-path",
        f"{corpus}/a",
        "--split",
        "90,10,0",
        "--train-iters",
        "6",
        "--data-cache-path",
        f"{corpus}/cache",
    ]
    reference = _batch_hashes(argv, 6)
    assert len(set(reference)) == 6
    for world_size, layout in (
        (2, []),
        (2, ["--tensor-model-parallel-size", "2"]),
        (2, ["--pipeline-model-parallel-size", "2"]),
    ):
        assert run_distributed(world_size, _batch_hashes, argv + layout, 6)[0] == reference
    assert _batch_hashes(argv, 3, resume_at=3) == reference[3:]


def test_blending_weights_are_respected_over_10000_samples(corpus):
    config = parse_args(
        MODEL
        + [
            "--data-path",
            "0.3",
            f"{corpus}/a",
            "0.7",
            f"{corpus}/b",
            "--split",
            "100,0,0",
            "--train-iters",
            "1250",
        ]
    )
    train = build_datasets(config)[0]
    sources = np.array([train.source_of(i) for i in range(10_000)])
    assert abs((sources == 0).mean() - 0.3) < 0.01
    assert abs((sources == 1).mean() - 0.7) < 0.01


def test_the_mid_level_surplus_reaches_megatron_core(corpus):
    """--mid-level-dataset-surplus (Megatron-LM's): each blended dataset is built that much
    larger than its weight's share, the fix megatron-core's 'too few samples' calls for."""
    argv = MODEL + ["--data-path", "0.3", f"{corpus}/a", "0.7", f"{corpus}/b"]
    argv += ["--split", "100,0,0", "--train-iters", "1250"]
    sizes = []
    for surplus in ("0.005", "0.5"):
        config = parse_args(argv + ["--mid-level-dataset-surplus", surplus])
        blend = build_datasets(config)[0].dataset
        sizes.append([len(dataset) for dataset in blend.datasets])
    assert all(small < large for small, large in zip(*sizes)), sizes
    # megatron-core's refusal names its config attribute: threefold's names the flag
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    def oversampled(self):
        raise IndexError("... mid_level_dataset_surplus may be increased, e.g. two- or ...")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BlendedMegatronDatasetBuilder, "build", oversampled)
        with pytest.raises(ConfigError, match=r"raise --mid-level-dataset-surplus \(now 0.005\)"):
            build_datasets(parse_args(argv))


def test_per_split_paths(corpus):
    config = parse_args(
        MODEL
        + [
            "--train-data-path",
            f"{corpus}/a",
            "--valid-data-path",
            f"{corpus}/b",
            "--train-iters",
            "2",
            "--eval-iters",
            "1",
        ]
    )
    train, valid, test = build_datasets(config)
    assert len(train) >= 16 and len(valid) >= 8 and test is None


def test_an_empty_train_split_is_refused(corpus):
    config = parse_args(
        MODEL + ["--data-path", f"{corpus}/a", "--split", "0,100,0", "--train-iters", "2"]
    )
    with pytest.raises(ConfigError, match="--split"):
        build_datasets(config)


DOCUMENT_FLAGS = ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]


def test_windows_split_into_documents_at_eod(corpus):
    """Megatron's GPTDataset masks: an EOD closes its document; the loss of predicting the
    token after it is masked, positions restart and attention stays inside each document."""
    import torch

    from tests.parity import LLAMA_STYLE, _setup
    from threefold.data.loader import collate

    argv = (
        LLAMA_STYLE
        + MODEL
        + DOCUMENT_FLAGS
        + [
            "--data-path",
            f"{corpus}/a",
            "--split",
            "100,0,0",
            "--train-iters",
            "2",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            str(VOCAB - 1),
            "--seq-length",
            "64",
            "--max-position-embeddings",
            "64",
        ]
    )
    trainer = _setup(argv)
    eod = trainer.tokenizer.eod
    model = trainer.model.eval()
    for index in range(4):
        sample = trainer.datasets[0][index]
        inputs = sample["tokens"][:-1]
        ends = np.flatnonzero(inputs == eod)
        assert len(ends) >= 1  # documents are 6 to 60 tokens long: a window of 64 holds one
        np.testing.assert_array_equal(sample["loss_mask"], inputs != eod)
        starts = np.concatenate([[0], ends + 1])
        batch = collate([sample], torch.device("cpu"))
        with torch.no_grad():
            packed = model(
                batch["tokens"],
                labels=batch["labels"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            )[0]
            for start, end in zip(starts, np.concatenate([ends + 1, [len(inputs)]])):
                if start == end:
                    continue
                assert sample["position_ids"][start] == 0
                alone = model(batch["tokens"][:, start:end], labels=batch["labels"][:, start:end])[
                    0
                ]
                torch.testing.assert_close(packed[start:end], alone, rtol=1e-5, atol=1e-6)


def test_document_flags_need_an_end_of_document_token():
    config = parse_args(MODEL + ["--mock-data", "--train-iters", "2", "--eod-mask-loss"])
    with pytest.raises(ConfigError, match="--eod-mask-loss needs a tokenizer"):
        build_datasets(config)


def test_finetuning_refuses_the_pretraining_document_flags(tmp_path):
    from finetune import check_finetuning

    argv = MODEL + ["--train-data-path", str(tmp_path / "sft.jsonl"), "--train-iters", "2"]
    argv += ["--tokenizer-type", "NullTokenizer", "--reset-attention-mask"]
    with pytest.raises(ConfigError, match="--reset-attention-mask is for pretraining"):
        check_finetuning(parse_args(argv))


def test_no_mmap_bin_files_reads_the_same_samples(corpus):
    argv = MODEL + ["--data-path", f"{corpus}/a", "--split", "90,10,0", "--train-iters", "3"]
    mapped = build_datasets(parse_args(argv))[0]
    read = build_datasets(parse_args(argv + ["--no-mmap-bin-files"]))[0]
    assert mapped.dataset.dataset.mmap and not read.dataset.dataset.mmap
    for index in range(24):
        np.testing.assert_array_equal(read[index], mapped[index])
