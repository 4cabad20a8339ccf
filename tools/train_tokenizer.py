"""Train a sentencepiece tokenizer on JSONL or plain text.

    python tools/train_tokenizer.py --input data/shakespeare.jsonl --json-keys text \
        --vocab-size 2048 --model-prefix data/shakespeare_sp

The tokenizer keeps text as it is: no Unicode normalization, no collapsing of spaces, newlines
as a token of their own and byte fallback for characters it never saw, so code and verse
round-trip exactly (`detokenize(tokenize(text)) == text`).
"""

import argparse
import os
import re
import sys
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import ToolParser, positive  # noqa: E402
from threefold.config import ConfigError  # noqa: E402
from threefold.data.documents import read_documents  # noqa: E402
from threefold.output_directory import make_parent_directory  # noqa: E402
from threefold.written_aside import written_aside  # noqa: E402

_PIECE = 16384  # characters per training "sentence"


def _pieces(text: str) -> list[str]:
    pieces, start = [], 0
    while len(text) - start > _PIECE:
        cut = text.rfind("\n", start, start + _PIECE)
        end = cut + 1 if cut > start else start + _PIECE
        pieces.append(text[start:end])
        start = end
    return pieces + [text[start:]]


def _refusal(error: Exception, vocab_size: int) -> str:
    """One line for sentencepiece's refusal, whose text follows its check ("... [check] text")."""
    text = str(error).rsplit("] ", 1)[-1].strip()
    small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", text)
    if small:
        return (
            f"--vocab-size {vocab_size}: below the {small.group(1)} pieces every tokenizer of "
            "this text holds (its characters, 256 bytes, the special tokens); give at least that"
        )
    high = re.search(r"too high \(\d+\)\. Please set it to a value <= (\d+)", text)
    if high:
        return (
            f"--vocab-size {vocab_size}: more pieces than this text yields; give at most "
            f"{high.group(1)}, or more text"
        )
    return f"sentencepiece: {text}"


def _train(sentences: Iterator[str], prefix: str, args: argparse.Namespace) -> None:
    """sentencepiece's training, writing PREFIX.model and PREFIX.vocab."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_prefix=prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        character_coverage=1.0,
        input_sentence_size=args.max_sentences,
        shuffle_input_sentence=True,
        byte_fallback=True,
        # Keep the text as it is (sentencepiece's defaults normalize it with NFKC, drop
        # repeated spaces and know no newline).
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["\n"],
        max_sentence_length=_PIECE,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        num_threads=2,
        minloglevel=2,
    )


def main() -> None:
    parser = ToolParser(prog="train_tokenizer.py", description=__doc__)
    parser.add_argument(
        "--input", required=True, help="JSONL file, or text with a document per line"
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="JSON fields to read (default: text)"
    )
    parser.add_argument(
        "--vocab-size",
        type=positive(int),
        default=8000,
        help="tokens in the vocabulary (default: 8000)",
    )
    parser.add_argument(
        "--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab"
    )
    parser.add_argument(
        "--model-type", default="bpe", choices=["bpe", "unigram"], help="sentencepiece's algorithm"
    )
    parser.add_argument(
        "--max-sentences",
        type=positive(int),
        default=2_000_000,
        help="lines sampled for training, bounding memory and time",
    )
    args = parser.parse_args()
    if not os.path.isfile(args.input):
        parser.exit(2, f"train_tokenizer.py: error: --input {args.input}: no such file\n")
    bad_records = []  # what the reader refused: sentencepiece passes it on as its own error

    def sentences():
        """Whole documents (in pieces of at most _PIECE characters, cut after a newline), so
        newlines and indentation are part of what the tokenizer learns."""
        try:
            for _, document in read_documents(args.input, args.json_keys):
                for text in document.values():
                    yield from (piece for piece in _pieces(text) if piece.strip())
        except ValueError as error:
            bad_records.append(str(error))
            raise

    prefix = args.model_prefix
    if prefix and os.path.basename(prefix) in ("", ".", ".."):  # (names it cannot extend)
        parser.error(
            f"--model-prefix {prefix}: a directory; give a name in it, such as "
            f"{os.path.join(prefix, 'tokenizer')} (which writes tokenizer.model and .vocab)"
        )
    try:
        make_parent_directory(args.model_prefix, "--model-prefix")
    except ConfigError as error:
        parser.error(str(error))
    # Trained under a name of its own, then renamed: a tokenizer already at --model-prefix
    # (which data was tokenized with) is replaced only by a complete one.
    # (the model last: it is what a run reads)
    outputs = [args.model_prefix + extension for extension in (".vocab", ".model")]
    try:
        with written_aside(*outputs) as (vocab, _):
            _train(sentences(), vocab.removesuffix(".vocab"), args)  # writes both
    except (ValueError, RuntimeError) as error:  # a bad record; sentencepiece's refusals
        line = bad_records[0] if bad_records else _refusal(error, args.vocab_size)
        parser.exit(2, f"train_tokenizer.py: error: {line}; nothing was written\n")
    print(f"wrote {args.model_prefix}.model (vocabulary {args.vocab_size})")


if __name__ == "__main__":
    main()
