"""Megatron-LM's own functional-test configs against threefold's command line.

Reads every `tests/functional_tests/test_cases/{gpt,moe,hybrid,nemotron}/*/model_config.yaml` of a
Megatron-LM checkout, turns its MODEL_ARGS into a pretrain_gpt.py command line the way the test
harness does, makes it runnable on a CPU, and parses it with threefold: each config either
parses (the run would start) or stops in one line naming what is missing. A generic argparse
message (`unrecognized arguments`, `invalid choice`) is a gap in threefold's Megatron
compatibility.

    git clone https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM
    python bench/megatron_configs.py /tmp/Megatron-LM > bench/results/megatron_configs.md

What is changed to run on a CPU, and nothing else: the data and tokenizer files become
`--mock-data --vocab-size 1024` (the configs name files on NVIDIA's clusters; with `--fim-data`,
which rearranges text, a small corpus and GPT-2 files holding its sentinels), paths of
checkpoints and TensorBoard become a scratch directory, `--distributed-backend nccl` becomes
gloo, `--transformer-impl transformer_engine` becomes local, `--attention-backend fused`
(cuDNN's) auto, and the model shrinks (hidden 64, 4 heads or the config's if it divides 64, as
many query groups of them as divide both, FFN 128, sequence 64, a DSA indexer of 4 heads of 16
picking 16 keys, Mamba layers of 16 heads of 8 in 8 groups with a state of 16, 2 iterations);
the harness's `${REPEAT}` (a repetition's number) is 1; layers, parallel layout, precision, and
every other flag stay.
"""

from __future__ import annotations

import contextlib
import glob
import io
import math
import os
import re
import sys
import tempfile

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DROPPED = {"--data-path", "--vocab-file", "--merge-file", "--tokenizer-model", "--data-cache-path"}
PATHS = {"--save", "--load", "--tensorboard-dir", "--wandb-save-dir", "--profile-dir"}
KINDS = ("gpt", "moe", "hybrid", "nemotron")  # the test_cases folders surveyed
HARNESS = {"${REPEAT}": "1"}  # variables the test harness substitutes
SHRUNK = {
    "--hidden-size": "64",
    "--ffn-hidden-size": "128",
    "--seq-length": "64",
    "--max-position-embeddings": "64",
    "--train-iters": "2",
    "--kv-channels": "16",
    "--moe-ffn-hidden-size": "32",
    "--moe-shared-expert-intermediate-size": "32",
    # DeepSeek sparse attention's indexer, and its top-k under the shrunk sequence
    "--dsa-indexer-n-heads": "4",
    "--dsa-indexer-head-dim": "16",
    "--dsa-indexer-topk": "16",
    # a hybrid model's Mamba layers: 16 heads of 8 in 8 groups (TP x CP up to 8 splits them)
    "--mamba-head-dim": "8",
    "--mamba-num-groups": "8",
    "--mamba-state-dim": "16",
    "--mamba-num-heads": "16",
}
# Mamba sizes a hybrid config leaves at megatron-core's defaults, shrunk as SHRUNK's
HYBRID_SIZES = ("--mamba-head-dim", "--mamba-num-groups", "--mamba-state-dim")


def command_line(model_args: dict, scratch: str) -> list[str]:
    """A config's MODEL_ARGS as the argv its harness passes, made runnable on a CPU."""
    argv: list[str] = []
    for flag, value in model_args.items():
        if flag in DROPPED or value is False or value is None:
            continue
        value = HARNESS.get(value, value) if isinstance(value, str) else value
        if flag in ("--save", "--load"):  # the harness's fresh run: --load is its --save
            value = os.path.join(scratch, "checkpoints")
        elif flag in PATHS:
            value = os.path.join(scratch, flag.strip("-"))
        elif flag in SHRUNK:
            value = SHRUNK[flag]
        elif flag == "--num-attention-heads":  # as many as divide hidden 64 and TP divides
            tp = int(model_args.get("--tensor-model-parallel-size", 1))
            value = str(value) if 64 % int(value) == 0 and int(value) <= 16 else str(max(4, tp))
        elif flag == "--distributed-backend":
            value = "gloo"
        elif flag == "--transformer-impl" and value == "transformer_engine":
            value = "local"  # Transformer Engine does not install without CUDA
        elif flag == "--attention-backend" and value == "fused":
            value = "auto"  # cuDNN's fused attention needs CUDA
        elif flag == "--tokenizer-type" and value != "NullTokenizer":
            continue  # its files are dropped: mock data with --vocab-size
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, str) and re.fullmatch(r"\[[^]]+\]", value.strip()):
            # the harness (_run_training.sh) strips the brackets and passes the words apart
            argv += [flag, *value.strip()[1:-1].split()]
        else:
            argv += [flag, str(value)]
    if "--num-query-groups" in model_args:
        groups = int(model_args["--num-query-groups"])
        heads = int(argv[argv.index("--num-attention-heads") + 1])
        argv[argv.index("--num-query-groups") + 1] = str(math.gcd(groups, heads))
    if "--hybrid-layer-pattern" in model_args or "--hybrid-override-pattern" in model_args:
        for flag in HYBRID_SIZES:
            if flag not in model_args:
                argv += [flag, SHRUNK[flag]]
    if model_args.get("--fim-data"):
        return argv + fim_files(scratch) + ["--vocab-size", "1024"]
    return argv + ["--mock-data", "--vocab-size", "1024"]


FIM_SENTINELS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|endoftext|>")


def fim_files(scratch: str) -> list[str]:
    """--fim-data rearranges the text of documents, which mock tokens have none of (Megatron-LM
    refuses mock data with it too): GPT-2 byte-level files whose vocabulary holds the FIM
    sentinels (256 bytes, no merges) and a corpus of 1,000 documents (this file's lines), so
    that even a 0.1% test split gets one; written once into the scratch directory."""
    prefix = os.path.join(scratch, "fim", "corpus")
    files = ["--vocab-file", prefix + "_vocab.json", "--merge-file", prefix + "_merges.txt"]
    flags = ["--data-path", prefix, *files, "--tokenizer-type", "GPT2BPETokenizer"]
    if os.path.exists(prefix + ".idx"):
        return flags
    import json
    import warnings

    import numpy as np
    from tokenizers import pre_tokenizers

    from threefold.data.tokenizer import GPT2BPETokenizer

    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    with open(prefix + "_vocab.json", "w") as f:
        json.dump({token: i for i, token in enumerate([*alphabet, *FIM_SENTINELS])}, f)
    with open(prefix + "_merges.txt", "w") as f:
        f.write("#version: 0.2\n")
    tokenizer = GPT2BPETokenizer(prefix + "_vocab.json", prefix + "_merges.txt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    with open(__file__) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for number in range(1000):
        ids = tokenizer.tokenize(lines[number % len(lines)]) + [tokenizer.eod]
        builder.add_document(np.array(ids), [len(ids)])
    builder.finalize(prefix + ".idx")
    return flags


def world_size(argv: list[str]) -> int:
    """The fewest ranks the config's layout runs on: each pipeline stage holds TP x CP x DP
    ranks, which EP x expert TP (default: TP, as in Megatron) must divide as well, and whose
    replicas (DP x CP, and expert DP) split into the distributed-optimizer instances."""

    def size(flag: str, default: int = 1) -> int:
        return int(argv[argv.index(flag) + 1]) if flag in argv else default

    tp = size("--tensor-model-parallel-size")
    experts = size("--expert-model-parallel-size") * size("--expert-tensor-parallel-size", tp)
    instances = size("--num-distributed-optimizer-instances")
    stage = math.lcm(tp * size("--context-parallel-size"), tp * instances, experts * instances)
    return stage * size("--pipeline-model-parallel-size")


def outcome(argv: list[str]) -> tuple[str, str]:
    """('parses' | 'refused' | 'argparse', the one line) for a command line."""
    from threefold.arguments import parse_args

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parse_args(argv, world_size=world_size(argv))
        except SystemExit:
            lines = [line for line in err.getvalue().splitlines() if "error:" in line]
            message = lines[-1].split("error: ", 1)[1] if lines else err.getvalue().strip()
            generic = "unrecognized arguments" in message or "invalid choice" in message
            return ("argparse" if generic else "refused"), message
    return "parses", ""


def main(root: str) -> None:
    pattern = os.path.join(root, "tests/functional_tests/test_cases/{}/*/model_config.yaml")
    files = sorted(sum((glob.glob(pattern.format(kind)) for kind in KINDS), []))
    counts: dict[str, int] = {}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for path in files:
            with open(path) as f:
                model_args = (yaml.safe_load(f) or {}).get("MODEL_ARGS") or {}
            if not model_args:
                continue
            kind, message = outcome(command_line(model_args, scratch))
            counts[kind] = counts.get(kind, 0) + 1
            name = "/".join(path.split(os.sep)[-3:-1])
            rows.append(f"| {name} | {kind} | {message.replace('|', '/')} |")
    print(f"{len(rows)} configs: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    print()
    print("| config | outcome | the line |")
    print("| --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1])
