"""Fill-in-the-middle samples (Megatron-LM's --fim-data; Bavarian et al. 2022, "Efficient
Training of Language Models to Fill in the Middle").

With probability --fim-rate each document of a sample (the pieces between end-of-document
tokens) is cut at two random character positions of its text into prefix, middle and suffix,
re-tokenized, and rearranged so that the middle comes last:

    PSM:  <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM:  <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle   (--fim-spm-rate of them)

The sample keeps its length: cut to it, or filled with --fim-pad-token. With
--fim-split-sample TOKEN a document that holds that token (a repository of files, say) is,
with probability --fim-rate, cut into fragments at it, each rearranged with probability
--fim-fragment-rate; --fim-no-prefix TEXT leaves pieces whose text starts so as they are.

Megatron-LM draws every choice from one generator that advances as samples are read, so its
samples depend on the order they were read in (and drops an end-of-document token that
follows another). Here each sample draws from a generator seeded by the run's seed, the split
and the sample's index, the same sample whatever reads it, resumed or on another
data-parallel layout; every end-of-document token stays.
"""

from __future__ import annotations

import numpy as np

from threefold.config import ConfigError, DataConfig

_STREAM = 0x46494D  # "FIM": the generator's stream, apart from others seeded by the run's seed


def _token(tokenizer, flag: str, token: str) -> int:
    """The id of one special token, or a one-line error naming its flag."""
    found = tokenizer.token_id(token) if hasattr(tokenizer, "token_id") else None
    if found is None:
        raise ConfigError(
            f"{flag} {token!r}: not a token of the tokenizer; give one it has (fill-in-the-"
            "middle needs its sentinel tokens in the vocabulary)"
        )
    return found


class FillInTheMiddle:
    """A sample's tokens rearranged for fill-in-the-middle training (module doc)."""

    def __init__(self, config: DataConfig, tokenizer, seed: int) -> None:
        if tokenizer is None:
            raise ConfigError(
                "--fim-data rearranges text: it needs --tokenizer-type (and the data it made)"
            )
        self.tokenizer, self.seed = tokenizer, seed
        self.rate, self.spm_rate = config.fim_rate, config.fim_spm_rate
        self.fragment_rate = config.fim_fragment_rate
        self.no_prefix = config.fim_no_prefix
        self.prefix, self.middle, self.suffix, self.pad, self.eod = (
            _token(tokenizer, flag, getattr(config, flag[2:].replace("-", "_")))
            for flag in (
                "--fim-prefix-token",
                "--fim-middle-token",
                "--fim-suffix-token",
                "--fim-pad-token",
                "--fim-eod-token",
            )
        )
        self.split = None
        if config.fim_split_sample is not None:
            self.split = _token(tokenizer, "--fim-split-sample", config.fim_split_sample)

    def __call__(self, sample: np.ndarray, index: int, split: int = 0) -> np.ndarray:
        """Sample `index` of split `split` (train, validation, test), rearranged, at its
        length."""
        rng = np.random.default_rng([self.seed, _STREAM, split, index])
        pieces = []
        for number, document in enumerate(_cut(sample, self.eod)):
            if number:
                pieces.append([self.eod])
            if len(document):
                pieces.append(self._document(document, rng))
        tokens = np.concatenate(pieces).astype(sample.dtype)[: len(sample)]
        fill = np.full(len(sample) - len(tokens), self.pad, dtype=sample.dtype)
        return np.concatenate([tokens, fill])

    def _document(self, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self.split is None or not (tokens == self.split).any():
            return self._rearranged(tokens, self.rate, rng)
        if rng.random() >= self.rate:
            return tokens
        pieces = []
        for number, fragment in enumerate(_cut(tokens, self.split)):
            if number:
                pieces.append([self.split])
            if len(fragment):
                pieces.append(self._rearranged(fragment, self.fragment_rate, rng))
        return np.concatenate(pieces)

    def _rearranged(self, tokens: np.ndarray, rate: float, rng: np.random.Generator):
        if rng.random() >= rate:
            return tokens
        text = self.tokenizer.detokenize(tokens.tolist())
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return tokens
        # Two cuts anywhere from before the first character to after the last: any of the
        # three parts may be empty.
        first, second = sorted(int(i) for i in rng.integers(0, len(text) + 1, size=2))
        prefix, middle, suffix = (
            self.tokenizer.tokenize(part)
            for part in (text[:first], text[first:second], text[second:])
        )
        if rng.random() < self.spm_rate:
            order = [self.prefix, self.suffix, *suffix, self.middle, *prefix, *middle]
        else:
            order = [self.prefix, *prefix, self.suffix, *suffix, self.middle, *middle]
        return np.array(order, dtype=tokens.dtype)


def _cut(tokens: np.ndarray, at: int) -> list[np.ndarray]:
    """`tokens` cut at each `at` token, which no piece keeps (empty pieces included, so that
    joining them with `at` gives `tokens` back)."""
    pieces = np.split(tokens, np.flatnonzero(tokens == at))
    return pieces[:1] + [piece[1:] for piece in pieces[1:]]
