"""The entry points bench/flag_probe.py runs: each one's flags, the tiny run a case adds one
flag to, and the files that run reads (a checkpoint, conversations, a corpus), made once.

An entry point's `main` reads `sys.argv` as its script would; a tool's flags are those of the
parser its `main` builds, caught at that parser's first parse (the tools build theirs inline).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import random
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from threefold.arguments import build_parser  # noqa: E402

# The tiny run: two layers of width 32, two iterations, an evaluation, a save.
MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16"
).split()
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4"]
SCHEDULE = (
    "--train-iters 2 --lr 1e-3 --log-interval 1 --eval-interval 2 --eval-iters 1 --save-interval 2"
).split()
MOCK = ["--mock-data", "--vocab-size", "100"]
TINY = MODEL + BATCH + SCHEDULE + MOCK
# (a Mamba layer and an attention layer: what pretrain_hybrid.py builds)
HYBRID = (
    "--hybrid-layer-pattern M* --mamba-num-heads 4 --mamba-head-dim 16 --mamba-num-groups 2"
).split()
# The fixtures' tokenizer, trained on their corpus by tools/train_tokenizer.py
TOKENIZER = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{f}/tok.model"]
WORDS = (
    "to be or not that is the question whether tis nobler in mind suffer slings and arrows of "
    "outrageous fortune take arms against a sea troubles by opposing end them die sleep no more"
).split()


@dataclasses.dataclass(frozen=True)
class Entry:
    """`prog`'s flags (`parser`), its `main` reading sys.argv, and the tiny run a case adds a
    flag to (`base`: "{f}" in a flag is the fixtures' directory, "{c}" the case's)."""

    prog: str
    main: Callable[[], int | None]
    parser: Callable[[], argparse.ArgumentParser]
    base: tuple[str, ...]

    def argv(self, fixtures: str, case: str) -> list[str]:
        return _formatted(self.base, fixtures, case)

    @property
    def reads_fixtures(self) -> bool:
        """Whether the tiny run reads what `write_fixtures` makes (else it is not made)."""
        return any("{f}" in flag for flag in self.base)


def _script(path: str):
    """A script of the tree (tools/ is no package) imported as a module."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"probed_{name}", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (a dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def parser_of(main: Callable[[], object]) -> argparse.ArgumentParser:
    """The parser `main` builds, caught when it first parses (so nothing after runs)."""
    parse = argparse.ArgumentParser.parse_known_args

    def caught(self, *args, **kwargs):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = caught
    argv, sys.argv = sys.argv, ["probe"]
    try:
        main()
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_known_args = parse
        sys.argv = argv
    raise RuntimeError(f"{main.__module__}.main parsed no flags")


def _tool(path: str, base: tuple[str, ...], trainer_flags: bool = False) -> Entry:
    """A tool's entry; `trainer_flags`: it takes pretrain_gpt.py's flags after its own."""
    module = _script(path)
    prog = os.path.basename(path)

    def parser() -> argparse.ArgumentParser:
        own = parser_of(module.main)
        return build_parser(prog, own_flags=own) if trainer_flags else own

    return Entry(prog, module.main, parser, base)


def _formatted(flags: tuple[str, ...], fixtures: str, case: str) -> list[str]:
    return [flag.format(f=fixtures, c=case) for flag in flags]


@functools.cache
def entries() -> dict[str, Entry]:
    """Each entry point by its script's name (imported once: a tool's module is one object,
    which its worker processes pickle functions of)."""
    import finetune
    import pretrain_gpt

    sft = "{f}/sft.jsonl"
    found = [
        Entry(
            "pretrain_gpt.py",
            lambda: pretrain_gpt.main(sys.argv[1:]),
            build_parser,
            (*TINY, "--save", "{c}/checkpoints", "--tensorboard-dir", "{c}/tb"),
        ),
        Entry(
            "pretrain_hybrid.py",
            lambda: pretrain_gpt.main(sys.argv[1:], prog="pretrain_hybrid.py", hybrid=True),
            lambda: build_parser("pretrain_hybrid.py"),
            (*TINY, *HYBRID, "--save", "{c}/checkpoints", "--tensorboard-dir", "{c}/tb"),
        ),
        Entry(
            "finetune.py",
            finetune.main,
            lambda: build_parser("finetune.py", own_flags=finetune._own_flags()),
            (
                *BATCH,
                *SCHEDULE,
                *("--load", "{f}/pretrained", "--save", "{c}/checkpoints"),
                *("--train-data-path", sft, "--valid-data-path", sft),
                *("--tensorboard-dir", "{c}/tb"),
            ),
        ),
        _tool("tools/estimate_memory.py", (*MODEL, *BATCH, *MOCK), trainer_flags=True),
        _tool("tools/plan_layout.py", ("--gpus", "8", *MODEL, *BATCH, *MOCK), True),
        _tool(
            "tools/convert_checkpoint.py",
            (
                *("--loader", "threefold", "--saver", "megatron"),
                *("--load-dir", "{f}/pretrained", "--save-dir", "{c}/converted"),
            ),
        ),
        _tool(
            "tools/generate.py",
            ("--load", "{f}/pretrained", "--prompt", "to be", "--max-new-tokens", "4"),
        ),
        _tool("tools/score.py", ("--load", "{f}/pretrained", "--input", "{f}/text.txt")),
        _tool("tools/prepare_default_corpus.py", ("--output", "{c}/corpus.jsonl")),
        _tool("tools/plot_logs.py", ("{f}/training.log", "--output", "{c}/training.png")),
        _tool(
            "tools/preprocess_data.py",
            ("--input", "{f}/corpus.jsonl", *TOKENIZER, "--output-prefix", "{c}/corpus"),
        ),
        _tool(
            "tools/train_tokenizer.py",
            ("--input", "{f}/corpus.jsonl", "--vocab-size", "300", "--model-prefix", "{c}/tok"),
        ),
    ]
    return {entry.prog: entry for entry in found}


def write_fixtures(directory: str, run: Callable[[str, list[str]], tuple[int, str]]) -> None:
    """What the tiny runs read, made as a user makes them (`run(script, argv)` runs one to
    its end: its exit code and output): a corpus, a tokenizer trained on it, the corpus
    tokenized, two iterations on it saved with the tokenizer (to fine-tune, convert, generate
    from and score; its log, to plot), three conversations."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(24)) for _ in range(200)]
    with open(f"{directory}/corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in lines)
    with open(f"{directory}/text.txt", "w") as f:
        f.write("\n".join(lines[:4]) + "\n")
    with open(f"{directory}/sft.jsonl", "w") as f:
        for words in (line.split() for line in lines[:3]):  # (a few tokens each)
            prompt, response = " ".join(words[:2]), " ".join(words[2:4])
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    corpus = ("--input", "{f}/corpus.jsonl")
    steps = [
        ("train_tokenizer.py", (*corpus, "--vocab-size", "300", "--model-prefix", "{f}/tok")),
        ("preprocess_data.py", (*corpus, *TOKENIZER, "--output-prefix", "{f}/corpus")),
        (
            "pretrain_gpt.py",
            (
                *(*MODEL, *BATCH, *SCHEDULE, *TOKENIZER),
                *("--data-path", "{f}/corpus_text_document", "--split", "90,5,5"),
                *("--save", "{f}/pretrained"),
            ),
        ),
    ]
    for script, flags in steps:
        argv = _formatted(flags, directory, "")
        code, output = run(script, argv)
        if code:
            raise RuntimeError(f"the probe's fixtures: {script} {' '.join(argv)}:\n{output}")
    with open(f"{directory}/training.log", "w") as f:  # (pretrain_gpt.py's, for plot_logs.py)
        f.write(output)
