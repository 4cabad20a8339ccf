"""Tokenize JSONL (or plain text) into Megatron's indexed `.bin/.idx` format.

Megatron-LM's interface and output names: for each of --json-keys, the files
`{output-prefix}_{key}_document.bin/.idx`, written with megatron-core's IndexedDatasetBuilder,
so Megatron-LM reads them and threefold reads Megatron-LM's.

    python tools/preprocess_data.py --input data/shakespeare.jsonl --json-keys text \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/shakespeare_sp.model \
        --output-prefix data/shakespeare --append-eod --workers 2
"""

import argparse
import itertools
import multiprocessing
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import ToolParser, positive  # noqa: E402
from threefold.config import ConfigError, DataConfig  # noqa: E402
from threefold.config.data import TOKENIZERS  # noqa: E402
from threefold.data import megatron_core  # noqa: E402
from threefold.data.documents import read_documents  # noqa: E402
from threefold.data.tokenizer import build_tokenizer  # noqa: E402
from threefold.output_directory import make_parent_directory  # noqa: E402
from threefold.written_aside import written_aside  # noqa: E402

_tokenizer = None
_append_eod = False
_dtype = np.int32
_PROGRESS_BYTES = 64 << 20  # progress at least this often: one document may be huge


def _init_worker(data_config: DataConfig, vocab_size, append_eod: bool, dtype) -> None:
    global _tokenizer, _append_eod, _dtype
    _tokenizer = build_tokenizer(data_config, vocab_size)
    _append_eod = append_eod
    _dtype = dtype


def _encode(numbered: tuple[int, dict[str, str]]) -> tuple[dict[str, np.ndarray] | str, int]:
    """(token ids as the output's dtype, text bytes): a few bytes per token, not a Python
    int's 36, while they travel back from a worker and wait in the pool's queue for the
    writer. A text the tokenizer refuses (NullTokenizer's word that is no id) is a bad record:
    ('line N: why', 0)."""
    line, document = numbered
    encoded = {}
    for key, text in document.items():
        try:
            ids = _tokenizer.tokenize(text)
        except ValueError as error:
            return f"{line}: {key!r}: {error}", 0
        if _append_eod:
            ids.append(_tokenizer.eod)
        encoded[key] = np.asarray(ids, dtype=_dtype)
        del ids
    return encoded, sum(len(text.encode("utf-8")) for text in document.values())


def _bounded_imap(pool, documents, workers: int, chunk: int = 64):
    """pool.imap over the documents, in order, with at most a few chunks per worker read ahead
    (Pool.imap alone reads its whole input eagerly: unbounded memory on a large file)."""
    window = 4 * workers * chunk
    while True:
        batch = list(itertools.islice(documents, window))
        if not batch:
            return
        yield from pool.imap(_encode, batch, chunksize=chunk)


def main() -> None:
    parser = ToolParser(
        prog="preprocess_data.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input", required=True, help="JSONL file, or text with a document per line"
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="JSON fields to tokenize (default: text)"
    )
    parser.add_argument(
        "--tokenizer-type",
        required=True,
        choices=[t for t in TOKENIZERS if t],
        help="the tokenizer the training run will use",
    )
    parser.add_argument("--tokenizer-model", help="sentencepiece file or HF tokenizer dir")
    parser.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    parser.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    parser.add_argument("--vocab-size", type=positive(int), help="for NullTokenizer")
    parser.add_argument(
        "--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx per key"
    )
    parser.add_argument(
        "--append-eod", action="store_true", help="end each document with the end-of-document token"
    )
    parser.add_argument(
        "--workers", type=positive(int), default=1, help="tokenizing processes (default: 1)"
    )
    parser.add_argument(
        "--log-interval",
        type=positive(int),
        default=1000,
        help="print progress every this many documents",
    )
    parser.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="report each malformed record (file:line) and go on, instead of "
        "stopping at the first; the count is printed at the end",
    )
    args = parser.parse_args()
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file")
    for key in args.json_keys:
        if "/" in key or os.sep in key:  # (a key names its output: PREFIX_{key}_document.bin)
            parser.error(f"--json-keys {key}: a key names its output file, so holds no '/'")

    data_config = DataConfig(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
    )
    try:
        data_config.finalize_tokenizer()  # (the files each type needs: as the trainer checks)
        tokenizer = build_tokenizer(data_config, args.vocab_size)
        for warning in data_config.unread_tokenizer_files():
            print(f"WARNING: {warning}", flush=True)
        make_parent_directory(args.output_prefix, "--output-prefix")
    except ConfigError as error:
        parser.error(str(error))
    # megatron-core imports torch: after the flags, the tokenizer and the output are checked.
    indexed_dataset = megatron_core.datasets().indexed_dataset
    DType, IndexedDatasetBuilder = indexed_dataset.DType, indexed_dataset.IndexedDatasetBuilder
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    # Written aside and renamed over the outputs only once complete: a failure (bad input,
    # full disk, Ctrl-C) leaves an earlier good .bin/.idx pair as it was.
    outputs = [prefix + suffix for prefix in prefixes.values() for suffix in (".idx", ".bin")]
    try:
        with written_aside(*outputs) as temporaries:
            aside = dict(zip(outputs, temporaries))
            builders = {
                key: IndexedDatasetBuilder(aside[prefix + ".bin"], dtype=dtype)
                for key, prefix in prefixes.items()
            }
            count, total_tokens, bad, elapsed, total_bytes = _tokenize(
                args, data_config, builders, DType.optimal_dtype(tokenizer.vocab_size)
            )
            for key, builder in builders.items():
                builder.finalize(aside[prefixes[key] + ".idx"])
    except ValueError as error:  # a bad record, without --skip-bad-records
        parser.exit(
            2,
            f"preprocess_data.py: error: {error}; fix it or pass "
            "--skip-bad-records (nothing was written)\n",
        )
    skipped = f", skipped {bad} bad records" if bad else ""
    print(
        f"done: {count} documents, {total_tokens} tokens in {elapsed:.1f} s "
        f"({count / elapsed:.1f} docs/s, {total_bytes / elapsed / 2**20:.2f} MB/s){skipped}; "
        "wrote " + ", ".join(p + ".bin/.idx" for p in prefixes.values()),
        flush=True,
    )


def _tokenize(args, data_config: DataConfig, builders: dict, dtype) -> tuple:
    """Tokenize every document into the builders; (documents, tokens, bad records, seconds,
    text bytes)."""
    bad = []

    def report(message: str) -> None:
        bad.append(message)
        print(f"preprocess_data.py: skipped {message}", file=sys.stderr, flush=True)

    documents = read_documents(
        args.input, args.json_keys, report if args.skip_bad_records else None
    )
    initargs = (data_config, args.vocab_size, args.append_eod, dtype)
    if args.workers > 1:
        pool = multiprocessing.Pool(args.workers, _init_worker, initargs)
        encoded_stream = _bounded_imap(pool, documents, args.workers)
    else:
        pool = None
        _init_worker(*initargs)
        encoded_stream = map(_encode, documents)

    start, total_bytes, total_tokens, count = time.time(), 0, 0, 0
    input_size = max(os.path.getsize(args.input), 1)
    reported_bytes = 0
    try:
        for encoded, num_bytes in encoded_stream:
            if isinstance(encoded, str):  # a bad record, where the tokenizer met it
                if not args.skip_bad_records:
                    raise ValueError(f"{args.input}:{encoded}")
                report(f"{args.input}:{encoded}")
                continue
            count += 1
            total_bytes += num_bytes
            for key, ids in encoded.items():
                if len(ids):
                    builders[key].add_document(ids, [len(ids)])
                    total_tokens += len(ids)
            if count % args.log_interval == 0 or total_bytes - reported_bytes > _PROGRESS_BYTES:
                reported_bytes = total_bytes
                elapsed = time.time() - start
                done = min(total_bytes / input_size, 1.0)  # text bytes: close to the file's
                print(
                    f"[{'#' * int(done * 20):<20}] ~{done:.0%} processed {count} documents "
                    f"({count / elapsed:.1f} docs/s, {total_bytes / elapsed / 2**20:.2f} "
                    "MB/s)",
                    flush=True,
                )
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return count, total_tokens, len(bad), max(time.time() - start, 1e-9), total_bytes


if __name__ == "__main__":
    main()
