"""GPT training samples of `seq_length + 1` tokens, built by megatron-core.

Indexed data (`--data-path`, `--train/valid/test-data-path`, with blending weights) goes through
megatron-core's `BlendedMegatronDatasetBuilder` and `GPTDataset`, which run on the CPU: the
same document, sample and shuffle indices as Megatron-LM, hence the same samples in the same
order for the same seed, split and sizes, cached under `--data-cache-path`. threefold reads the
samples sequentially (the shuffling is in the indices), so `consumed samples` alone says where
to resume, and every TP/PP/DP layout sees the same global batches.

Before megatron-core touches a file, `check_prefix` validates it and names the file in one line:
missing `.bin`/`.idx`, a bad header (magic, version, dtype), a truncated `.bin`, token ids
outside the model's vocabulary.

Mock data (`--mock-data`): every sample is a pure function of the seed and the sample index.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
from collections.abc import Callable

import numpy as np

from threefold.config import ConfigError
from threefold.data import megatron_core
from threefold.data.fim import FillInTheMiddle

_MAGIC = b"MMIDIDX\x00\x00"
_CHECKED: set[tuple[str, int]] = set()  # (prefix, vocabulary size) found good in this process
# megatron.core.datasets.indexed_dataset.DType codes
_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def check_prefix(prefix: str, vocab_size: int, flag: str = "--data-path") -> None:
    """Fail with one line naming the file unless `prefix.bin/.idx` is a readable Megatron
    indexed dataset whose token ids fit the vocabulary."""
    if (prefix, vocab_size) in _CHECKED:  # the scan reads the whole corpus: once is enough
        return
    dtype = check_index(prefix, flag)
    bin_file = prefix + ".bin"
    tokens = np.memmap(bin_file, dtype=dtype, mode="r")
    largest = max(int(tokens[i : i + 2**26].max()) for i in range(0, len(tokens), 2**26))
    if largest >= vocab_size:
        raise ConfigError(
            f"{flag} {prefix}: token id {largest} in {bin_file} is outside the "
            f"model's vocabulary of {vocab_size}; use the tokenizer that made it "
            "(or a larger --vocab-size)"
        )
    _CHECKED.add((prefix, vocab_size))


def check_index(prefix: str, flag: str = "--data-path") -> np.dtype:
    """The checks that read only the index and file sizes (milliseconds, whatever the corpus
    size); returns the token dtype."""
    bin_file, idx_file = prefix + ".bin", prefix + ".idx"
    for path in (bin_file, idx_file):
        if not os.path.isfile(path):
            raise ConfigError(
                f"{flag} {prefix}: {path} does not exist; create it with tools/preprocess_data.py"
            )
    with open(idx_file, "rb") as f:
        header = f.read(len(_MAGIC) + 8 + 1 + 16)
    if len(header) < len(_MAGIC) + 25 or header[: len(_MAGIC)] != _MAGIC:
        raise ConfigError(
            f"{flag} {prefix}: {idx_file} is not a Megatron indexed-dataset "
            "index (bad magic); regenerate it with tools/preprocess_data.py"
        )
    (version,) = struct.unpack("<Q", header[9:17])
    if version != 1:
        raise ConfigError(
            f"{flag} {prefix}: {idx_file} has index version {version}; "
            "threefold and megatron-core read version 1"
        )
    code = header[17]
    if code not in _DTYPES:
        raise ConfigError(
            f"{flag} {prefix}: {idx_file} names token dtype code {code}, "
            "which is not one of megatron-core's"
        )
    sequences, documents = struct.unpack("<QQ", header[18:34])
    dtype = np.dtype(_DTYPES[code])
    # header, then int32 lengths, int64 pointers and int64 document boundaries
    index_bytes = 34 + sequences * (4 + 8) + documents * 8
    if os.path.getsize(idx_file) < index_bytes:
        raise ConfigError(
            f"{flag} {prefix}: {idx_file} is truncated ({os.path.getsize(idx_file)}"
            f" bytes, its header promises {index_bytes}); regenerate it"
        )
    if sequences == 0:
        raise ConfigError(f"{flag} {prefix}: {idx_file} holds no documents")
    lengths = document_lengths(prefix)
    expected = int(lengths.sum(dtype=np.int64)) * dtype.itemsize
    actual = os.path.getsize(bin_file)
    if actual != expected:  # a .bin of another corpus (or of another preprocessing run)
        problem = "is truncated" if actual < expected else "is larger than its index says"
        raise ConfigError(
            f"{flag} {prefix}: {bin_file} {problem} ({actual} bytes, "
            f"{idx_file} describes {expected}); the two files are not a pair: "
            "regenerate both with tools/preprocess_data.py"
        )
    if expected == 0:
        raise ConfigError(f"{flag} {prefix}: its {sequences} documents hold no tokens")
    return dtype


def document_lengths(prefix: str) -> np.ndarray:
    """Every document's token count, read from the `.idx` (after `check_index`'s checks)."""
    with open(prefix + ".idx", "rb") as f:
        (sequences,) = struct.unpack("<Q", f.read(34)[18:26])
    return np.memmap(prefix + ".idx", dtype=np.int32, mode="r", offset=34, shape=(sequences,))


def split_ranges(weights: list[float], count: int) -> list[tuple[str, int, int]]:
    """(split name, first, end) of the items each split with a share gets out of `count`, as
    megatron-core's builder cuts them: round(bound x count). `weights` normalized."""
    bounds = np.concatenate([[0.0], np.cumsum(weights)])
    return [
        (name, round(begin * count), round(end * count))
        for name, weight, begin, end in zip(
            ("train", "validation", "test"), weights, bounds, bounds[1:]
        )
        if weight > 0
    ]


def check_split(
    prefix: str,
    weights: list[float],
    seq_length: int,
    flag: str = "--data-path",
    split_flag: str | None = "--split",
) -> None:
    """Every split that gets a share (megatron-core's document ranges: round(bound x count))
    must get tokens, and the corpus must hold one sample: megatron-core otherwise loops
    forever counting epochs of an empty split. `weights` normalized; [1] for a whole file."""
    lengths = document_lengths(prefix)
    total = int(lengths.sum(dtype=np.int64))
    if total < seq_length + 1:
        raise ConfigError(
            f"{flag} {prefix}: holds {total} tokens, fewer than one sample of "
            f"--seq-length {seq_length} + 1; give it more text or a shorter "
            "--seq-length"
        )
    for name, first, last in split_ranges(weights, len(lengths)):
        if int(lengths[first:last].sum(dtype=np.int64)) == 0:
            share = f"{last - first} of its {len(lengths)} documents"
            fix = (
                "give it more documents (e.g. --split 90,5,5) or weight 0"
                if split_flag
                else "give it documents"
            )
            raise ConfigError(
                f"{split_flag or flag} {prefix}: the {name} split gets {share} and no tokens; {fix}"
            )


def index_cache_directories(data_cache_path: str | None, prefixes: list[str]) -> list[str]:
    """Where megatron-core reads and writes its dataset index cache for this run."""
    if data_cache_path:
        return [data_cache_path]
    return [os.path.join(prefix, "cache", "GPTDataset_indices") for prefix in prefixes]


def check_index_cache(directory: str) -> None:
    """The cache directory can be written (or already holds the indices), and every index in
    it is a plain numeric array (see threefold/safe_loading.py)."""
    flag = "--data-cache-path"
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"{flag}: cannot create the dataset index cache {directory} "
            f"({error.strerror}); pass --data-cache-path DIR somewhere "
            "writable"
        ) from None
    cached = any(name.endswith(".npy") for name in os.listdir(directory))
    if not os.access(directory, os.W_OK) and not cached:
        raise ConfigError(
            f"{flag}: the dataset index cache {directory} is not writable; "
            "pass --data-cache-path DIR somewhere writable"
        )


class _Tokenizer:
    """What GPTDataset asks of a tokenizer (only used for masks threefold does not request)."""

    def __init__(self, eod: int | None, vocab_size: int) -> None:
        self.eod = -1 if eod is None else eod
        self.pad = -1
        self.vocab_size = vocab_size
        self.unique_identifiers = {"class": "threefold", "eod": self.eod}


class MegatronSamples:
    """A megatron-core GPTDataset or BlendedDataset as arrays of `seq_length + 1` tokens."""

    shuffled = True  # the indices are shuffled already: read sequentially

    def __init__(self, dataset, transform: Callable | None = None) -> None:
        # `transform(tokens, index)`: --fim-data's rearrangement (data/fim.py)
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> np.ndarray:
        sample = self.dataset[index]
        tokens = np.concatenate([sample["tokens"].numpy(), sample["labels"][-1:].numpy()])
        return tokens if self.transform is None else self.transform(tokens, index)

    def document_pieces(self, index: int, sequence_length: int) -> list[int]:
        """The lengths of the documents' pieces in sample `index`, in order, as Megatron-LM's
        --dataloader-inter-document-masking cuts it: from megatron-core's sample index (the
        sample's first and last document and their offsets), the extra token of the labels
        left out, and any padding made part of the last piece. Read after the sample itself
        (megatron-core may load its indices then)."""
        dataset = self.dataset
        if getattr(dataset, "dataset_index", None) is not None:  # a blend: which one, where
            dataset, index = (
                dataset.datasets[int(dataset.dataset_index[index])],
                int(dataset.dataset_sample_index[index]),
            )
        sample = int(dataset.shuffle_index[index])
        (first, start), (last, end) = dataset.sample_index[sample], dataset.sample_index[sample + 1]
        extra = int(dataset.config.add_extra_token_to_sequence)
        length = dataset.dataset.sequence_lengths
        if first == last:
            pieces = [int(end - start) + extra]
        else:
            pieces = [int(length[dataset.document_index[first]] - start)]
            pieces += [int(length[dataset.document_index[i]]) for i in range(first + 1, last)]
            pieces.append(int(end) + extra)
        pieces[-1] -= extra
        if pieces[-1] == 0:
            pieces.pop()
        pieces[-1:] = [pieces[-1] + max(sequence_length - sum(pieces), 0)] if pieces else []
        return pieces or [sequence_length]

    def source_of(self, index: int) -> int:
        """Which blended dataset sample `index` comes from (0 when not blended)."""
        dataset_index = getattr(self.dataset, "dataset_index", None)
        return 0 if dataset_index is None else int(dataset_index[index])


class IndexedData:
    """What `megatron_datasets` reads --data-path's `.bin/.idx` prefixes with: megatron-core's
    GPTDataset, samples as token arrays (rearranged with --fim-data). data/megatron_sft.py
    has --sft's JSONL counterpart."""

    def __init__(self, config, tokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.dataset_class = megatron_core.datasets().gpt_dataset.GPTDataset
        # (what GPTDataset asks of a tokenizer: only for masks threefold does not request)
        self.dataset_tokenizer = _Tokenizer(
            getattr(tokenizer, "eod", None), config.model.vocab_size
        )
        self.fim = None
        if config.data.fim_data:  # each split's samples rearranged from a generator of its own
            self.fim = FillInTheMiddle(config.data, tokenizer, config.training.seed)

    def check(self, prefix: str, flag: str) -> None:
        check_prefix(prefix, self.config.model.vocab_size, flag)

    def cache_directories(self, prefixes: list[str]) -> list[str]:
        return index_cache_directories(self.config.data.data_cache_path, prefixes)

    def samples(self, dataset, split: int):
        transform = None if self.fim is None else functools.partial(self.fim, split=split)
        return MegatronSamples(dataset, transform)


def _blend(paths: list[str], flag: str, check: Callable[[str, str], None]):
    try:
        prefixes, weights = megatron_core.datasets().utils.get_blend_from_list(paths)
    except (ValueError, AssertionError):
        raise ConfigError(
            f"{flag}: give PREFIX [PREFIX ...], or WEIGHT PREFIX WEIGHT PREFIX ..."
        ) from None
    for prefix in prefixes:
        check(prefix, flag)
    return prefixes, weights


def _check_npy_caches(directories: list[str]) -> None:
    """Every cached index megatron-core will load with allow_pickle=True (safe_loading.py),
    checked on every rank before any rank writes one: megatron-core's builder has rank 0 write
    the cache while the others wait at its barrier, and a rank still checking would read a
    file half written (and refuse it). So the checks run between two barriers of the group the
    builder's own barrier uses, the default one; a rank that refuses still reaches the second,
    so the others never wait on it."""
    import torch.distributed as dist

    from threefold.safe_loading import check_npy_cache

    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        dist.barrier()
    try:
        for directory in directories:
            check_npy_cache(directory)
    finally:
        if distributed:
            dist.barrier()


def megatron_datasets(config, tokenizer, sizes: list[int], reader=None) -> list:
    """Train, validation and test samples (None for an empty split), built by megatron-core's
    builder (its blends, splits and sizes) from what `reader` reads: IndexedData by default."""
    mcore = megatron_core.datasets()
    reader = reader or IndexedData(config, tokenizer)
    data, model = config.data, config.model
    options = {}
    if data.data_path:
        options.update(blend=_blend(data.data_path, "--data-path", reader.check), split=data.split)
    else:
        options["blend_per_split"] = [
            _blend(paths, flag, reader.check) if paths else None
            for paths, flag in (
                (data.train_data_path, "--train-data-path"),
                (data.valid_data_path, "--valid-data-path"),
                (data.test_data_path, "--test-data-path"),
            )
        ]
    validation = options.get("blend") or options["blend_per_split"][1]
    if config.training.full_validation and validation and validation[1] is not None:
        flag = "--data-path" if data.data_path else "--valid-data-path"
        raise ConfigError(
            f"--full-validation reads every validation sample once, and {flag} weighs its "
            "datasets (samples drawn by weight): give the validation prefixes without weights "
            "(--valid-data-path PREFIX PREFIX ...)"
        )
    prefixes = [
        prefix
        for blend in [options.get("blend"), *options.get("blend_per_split", [])]
        if blend
        for prefix in blend[0]
    ]
    directories = reader.cache_directories(prefixes)
    for directory in directories:
        check_index_cache(directory)
    _check_npy_caches(directories)
    gpt_config = mcore.gpt_dataset.GPTDatasetConfig(
        random_seed=config.training.seed,
        sequence_length=model.seq_length,
        path_to_cache=data.data_cache_path,
        tokenizer=reader.dataset_tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=data.mmap_bin_files,
        mid_level_dataset_surplus=data.mid_level_dataset_surplus,
        num_dataset_builder_threads=data.num_dataset_builder_threads,
        context_parallel_size=config.parallel.context_parallel_size,  # (--sft's padding)
        # (a list of datasets, one per --valid-data-path prefix, for the validation split)
        multiple_validation_sets=config.training.multiple_validation_sets,
        **options,
    )
    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
    try:
        builder = mcore.blended_megatron_dataset_builder.BlendedMegatronDatasetBuilder
        built = builder(reader.dataset_class, sizes, lambda: True, gpt_config).build()
    except (AssertionError, ValueError, IndexError) as error:
        if "mid_level_dataset_surplus" in str(error):  # (its IndexError names the attribute)
            raise ConfigError(
                f"--data-path: megatron-core's blend draws more samples from a dataset than it "
                f"built; raise --mid-level-dataset-surplus (now {data.mid_level_dataset_surplus})"
                ", e.g. ten-fold"
            ) from None
        raise ConfigError(
            f"--data-path/--split: megatron-core could not build the datasets "
            f"({error}); check --split and that every split has documents"
        ) from None
    datasets = [_samples(dataset, split, reader) for split, dataset in enumerate(built)]
    if config.training.multiple_validation_sets and not isinstance(datasets[1], list):
        datasets[1] = [datasets[1]]  # (megatron-core's single prefix: no list)
    if datasets[0] is None:
        raise ConfigError("--split: the train split is empty; give it documents")
    return datasets


def _samples(built, split: int, reader):
    """megatron-core's dataset of a split (a list of them: --multiple-validation-sets) as
    threefold's samples; None for an empty one."""
    if isinstance(built, list):
        return [_samples(dataset, split, reader) for dataset in built]
    return reader.samples(built, split) if built is not None and len(built) else None


class MockGPTDataset:
    """Synthetic tokens: sample `i` of split `s` comes from a generator seeded by (seed, s, i)."""

    def __init__(
        self, seq_length: int, vocab_size: int, seed: int, split_index: int, num_samples: int
    ) -> None:
        self.seq_length, self.vocab_size = seq_length, vocab_size
        self.seed, self.split_index, self.num_samples = seed, split_index, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.split_index, index])
        return rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)
