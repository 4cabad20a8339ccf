"""Train a sentencepiece tokenizer on JSONL or plain text.

    python tools/train_tokenizer.py --input data/shakespeare.jsonl --json-keys text \
        --vocab-size 2048 --model-prefix data/shakespeare_sp

The tokenizer keeps text as it is: no Unicode normalization, no collapsing of spaces, newlines
as a token of their own and byte fallback for characters it never saw, so code and verse
round-trip exactly (`detokenize(tokenize(text)) == text`).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.data.documents import read_documents  # noqa: E402

_PIECE = 16384  # characters per training "sentence"


def _pieces(text: str) -> list[str]:
    pieces, start = [], 0
    while len(text) - start > _PIECE:
        cut = text.rfind("\n", start, start + _PIECE)
        end = cut + 1 if cut > start else start + _PIECE
        pieces.append(text[start:end])
        start = end
    return pieces + [text[start:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument(
        "--input", required=True, help="JSONL file, or text with a document per line"
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="JSON fields to read (default: text)"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=8000, help="tokens in the vocabulary (default: 8000)"
    )
    parser.add_argument(
        "--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab"
    )
    parser.add_argument(
        "--model-type", default="bpe", choices=["bpe", "unigram"], help="sentencepiece's algorithm"
    )
    parser.add_argument(
        "--max-sentences",
        type=int,
        default=2_000_000,
        help="lines sampled for training, bounding memory and time",
    )
    args = parser.parse_args()
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file")
    import sentencepiece

    def sentences():
        """Whole documents (in pieces of at most _PIECE characters, cut after a newline), so
        newlines and indentation are part of what the tokenizer learns."""
        for document in read_documents(args.input, args.json_keys):
            for text in document.values():
                yield from (piece for piece in _pieces(text) if piece.strip())

    os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=sentences(),
        model_prefix=args.model_prefix,
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
    print(f"wrote {args.model_prefix}.model (vocabulary {args.vocab_size})")


if __name__ == "__main__":
    main()
