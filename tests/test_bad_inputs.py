"""Up-front validation: every mistake below ends `pretrain_gpt.py` with exit code 2 and one
line naming the flag or file, in under 5 seconds (layout mistakes before torch is imported)."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.data.test_datasets import VOCAB, write_corpus

BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "2",
    "--eval-iters",
    "0",
]
MOCK = ["--mock-data", "--vocab-size", "128"]

# (flags after BASE, world size, what the error must name)
CONFIGS = [
    (
        MOCK + ["--tensor-model-parallel-size", "3"],
        3,
        "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3",
    ),
    (
        MOCK
        + [
            "--group-query-attention",
            "--num-query-groups",
            "1",
            "--tensor-model-parallel-size",
            "2",
        ],
        2,
        "--num-query-groups 1",
    ),
    (MOCK + ["--group-query-attention", "--num-query-groups", "3"], 1, "--num-query-groups 3"),
    (MOCK + ["--hidden-size", "66"], 1, "--hidden-size 66"),
    (
        MOCK + ["--ffn-hidden-size", "30", "--tensor-model-parallel-size", "4"],
        4,
        "--ffn-hidden-size 30",
    ),
    (
        MOCK + ["--pipeline-model-parallel-size", "3"],
        3,
        "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3",
    ),
    (
        MOCK
        + ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "4"],
        2,
        "--virtual-pipeline-model-parallel-size 4",
    ),
    (
        MOCK
        + [
            "--pipeline-model-parallel-size",
            "2",
            "--virtual-pipeline-model-parallel-size",
            "2",
            "--global-batch-size",
            "6",
        ],
        2,
        "multiple of --pipeline-model-parallel-size 2",
    ),
    (
        MOCK + ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "5"],
        2,
        "--decoder-first/last-pipeline-num-layers",
    ),
    (MOCK + ["--tensor-model-parallel-size", "2"], 3, "world size 3"),
    (
        MOCK + ["--context-parallel-size", "4", "--seq-length", "36"],
        4,
        "--seq-length 36 is not divisible by 2 x --context-parallel-size 4",
    ),
    (MOCK + ["--global-batch-size", "5"], 1, "--global-batch-size 5"),
    (MOCK + ["--micro-batch-size", "0"], 1, "--micro-batch-size"),
    (MOCK + ["--fp16", "--bf16"], 1, "--fp16 and --bf16"),
    (MOCK + ["--max-position-embeddings", "16"], 1, "--max-position-embeddings 16"),
    (MOCK + ["--overlap-param-gather"], 2, "--overlap-param-gather"),
    (MOCK + ["--tokenizer-type", "TikTokenizer"], 1, "--tokenizer-type TikTokenizer"),
    (
        MOCK + ["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
        1,
        "--recompute-method and --recompute-num-layers",
    ),
    (MOCK + ["--lr", "1e-4", "--min-lr", "1e-3"], 1, "--min-lr"),
    (MOCK + ["--lr-warmup-iters", "5", "--lr-decay-iters", "3"], 1, "--lr-warmup-iters 5"),
    (MOCK + ["--split", "a,b"], 1, "--split"),
    (MOCK + ["--async-save"], 1, "--async-save needs --save"),
    (MOCK + ["--finetune"], 1, "--finetune needs --load"),
    (MOCK + ["--exit-interval", "0"], 1, "--exit-interval"),
    (MOCK + ["--seq-length", "0"], 1, "--seq-length must be >= 1, not 0"),
    (MOCK + ["--adam-beta1", "2"], 1, "--adam-beta1 must be in [0, 1), not 2.0"),
    # (before: trained, and the padded vocabulary rows stepped to NaN at the first step)
    (MOCK + ["--adam-eps", "0"], 1, "--adam-eps 0: Adam divides each step by sqrt(v) + eps"),
    (MOCK + ["--lr", "inf"], 1, "argument --lr: give a finite number, not inf"),
    (MOCK + ["--moe-expert-capacity-factor", "nan"], 1, "give a finite number, not nan"),
    (MOCK + ["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes must be"),
    (MOCK + ["--no-such-flag"], 1, "--no-such-flag"),
    (MOCK + ["--position-embedding-type", "alibi"], 1, "--position-embedding-type"),
    (["--vocab-size", "128"], 1, "--data-path"),
    (MOCK + ["--tokenizer-type", "SentencePieceTokenizer"], 1, "needs --tokenizer-model"),
    (
        MOCK
        + [
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            "/no/such/tokenizer.model",
        ],
        1,
        "--tokenizer-model /no/such/tokenizer.model",
    ),
    (
        MOCK + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/no/such/dir"],
        1,
        "--tokenizer-model /no/such/dir",
    ),
    (MOCK + ["--tokenizer-type", "GPT2BPETokenizer"], 1, "--vocab-file"),
    (MOCK + ["--load", "/no/such/checkpoints"], 1, "--load /no/such/checkpoints"),
    # a dense model builds the experts' grid too: it must split the ranks of a stage
    (
        MOCK + ["--expert-tensor-parallel-size", "3"],
        1,
        "--expert-tensor-parallel-size 3 must divide TP x CP x DP = 1",
    ),
    (
        MOCK + ["--distributed-timeout-minutes", "1e9"],
        1,
        "--distributed-timeout-minutes must be positive and at most 1e+08 minutes, not 1e+09",
    ),
    (MOCK + ["--wandb-project", "team/run"], 1, "--wandb-project 'team/run': a Weights & Biases"),
    (MOCK + ["--fp8-format", "hybrid", "--fp8-margin", "1000"], 1, "--fp8-margin 1000: give 0"),
    (MOCK + ["--step-batch-size-schedule", "0:4 inf:8"], 1, "'inf:8' is not THRESHOLD:SIZE"),
    (
        MOCK + ["--num-experts", "4", "--init-method-xavier-uniform"],
        1,
        "--init-method-xavier-uniform draws matrices, and a mixture's router bias",
    ),
    (["--data-path", "0.5", "/some/corpus", "0.5"], 1, "--data-path"),
    (["--data-path", "nan", "/some/corpus"], 1, "--data-path: blending weights must be finite"),
    # prefixes without weights are Megatron-LM's blend by size (before: refused as malformed)
    (["--data-path", "/no/a", "/no/b"], 1, "--data-path /no/a: /no/a.bin does not exist"),
]


def _run(argv: list[str], world_size: int = 1) -> tuple[subprocess.CompletedProcess, float]:
    environment = dict(os.environ)
    if world_size > 1:  # parse_args reads it; no process group is started before the error
        environment["WORLD_SIZE"] = str(world_size)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=environment,
    )
    return result, time.monotonic() - start


def _assert_refused(result: subprocess.CompletedProcess, seconds: float, expected: str) -> None:
    assert result.returncode == 2, (expected, result.stdout[-1000:], result.stderr[-2000:])
    last = result.stderr.strip().splitlines()[-1]
    assert expected in last, (expected, result.stderr[-2000:])
    assert seconds < 5, f"{expected}: {seconds:.1f} s"


def test_at_least_25_distinct_config_mistakes_are_refused_fast():
    assert len(CONFIGS) >= 25
    for extra, world_size, expected in CONFIGS:
        _assert_refused(*_run(BASE + extra, world_size), expected)


def test_a_broken_checkpoint_tracker_is_refused(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("oops\n")
    _assert_refused(
        *_run(BASE + MOCK + ["--load", str(tmp_path)]),
        "latest_checkpointed_iteration.txt holds 'oops'",
    )


def test_exit_on_missing_checkpoint_refuses_an_empty_load(tmp_path):
    """Megatron-LM's --exit-on-missing-checkpoint: a --load with nothing in it (a typo, a
    lost mount) stops the run instead of training from scratch, even as its own --save."""
    flags = ["--exit-on-missing-checkpoint", "--save", str(tmp_path / "run")]
    for load in (tmp_path, tmp_path / "run"):
        _assert_refused(
            *_run(BASE + MOCK + ["--load", str(load), *flags]),
            f"--load {load}: holds no checkpoint, and --exit-on-missing-checkpoint is on",
        )


def test_a_vocabulary_below_the_tokenizer_is_refused(shakespeare_data):
    _assert_refused(
        *_run(
            BASE
            + [
                "--data-path",
                shakespeare_data["DATA_PATH"],
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                shakespeare_data["TOKENIZER_MODEL"],
                "--vocab-size",
                "500",
            ]
        ),
        "--vocab-size 500 is smaller than the tokenizer's vocabulary (1024)",
    )


def test_tokenizer_files_their_library_cannot_read_are_refused(tmp_path):
    """(before: sentencepiece's RuntimeError or the tokenizers library's bare Exception)"""
    garbage = tmp_path / "tokenizer.model"
    garbage.write_bytes(bytes(range(256)) * 4)
    _assert_refused(
        *_run(
            BASE
            + MOCK
            + ["--tokenizer-type", "SentencePieceTokenizer"]
            + ["--tokenizer-model", str(garbage)]
        ),
        f"--tokenizer-model {garbage}: not a readable sentencepiece model (INTERNAL: could not "
        f"parse ModelProto from {garbage})",
    )
    files = ["--vocab-file", str(garbage), "--merge-file", str(garbage)]
    _assert_refused(
        *_run(BASE + MOCK + ["--tokenizer-type", "GPT2BPETokenizer", *files]),
        f"--vocab-file {garbage} / --merge-file {garbage}: not a readable GPT-2 BPE (Error "
        "while reading BPE files: ",
    )


def test_an_output_under_a_file_is_refused(tmp_path):
    """(before: a NotADirectoryError after start-up, or at the first rerun's report)"""
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a directory must be\n")
    for flag, path, more in (
        ("--tensorboard-dir", f"{blocked}/tensorboard", []),
        (
            "--result-rejected-tracker-filename",
            f"{blocked}/rejected.txt",
            ["--rerun-mode", "validate_results"],
        ),
    ):
        _assert_refused(
            *_run(BASE + MOCK + more + [flag, path]),
            f"{flag} {path}: cannot write there ({blocked} is a file)",
        )


@pytest.fixture(scope="module")
def good_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    write_corpus(str(root / "a"), 50, seed=1)
    return str(root)


def _damaged(corpus: str, tmp_path, kind: str) -> str:
    """A copy of the good corpus at a new prefix, damaged as `kind` says."""
    prefix = str(tmp_path / kind)
    if kind == "missing":
        return prefix
    if kind == "empty":
        write_corpus(prefix, 0, seed=1)
        return prefix
    if kind == "vocabulary":  # ids up to VOCAB - 1, for a model of VOCAB - 1
        write_corpus(prefix, 50, seed=3, low=VOCAB - 2)
        return prefix
    shutil.copyfile(f"{corpus}/a.bin", prefix + ".bin")
    if kind == "missing-idx":
        return prefix
    shutil.copyfile(f"{corpus}/a.idx", prefix + ".idx")
    with open(prefix + ".idx", "r+b") as f:
        if kind == "bad-magic":
            f.write(b"NOTANIDX!")
        elif kind == "bad-version":
            f.seek(9)
            f.write((7).to_bytes(8, "little"))
        elif kind == "bad-dtype":
            f.seek(17)
            f.write(bytes([42]))
        elif kind == "truncated-idx":
            f.truncate(40)
    if kind == "truncated":
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(os.path.getsize(prefix + ".bin") // 2)
    return prefix


DATA_FILES = [
    ("missing", ".bin does not exist"),
    ("missing-idx", ".idx does not exist"),
    ("bad-magic", "bad magic"),
    ("bad-version", "index version 7"),
    ("bad-dtype", "dtype code 42"),
    ("truncated", ".bin is truncated"),
    ("truncated-idx", ".idx is truncated"),
    ("empty", "holds no documents"),
    ("vocabulary", "outside the model's vocabulary"),
]


def test_bad_data_files_are_refused_naming_the_file(good_corpus, tmp_path):
    assert len(DATA_FILES) >= 5
    for kind, expected in DATA_FILES:
        prefix = _damaged(good_corpus, tmp_path, kind)
        vocab = VOCAB - 1 if kind == "vocabulary" else VOCAB
        result, seconds = _run(BASE + ["--data-path", prefix, "--vocab-size", str(vocab)])
        _assert_refused(result, seconds, expected)
        assert f"--data-path {prefix}" in result.stderr


def test_under_torchrun_a_refusal_is_printed_once():
    # Local rank 1 says nothing (and waits for local rank 0 to say it) ...
    env = {**os.environ, "LOCAL_RANK": "1"}
    argv = [sys.executable, "pretrain_gpt.py", *BASE, *MOCK, "--num-layer", "2"]
    silent = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert silent.returncode == 2 and silent.stderr == ""
    # ... so torchrun's output holds the line once.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", "0", "pretrain_gpt.py", *BASE, *MOCK, "--num-layer", "2"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = (result.stdout + result.stderr).splitlines()
    assert [line for line in lines if "did you mean --num-layers?" in line] == [
        "pretrain_gpt.py: error: unrecognized arguments: --num-layer 2; did you mean "
        "--num-layers? (--help lists every flag)"
    ]


# After start-up ranks can meet different refusals (a file one node lacks): each is said once,
# by the first rank to meet it, a rank other than 0 naming itself.
_RANKS_APART = """
import sys

import torch.distributed as dist

from threefold.parallel import state
from threefold.parallel.refusal import print_refusal_once

state.initialize_distributed("gloo")
rank = dist.get_rank()
print_refusal_once("job.py", "--data-path corpus: every rank meets this", rank)
dist.barrier()
if rank == 2:
    print_refusal_once("job.py", "--load ckpt: a shard only rank 2 reads is damaged", rank)
    sys.exit(2)
dist.barrier()  # the others wait for rank 2, as a job's collectives would, until stopped
"""


def test_under_torchrun_a_refusal_met_after_start_up_is_printed_once_by_whichever_rank_met_it(
    tmp_path,
):
    script = tmp_path / "job.py"
    script.write_text(_RANKS_APART)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "3", str(script)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = (result.stdout + result.stderr).splitlines()
    assert [line for line in lines if line.startswith("job.py:")] == [
        "job.py: error: --data-path corpus: every rank meets this",
        "job.py: error on rank 2: --load ckpt: a shard only rank 2 reads is damaged",
    ]


_EVERY_RANK = """
import sys

from threefold.parallel import state
from threefold.parallel.refusal import print_refusal_once

state.initialize_distributed("gloo")
print_refusal_once("job.py", "--profile: every rank meets this", int(sys.argv[1]))
sys.exit(2)
"""


def test_launched_without_torchrun_a_refusal_every_rank_meets_is_one_line(tmp_path):
    """srun-style: each rank its own process, rank 0's hosting the store. (before: rank 0
    exited with the store, and rank 1's claim failed, torch printing the socket's C++ stack,
    and said the line again as its own)"""
    from tests.distributed import free_port, worker_environment

    script = tmp_path / "job.py"
    script.write_text(_EVERY_RANK)
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT, **worker_environment(rank, 2, port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2]
    assert outputs == ["job.py: error: --profile: every rank meets this\n", ""], outputs
